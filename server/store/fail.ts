/**
 * Fail: the current attempt reports failure (claimed or running → queued after a backoff,
 * failed for good, or dead at the attempt cap).
 */
import { z } from 'zod';
import { ok, type Outcome } from '../domain/outcomes.js';
import { check, checkJson, limits } from '../domain/validation.js';
import { checkRef, type AttemptRef } from './batch.js';
import { countChangeSql, endedCountSql, endedKindSql } from './counts.js';
import { withDays } from './days.js';
import { backoffSql, DEFAULT_BACKOFF, type Backoff } from './backoff.js';
import { attemptEndSql, endedColumn, movedRowSql, notifiedJob } from './ends.js';
import { repeatOrStale } from './explain.js';
import { outboxSql } from './outbox.js';
import { toJob, type Job } from './rows.js';
import { JOB_COLUMNS } from './schema.js';
import { run, statement, type Queryable } from './sql.js';

export interface FailParams extends AttemptRef {
  /** `{message, …}`: at most `limits.errorBytes` serialized. */
  error: { message: string; [k: string]: unknown };
  /** Retry (with backoff, or `dead` at the attempt cap), or fail for good. */
  retryable: boolean;
  backoff?: Backoff;
}

// The fence as in attemptComplete. The next state: `failed` when not retryable; `dead` when the
// started attempts (this one included) reached max_attempts; otherwise `queued` after a backoff.
// A retry updates the row in jobs_live (r); a failure for good or a dead letter moves it to its
// day's partition of jobs as a success does (m deletes it, f inserts it: endedColumn). The
// attempt's row keeps the error (stored once: the job's error is read from its attempts);
// job.failed / job.dead go to the outbox in the same statement; a retry notifies nobody.
const failSql = statement(
  'attemptFail',
  `WITH o AS (
     SELECT id, status, current_attempt_id, agent_id, attempt_no, attempts_started, max_attempts, claimed_at, claim_deadline,
       started_at, suspect_since, created_at
     FROM jobs_live
     WHERE current_attempt_id = $1 AND agent_id = $2 AND status IN ('claimed', 'running') AND ($3::uuid IS NULL OR id = $3)
     FOR UPDATE
   ), d AS (
     SELECT o.*, o.attempts_started + (o.status = 'claimed')::int AS started,
       (CASE WHEN NOT $5::boolean THEN 'failed'
             WHEN o.attempts_started + (o.status = 'claimed')::int >= o.max_attempts THEN 'dead'
             ELSE 'queued' END)::job_status AS next
     FROM o
   ), r AS (
     UPDATE jobs_live j SET status = d.next, attempts_started = d.started,
       current_attempt_id = NULL, agent_id = NULL, lease_expires_at = NULL, execution_deadline = NULL,
       claimed_at = NULL, claim_deadline = NULL, started_at = NULL, suspect_since = NULL,
       run_at = coalesce($8::timestamptz, now()) + ${backoffSql('d.started', '$6', '$7')},
       finished_at = NULL, updated_at = coalesce($8::timestamptz, now())
     FROM d WHERE j.id = d.id AND d.next = 'queued'
     RETURNING j.*
   ), m AS (
     DELETE FROM jobs_live j USING d WHERE j.id = d.id AND d.next <> 'queued' RETURNING j.*, d.next, d.started
   ), f AS (
     INSERT INTO jobs (${JOB_COLUMNS.join(', ')})
     SELECT ${movedRowSql('m', { ...endedColumn('coalesce($8::timestamptz, now())'), status: 'm.next', attempts_started: 'm.started' })} FROM m
     RETURNING *
   ), u AS (
     SELECT * FROM r UNION ALL SELECT * FROM f
   ), a AS (
     ${attemptEndSql(`SELECT d.current_attempt_id, u.id, d.attempt_no, d.agent_id, d.claimed_at, d.claim_deadline,
       coalesce(d.started_at, u.updated_at), u.updated_at, d.suspect_since, 'failed', $4::jsonb, $5::boolean, u.status,
       CASE WHEN u.status = 'queued' THEN u.run_at END, u.created_at
     FROM u JOIN d ON d.id = u.id`)}
   ), k AS (
     ${countChangeSql('SELECT u.queue, u.status, 1 FROM u')}
   ), ec AS (
     ${endedCountSql(`SELECT a.ended_at, ${endedKindSql('a.status', 'a.job_status')} FROM a`)}
   )${outboxSql(`SELECT u.id AS job_id, u.queue, u.notify_url,
       CASE u.status WHEN 'failed' THEN 'job.failed' WHEN 'dead' THEN 'job.dead' END AS type, u.updated_at AS at,
       ${notifiedJob('$4::jsonb')} AS job, to_jsonb(a) AS attempt FROM u JOIN a ON a.job_id = u.id`)}
   SELECT u.*, $4::jsonb AS error FROM u`,
);

const retryableSchema = z.boolean();
const errorSchema = z.object({ message: z.string().min(1, 'must not be empty') }).loose();

/**
 * Reports the attempt failed: `failed` for good, or retried after a backoff, or `dead` at the
 * attempt cap. Repeats are `duplicate` / `conflict` as for `attemptComplete`.
 */
export async function attemptFail(db: Queryable, p: FailParams): Promise<Outcome<Job>> {
  const bad = checkRef(p) ?? check('error', errorSchema, p.error) ?? check('retryable', retryableSchema, p.retryable);
  if (bad) return bad;
  const error = checkJson('error', p.error, { maxBytes: limits.errorBytes, object: true });
  if ('failure' in error) return error.failure;
  const backoff = p.backoff ?? DEFAULT_BACKOFF;
  const params = [p.attemptId, p.agentId, p.jobId ?? null, error.json, p.retryable, backoff.baseMs, backoff.maxMs, p.now ?? null];
  const [row] = await withDays(db, () => run<Record<string, unknown>>(db, failSql, params));
  if (row) return ok(toJob(row));
  return repeatOrStale(db, p, 'fail', { json: error.json, retryable: p.retryable }, 'failed');
}
