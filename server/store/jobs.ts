/**
 * Job verbs that are not made on behalf of an attempt: enqueue, cancel, requeue, get, list.
 * Each is one statement (or, for `jobGet`, one read-only snapshot). The enqueue is recorded by
 * the row it inserts; a cancel ends the held attempt (its `attempts` row) or, for a queued job,
 * appends a `job_events` row, as a requeue does.
 */
import { asc, desc, eq } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/node-postgres';
import pg from 'pg';
import { z } from 'zod';
import { conflict, duplicate, invalid, notFound, ok, type Outcome } from '../domain/outcomes.js';
import { check, checkAll, checkJson, limits, schemas, valid } from '../domain/validation.js';
import { attemptEndSql, endedColumn, movedRowSql, notifiedJob } from './ends.js';
import { withDays } from './days.js';
import { camelRow, currentOf, jobColumns, toJob, type Job } from './rows.js';
import { jobListPage } from './job-list.js';
import { JOB_COLUMNS, jobEvents, staleReports, steps, type AttemptRow, type JobEventRow, type StaleReportRow, type StepRow } from './schema.js';
import { JOB_STATUSES, type EventKind, type JobStatus } from '../domain/statuses.js';
import { JOBS_CHANNEL } from './notify.js';
import { countChangeSql, endedCountSql } from './counts.js';
import { outboxSql } from './outbox.js';
import { run, statement, withTransaction, type Queryable } from './sql.js';

const withoutNotified = ({ notified: _, ...row }: Record<string, unknown>) => row;

export interface EnqueueParams {
  queue: string;
  /** A JSON object, at most `limits.payloadBytes` serialized. */
  payload: unknown;
  /** Higher runs first; default 0. */
  priority?: number;
  /** Not before this time; default now. */
  runAt?: Date;
  /** Started attempts before the job is dead-lettered; default 5. */
  maxAttempts?: number;
  /** The same key with the same queue and payload returns the existing job; another payload is `conflict`. */
  idempotencyKey?: string;
  /** A running attempt past this is revoked and failed as retryable. */
  executionTimeoutMs?: number;
  /** Only agents carrying all these labels are given the job. */
  labels?: Record<string, string>;
  /**
   * An http(s) URL that receives one signed notification when the job ends. Not part of the
   * idempotency comparison: a duplicate enqueue keeps the first call's URL.
   */
  notifyUrl?: string;
  /**
   * A header every delivery to `notifyUrl` carries (a receiver checking a header instead of the
   * signature). Kept in `notify_headers`, never read back by any read of the job. Needs `notifyUrl`.
   */
  notifyHeader?: { name: string; value: string };
  /**
   * A free slot of an agent on the caller's coordinator (the dispatcher's `reserve`): the job is
   * claimed for it by the enqueue itself when nothing comes before it (see the statement).
   */
  handOff?: { agentId: string; agentLabels: Record<string, string>; attemptId: string; claimTtlMs: number };
  /**
   * Whether the statement itself NOTIFYs the dispatchers when the job is queued and due
   * (default). A caller that wakes them after the commit instead (`QueueWaker`: the gateway)
   * passes false, so that enqueues do not commit one at a time on PostgreSQL's NOTIFY lock.
   */
  notify?: boolean;
  now?: Date;
}

export const DEFAULT_MAX_ATTEMPTS = 5;

// The row is the enqueue's record: what was asked for stays in its columns, the time in
// created_at. Nothing else is written.
//
// With a hand-off ($11–$14: an agent with a free slot on the caller's coordinator, its labels,
// a fresh attempt id and the claim TTL), the job is inserted already claimed for that agent (the
// claim and its attempt as jobClaim makes them) when it could have been claimed for it right
// away: due now, its labels carried by the agent, and no due queued job in the queue that the
// agent could take would come before it (priority, then age: the job is the newest). That
// check reads jobs_claim_idx from the front of the queue and stops at the first match. Then no
// NOTIFY is sent: the job is not waiting. Nor when $15 is false: the caller wakes the
// dispatchers after the commit (see `jobsNotify`).
const enqueueSql = statement(
  'jobEnqueue',
  `WITH h AS MATERIALIZED (
     SELECT $12::text IS NOT NULL
       AND ($4::timestamptz IS NULL OR $4::timestamptz <= coalesce($8::timestamptz, now()))
       AND $9::jsonb <@ $13::jsonb
       AND NOT EXISTS (
         SELECT 1 FROM jobs_live q
         WHERE q.current_attempt_id IS NULL AND q.finished_at IS NULL AND q.queue = $1 AND q.priority >= $3
           AND q.run_at <= coalesce($8::timestamptz, now()) AND (q.labels = '{}'::jsonb OR q.labels <@ $13::jsonb)
       ) AS yes
   ), i AS MATERIALIZED (
     SELECT job_id_v7() AS id
   ), k AS (
     -- The key taken for this job, unless another job holds it (then no job is inserted).
     INSERT INTO job_keys (key, job_id) SELECT $6, i.id FROM i WHERE $6::text IS NOT NULL
     ON CONFLICT (key) DO NOTHING
     RETURNING job_id
   ), n AS (
     INSERT INTO jobs_live (id, queue, payload, priority, run_at, max_attempts, idempotency_key, execution_timeout_ms,
                       labels, notify_url, created_at, updated_at,
                       status, attempt_no, current_attempt_id, agent_id, claimed_at, claim_deadline, lease_expires_at)
     SELECT i.id, $1, $2::jsonb, $3, coalesce($4::timestamptz, $8::timestamptz, now()), $5, $6, $7, $9::jsonb, $10,
            coalesce($8::timestamptz, now()), coalesce($8::timestamptz, now()),
            CASE WHEN h.yes THEN 'claimed' ELSE 'queued' END::job_status, CASE WHEN h.yes THEN 1 ELSE 0 END,
            CASE WHEN h.yes THEN $11::uuid END, CASE WHEN h.yes THEN $12::text END,
            CASE WHEN h.yes THEN coalesce($8::timestamptz, now()) END,
            CASE WHEN h.yes THEN coalesce($8::timestamptz, now()) + make_interval(secs => $14::float8 / 1000.0) END,
            CASE WHEN h.yes THEN coalesce($8::timestamptz, now()) + make_interval(secs => $14::float8 / 1000.0) END
     FROM h, i
     WHERE $6::text IS NULL OR EXISTS (SELECT 1 FROM k)
     RETURNING *
   ), nh AS (
     INSERT INTO notify_headers (job_id, name, value) SELECT n.id, $16, $17 FROM n WHERE $16::text IS NOT NULL
   )
   -- Wakes the dispatchers of every coordinator (delivered at commit) when the job is due now.
   SELECT n.*, NULL::jsonb AS error,
     (SELECT count(pg_notify('${JOBS_CHANNEL}', n.queue)) FROM n WHERE $15::boolean AND n.status = 'queued' AND n.run_at <= now()) AS notified
   FROM n`,
);

// Runs after the key's ON CONFLICT DO NOTHING inserted nothing: a new snapshot, so it sees the
// competing insert that made it skip (READ COMMITTED). The job is looked up by id in every
// partition of jobs (live or moved to its day). `k_job_id` without a job: a key left behind.
const byKeySql = statement(
  'jobByIdempotencyKey',
  `SELECT ${jobColumns('j')}, (j.queue = $2 AND j.payload = $3::jsonb) AS same, k.job_id AS k_job_id
   FROM job_keys k LEFT JOIN jobs j ON j.id = k.job_id WHERE k.key = $1`,
);

// A key whose job is gone (deleted behind the store's back): freed, so the enqueue can take it.
const keyFreeSql = statement('jobKeyFree', `DELETE FROM job_keys k WHERE k.key = $1 AND k.job_id = $2 AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = $2)`);

/**
 * Adds a job in `queued`. With an idempotency key: `ok` for a new job, `duplicate` with the
 * existing job for the same queue and payload, `conflict` for another one.
 */
export async function jobEnqueue(db: Queryable, p: EnqueueParams): Promise<Outcome<Job>> {
  const bad = checkAll(
    valid.queue(p.queue) ? undefined : check('queue', schemas.queue, p.queue),
    p.priority === undefined ? undefined : check('priority', schemas.priority, p.priority),
    p.maxAttempts === undefined ? undefined : check('maxAttempts', schemas.maxAttempts, p.maxAttempts),
    p.runAt === undefined ? undefined : check('runAt', schemas.date, p.runAt),
    p.idempotencyKey === undefined ? undefined : check('idempotencyKey', schemas.idempotencyKey, p.idempotencyKey),
    p.executionTimeoutMs === undefined
      ? undefined
      : check('executionTimeoutMs', schemas.executionTimeoutMs, p.executionTimeoutMs),
    p.labels === undefined ? undefined : check('labels', schemas.labels, p.labels),
    p.notifyUrl === undefined ? undefined : check('notifyUrl', schemas.url, p.notifyUrl),
    p.notifyHeader === undefined ? undefined : check('notifyHeader', schemas.notifyHeader, p.notifyHeader),
    p.notifyHeader !== undefined && p.notifyUrl === undefined ? invalid('notifyHeader', 'needs notifyUrl: it is sent with the deliveries to it') : undefined,
  );
  if (bad) return bad;
  const payload = checkJson('payload', p.payload, { maxBytes: limits.payloadBytes, object: true });
  if ('failure' in payload) return payload.failure;

  const rows = await run(db, enqueueSql, [
    p.queue,
    payload.json,
    p.priority ?? 0,
    p.runAt ?? null,
    p.maxAttempts ?? DEFAULT_MAX_ATTEMPTS,
    p.idempotencyKey ?? null,
    p.executionTimeoutMs ?? null,
    p.now ?? null,
    JSON.stringify(p.labels ?? {}),
    p.notifyUrl ?? null,
    p.handOff?.attemptId ?? null,
    p.handOff?.agentId ?? null,
    JSON.stringify(p.handOff?.agentLabels ?? {}),
    p.handOff?.claimTtlMs ?? null,
    p.notify ?? true,
    p.notifyHeader?.name ?? null,
    p.notifyHeader?.value ?? null,
  ]);
  if (rows[0]) return ok(toJob(withoutNotified(rows[0])));

  const [existing] = await run<Record<string, unknown> & { same: boolean; k_job_id: string }>(db, byKeySql, [
    p.idempotencyKey,
    p.queue,
    payload.json,
  ]);
  // The conflicting job was purged between the two statements: the key is free again.
  if (!existing) return jobEnqueue(db, p);
  const { same, k_job_id, ...row } = existing;
  if (row.id === null) {
    await run(db, keyFreeSql, [p.idempotencyKey, k_job_id]);
    return jobEnqueue(db, p);
  }
  if (same) return duplicate(toJob(row));
  return conflict(`idempotency key ${JSON.stringify(p.idempotencyKey)} was used for job ${String(row.id)} with another queue or payload`, currentOf(row as never));
}

export interface CancelParams {
  jobId: string;
  now?: Date;
}

/** What a cancel did: the job, and the attempt it took away (to push `Cancel` to its agent). */
export interface Canceled {
  job: Job;
  canceledAttempt: { attemptId: string; agentId: string } | null;
}

// The job moves to its day's partition of jobs, as every end does (ends.ts, endedColumn). A
// held job's attempt ends as `canceled` (its row written here); a queued job's cancel is a
// job_events row (no attempt made it), without done_day (where the row is kept, not a change).
const cancelSql = statement(
  'jobCancel',
  `WITH o AS (
     SELECT * FROM jobs_live WHERE id = $1 AND status IN ('queued', 'claimed', 'running') FOR UPDATE
   ), m AS (
     DELETE FROM jobs_live j USING o WHERE j.id = o.id RETURNING j.*
   ), u AS (
     INSERT INTO jobs (${JOB_COLUMNS.join(', ')})
     SELECT ${movedRowSql('m', { ...endedColumn('coalesce($2::timestamptz, now())'), status: "'canceled'" })} FROM m
     RETURNING *
   ), a AS (
     ${attemptEndSql(`SELECT o.current_attempt_id, o.id, o.attempt_no, o.agent_id, o.claimed_at, o.claim_deadline, o.started_at,
       u.finished_at, o.suspect_since, 'canceled', NULL, NULL, 'canceled', NULL, o.created_at
     FROM u JOIN o ON o.id = u.id WHERE o.current_attempt_id IS NOT NULL`)}
   ), e AS (
     INSERT INTO job_events (job_id, kind, at, data)
     SELECT u.id, 'canceled', u.finished_at, job_event_delta(to_jsonb(u) - 'done_day', to_jsonb(o))
     FROM u JOIN o ON o.id = u.id WHERE o.current_attempt_id IS NULL
     RETURNING at
   ), k AS (
     ${countChangeSql('SELECT u.queue, u.status, 1 FROM u')}
   ), ec AS (
     ${endedCountSql(`SELECT a.ended_at, 'canceled' FROM a UNION ALL SELECT e.at, 'canceled' FROM e`)}
   )${outboxSql(`SELECT u.id AS job_id, u.queue, u.notify_url, 'job.canceled' AS type, u.finished_at AS at,
       ${notifiedJob('job_error(u.id, u.status)')} AS job,
       coalesce((SELECT to_jsonb(a) FROM a),
                (SELECT to_jsonb(la) FROM attempts la WHERE la.job_id = u.id AND la.attempt_no = u.attempt_no)) AS attempt
     FROM u`)}
   SELECT u.*, job_error(u.id, u.status) AS error, o.current_attempt_id AS canceled_attempt_id, o.agent_id AS canceled_agent_id
   FROM u JOIN o ON o.id = u.id`,
);

const jobStateSql = statement('jobState', `SELECT ${jobColumns('j')} FROM jobs j WHERE j.id = $1`);

/**
 * Cancels a job that is not terminal (its current attempt, if any, ends as `canceled`).
 * A canceled job is `duplicate`; another terminal job is `conflict`.
 */
export async function jobCancel(db: Queryable, p: CancelParams): Promise<Outcome<Canceled>> {
  const bad = check('jobId', schemas.id, p.jobId);
  if (bad) return bad;
  const [row] = await withDays(db, () => run<Record<string, unknown>>(db, cancelSql, [p.jobId, p.now ?? null]));
  if (row) {
    const { canceled_attempt_id, canceled_agent_id, ...job } = row;
    return ok({
      job: toJob(job),
      canceledAttempt: canceled_attempt_id
        ? { attemptId: canceled_attempt_id as string, agentId: canceled_agent_id as string }
        : null,
    });
  }
  const [cur] = await run<Record<string, unknown>>(db, jobStateSql, [p.jobId]);
  if (!cur) return notFound(`job ${p.jobId} not found`);
  const job = toJob(cur);
  if (job.status === 'canceled') return duplicate({ job, canceledAttempt: null });
  return conflict(`job ${p.jobId} is already ${job.status}`, currentOf(cur as never));
}

export interface RequeueParams {
  jobId: string;
  now?: Date;
}

// What a requeue changes in the row it moves back to jobs_live.
const REQUEUED: Record<string, string> = {
  status: `'queued'`,
  run_at: 'coalesce($2::timestamptz, now())',
  attempts_started: '0',
  finished_at: 'NULL',
  updated_at: 'coalesce($2::timestamptz, now())',
  done_day: 'NULL',
};

// The job moves back from its day's partition to jobs_live (m deletes it, b inserts it queued), or,
// a row that finished before jobs moved at every end (kept in jobs_live), is updated there (l). Its
// event leaves out done_day (where the row is kept, not a change of the job).
const requeueSql = statement(
  'jobRequeue',
  `WITH o AS (
     SELECT * FROM jobs WHERE id = $1 AND status IN ('dead', 'failed', 'canceled') FOR UPDATE
   ), m AS (
     DELETE FROM jobs j USING o WHERE j.id = o.id AND o.done_day IS NOT NULL AND j.done_day = o.done_day RETURNING j.*
   ), b AS (
     INSERT INTO jobs_live (${JOB_COLUMNS.join(', ')})
     SELECT ${movedRowSql('m', REQUEUED)} FROM m
     RETURNING *
   ), l AS (
     UPDATE jobs_live j SET status = 'queued', run_at = coalesce($2::timestamptz, now()), attempts_started = 0,
       finished_at = NULL, updated_at = coalesce($2::timestamptz, now())
     FROM o WHERE j.id = o.id AND o.done_day IS NULL
     RETURNING j.*
   ), u AS (
     SELECT * FROM b UNION ALL SELECT * FROM l
   ), e AS (
     INSERT INTO job_events (job_id, kind, at, data)
     SELECT u.id, 'requeued', u.updated_at, job_event_delta(to_jsonb(u) - 'done_day', to_jsonb(o)) FROM u JOIN o ON o.id = u.id
   ), k AS (
     ${countChangeSql('SELECT o.queue, o.status, -1 FROM o JOIN u ON u.id = o.id')}
   )
   SELECT u.*, job_error(u.id, u.status) AS error, (SELECT count(pg_notify('${JOBS_CHANNEL}', u.queue)) FROM u) AS notified FROM u`,
);

/**
 * An operator's second chance: a `dead`, `failed` or `canceled` job goes back to `queued` with
 * its started-attempt count reset (attempt numbers keep growing). A succeeded job never moves.
 */
export async function jobRequeue(db: Queryable, p: RequeueParams): Promise<Outcome<Job>> {
  const bad = check('jobId', schemas.id, p.jobId);
  if (bad) return bad;
  const [row] = await run<Record<string, unknown>>(db, requeueSql, [p.jobId, p.now ?? null]);
  if (row) return ok(toJob(withoutNotified(row)));
  const [cur] = await run<Record<string, unknown>>(db, jobStateSql, [p.jobId]);
  if (!cur) return notFound(`job ${p.jobId} not found`);
  return conflict(
    `job ${p.jobId} is ${String(cur.status)}: only dead, failed or canceled jobs can be requeued`,
    currentOf(cur as never),
  );
}

/**
 * An attempt as operators see it: ended (a row of `attempt_log`: its `attempts` row, or for a
 * success its job's row, `seq` NULL) or live (from its job's row, `endedAt` NULL).
 */
export type AttemptView = Omit<AttemptRow, 'endedAt' | 'jobStatus' | 'seq' | 'jobCreatedAt'> & { endedAt: Date | null; jobStatus: JobStatus | null; seq: number | null };

/** A job with everything that happened to it. */
export interface JobDetail {
  job: Job;
  /** Oldest first; the live attempt, if the job is held, last. */
  attempts: AttemptView[];
  events: JobEventRow[];
  steps: StepRow[];
  staleReports: StaleReportRow[];
}

/** The live attempt a held job's row holds, as an attempt. */
export function liveAttempt(job: Job): AttemptView | undefined {
  if (!job.currentAttemptId || (job.status !== 'claimed' && job.status !== 'running')) return undefined;
  return {
    id: job.currentAttemptId,
    jobId: job.id,
    attemptNo: job.attemptNo,
    agentId: job.agentId ?? '',
    status: job.status,
    claimedAt: job.claimedAt ?? job.updatedAt,
    claimDeadline: job.claimDeadline ?? job.updatedAt,
    startedAt: job.startedAt,
    endedAt: null,
    suspectSince: job.suspectSince,
    error: null,
    retryable: null,
    jobStatus: null,
    runAt: null,
    seq: null,
  };
}

/** What an attempt's end was, as a transition of its job. */
function endKind(a: AttemptView): EventKind {
  if (a.jobStatus === 'dead') return 'dead';
  switch (a.status) {
    case 'succeeded':
      return 'completed';
    case 'failed':
      return a.jobStatus === 'queued' ? 'retry_scheduled' : 'failed';
    default:
      return a.status as EventKind;
  }
}

/**
 * A job's transitions in order, as operators read them (GetJob's `events`), from its history:
 * the enqueue (its row), each attempt's claim, start and end (the attempt), and the stored
 * events (requeues, cancels of queued jobs). `id` is the position in this list.
 */
export function jobHistory(job: Job, attemptsOf: AttemptView[], events: JobEventRow[]): JobEventRow[] {
  type Entry = Omit<JobEventRow, 'id'>;
  const out: Entry[] = [{ jobId: job.id, attemptId: null, kind: 'enqueued', at: job.createdAt, data: { status: 'queued' } }];
  // Ended attempts and stored events in the order they happened (one sequence numbers both; a
  // success kept on its job's row has none and is the job's last transition), then the live
  // attempt.
  const ordered: Array<{ seq: number; a?: AttemptView; e?: JobEventRow }> = [
    ...attemptsOf.filter((a) => a.endedAt !== null).map((a) => ({ seq: a.seq ?? Number.MAX_SAFE_INTEGER, a })),
    ...events.map((e) => ({ seq: e.id, e })),
  ].sort((x, y) => x.seq - y.seq);
  const live = attemptsOf.find((a) => a.endedAt === null);
  if (live) ordered.push({ seq: Infinity, a: live });
  for (const { a, e } of ordered) {
    if (e) {
      const { id: _, ...rest } = e;
      out.push(rest);
      continue;
    }
    out.push({
      jobId: job.id,
      attemptId: a!.id,
      kind: 'claimed',
      at: a!.claimedAt,
      data: { status: 'claimed', attempt_no: a!.attemptNo, agent_id: a!.agentId, claim_deadline: a!.claimDeadline },
    });
    if (a!.startedAt) out.push({ jobId: job.id, attemptId: a!.id, kind: 'started', at: a!.startedAt, data: { status: 'running' } });
    if (a!.endedAt && a!.jobStatus) {
      out.push({
        jobId: job.id,
        attemptId: a!.id,
        kind: endKind(a!),
        at: a!.endedAt,
        data: { status: a!.jobStatus, ...(a!.error ? { error: a!.error } : {}), ...(a!.runAt ? { run_at: a!.runAt } : {}) },
      });
    }
  }
  return out.map((e, i) => ({ id: i + 1, ...e }));
}

/** One job with its attempts, history, steps and stale reports, read from one snapshot. */
export async function jobGet(db: Queryable, p: { jobId: string }): Promise<Outcome<JobDetail>> {
  const bad = check('jobId', schemas.id, p.jobId);
  if (bad) return bad;
  const read = async (tx: pg.PoolClient | pg.Client) => {
    const [row] = (await tx.query(`SELECT ${jobColumns('j')} FROM jobs j WHERE j.id = $1`, [p.jobId])).rows;
    if (!row) return notFound(`job ${p.jobId} not found`);
    const d = drizzle(tx);
    const job = toJob(row);
    const live = liveAttempt(job);
    const ended = (await tx.query(`SELECT * FROM attempt_log WHERE job_id = $1 ORDER BY attempt_no`, [p.jobId])).rows.map((r) =>
      camelRow<AttemptView>(r),
    );
    const all = live ? [...ended, live] : ended;
    return ok<JobDetail>({
      job,
      attempts: all,
      events: jobHistory(job, all, await d.select().from(jobEvents).where(eq(jobEvents.jobId, p.jobId)).orderBy(asc(jobEvents.id))),
      steps: await d.select().from(steps).where(eq(steps.jobId, p.jobId)).orderBy(asc(steps.startedAt)),
      staleReports: await d
        .select()
        .from(staleReports)
        .where(eq(staleReports.jobId, p.jobId))
        .orderBy(desc(staleReports.id)),
    });
  };
  return withTransaction(db, read, { mode: 'REPEATABLE READ, READ ONLY' });
}

export interface ListParams {
  queue?: string;
  status?: JobStatus;
  /** 1 to 500; default 50. */
  pageSize?: number;
  /** From the previous page's `nextPageToken`. */
  pageToken?: string;
}

/** A page of jobs, newest first, and the token of the next page (empty at the end; job-list.ts). */
export async function jobList(db: Queryable, p: ListParams): Promise<Outcome<{ jobs: Job[]; nextPageToken: string }>> {
  const bad = checkAll(
    p.queue === undefined ? undefined : check('queue', schemas.queue, p.queue),
    p.status === undefined ? undefined : check('status', z.enum(JOB_STATUSES), p.status),
    p.pageSize === undefined ? undefined : check('pageSize', z.int().min(1).max(500), p.pageSize),
  );
  if (bad) return bad;
  return jobListPage(db, { queue: p.queue, statuses: p.status ? [p.status] : undefined }, p.pageSize ?? 50, p.pageToken);
}
