/**
 * Applies the committed drizzle-kit migrations. Serialised by an advisory lock, so several
 * coordinators starting at once on one database apply each migration exactly once.
 */
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { drizzle } from 'drizzle-orm/node-postgres';
import { migrate } from 'drizzle-orm/node-postgres/migrator';
import type pg from 'pg';

/** The folder drizzle-kit writes to (`server/store/migrations`). */
export const migrationsFolder = path.join(path.dirname(fileURLToPath(import.meta.url)), 'migrations');

// An arbitrary constant: the advisory lock key of "leasehold migrations".
const MIGRATION_LOCK = 7_140_356_001;

/** Brings the schema up to date; returns the number of migrations applied. */
export async function migrateDatabase(pool: pg.Pool): Promise<number> {
  const client = await pool.connect();
  try {
    await client.query('SELECT pg_advisory_lock($1)', [MIGRATION_LOCK]);
    const count = async () =>
      Number(
        (
          await client.query(
            `SELECT count(*) AS n FROM information_schema.tables WHERE table_schema = 'drizzle' AND table_name = '__drizzle_migrations'`,
          )
        ).rows[0].n,
      ) === 0
        ? 0
        : Number((await client.query('SELECT count(*) AS n FROM drizzle.__drizzle_migrations')).rows[0].n);
    const before = await count();
    await migrate(drizzle(client), { migrationsFolder });
    return (await count()) - before;
  } finally {
    await client.query('SELECT pg_advisory_unlock($1)', [MIGRATION_LOCK]).catch(() => undefined);
    client.release();
  }
}
