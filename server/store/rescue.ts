/**
 * Recovery of held jobs whose time ran out, in one statement: a claim not started by its
 * deadline, a running attempt whose lease passed (its agent stopped heartbeating), and a
 * running attempt past its execution timeout (the lease is capped by it).
 */
import { z } from 'zod';
import { ok, type Outcome } from '../core/outcomes.js';
import { check, checkAll } from '../core/validation.js';
import { backoffSql, DEFAULT_BACKOFF, type Backoff } from './attempts.js';
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
// reapers never take the same job. The scan is served by jobs_lease_idx (lease_expires_at)
// WHERE status IN ('claimed', 'running').
//
// Where each goes: a claim that expired never started, so it returns to the queue where it
// stood (run_at kept) without counting. A lease that passed means the agent vanished: the job
// goes back at once, or to `dead` when its started attempts reached max_attempts. An execution
// timeout is the job's fault: retried after a backoff, or `dead` at the cap. A job going to
// `dead` writes its job.dead notification (always: it is an alert) in the same statement.
const rescueSql = statement(
  'jobRescueExpired',
  `WITH o AS (
     SELECT * FROM jobs
     WHERE status IN ('claimed', 'running') AND lease_expires_at < coalesce($4::timestamptz, now())
     ORDER BY lease_expires_at
     LIMIT $1
     FOR UPDATE SKIP LOCKED
   ), d AS (
     SELECT o.id,
       (CASE WHEN o.status = 'claimed' THEN 'claim_expired'
             WHEN o.execution_deadline IS NOT NULL AND o.lease_expires_at >= o.execution_deadline THEN 'timed_out'
             ELSE 'lease_expired' END)::attempt_status AS reason,
       (CASE WHEN o.status = 'running' AND o.attempts_started >= o.max_attempts THEN 'dead'
             ELSE 'queued' END)::job_status AS next
     FROM o
   ), u AS (
     UPDATE jobs j SET status = d.next,
       current_attempt_id = NULL, agent_id = NULL, lease_expires_at = NULL, execution_deadline = NULL,
       run_at = CASE WHEN d.next = 'queued' AND d.reason = 'timed_out'
                     THEN coalesce($4::timestamptz, now()) + ${backoffSql('j.attempts_started', '$2', '$3')}
                     ELSE j.run_at END,
       error = CASE d.reason
                 WHEN 'claim_expired' THEN j.error
                 WHEN 'timed_out' THEN jsonb_build_object('message', 'execution timeout passed', 'reason', 'timed_out',
                                                          'attemptNo', j.attempt_no, 'agentId', j.agent_id)
                 ELSE jsonb_build_object('message', 'lease expired: no heartbeat from the agent', 'reason', 'lease_expired',
                                         'attemptNo', j.attempt_no, 'agentId', j.agent_id) END,
       finished_at = CASE WHEN d.next = 'dead' THEN coalesce($4::timestamptz, now()) END,
       updated_at = coalesce($4::timestamptz, now())
     FROM d WHERE j.id = d.id
     RETURNING j.*
   ), a AS (
     UPDATE attempts t SET status = d.reason, ended_at = coalesce($4::timestamptz, now())
     FROM o JOIN d ON d.id = o.id WHERE t.id = o.current_attempt_id
     RETURNING t.*
   ), e AS (
     INSERT INTO job_events (job_id, attempt_id, kind, at, data)
     SELECT u.id, o.current_attempt_id,
       (CASE WHEN u.status = 'dead' THEN 'dead' ELSE d.reason::text END)::event_kind,
       u.updated_at, job_event_delta(to_jsonb(u), to_jsonb(o))
     FROM u JOIN o ON o.id = u.id JOIN d ON d.id = u.id
   )${outboxSql(`SELECT u.id AS job_id, u.queue, u.notify_url, CASE WHEN u.status = 'dead' THEN 'job.dead' END AS type,
       u.updated_at AS at, to_jsonb(u) AS job, to_jsonb(ra) AS attempt FROM u LEFT JOIN a ra ON ra.job_id = u.id`)}
   SELECT u.id AS job_id, u.queue, o.current_attempt_id AS attempt_id, o.attempt_no, o.agent_id, d.reason, u.status,
     -- Wakes every coordinator's dispatcher for the queues that got jobs back now.
     (SELECT count(pg_notify('${JOBS_CHANNEL}', q.queue))
      FROM (SELECT DISTINCT queue FROM u WHERE status = 'queued' AND run_at <= coalesce($4::timestamptz, now())) q) AS notified
   FROM u JOIN o ON o.id = u.id JOIN d ON d.id = u.id`,
);

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
