/**
 * The `history` scenario's parts: finished jobs seeded as `npm run seed:history` writes them, and
 * the operator reads timed through the store functions their RPCs call (GetStats and the
 * `/metrics` gauges, ListJobs by each filter, GetJob, ListAgents).
 */
import type pg from 'pg';
import pino from 'pino';
import { Purger } from '../../server/core/purger.js';
import { DEFAULT_SEED, seedHistory } from '../../server/seed-history.js';
import { agentOverview, jobDepths, jobGet, jobList, jobSearch, statsGet } from '../../server/store/index.js';

/**
 * The "empty" round's history: enough finished jobs that every list fills its page (50 jobs) in
 * both rounds, so the ratio is what the history costs, not the difference between a short page
 * and a full one (with 100 jobs the lists by queue and status returned 14 and 2 jobs against 50;
 * a page of 50 takes ~2 ms whatever the history, of which the statement ~0.4 ms at 3,000,000
 * jobs by EXPLAIN ANALYZE; the rest is the round trip and turning 50 rows into jobs).
 */
export const HISTORY_EMPTY_JOBS = 5000;

/**
 * Calls per read; the first is discarded (its plan and pages are cold). 15 timed: with 7, one
 * slow stretch of this 2-core machine moved a median by 2 × (a read of 2.4 – 15.2 ms).
 */
const CALLS = 16;

/**
 * Seeds `n` finished jobs over the last 6 days (the default mix; inside the coordinator's 7-day
 * retention, so its purger takes none of them while the scenario runs).
 */
export async function seedFinished(pool: pg.Pool, n: number): Promise<void> {
  await seedHistory(pool, { ...DEFAULT_SEED, jobs: n, days: HISTORY_DAYS });
}

/** How long the seeded history reaches back (`seedFinished`), in days. */
export const HISTORY_DAYS = 6;

/**
 * Purges the oldest whole UTC day of the seeded history, as the coordinator's purger does (each
 * day's partition detached, then its jobs' attempts, events and keys swept behind it at the
 * purger's default pace, `sweepShare`), and says how long until the day was gone from the reads,
 * how long until it was swept, how many jobs went and which days. The history starts `HISTORY_DAYS` ago at this time
 * of day, so its first day is only the part after that: it goes too (the purger drops every day
 * ended before its cutoff), and the figure is a whole day's at any hour (the first day alone held
 * 53,197 jobs at 23:17 and 390,113 in the evening). `sweepHold`, when given, is awaited before
 * each batch of the sweep (`PurgerConfig.sweepHold`).
 */
export async function purgeOldestDay(
  pool: pg.Pool,
  sweepHold?: () => Promise<void>,
): Promise<{ ms: number; goneMs: number; purged: number; batches: number; days: string[] }> {
  const day = 86_400_000;
  const start = Date.now() - HISTORY_DAYS * day;
  const cutoff = Math.floor(start / day) * day + 2 * day; // the end of the first whole day
  const purger = new Purger(pool, pino({ level: 'silent' }), { retentionMs: Date.now() - cutoff, sweepHold });
  const t0 = performance.now();
  const run = await purger.runOnce();
  return { ms: performance.now() - t0, goneMs: run.goneMs, purged: run.purged, batches: run.batches, days: run.days };
}

/** A read's times (ms, `CALLS - 1` of them) and, for a list, how many jobs its page held. */
export interface ReadTimes {
  ms: number[];
  rows?: number;
}

/** Each operator read, timed `CALLS - 1` times. */
export async function historyReads(pool: pg.Pool): Promise<Map<string, ReadTimes>> {
  const day = 86_400_000;
  const now = Date.now();
  // A job from the middle of the history, read by id.
  const { rows } = await pool.query(`SELECT id FROM jobs WHERE queue <> 'noop' ORDER BY created_at LIMIT 1 OFFSET (SELECT count(*) / 2 FROM jobs WHERE queue <> 'noop')`);
  const jobId = rows[0]?.id as string;
  const must = async <T>(o: Promise<{ outcome: string; value?: T }>) => {
    const x = await o;
    if (x.outcome !== 'ok') throw new Error(`history read refused: ${JSON.stringify(x)}`);
    const v = x.value as { jobs?: unknown[] } | undefined;
    return v?.jobs ? v.jobs.length : undefined;
  };
  const reads: Array<[string, () => Promise<number | undefined>]> = [
    ['GetStats', () => must(statsGet(pool))],
    ['/metrics gauges', async () => void (await jobDepths(pool))],
    ['ListJobs by queue', () => must(jobSearch(pool, { queue: 'reports' }))],
    ['ListJobs by status', () => must(jobSearch(pool, { statuses: ['dead'] }))],
    ['ListJobs by agent', () => must(jobSearch(pool, { agentId: 'seed-agent-03' }))],
    ['ListJobs by time', () => must(jobSearch(pool, { createdAfter: new Date(now - 3 * day), createdBefore: new Date(now - 2 * day) }))],
    ['JobService ListJobs by queue', () => must(jobList(pool, { queue: 'reports' }))],
    ['GetJob', async () => void (await must(jobGet(pool, { jobId })))],
    ['ListAgents', async () => void (await must(agentOverview(pool, { staleAfterMs: 60_000 })))],
  ];
  const out = new Map<string, ReadTimes>();
  for (const [name, read] of reads) {
    const ms: number[] = [];
    let rows: number | undefined;
    for (let i = 0; i < CALLS; i++) {
      const t0 = performance.now();
      rows = await read();
      if (i > 0) ms.push(performance.now() - t0);
    }
    out.set(name, rows === undefined ? { ms } : { ms, rows });
  }
  return out;
}
