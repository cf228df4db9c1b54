/**
 * Claim: queued jobs handed to agents, each with a fresh attempt, its id the fencing token
 * (queued → claimed). One CTE per call, for one agent or for many agents' free slots at once.
 */
import { randomBytes } from 'node:crypto';
import { z } from 'zod';
import { ok, type Outcome } from '../domain/outcomes.js';
import { check, checkAll, limits, schemas, valid } from '../domain/validation.js';
import { jobErrorSql, type Job } from './rows.js';
import { run, statement, type Queryable } from './sql.js';

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
//
// The claim's time is the clock read once as the statement runs (t), not now(): now() is when
// the transaction began, before the statement was parsed and planned and so before its snapshot
// was taken. A job the reaper gave back in between (its statement began after the claim's and
// committed before the claim's snapshot) would be recorded as claimed before its last attempt
// ended (seen in chaos: 6.6 ms before). The clock read here comes after the snapshot, so after
// every end the claim saw. Which jobs are due still uses now(): the index scan needs a stable
// value, and the earlier time only ever leaves a job due this instant for the next claim.
export const claimSql = statement(
  'jobClaim',
  `WITH t AS MATERIALIZED (
     SELECT coalesce($6::timestamptz, clock_timestamp()) AS at
   ), c AS MATERIALIZED (
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
   -- dispatcher's hand-off makes the same shape (ids.ts, randomAttemptId).
   UPDATE jobs_live j SET status = 'claimed', attempt_no = j.attempt_no + 1,
     current_attempt_id = ${attemptIdSql('(SELECT at FROM t)', `sha256($3::bytea || int4send(((SELECT rn FROM m) ->> j.id::text)::int))`)},
     agent_id = ($4::text[])[($8::int2[])[((SELECT rn FROM m) ->> j.id::text)::int]], progress = NULL, heartbeat_at = NULL,
     claimed_at = (SELECT at FROM t),
     claim_deadline = (SELECT at FROM t) + make_interval(secs => $5::float8 / 1000.0),
     lease_expires_at = (SELECT at FROM t) + make_interval(secs => $5::float8 / 1000.0),
     updated_at = (SELECT at FROM t)
   WHERE j.id = ANY ((SELECT ids FROM m)::uuid[])
   -- What an Assign carries, times as epoch milliseconds (cheaper to read than timestamps). A
   -- job's error is that of an earlier attempt: only a job claimed before can have one.
   RETURNING ((SELECT rn FROM m) ->> j.id::text)::int AS slot, j.id, j.queue, j.payload, j.priority, j.max_attempts, j.attempt_no, j.attempts_started,
     j.current_attempt_id, j.agent_id, j.execution_timeout_ms, j.idempotency_key, j.labels, j.notify_url,
     date_part('epoch', j.run_at) * 1000 AS run_at_ms, date_part('epoch', j.created_at) * 1000 AS created_at_ms,
     date_part('epoch', j.claimed_at) * 1000 AS claimed_at_ms, date_part('epoch', j.claim_deadline) * 1000 AS claim_deadline_ms,
     CASE WHEN j.attempt_no > 1 THEN ${jobErrorSql('j')} END AS error`,
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

/** Built once (a zod schema costs tens of microseconds to build). */
const limitSchema = z.int().min(1).max(limits.claimBatch);

/** Claims up to `limit` queued jobs of `queues` for one agent, each with a fresh attempt. */
export async function jobClaim(db: Queryable, p: ClaimParams): Promise<Outcome<Claimed[]>> {
  const bad = checkAll(
    check('agentId', schemas.agentId, p.agentId),
    check('limit', limitSchema, p.limit),
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

// Claims made for a stream that ended before they could be sent (agent-hub.ts, `assign`): their
// start deadline becomes now (and the lease, which a claim sets to it and the reaper reads), and
// the reaper ends them as any claim not started in time
// (claim_expired: back to the queue where they stood, not counted). Only while still claimed
// with this attempt: a claim already ended or started is left alone.
const claimsExpireSql = statement(
  'claimsExpire',
  `UPDATE jobs_live SET claim_deadline = least(claim_deadline, now()), lease_expires_at = least(lease_expires_at, now())
   WHERE current_attempt_id = ANY ($1::uuid[]) AND status = 'claimed'`,
);

/** Moves the start deadline of these claims to now, for the reaper to take them back (see claimsExpireSql). */
export async function claimsExpire(db: Queryable, p: { attemptIds: string[] }): Promise<void> {
  await run(db, claimsExpireSql, [p.attemptIds]);
}
