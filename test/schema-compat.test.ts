/**
 * Which releases can run on a database (server/store/schema-compat.ts): the mark of each
 * migration (migrations/compat.json; unmarked counts as breaks), the database's
 * `schema_compat.min_reader` (written by migration 0021 for the databases of before, raised by
 * the migrator with a NOTIFY, never lowered), and the refusal at start of a database whose
 * min_reader is above the release's reader level, which LEASEHOLD_ALLOW_NEWER_SCHEMA=1 does not
 * override (it still lets a release run beside newer add-only migrations).
 */
import { cp, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Writable } from 'node:stream';
import pg from 'pg';
import pino from 'pino';
import { afterEach, describe, expect, it } from 'vitest';
import { migrateDatabase, migrationsFolder } from '../server/store/migrate.js';
import { compatInfo } from '../server/store/schema-compat.js';
import { newerRelease, ownDatabase } from './helpers/newer-release.js';
import { killAll, serve } from './helpers/serve.js';

afterEach(() => killAll());

const journal = async (folder: string) =>
  (JSON.parse(await readFile(path.join(folder, 'meta/_journal.json'), 'utf8')) as { entries: Array<{ tag: string }> }).entries;
const minReader = async (db: pg.Pool) => (await db.query<{ min_reader: number }>('SELECT min_reader FROM schema_compat')).rows.map((r) => r.min_reader);

/** A logger whose lines are kept. */
function capture() {
  const lines: Array<Record<string, unknown>> = [];
  const stream = new Writable({
    write(chunk: Buffer, _enc, done) {
      lines.push(JSON.parse(chunk.toString()) as Record<string, unknown>);
      done();
    },
  });
  return { log: pino({ level: 'info' }, stream), lines };
}

/** Collects the payloads NOTIFY sends on `leasehold_schema` to the database at `url`. */
async function hearSchema(url: string) {
  const c = new pg.Client({ connectionString: url });
  await c.connect();
  const heard: string[] = [];
  c.on('notification', (n) => n.channel === 'leasehold_schema' && heard.push(String(n.payload)));
  await c.query('LISTEN leasehold_schema');
  return {
    heard,
    // A round trip after the notifying commit: everything it sent has arrived by then.
    settle: () => c.query('SELECT 1'),
    end: () => c.end(),
  };
}

describe('the marks in migrations/compat.json', () => {
  it('name migrations of the journal only; 0017, 0018 and 0019 break; the reader level is the number of migrations, min_reader the last breaking one plus one', async () => {
    const entries = await journal(migrationsFolder);
    const marks = (JSON.parse(await readFile(path.join(migrationsFolder, 'compat.json'), 'utf8')) as { migrations: Record<string, { mark: string; why: string }> }).migrations;
    expect(Object.keys(marks).filter((tag) => !entries.some((e) => e.tag === tag)), 'marks of no migration (a typo counts as unmarked)').toEqual([]);
    for (const [tag, m] of Object.entries(marks)) {
      expect(['add-only', 'breaks'], tag).toContain(m.mark);
      expect(m.why, tag).toBeTruthy();
    }
    const info = compatInfo(migrationsFolder);
    expect(info.migrations.filter((m) => !m.marked).map((m) => m.tag), 'every shipped migration is marked').toEqual([]);
    const of = (n: string) => info.migrations.find((m) => m.tag.startsWith(n))?.mark;
    expect([of('0017'), of('0018'), of('0019'), of('0005')]).toEqual(['breaks', 'breaks', 'breaks', 'breaks']);
    expect([of('0020'), of('0021')]).toEqual(['add-only', 'add-only']);
    expect(info.readerLevel).toBe(entries.length);
    expect(info.minReader).toBe(20);
  });

  it('a migration without a mark counts as breaking: a release shipping it needs readers of its own level', async () => {
    const [newer, addOnly] = [await newerRelease(), await newerRelease('add-only')];
    try {
      const info = compatInfo(newer.folder);
      expect(info.migrations.at(-1)).toEqual({ tag: newer.tag, mark: 'breaks', marked: false });
      expect(info.minReader).toBe(newer.readerLevel);
      expect(compatInfo(addOnly.folder).minReader).toBe(20);
    } finally {
      await newer.remove();
      await addOnly.remove();
    }
  });
});

describe("the database's min_reader", () => {
  it('a database of a release before 0021 gets min_reader 20 from it, and the migrator logs both levels', async () => {
    const db = await ownDatabase({ empty: true });
    const before = await mkdtemp(path.join(os.tmpdir(), 'leasehold-migrations-0020-'));
    try {
      // The release before this change: migrations 0000 to 0020.
      await cp(migrationsFolder, before, { recursive: true });
      const file = path.join(before, 'meta/_journal.json');
      const j = JSON.parse(await readFile(file, 'utf8')) as { entries: Array<{ tag: string }> };
      j.entries = j.entries.filter((e) => e.tag < '0021');
      await writeFile(file, JSON.stringify(j));
      expect(await migrateDatabase(db.pool, { migrationsFolder: before })).toBe(21);
      expect((await db.pool.query(`SELECT to_regclass('schema_compat') AS t`)).rows[0].t).toBeNull();

      const { log, lines } = capture();
      expect(await migrateDatabase(db.pool, { log })).toBe(1);
      expect(await minReader(db.pool)).toEqual([20]);
      const level = compatInfo(migrationsFolder).readerLevel;
      expect(lines.find((l) => /^schema level:/.test(String(l.msg)))).toMatchObject({
        readerLevel: level,
        minReader: 20,
        msg: `schema level: this release reads up to ${level}, the database needs 20 or more`,
      });
    } finally {
      await rm(before, { recursive: true, force: true });
      await db.drop();
    }
  });

  it('a newer release applying a breaking migration raises it and sends NOTIFY; this release then refuses the database, LEASEHOLD_ALLOW_NEWER_SCHEMA or not, and never lowers it', async () => {
    const db = await ownDatabase();
    const newer = await newerRelease();
    const ear = await hearSchema(db.url);
    try {
      expect(await minReader(db.pool)).toEqual([20]);
      expect(await migrateDatabase(db.pool, { migrationsFolder: newer.folder })).toBe(1);
      await ear.settle();
      expect(await minReader(db.pool)).toEqual([newer.readerLevel]);
      expect(ear.heard).toEqual([String(newer.readerLevel)]);

      const level = compatInfo(migrationsFolder).readerLevel;
      const refusal = new RegExp(`migrated to schema level ${newer.readerLevel} by a newer release; this release reads up to level ${level} .*does not override this`);
      for (const allowNewerSchema of [false, true]) {
        await expect(migrateDatabase(db.pool, { allowNewerSchema })).rejects.toMatchObject({ name: 'NewerSchemaError', message: expect.stringMatching(refusal) });
      }
      // The newer release again: nothing to raise, nothing sent.
      expect(await migrateDatabase(db.pool, { migrationsFolder: newer.folder })).toBe(0);
      await ear.settle();
      expect(ear.heard).toHaveLength(1);
      expect(await minReader(db.pool)).toEqual([newer.readerLevel]);
    } finally {
      await ear.end();
      await newer.remove();
      await db.drop();
    }
  });

  it('a newer add-only migration leaves it; this release runs beside it only with LEASEHOLD_ALLOW_NEWER_SCHEMA=1, as before, and does not lower it', async () => {
    const db = await ownDatabase();
    const newer = await newerRelease('add-only');
    const ear = await hearSchema(db.url);
    try {
      expect(await migrateDatabase(db.pool, { migrationsFolder: newer.folder })).toBe(1);
      await ear.settle();
      expect(ear.heard).toEqual([]);
      expect(await minReader(db.pool)).toEqual([20]);
      await expect(migrateDatabase(db.pool)).rejects.toMatchObject({ name: 'NewerSchemaError', message: expect.stringMatching(/it has 1 migration this release does not know/) });
      expect(await migrateDatabase(db.pool, { allowNewerSchema: true })).toBe(0);
      // Raised by hand above this release's level (as a later breaking release would), an older
      // release's migrator leaves it there.
      await db.pool.query('UPDATE schema_compat SET min_reader = 21');
      expect(await migrateDatabase(db.pool, { allowNewerSchema: true })).toBe(0);
      expect(await minReader(db.pool)).toEqual([21]);
    } finally {
      await ear.end();
      await newer.remove();
      await db.drop();
    }
  });
});

describe('serve and migrate on a database that needs a newer reader', () => {
  it('refuse it with exit code 2 and one line naming both levels, LEASEHOLD_ALLOW_NEWER_SCHEMA=1 or not', async () => {
    const db = await ownDatabase();
    const newer = await newerRelease();
    try {
      await migrateDatabase(db.pool, { migrationsFolder: newer.folder });
      const level = compatInfo(migrationsFolder).readerLevel;
      const refusal = new RegExp(`^the database was migrated to schema level ${newer.readerLevel} by a newer release; this release reads up to level ${level} `);
      const envs: Array<Record<string, string>> = [{ DATABASE_URL: db.url }, { DATABASE_URL: db.url, LEASEHOLD_ALLOW_NEWER_SCHEMA: '1' }];
      for (const env of envs) {
        for (const args of [['migrate'], ['serve', '--grpc-addr', '127.0.0.1:0', '--http-addr', '127.0.0.1:0']]) {
          const p = serve(args, env);
          const exit = p.exited.then((e) => `exit code ${e.code}`);
          const ready = p.waitFor(/leasehold coordinator ready/).then(() => 'serving', () => exit);
          expect(await Promise.race([exit, ready]), `${args[0]} ${JSON.stringify(env)}`).toBe('exit code 2');
          const error = p.lines.find((l) => l.level === 50);
          expect(String(error?.msg)).toMatch(refusal);
          expect(error?.stack, 'one line, no stack').toBeUndefined();
        }
      }
    } finally {
      await newer.remove();
      await db.drop();
    }
  });
});
