/**
 * `migrateDatabase` with several coordinators on one database: replicas starting together on a
 * fresh database all migrate (none fails on a deadlock between the migration lock and the
 * indexes built CONCURRENTLY), a replica starting while another holds the lock waits and says so,
 * and a database migrated by a newer release is refused, at `serve` and `migrate`, unless
 * `LEASEHOLD_ALLOW_NEWER_SCHEMA=1` says the rollback is deliberate.
 */
import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { EventEmitter } from 'node:events';
import { Writable } from 'node:stream';
import pg from 'pg';
import pino from 'pino';
import { afterEach, describe, expect, inject, it } from 'vitest';
import { migrateDatabase, migrationsFolder, ONLINE_INDEXES } from '../server/store/migrate.js';
import { within } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { quietPool } from './helpers/quiet-pool.js';
import { withDatabase } from './helpers/global-setup.js';
import { killAll, serve } from './helpers/serve.js';

const t = useTestDb();
// Read here, not imported, so that this file runs against the migrate.ts of before the fixes too.
const MIGRATION_LOCK = 7_140_356_001;
const migrationLast = () => {
  const journal = JSON.parse(readFileSync(path.join(migrationsFolder, 'meta/_journal.json'), 'utf8')) as { entries: Array<{ tag: string; when: number }> };
  return journal.entries.at(-1)!;
};
afterEach(() => killAll());

/** A logger whose lines are kept, each also emitted as 'line'. */
function capture() {
  const lines: Array<Record<string, unknown>> = [];
  const events = new EventEmitter();
  const stream = new Writable({
    write(chunk: Buffer, _enc, done) {
      const l = JSON.parse(chunk.toString()) as Record<string, unknown>;
      lines.push(l);
      events.emit('line', l);
      done();
    },
  });
  /** Resolves with the next line whose msg matches. */
  const next = (re: RegExp) =>
    new Promise<Record<string, unknown>>((resolve) => {
      const on = (l: Record<string, unknown>) => {
        if (!re.test(String(l.msg))) return;
        events.off('line', on);
        resolve(l);
      };
      events.on('line', on);
    });
  return { log: pino({ level: 'info' }, stream), lines, next };
}

/** The catalog a complete migration leaves (the day partitions aside: they are named by date). */
async function schemaOf(db: pg.Pool | pg.Client) {
  const rel = await db.query(
    `SELECT n.nspname, c.relname, c.relkind::text, i.indisvalid
       FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace LEFT JOIN pg_index i ON i.indexrelid = c.oid
      WHERE n.nspname IN ('public', 'drizzle') AND NOT c.relispartition ORDER BY 1, 2`,
  );
  const fns = await db.query(`SELECT proname FROM pg_proc WHERE pronamespace = 'public'::regnamespace ORDER BY 1`);
  const migrations = await db.query(`SELECT hash, created_at::text FROM drizzle.__drizzle_migrations ORDER BY id`);
  const days = await db.query(`SELECT count(*)::int AS n FROM pg_inherits WHERE inhparent = 'jobs'::regclass`);
  return { relations: rel.rows, functions: fns.rows, migrations: migrations.rows, partitions: days.rows[0].n > 1 };
}

describe('replicas starting together', () => {
  it('three coordinators migrating a fresh database at once all succeed, round after round, and the schema is complete', async () => {
    const admin = new pg.Client({ connectionString: inject('pgAdminUrl') });
    await admin.connect();
    // The template's schema, read and the connection closed at once: other test files create
    // their databases from the template meanwhile, which PostgreSQL refuses (after 5 s) while a
    // session is connected to it.
    const template = new pg.Client({ connectionString: withDatabase(inject('pgAdminUrl'), inject('pgTemplate')) });
    await template.connect();
    const expected = await schemaOf(template).finally(() => template.end());
    try {
      expect(expected.migrations.at(-1)).toMatchObject({ created_at: String(migrationLast().when) });
      for (let round = 1; round <= 3; round++) {
        const name = `${inject('pgPrefix')}race_${randomBytes(4).toString('hex')}`;
        await admin.query(`CREATE DATABASE ${name}`);
        // A pool per replica, as each coordinator process has its own.
        const pools = [0, 1, 2].map(() => quietPool({ connectionString: withDatabase(inject('pgAdminUrl'), name), max: 2 }));
        try {
          const results = await Promise.allSettled(pools.map((p) => migrateDatabase(p)));
          const failures = results.flatMap((r, i) =>
            r.status === 'rejected' ? [`round ${round}, replica ${i}: ${(r.reason as Error).message} [${(r.reason as { code?: string }).code}]`] : [],
          );
          expect(failures).toEqual([]);
          // Each migration applied once, by one of them.
          const applied = results.map((r) => (r.status === 'fulfilled' ? r.value : -1)).sort((a, b) => a - b);
          expect(applied).toEqual([0, 0, expected.migrations.length]);
          expect(await schemaOf(pools[0]!)).toEqual(expected);
          const built = await pools[0]!.query(`SELECT count(*)::int AS n FROM pg_index WHERE indexrelid = ANY ($1::regclass[]) AND indisvalid`, [
            ONLINE_INDEXES.map((x) => x.name),
          ]);
          expect(built.rows[0].n).toBe(ONLINE_INDEXES.length);
        } finally {
          await Promise.all(pools.map((p) => p.end()));
          await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
        }
      }
    } finally {
      await admin.end();
    }
  });

  it('a replica starting while another holds the lock waits without holding anything, says so, and migrates after', async () => {
    const holder = await t.newPool(1).connect();
    const { log, lines, next } = capture();
    let replica: Promise<number> | undefined;
    try {
      await holder.query('SELECT pg_advisory_lock($1)', [MIGRATION_LOCK]);
      const waiting = next(/waiting for the migrations of another coordinator/);
      replica = migrateDatabase(t.newPool(2), { log, waitLogEveryMs: 50 });
      let settled = false;
      void replica.finally(() => (settled = true)).catch(() => undefined);
      const first = await within(waiting, 20_000, 'the waiting replica said nothing');
      const pid = (await holder.query('SELECT pg_backend_pid() AS pid')).rows[0].pid;
      expect(first).toMatchObject({ holder: { pid } });
      // What the holder does under the lock: an index built CONCURRENTLY, which waits for every
      // older transaction to end; a replica blocked in pg_advisory_lock would be one (40P01).
      await holder.query('CREATE INDEX CONCURRENTLY migrate_wait_probe_idx ON agents (created_at)');
      const second = await next(/waiting for the migrations of another coordinator/);
      expect(second).toMatchObject({ holder: { pid, running: expect.stringContaining('CREATE INDEX CONCURRENTLY migrate_wait_probe_idx') } });
      expect(settled).toBe(false);
      await holder.query('SELECT pg_advisory_unlock($1)', [MIGRATION_LOCK]);
      expect(await replica).toBe(0);
      expect(lines.find((l) => l.msg === 'migration lock taken')).toMatchObject({ waitedMs: expect.any(Number) });
    } finally {
      await holder.query('SELECT pg_advisory_unlock_all()');
      await replica?.catch(() => undefined);
      await holder.query('DROP INDEX IF EXISTS migrate_wait_probe_idx');
      holder.release();
    }
  });
});

describe('a database migrated by a newer release', () => {
  const last = migrationLast();
  const newer = { hash: 'from-a-newer-release', createdAt: last.when + 86_400_000 };
  const iso = new Date(newer.createdAt).toISOString();
  const add = () => t.pool.query(`INSERT INTO drizzle.__drizzle_migrations (hash, created_at) VALUES ($1, $2)`, [newer.hash, newer.createdAt]);
  const remove = () => t.pool.query(`DELETE FROM drizzle.__drizzle_migrations WHERE hash = $1`, [newer.hash]);
  const refusal = new RegExp(
    `migrated by a newer release: it has 1 migration this release does not know, the newest dated ${iso.replace(/\./g, '\\.')} \\(hash from-a-newer\\); ` +
      `the newest this release knows is ${last.tag} .*LEASEHOLD_ALLOW_NEWER_SCHEMA=1`,
  );

  it('migrateDatabase refuses it with NewerSchemaError naming both migrations; allowNewerSchema runs on it with a warning', async () => {
    await add();
    try {
      const { log, lines } = capture();
      await expect(migrateDatabase(t.pool, { log })).rejects.toMatchObject({ name: 'NewerSchemaError', message: expect.stringMatching(refusal) });
      // Nothing held after the refusal: the lock is free.
      const other = t.newPool(1);
      expect((await other.query('SELECT pg_try_advisory_lock($1) AS got', [MIGRATION_LOCK])).rows[0].got).toBe(true);
      await other.query('SELECT pg_advisory_unlock($1)', [MIGRATION_LOCK]);
      expect(await migrateDatabase(t.pool, { log, allowNewerSchema: true })).toBe(0);
      expect(lines.find((l) => l.level === 40)).toMatchObject({ unknownMigrations: 1, msg: expect.stringContaining('LEASEHOLD_ALLOW_NEWER_SCHEMA=1') });
      // A migration unknown by hash but not dated later (a reworded file) is no newer release.
      await t.pool.query(`UPDATE drizzle.__drizzle_migrations SET created_at = $1 WHERE hash = $2`, [last.when - 1, newer.hash]);
      expect(await migrateDatabase(t.pool)).toBe(0);
    } finally {
      await remove();
    }
  });

  it('serve and migrate refuse to start on it (exit code 2, one line naming both migrations); with LEASEHOLD_ALLOW_NEWER_SCHEMA=1 serve starts', async () => {
    await add();
    try {
      const env = { DATABASE_URL: t.url };
      const [migrate, start] = [serve(['migrate'], env), serve(['serve', '--grpc-addr', '127.0.0.1:0', '--http-addr', '127.0.0.1:0'], env)];
      for (const p of [migrate, start]) {
        // Exits, or (were it not refused) serves: whichever comes first.
        const exit = p.exited.then((e) => `exit code ${e.code}`);
        const ready = p.waitFor(/leasehold coordinator ready/).then(() => 'serving', () => exit);
        expect(await Promise.race([exit, ready])).toBe('exit code 2');
        const error = p.lines.find((l) => l.level === 50);
        expect(String(error?.msg)).toMatch(refusal);
        expect(error?.stack, 'one line, no stack').toBeUndefined();
        expect(p.lines.some((l) => /leasehold coordinator ready|schema up to date/.test(String(l.msg)))).toBe(false);
      }
      const allowed = serve(['serve', '--grpc-addr', '127.0.0.1:0', '--http-addr', '127.0.0.1:0'], { ...env, LEASEHOLD_ALLOW_NEWER_SCHEMA: '1' });
      try {
        await allowed.waitFor(/leasehold coordinator ready/);
        expect(allowed.lines.find((l) => l.level === 40 && /migrated by a newer release/.test(String(l.msg)))).toBeDefined();
      } finally {
        allowed.child.kill('SIGTERM');
        expect((await allowed.exited).code).toBe(0);
      }
    } finally {
      await remove();
    }
  });
});
