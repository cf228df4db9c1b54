/**
 * Applies the committed drizzle-kit migrations, then builds what they leave to be built online.
 * Serialised by an advisory lock, so several coordinators starting at once on one database apply
 * each migration exactly once. The lock is waited for by trying it (`pg_try_advisory_lock`, one
 * short statement at a time), never by a blocked `pg_advisory_lock`: the holder's
 * `CREATE INDEX CONCURRENTLY` waits for every transaction older than its own to end, a statement
 * blocked on the lock included, and PostgreSQL would end that wait as a deadlock (40P01).
 *
 * A database migrated by a newer release (a migration dated after the last this release knows)
 * is refused with `NewerSchemaError`, unless `allowNewerSchema` says the rollback is deliberate.
 * A database whose `schema_compat.min_reader` is above this release's reader level (a newer
 * release applied a migration that breaks this one: schema-compat.ts) is refused whatever
 * `allowNewerSchema` says. After applying migrations, `min_reader` is raised to what they need,
 * which stops the older coordinators still running (NOTIFY `leasehold_schema`).
 */
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { setTimeout as delay } from 'node:timers/promises';
import { fileURLToPath } from 'node:url';
import { readMigrationFiles } from 'drizzle-orm/migrator';
import type pg from 'pg';
import type { Logger } from '../log.js';
import { endedCountsReconcile, endedCutoff, jobCountsReconcile } from './counts.js';
import { DatabaseSettingError } from './database.js';
import { daysEnsure } from './days.js';
import { compatInfo, schemaCompatRaise, schemaTooNewMessage, type CompatInfo } from './schema-compat.js';

/** The folder drizzle-kit writes to (`server/store/migrations`). */
export const migrationsFolder = path.join(path.dirname(fileURLToPath(import.meta.url)), 'migrations');

// An arbitrary constant: the advisory lock key of "leasehold migrations".
const MIGRATION_LOCK = 7_140_356_001;

/** What `migrateDatabase` is told besides the pool. */
export interface MigrateOptions {
  /** Where the wait for another coordinator's migrations, and a newer schema allowed, are logged. */
  log?: Logger;
  /**
   * Run against a database migrated by a newer release (`LEASEHOLD_ALLOW_NEWER_SCHEMA=1`): a
   * deliberate rollback. No migration is applied (none is newer than the database's); a warning
   * is logged and the rest (the indexes built online, the fill-ins, the day partitions) runs as
   * ever. It does not let this release run on a database whose `min_reader` is above its reader
   * level (a newer migration that breaks it): that is refused whatever this says.
   */
  allowNewerSchema?: boolean;
  /** How often a wait for the migration lock is logged (default 10 s). */
  waitLogEveryMs?: number;
  /** The migrations to apply, with their journal and marks (default `migrationsFolder`; tests give a newer release's). */
  migrationsFolder?: string;
}

/**
 * The database holds migrations this release does not know (a newer release migrated it), or
 * needs a reader of a higher level than this release (schema-compat.ts).
 */
export class NewerSchemaError extends Error {
  override readonly name = 'NewerSchemaError';
}

/** The first and the longest pause between two tries of the migration lock. */
const TRY_FIRST_MS = 25;
const TRY_MAX_MS = 1_000;

/**
 * Brings the schema up to date; returns the number of migrations applied. Throws
 * `NewerSchemaError` when the database is ahead of this release (see `allowNewerSchema`).
 */
export async function migrateDatabase(pool: pg.Pool, opts: MigrateOptions = {}): Promise<number> {
  const folder = opts.migrationsFolder ?? migrationsFolder;
  const compat = compatInfo(folder);
  const client = await pool.connect();
  let locked = false;
  let broken: Error | undefined;
  try {
    // A statement_timeout set on the role or the database (a DBA's guard for applications) would
    // cut a migration, or an index built online over a large history, at every start: the
    // migrations run without one, and the connection gets the role's back before it is pooled.
    // (Sent with the lock's first try: a start far from its database pays each round trip.)
    await migrationLockTake(client, opts, 'SET statement_timeout = 0');
    locked = true;
    const state = await schemaState(client, migrationLast(folder).when);
    readerLevelCheck(state, compat);
    newerSchemaCheck(state, folder, opts);
    const applied = await applyMigrations(client, folder);
    // (The table exists once 0021 has run: always, but for a test's journal cut before it. Looked
    // for again only when migrations ran where it was missing.)
    if (state.compatKept || (applied > 0 && (await compatKept(client)))) {
      const { raised, minReader } = await schemaCompatRaise(client, compat.minReader);
      if (raised !== undefined) opts.log?.info({ minReader: raised }, 'schema level raised: coordinators of a lower reader level stop');
      opts.log?.info(
        { readerLevel: compat.readerLevel, minReader },
        `schema level: this release reads up to ${compat.readerLevel}, the database needs ${minReader} or more`,
      );
    }
    await buildOnline(client);
    await fillInOnline(client);
    // The partitions of today and the next days, for the successes to move to (days.ts).
    await daysEnsure(client);
    return applied;
  } catch (err) {
    broken = err as Error;
    throw (await privilegeProblem(client, err as Error)) ?? err;
  } finally {
    // The unlock and the reset in one round trip when all went well.
    const reset = broken ? undefined : 'RESET statement_timeout';
    if (locked) {
      await client.query(reset ? `SELECT pg_advisory_unlock(${MIGRATION_LOCK}); ${reset}` : `SELECT pg_advisory_unlock(${MIGRATION_LOCK})`).catch((err: Error) => {
        broken ??= err;
      });
    } else if (reset) {
      await client.query(reset).catch((err: Error) => (broken = err));
    }
    // After a failure (or an unlock that failed: the session may still hold the lock), the
    // connection is closed rather than pooled.
    client.release(broken);
  }
}

/**
 * A migration refused for want of a privilege (SQLSTATE 42501: a role that does not own the
 * database, e.g. one given only table grants, or a new database on PostgreSQL 15+ where `public`
 * is its owner's), as one line naming the role, the database and the fix, exit code 2: a restart
 * cannot help. `applyMigrations` says which step failed (`MigrationStepError`).
 */
async function privilegeProblem(client: pg.PoolClient, err: Error): Promise<DatabaseSettingError | undefined> {
  const cause = (err as { cause?: { code?: string; message?: string } }).cause;
  const code = (err as { code?: string }).code ?? cause?.code;
  if (code !== '42501') return undefined;
  const step = err instanceof MigrationStepError ? err.step : undefined;
  const who = await client
    .query<{ role: string; db: string; fix: string }>(
      `SELECT current_user AS role, current_database() AS db, format('ALTER DATABASE %I OWNER TO %I', current_database(), current_user) AS fix`,
    )
    .then((r) => r.rows[0])
    .catch(() => undefined);
  const reason = cause?.message ?? err.message;
  return new DatabaseSettingError(
    `the migrations cannot run as role ${who ? `"${who.role}" on database "${who.db}"` : 'of DATABASE_URL'}: ${reason}` +
      (step ? ` (in ${step})` : '') +
      `. The coordinator's role must own its database${who ? ` (${who.fix})` : ''} and the tables the migrations made in it ` +
      `(after another role ran them: REASSIGN OWNED BY that_role TO ${who ? who.role : 'this_role'}), as an admin runs it (docs/deploy.md, "A managed PostgreSQL")`,
    { cause: err },
  );
}

/** A step of `applyMigrations` failed: `step` says which (a migration's tag, or the journal table's setup); `code`, PostgreSQL's SQLSTATE. */
export class MigrationStepError extends Error {
  override readonly name = 'MigrationStepError';
  readonly code: string | undefined;
  constructor(
    readonly step: string,
    cause: Error & { code?: string },
  ) {
    super(`${step} failed: ${cause.message}`, { cause });
    this.code = cause.code;
  }
}

/** Where drizzle keeps which migrations a database has (its migrator's defaults, kept). */
const JOURNAL_TABLE = '"drizzle"."__drizzle_migrations"';

/**
 * drizzle's migrator (`drizzle-orm/node-postgres/migrator`), in fewer round trips: it sends each
 * statement of each migration on its own (about 160 on a new database, 5 on an up-to-date one),
 * which a database 60 ms away turned into an 18 s first start. This does what it does, in the
 * same order and with the same bookkeeping, so either can follow the other on one database:
 * the journal table made if missing, the newest `created_at` read, and every migration dated
 * after it applied, its statements then its row (`hash`, `created_at`), all in one transaction.
 * One round trip to read the journal table, and one per migration to apply (the statements of a
 * migration sent together), between a BEGIN and a COMMIT. A failure rolls everything back and
 * names the migration. Returns how many were applied.
 */
export async function applyMigrations(client: pg.ClientBase, folder: string): Promise<number> {
  const migrations = readMigrationFiles({ migrationsFolder: folder });
  const tags = journalEntries(folder).map((e) => e.tag);
  const read = (await client
    .query(
      `CREATE SCHEMA IF NOT EXISTS "drizzle";
       CREATE TABLE IF NOT EXISTS ${JOURNAL_TABLE} (id SERIAL PRIMARY KEY, hash text NOT NULL, created_at bigint);
       SELECT created_at FROM ${JOURNAL_TABLE} ORDER BY created_at DESC LIMIT 1`,
    )
    .catch((err: Error) => {
      throw new MigrationStepError(`drizzle's journal table setup: CREATE SCHEMA IF NOT EXISTS "drizzle"; CREATE TABLE IF NOT EXISTS ${JOURNAL_TABLE}`, err);
    })) as unknown as pg.QueryResult<{ created_at: string }>[];
  const last = read.at(-1)?.rows[0]?.created_at;
  const pending = migrations.map((m, i) => ({ ...m, tag: tags[i] ?? `#${i + 1}` })).filter((m) => last === undefined || Number(last) < m.folderMillis);
  if (!pending.length) return 0;
  // The hash is sha256 hex and the date an integer (readMigrationFiles): safe as literals, which a
  // query of several statements needs (it takes no parameters).
  const odd = pending.find((m) => !/^[0-9a-f]{64}$/.test(m.hash) || !Number.isSafeInteger(m.folderMillis));
  if (odd) throw new Error(`migration ${odd.tag}: unexpected hash or date in the journal`);
  await client.query('BEGIN');
  for (const m of pending) {
    // Each statement ends on a line of its own: a statement ending in a -- comment keeps its ";".
    const text = [...m.sql, `INSERT INTO ${JOURNAL_TABLE} ("hash", "created_at") VALUES ('${m.hash}', ${m.folderMillis})`].join('\n;\n');
    try {
      await client.query(text);
    } catch (err) {
      await client.query('ROLLBACK').catch(() => undefined);
      throw new MigrationStepError(`migration ${m.tag}`, err as Error);
    }
  }
  await client.query('COMMIT');
  return pending.length;
}

/**
 * Takes the migration lock, trying it with pauses that grow to 1 s (jittered), and holding
 * nothing between tries; every `waitLogEveryMs` of waiting it logs who holds it and what that
 * session is running (a long `CREATE INDEX CONCURRENTLY`, a batch of `fillInOnline`).
 */
async function migrationLockTake(client: pg.PoolClient, opts: MigrateOptions, before: string): Promise<void> {
  const every = opts.waitLogEveryMs ?? 10_000;
  const started = performance.now();
  let nextLog = started + every;
  let pause = TRY_FIRST_MS;
  let told = false;
  let got = await migrationLockTry(client, before);
  for (;;) {
    if (got) {
      if (told) opts.log?.info({ waitedMs: Math.round(performance.now() - started) }, 'migration lock taken');
      return;
    }
    if (opts.log && performance.now() >= nextLog) {
      nextLog = performance.now() + every;
      told = true;
      const holder = await client.query<{ pid: number; application: string; state: string; running: string; since: Date }>(
        `SELECT a.pid, a.application_name AS application, a.state, left(a.query, 200) AS running, a.query_start AS since
           FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
          WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
            AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
            AND ((l.classid::int8 << 32) | l.objid::int8) = $1`,
        [MIGRATION_LOCK],
      );
      opts.log.info(
        { waitedMs: Math.round(performance.now() - started), holder: holder.rows[0] },
        'waiting for the migrations of another coordinator (the migration lock is held)',
      );
    }
    await delay(pause * (0.5 + Math.random() / 2));
    pause = Math.min(TRY_MAX_MS, pause * 2);
    got = await migrationLockTry(client);
  }
}

/**
 * One try of the migration lock, after `before` in the same round trip when given (the first
 * try carries the timeout's SET). The simple protocol, the lock's key written in: it alone sends
 * several statements at once, and answers with one result for each.
 */
async function migrationLockTry(client: pg.PoolClient, before?: string): Promise<boolean> {
  type Got = pg.QueryResult<{ got: boolean }>;
  const r = (await client.query(`${before ? `${before}; ` : ''}SELECT pg_try_advisory_lock(${MIGRATION_LOCK}) AS got`)) as unknown as Got | Got[];
  const last = Array.isArray(r) ? r.at(-1) : r;
  return last?.rows[0]?.got === true;
}

/** What the checks before the migrations read (`schemaState`). */
interface SchemaState {
  /** `schema_compat` exists (0021 ran), and its `min_reader` (undefined without a row). */
  compatKept: boolean;
  minReader: number | undefined;
  /** drizzle's journal table exists, and what it holds dated after this release's last migration. */
  journalKept: boolean;
  newer: { n: number; newest: number | string | null; hash: string | null };
}

/**
 * What the checks before the migrations need, in two round trips (one on a new database): which
 * of the two tables exist, then what they hold. A table that is not there cannot be named in
 * the statement that reads the others, hence the first.
 */
async function schemaState(client: pg.PoolClient, knownWhen: number): Promise<SchemaState> {
  const kept = await client.query<{ compat: boolean; journal: boolean }>(
    `SELECT to_regclass('schema_compat') IS NOT NULL AS compat, to_regclass('drizzle.__drizzle_migrations') IS NOT NULL AS journal`,
  );
  const compatKept = kept.rows[0]?.compat === true;
  const journalKept = kept.rows[0]?.journal === true;
  const state: SchemaState = { compatKept, minReader: undefined, journalKept, newer: { n: 0, newest: null, hash: null } };
  if (!compatKept && !journalKept) return state;
  // (count and max come back as numbers where database.ts's parser of int8 is set, else as text.)
  const { rows } = await client.query<{ min_reader: number | null; n: number | string | null; newest: number | string | null; hash: string | null }>(
    `SELECT ${compatKept ? '(SELECT min_reader FROM schema_compat)' : 'NULL::int'} AS min_reader, ${
      journalKept
        ? `n.n, n.newest, n.hash FROM (
             SELECT count(*) AS n, max(created_at) AS newest, (array_agg(hash ORDER BY created_at DESC))[1] AS hash
               FROM drizzle.__drizzle_migrations WHERE created_at > $1
           ) n`
        : 'NULL::bigint AS n, NULL::text AS newest, NULL::text AS hash'
    }`,
    journalKept ? [knownWhen] : [],
  );
  const r = rows[0];
  state.minReader = r?.min_reader ?? undefined;
  state.newer = { n: Number(r?.n ?? 0), newest: r?.newest ?? null, hash: r?.hash ?? null };
  return state;
}

/**
 * Refuses a database that needs a reader of a higher level than this release (its
 * `schema_compat.min_reader`: a newer release applied a migration this one cannot run beside).
 * No setting overrides it. A database without the table (new, or from before 0021) passes.
 */
function readerLevelCheck(state: SchemaState, compat: CompatInfo): void {
  const { minReader } = state;
  if (minReader !== undefined && minReader > compat.readerLevel) throw new NewerSchemaError(schemaTooNewMessage(minReader, compat.readerLevel));
}

async function compatKept(client: pg.PoolClient): Promise<boolean> {
  const kept = await client.query<{ yes: boolean }>(`SELECT to_regclass('schema_compat') IS NOT NULL AS yes`);
  return kept.rows[0]?.yes === true;
}

/** The migrations of a journal (`meta/_journal.json`), in order. */
function journalEntries(folder: string): Array<{ tag: string; when: number }> {
  return (JSON.parse(readFileSync(path.join(folder, 'meta/_journal.json'), 'utf8')) as { entries: Array<{ tag: string; when: number }> }).entries;
}

/** The last migration of a journal. */
function migrationLast(folder: string): { tag: string; when: number } {
  const last = journalEntries(folder).at(-1);
  if (!last) throw new Error(`no migration in ${path.join(folder, 'meta/_journal.json')}`);
  return last;
}

/**
 * Refuses a database that holds a migration dated after this release's last one. Dates, not
 * hashes: drizzle orders and applies migrations by date (the journal's `when`, kept as
 * `created_at`) and hashes the file's text, which a release may reword (0012 and 0014 were, once
 * applied), so a hash unknown here is no sign of a newer release; a later date is one.
 */
function newerSchemaCheck(state: SchemaState, folder: string, opts: MigrateOptions): void {
  const known = migrationLast(folder);
  if (!state.journalKept) return; // a new database
  const { n, newest, hash } = state.newer;
  if (n === 0) return;
  const when = (ms: number) => new Date(ms).toISOString();
  const ahead =
    `the database was migrated by a newer release: it has ${n} migration${n === 1 ? '' : 's'} this release does not know, ` +
    `the newest dated ${when(Number(newest))} (hash ${String(hash).slice(0, 12)}); ` +
    `the newest this release knows is ${known.tag} (dated ${when(known.when)})`;
  if (!opts.allowNewerSchema) {
    throw new NewerSchemaError(
      `${ahead}. Start the newer release instead, or, to run this one on it deliberately (a rollback the newer ` +
        `migrations allow: see "Rolling back" in docs/deploy.md), set LEASEHOLD_ALLOW_NEWER_SCHEMA=1`,
    );
  }
  opts.log?.warn({ unknownMigrations: n }, `${ahead}; running on it as LEASEHOLD_ALLOW_NEWER_SCHEMA=1 says`);
}

/**
 * Indexes of schema.ts that a migration does not build: a migration runs in a transaction, where
 * CREATE INDEX stops every write to the table while it reads it (seconds to minutes with a week
 * of history). These are built CONCURRENTLY here instead, under the migration lock, by whichever
 * coordinator starts first with them missing; the coordinators already running keep serving
 * meanwhile (the lists that use them are slower until they exist), and one starting meanwhile
 * waits for the lock, saying so every 10 s. Under the lock, not after it: two concurrent builds
 * of partial indexes each wait for the other's transaction to end (PostgreSQL exempts only plain
 * column indexes from that wait), which PostgreSQL ends as a deadlock, and a replica finding an
 * invalid index could not tell a build in progress from one cut short. A build cut short (a
 * crash) leaves an invalid index, which is dropped and built again.
 */
export const ONLINE_INDEXES: ReadonlyArray<{ name: string; sql: string }> = [
  {
    name: 'jobs_finished_queue_idx',
    sql: `CREATE INDEX CONCURRENTLY "jobs_finished_queue_idx" ON "jobs_live" USING btree ("queue", "created_at" DESC NULLS LAST, "id" DESC NULLS LAST) WHERE "finished_at" IS NOT NULL`,
  },
  {
    name: 'jobs_unsucceeded_idx',
    sql: `CREATE INDEX CONCURRENTLY "jobs_unsucceeded_idx" ON "jobs_live" USING btree ("created_at" DESC NULLS LAST, "id" DESC NULLS LAST) WHERE "finished_at" IS NOT NULL AND "result" IS NULL`,
  },
  {
    name: 'attempts_created_missing_idx',
    sql: `CREATE INDEX CONCURRENTLY "attempts_created_missing_idx" ON "attempts" USING btree ("id") WHERE "job_created_at" IS NULL`,
  },
  {
    name: 'jobs_final_attempt_uq',
    sql: `CREATE UNIQUE INDEX CONCURRENTLY "jobs_final_attempt_uq" ON "jobs_live" USING btree ("final_attempt_id") WHERE "final_attempt_id" IS NOT NULL`,
  },
  {
    name: 'jobs_final_agent_idx',
    sql: `CREATE INDEX CONCURRENTLY "jobs_final_agent_idx" ON "jobs_live" USING btree ("final_agent_id", "created_at" DESC NULLS LAST, "id" DESC NULLS LAST) WHERE "final_attempt_id" IS NOT NULL`,
  },
  {
    name: 'attempts_agent_idx',
    sql: `CREATE INDEX CONCURRENTLY "attempts_agent_idx" ON "attempts" USING btree ("agent_id", "job_created_at" DESC NULLS LAST, "job_id" DESC NULLS LAST)`,
  },
];

async function buildOnline(client: pg.PoolClient): Promise<void> {
  // Which exist and are valid, in one round trip (a start far from its database pays each).
  const { rows } = await client.query<{ name: string; valid: boolean | null }>(
    'SELECT n.name, i.indisvalid AS valid FROM unnest($1::text[]) AS n(name) LEFT JOIN pg_index i ON i.indexrelid = to_regclass(quote_ident(n.name))',
    [ONLINE_INDEXES.map((ix) => ix.name)],
  );
  const state = new Map(rows.map((r) => [r.name, r.valid]));
  for (const ix of ONLINE_INDEXES) {
    const valid = state.get(ix.name);
    if (valid) continue;
    if (valid === false) await client.query(`DROP INDEX CONCURRENTLY "${ix.name}"`);
    await client.query(ix.sql);
  }
}

/** Attempts given their job's creation time per statement (each its own transaction). */
const FILL_BATCH = 10_000;

/**
 * What migrations 0012, 0014 and 0016 leave to be filled in, done here after them and outside
 * their transaction (which would hold the altered tables' locks throughout), so the coordinators
 * already running keep working: the kept job counts, when there are none yet (one scan of the
 * finished jobs, in one statement); the per-minute counts of the last day likewise (a scan of
 * the day's attempts; the count keeper's first run would do it too, 5 s later); and the creation
 * time of the attempts ended before 0014 (or since, by an older coordinator), in batches of
 * 10,000 in id order through the partial index that holds exactly those. An attempt whose job is
 * gone keeps NULL (the purge takes both).
 */
async function fillInOnline(client: pg.PoolClient): Promise<void> {
  // What is to be done, in one round trip (each EXISTS stops at its first row; the attempts'
  // question reads attempts_created_missing_idx, built by buildOnline before this).
  const { rows } = await client.query<{ counts: boolean; minutes: boolean; created: boolean }>(
    `SELECT NOT EXISTS (SELECT 1 FROM job_counts) AND EXISTS (SELECT 1 FROM jobs WHERE finished_at IS NOT NULL) AS counts,
            NOT EXISTS (SELECT 1 FROM ended_counts) AND EXISTS (SELECT 1 FROM attempt_log WHERE ended_at >= ${endedCutoff}) AS minutes,
            EXISTS (SELECT 1 FROM attempts WHERE job_created_at IS NULL) AS created`,
  );
  if (rows[0]?.counts) await jobCountsReconcile(client);
  // The per-minute counts of the last day (migration 0016), when none are kept yet.
  if (rows[0]?.minutes) await endedCountsReconcile(client);
  if (!rows[0]?.created) return;
  let after = '00000000-0000-0000-0000-000000000000';
  for (;;) {
    const batch = await client.query<{ last: string | null }>(
      `WITH b AS (
         SELECT id FROM attempts WHERE job_created_at IS NULL AND id > $1 ORDER BY id LIMIT $2
       ), u AS (
         UPDATE attempts a SET job_created_at = j.created_at FROM b, jobs j WHERE a.id = b.id AND j.id = a.job_id
       )
       SELECT max(id::text) AS last FROM b`,
      [after, FILL_BATCH],
    );
    const last = batch.rows[0]?.last;
    if (!last) return;
    after = last;
  }
}
