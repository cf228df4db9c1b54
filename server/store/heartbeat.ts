/**
 * Heartbeat: the leases of many running attempts renewed in one statement (one per coordinator
 * tick), and for those it did not renew, what each is now (pending, or lost and why).
 */
import { z } from 'zod';
import { ok, type CurrentState, type Outcome } from '../domain/outcomes.js';
import { RESCUE_REASONS, type JobStatus, type RescueReason } from '../domain/statuses.js';
import { check, checkAll, checkJson, limits, schemas, valid } from '../domain/validation.js';
import { batchFence, byAttempt, fenceParams, firstOfEach } from './batch.js';
import { currentOf } from './rows.js';
import { run, statement, type Queryable } from './sql.js';
import { reportStale } from './stale-reports.js';

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
  /**
   * No longer to be worked on, and why: what ended the attempt when a cancel or the reaper did
   * (`canceled`, `claim_expired`, `lease_expired`, `timed_out`: the reason that ending's own push
   * gives the agent), `timed_out` too for a running attempt past its execution deadline, `stale`
   * for one superseded or ended otherwise, `not_found`, or `forbidden` (another agent's).
   */
  lost: Array<{ attemptId: string; reason: LostReason; current?: CurrentState }>;
}

/** Why a heartbeat lost an attempt (HeartbeatResult.lost). */
export type LostReason = TakenBack | 'stale' | 'not_found' | 'forbidden';

/** How a cancel or the reaper ended an attempt (its `attempts` status): a heartbeat says so. */
type TakenBack = RescueReason | 'canceled';
const TAKEN_BACK: ReadonlySet<string> = new Set<TakenBack>([...RESCUE_REASONS, 'canceled']);

// One UPDATE renews every item whose attempt is current (batchFence), running, and not past its
// execution deadline, keeping the progress an item brings ($5, a map). It changes no indexed
// column: a HOT update when the page has room.
//
// It skips rows another transaction holds locked (SKIP LOCKED in the CTE that picks them, as the
// claim and the reaper do): one job's row locked for long (an operator's `SELECT … FOR UPDATE`,
// a transaction left open) would otherwise hold the renewal of every lease of this coordinator,
// which is one statement a tick, until the agents' local deadlines passed and they gave all
// their jobs up (measured: a row locked 50 s cost 4 running jobs, 3 of them rerun). A skipped
// row is current and running, so the lookup below answers it `pending` and the next tick tries
// it again; only its own lease waits for the lock. (The reaper skips it too while it is locked.)
const heartbeatSql = statement(
  'attemptHeartbeat',
  `WITH l AS (
     SELECT j.id FROM jobs_live j
     WHERE ${batchFence} AND j.status = 'running'
       AND (j.execution_deadline IS NULL OR j.execution_deadline > coalesce($6::timestamptz, now()))
     FOR UPDATE SKIP LOCKED
   )
   UPDATE jobs_live j SET
     lease_expires_at = least(coalesce($6::timestamptz, now()) + make_interval(secs => $4::float8 / 1000.0), j.execution_deadline),
     heartbeat_at = coalesce($6::timestamptz, now()),
     progress = coalesce($5::jsonb -> j.current_attempt_id::text, j.progress)
   FROM l WHERE j.id = l.id
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
          a.status AS attempt_status, j.status, j.attempt_no, j.current_attempt_id,
          j.execution_deadline <= coalesce($3::timestamptz, now()) AS timed_out
   FROM unnest($1::uuid[], $2::text[]) AS x(id, agent_id)
   LEFT JOIN LATERAL (SELECT e.job_id, e.agent_id, e.status FROM attempt_log e WHERE e.id = x.id LIMIT 1) a ON true
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
    attempt_status: string | null;
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
      // Started by a start that committed after the UPDATE ran (that start set a fresh lease), or
      // its row was locked by another transaction and skipped: not lost; the next heartbeat
      // renews it.
      result.pending.push(f.attempt_id);
    } else {
      const s = await reportStale(db, {
        jobId: f.job_id,
        attemptId: f.attempt_id,
        agentId: f.agent_id,
        call: 'heartbeat',
        now: p.now,
      });
      // An attempt a cancel or the reaper ended says how: the agent hears the same reason whether
      // that ending's own push or this heartbeat reaches it first.
      const reason = f.attempt_status !== null && TAKEN_BACK.has(f.attempt_status) ? (f.attempt_status as TakenBack) : 'stale';
      result.lost.push({ attemptId: f.attempt_id, reason, ...(s.outcome === 'stale' ? { current: s.current } : {}) });
    }
  }
  return ok(result);
}
