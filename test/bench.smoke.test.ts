/**
 * The benchmark's smoke version, so the bench code cannot rot: every scenario and every system
 * at toy sizes (300 jobs, 2 s of steady load, 10 held jobs, 50 streams). The figures are
 * printed, not judged: on a shared 2-core machine in a test run they mean little; what must
 * hold is that each system drains its jobs and the report is produced.
 */
import { expect, it } from 'vitest';
import { bench } from './bench/run.js';

it('npm run bench --quick: every system, every scenario, a report', async () => {
  const lines: string[] = [];
  const { rows, md } = await bench({
    jobs: 300,
    reps: 1,
    rate: 100,
    seconds: 2,
    concurrency: 32,
    recoveryJobs: 10,
    leaseMs: 2000,
    recoveryCapMs: 6000,
    streams: 50,
    warmupSeconds: 0,
    systems: ['leasehold', 'graphile-off', 'graphile-on', 'pgboss'],
    scenarios: ['throughput', 'latency', 'recovery', 'heartbeats', 'pgbench'],
    log: (l) => lines.push(l),
  });
  console.log(md);
  const throughput = rows.filter((r) => r.scenario.startsWith('throughput'));
  expect(throughput.map((r) => r.system)).toEqual(['Leasehold', 'graphile-worker (batching off)', 'graphile-worker (batching on)', 'pg-boss']);
  for (const r of throughput) expect(r.figures[0]!.median, r.system).toBeGreaterThan(0);
  if (process.platform === 'linux') {
    // Every job costs PostgreSQL and the workers some CPU: a zero means the /proc reading broke.
    for (const r of throughput) {
      for (const unit of ['CPU ms/job: workers', 'CPU ms/job: PostgreSQL']) {
        expect(r.figures.find((x) => x.unit === unit)?.median, `${r.system}: ${unit}`).toBeGreaterThan(0);
      }
    }
  }
  const recovery = rows.find((r) => r.scenario.startsWith('recovery') && r.system === 'Leasehold')!;
  expect(recovery.figures.length, 'Leasehold recovered the SIGKILLed worker\'s jobs').toBeGreaterThan(0);
  expect(md).toMatch(/# Benchmark results/);
}, 600_000);
