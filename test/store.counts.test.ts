/**
 * The job counts GetStats and `/metrics` read are kept, not counted (server/store/counts.ts):
 * every transition into or out of a finished status appends its change, the keeper folds them,
 * a recount corrects what was changed behind the transitions' back. The invariant checker
 * compares what is read with a count of every job after each test of state; here each path is
 * driven on purpose, and the fold and the recount are checked against concurrent writers.
 */
import pg from 'pg';
import pino from 'pino';
import { expect, it } from 'vitest';
import { CountKeeper } from '../server/core/count-keeper.js';
import {
  attemptComplete,
  attemptFail,
  attemptStart,
  endedCountsReconcile,
  jobCancel,
  jobClaim,
  jobCounts,
  jobCountsCompact,
  jobCountsReconcile,
  jobEnqueue,
  jobPurge,
  jobRequeue,
  jobRescueExpired,
  statsGet,
} from '../server/store/index.js';
import { jobDepths, statsMinutesSql } from '../server/store/stats.js';
import { countsReadSql } from '../server/store/counts.js';
import { migrateDatabase } from '../server/store/migrate.js';
import { useTestDb } from './helpers/db.js';
import { checkInvariants } from './helpers/invariants.js';
import { planNodes, type PlanNode } from './helpers/plan.js';

const t = useTestDb();
const T0 = Date.parse('2030-01-01T00:00:00Z');
const at = (ms: number) => new Date(T0 + ms);
const TTL = 1000;

function must<T>(o: { outcome: string; value?: T }): T {
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  return o.value as T;
}

const depth = async (queue: string) =>
  Object.fromEntries((await jobCounts(t.pool)).filter((d) => d.queue === queue).map((d) => [d.status, d.count]));

/** Enqueues, claims and starts one job of `queue`; returns its attempt. */
async function running(queue: string, ms: number, maxAttempts = 5) {
  must(await jobEnqueue(t.pool, { queue, payload: {}, maxAttempts, now: at(ms) }));
  const [c] = must(await jobClaim(t.pool, { agentId: 'a', queues: [queue], limit: 1, claimTtlMs: TTL, now: at(ms) }));
  must(await attemptStart(t.pool, { attemptId: c!.attemptId, agentId: 'a', leaseTtlMs: TTL, now: at(ms) }));
  return c!;
}

it('every transition into or out of a finished status keeps the counts', async () => {
  const q = 'kept';
  const ok = await running(q, 0);
  must(await attemptComplete(t.pool, { attemptId: ok.attemptId, agentId: 'a', result: {}, now: at(1) }));
  const bad = await running(q, 2);
  must(await attemptFail(t.pool, { attemptId: bad.attemptId, agentId: 'a', error: { message: 'no' }, retryable: false, now: at(3) }));
  const once = await running(q, 4, 1);
  must(await attemptFail(t.pool, { attemptId: once.attemptId, agentId: 'a', error: { message: 'again' }, retryable: true, now: at(5) }));
  const retry = await running(q, 6);
  must(await attemptFail(t.pool, { attemptId: retry.attemptId, agentId: 'a', error: { message: 'later' }, retryable: true, now: at(7) }));
  const lost = await running(q, 8, 1);
  must(await jobRescueExpired(t.pool, { limit: 10, now: at(8 + TTL + 1) }));
  const queued = must(await jobEnqueue(t.pool, { queue: q, payload: {}, runAt: at(1e9), now: at(10) }));
  must(await jobCancel(t.pool, { jobId: queued.id, now: at(11) }));
  const held = await running(q, 12);
  must(await jobCancel(t.pool, { jobId: held.job.id, now: at(13) }));
  expect(await depth(q)).toEqual({ queued: 1, succeeded: 1, failed: 1, dead: 2, canceled: 2 });
  await checkInvariants(t.pool);

  // An operator's requeue takes a job out of its finished status; a purge takes finished jobs away.
  must(await jobRequeue(t.pool, { jobId: lost.job.id, now: at(20) }));
  must(await jobRequeue(t.pool, { jobId: queued.id, now: at(21) }));
  expect(await depth(q)).toEqual({ queued: 3, succeeded: 1, failed: 1, dead: 1, canceled: 1 });
  // (The dead job stays: its alert is not raised yet.)
  const purged = must(await jobPurge(t.pool, { olderThanMs: 1000, statuses: ['dead', 'failed'], now: at(1e7) }));
  expect(purged.purged).toBe(1);
  expect(await depth(q)).toEqual({ queued: 3, succeeded: 1, dead: 1, canceled: 1 });
  await checkInvariants(t.pool);

  // Folded: one row per queue and status, the same figures.
  const rowsBefore = Number((await t.pool.query('SELECT count(*) FROM job_counts')).rows[0].count);
  expect(await jobCountsCompact(t.pool)).toBe(true);
  const { rows } = await t.pool.query('SELECT queue, status::text, n FROM job_counts ORDER BY status::text');
  expect(rows).toEqual([
    { queue: q, status: 'canceled', n: 1 },
    { queue: q, status: 'dead', n: 1 },
    { queue: q, status: 'succeeded', n: 1 },
  ]);
  expect(rowsBefore).toBeGreaterThan(rows.length);
  expect(await depth(q)).toEqual({ queued: 3, succeeded: 1, dead: 1, canceled: 1 });
  await checkInvariants(t.pool);
});

it('a fold keeps what a transition appends while it runs; a recount keeps what commits after it began', async () => {
  await t.truncate();
  for (let i = 0; i < 3; i++) {
    const c = await running('fold', 100 + i);
    must(await attemptComplete(t.pool, { attemptId: c.attemptId, agentId: 'a', result: {}, now: at(200 + i) }));
  }
  // A transition in flight: its change is appended but not committed when the fold runs.
  const other = await t.newPool(1).connect();
  try {
    const c = await running('fold', 300);
    await other.query('BEGIN');
    must(await attemptComplete(other, { attemptId: c.attemptId, agentId: 'a', result: {}, now: at(301) }));
    expect(await jobCountsCompact(t.pool)).toBe(true);
    await other.query('COMMIT');
  } finally {
    other.release();
  }
  expect(await depth('fold')).toEqual({ succeeded: 4 });
  await checkInvariants(t.pool);

  // A change behind the transitions' back: the recount reports it and keeps the jobs' figure.
  await t.pool.query(
    `WITH d AS (DELETE FROM jobs WHERE id = (SELECT id FROM jobs WHERE queue = 'fold' LIMIT 1) RETURNING id)
     DELETE FROM attempts WHERE job_id IN (SELECT id FROM d)`,
  );
  expect(await depth('fold')).toEqual({ succeeded: 4 });
  expect(await jobCountsReconcile(t.pool)).toEqual([{ queue: 'fold', status: 'succeeded', kept: 4, counted: 3 }]);
  expect(await depth('fold')).toEqual({ succeeded: 3 });
  expect(await endedCountsReconcile(t.pool)).toBe(1); // the minute 2030-01-01T00:00 counted 4 completions, 3 are kept
  await checkInvariants(t.pool);
});

it('the keeper recounts at its first run, then folds, and logs a drift it corrected', async () => {
  await t.truncate();
  const c = await running('keeper', 0);
  must(await attemptComplete(t.pool, { attemptId: c.attemptId, agentId: 'a', result: {}, now: at(1) }));
  await t.pool.query(`INSERT INTO job_counts (queue, status, n) VALUES ('keeper', 'dead', 5)`);
  await t.pool.query(`INSERT INTO ended_counts (minute, kind, n) VALUES (date_trunc('minute', now()), 'timed_out', 3)`);
  const warnings: string[] = [];
  const log = pino({ level: 'warn' }, { write: (line: string) => void warnings.push(line) });
  const keeper = new CountKeeper(t.pool, log, { intervalMs: 60_000 });
  expect(await keeper.runOnce()).toEqual({ kind: 'recount', drift: [{ queue: 'keeper', status: 'dead', kept: 5, counted: 0 }], minutesDrifted: 1 });
  expect(warnings.map((w) => JSON.parse(w).msg)).toEqual([
    'job counts had drifted from the jobs (changed outside the transitions); recounted',
    'per-minute counts had drifted from the attempts (changed outside the transitions); recounted',
  ]);
  expect(must(await statsGet(t.pool, { windowMinutes: 1 })).window.timedOut).toBe(0);
  expect(await keeper.runOnce()).toEqual({ kind: 'fold', drift: [], minutesDrifted: 0 });
  expect(await depth('keeper')).toEqual({ succeeded: 1 });
});

it('the counts read no finished job: the kept rows and the partial indexes of the live ones', async () => {
  await t.pool.query(
    `INSERT INTO jobs (queue, payload, status, result, finished_at)
     SELECT 'scan-' || (i % 3), '{}', 'succeeded', '{}', now() FROM generate_series(1, 20000) i`,
  );
  await jobCountsReconcile(t.pool);
  await t.pool.query('ANALYZE jobs');
  for (const mode of ['force_custom_plan', 'force_generic_plan']) {
    const c = await t.pool.connect();
    try {
      await c.query(`SET plan_cache_mode = ${mode}`);
      const { rows } = await c.query(`EXPLAIN (FORMAT JSON) ${countsReadSql.text}`);
      const plan = planNodes((rows[0]['QUERY PLAN'] as Array<{ Plan: PlanNode }>)[0]!.Plan);
      const onJobs = plan.filter((n) => n['Relation Name'] === 'jobs' || /^jobs_/.test(n['Index Name'] ?? ''));
      expect(onJobs.map((n) => n['Node Type']), mode).not.toContain('Seq Scan');
      expect(new Set(onJobs.map((n) => n['Index Name']).filter(Boolean)), mode).toEqual(new Set(['jobs_claim_idx', 'jobs_current_attempt_uq']));
    } finally {
      await c.query('RESET plan_cache_mode');
      c.release();
    }
  }
  expect((await depth('scan-1')).succeeded).toBe(6667);
});

it('what ended is kept per minute and kind: GetStats reads it, the keeper folds it and drops what is older than a day', async () => {
  await t.truncate();
  // At the database's own time: the minutes kept are the last day's.
  for (let i = 0; i < 3; i++) {
    must(await jobEnqueue(t.pool, { queue: 'minutes', payload: {} }));
    const [c] = must(await jobClaim(t.pool, { agentId: 'a', queues: ['minutes'], limit: 1, claimTtlMs: 60_000 }));
    if (i < 2) must(await attemptComplete(t.pool, { attemptId: c!.attemptId, agentId: 'a', result: {} }));
    else must(await attemptFail(t.pool, { attemptId: c!.attemptId, agentId: 'a', error: { message: 'later' }, retryable: true }));
  }
  const queued = must(await jobEnqueue(t.pool, { queue: 'minutes', payload: {}, runAt: new Date(Date.now() + 3_600_000) }));
  must(await jobCancel(t.pool, { jobId: queued.id }));
  const stats = must(await statsGet(t.pool, { windowMinutes: 5 }));
  expect(stats.window).toMatchObject({ succeeded: 2, retried: 1, canceled: 1, failed: 0, dead: 0 });
  expect(stats.minutes).toHaveLength(5);
  await checkInvariants(t.pool);

  // A minute at the day's edge stays, one a minute older goes; the rest fold to a row per minute and kind.
  const edge = `date_trunc('minute', now()) - interval '1439 minutes'`;
  await t.pool.query(`INSERT INTO ended_counts (minute, kind, n) VALUES (${edge}, 'completed', 7), (${edge} - interval '1 minute', 'completed', 9)`);
  const before = (await t.pool.query('SELECT count(*)::int AS n FROM ended_counts')).rows[0].n as number;
  expect(await jobCountsCompact(t.pool)).toBe(true);
  const { rows } = await t.pool.query(
    `SELECT minute = ${edge} AS edge, kind, n::int FROM ended_counts ORDER BY edge DESC, kind`,
  );
  expect(rows.filter((r) => r.edge)).toEqual([{ edge: true, kind: 'completed', n: 7 }]);
  const byKind: Record<string, number> = {};
  for (const r of rows.filter((x) => !x.edge)) byKind[r.kind] = (byKind[r.kind] ?? 0) + r.n;
  expect(byKind).toEqual({ completed: 2, retry_scheduled: 1, canceled: 1 });
  expect(rows.length).toBeLessThan(before);
  const groups = await t.pool.query('SELECT count(*)::int AS n FROM (SELECT DISTINCT minute, kind FROM ended_counts) g');
  expect(rows.length).toBe(groups.rows[0].n); // one row per minute and kind
  expect(must(await statsGet(t.pool, { windowMinutes: 1440 })).window.succeeded).toBe(9);

  // The edge minute counted 7 completions no attempt shows: a recount puts the attempts' figure back.
  expect(await endedCountsReconcile(t.pool)).toBe(1);
  expect(must(await statsGet(t.pool, { windowMinutes: 1440 })).window.succeeded).toBe(2);
  await checkInvariants(t.pool);

  // A database upgraded to 0016 keeps none yet: the start after the migrations counts the last day.
  await t.pool.query('DELETE FROM ended_counts');
  expect(await migrateDatabase(t.pool)).toBe(0);
  expect(must(await statsGet(t.pool, { windowMinutes: 5 })).window).toMatchObject({ succeeded: 2, retried: 1, canceled: 1 });
  await checkInvariants(t.pool);
});

it('GetStats reads its minutes without an attempt or an event', async () => {
  for (const mode of ['force_custom_plan', 'force_generic_plan']) {
    const c = await t.pool.connect();
    try {
      await c.query(`SET plan_cache_mode = ${mode}`);
      await c.query(`PREPARE m(int) AS ${statsMinutesSql.text}`);
      const { rows } = await c.query(`EXPLAIN (FORMAT JSON) EXECUTE m(15)`);
      const plan = planNodes((rows[0]['QUERY PLAN'] as Array<{ Plan: PlanNode }>)[0]!.Plan);
      const relations = new Set(plan.map((n) => n['Relation Name']).filter(Boolean));
      expect([...relations], mode).toEqual(['ended_counts']);
    } finally {
      await c.query('DEALLOCATE ALL');
      await c.query('RESET plan_cache_mode');
      c.release();
    }
  }
});

it('plans the gauges serial, on a connection whose planner would otherwise go parallel', async () => {
  // In a benchmark a connection kept a parallel plan of the counts read, made while a burst had
  // jobs_live past 8 MB: two workers launched on every call of the gauges, 5.6 ms for 0.2 of work.
  // Here the planner is told parallelism costs nothing, for the whole session, and auto_explain
  // hands back the plan each statement of the gauges ran with, as a notice. What is checked is the
  // plan executed, not one asked for afterwards: an ANALYZE (autovacuum's, in a loaded run)
  // invalidates a kept plan, and an EXPLAIN EXECUTE outside the gauges' transaction replans it
  // with the session's settings, not the gauges'.
  await t.pool.query(`INSERT INTO jobs (queue, payload) SELECT 'burst', jsonb_build_object('pad', repeat('x', 1000)) FROM generate_series(1, 5000)`);
  await t.pool.query('ANALYZE jobs_live');
  const c = new pg.Client(t.url);
  await c.connect();
  const ran: string[] = [];
  c.on('notice', (n) => {
    if (n.message?.includes('duration:')) ran.push(n.message);
  });
  try {
    for (const [k, v] of [['parallel_setup_cost', '0'], ['parallel_tuple_cost', '0'], ['min_parallel_table_scan_size', '0'], ['min_parallel_index_scan_size', '0']]) await c.query(`SET ${k} = ${v}`);
    // What the setting does to the same statement planned without the gauges' care.
    const free = JSON.stringify((await c.query(`EXPLAIN (FORMAT JSON) ${countsReadSql.text}`)).rows[0]['QUERY PLAN']);
    expect(free).toMatch(/"Node Type":"Gather/);
    await c.query(`LOAD 'auto_explain'`);
    for (const [k, v] of [['auto_explain.log_min_duration', '0'], ['auto_explain.log_format', 'json'], ['auto_explain.log_level', 'notice'], ['client_min_messages', 'notice']]) await c.query(`SET ${k} = ${v}`);
    // The first call plans both statements; the second runs the plans kept; the third replans
    // them after an ANALYZE of every table they read, as autovacuum would.
    for (const step of ['first', 'kept', 'replanned']) {
      if (step === 'replanned') await t.pool.query('ANALYZE job_counts, jobs_live');
      ran.length = 0;
      const { depths } = await jobDepths(c);
      const burst = depths.find((d) => d.queue === 'burst');
      expect([burst?.status, Number(burst?.count)], step).toEqual(['queued', 5000]);
      const plans = ran.filter((m) => m.includes('jobs_live'));
      expect(plans.length, step).toBe(2); // the counts read and the waits
      for (const plan of plans) expect(plan, step).not.toMatch(/"Node Type": ?"Gather|"Parallel Aware": ?true/);
    }
  } finally {
    await c.end();
  }
});
