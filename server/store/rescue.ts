/**
 * Recovery of held jobs whose time ran out, in one statement: a claim not started by its
 * deadline, a running attempt whose lease passed (its agent stopped heartbeating), and a
 * running attempt past its execution timeout (the lease is capped by it).
 */
import { z } from 'zod';
import { ok, type Outcome } from '../core/outcomes.js';
import { check, checkAll } from '../core/validation.js';
import { attemptEndSql, attemptJson, backoffSql, DEFAULT_BACKOFF, notifiedJob, type Backoff } from './attempts.js';
import type { AttemptStatus, JobStatus } from './schema.js';
import { JOBS_CHANNEL } from './notify.js';
import { outboxSql } from './outbox.js';
import { run, statement, type Queryable } from './sql.js';

export interface RescueParams {
  /** At most this many jobs per statement. */
  limit: number;
  /** Backoff before retrying a job that ran past its execution timeout. */
  backoff?: Backoff;
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
  reason: Extract<AttemptStatus, 'claim_expired' | 'lease_expired' | 'timed_out'>;
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
const rescueSql = statement(
  'jobRescueExpired',
  `WITH o AS (
     SELECT id, status, current_attempt_id, agent_id, attempt_no, attempts_started, max_attempts, lease_expires_at,
       execution_deadline, claimed_at, claim_deadline, started_at, suspect_since
     FROM jobs
     WHERE current_attempt_id IS NOT NULL AND lease_expires_at < coalesce($4::timestamptz, now())
     ORDER BY lease_expires_at
     LIMIT $1
     FOR UPDATE SKIP LOCKED
   ), d AS (
     SELECT o.*,
       (CASE WHEN o.status = 'claimed' THEN 'claim_expired'
             WHEN o.execution_deadline IS NOT NULL AND o.lease_expires_at >= o.execution_deadline THEN 'timed_out'
             ELSE 'lease_expired' END)::attempt_status AS reason,
       (CASE WHEN o.status = 'running' AND o.attempts_started >= o.max_attempts THEN 'dead'
             ELSE 'queued' END)::job_status AS next
     FROM o
   ), u AS (
     UPDATE jobs j SET status = d.next,
       current_attempt_id = NULL, agent_id = NULL, lease_expires_at = NULL, execution_deadline = NULL,
       claimed_at = NULL, claim_deadline = NULL, started_at = NULL, suspect_since = NULL,
       run_at = CASE WHEN d.next = 'queued' AND d.reason = 'timed_out'
                     THEN coalesce($4::timestamptz, now()) + ${backoffSql('j.attempts_started', '$2', '$3')}
                     ELSE j.run_at END,
       finished_at = CASE WHEN d.next = 'dead' THEN coalesce($4::timestamptz, now()) END,
       updated_at = coalesce($4::timestamptz, now())
     FROM d WHERE j.id = d.id
     -- The attempt as the row held it, carried along so that no later CTE joins u to d (CTEs
     -- have no statistics: such a join is planned as a nested loop, n² for n jobs).
     RETURNING j.*, d.current_attempt_id AS d_attempt_id, d.agent_id AS d_agent_id, d.claimed_at AS d_claimed_at,
       d.claim_deadline AS d_claim_deadline, d.started_at AS d_started_at, d.suspect_since AS d_suspect_since, d.reason AS d_reason
   ), a AS (
     ${attemptEndSql(`SELECT u.d_attempt_id, u.id, u.attempt_no, u.d_agent_id, u.d_claimed_at, u.d_claim_deadline, u.d_started_at,
       u.updated_at, u.d_suspect_since, u.d_reason,
       CASE u.d_reason WHEN 'timed_out' THEN ${reaperError('timed_out')} WHEN 'lease_expired' THEN ${reaperError('lease_expired')} END,
       NULL, u.status, CASE WHEN u.d_reason = 'timed_out' AND u.status = 'queued' THEN u.run_at END
     FROM u`)}
   )${outboxSql(`SELECT u.id AS job_id, u.queue, u.notify_url, 'job.dead' AS type,
       u.updated_at AS at, ${notifiedJob(`CASE u.d_reason WHEN 'timed_out' THEN ${reaperError('timed_out')} ELSE ${reaperError('lease_expired')} END`)} AS job,
       ${attemptJson('u.d_attempt_id', 'u.attempt_no', 'u.d_agent_id', 'u.d_reason', 'u.d_claimed_at', 'u.d_started_at', 'u.updated_at')} AS attempt
     FROM u WHERE u.status = 'dead'`)}
   SELECT u.id AS job_id, u.queue, u.d_attempt_id AS attempt_id, u.attempt_no, u.d_agent_id AS agent_id, u.d_reason AS reason, u.status,
     -- Wakes every coordinator's dispatcher for the queues that got jobs back now.
     (SELECT count(pg_notify('${JOBS_CHANNEL}', q.queue))
      FROM (SELECT DISTINCT queue FROM u WHERE status = 'queued' AND run_at <= coalesce($4::timestamptz, now())) q) AS notified
   FROM u`,
);

/** The error the reaper records for an attempt it ended (of the `jobs` row `u`, its attempt carried along). */
function reaperError(reason: 'timed_out' | 'lease_expired'): string {
  const message = reason === 'timed_out' ? 'execution timeout passed' : 'lease expired: no heartbeat from the agent';
  return `jsonb_build_object('message', '${message}', 'reason', '${reason}', 'attemptNo', u.attempt_no, 'agentId', u.d_agent_id)`;
}

/**
 * Ends up to `limit` expired attempts and requeues their jobs (`dead` at the cap). The reaper
 * calls it until it returns fewer than `limit`.
 */
export async function jobRescueExpired(db: Queryable, p: RescueParams): Promise<Outcome<Rescued[]>> {
  const bad = checkAll(check('limit', z.int().min(1).max(10_000), p.limit));
  if (bad) return bad;
  const backoff = p.backoff ?? DEFAULT_BACKOFF;
  const rows = await run<{
    job_id: string;
    queue: string;
    attempt_id: string;
    attempt_no: number;
    agent_id: string;
    reason: Rescued['reason'];
    status: Rescued['status'];
  }>(db, rescueSql, [p.limit, backoff.baseMs, backoff.maxMs, p.now ?? null]);
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
