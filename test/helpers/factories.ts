/**
 * Factories that insert rows in exact states without walking the state machine, for tests that
 * start from "a running job whose lease ended a minute ago". Each writes the job's attempts and
 * one `enqueued` event carrying the whole row, so the invariants hold for what it makes.
 */
import { randomUUID } from 'node:crypto';
import type pg from 'pg';
import { toJob, type Job } from '../../server/store/rows.js';
import type { JobStatus } from '../../server/store/schema.js';

export interface MakeJob {
  queue?: string;
  payload?: Record<string, unknown>;
  status?: JobStatus;
  priority?: number;
  runAt?: Date;
  maxAttempts?: number;
  /** Started attempts so far (default: 1 when running, 0 otherwise). */
  attemptsStarted?: number;
  agentId?: string;
  /** Start deadline (claimed) or lease (running); default a minute from now. */
  leaseExpiresAt?: Date;
  executionTimeoutMs?: number;
  executionDeadline?: Date;
  result?: Record<string, unknown>;
}

/** Inserts one job in `status` (default `queued`); held jobs get a current attempt numbered 1. */
export async function makeJob(db: pg.Pool | pg.PoolClient, o: MakeJob = {}): Promise<Job> {
  const status = o.status ?? 'queued';
  const held = status === 'claimed' || status === 'running';
  const attemptId = held ? randomUUID() : null;
  const agentId = held ? (o.agentId ?? 'agent-1') : null;
  const lease = held ? (o.leaseExpiresAt ?? new Date(Date.now() + 60_000)) : null;
  const id = randomUUID();
  const { rows } = await db.query(
    `WITH j AS (
       INSERT INTO jobs (id, queue, payload, priority, status, run_at, max_attempts, attempt_no, attempts_started,
                         current_attempt_id, last_attempt_id, agent_id, lease_expires_at, execution_timeout_ms,
                         execution_deadline, result, finished_at)
       VALUES ($1, $2, $3::jsonb, $4, $5::job_status, coalesce($6, now()), $7, $8, $9, $10, $10, $11, $12, $13, $14, $15::jsonb,
               CASE WHEN $5::text IN ('succeeded', 'failed', 'dead', 'canceled') THEN now() END)
       RETURNING *
     ), e AS (
       INSERT INTO job_events (job_id, kind, at, data)
       SELECT j.id, 'enqueued', j.created_at, job_event_delta(to_jsonb(j), '{}'::jsonb) FROM j
     )
     SELECT * FROM j`,
    [
      id,
      o.queue ?? 'default',
      JSON.stringify(o.payload ?? {}),
      o.priority ?? 0,
      status,
      o.runAt ?? null,
      o.maxAttempts ?? 5,
      held ? 1 : 0,
      o.attemptsStarted ?? (status === 'running' ? 1 : 0),
      attemptId,
      agentId,
      lease,
      o.executionTimeoutMs ?? null,
      o.executionDeadline ?? null,
      o.result ? JSON.stringify(o.result) : null,
    ],
  );
  if (held) {
    await db.query(
      `INSERT INTO attempts (id, job_id, attempt_no, agent_id, status, claimed_at, claim_deadline, started_at)
       VALUES ($1, $2, 1, $3, $4::attempt_status, now(), $5, CASE WHEN $4::text = 'running' THEN now() END)`,
      [attemptId, id, agentId, status, lease],
    );
  }
  return toJob(rows[0]);
}

/** Inserts `n` queued jobs in one statement (with their events); returns their ids. */
export async function makeQueuedJobs(db: pg.Pool, n: number, queue = 'default'): Promise<string[]> {
  const { rows } = await db.query(
    `WITH j AS (
       INSERT INTO jobs (queue, payload) SELECT $2, jsonb_build_object('i', g) FROM generate_series(1, $1) g RETURNING *
     ), e AS (
       INSERT INTO job_events (job_id, kind, at, data)
       SELECT j.id, 'enqueued', j.created_at, job_event_delta(to_jsonb(j), '{}'::jsonb) FROM j
     )
     SELECT id FROM j`,
    [n, queue],
  );
  return rows.map((r) => r.id as string);
}
