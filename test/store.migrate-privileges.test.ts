/**
 * A role that may not run the migrations (it does not own the database: a role given only table
 * grants, or a new database on PostgreSQL 15+ whose `public` is its owner's) is told so in one
 * line naming the role, the database and the fix, as a DatabaseSettingError (`leasehold serve`
 * and `migrate`: exit code 2). It was drizzle's `Failed query: CREATE SCHEMA …` with a stack,
 * exit code 1, and systemd restarting it forever.
 */
import { randomBytes } from 'node:crypto';
import pg from 'pg';
import { afterEach, expect, inject, it } from 'vitest';
import { migrateDatabase } from '../server/store/migrate.js';
import { ownDatabase } from './helpers/newer-release.js';
import { quietPool } from './helpers/quiet-pool.js';

const cleanups: Array<() => Promise<unknown>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

it('a role that does not own the database: one line with the role, the database and ALTER DATABASE … OWNER TO', async () => {
  const role = `lh_guest_${randomBytes(4).toString('hex')}`;
  // Dropped last: it owns the database at the end.
  cleanups.push(async () => {
    const admin = new pg.Client({ connectionString: inject('pgAdminUrl') });
    await admin.connect();
    await admin.query(`DROP ROLE IF EXISTS ${role}`).finally(() => admin.end());
  });
  const db = await ownDatabase({ empty: true });
  cleanups.push(() => db.drop());
  await db.pool.query(`CREATE ROLE ${role} LOGIN PASSWORD 'guest-pw'`);
  const url = new URL(db.url);
  url.username = role;
  url.password = 'guest-pw';
  const pool = quietPool({ connectionString: url.toString(), max: 1 });
  cleanups.push(() => pool.end());
  const dbName = url.pathname.slice(1);

  const err = (await migrateDatabase(pool).then(
    () => undefined,
    (e: unknown) => e,
  )) as Error;
  expect(err?.name).toBe('DatabaseSettingError');
  expect(err.message).toBe(
    `the migrations cannot run as role "${role}" on database "${dbName}": permission denied for database ${dbName} ` +
      `(in drizzle's journal table setup: CREATE SCHEMA IF NOT EXISTS "drizzle"; CREATE TABLE IF NOT EXISTS "drizzle"."__drizzle_migrations"). ` +
      `The coordinator's role must own its database (ALTER DATABASE ${dbName} OWNER TO ${role}) and the tables the migrations made in it ` +
      `(after another role ran them: REASSIGN OWNED BY that_role TO ${role}), as an admin runs it (docs/deploy.md, "A managed PostgreSQL")`,
  );

  // With the fix the message gives, the same role migrates.
  await db.pool.query(`ALTER DATABASE ${dbName} OWNER TO ${role}`);
  expect(await migrateDatabase(pool)).toBeGreaterThan(20);
});
