/**
 * What operators read (AdminService, the CLI, the dashboard, the metrics gauges) and the one
 * maintenance write they have: purging finished jobs. Every read here is read-only and none is
 * on a hot path. What the transitions pay for them: BRIN on `attempts.ended_at` and
 * `job_events.at` (nearly free: both are appended in time order), the kept counts (counts.ts)
 * and the lists' indexes, which a job enters only when it finishes (job-list.ts).
 */
import { z } from 'zod';
import { invalid, ok, type Outcome } from '../domain/outcomes.js';
import { check, checkAll, schemas } from '../domain/validation.js';
import { camelRow, type Job } from './rows.js';
import { jobListPage } from './job-list.js';
import type { AgentSessionRow, StaleReportRow } from './schema.js';
import { referencesDeleteSql } from './references.js';
import { run, statement, withTransaction, type Queryable } from './sql.js';
import { FINISHED_STATUSES, JOB_STATUSES, type AttemptStatus, type JobStatus } from '../domain/statuses.js';
import { countChangeSql, ENDED_MINUTES_KEPT, endedCountSql, endedCutoff, endedKindSql, jobCounts, type QueueDepth } from './counts.js';

/** The terminal statuses: the only ones a purge takes. */
export { FINISHED_STATUSES };

const statuses = z.array(z.enum(JOB_STATUSES)).max(JOB_STATUSES.length);
const pageSize = z.int().min(1).max(500);

export interface JobSearchParams {
  statuses?: JobStatus[];
  queue?: string;
  /** Jobs with an attempt by this agent. */
  agentId?: string;
  createdAfter?: Date;
  createdBefore?: Date;
  /** 1 to 500; default 50. */
  pageSize?: number;
  pageToken?: string;
}

/** A page of jobs matching every filter given, newest first, and the next page's token (job-list.ts). */
export async function jobSearch(db: Queryable, p: JobSearchParams): Promise<Outcome<{ jobs: Job[]; nextPageToken: string }>> {
  const bad = checkAll(
    p.statuses === undefined ? undefined : check('statuses', statuses, p.statuses),
    p.queue === undefined ? undefined : check('queue', schemas.queue, p.queue),
    p.agentId === undefined ? undefined : check('agentId', schemas.agentId, p.agentId),
    p.createdAfter === undefined ? undefined : check('createdAfter', schemas.date, p.createdAfter),
    p.createdBefore === undefined ? undefined : check('createdBefore', schemas.date, p.createdBefore),
    p.pageSize === undefined ? undefined : check('pageSize', pageSize, p.pageSize),
  );
  if (bad) return bad;
  const { pageSize: size = 50, pageToken, ...filter } = p;
  return jobListPage(db, filter, size, pageToken);
}

export interface PurgeParams {
  /** Jobs that finished longer ago than this are purged. At least 1 s. */
  olderThanMs: number;
  /** Terminal statuses to purge; default all four. */
  statuses?: JobStatus[];
  queue?: string;
  /** Jobs per statement; default 1000. */
  limit?: number;
  /** Count, delete nothing. */
  dryRun?: boolean;
  now?: Date;
  /**
   * Only jobs that finished at or after this time: the `last` of the previous batch of the same
   * run, so each batch starts where the last one ended instead of walking the index entries of
   * the jobs already deleted (dead until VACUUM). A job skipped meanwhile is left to the next run.
   */
  after?: Date;
  /**
   * Only finished jobs in `jobs_live` (those from before every end moved its job, or kept back by a
   * day's drop for their undelivered notification; not those in the partitions of their days, which
   * the purger drops whole: days.ts). The purger's; an operator's purge takes every partition.
   */
  liveOnly?: boolean;
}

// Finished before the cutoff, of the statuses and queue asked for, and with nothing left for the
// deliverer: a job whose notification is still to be delivered, or whose dead-letter alert was
// not raised yet, is kept until the deliverer is done with it. The deliveries' status spelled as
// two arms, each the predicate of a partial index (webhook_deliveries_due_idx, _sending_idx),
// so the open deliveries are read from those: as `status IN (...)` it matched neither, and every
// batch read the whole table (a delivery per notified job of the history kept).
const purgeWhere = `j.finished_at < w.cutoff AND j.status = ANY($2::job_status[]) AND ($3::text IS NULL OR j.queue = $3)
       AND NOT EXISTS (SELECT 1 FROM webhook_events e JOIN webhook_deliveries d ON d.event_id = e.id
                       WHERE e.job_id = j.id AND (d.status = 'pending' OR d.status = 'sending'))
       AND NOT EXISTS (SELECT 1 FROM webhook_events e WHERE e.job_id = j.id AND e.type = 'job.dead' AND e.alerted_at IS NULL)`;
const cutoffCte = `w AS (SELECT coalesce($4::timestamptz, now()) - make_interval(secs => $1::float8 / 1000.0) AS cutoff)`;

// One batch. Candidates come oldest first from jobs_finished_idx (of each partition of jobs, or of
// jobs_live) and are locked FOR UPDATE SKIP LOCKED, so purgers on several replicas take different
// jobs, and an operator's requeue of the same job either waits for the delete (and then finds
// nothing) or commits first (finished_at is NULL then, and the recheck under the lock drops the
// row). The jobs themselves, their keys, their attempts and the rows of JOB_REFERENCES (events,
// steps, stale reports, notify header, webhook events, whose deliveries the events' cascade
// takes) go in the same statement (references.ts), none having a foreign key to jobs (schema.ts): each through
// its index, the batch's ids (and keys) given as one array so that the
// plan is an index scan whatever the planner thinks of the table's size (joined with `c`, steps
// were read whole, a hash join, at 60,000 rows; the jobs' own delete, joined with `c`, read every
// partition of ten million finished jobs whole). The kept counts lose what was deleted, and the
// per-minute counts what ended in the last day: the deleted attempts (their rows, and the
// successes kept on the jobs' rows) and cancels of queued jobs (job_events) of that day, as a
// recount of what is kept would find (counts.ts).
const purgeSqlOf = (name: string, from: 'jobs' | 'jobs_live') =>
  statement(
  name,
  `WITH ${cutoffCte}, c AS (
     SELECT j.id, j.status, j.finished_at, j.idempotency_key FROM ${from} j, w WHERE ${purgeWhere} AND j.finished_at >= coalesce($6::timestamptz, '-infinity')
     ORDER BY j.finished_at
     LIMIT $5
     FOR UPDATE OF j SKIP LOCKED
   ), ids AS (
     SELECT array_agg(id) AS ids, array_agg(idempotency_key) FILTER (WHERE idempotency_key IS NOT NULL) AS keys FROM c
   ), d AS (
     DELETE FROM ${from} j WHERE j.id = ANY((SELECT ids FROM ids)::uuid[]) RETURNING j.id, j.queue, j.status, j.finished_at, j.final_attempt_id
   ), ${referencesDeleteSql('(SELECT ids FROM ids)::uuid[]', '(SELECT keys FROM ids)::text[]')}, k AS (
     ${countChangeSql('SELECT queue, status, -1 FROM d')}
   ), ec AS (
     ${endedCountSql(`SELECT ended_at, ${endedKindSql('status', 'job_status')} FROM a WHERE ended_at >= ${endedCutoff}
       UNION ALL SELECT finished_at, 'completed' FROM d WHERE final_attempt_id IS NOT NULL AND finished_at >= ${endedCutoff}
       UNION ALL SELECT at, 'canceled' FROM e WHERE kind = 'canceled' AND at >= ${endedCutoff}`, '-1')}
   )
   SELECT (SELECT count(*) FROM d)::int AS n, (SELECT cutoff FROM w) AS cutoff, (SELECT max(finished_at) FROM c) AS last`,
);
// Every partition (an operator's PurgeJobs: the jobs asked for, exactly), or jobs_live only (the
// purger, which drops the partitions of days whole: days.ts).
export const purgeSql = purgeSqlOf('jobPurge', 'jobs');
const purgeLiveSql = purgeSqlOf('jobPurgeLive', 'jobs_live');

// A dry run: counts every job the purge would take, locking nothing.
const purgeCountSql = statement(
  'jobPurgeCount',
  `WITH ${cutoffCte}
   SELECT (SELECT count(*) FROM jobs j, w WHERE ${purgeWhere})::int AS n, (SELECT cutoff FROM w) AS cutoff`,
);

/**
 * Deletes up to `limit` finished jobs older than the cutoff; returns how many, the cutoff, and the
 * finish time of the last one it took (for `after`).
 * Callers repeat it until fewer than `limit` come back. A dry run counts them all and deletes
 * nothing.
 */
export async function jobPurge(db: Queryable, p: PurgeParams): Promise<Outcome<{ purged: number; cutoff: Date; last?: Date }>> {
  const bad = checkAll(
    check('olderThanMs', z.int().min(1000, 'must be at least 1 second'), p.olderThanMs),
    p.statuses === undefined
      ? undefined
      : check('statuses', z.array(z.enum(FINISHED_STATUSES, `must be one of ${FINISHED_STATUSES.join(', ')} (only finished jobs are purged)`)), p.statuses),
    p.queue === undefined ? undefined : check('queue', schemas.queue, p.queue),
    p.limit === undefined ? undefined : check('limit', z.int().min(1).max(100_000), p.limit),
  );
  if (bad) return bad;
  const params = [p.olderThanMs, p.statuses?.length ? p.statuses : FINISHED_STATUSES, p.queue ?? null, p.now ?? null];
  if (p.dryRun) {
    const [row] = await run<{ n: number; cutoff: Date }>(db, purgeCountSql, params);
    return ok({ purged: row!.n, cutoff: row!.cutoff });
  }
  const [row] = await run<{ n: number; cutoff: Date; last: Date | null }>(db, p.liveOnly ? purgeLiveSql : purgeSql, [...params, p.limit ?? 1000, p.after ?? null]);
  return ok({ purged: row!.n, cutoff: row!.cutoff, ...(row!.last ? { last: row!.last } : {}) });
}

export type { QueueDepth };

/** The due queued jobs of a queue and the one waiting longest. */
export interface QueueWait {
  queue: string;
  due: number;
  oldestJobId: string;
  oldestDueAt: Date;
  oldestAgeMs: number;
}

// Due queued jobs only, from jobs_claim_idx, which holds exactly the queued ones: "queued" is
// spelled as that index's predicate (a check constraint ties it to status = 'queued'), which the
// planner can match; `status = 'queued'` it cannot, and read every job kept instead (49 ms for a
// million finished jobs against 0.1, measured with `seed:history`).
export const waitSql = statement(
  'adminQueueWaits',
  `SELECT DISTINCT ON (queue) queue, id, run_at, count(*) OVER (PARTITION BY queue)::int8 AS due,
     (extract(epoch FROM now() - run_at) * 1000)::float8 AS age_ms
   FROM jobs_live WHERE current_attempt_id IS NULL AND finished_at IS NULL AND run_at <= now()
   ORDER BY queue, run_at, id`,
);

/** Job counts per queue and status, and per queue the due jobs waiting and the oldest of them. */
export async function jobDepths(db: Queryable): Promise<{ depths: QueueDepth[]; waiting: QueueWait[] }> {
  return withTransaction(
    db,
    async (tx) => {
      // Planned serial. Both statements have no parameters, so a connection plans each once and
      // keeps the plan; one made while a burst had jobs_live past 8 MB was parallel, and stayed:
      // two workers launched on every call, 5.6 ms for 0.2 of work (docs/performance.md, "Cost
      // as the work grows"). A few thousand live jobs never need a parallel plan.
      await tx.query('SET LOCAL max_parallel_workers_per_gather = 0');
      const depths = await jobCounts(tx);
      const waits = await run<{ queue: string; id: string; run_at: Date; due: number; age_ms: number }>(tx, waitSql, []);
      return {
        depths,
        waiting: waits.map((w) => ({ queue: w.queue, due: w.due, oldestJobId: w.id, oldestDueAt: w.run_at, oldestAgeMs: Math.max(0, Math.round(w.age_ms)) })),
      };
    },
    { mode: 'REPEATABLE READ, READ ONLY' },
  );
}

/** Transitions of one minute. */
export interface MinuteCounts {
  minute: Date;
  succeeded: number;
  failed: number;
  retried: number;
  dead: number;
  canceled: number;
  claimExpired: number;
  leaseExpired: number;
  timedOut: number;
}

const countColumns = `
     coalesce(sum(n) FILTER (WHERE kind = 'completed'), 0)::int AS succeeded,
     coalesce(sum(n) FILTER (WHERE kind = 'failed'), 0)::int AS failed,
     coalesce(sum(n) FILTER (WHERE kind = 'retry_scheduled'), 0)::int AS retried,
     coalesce(sum(n) FILTER (WHERE kind = 'dead'), 0)::int AS dead,
     coalesce(sum(n) FILTER (WHERE kind = 'canceled'), 0)::int AS canceled,
     coalesce(sum(n) FILTER (WHERE kind = 'claim_expired'), 0)::int AS claim_expired,
     coalesce(sum(n) FILTER (WHERE kind = 'lease_expired'), 0)::int AS lease_expired,
     coalesce(sum(n) FILTER (WHERE kind = 'timed_out'), 0)::int AS timed_out`;

// The window's minutes from what the transitions keep (counts.ts, `ended_counts`): the current
// (partial) minute and the $1 - 1 before it, each as its rows sum. Reading what ended instead
// read every attempt of the window: 14 ms at ten million jobs, growing with the rate.
export const statsMinutesSql = statement(
  'adminMinuteCounts',
  `WITH w AS (SELECT date_trunc('minute', now()) - ($1::int - 1) * interval '1 minute' AS start),
   c AS (
     SELECT k.minute, k.kind, sum(k.n) AS n FROM ended_counts k, w WHERE k.minute >= w.start GROUP BY 1, 2
   )
   SELECT m.minute, ${countColumns}
   FROM w, generate_series(w.start, date_trunc('minute', now()), interval '1 minute') AS m(minute)
   LEFT JOIN c ON c.minute = m.minute
   GROUP BY m.minute ORDER BY m.minute`,
);

// The window as a whole: from the start of its first minute to now, how long that is (the
// rates' divisor), and the stale reports in it.
const windowSql = statement(
  'adminWindowCounts',
  `WITH w AS (SELECT date_trunc('minute', now()) - ($1::int - 1) * interval '1 minute' AS start)
   SELECT (extract(epoch FROM now() - w.start) / 60)::float8 AS span_minutes,
     (SELECT count(*) FROM stale_reports WHERE at >= w.start)::int8 AS stale_reports,
     now() AS now
   FROM w`,
);

/** What GetStats answers. */
export interface Stats {
  depths: QueueDepth[];
  waiting: QueueWait[];
  minutes: MinuteCounts[];
  /** Counts over the window (the sum of its minutes). */
  window: Omit<MinuteCounts, 'minute'>;
  windowMinutes: number;
  /** How long the window is so far, in minutes: from the start of its first minute to now. */
  spanMinutes: number;
  staleReports: number;
  now: Date;
}

/** Depths, waits and per-minute counts over the last `windowMinutes` (default 15), from one snapshot. */
export async function statsGet(db: Queryable, p: { windowMinutes?: number } = {}): Promise<Outcome<Stats>> {
  const bad = p.windowMinutes === undefined ? undefined : check('windowMinutes', z.int().min(1).max(ENDED_MINUTES_KEPT), p.windowMinutes);
  if (bad) return bad;
  const windowMinutes = p.windowMinutes ?? 15;
  return withTransaction(
    db,
    async (tx) => {
      const { depths, waiting } = await jobDepths(tx);
      const minutes = (await run<Record<string, unknown>>(tx, statsMinutesSql, [windowMinutes])).map((r) => camelRow<MinuteCounts>(r));
      const [w] = await run<{ span_minutes: number; stale_reports: number; now: Date }>(tx, windowSql, [windowMinutes]);
      const window = { succeeded: 0, failed: 0, retried: 0, dead: 0, canceled: 0, claimExpired: 0, leaseExpired: 0, timedOut: 0 };
      for (const m of minutes) for (const k of Object.keys(window) as (keyof typeof window)[]) window[k] += m[k];
      return ok({ depths, waiting, minutes, window, windowMinutes, spanMinutes: w!.span_minutes, staleReports: w!.stale_reports, now: w!.now });
    },
    { mode: 'REPEATABLE READ, READ ONLY' },
  );
}

// Newest first, paged by id (the primary key; stale_reports_job_idx serves the job filter).
const staleSql = statement(
  'adminStaleReports',
  `SELECT * FROM stale_reports
   WHERE ($1::uuid IS NULL OR job_id = $1) AND ($2::text IS NULL OR agent_id = $2) AND ($3::bigint IS NULL OR id < $3)
   ORDER BY id DESC LIMIT $4`,
);

/** A page of stale reports, newest first. */
export async function staleReportList(
  db: Queryable,
  p: { jobId?: string; agentId?: string; pageSize?: number; pageToken?: string },
): Promise<Outcome<{ reports: StaleReportRow[]; nextPageToken: string }>> {
  const bad = checkAll(
    p.jobId === undefined ? undefined : check('jobId', schemas.id, p.jobId),
    p.agentId === undefined ? undefined : check('agentId', schemas.agentId, p.agentId),
    p.pageSize === undefined ? undefined : check('pageSize', pageSize, p.pageSize),
  );
  if (bad) return bad;
  let before: number | null = null;
  if (p.pageToken) {
    const m = /^s(\d{1,15})$/.exec(Buffer.from(p.pageToken, 'base64url').toString('utf8'));
    if (!m) return invalid('pageToken', 'is not a token this server issued');
    before = Number(m[1]);
  }
  const size = p.pageSize ?? 50;
  const rows = await run<Record<string, unknown>>(db, staleSql, [p.jobId ?? null, p.agentId ?? null, before, size + 1]);
  const page = rows.slice(0, size).map((r) => camelRow<StaleReportRow>(r));
  const last = page.at(-1);
  return ok({ reports: page, nextPageToken: rows.length > size && last ? Buffer.from(`s${last.id}`).toString('base64url') : '' });
}

/** An attempt an agent holds now. */
export interface HeldAttempt {
  attemptId: string;
  jobId: string;
  queue: string;
  agentId: string;
  attemptNo: number;
  status: Extract<AttemptStatus, 'claimed' | 'running'>;
  claimedAt: Date;
  startedAt: Date | null;
  leaseExpiresAt: Date | null;
  suspectSince: Date | null;
}

/** An agent, its open streams and what it holds. */
export interface AgentOverview {
  agentId: string;
  /** False: a key with the agent scope holding attempts (no agents row). */
  registered: boolean;
  createdAt: Date | null;
  revokedAt: Date | null;
  lastSeenAt: Date | null;
  sessions: AgentSessionRow[];
  attempts: HeldAttempt[];
}

const agentsSql = statement('adminAgents', `SELECT * FROM agents WHERE ($1::text IS NULL OR id = $1) ORDER BY created_at, id`);
const sessionsSql = statement(
  'adminAgentSessions',
  `SELECT * FROM agent_sessions
   WHERE ($1::text IS NULL OR agent_id = $1) AND seen_at >= now() - make_interval(secs => $2::float8 / 1000.0)
   ORDER BY connected_at, id`,
);
// Live attempts are held jobs' rows; jobs_current_attempt_uq holds exactly those.
const heldSql = statement(
  'adminHeldAttempts',
  `SELECT j.current_attempt_id AS attempt_id, j.id AS job_id, j.queue, j.agent_id, j.attempt_no, j.status::text AS status,
     j.claimed_at, j.started_at, j.lease_expires_at, j.suspect_since
   FROM jobs_live j
   WHERE j.current_attempt_id IS NOT NULL AND ($1::text IS NULL OR j.agent_id = $1)
   ORDER BY j.claimed_at, j.current_attempt_id`,
);

/**
 * Every agent (or one) with its live streams (rows stamped within `staleAfterMs`) and the
 * attempts it holds; revoked agents that hold nothing only with `includeRevoked`. Agents that
 * hold attempts through an API key (no agents row) come last.
 */
export async function agentOverview(
  db: Queryable,
  p: { agentId?: string; includeRevoked?: boolean; staleAfterMs: number },
): Promise<Outcome<AgentOverview[]>> {
  const bad = p.agentId === undefined ? undefined : check('agentId', schemas.agentId, p.agentId);
  if (bad) return bad;
  return withTransaction(
    db,
    async (tx) => {
      const id = p.agentId ?? null;
      const agents = await run<Record<string, unknown>>(tx, agentsSql, [id]);
      const sessions = (await run<Record<string, unknown>>(tx, sessionsSql, [id, p.staleAfterMs])).map((r) => camelRow<AgentSessionRow>(r));
      const held = (await run<Record<string, unknown>>(tx, heldSql, [id])).map((r) => camelRow<HeldAttempt>(r));
      const out = new Map<string, AgentOverview>();
      for (const a of agents) {
        out.set(a.id as string, {
          agentId: a.id as string,
          registered: true,
          createdAt: a.created_at as Date,
          revokedAt: (a.revoked_at as Date | null) ?? null,
          lastSeenAt: (a.last_seen_at as Date | null) ?? null,
          sessions: [],
          attempts: [],
        });
      }
      const entry = (agentId: string) => {
        let e = out.get(agentId);
        if (!e) {
          e = { agentId, registered: false, createdAt: null, revokedAt: null, lastSeenAt: null, sessions: [], attempts: [] };
          out.set(agentId, e);
        }
        return e;
      };
      for (const s of sessions) entry(s.agentId).sessions.push(s);
      for (const h of held) entry(h.agentId).attempts.push(h);
      return ok(
        [...out.values()].filter((a) => p.includeRevoked || !a.revokedAt || a.attempts.length > 0 || a.sessions.length > 0),
      );
    },
    { mode: 'REPEATABLE READ, READ ONLY' },
  );
}

const nowSql = statement('dbNow', `SELECT now() AS now`);

/** The database's clock (the one every lease and timestamp is on). */
export async function dbNow(db: Queryable): Promise<Date> {
  const [r] = await run<{ now: Date }>(db, nowSql, []);
  return r!.now;
}
