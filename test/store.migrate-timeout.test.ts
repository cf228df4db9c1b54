/**
 * A statement_timeout set on the database or the role (a DBA's guard for applications) does not
 * cut the migrations: a migration, or an index built online over a large history, may take
 * longer than any such bound, and was cut at every start (a coordinator that could never start
 * again after an upgrade). The migrations' connection runs without one and gives the database's
 * back before it is pooled.
 */
import { afterEach, expect, it } from 'vitest';
import { migrateDatabase } from '../server/store/migrate.js';
import { newerRelease, ownDatabase } from './helpers/newer-release.js';
import { quietPool } from './helpers/quiet-pool.js';

const cleanups: Array<() => Promise<unknown>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

it('applies a migration longer than the database’s statement_timeout, and leaves the pooled connection with that timeout', async () => {
  const db = await ownDatabase();
  cleanups.push(() => db.drop());
  const release = await newerRelease('add-only', 'SELECT pg_sleep(0.6);\n');
  cleanups.push(() => release.remove());
  await db.pool.query(`DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET statement_timeout = %L', current_database(), '200ms'); END $$`);
  // Sessions opened from now on have it; one connection, so the migrations' is the one read after.
  const pool = quietPool({ connectionString: db.url, max: 1 });
  cleanups.push(() => pool.end());
  await expect(pool.query('SELECT pg_sleep(0.6)')).rejects.toThrow(/statement timeout/);

  expect(await migrateDatabase(pool, { migrationsFolder: release.folder })).toBe(1);
  expect((await pool.query('SHOW statement_timeout')).rows[0].statement_timeout).toBe('200ms');
  expect((await pool.query(`SELECT count(*)::int AS n FROM drizzle.__drizzle_migrations`)).rows[0].n).toBe(release.readerLevel);
});
