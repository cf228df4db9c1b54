/**
 * Job counts per queue and status, kept rather than counted (the `job_counts` table).
 *
 * Finished jobs are the history: counting them on every read scanned every job kept (885 ms at
 * ten million, docs/performance-history.md). So each statement that moves jobs into a finished status
 * or out of one appends its change, in the same statement (`countChangeSql`): one row per queue
 * and status it touched, `n` the signed number of jobs. Appending, never updating a total, so
 * concurrent transitions never wait on one another's row. `jobCountsCompact` folds the rows
 * (the purger does it each run); a read sums what is there.
 *
 * Live jobs (queued, claimed, running) are not kept: they are counted from the partial indexes
 * that hold exactly them (`jobs_claim_idx`, `jobs_current_attempt_uq`), small however much
 * history the table holds.
 *
 * A change made outside these statements (an operator's hand-written SQL, a coordinator of an
 * older version during a rolling upgrade) is not seen; `jobCountsReconcile` recounts the
 * finished jobs and replaces what is kept, reporting the drift it corrected. The purger runs it
 * once at its start and then every `reconcileEveryMs`.
 */
import { FINISHED_STATUSES, type JobStatus } from '../domain/statuses.js';
import { run, statement, withTransaction, type Queryable } from './sql.js';

const finished = `'{${FINISHED_STATUSES.join(',')}}'::job_status[]`;

/**
 * A CTE body (for `name AS (...)`) recording the change of `source`, a SELECT yielding rows
 * `(queue, status, n)`: per job, its queue, a status and +1 (it entered that status) or -1 (it
 * left it). Rows of live statuses are ignored. Nothing is written when nothing finished.
 */
export function countChangeSql(source: string): string {
  return `INSERT INTO job_counts (queue, status, n)
     SELECT x.queue, x.status, sum(x.n)::int8 FROM (${source}) AS x(queue, status, n)
     WHERE x.status = ANY (${finished})
     GROUP BY x.queue, x.status HAVING sum(x.n) <> 0`;
}

/**
 * What GetStats counts an ended attempt as, from its `attempts` row's status and its job's
 * status after it (SQL expressions): a transition that made the job dead is `dead` only, a
 * failure that queued the job again `retry_scheduled`, a success `completed`, else the status.
 */
export const endedKindSql = (status: string, jobStatus: string) =>
  `CASE WHEN ${jobStatus} = 'dead' THEN 'dead'
        WHEN ${status} = 'succeeded' THEN 'completed'
        WHEN ${status} = 'failed' AND ${jobStatus} = 'queued' THEN 'retry_scheduled'
        ELSE ${status}::text END`;

/**
 * A CTE body recording what `source` ended, a SELECT yielding rows `(at, kind)`: per ended
 * attempt (or canceled queued job) its end time and kind (`endedKindSql`). One row per minute
 * and kind, appended as `countChangeSql`'s are; with `sign` -1, taken away (the purge).
 */
export function endedCountSql(source: string, sign: '1' | '-1' = '1'): string {
  return `INSERT INTO ended_counts (minute, kind, n)
     SELECT date_trunc('minute', x.at), x.kind, ${sign} * count(*) FROM (${source}) AS x(at, kind) GROUP BY 1, 2`;
}

/** The minutes kept: GetStats' longest window, 1440 minutes, ends with the current one. */
export const ENDED_MINUTES_KEPT = 1440;
export const endedCutoff = `date_trunc('minute', now()) - ${ENDED_MINUTES_KEPT - 1} * interval '1 minute'`;

/**
 * What ended in the kept minutes, counted from the rows the transitions write (the ended attempts
 * of `attempt_log`, through attempts_ended_brin and jobs_finished_idx, and the cancels of queued
 * jobs, through job_events_at_brin), as `(minute, kind, n)`: what `ended_counts` holds when
 * nothing was missed or purged.
 */
export const endedScanSql = `
     SELECT date_trunc('minute', x.at) AS minute, x.kind, count(*)::int8 AS n FROM (
       SELECT a.ended_at, ${endedKindSql('a.status', 'a.job_status')} FROM attempt_log a WHERE a.ended_at >= ${endedCutoff}
       UNION ALL
       SELECT e.at, 'canceled' FROM job_events e WHERE e.at >= ${endedCutoff} AND e.kind = 'canceled'
     ) AS x(at, kind)
     GROUP BY 1, 2`;

// What is kept, plus the live jobs counted from their partial indexes: "queued" spelled as
// jobs_claim_idx's predicate, held as jobs_current_attempt_uq's. Grouped by the enum's order.
export const countsReadSql = statement(
  'jobCountsRead',
  `SELECT queue, status::text AS status, sum(n)::int8 AS count FROM (
     SELECT queue, status, n FROM job_counts
     UNION ALL
     SELECT queue, 'queued'::job_status, count(*) FROM jobs_live WHERE current_attempt_id IS NULL AND finished_at IS NULL GROUP BY queue
     UNION ALL
     SELECT queue, status, count(*) FROM jobs_live WHERE current_attempt_id IS NOT NULL GROUP BY queue, status
   ) c
   GROUP BY queue, status HAVING sum(n) <> 0
   ORDER BY queue, status`,
);

/** How many jobs of a queue are in one status. */
export interface QueueDepth {
  queue: string;
  status: JobStatus;
  count: number;
}

/** Jobs per queue and status (only those with at least one), from one snapshot of `db`. */
export async function jobCounts(db: Queryable): Promise<QueueDepth[]> {
  return run<{ queue: string; status: JobStatus; count: number }>(db, countsReadSql, []);
}

// One at a time across replicas (a transaction-scoped advisory lock; the key is arbitrary
// and used for nothing else): two folds at once would each sum what they both deleted.
const COUNTS_LOCK = 0x6c68_636e; // "lhcn"

// Every row visible to the statement is deleted and its sum written back: rows appended
// meanwhile are not visible to it, so they stay and are folded next time.
const compactSql = statement(
  'jobCountsCompact',
  `WITH d AS (DELETE FROM job_counts RETURNING queue, status, n)
   INSERT INTO job_counts (queue, status, n)
   SELECT queue, status, sum(n)::int8 FROM d GROUP BY queue, status HAVING sum(n) <> 0`,
);

// The minutes and kinds with more than one row (appended since the last fold) folded into one;
// the others are left as they are, so a fold rewrites what changed, not the day kept.
const endedCompactSql = statement(
  'endedCountsCompact',
  `WITH g AS (
     SELECT minute, kind FROM ended_counts GROUP BY minute, kind HAVING count(*) > 1
   ), d AS (
     DELETE FROM ended_counts c USING g WHERE c.minute = g.minute AND c.kind = g.kind RETURNING c.minute, c.kind, c.n
   )
   INSERT INTO ended_counts (minute, kind, n) SELECT minute, kind, sum(n)::int8 FROM d GROUP BY minute, kind HAVING sum(n) <> 0`,
);

const endedTrimSql = statement('endedCountsTrim', `DELETE FROM ended_counts WHERE minute < ${endedCutoff}`);

// As reconcileSql, for the kept minutes: the scan written in place of what was kept, in one
// statement; returns how many minutes and kinds differed.
const endedReconcileSql = statement(
  'endedCountsReconcile',
  `WITH d AS (
     DELETE FROM ended_counts RETURNING minute, kind, n
   ), kept AS (
     SELECT minute, kind, sum(n)::int8 AS n FROM d WHERE minute >= ${endedCutoff} GROUP BY 1, 2
   ), counted AS (${endedScanSql}
   ), w AS (
     INSERT INTO ended_counts (minute, kind, n) SELECT minute, kind, n FROM counted
   )
   SELECT count(*)::int AS differ
   FROM kept k FULL JOIN counted c ON c.minute = k.minute AND c.kind = k.kind
   WHERE coalesce(k.n, 0) <> coalesce(c.n, 0)`,
);

// The finished jobs counted and written in place of what was kept, in one statement (one
// snapshot): a change committed after it began is neither counted nor deleted, so it stays,
// as it should. Returns the kept and the counted figure of each queue and status that differ.
const reconcileSql = statement(
  'jobCountsReconcile',
  `WITH d AS (
     DELETE FROM job_counts RETURNING queue, status, n
   ), kept AS (
     SELECT queue, status, sum(n)::int8 AS n FROM d GROUP BY 1, 2
   ), counted AS (
     SELECT queue, status, count(*)::int8 AS n FROM jobs WHERE finished_at IS NOT NULL GROUP BY 1, 2
   ), w AS (
     INSERT INTO job_counts (queue, status, n) SELECT queue, status, n FROM counted
   )
   SELECT coalesce(k.queue, c.queue) AS queue, coalesce(k.status, c.status)::text AS status,
     coalesce(k.n, 0)::int8 AS kept, coalesce(c.n, 0)::int8 AS counted
   FROM kept k FULL JOIN counted c ON c.queue = k.queue AND c.status = k.status
   WHERE coalesce(k.n, 0) <> coalesce(c.n, 0)
   ORDER BY 1, 2`,
);

const lockSql = statement('jobCountsLock', `SELECT pg_try_advisory_xact_lock(${COUNTS_LOCK}) AS locked`);

/** Folds the kept counts into one row per queue and status; false when another fold was running. */
export async function jobCountsCompact(db: Queryable): Promise<boolean> {
  return withTransaction(db, async (tx) => {
    const [l] = await run<{ locked: boolean }>(tx, lockSql, []);
    if (!l?.locked) return false;
    await run(tx, compactSql, []);
    await run(tx, endedCompactSql, []);
    await run(tx, endedTrimSql, []);
    return true;
  });
}

/** A queue and status whose kept count differed from the jobs counted. */
export interface CountDrift {
  queue: string;
  status: JobStatus;
  kept: number;
  counted: number;
}

/**
 * Recounts the finished jobs (a scan of them) and keeps that; returns where the kept counts had
 * drifted, or null when another fold or recount was running.
 */
export async function jobCountsReconcile(db: Queryable): Promise<CountDrift[] | null> {
  return withTransaction(db, async (tx) => {
    const [l] = await run<{ locked: boolean }>(tx, lockSql, []);
    if (!l?.locked) return null;
    return run<CountDrift>(tx, reconcileSql, []);
  });
}

/**
 * Recounts what ended in the kept minutes (a scan of the last day's attempts and cancels) and
 * keeps that; returns how many minutes and kinds had drifted, or null when another fold or
 * recount was running. (The purge takes back what it deletes, so only a change behind the
 * transitions' back makes the two differ.)
 */
export async function endedCountsReconcile(db: Queryable): Promise<number | null> {
  return withTransaction(db, async (tx) => {
    const [l] = await run<{ locked: boolean }>(tx, lockSql, []);
    if (!l?.locked) return null;
    const [r] = await run<{ differ: number }>(tx, endedReconcileSql, []);
    return r?.differ ?? 0;
  });
}
