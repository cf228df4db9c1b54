/**
 * `applyMigrations` (server/store/migrate.ts) is drizzle's migrator in fewer round trips: one to
 * read the journal table and one per migration, where drizzle's sends each statement on its own
 * (about 160 on a new database: an 18 s first start against a database 60 ms away). It must leave
 * what drizzle's leaves, schema and journal rows alike, so either can follow the other on one
 * database; and a migration that fails must take every pending one back with it, naming itself.
 */
import { cp, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { drizzle } from 'drizzle-orm/node-postgres';
import { migrate } from 'drizzle-orm/node-postgres/migrator';
import pg from 'pg';
import { afterAll, describe, expect, it } from 'vitest';
import { applyMigrations, migrateDatabase, MigrationStepError, migrationsFolder } from '../server/store/migrate.js';
import { newerRelease, ownDatabase, type OwnDatabase } from './helpers/newer-release.js';

const cleanups: Array<() => Promise<void>> = [];
afterAll(async () => {
  for (const c of cleanups.reverse()) await c();
});

async function emptyDatabase(): Promise<OwnDatabase> {
  const db = await ownDatabase({ empty: true });
  cleanups.push(() => db.drop());
  return db;
}

/** A client of `db` that counts the queries it sends (each one round trip). */
async function countingClient(db: OwnDatabase): Promise<{ client: pg.PoolClient; sent: () => number }> {
  const client = await db.pool.connect();
  cleanups.push(async () => client.release());
  let n = 0;
  const query = client.query.bind(client) as (...args: unknown[]) => unknown;
  (client as unknown as { query: (...args: unknown[]) => unknown }).query = (...args: unknown[]) => {
    n++;
    return query(...args);
  };
  return { client, sent: () => n };
}

/** drizzle's own migrator on `db`. */
async function drizzleMigrate(db: OwnDatabase, folder: string): Promise<void> {
  const client = await db.pool.connect();
  try {
    await migrate(drizzle(client), { migrationsFolder: folder });
  } finally {
    client.release();
  }
}

/** The first `n` migrations of this release, as a folder of their own. */
async function firstMigrations(n: number): Promise<string> {
  const folder = await mkdtemp(path.join(os.tmpdir(), 'leasehold-first-migrations-'));
  cleanups.push(() => rm(folder, { recursive: true, force: true }));
  await cp(migrationsFolder, folder, { recursive: true });
  const file = path.join(folder, 'meta/_journal.json');
  const journal = JSON.parse(await readFile(file, 'utf8')) as { entries: unknown[] };
  journal.entries = journal.entries.slice(0, n);
  await writeFile(file, JSON.stringify(journal, null, 2));
  return folder;
}

/** What migrations leave in a database: its catalog (tables, columns, types, indexes, constraints, functions, triggers, views, sequences) and drizzle's journal rows. */
async function catalog(db: OwnDatabase) {
  const q = async (sql: string) => (await db.pool.query(sql)).rows;
  const schemas = `('public', 'drizzle')`;
  return {
    relations: await q(`SELECT n.nspname, c.relname, c.relkind, c.relpersistence, c.relrowsecurity, array_to_string(c.reloptions, ',') AS options,
                               obj_description(c.oid) AS comment, pg_get_expr(c.relpartbound, c.oid) AS bound, array_to_string(c.relacl, ',') AS acl
                          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname IN ${schemas} ORDER BY 1, 2`),
    columnComments: await q(`SELECT c.relname, a.attname, col_description(c.oid, a.attnum) AS comment FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
                              WHERE c.relnamespace = 'public'::regnamespace AND a.attnum > 0 AND col_description(c.oid, a.attnum) IS NOT NULL ORDER BY 1, 2`),
    // Rows the migrations write (0019's, 0021's): every table's rows, as text.
    rows: await q(`SELECT c.relname, (xpath('/row/n/text()', query_to_xml(format('SELECT count(*) AS n FROM %I', c.relname), false, true, '')))[1]::text AS n
                     FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p') ORDER BY 1`),
    schemaCompat: (await q(`SELECT to_regclass('schema_compat') IS NOT NULL AS kept`))[0]!.kept ? await q(`SELECT to_jsonb(s) AS row FROM schema_compat s`) : [],
    columns: await q(`SELECT table_schema, table_name, column_name, ordinal_position, data_type, udt_name, column_default, is_nullable, is_identity, is_generated, generation_expression
                        FROM information_schema.columns WHERE table_schema IN ${schemas} ORDER BY 1, 2, 4`),
    indexes: await q(`SELECT schemaname, tablename, indexname, indexdef FROM pg_indexes WHERE schemaname IN ${schemas} ORDER BY 1, 2, 3`),
    constraints: await q(`SELECT conrelid::regclass::text AS rel, conname, pg_get_constraintdef(oid) AS def FROM pg_constraint
                            WHERE connamespace IN (SELECT oid FROM pg_namespace WHERE nspname IN ${schemas}) ORDER BY 1, 2`),
    functions: await q(`SELECT p.proname, pg_get_function_identity_arguments(p.oid) AS args, CASE WHEN p.prokind IN ('f', 'p') THEN pg_get_functiondef(p.oid) END AS def
                          FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace ORDER BY 1, 2`),
    triggers: await q(`SELECT tgrelid::regclass::text AS rel, tgname, pg_get_triggerdef(oid) AS def FROM pg_trigger WHERE NOT tgisinternal ORDER BY 1, 2`),
    types: await q(`SELECT t.typname, e.enumsortorder, e.enumlabel FROM pg_type t JOIN pg_enum e ON e.enumtypid = t.oid ORDER BY 1, 2`),
    views: await q(`SELECT schemaname, viewname, definition FROM pg_views WHERE schemaname IN ${schemas} ORDER BY 1, 2`),
    sequences: await q(`SELECT schemaname, sequencename, data_type, start_value, increment_by FROM pg_sequences WHERE schemaname IN ${schemas} ORDER BY 1, 2`),
    journal: await q(`SELECT id, hash, created_at FROM drizzle.__drizzle_migrations ORDER BY id`),
  };
}

const journalLength = async () => (JSON.parse(await readFile(path.join(migrationsFolder, 'meta/_journal.json'), 'utf8')) as { entries: unknown[] }).entries.length;

describe('applyMigrations against drizzle-orm/node-postgres/migrator', () => {
  it('leaves a new database as drizzle does, in one round trip per migration and three more', async () => {
    const byDrizzle = await emptyDatabase();
    await drizzleMigrate(byDrizzle, migrationsFolder);
    const ours = await emptyDatabase();
    const { client, sent } = await countingClient(ours);
    const migrations = await journalLength();
    expect(await applyMigrations(client, migrationsFolder)).toBe(migrations);
    // The journal read, BEGIN, each migration, COMMIT.
    expect(sent()).toBe(migrations + 3);
    const expected = await catalog(byDrizzle);
    expect(expected.journal).toHaveLength(migrations);
    expect(expected.relations.length).toBeGreaterThan(20);
    expect(await catalog(ours)).toEqual(expected);

    // Up to date: one round trip, nothing applied.
    expect(await applyMigrations(client, migrationsFolder)).toBe(0);
    expect(sent()).toBe(migrations + 4);
    expect(await catalog(ours)).toEqual(expected);
  });

  it('follows drizzle partway through, and drizzle follows it', async () => {
    const reference = await emptyDatabase();
    await drizzleMigrate(reference, migrationsFolder);
    const expected = await catalog(reference);
    const half = Math.floor((await journalLength()) / 2);
    const firstHalf = await firstMigrations(half);

    const drizzleThenOurs = await emptyDatabase();
    await drizzleMigrate(drizzleThenOurs, firstHalf);
    const { client } = await countingClient(drizzleThenOurs);
    expect(await applyMigrations(client, migrationsFolder)).toBe(expected.journal.length - half);
    expect(await catalog(drizzleThenOurs)).toEqual(expected);

    const oursThenDrizzle = await emptyDatabase();
    const other = await countingClient(oursThenDrizzle);
    expect(await applyMigrations(other.client, firstHalf)).toBe(half);
    other.client.release();
    cleanups.pop();
    await drizzleMigrate(oursThenDrizzle, migrationsFolder);
    expect(await catalog(oursThenDrizzle)).toEqual(expected);
  });

  it('applies statements that end in a comment or lack their semicolon, and DO blocks, as drizzle does', async () => {
    const odd = await newerRelease(
      undefined,
      'CREATE TABLE "odd_statements" ("a" integer) -- no semicolon, a comment last\n--> statement-breakpoint\n' +
        "DO $$ BEGIN INSERT INTO odd_statements VALUES (1); END $$\n--> statement-breakpoint\n" +
        // The file's last line a comment without a line end: joined to what follows by a bare
        // ";", the journal's INSERT would be commented out.
        'INSERT INTO "odd_statements" VALUES (2); -- a comment after it, the last line',
    );
    cleanups.push(() => odd.remove());
    const byDrizzle = await emptyDatabase();
    await drizzleMigrate(byDrizzle, odd.folder);
    const ours = await emptyDatabase();
    const { client } = await countingClient(ours);
    expect(await applyMigrations(client, odd.folder)).toBe((await journalLength()) + 1);
    expect((await ours.pool.query('SELECT a FROM odd_statements ORDER BY a')).rows).toEqual([{ a: 1 }, { a: 2 }]);
    expect(await catalog(ours)).toEqual(await catalog(byDrizzle));
  });

  it('takes back every pending migration when one fails, and names it', async () => {
    const half = Math.floor((await journalLength()) / 2);
    const db = await emptyDatabase();
    const { client } = await countingClient(db);
    expect(await applyMigrations(client, await firstMigrations(half))).toBe(half);
    const before = await catalog(db);

    // This release's later migrations, then one that makes a table and fails after it.
    const broken = await newerRelease(undefined, 'CREATE TABLE "made_then_undone" ("a" integer);\n--> statement-breakpoint\nSELECT 1 / 0;\n');
    cleanups.push(() => broken.remove());
    const err = (await applyMigrations(client, broken.folder).then(
      () => undefined,
      (e: unknown) => e,
    )) as MigrationStepError;
    expect(err).toBeInstanceOf(MigrationStepError);
    expect(err.message).toBe(`migration ${broken.tag} failed: division by zero`);
    expect(err.code).toBe('22012');
    expect(await catalog(db)).toEqual(before);
    // The connection is usable after (the transaction was rolled back), and the migrations apply
    // once the broken one is gone.
    expect(await applyMigrations(client, migrationsFolder)).toBe((await journalLength()) - half);
  });
});

describe('migrateDatabase', () => {
  it('looks over an up-to-date database in ten round trips, as a start far from its database pays each', async () => {
    const db = await emptyDatabase();
    const migrations = await journalLength();
    expect(await migrateDatabase(db.pool)).toBe(migrations);
    // Every query of every client the pool hands out, counted.
    let sent = 0;
    const connect = db.pool.connect.bind(db.pool) as () => Promise<pg.PoolClient>;
    // (migrateDatabase takes its client with a promise; pool.query, with a callback, comes after.)
    (db.pool as unknown as { connect: () => Promise<pg.PoolClient> }).connect = async () => {
      const client = await connect();
      const query = client.query.bind(client) as (...args: unknown[]) => unknown;
      (client as unknown as { query: (...args: unknown[]) => unknown }).query = (...args: unknown[]) => {
        sent++;
        return query(...args);
      };
      return client;
    };
    try {
      expect(await migrateDatabase(db.pool)).toBe(0);
    } finally {
      (db.pool as unknown as { connect: unknown }).connect = connect;
    }
    // The timeout set with the lock's first try; which tables exist; what they hold; the journal;
    // the schema level raised and read; the online indexes; what is to be filled in; the days'
    // partitions (two); the unlock with the reset. (Eighteen before 2026-12-07.)
    expect(sent).toBe(10);
    // (The timeout's reset is test/store.migrate-timeout.test.ts's.)
  });
});
