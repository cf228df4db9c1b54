/**
 * Recovery of held jobs whose time ran out, in one statement: a claim not started by its
 * deadline, a running attempt whose lease passed (its agent stopped heartbeating), and a
 * running attempt past its execution timeout (the lease is capped by it).
 */
import { z } from 'zod';
import { ok, type Outcome } from '../domain/outcomes.js';
import { check, checkAll } from '../domain/validation.js';
import { attemptEndSql, attemptJson, endedColumn, movedRowSql, notifiedJob } from './ends.js';
import { backoffSql, DEFAULT_BACKOFF, type Backoff } from './backoff.js';
import { withDays } from './days.js';
import { JOB_COLUMNS } from './schema.js';
import type { JobStatus, RescueReason } from '../domain/statuses.js';
import { JOBS_CHANNEL } from './notify.js';
import { countChangeSql, endedCountSql, endedKindSql } from './counts.js';
import { outboxSql } from './outbox.js';
import { run, statement, type Queryable } from './sql.js';

export interface RescueParams {
  /** At most this many jobs per statement. */
  limit: number;
  /** Backoff before retrying a job that ran past its execution timeout. */
  backoff?: Backoff;
  /**
   * Leave running attempts whose lease passed (`lease_expired`) where they are; start deadlines
   * (`claim_expired`) and execution timeouts (`timed_out`) are rescued as ever. The reaper sets it
   * for a grace after a database outage, while agents come back with what their outboxes hold.
   */
  holdLeaseExpired?: boolean;
  now?: Date;
}

/** One job the reaper took back. */
export interface Rescued {
  jobId: string;
  queue: string;
  /** The attempt that ended, and the agent that held it. */
  attemptId: string;
  attemptNo: number;
  agentId: string;
  reason: RescueReason;
  /** `queued` for another attempt, or `dead` at the attempt cap. */
  status: Extract<JobStatus, 'queued' | 'dead'>;
}

// Safe beside claims, completions and other reapers: candidates are locked FOR UPDATE SKIP
// LOCKED, so a job a completion is writing right now is skipped and looked at next run, and two
// reapers never take the same job. The scan walks the held jobs through jobs_current_attempt_uq
// (partial: only held jobs are in it, so it is as large as the work in flight, not the history)
// and keeps those whose start deadline or lease passed: there is no index on the lease, because
// one would turn every start and heartbeat into an index write (they are HOT updates without).
//
// Where each goes: a claim that expired never started, so it returns to the queue where it
// stood (run_at kept) without counting. A lease that passed means the agent vanished: the job
// goes back at once, or to `dead` when its started attempts reached max_attempts. An execution
// timeout is the job's fault: retried after a backoff, or `dead` at the cap. The attempt's row
// is written with how it ended (and, for a lease or a timeout, an error saying so); a job going
// to `dead` writes its job.dead notification (always: it is an alert) in the same statement.
//
// $5 (holdLeaseExpired) keeps the lease expiries out of the candidates, in the scan's own WHERE
// (not after the LIMIT, where held jobs would fill every batch and hide the claims behind them):
// a running attempt whose lease did not reach its execution deadline (reasonSql's
// lease_expired) is neither locked nor taken. The holder may still complete, fail or renew it
// (the fence is the attempt, not the lease); once the hold is lifted, what is still expired is
// taken as before. A flag, not a time: the reaper measures its grace on its own clock (a
// duration), never compared with the database's, and a lag ("expired more than the grace ago")
// would not hold what an outage longer than the grace let expire, the very case it is for.
const rescueSql = statement(
  'jobRescueExpired',
  `WITH d AS MATERIALIZED (
     SELECT o.*, ${reasonSql('o')} AS reason, ${nextSql('o')} AS next,
       CASE WHEN ${nextSql('o')} = 'queued' AND ${reasonSql('o')} = 'timed_out'
            THEN coalesce($4::timestamptz, now()) + ${backoffSql('o.attempts_started', '$2', '$3')} END AS retry_at
     FROM (
       SELECT id, queue, status, current_attempt_id, agent_id, attempt_no, attempts_started, max_attempts, lease_expires_at,
         execution_deadline, claimed_at, claim_deadline, started_at, suspect_since, created_at
       FROM jobs_live
       WHERE current_attempt_id IS NOT NULL AND lease_expires_at < coalesce($4::timestamptz, now())
         AND NOT ($5::boolean AND status = 'running' AND (execution_deadline IS NULL OR lease_expires_at < execution_deadline))
       ORDER BY lease_expires_at
       LIMIT $1
       FOR UPDATE SKIP LOCKED
     ) o
   ), a AS (
     ${attemptEndSql(`SELECT d.current_attempt_id, d.id, d.attempt_no, d.agent_id, d.claimed_at, d.claim_deadline, d.started_at,
       coalesce($4::timestamptz, now()), d.suspect_since, d.reason, ${errorSql('d')}, NULL, d.next, d.retry_at, d.created_at
     FROM d`)}
   ), m AS (
     -- Per job, by id: a retry's due time (random jitter: computed once, above), and for a job
     -- going to dead, its error and ended attempt as the notification shows them.
     SELECT jsonb_object_agg(d.id, d.retry_at) FILTER (WHERE d.retry_at IS NOT NULL) AS retry,
       jsonb_object_agg(d.id, jsonb_build_object('error', ${errorSql('d')},
         'attempt', ${attemptJson('d.current_attempt_id', 'd.attempt_no', 'd.agent_id', 'd.reason', 'd.claimed_at', 'd.started_at', 'coalesce($4::timestamptz, now())')}))
         FILTER (WHERE d.next = 'dead') AS dead
     FROM d
   ), r AS (
     -- A job queued again, by id, no join: updated in jobs_live.
     UPDATE jobs_live j SET status = 'queued',
       current_attempt_id = NULL, agent_id = NULL, lease_expires_at = NULL, execution_deadline = NULL,
       claimed_at = NULL, claim_deadline = NULL, started_at = NULL, suspect_since = NULL,
       run_at = coalesce(((SELECT retry FROM m) ->> j.id::text)::timestamptz, j.run_at),
       finished_at = NULL, updated_at = coalesce($4::timestamptz, now())
     WHERE j.id = ANY (ARRAY(SELECT id FROM d WHERE next = 'queued'))
     RETURNING j.*
   ), x AS (
     -- A dead letter moves to its day's partition of jobs, as every end does (ends.ts, endedColumn).
     DELETE FROM jobs_live j WHERE j.id = ANY (ARRAY(SELECT id FROM d WHERE next = 'dead')) RETURNING j.*
   ), f AS (
     INSERT INTO jobs (${JOB_COLUMNS.join(', ')})
     SELECT ${movedRowSql('x', { ...endedColumn('coalesce($4::timestamptz, now())'), status: "'dead'" })} FROM x
     RETURNING *
   ), u AS (
     SELECT * FROM r UNION ALL SELECT * FROM f
   ), k AS (
     ${countChangeSql('SELECT u.queue, u.status, 1 FROM u')}
   ), ec AS (
     ${endedCountSql(`SELECT a.ended_at, ${endedKindSql('a.status', 'a.job_status')} FROM a`)}
   )${outboxSql(`SELECT u.id AS job_id, u.queue, u.notify_url, 'job.dead' AS type, u.updated_at AS at,
       ${notifiedJob(`(SELECT dead FROM m) -> u.id::text -> 'error'`)} AS job, (SELECT dead FROM m) -> u.id::text -> 'attempt' AS attempt
     FROM u WHERE u.status = 'dead'`)}
   SELECT d.id AS job_id, d.queue, d.current_attempt_id AS attempt_id, d.attempt_no, d.agent_id, d.reason, d.next AS status,
     -- Wakes every coordinator's dispatcher for the queues that got jobs back now.
     (SELECT count(pg_notify('${JOBS_CHANNEL}', q.queue)) FROM (SELECT DISTINCT queue FROM d WHERE next = 'queued' AND retry_at IS NULL) q) AS notified
   FROM d`,
);

/** How the attempt of the held `jobs` row `t` (as it was) ended: its start deadline, its lease, or its execution timeout passed. */
function reasonSql(t: string): string {
  return `(CASE WHEN ${t}.status = 'claimed' THEN 'claim_expired'
                WHEN ${t}.execution_deadline IS NOT NULL AND ${t}.lease_expires_at >= ${t}.execution_deadline THEN 'timed_out'
                ELSE 'lease_expired' END)::attempt_status`;
}

/** What the held `jobs` row `t` (as it was) becomes: dead when a started attempt reached the cap, else queued again. */
function nextSql(t: string): string {
  return `(CASE WHEN ${t}.status = 'running' AND ${t}.attempts_started >= ${t}.max_attempts THEN 'dead' ELSE 'queued' END)::job_status`;
}

/** The error the reaper records for the attempt it ended, from `t` with `reason`, `attempt_no` and `agent_id`. */
function errorSql(t: string): string {
  const of = (reason: string, message: string) =>
    `jsonb_build_object('message', '${message}', 'reason', '${reason}', 'attemptNo', ${t}.attempt_no, 'agentId', ${t}.agent_id)`;
  return `CASE ${t}.reason WHEN 'timed_out' THEN ${of('timed_out', 'execution timeout passed')}
                           WHEN 'lease_expired' THEN ${of('lease_expired', 'lease expired: no heartbeat from the agent')} END`;
}

/** Built once: a zod schema costs tens of microseconds to build, and the reaper calls this every tick. */
const limitSchema = z.int().min(1).max(10_000);

/**
 * Ends up to `limit` expired attempts and requeues their jobs (`dead` at the cap). The reaper
 * calls it until it returns fewer than `limit`.
 */
export async function jobRescueExpired(db: Queryable, p: RescueParams): Promise<Outcome<Rescued[]>> {
  const bad = checkAll(check('limit', limitSchema, p.limit));
  if (bad) return bad;
  const backoff = p.backoff ?? DEFAULT_BACKOFF;
  const rows = await withDays(db, () => run<{
    job_id: string;
    queue: string;
    attempt_id: string;
    attempt_no: number;
    agent_id: string;
    reason: Rescued['reason'];
    status: Rescued['status'];
  }>(db, rescueSql, [p.limit, backoff.baseMs, backoff.maxMs, p.now ?? null, p.holdLeaseExpired ?? false]));
  return ok(
    rows.map((r) => ({
      jobId: r.job_id,
      queue: r.queue,
      attemptId: r.attempt_id,
      attemptNo: r.attempt_no,
      agentId: r.agent_id,
      reason: r.reason,
      status: r.status,
    })),
  );
}
