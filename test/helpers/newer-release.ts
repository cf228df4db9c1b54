/**
 * What a newer release brings to a database, for the tests of schema compatibility: its
 * migrations folder (this release's, plus one migration dated a day after the last, marked as
 * asked or not at all), and databases of their own cloned from the migrated template (a newer
 * release's migration cannot be taken back, so each test that applies one gets a database).
 */
import { randomBytes } from 'node:crypto';
import { cp, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { inject } from 'vitest';
import { migrationsFolder } from '../../server/store/migrate.js';
import { quietPool } from './quiet-pool.js';
import { withDatabase } from './global-setup.js';

export interface NewerRelease {
  folder: string;
  /** Its migration's tag. */
  tag: string;
  /** Its reader level: the number of migrations it ships. */
  readerLevel: number;
  remove(): Promise<void>;
}

/**
 * This release's migrations and one more (`sql`, default `SELECT 1`), marked `mark` in compat.json (or not
 * marked, which counts as breaks).
 */
export async function newerRelease(mark?: 'add-only' | 'breaks', sql = 'SELECT 1;\n'): Promise<NewerRelease> {
  const folder = await mkdtemp(path.join(os.tmpdir(), 'leasehold-newer-release-'));
  await cp(migrationsFolder, folder, { recursive: true });
  const journalFile = path.join(folder, 'meta/_journal.json');
  const journal = JSON.parse(await readFile(journalFile, 'utf8')) as { entries: Array<{ idx: number; version: string; when: number; tag: string; breakpoints: boolean }> };
  const last = journal.entries.at(-1)!;
  const idx = last.idx + 1;
  const tag = `${String(idx).padStart(4, '0')}_newer_release`;
  journal.entries.push({ idx, version: last.version, when: last.when + 86_400_000, tag, breakpoints: true });
  await writeFile(journalFile, JSON.stringify(journal, null, 2));
  await writeFile(path.join(folder, `${tag}.sql`), sql);
  if (mark) {
    const compatFile = path.join(folder, 'compat.json');
    const compat = JSON.parse(await readFile(compatFile, 'utf8')) as { migrations: Record<string, unknown> };
    compat.migrations[tag] = { mark, why: 'a test' };
    await writeFile(compatFile, JSON.stringify(compat, null, 2));
  }
  return { folder, tag, readerLevel: journal.entries.length, remove: () => rm(folder, { recursive: true, force: true }) };
}

export interface OwnDatabase {
  url: string;
  pool: pg.Pool;
  drop(): Promise<void>;
}

/** A database of its own, cloned from the migrated template (or `empty`); `drop()` ends its pool and drops it. */
export async function ownDatabase(opts: { empty?: boolean } = {}): Promise<OwnDatabase> {
  const name = `${inject('pgPrefix')}skew_${randomBytes(4).toString('hex')}`;
  const admin = async (q: string) => {
    const c = new pg.Client({ connectionString: inject('pgAdminUrl') });
    await c.connect();
    try {
      await c.query(q);
    } finally {
      await c.end();
    }
  };
  await admin(opts.empty ? `CREATE DATABASE ${name}` : `CREATE DATABASE ${name} TEMPLATE ${inject('pgTemplate')}`);
  const url = withDatabase(inject('pgAdminUrl'), name);
  const pool = quietPool({ connectionString: url, max: 4 });
  return {
    url,
    pool,
    drop: async () => {
      await pool.end();
      await admin(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
    },
  };
}
