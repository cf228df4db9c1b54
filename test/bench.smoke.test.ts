/**
 * The benchmark's smoke version, so the bench code cannot rot: every scenario and every system
 * at toy sizes (300 jobs, 2 s of steady load, 10 held jobs, 50 streams). The figures are
 * printed, not judged: on a shared 2-core machine in a test run they mean little; what must
 * hold is that each system drains its jobs and the report is produced.
 */
import { readdirSync } from 'node:fs';
import os from 'node:os';
import { expect, it } from 'vitest';
import { bench } from './bench/run.js';
import { results } from './bench/report.js';

/** The toy sizes of the runs below that take a few systems and scenarios. */
const TOY = { jobs: 300, reps: 1, rate: 100, seconds: 2, recoveryJobs: 10, historyJobs: 3000, leaseMs: 2000, streams: 50, warmupSeconds: 0 };

it('npm run bench --quick: every system, every scenario, a report', async () => {
  const lines: string[] = [];
  // The agents' outboxes (worker.ts) are the run's to remove: its workers die by SIGKILL.
  const outboxes = () => new Set(readdirSync(os.tmpdir()).filter((f) => f.startsWith('bench-outbox-') || f.startsWith('leasehold-bench-outboxes-')));
  const before = outboxes();
  const { rows, md } = await bench({
    jobs: 300,
    reps: 1,
    rate: 100,
    seconds: 2,
    concurrency: 32,
    // `--concurrency graphile-off=best`: a sweep, its contenders drained in the repetitions.
    sweepOf: { 'graphile-off': [2, 4] },
    recoveryJobs: 10,
    historyJobs: 3000,
    leaseMs: 2000,
    recoveryCapMs: 6000,
    streams: 50,
    warmupSeconds: 0,
    systems: ['leasehold', 'graphile-off', 'graphile-on', 'pgboss'],
    scenarios: ['throughput', 'writes', 'latency', 'recovery', 'heartbeats', 'history', 'pgbench'],
    log: (l) => lines.push(l),
  });
  console.log(md);
  const throughput = rows.filter((r) => r.scenario.startsWith('throughput'));
  expect(throughput.map((r) => r.system)).toEqual(['Leasehold', 'graphile-worker (batching off)', 'graphile-worker (batching on)', 'pg-boss']);
  for (const r of throughput) expect(r.figures[0]!.median, r.system).toBeGreaterThan(0);
  // The swept system reports the concurrency it ran at, the fastest of those tried, and each tried.
  const swept = throughput.find((r) => r.system === 'graphile-worker (batching off)')!;
  expect(swept.note).toMatch(/^concurrency (2|4) \(the fastest of one drain each: 2: [\d,]+, 4: [\d,]+ jobs\/s\)$/);
  expect(lines.filter((l) => /^throughput graphile-worker \(batching off\) at [24] rep 1:/.test(l))).toHaveLength(2);
  if (process.platform === 'linux') {
    // Every job costs PostgreSQL and the workers some CPU: a zero across all systems means the
    // /proc reading broke. One system alone may read 0: /proc counts in ticks of 10 ms, and 300
    // jobs of graphile-worker with batching cost its PostgreSQL ~6 ms on a fast day.
    for (const unit of ['CPU ms/job: workers', 'CPU ms/job: PostgreSQL']) {
      const sum = throughput.reduce((a, r) => a + (r.figures.find((x) => x.unit === unit)?.median ?? 0), 0);
      expect(sum, unit).toBeGreaterThan(0);
    }
  }
  // results.json: the figures scripts compare, by metric name, for every system.
  const json = results(rows, 'abc1234');
  const metric = (scenario: string, system: string, m: string) => json.find((r) => r.scenario === scenario && r.system === system && r.metric === m);
  for (const system of ['leasehold', 'graphile-off', 'graphile-on', 'pg-boss']) {
    expect(metric('throughput', system, 'jobs_per_s')?.median, system).toBeGreaterThan(0);
    expect(metric('latency', system, 'p50_ms'), system).toBeDefined();
    // Every job is at least inserted and then changed or removed, and that is logged.
    expect(metric('writes', system, 'rows_per_job')?.median, system).toBeGreaterThanOrEqual(2);
    expect(metric('writes', system, 'wal_bytes_per_job')?.median, system).toBeGreaterThan(100);
  }
  // history: the worst read's ratio and the hot path's, then one row per read, each timed.
  expect(metric('history', 'leasehold', 'read_ms_ratio')?.median).toBeGreaterThan(0);
  expect(metric('history', 'leasehold', 'read_ms_ratio_after_purge')?.median).toBeGreaterThan(0);
  expect(metric('history', 'leasehold', 'jobs_per_s_ratio')?.median).toBeGreaterThan(0);
  expect(metric('history', 'leasehold', 'wal_bytes_per_job_ratio')?.median).toBeGreaterThan(0);
  // The oldest day's purge, timed, and the throughput while it ran.
  expect(metric('history', 'leasehold', 'purge_ms')?.median).toBeGreaterThan(0);
  expect(metric('history', 'leasehold', 'purge_jobs_per_s_ratio')?.median).toBeGreaterThan(0);
  // A backlog ten times as deep against the usual, the agents' CPU per job included.
  expect(metric('history', 'leasehold', 'deep_jobs_per_s_ratio')?.median).toBeGreaterThan(0);
  expect(metric('history', 'leasehold', 'deep_agent_cpu_ratio')?.median).toBeGreaterThan(0);
  // A whole day, whatever the hour: the seeded history's first (partial) day and the day after it.
  const historyRow = rows.find((r) => r.scenarioKey === 'history' && r.system === 'Leasehold')!;
  expect(historyRow.note).toMatch(/purge of the oldest whole day \(\d{4}-\d\d-\d\d, \d{4}-\d\d-\d\d\): [1-9][\d,]* jobs/);
  const reads = json.filter((r) => r.scenario === 'history' && r.read && r.metric === 'read_ms');
  expect(reads.map((r) => r.read)).toEqual(expect.arrayContaining(['GetStats', '/metrics gauges', 'ListJobs by queue', 'ListJobs by agent', 'GetJob']));
  for (const r of reads) expect(r.median, r.read).toBeGreaterThan(0);
  // Every list compared a full page with a full page.
  const pages = rows.filter((r) => r.scenarioKey === 'history' && (r.read?.startsWith('ListJobs') || r.read?.startsWith('JobService')));
  expect(pages.map((r) => r.note)).toEqual(Array(5).fill('jobs on the page: 50 empty, 50 full'));
  expect(metric('ceiling', 'postgresql', 'tps') ?? metric('heartbeats', 'leasehold', 'commits_per_s')).toBeDefined();
  // The heartbeats renew leases: each renewal is an update of a held job's row (it read 0 when the
  // benchmark counted the updates of the partitioned jobs, which has no rows of its own).
  const beats = rows.find((r) => r.scenarioKey === 'heartbeats')!;
  expect(beats.figures.find((f) => f.unit === 'leases renewed/s')?.median).toBeGreaterThan(0);
  const recovery = rows.find((r) => r.scenario.startsWith('recovery') && r.system === 'Leasehold')!;
  expect(recovery.figures.length, 'Leasehold recovered the SIGKILLed worker\'s jobs').toBeGreaterThan(0);
  expect(md).toMatch(/# Benchmark results/);
  expect([...outboxes()].filter((f) => !before.has(f)), 'outbox directories left behind').toEqual([]);
}, 600_000);

it('npm run bench -- --systems floor --scenarios latency: the contract\'s floor runs every job through its steps', async () => {
  const lines: string[] = [];
  const { rows } = await bench({
    ...TOY,
    // Two slots for 100 jobs a second, each held until its completion's ack (20 ms of linger
    // included): enqueues find every slot taken and wait for one, as under a busy machine.
    concurrency: 2,
    systems: ['floor'],
    scenarios: ['latency'],
    log: (l) => lines.push(l),
  });
  // Every job's handler started (the repetition throws otherwise) and every completion committed.
  const [row] = rows;
  expect(row).toMatchObject({ scenarioKey: 'latency', systemKey: 'floor', system: "the contract's floor (bare Node and SQL)" });
  expect(row!.figures.find((f) => f.metric === 'p50_ms')?.median).toBeGreaterThan(0);
  if (process.platform === 'linux') expect(row!.figures.find((f) => f.metric === 'cpu_ms_per_job')?.median).toBeGreaterThan(0);
  expect(lines.some((l) => /^latency the contract's floor .* rep 1: p50 /.test(l))).toBe(true);
}, 120_000);

it('npm run bench with the floor among the systems: the floor takes part in the latency scenario only, the others in every one', async () => {
  const { rows } = await bench({
    ...TOY,
    concurrency: 32,
    systems: ['leasehold', 'floor'],
    scenarios: ['throughput', 'writes', 'latency', 'recovery'],
    log: () => undefined,
  });
  const who = (scenario: string) => rows.filter((r) => r.scenarioKey === scenario).map((r) => r.systemKey);
  expect(who('throughput')).toEqual(['leasehold']);
  expect(who('writes')).toEqual(['leasehold']);
  expect(who('recovery')).toEqual(['leasehold']);
  expect(who('latency')).toEqual(['leasehold', 'floor']);
}, 300_000);

it('npm run bench -- --rep-warmup: each latency repetition\'s fresh worker runs that much of the load, discarded, before it is measured', async () => {
  const run = async (repWarmupSeconds: number) => {
    const lines: string[] = [];
    const { rows } = await bench({
      ...TOY,
      rate: 50,
      seconds: 1,
      concurrency: 8,
      warmupSeconds: 1,
      repWarmupSeconds,
      systems: ['floor'],
      scenarios: ['latency'],
      log: (l) => lines.push(l),
    });
    return { lines, rows };
  };
  // 50 jobs a second: one second of warm-up is 50 jobs; none without it. The measured jobs are
  // the repetition's own second either way (the repetition throws unless every one started).
  const warmed = await run(1);
  expect(warmed.lines.filter((l) => /^latency the contract's floor .* rep 1: /.test(l))).toEqual([expect.stringMatching(/its worker warmed by 50 discarded jobs$/)]);
  expect(warmed.rows[0]!.figures.find((f) => f.metric === 'p50_ms')?.median).toBeGreaterThan(0);
  const cold = await run(0);
  expect(cold.lines.filter((l) => /^latency the contract's floor .* rep 1: /.test(l))).toEqual([expect.stringMatching(/its worker warmed by 0 discarded jobs$/)]);
}, 180_000);
