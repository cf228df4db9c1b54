/**
 * Leases and fences: claim, start, heartbeat, complete, fail.
 *
 * State machine (DESIGN.md):
 *
 *   queued ──claim──► claimed ──start──► running ──complete──► succeeded
 *     ▲                  │ start deadline     │ fail(final) ──► failed
 *     │                  │ passes (reaper)    │ fail(retryable) / lease or execution
 *     └──────────────────┴────────────────────┘ timeout passes (reaper): queued, or dead at the cap
 *   cancel (jobs.ts): any of queued, claimed, running ──► canceled
 *   requeue (jobs.ts, an operator): dead, failed, canceled ──► queued
 *
 * The fence: claiming a job creates an attempt with a fresh 128-bit random id and stores it in
 * `jobs.current_attempt_id`. Every write made on behalf of an attempt is one statement whose
 * WHERE clause matches that id (and the agent that holds it, and the states it may act in);
 * its row count is the outcome. Zero rows means the attempt is not current (`stale`, with a
 * `stale_reports` row), is not this agent's (`forbidden`), does not exist (`not_found`), or already
 * did this (`duplicate` / `conflict`, decided from how it ended: `attempt_log`). The follow-up read that
 * tells these apart never writes job state: it only explains a write that did not happen.
 *
 * History: while an attempt is live, the `jobs` row holds it (claim time, start deadline, start
 * time, agent). The statement that ends it (fail, the reaper's, cancel) writes its `attempts`
 * row, once, in the same statement: how it ended, its error, what became of the job. A success
 * keeps its attempt on the job's row instead (`final_attempt_id` and the `final_*` columns, one
 * row write less per job), with the result, stored once, in `jobs.result`; the view
 * `attempt_log` reads both kinds as one list of ended attempts.
 *
 * Leases expire lazily: a lease that has passed makes an attempt recoverable by the reaper,
 * and until the reaper ends it the holder may still start, complete or fail (nobody else can
 * hold the job meanwhile). Only started attempts count toward `max_attempts`.
 */
import { randomBytes } from 'node:crypto';
import {
  conflict,
  duplicate,
  forbidden,
  notFound,
  ok,
  stale,
  type CurrentState,
  type Failure,
  type Outcome,
} from '../domain/outcomes.js';
import { check, checkAll, checkJson, limits, schemas, valid } from '../domain/validation.js';
import { z } from 'zod';
import { countChangeSql, endedCountSql, endedKindSql } from './counts.js';
import { withDays } from './days.js';
import { outboxSql } from './outbox.js';
import { currentOf, jobColumns, summaryColumns, toJob, toSummary, type Job, type JobSummary } from './rows.js';
import { JOB_COLUMNS } from './schema.js';
import type { JobStatus } from '../domain/statuses.js';
import { run, statement, type Queryable } from './sql.js';

/** Exponential backoff with jitter for retries: `min(base·2^(n−1), max) × [0.5, 1)`. */
export interface Backoff {
  baseMs: number;
  maxMs: number;
}
export const DEFAULT_BACKOFF: Backoff = { baseMs: 1000, maxMs: 3_600_000 };

/** The SQL of the backoff delay after `started` started attempts, with params for base and max. */
export const backoffSql = (started: string, base: string, max: string) =>
  `make_interval(secs => least(${base}::float8 * power(2, greatest(${started}, 1) - 1), ${max}::float8)
     * (0.5 + random() * 0.5) / 1000.0)`;

/**
 * The `attempts` row of an attempt that ends, written by the statement that ends it. `source`
 * is a SELECT yielding the columns below, in order, per ended attempt: the attempt's id, job,
 * number, agent, claim time and start deadline, start time, end time, suspect mark (as the
 * `jobs` row held them before the transition), how it ended, its error and retry flag, the job's
 * status after it, the job's new due time when it was queued again with one, and when the job
 * was created (the order of the lists of an agent's jobs, job-list.ts).
 */
export const attemptEndSql = (source: string) =>
  `INSERT INTO attempts (id, job_id, attempt_no, agent_id, claimed_at, claim_deadline, started_at, ended_at, suspect_since,
                         status, error, retryable, job_status, run_at, job_created_at)
   ${source}
   RETURNING *`;

/**
 * The attempt as a notification shows it (the fields `webhook_event_body` reads), built from the
 * values its `attempts` row is written with: a batch's notifications need no join back to the
 * inserted rows (CTEs have no statistics, so such a join is a nested loop, n² for n items).
 */
export const attemptJson = (id: string, no: string, agent: string, status: string, claimed: string, started: string, ended: string) =>
  `jsonb_build_object('id', ${id}, 'attempt_no', ${no}, 'agent_id', ${agent}, 'status', ${status}, 'claimed_at', ${claimed},
     'started_at', ${started}, 'ended_at', ${ended})`;

/** The job as a notification shows it, from a `jobs` row named `u` and the job's error. */
export const notifiedJob = (error: string) => `to_jsonb(u) || jsonb_build_object('error', ${error})`;

// ───────────────────────────── claim ─────────────────────────────

export interface ClaimParams {
  agentId: string;
  queues: string[];
  /** Claim up to this many jobs. */
  limit: number;
  /** Start deadline: an attempt not started by then is recovered and does not count. */
  claimTtlMs: number;
  /** The agent's labels: only jobs whose required labels are all among these are claimed. */
  labels?: Record<string, string>;
  now?: Date;
}

/** Claims for several agents that serve the same queues with the same labels, in one statement. */
export interface ClaimSlotsParams {
  /** One agent id per free slot, in the order slots are to be filled (interleave for fairness). */
  slots: string[];
  queues: string[];
  labels?: Record<string, string>;
  claimTtlMs: number;
  now?: Date;
}

/** A job handed to an agent: the attempt is its fencing token. */
export interface Claimed {
  job: Job;
  /** Index into `slots` of the slot this job filled (0-based). */
  slot: number;
  agentId: string;
  attemptId: string;
  attemptNo: number;
  claimDeadline: Date;
}

/**
 * An attempt id, the SQL of it: the milliseconds since the epoch of `at` (48 bits), then the
 * first 80 bits of the bytea `random`, as a UUID (claimSql says why in this order).
 */
export const attemptIdSql = (at: string, random: string): string =>
  `encode(substring(int8send(floor(extract(epoch FROM ${at}) * 1000)::int8) FROM 3) || substring(${random} FROM 1 FOR 10), 'hex')::uuid`;

// Safe under any number of concurrent claimers: each candidate row is locked FOR UPDATE and
// rows another claimer holds are skipped (SKIP LOCKED), so no job is claimed twice and no
// claimer waits. The candidate scan is served by jobs_claim_idx (queue, priority DESC NULLS
// LAST, run_at, id) WHERE current_attempt_id IS NULL AND finished_at IS NULL (queued: a CHECK
// ties the two): one ordered index scan per queue, stopped by the LIMIT, whatever the table
// holds (test/store.claim-plan.test.ts holds the plan to that). A row claimed by a concurrent
// claimer that committed first is rechecked under its lock (the partial index's predicate is
// kept as a filter for that) and skipped. The n-th candidate goes to the n-th slot: its agent
// ($4, indexed by $8) and its attempt id, the first 128 bits of SHA-256(key ‖ n) under a 256-bit
// key ($3) fresh from the caller's CSPRNG and never stored: unpredictable and unique like 128
// random bits, without sending one id per free slot (a round offers up to 1,000 slots for what
// is often a single job). Only jobs whose required labels the agents carry ($7, jsonb
// containment) are candidates. The claim writes only the jobs row: the attempt's own row is
// written when it ends.
export const claimSql = statement(
  'jobClaim',
  `WITH c AS MATERIALIZED (
     -- Per queue, the first $2 claimable jobs in index order (locked, others' locks skipped);
     -- of those, the first $2 overall. Unclaimed extras are unlocked when the statement
     -- commits. MATERIALIZED: it runs once, as written, before the UPDATE reads it.
     SELECT k.id, k.priority, k.run_at FROM unnest($1::text[]) AS q(name)
     CROSS JOIN LATERAL (
       SELECT id, priority, run_at FROM jobs_live
       WHERE current_attempt_id IS NULL AND finished_at IS NULL AND queue = q.name
         AND run_at <= coalesce($6::timestamptz, now())
         -- '{}' <@ anything; spelled out so the planner sees (from the column's statistics)
         -- that most jobs need no labels, rather than guessing containment is rare and
         -- choosing a sort of every queued job over the index.
         AND (labels = '{}'::jsonb OR labels <@ $7::jsonb)
       ORDER BY priority DESC NULLS LAST, run_at, id
       LIMIT $2
       FOR UPDATE SKIP LOCKED
     ) k
     ORDER BY k.priority DESC NULLS LAST, k.run_at, k.id
     LIMIT $2
   ), m AS MATERIALIZED (
     -- The candidates' ids, and each one's place (1-based) in claim order, looked up by id.
     SELECT array_agg(r.id) AS ids, jsonb_object_agg(r.id, r.rn) AS rn
     FROM (SELECT c.id, row_number() OVER (ORDER BY c.priority DESC NULLS LAST, c.run_at, c.id) AS rn FROM c) r
   )
   -- The n-th candidate gets the n-th slot's agent, by array subscript, and its attempt id. The
   -- rows are fetched by primary key from the id list, and each finds its place by its id: no
   -- join, so no plan (generic or not, whatever the statistics say) reads jobs in any other way.
   -- An attempt id is the claim's time in milliseconds (48 bits), then 80 bits of sha256 of the
   -- call's random $3 and n. Time-ordered, it lands at the right edge of the indexes that carry
   -- it (jobs_current_attempt_uq, and jobs_final_attempt_uq of its day's partition once it
   -- succeeds), where a random one touched a random page of them: 2,471 against 1,930 B of WAL
   -- a job beside 200,000 finished jobs (docs/decisions.md, "Attempt ids in time order too"). The
   -- dispatcher's hand-off makes the same shape (core/dispatcher.ts, randomAttemptId).
   UPDATE jobs_live j SET status = 'claimed', attempt_no = j.attempt_no + 1,
     current_attempt_id = ${attemptIdSql('coalesce($6::timestamptz, now())', `sha256($3::bytea || int4send(((SELECT rn FROM m) ->> j.id::text)::int))`)},
     agent_id = ($4::text[])[($8::int2[])[((SELECT rn FROM m) ->> j.id::text)::int]], progress = NULL, heartbeat_at = NULL,
     claimed_at = coalesce($6::timestamptz, now()),
     claim_deadline = coalesce($6::timestamptz, now()) + make_interval(secs => $5::float8 / 1000.0),
     lease_expires_at = coalesce($6::timestamptz, now()) + make_interval(secs => $5::float8 / 1000.0),
     updated_at = coalesce($6::timestamptz, now())
   WHERE j.id = ANY ((SELECT ids FROM m)::uuid[])
   -- What an Assign carries, times as epoch milliseconds (cheaper to read than timestamps). A
   -- job's error is that of an earlier attempt: only a job claimed before can have one.
   RETURNING ((SELECT rn FROM m) ->> j.id::text)::int AS slot, j.id, j.queue, j.payload, j.priority, j.max_attempts, j.attempt_no, j.attempts_started,
     j.current_attempt_id, j.agent_id, j.execution_timeout_ms, j.idempotency_key, j.labels, j.notify_url,
     date_part('epoch', j.run_at) * 1000 AS run_at_ms, date_part('epoch', j.created_at) * 1000 AS created_at_ms,
     date_part('epoch', j.claimed_at) * 1000 AS claimed_at_ms, date_part('epoch', j.claim_deadline) * 1000 AS claim_deadline_ms,
     CASE WHEN j.attempt_no > 1 THEN job_error(j.id, j.status) END AS error`,
);

interface ClaimRow {
  slot: string;
  id: string;
  queue: string;
  payload: unknown;
  priority: number;
  max_attempts: number;
  attempt_no: number;
  attempts_started: number;
  current_attempt_id: string;
  agent_id: string;
  execution_timeout_ms: number | null;
  idempotency_key: string | null;
  labels: unknown;
  notify_url: string | null;
  run_at_ms: number;
  created_at_ms: number;
  claimed_at_ms: number;
  claim_deadline_ms: number;
  error: unknown;
}

/** Claims up to `limit` queued jobs of `queues` for one agent, each with a fresh attempt. */
export async function jobClaim(db: Queryable, p: ClaimParams): Promise<Outcome<Claimed[]>> {
  const bad = checkAll(
    check('agentId', schemas.agentId, p.agentId),
    check('limit', z.int().min(1).max(limits.claimBatch), p.limit),
  );
  if (bad) return bad;
  return jobClaimSlots(db, {
    slots: Array.from({ length: p.limit }, () => p.agentId),
    queues: p.queues,
    claimTtlMs: p.claimTtlMs,
    ...(p.labels ? { labels: p.labels } : {}),
    ...(p.now ? { now: p.now } : {}),
  });
}

/**
 * Claims for many slots of agents that share queues and labels, in one statement: the n-th job
 * (in priority order) goes to `slots[n]`. What the dispatcher uses to batch waiting agents.
 */
export async function jobClaimSlots(db: Queryable, p: ClaimSlotsParams): Promise<Outcome<Claimed[]>> {
  // Once per dispatch round: the common well-formed case without zod, which explains the rest.
  const quick =
    Array.isArray(p.slots) &&
    p.slots.length >= 1 &&
    p.slots.length <= limits.claimBatch &&
    p.slots.every(valid.agentId) &&
    Array.isArray(p.queues) &&
    p.queues.length >= 1 &&
    p.queues.length <= limits.queuesPerClaim &&
    p.queues.every(valid.queue) &&
    Number.isInteger(p.claimTtlMs) &&
    p.claimTtlMs >= 100 &&
    p.claimTtlMs <= 86_400_000 &&
    (p.labels === undefined || Object.keys(p.labels).length === 0);
  const bad = quick
    ? undefined
    : checkAll(
        check('slots', z.array(z.string()).min(1, 'must hold at least one slot').max(limits.claimBatch), p.slots),
        check('slots', z.array(schemas.agentId), [...new Set(p.slots)]),
        check('queues', z.array(schemas.queue).min(1, 'must name at least one queue').max(limits.queuesPerClaim), p.queues),
        check('claimTtlMs', schemas.ttlMs, p.claimTtlMs),
        p.labels === undefined ? undefined : check('labels', schemas.labels, p.labels),
      );
  if (bad) return bad;
  // The slots as distinct agents and, per slot, the 1-based index of its agent: a few names and
  // a short list of numbers instead of one name per slot.
  const agents: string[] = [];
  const index = new Map<string, number>();
  const slotAgent = p.slots.map((a) => {
    let i = index.get(a);
    if (i === undefined) index.set(a, (i = agents.push(a)));
    return i;
  });
  const rows = await run<ClaimRow>(db, claimSql, [
    p.queues,
    p.slots.length,
    randomBytes(32),
    agents,
    p.claimTtlMs,
    p.now ?? null,
    JSON.stringify(p.labels ?? {}),
    slotAgent,
  ]);
  const claimed = rows.map((r): Claimed => {
    const claimedAt = new Date(r.claimed_at_ms);
    const deadline = new Date(r.claim_deadline_ms);
    const job: Job = {
      id: r.id,
      queue: r.queue,
      payload: r.payload,
      priority: r.priority,
      status: 'claimed',
      runAt: new Date(r.run_at_ms),
      maxAttempts: r.max_attempts,
      attemptNo: r.attempt_no,
      attemptsStarted: r.attempts_started,
      currentAttemptId: r.current_attempt_id,
      agentId: r.agent_id,
      claimedAt,
      claimDeadline: deadline,
      startedAt: null,
      suspectSince: null,
      leaseExpiresAt: deadline,
      heartbeatAt: null,
      executionTimeoutMs: r.execution_timeout_ms,
      executionDeadline: null,
      idempotencyKey: r.idempotency_key,
      labels: r.labels,
      progress: null,
      result: null,
      error: r.error ?? null,
      notifyUrl: r.notify_url,
      createdAt: new Date(r.created_at_ms),
      updatedAt: claimedAt,
      finishedAt: null,
    };
    return { job, slot: Number(r.slot) - 1, agentId: r.agent_id, attemptId: r.current_attempt_id, attemptNo: r.attempt_no, claimDeadline: deadline };
  });
  // In slot order, which is the claim's priority order.
  return ok(claimed.sort((a, b) => a.slot - b.slot));
}

// ───────────────────── why a fenced write matched nothing ─────────────────────

type Call = 'start' | 'heartbeat' | 'complete' | 'fail' | 'step';

export interface Lookup {
  job_id: string;
  attempt_agent_id: string;
  status: JobStatus;
  attempt_no: number;
  current_attempt_id: string | null;
  /** How the attempt was reported, if it was: its row says `succeeded` or `failed`. */
  kind: 'completed' | 'failed' | null;
  result: unknown;
  error: unknown;
  retryable: boolean | null;
  /** The call's own report equals the stored one (complete: result; fail: error and retryable). */
  same: boolean | null;
}

/**
 * Where an attempt is, in SQL: `x.id` is the attempt id; the attempt is either ended (`a`, from
 * `attempt_log`: its `attempts` row, or its job's row for a success) or live (the `jobs` row `l`
 * holding it), and `j` is its job.
 */
export const attemptWhere = `LEFT JOIN attempt_log a ON a.id = x.id
   LEFT JOIN jobs_live l ON l.current_attempt_id = x.id
   JOIN jobs j ON j.id = coalesce(a.job_id, l.id)`;

// Read in a fresh snapshot after the fenced statement matched nothing, so it sees whatever
// concurrent transition made the fence fail.
const lookupSql = statement(
  'attemptLookup',
  `SELECT j.id AS job_id, coalesce(a.agent_id, l.agent_id) AS attempt_agent_id, j.status, j.attempt_no, j.current_attempt_id,
          CASE a.status WHEN 'succeeded' THEN 'completed' WHEN 'failed' THEN 'failed' END AS kind,
          CASE WHEN a.status = 'succeeded' THEN j.result END AS result, a.error, a.retryable,
          CASE a.status WHEN 'succeeded' THEN j.result = $2::jsonb
                        WHEN 'failed' THEN a.error = $2::jsonb AND a.retryable = $3 END AS same
   FROM (SELECT $1::uuid AS id) x
   ${attemptWhere}`,
);

// FOR KEY SHARE: a job purged (or deleted) while its late report is answered is skipped, not a
// foreign-key error: the lock waits for the delete and then finds no row, where the key's own
// check would have failed the statement (and with it a heartbeat tick of every agent). It does
// not conflict with the transitions' updates, which change no key.
const staleReportSql = statement(
  'staleReportInsert',
  `INSERT INTO stale_reports (job_id, attempt_id, agent_id, call, current_attempt_id, current_attempt_no, current_status, at)
   SELECT j.id, $2, $3, $4, j.current_attempt_id, j.attempt_no, j.status, coalesce($5::timestamptz, now())
   FROM jobs j WHERE j.id = $1
   FOR KEY SHARE
   RETURNING current_attempt_id, current_attempt_no, current_status`,
);

/** Writes the `stale_reports` row for a late call and returns the `stale` outcome. */
export async function reportStale(
  db: Queryable,
  p: { jobId: string; attemptId: string; agentId: string; call: Call; now?: Date | undefined },
): Promise<Failure> {
  type Row = { current_attempt_id: string | null; current_attempt_no: number; current_status: JobStatus };
  const params = [p.jobId, p.attemptId, p.agentId, p.call, p.now ?? null];
  // No row: the job was purged, or a success was moving its row to its day's partition while the
  // lock waited (a delete and an insert, which the lock does not follow): a new snapshot sees it
  // moved.
  let [r] = await run<Row>(db, staleReportSql, params);
  if (!r) [r] = await run<Row>(db, staleReportSql, params);
  const current: CurrentState = {
    jobId: p.jobId,
    status: r?.current_status ?? 'canceled',
    attemptNo: r?.current_attempt_no ?? 0,
    currentAttemptId: r?.current_attempt_id ?? null,
  };
  return stale(
    `attempt ${p.attemptId} is not current: job ${p.jobId} is ${current.status} at attempt ${current.attemptNo}` +
      (current.currentAttemptId ? ` (current attempt ${current.currentAttemptId})` : ''),
    current,
  );
}

/**
 * Explains a fenced write that matched nothing: `not_found`, `forbidden`, the stored answer
 * of a repeat (via `onRepeat`), or `stale` (logged in `stale_reports`).
 */
export async function explain(
  db: Queryable,
  p: { attemptId: string; agentId: string; jobId?: string | undefined; call: Call; now?: Date | undefined },
  report: { json: string | null; retryable: boolean | null },
  onRepeat: (l: Lookup) => Outcome<string> | undefined,
): Promise<Outcome<string>> {
  const [l] = await run<Lookup>(db, lookupSql, [p.attemptId, report.json, report.retryable]);
  if (!l || (p.jobId !== undefined && l.job_id !== p.jobId)) {
    return notFound(`attempt ${p.attemptId} not found` + (p.jobId ? ` for job ${p.jobId}` : ''));
  }
  if (l.attempt_agent_id !== p.agentId) {
    return forbidden(`attempt ${p.attemptId} belongs to another agent`);
  }
  const repeat = onRepeat(l);
  if (repeat) return repeat;
  return reportStale(db, { jobId: l.job_id, attemptId: p.attemptId, agentId: p.agentId, call: p.call, now: p.now });
}

interface AttemptRef {
  attemptId: string;
  agentId: string;
  /** When given, the attempt must belong to this job (else `not_found`). */
  jobId?: string;
  now?: Date;
}

/** Validates an attempt reference: the well-formed case without zod (it runs per batch item). */
function checkRef(p: AttemptRef): Failure | undefined {
  if (valid.id(p.attemptId) && valid.agentId(p.agentId) && (p.jobId === undefined || valid.id(p.jobId))) return undefined;
  return checkAll(
    check('attemptId', schemas.id, p.attemptId),
    check('agentId', schemas.agentId, p.agentId),
    p.jobId === undefined ? undefined : check('jobId', schemas.id, p.jobId),
  );
}

/** Indexes of the items to put in a batch: valid ones, each attempt once (repeats are explained). */
function firstOfEach(items: AttemptRef[], out: Array<Outcome<unknown> | undefined>): number[] {
  const seen = new Set<string>();
  const batch: number[] = [];
  for (const [k, item] of items.entries()) {
    const key = item.attemptId.toLowerCase();
    if (out[k] || seen.has(key)) continue;
    seen.add(key);
    batch.push(k);
  }
  return batch;
}

/**
 * A JSON object `{attempt id: value}` for the batched statements, which look each row's own
 * value up by its attempt (`$n::jsonb ->> j.current_attempt_id::text`: keys as PostgreSQL
 * writes a uuid). `json` gives each value as JSON text; items without one are left out.
 */
function byAttempt(ids: string[], json: (k: number) => string | undefined): string {
  const parts: string[] = [];
  for (const [k, id] of ids.entries()) {
    const v = json(k);
    if (v !== undefined) parts.push(`"${id.toLowerCase()}":${v}`);
  }
  return `{${parts.join(',')}}`;
}

/**
 * The fence of the batched statements, for the `jobs` row `j`: its current attempt is one of
 * `$1` (found through jobs_current_attempt_uq, in index order, which is also the order rows are
 * locked in when the plan is that index scan; a plan that reads them in another order can
 * deadlock with another batch, and PostgreSQL then fails one of the two: seen once in a
 * benchmark, a renewal; on the pool `run` runs the victim again), held by the agent the call named for it (`$2`, a map),
 * and of the job the call named, if it named one (`$3`, a map, or NULL). No join: each row is
 * checked against its own entries, so the plan is an index scan whatever the statistics say.
 */
const batchFence = `j.current_attempt_id = ANY($1::uuid[]) AND j.agent_id = ($2::jsonb ->> j.current_attempt_id::text)
       AND coalesce(($3::jsonb ->> j.current_attempt_id::text)::uuid = j.id, true)`;

/** The fence parameters `$1`–`$3` of `batchFence` for a batch. */
function fenceParams(items: AttemptRef[]): [string[], string, string | null] {
  const ids = items.map((i) => i.attemptId);
  const jobs = items.some((i) => i.jobId !== undefined) ? byAttempt(ids, (k) => (items[k]!.jobId === undefined ? undefined : JSON.stringify(items[k]!.jobId))) : null;
  return [ids, byAttempt(ids, (k) => JSON.stringify(items[k]!.agentId)), jobs];
}

const jobByIdSql = statement('attemptJobById', `SELECT ${jobColumns('j')} FROM jobs j WHERE j.id = $1`);

/** Turns a `duplicate` naming a job id into a `duplicate` carrying the job as stored now. */
async function withJob(db: Queryable, o: Outcome<string>): Promise<Outcome<Job>> {
  if (o.outcome !== 'duplicate' && o.outcome !== 'ok') return o;
  const [row] = await run<Record<string, unknown>>(db, jobByIdSql, [o.value]);
  return row ? duplicate(toJob(row)) : notFound(`job ${o.value} not found`);
}

/**
 * The two shapes a batched transition answers in: the whole job (the unary API, which returns
 * it), or a summary (the agent stream, which needs only an ack).
 */
type Shape = 'job' | 'summary';

// ───────────────────────────── start ─────────────────────────────

export interface StartParams extends AttemptRef {
  leaseTtlMs: number;
}

// The fence (batchFence), and the attempt still only claimed. Many attempts (of any agents) in
// one statement; an item that matches nothing is explained afterwards, on its own. Nothing it
// changes is indexed, so with room on the page it is a HOT update.
const startSql = (shape: Shape) =>
  statement(
    shape === 'job' ? 'attemptStart' : 'attemptStartMany',
    `UPDATE jobs_live j SET status = 'running', attempts_started = j.attempts_started + 1,
       started_at = coalesce($5::timestamptz, now()),
       execution_deadline = coalesce($5::timestamptz, now()) + make_interval(secs => j.execution_timeout_ms / 1000.0),
       lease_expires_at = least(coalesce($5::timestamptz, now()) + make_interval(secs => $4::float8 / 1000.0),
                                coalesce($5::timestamptz, now()) + make_interval(secs => j.execution_timeout_ms / 1000.0)),
       heartbeat_at = coalesce($5::timestamptz, now()), updated_at = coalesce($5::timestamptz, now())
     WHERE ${batchFence} AND j.status = 'claimed'
     RETURNING ${shape === 'job' ? jobColumns('j') : summaryColumns('j')}`,
  );
const startSqls = { job: startSql('job'), summary: startSql('summary') };

/**
 * Moves a claimed job to `running` and sets its lease (capped by the execution timeout).
 * A repeat from the running attempt is `duplicate`.
 */
export async function attemptStart(db: Queryable, p: StartParams): Promise<Outcome<Job>> {
  const [o] = await startMany(db, { items: [p], leaseTtlMs: p.leaseTtlMs, ...(p.now ? { now: p.now } : {}) }, 'job');
  return o as Outcome<Job>;
}

/**
 * Starts many attempts in one statement (the coordinator groups the `Started` of all its agents
 * per tick); returns one outcome per item, in order, as `attemptStart` would, each with a
 * summary of the job.
 */
export async function attemptStartMany(
  db: Queryable,
  p: { items: AttemptRef[]; leaseTtlMs: number; now?: Date },
): Promise<Array<Outcome<JobSummary>>> {
  return startMany(db, p, 'summary');
}

async function startMany(
  db: Queryable,
  p: { items: AttemptRef[]; leaseTtlMs: number; now?: Date },
  shape: Shape,
): Promise<Array<Outcome<JobSummary>>> {
  const bad = check('leaseTtlMs', schemas.ttlMs, p.leaseTtlMs);
  if (bad) return p.items.map(() => bad);
  const out: Array<Outcome<JobSummary> | undefined> = p.items.map((i) => checkRef(i));
  const batch = firstOfEach(p.items, out);
  if (batch.length) {
    const rows = await run<Record<string, unknown>>(db, startSqls[shape], [...fenceParams(batch.map((k) => p.items[k]!)), p.leaseTtlMs, p.now ?? null]);
    const started = new Map(rows.map((r) => [r.current_attempt_id as string, r]));
    for (const k of batch) {
      const row = started.get(p.items[k]!.attemptId.toLowerCase());
      if (row) out[k] = ok(shape === 'job' ? toJob(row) : toSummary(row as never));
    }
  }
  for (const [k, item] of p.items.entries()) {
    if (out[k]) continue;
    // A start that arrives after its own attempt already ran (started, or even reported: a
    // completion of a claimed attempt starts it implicitly) repeats what happened: duplicate.
    const o = await explain(db, { ...item, call: 'start' }, { json: null, retryable: null }, (l) =>
      (l.current_attempt_id === item.attemptId.toLowerCase() && l.status === 'running') || l.kind ? duplicate(l.job_id) : undefined,
    );
    out[k] = await withJob(db, o);
  }
  return out as Array<Outcome<JobSummary>>;
}

// ─────────────────────────── heartbeat ───────────────────────────

export interface HeartbeatParams {
  /** Attempts to renew, each with the agent that claims to hold it and optional progress to keep. */
  items: Array<{ attemptId: string; agentId: string; progress?: unknown }>;
  leaseTtlMs: number;
  now?: Date;
}

/** What a heartbeat found, attempt by attempt. */
export interface HeartbeatResult {
  /** Renewed: running, current, held by the caller. */
  renewed: Array<{ attemptId: string; leaseExpiresAt: Date }>;
  /** Current but only claimed: nothing to renew until `start`. */
  pending: string[];
  /** No longer to be worked on: superseded, ended, canceled, or past its execution timeout. */
  lost: Array<{ attemptId: string; reason: 'stale' | 'timed_out' | 'not_found' | 'forbidden'; current?: CurrentState }>;
}

// One UPDATE renews every item whose attempt is current (batchFence), running, and not past its
// execution deadline, keeping the progress an item brings ($5, a map). It changes no indexed
// column: a HOT update when the page has room.
const heartbeatSql = statement(
  'attemptHeartbeat',
  `UPDATE jobs_live j SET
     lease_expires_at = least(coalesce($6::timestamptz, now()) + make_interval(secs => $4::float8 / 1000.0), j.execution_deadline),
     heartbeat_at = coalesce($6::timestamptz, now()),
     progress = coalesce($5::jsonb -> j.current_attempt_id::text, j.progress)
   WHERE ${batchFence} AND j.status = 'running'
     AND (j.execution_deadline IS NULL OR j.execution_deadline > coalesce($6::timestamptz, now()))
   RETURNING j.current_attempt_id AS attempt_id, j.agent_id, j.lease_expires_at`,
);

// For the items the UPDATE did not renew: what each attempt is now. The ended attempt is read
// per item in a LATERAL subquery (LIMIT 1: an attempt id is unique) so that PostgreSQL plans it
// with the item's id as a value it pushes into both halves of `attempt_log`, through
// attempts_pkey and jobs_final_attempt_uq. Joined to the view instead, the id is a join clause,
// which PostgreSQL does not push into the view's second half (a subquery with a WHERE of its
// own): it read every succeeded job's row on each call, seconds at ten million jobs.
const heartbeatLookupSql = statement(
  'attemptHeartbeatLookup',
  `SELECT x.id AS attempt_id, x.agent_id, j.id AS job_id, coalesce(a.agent_id, l.agent_id) AS attempt_agent_id,
          j.status, j.attempt_no, j.current_attempt_id, j.execution_deadline <= coalesce($3::timestamptz, now()) AS timed_out
   FROM unnest($1::uuid[], $2::text[]) AS x(id, agent_id)
   LEFT JOIN LATERAL (SELECT e.job_id, e.agent_id FROM attempt_log e WHERE e.id = x.id LIMIT 1) a ON true
   LEFT JOIN jobs_live l ON l.current_attempt_id = x.id
   LEFT JOIN jobs j ON j.id = coalesce(a.job_id, l.id)`,
);

/**
 * Renews the leases of many attempts in one statement (one per coordinator tick in practice).
 * Returns those renewed, those still waiting for `start`, and those lost; a lost attempt that
 * exists and is the caller's gets a `stale_reports` row.
 */
export async function attemptHeartbeat(db: Queryable, p: HeartbeatParams): Promise<Outcome<HeartbeatResult>> {
  const quick =
    Array.isArray(p.items) &&
    p.items.length <= limits.heartbeatBatch &&
    p.items.every((i) => valid.id(i.attemptId) && valid.agentId(i.agentId)) &&
    Number.isInteger(p.leaseTtlMs) &&
    p.leaseTtlMs >= 100 &&
    p.leaseTtlMs <= 86_400_000;
  const bad = quick
    ? undefined
    : checkAll(
        check(
          'items',
          z
            .array(z.object({ attemptId: schemas.id, agentId: schemas.agentId, progress: z.unknown().optional() }))
            .max(limits.heartbeatBatch, `must hold at most ${limits.heartbeatBatch} attempts`),
          p.items,
        ),
        check('leaseTtlMs', schemas.ttlMs, p.leaseTtlMs),
      );
  if (bad) return bad;
  const result: HeartbeatResult = { renewed: [], pending: [], lost: [] };
  if (p.items.length === 0) return ok(result);
  const progress: Array<string | undefined> = [];
  for (const [i, item] of p.items.entries()) {
    if (item.progress === undefined) {
      progress.push(undefined);
      continue;
    }
    const j = checkJson(`items.${i}.progress`, item.progress, { maxBytes: limits.progressBytes });
    if ('failure' in j) return j.failure;
    progress.push(j.json);
  }
  // One item per attempt in the statement; a second item for an attempt (another agent naming
  // it) is answered by the lookup below.
  const out: Array<Outcome<unknown> | undefined> = p.items.map(() => undefined);
  const batch = firstOfEach(p.items, out).map((k) => ({ item: p.items[k]!, progress: progress[k] }));
  const [ids, agents, jobs] = fenceParams(batch.map((b) => b.item));
  const rows = await run<{ attempt_id: string; agent_id: string; lease_expires_at: Date }>(db, heartbeatSql, [
    ids,
    agents,
    jobs,
    p.leaseTtlMs,
    byAttempt(ids, (k) => batch[k]!.progress),
    p.now ?? null,
  ]);
  const key = (attemptId: string, agentId: string) => `${attemptId.toLowerCase()} ${agentId}`;
  const renewed = new Set<string>();
  for (const r of rows) {
    renewed.add(key(r.attempt_id, r.agent_id));
    result.renewed.push({ attemptId: r.attempt_id, leaseExpiresAt: r.lease_expires_at });
  }
  const missed = p.items.filter((i) => !renewed.has(key(i.attemptId, i.agentId)));
  if (missed.length === 0) return ok(result);

  const found = await run<{
    attempt_id: string;
    agent_id: string;
    job_id: string | null;
    attempt_agent_id: string | null;
    status: JobStatus | null;
    attempt_no: number | null;
    current_attempt_id: string | null;
    timed_out: boolean | null;
  }>(db, heartbeatLookupSql, [missed.map((i) => i.attemptId), missed.map((i) => i.agentId), p.now ?? null]);
  for (const f of found) {
    if (!f.job_id || !f.status) {
      result.lost.push({ attemptId: f.attempt_id, reason: 'not_found' });
    } else if (f.attempt_agent_id !== f.agent_id) {
      result.lost.push({ attemptId: f.attempt_id, reason: 'forbidden' });
    } else if (f.current_attempt_id === f.attempt_id && f.status === 'claimed') {
      result.pending.push(f.attempt_id);
    } else if (f.current_attempt_id === f.attempt_id && f.status === 'running' && f.timed_out) {
      result.lost.push({
        attemptId: f.attempt_id,
        reason: 'timed_out',
        current: currentOf({ job_id: f.job_id, status: f.status, attempt_no: f.attempt_no ?? 0, current_attempt_id: f.current_attempt_id }),
      });
    } else if (f.current_attempt_id === f.attempt_id && f.status === 'running') {
      // Started by a start that committed after the UPDATE ran: that start set a fresh lease,
      // so it is not lost; the next heartbeat renews it.
      result.pending.push(f.attempt_id);
    } else {
      const s = await reportStale(db, {
        jobId: f.job_id,
        attemptId: f.attempt_id,
        agentId: f.agent_id,
        call: 'heartbeat',
        now: p.now,
      });
      result.lost.push({ attemptId: f.attempt_id, reason: 'stale', ...(s.outcome === 'stale' ? { current: s.current } : {}) });
    }
  }
  return ok(result);
}

// ─────────────────────────── complete ────────────────────────────

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

/**
 * What every end (a success, a final failure, a dead letter, a cancel) changes in its job's row as
 * the row moves from `jobs_live` to its day's partition of `jobs`, `now` being the end's time: the
 * live attempt's columns are cleared, the job finishes, and done_day is the day of PostgreSQL's
 * clock (not the time a test may give: a partition exists for today and the next days, days.ts).
 * Each end adds its own (status, …); every other column is copied as it was.
 */
export const endedColumn = (now: string): Record<string, string> => ({
  current_attempt_id: 'NULL',
  agent_id: 'NULL',
  lease_expires_at: 'NULL',
  execution_deadline: 'NULL',
  claimed_at: 'NULL',
  claim_deadline: 'NULL',
  started_at: 'NULL',
  suspect_since: 'NULL',
  finished_at: now,
  updated_at: now,
  done_day: "(now() AT TIME ZONE 'UTC')::date",
});

/** The select list that inserts the moved row `alias` into `jobs` with `changed` applied. */
export const movedRowSql = (alias: string, changed: Record<string, string>): string =>
  JOB_COLUMNS.map((c) => changed[c] ?? `${alias}.${c}`).join(', ');

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
const completeSql = (shape: Shape) =>
  statement(
    shape === 'job' ? 'attemptComplete' : 'attemptCompleteMany',
    `WITH d AS (
       DELETE FROM jobs_live j WHERE ${batchFence} AND j.status IN ('claimed', 'running') RETURNING j.*
     ), u AS (
       INSERT INTO jobs (${JOB_COLUMNS.join(', ')})
       SELECT ${movedRowSql('d', movedColumn)} FROM d
       RETURNING *
     ), k AS (
       ${countChangeSql('SELECT u.queue, u.status, 1 FROM u')}
     ), ec AS (
       ${endedCountSql(`SELECT u.finished_at, 'completed' FROM u`)}
     ), ${succeededNotificationSql}
     ${
       shape === 'job'
         ? 'SELECT d.current_attempt_id AS reported_by, u.*, NULL::jsonb AS error FROM u JOIN d ON d.id = u.id'
         : `SELECT d.current_attempt_id AS reported_by, d.id, d.queue, 'succeeded' AS status, d.attempt_no, NULL AS current_attempt_id,
              date_part('epoch', d.run_at) * 1000 AS run_at_ms, date_part('epoch', coalesce($5::timestamptz, now())) * 1000 AS updated_at_ms,
              NULL AS lease_ms
            FROM d`
     }`,
  );
const completeSqls = { job: completeSql('job'), summary: completeSql('summary') };

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
  const batch = firstOfEach(p.items, out);
  if (batch.length) {
    const items = batch.map((k) => p.items[k]!);
    const fence = fenceParams(items);
    const params = [...fence, byAttempt(fence[0], (i) => json[batch[i]!]), p.now ?? null];
    const rows = await withDays(db, () => run<Record<string, unknown>>(db, completeSqls[shape], params));
    const done = new Map(rows.map(({ reported_by, ...r }) => [reported_by as string, r]));
    for (const k of batch) {
      const row = done.get(p.items[k]!.attemptId.toLowerCase());
      if (row) out[k] = ok(shape === 'job' ? toJob(row) : toSummary(row as never));
    }
  }
  for (const [k, item] of p.items.entries()) {
    if (out[k]) continue;
    out[k] = await repeatOrStale(db, item, 'complete', { json: json[k]!, retryable: null }, 'completed');
  }
  return out as Array<Outcome<JobSummary>>;
}

/** After a zero-row complete or fail: the stored answer of a repeat, or why not. */
async function repeatOrStale(
  db: Queryable,
  p: AttemptRef,
  call: 'complete' | 'fail',
  report: { json: string; retryable: boolean | null },
  kind: 'completed' | 'failed',
): Promise<Outcome<Job>> {
  const o = await explain(db, { ...p, call }, report, (l) => {
    if (!l.kind) return undefined;
    if (l.kind === kind && l.same) return duplicate(l.job_id);
    return conflict(
      l.kind === kind
        ? `attempt ${p.attemptId} already reported a different ${kind === 'completed' ? 'result' : 'failure'}`
        : `attempt ${p.attemptId} already ${l.kind}`,
      currentOf(l),
    );
  });
  return withJob(db, o);
}

// ───────────────────────────── fail ──────────────────────────────

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

const errorSchema = z.object({ message: z.string().min(1, 'must not be empty') }).loose();

/**
 * Reports the attempt failed: `failed` for good, or retried after a backoff, or `dead` at the
 * attempt cap. Repeats are `duplicate` / `conflict` as for `attemptComplete`.
 */
export async function attemptFail(db: Queryable, p: FailParams): Promise<Outcome<Job>> {
  const bad = checkRef(p) ?? check('error', errorSchema, p.error) ?? check('retryable', z.boolean(), p.retryable);
  if (bad) return bad;
  const error = checkJson('error', p.error, { maxBytes: limits.errorBytes, object: true });
  if ('failure' in error) return error.failure;
  const backoff = p.backoff ?? DEFAULT_BACKOFF;
  const params = [p.attemptId, p.agentId, p.jobId ?? null, error.json, p.retryable, backoff.baseMs, backoff.maxMs, p.now ?? null];
  const [row] = await withDays(db, () => run<Record<string, unknown>>(db, failSql, params));
  if (row) return ok(toJob(row));
  return repeatOrStale(db, p, 'fail', { json: error.json, retryable: p.retryable }, 'failed');
}
