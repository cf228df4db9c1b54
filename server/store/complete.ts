/**
 * Complete: the current attempt reports success (claimed or running → succeeded). The job's row
 * moves to its day's partition with its result, stored once, and its attempt kept on the row
 * (the `final_*` columns); the job.succeeded notification goes to the outbox in the same
 * statement. One attempt (the unary API) or many (the agent stream's `Completed`, per tick).
 */
import { ok, type Outcome } from '../domain/outcomes.js';
import { checkJson, limits } from '../domain/validation.js';
import { batchFence, byAttempt, checkRef, fenceParams, firstOfEach, type AttemptRef, type Shape } from './batch.js';
import { countChangeSql, endedCountSql } from './counts.js';
import { withDays } from './days.js';
import { attemptJson, endedColumn, movedRowSql, notifiedJob } from './ends.js';
import { repeatOrStale } from './explain.js';
import { outboxSql } from './outbox.js';
import { toJob, toSummary, type Job, type JobSummary } from './rows.js';
import { JOB_COLUMNS } from './schema.js';
import { run, statement, type Queryable } from './sql.js';

export interface CompleteParams extends AttemptRef {
  /** A JSON object, at most `limits.resultBytes` serialized. */
  result: unknown;
}

/**
 * The part of a completion after its CTEs `d` (the rows as they were deleted from jobs_live, with
 * their attempt's claim and start) and `u` (the jobs as they finished, `$5` the time given or
 * NULL): the job.succeeded notification, each carrying its attempt, to the outbox, only when
 * someone listens.
 */
const succeededNotificationSql = `n AS (
       -- The ended attempts by job, for the notifications (looked up, not joined).
       SELECT jsonb_object_agg(d.id, ${attemptJson('d.current_attempt_id', 'd.attempt_no', 'd.agent_id', "'succeeded'", 'd.claimed_at', 'coalesce(d.started_at, coalesce($5::timestamptz, now()))', 'coalesce($5::timestamptz, now())')}) AS m
       FROM d
     )${outboxSql(`SELECT u.id AS job_id, u.queue, u.notify_url, 'job.succeeded' AS type, u.finished_at AS at,
         ${notifiedJob('NULL::jsonb')} AS job, (SELECT m FROM n) -> u.id::text AS attempt
       FROM u
       WHERE u.notify_url IS NOT NULL OR EXISTS (SELECT 1 FROM subscriptions sub WHERE sub.queue IN (u.queue, '*'))`)}`;

// What a success changes besides (endedColumn): its attempt goes to the final_* columns (its end
// is finished_at) and its result is stored on the row.
const movedColumn: Record<string, string> = {
  ...endedColumn('coalesce($5::timestamptz, now())'),
  status: `'succeeded'`,
  result: '$4::jsonb -> d.current_attempt_id::text',
  attempts_started: "d.attempts_started + (d.status = 'claimed')::int",
  final_attempt_id: 'd.current_attempt_id',
  final_agent_id: 'd.agent_id',
  final_claimed_at: 'd.claimed_at',
  final_claim_deadline: 'd.claim_deadline',
  final_started_at: 'coalesce(d.started_at, coalesce($5::timestamptz, now()))',
  final_suspect_since: 'd.suspect_since',
};

// The fence (batchFence), the attempt claimed or running. Completing a claimed attempt starts it
// implicitly (it counts toward max_attempts). Many attempts in one statement, none joined to
// another relation: d deletes each job's row from jobs_live where the fence holds, and u inserts
// it into jobs, which routes it to its day's partition (movedColumn: its attempt in the final_*
// columns, its result, stored once, looked up by its attempt in $4). The fence is the DELETE's
// own condition, with no row lock before it: a concurrent statement on the row (a heartbeat, the
// reaper, a cancel) either commits first, and the DELETE, having waited for it, checks the fence
// again on the row as that statement left it (READ COMMITTED), or waits for this one and then
// finds the row gone, as it finds a finished job. A FOR UPDATE before the DELETE wrote a lock
// record on every row it then deleted (54 B of WAL a job, docs/decisions.md). The move is an
// explicit delete, not an UPDATE of the partition key, which PostgreSQL would answer with a
// serialization failure instead. The job.succeeded notification goes to the outbox in the same
// statement, only when someone listens.
//
// Each in two forms: with the outbox's CTEs, and without them (`unheard`) for the jobs no one
// listens to, which PostgreSQL would otherwise set up on every execution for no row: their two
// INSERT nodes and a materialized CTE, about 90 µs of a backend's CPU a statement, 22 µs a job at
// four a statement (docs/performance.md, "CPU time beside the floor"). The second form completes
// only jobs without a notify_url in queues no subscription names (nor '*'): what the first would
// have found, in the same snapshot. A job it leaves is completed by the first (`completeMany`).
const UNHEARD = `
       AND j.notify_url IS NULL AND NOT EXISTS (SELECT 1 FROM subscriptions sub WHERE sub.queue IN (j.queue, '*'))`;
const completeSql = (shape: Shape, unheard: boolean) =>
  statement(
    `${shape === 'job' ? 'attemptComplete' : 'attemptCompleteMany'}${unheard ? 'Unheard' : ''}`,
    `WITH d AS (
       DELETE FROM jobs_live j WHERE ${batchFence} AND j.status IN ('claimed', 'running')${unheard ? UNHEARD : ''} RETURNING j.*
     ), u AS (
       INSERT INTO jobs (${JOB_COLUMNS.join(', ')})
       SELECT ${movedRowSql('d', movedColumn)} FROM d
       RETURNING *
     ), k AS (
       ${countChangeSql('SELECT u.queue, u.status, 1 FROM u')}
     ), ec AS (
       ${endedCountSql(`SELECT u.finished_at, 'completed' FROM u`)}
     )${unheard ? '' : `, ${succeededNotificationSql}`}
     ${
       shape === 'job'
         ? 'SELECT d.current_attempt_id AS reported_by, u.*, NULL::jsonb AS error FROM u JOIN d ON d.id = u.id'
         : `SELECT d.current_attempt_id AS reported_by, d.id, d.queue, 'succeeded' AS status, d.attempt_no, NULL AS current_attempt_id,
              date_part('epoch', d.run_at) * 1000 AS run_at_ms, date_part('epoch', coalesce($5::timestamptz, now())) * 1000 AS updated_at_ms,
              NULL AS lease_ms
            FROM d`
     }`,
  );
const completeSqls = {
  job: { heard: completeSql('job', false), unheard: completeSql('job', true) },
  summary: { heard: completeSql('summary', false), unheard: completeSql('summary', true) },
};

/**
 * Until when (`Date.now()`) completions go straight to the statement with the outbox: set when
 * the statement without it left a job that the one with it then completed (a job with a
 * notify_url, or a subscription of its queue), so that while someone listens a completion takes
 * one statement, not two. A choice between two statements that complete the same jobs the same
 * way, never a reason to skip a notification. Tests set it back to 0.
 */
export const heardCompletions = { until: 0 };
/** How long one completion that needed the outbox sends the next ones straight to it. */
export const HEARD_COMPLETIONS_MS = 60_000;

/**
 * Completes the job with `result`, stored once. A repeat with the same result is `duplicate`
 * carrying the stored result; another result (or a failure report) from the same attempt is
 * `conflict`; a non-current attempt is `stale`.
 */
export async function attemptComplete(db: Queryable, p: CompleteParams): Promise<Outcome<Job>> {
  const [o] = await completeMany(db, { items: [p], ...(p.now ? { now: p.now } : {}) }, 'job');
  return o as Outcome<Job>;
}

/**
 * Completes many attempts in one statement (the coordinator groups the `Completed` of all its
 * agents per tick); one outcome per item, in order, as `attemptComplete` would give, each with a
 * summary of the job (a repeat's carries the stored result).
 */
export async function attemptCompleteMany(db: Queryable, p: { items: CompleteParams[]; now?: Date }): Promise<Array<Outcome<JobSummary>>> {
  return completeMany(db, p, 'summary');
}

async function completeMany(db: Queryable, p: { items: CompleteParams[]; now?: Date }, shape: Shape): Promise<Array<Outcome<JobSummary>>> {
  const json: string[] = [];
  const out: Array<Outcome<JobSummary> | undefined> = p.items.map((item, k) => {
    const bad = checkRef(item);
    if (bad) return bad;
    const r = checkJson('result', item.result, { maxBytes: limits.resultBytes, object: true });
    if ('failure' in r) return r.failure;
    json[k] = r.json;
    return undefined;
  });
  let batch = firstOfEach(p.items, out);
  // Without the outbox first, unless completions needed it lately; what that leaves, with it.
  const forms = Date.now() < heardCompletions.until ? (['heard'] as const) : (['unheard', 'heard'] as const);
  for (const [n, form] of forms.entries()) {
    if (!batch.length) break;
    const items = batch.map((k) => p.items[k]!);
    const fence = fenceParams(items);
    const params = [...fence, byAttempt(fence[0], (i) => json[batch[i]!]), p.now ?? null];
    const rows = await withDays(db, () => run<Record<string, unknown>>(db, completeSqls[shape][form], params));
    // The statement with the outbox completed what the one without it left: someone listens.
    if (n > 0 && rows.length) heardCompletions.until = Date.now() + HEARD_COMPLETIONS_MS;
    const done = new Map(rows.map(({ reported_by, ...r }) => [reported_by as string, r]));
    for (const k of batch) {
      const row = done.get(p.items[k]!.attemptId.toLowerCase());
      if (row) out[k] = ok(shape === 'job' ? toJob(row) : toSummary(row as never));
    }
    batch = batch.filter((k) => !out[k]);
  }
  for (const [k, item] of p.items.entries()) {
    if (out[k]) continue;
    out[k] = await repeatOrStale(db, item, 'complete', { json: json[k]!, retryable: null }, 'completed');
  }
  return out as Array<Outcome<JobSummary>>;
}
