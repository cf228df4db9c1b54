/**
 * What NOTIFY inside the enqueue's transaction costs when enqueues come together: `--calls`
 * enqueues of due jobs (no agent waiting, so each wakes the dispatchers), `--concurrency` at a
 * time on a pool of as many connections, against an embedded PostgreSQL 17 (fsync on), in two
 * modes alternating per repetition:
 * - `in-transaction`: `jobEnqueue` with its own NOTIFY (PostgreSQL holds its NOTIFY lock through
 *   each such commit's WAL flush, so these commits go one at a time);
 * - `after-commit`: `jobEnqueue({notify: false})` and a `QueueWaker` sending the NOTIFYs after the
 *   commits, batched (what the gateway does).
 * Reports enqueues per second and the latency of one enqueue call (p50, p99), medians over
 * repetitions, and checks that a LISTENer heard the queue in both modes.
 *
 *   node --import tsx test/bench/enqueue-notify.ts [--calls 4000] [--concurrency 32] [--reps 3]
 */
import { mkdtemp } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Command } from 'commander';
import pg from 'pg';
import pino from 'pino';
import { QueueWaker } from '../../server/core/queue-waker.js';
import { startEmbedded } from '../../server/store/embedded.js';
import { createPool, jobEnqueue, JOBS_CHANNEL, migrateDatabase } from '../../server/store/index.js';

const o = new Command()
  .option('--calls <n>', 'enqueues per repetition', (v) => Number(v), 4000)
  .option('--concurrency <n>', 'enqueues in flight (and pool size)', (v) => Number(v), 32)
  .option('--reps <n>', 'repetitions per mode', (v) => Number(v), 3)
  .parse()
  .opts<{ calls: number; concurrency: number; reps: number }>();

const log = pino({ level: 'warn' });
const embedded = await startEmbedded({ dataDir: await mkdtemp(path.join(os.tmpdir(), 'leasehold-notifybench-')), log, ephemeral: true });
const pool = createPool(embedded.url, o.concurrency, log);
const hot = createPool(embedded.url, 2, log, { hot: true });
await migrateDatabase(pool);
const listener = new pg.Client({ connectionString: embedded.url });
await listener.connect();
let heard = 0;
listener.on('notification', () => heard++);
await listener.query(`LISTEN ${JOBS_CHANNEL}`);

type Mode = 'in-transaction' | 'after-commit';
const pct = (xs: number[], p: number) => [...xs].sort((a, b) => a - b)[Math.min(xs.length - 1, Math.floor((p / 100) * xs.length))]!;
const median = (xs: number[]) => pct(xs, 50);

async function rep(mode: Mode) {
  await pool.query('TRUNCATE jobs, job_keys, attempts');
  await pool.query('CHECKPOINT');
  heard = 0;
  const waker = new QueueWaker(hot, log, () => undefined);
  const latencies: number[] = [];
  let next = 0;
  const started = performance.now();
  await Promise.all(
    Array.from({ length: o.concurrency }, async () => {
      while (next < o.calls) {
        const i = next++;
        const t = performance.now();
        const r = await jobEnqueue(pool, { queue: 'bench', payload: { i }, notify: mode === 'in-transaction' });
        if (r.outcome !== 'ok') throw new Error(JSON.stringify(r));
        if (mode === 'after-commit') waker.wake('bench');
        latencies.push(performance.now() - t);
      }
    }),
  );
  const seconds = (performance.now() - started) / 1000;
  await waker.stop();
  await listener.query('SELECT 1'); // notifications sent before this are delivered before its answer
  if (heard === 0) throw new Error(`${mode}: the listener heard nothing`);
  return { perSecond: o.calls / seconds, p50: pct(latencies, 50), p99: pct(latencies, 99), heard };
}

const results: Record<Mode, Array<Awaited<ReturnType<typeof rep>>>> = { 'in-transaction': [], 'after-commit': [] };
await rep('after-commit'); // warm-up, discarded
for (let r = 0; r < o.reps; r++) {
  for (const mode of ['in-transaction', 'after-commit'] as const) {
    const x = await rep(mode);
    results[mode].push(x);
    console.error(`${mode} rep ${r + 1}: ${x.perSecond.toFixed(0)} enqueues/s, p50 ${x.p50.toFixed(1)} ms, p99 ${x.p99.toFixed(1)} ms, ${x.heard} notifications heard`);
  }
}
console.log(`| NOTIFY | enqueues/s | p50 ms | p99 ms | notifications heard |\n|---|---:|---:|---:|---:|`);
for (const mode of ['in-transaction', 'after-commit'] as const) {
  const xs = results[mode];
  const f = (k: 'perSecond' | 'p50' | 'p99', d: number) => `${median(xs.map((x) => x[k])).toFixed(d)} [${Math.min(...xs.map((x) => x[k])).toFixed(d)} – ${Math.max(...xs.map((x) => x[k])).toFixed(d)}]`;
  console.log(`| ${mode} | ${f('perSecond', 0)} | ${f('p50', 1)} | ${f('p99', 1)} | ${median(xs.map((x) => x.heard))} |`);
}
await listener.end();
await hot.end();
await pool.end();
await embedded.stop();
