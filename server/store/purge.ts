/**
 * Purge: finished jobs past a retention deleted in batches, with everything that refers to them
 * (references.ts): an operator's PurgeJobs, and the purger's sweep of `jobs_live` (the
 * partitions of past days it drops whole: days.ts).
 */
import { z } from 'zod';
import { ok, type Outcome } from '../domain/outcomes.js';
import { FINISHED_STATUSES, type JobStatus } from '../domain/statuses.js';
import { check, checkAll, limits, schemas } from '../domain/validation.js';
import { countChangeSql, endedCountSql, endedCutoff, endedKindSql } from './counts.js';
import { referencesDeleteSql } from './references.js';
import { run, statement, type Queryable } from './sql.js';

/** The terminal statuses: the only ones a purge takes. */
export { FINISHED_STATUSES };

export interface PurgeParams {
  /** Jobs that finished longer ago than this are purged. At least 1 s, at most 1000 years (`limits.purgeOlderThanMs`). */
  olderThanMs: number;
  /** Terminal statuses to purge; default all four. */
  statuses?: JobStatus[];
  queue?: string;
  /** Jobs per statement; default 1000. */
  limit?: number;
  /** Count, delete nothing. */
  dryRun?: boolean;
  now?: Date;
  /**
   * Only jobs that finished at or after this time: the `last` of the previous batch of the same
   * run, so each batch starts where the last one ended instead of walking the index entries of
   * the jobs already deleted (dead until VACUUM). A job skipped meanwhile is left to the next run.
   */
  after?: Date;
  /**
   * Only finished jobs in `jobs_live` (those from before every end moved its job, or kept back by a
   * day's drop for their undelivered notification; not those in the partitions of their days, which
   * the purger drops whole: days.ts). The purger's; an operator's purge takes every partition.
   */
  liveOnly?: boolean;
}

// Finished before the cutoff, of the statuses and queue asked for, and with nothing left for the
// deliverer: a job whose notification is still to be delivered, or whose dead-letter alert was
// not raised yet, is kept until the deliverer is done with it. The deliveries' status spelled as
// two arms, each the predicate of a partial index (webhook_deliveries_due_idx, _sending_idx),
// so the open deliveries are read from those: as `status IN (...)` it matched neither, and every
// batch read the whole table (a delivery per notified job of the history kept).
const purgeWhere = `j.finished_at < w.cutoff AND j.status = ANY($2::job_status[]) AND ($3::text IS NULL OR j.queue = $3)
       AND NOT EXISTS (SELECT 1 FROM webhook_events e JOIN webhook_deliveries d ON d.event_id = e.id
                       WHERE e.job_id = j.id AND (d.status = 'pending' OR d.status = 'sending'))
       AND NOT EXISTS (SELECT 1 FROM webhook_events e WHERE e.job_id = j.id AND e.type = 'job.dead' AND e.alerted_at IS NULL)`;
const cutoffCte = `w AS (SELECT coalesce($4::timestamptz, now()) - make_interval(secs => $1::float8 / 1000.0) AS cutoff)`;

// One batch. Candidates come oldest first from jobs_finished_idx (of each partition of jobs, or of
// jobs_live) and are locked FOR UPDATE SKIP LOCKED, so purgers on several replicas take different
// jobs, and an operator's requeue of the same job either waits for the delete (and then finds
// nothing) or commits first (finished_at is NULL then, and the recheck under the lock drops the
// row). The jobs themselves, their keys, their attempts and the rows of JOB_REFERENCES (events,
// steps, stale reports, notify header, webhook events, whose deliveries the events' cascade
// takes) go in the same statement (references.ts), none having a foreign key to jobs (schema.ts): each through
// its index, the batch's ids (and keys) given as one array so that the
// plan is an index scan whatever the planner thinks of the table's size (joined with `c`, steps
// were read whole, a hash join, at 60,000 rows; the jobs' own delete, joined with `c`, read every
// partition of ten million finished jobs whole). The kept counts lose what was deleted, and the
// per-minute counts what ended in the last day: the deleted attempts (their rows, and the
// successes kept on the jobs' rows) and cancels of queued jobs (job_events) of that day, as a
// recount of what is kept would find (counts.ts).
const purgeSqlOf = (name: string, from: 'jobs' | 'jobs_live') =>
  statement(
  name,
  `WITH ${cutoffCte}, c AS (
     SELECT j.id, j.status, j.finished_at, j.idempotency_key FROM ${from} j, w WHERE ${purgeWhere} AND j.finished_at >= coalesce($6::timestamptz, '-infinity')
     ORDER BY j.finished_at
     LIMIT $5
     FOR UPDATE OF j SKIP LOCKED
   ), ids AS (
     SELECT array_agg(id) AS ids, array_agg(idempotency_key) FILTER (WHERE idempotency_key IS NOT NULL) AS keys FROM c
   ), d AS (
     DELETE FROM ${from} j WHERE j.id = ANY((SELECT ids FROM ids)::uuid[]) RETURNING j.id, j.queue, j.status, j.finished_at, j.final_attempt_id
   ), ${referencesDeleteSql('(SELECT ids FROM ids)::uuid[]', '(SELECT keys FROM ids)::text[]')}, k AS (
     ${countChangeSql('SELECT queue, status, -1 FROM d')}
   ), ec AS (
     ${endedCountSql(`SELECT ended_at, ${endedKindSql('status', 'job_status')} FROM a WHERE ended_at >= ${endedCutoff}
       UNION ALL SELECT finished_at, 'completed' FROM d WHERE final_attempt_id IS NOT NULL AND finished_at >= ${endedCutoff}
       UNION ALL SELECT at, 'canceled' FROM e WHERE kind = 'canceled' AND at >= ${endedCutoff}`, '-1')}
   )
   SELECT (SELECT count(*) FROM d)::int AS n, (SELECT cutoff FROM w) AS cutoff, (SELECT max(finished_at) FROM c) AS last`,
);
// Every partition (an operator's PurgeJobs: the jobs asked for, exactly), or jobs_live only (the
// purger, which drops the partitions of days whole: days.ts).
export const purgeSql = purgeSqlOf('jobPurge', 'jobs');
const purgeLiveSql = purgeSqlOf('jobPurgeLive', 'jobs_live');

// A dry run: counts every job the purge would take, locking nothing.
const purgeCountSql = statement(
  'jobPurgeCount',
  `WITH ${cutoffCte}
   SELECT (SELECT count(*) FROM jobs j, w WHERE ${purgeWhere})::int AS n, (SELECT cutoff FROM w) AS cutoff`,
);

const olderThanSchema = z
  .int()
  .min(1000, 'must be at least 1 second')
  .max(limits.purgeOlderThanMs, `must be at most 1000 years (${limits.purgeOlderThanMs / 1000}s)`);

/**
 * Deletes up to `limit` finished jobs older than the cutoff; returns how many, the cutoff, and the
 * finish time of the last one it took (for `after`).
 * Callers repeat it until fewer than `limit` come back. A dry run counts them all and deletes
 * nothing.
 */
export async function jobPurge(db: Queryable, p: PurgeParams): Promise<Outcome<{ purged: number; cutoff: Date; last?: Date }>> {
  const bad = checkAll(
    check('olderThanMs', olderThanSchema, p.olderThanMs),
    p.statuses === undefined
      ? undefined
      : check('statuses', z.array(z.enum(FINISHED_STATUSES, `must be one of ${FINISHED_STATUSES.join(', ')} (only finished jobs are purged)`)), p.statuses),
    p.queue === undefined ? undefined : check('queue', schemas.queue, p.queue),
    p.limit === undefined ? undefined : check('limit', z.int().min(1).max(100_000), p.limit),
  );
  if (bad) return bad;
  const params = [p.olderThanMs, p.statuses?.length ? p.statuses : FINISHED_STATUSES, p.queue ?? null, p.now ?? null];
  if (p.dryRun) {
    const [row] = await run<{ n: number; cutoff: Date }>(db, purgeCountSql, params);
    return ok({ purged: row!.n, cutoff: row!.cutoff });
  }
  const [row] = await run<{ n: number; cutoff: Date; last: Date | null }>(db, p.liveOnly ? purgeLiveSql : purgeSql, [...params, p.limit ?? 1000, p.after ?? null]);
  return ok({ purged: row!.n, cutoff: row!.cutoff, ...(row!.last ? { last: row!.last } : {}) });
}
