/**
 * Factories that insert rows in exact states without walking the state machine, for tests that
 * start from "a running job whose lease ended a minute ago". Each writes the history the real
 * transitions would have left (a live attempt in the row; a finished job's ended attempt, or for
 * a canceled one its cancel event, and the kept count), so the invariants hold for what it makes.
 */
import { randomUUID } from 'node:crypto';
import type pg from 'pg';
import { endedCountSql, endedKindSql } from '../../server/store/counts.js';
import { toJob, type Job } from '../../server/store/rows.js';
import type { JobStatus } from '../../server/domain/statuses.js';

export interface MakeJob {
  queue?: string;
  payload?: Record<string, unknown>;
  status?: JobStatus;
  priority?: number;
  runAt?: Date;
  maxAttempts?: number;
  /** Started attempts so far (default: 1 when running or finished by an attempt, 0 otherwise). */
  attemptsStarted?: number;
  agentId?: string;
  /** Start deadline (claimed) or lease (running); default a minute from now. */
  leaseExpiresAt?: Date;
  executionTimeoutMs?: number;
  executionDeadline?: Date;
  result?: Record<string, unknown>;
}

/**
 * Inserts one job in `status` (default `queued`). Held jobs get a live attempt numbered 1;
 * succeeded, failed and dead jobs an ended attempt 1 that made them so; canceled ones a cancel
 * event.
 */
export async function makeJob(db: pg.Pool | pg.PoolClient, o: MakeJob = {}): Promise<Job> {
  const status = o.status ?? 'queued';
  const held = status === 'claimed' || status === 'running';
  const ended = status === 'succeeded' || status === 'failed' || status === 'dead';
  const attemptId = held || ended ? randomUUID() : null;
  const agentId = held || ended ? (o.agentId ?? 'agent-1') : null;
  const lease = held ? (o.leaseExpiresAt ?? new Date(Date.now() + 60_000)) : null;
  const id = randomUUID();
  const { rows } = await db.query(
    `INSERT INTO jobs (id, queue, payload, priority, status, run_at, max_attempts, attempt_no, attempts_started,
                       current_attempt_id, agent_id, claimed_at, claim_deadline, started_at, lease_expires_at, execution_timeout_ms,
                       execution_deadline, result, finished_at)
     VALUES ($1, $2, $3::jsonb, $4, $5::job_status, coalesce($6, now()), $7, $8, $9, $10, $11,
             CASE WHEN $10::uuid IS NOT NULL THEN now() END, CASE WHEN $10::uuid IS NOT NULL THEN $12::timestamptz END,
             CASE WHEN $5::text = 'running' THEN now() END, $12, $13, $14,
             CASE WHEN $5::text = 'succeeded' THEN coalesce($15::jsonb, '{}') END,
             CASE WHEN $5::text IN ('succeeded', 'failed', 'dead', 'canceled') THEN now() END)
     RETURNING *, NULL::jsonb AS error`,
    [
      id,
      o.queue ?? 'default',
      JSON.stringify(o.payload ?? {}),
      o.priority ?? 0,
      status,
      o.runAt ?? null,
      o.maxAttempts ?? 5,
      held || ended ? 1 : 0,
      o.attemptsStarted ?? (status === 'running' || ended ? 1 : 0),
      held ? attemptId : null,
      held ? agentId : null,
      lease,
      o.executionTimeoutMs ?? null,
      o.executionDeadline ?? null,
      o.result ? JSON.stringify(o.result) : null,
    ],
  );
  const job = toJob(rows[0]);
  // Started attempts before the one the job holds now (or ended with): each left the job queued.
  const earlier = Math.max(0, (o.attemptsStarted ?? 0) - (status === 'running' || ended ? 1 : 0));
  if (earlier > 0) {
    await db.query(
      `WITH e AS (
         INSERT INTO attempts (id, job_id, attempt_no, agent_id, claimed_at, claim_deadline, started_at, ended_at, status, error, job_status)
         SELECT gen_random_uuid(), $1, g, 'agent-0', now() - make_interval(hours => $2 - g + 2), now() - make_interval(hours => $2 - g + 2),
                now() - make_interval(hours => $2 - g + 2), now() - make_interval(hours => $2 - g + 1), 'lease_expired',
                '{"message": "lease expired: no heartbeat from the agent", "reason": "lease_expired"}', 'queued'
         FROM generate_series(1, $2) g RETURNING 1
       )
       UPDATE jobs SET attempt_no = attempt_no + (SELECT count(*) FROM e), created_at = created_at - make_interval(hours => $2 + 3)
       WHERE id = $1`,
      [id, earlier],
    );
    job.attemptNo += earlier;
  }
  if (status === 'succeeded') {
    // As the completion keeps it: the attempt on the job's row, no row of attempts.
    await db.query(
      `UPDATE jobs SET final_attempt_id = $1, final_agent_id = $3, final_claimed_at = finished_at, final_claim_deadline = finished_at,
         final_started_at = finished_at WHERE id = $2`,
      [attemptId, id, agentId],
    );
    job.error = null;
  } else if (ended) {
    const how = { failed: 'failed', dead: 'lease_expired' }[status];
    const error = { message: status === 'failed' ? 'failed for good' : 'lease expired: no heartbeat from the agent' };
    await db.query(
      `INSERT INTO attempts (id, job_id, attempt_no, agent_id, claimed_at, claim_deadline, started_at, ended_at, status, error,
                             retryable, job_status)
       SELECT $1, id, attempt_no, $3, finished_at, finished_at, finished_at, finished_at, $4::attempt_status, $5::jsonb,
              CASE WHEN $4 = 'failed' THEN false END, status
       FROM jobs WHERE id = $2`,
      [attemptId, id, agentId, how, error && JSON.stringify(error)],
    );
    job.error = error;
  } else if (status === 'canceled') {
    await db.query(
      `INSERT INTO job_events (job_id, kind, at, data)
       SELECT id, 'canceled', finished_at, jsonb_build_object('status', 'canceled', 'finished_at', finished_at) FROM jobs WHERE id = $1`,
      [id],
    );
  }
  if (ended || status === 'canceled') {
    // The kept count a transition to it would have appended (server/store/counts.ts).
    await db.query('INSERT INTO job_counts (queue, status, n) VALUES ($1, $2::job_status, 1)', [job.queue, status]);
  }
  // And what its ended attempts and cancel appended to the per-minute counts.
  await db.query(
    endedCountSql(`SELECT a.ended_at, ${endedKindSql('a.status', 'a.job_status')} FROM attempt_log a WHERE a.job_id = $1
      UNION ALL SELECT e.at, 'canceled' FROM job_events e WHERE e.job_id = $1 AND e.kind = 'canceled'`),
    [id],
  );
  return job;
}

/** Inserts `n` queued jobs in one statement; returns their ids. */
export async function makeQueuedJobs(db: pg.Pool, n: number, queue = 'default'): Promise<string[]> {
  const { rows } = await db.query(
    `INSERT INTO jobs (queue, payload) SELECT $2, jsonb_build_object('i', g) FROM generate_series(1, $1) g RETURNING id`,
    [n, queue],
  );
  return rows.map((r) => r.id as string);
}
