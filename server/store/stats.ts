/**
 * What GetStats, the dashboard and the metrics gauges read: job counts per queue and status (kept,
 * not counted: counts.ts), the due jobs waiting per queue, and per-minute counts of transitions.
 * Read-only, from one snapshot, and on no hot path.
 */
import { z } from 'zod';
import { ok, type Outcome } from '../domain/outcomes.js';
import { check } from '../domain/validation.js';
import { ENDED_MINUTES_KEPT, jobCounts, type QueueDepth } from './counts.js';
import { camelRow } from './rows.js';
import { run, statement, withTransaction, type Queryable } from './sql.js';

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
      // two workers launched on every call, 5.6 ms for 0.2 of work (docs/performance-history.md, "Cost
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

/** Built once (a zod schema costs tens of microseconds to build). */
const windowSchema = z.int().min(1).max(ENDED_MINUTES_KEPT);

/** Depths, waits and per-minute counts over the last `windowMinutes` (default 15), from one snapshot. */
export async function statsGet(db: Queryable, p: { windowMinutes?: number } = {}): Promise<Outcome<Stats>> {
  const bad = p.windowMinutes === undefined ? undefined : check('windowMinutes', windowSchema, p.windowMinutes);
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
