/**
 * Applies the committed drizzle-kit migrations. Serialised by an advisory lock, so several
 * coordinators starting at once on one database apply each migration exactly once.
 */
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { drizzle } from 'drizzle-orm/node-postgres';
import { migrate } from 'drizzle-orm/node-postgres/migrator';
import type pg from 'pg';
import { endedCountsReconcile, endedCutoff, jobCountsReconcile } from './counts.js';
import { daysEnsure } from './days.js';

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
    await fillInOnline(client);
    // The partitions of today and the next days, for the successes to move to (days.ts).
    await daysEnsure(client);
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
  const { rows } = await client.query<{ need: boolean }>(
    'SELECT NOT EXISTS (SELECT 1 FROM job_counts) AND EXISTS (SELECT 1 FROM jobs WHERE finished_at IS NOT NULL) AS need',
  );
  if (rows[0]?.need) await jobCountsReconcile(client);
  // The per-minute counts of the last day (migration 0016), when none are kept yet.
  const minutes = await client.query<{ need: boolean }>(
    `SELECT NOT EXISTS (SELECT 1 FROM ended_counts) AND EXISTS (SELECT 1 FROM attempt_log WHERE ended_at >= ${endedCutoff}) AS need`,
  );
  if (minutes.rows[0]?.need) await endedCountsReconcile(client);
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
