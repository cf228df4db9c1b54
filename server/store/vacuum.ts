/**
 * The live jobs' own VACUUM, run by the vacuumer (server/core/vacuumer.ts) when a deep drain
 * has left many dead rows behind.
 *
 * Why: a claim's update is not HOT (it changes `current_attempt_id`, in `jobs_claim_idx`'s
 * predicate), so every claimed job leaves its entry at the front of that index, where the next
 * claim's ordered scan starts. Entries of jobs since claimed and ended are only skipped, page by
 * page, until a VACUUM removes them: late in a 200,000-job drain a claim of 64 jobs read 2,210
 * buffers of the index, and autovacuum (a minute between looks, and a fifth of the table's rows
 * changed before it acts) had not run once. B-tree pages are cleaned on insert too, but new
 * jobs go in at the back.
 */
import { run, statement, type Queryable } from './sql.js';

/** What the statistics say of `jobs_live` (cumulative counters, no scan). */
export interface LiveChurn {
  /** Rows updated other than HOT, and rows deleted: each leaves a dead row and its index entries. */
  changed: number;
  /** Dead rows now: what VACUUM would remove, or could not (an older snapshot still sees them). */
  dead: number;
  /** VACUUMs of the table so far, autovacuum's included. */
  vacuums: number;
}

const churnSql = statement(
  'liveChurn',
  `SELECT pg_stat_get_tuples_updated(r.oid) - pg_stat_get_tuples_hot_updated(r.oid) + pg_stat_get_tuples_deleted(r.oid) AS changed,
     pg_stat_get_dead_tuples(r.oid) AS dead, pg_stat_get_vacuum_count(r.oid) + pg_stat_get_autovacuum_count(r.oid) AS vacuums
   FROM (SELECT 'jobs_live'::regclass::oid) r(oid)`,
);

export async function liveChurn(db: Queryable): Promise<LiveChurn> {
  const [row] = await run<{ changed: string; dead: string; vacuums: string }>(db, churnSql, []);
  return { changed: Number(row!.changed), dead: Number(row!.dead), vacuums: Number(row!.vacuums) };
}

/**
 * VACUUM of `jobs_live` alone; returns at once if another VACUUM (a replica's, autovacuum's)
 * holds the table. Outside any transaction, so on a pool, never a client in one. Without the
 * table's ownership PostgreSQL skips it with a warning.
 */
export async function liveVacuum(db: Queryable): Promise<void> {
  await db.query('VACUUM (SKIP_LOCKED) jobs_live');
}
