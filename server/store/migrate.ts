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
    await buildOnline(client);
    return (await count()) - before;
  } finally {
    await client.query('SELECT pg_advisory_unlock($1)', [MIGRATION_LOCK]).catch(() => undefined);
    client.release();
  }
}

/**
 * Indexes of schema.ts that a migration does not build: a migration runs in a transaction, where
 * CREATE INDEX stops every write to the table while it reads it (seconds to minutes with a week
 * of history). These are built CONCURRENTLY here instead, under the migration lock, by whichever
 * coordinator starts first with them missing; the others keep serving meanwhile (the lists that
 * use them are slower until they exist). A build cut short (a crash) leaves an invalid index,
 * which is dropped and built again.
 */
export const ONLINE_INDEXES: ReadonlyArray<{ name: string; sql: string }> = [
  {
    name: 'jobs_finished_queue_idx',
    sql: `CREATE INDEX CONCURRENTLY "jobs_finished_queue_idx" ON "jobs" USING btree ("queue", "created_at" DESC NULLS LAST, "id" DESC NULLS LAST) WHERE "finished_at" IS NOT NULL`,
  },
  {
    name: 'jobs_unsucceeded_idx',
    sql: `CREATE INDEX CONCURRENTLY "jobs_unsucceeded_idx" ON "jobs" USING btree ("created_at" DESC NULLS LAST, "id" DESC NULLS LAST) WHERE "finished_at" IS NOT NULL AND "result" IS NULL`,
  },
  {
    name: 'attempts_agent_idx',
    sql: `CREATE INDEX CONCURRENTLY "attempts_agent_idx" ON "attempts" USING btree ("agent_id", "job_created_at" DESC NULLS LAST, "job_id" DESC NULLS LAST)`,
  },
];

async function buildOnline(client: pg.PoolClient): Promise<void> {
  for (const ix of ONLINE_INDEXES) {
    const { rows } = await client.query<{ valid: boolean }>(
      'SELECT indisvalid AS valid FROM pg_index WHERE indexrelid = to_regclass($1)',
      [`"${ix.name}"`],
    );
    if (rows[0]?.valid) continue;
    if (rows[0]) await client.query(`DROP INDEX CONCURRENTLY "${ix.name}"`);
    await client.query(ix.sql);
  }
}
