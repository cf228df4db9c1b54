/**
 * A worker process for the benchmarks: Leasehold agents (the SDK over real streams),
 * graphile-worker, pg-boss or the floor's agent (floor-agent.ts), each with its own workers and a
 * no-op (or holding) handler.
 * Started with `fork()`; reports over IPC: `ready`, and in `latency`/`hold` mode the time each
 * job's handler began (`clockMs()`), in `started` messages sent every `STARTS_FLUSH_MS`.
 */
import os from 'node:os';
import path from 'node:path';
import { mkdtempSync } from 'node:fs';
import pino from 'pino';
import { clockMs } from './clock.js';

export interface WorkerConfig {
  system: 'leasehold' | 'graphile-off' | 'graphile-on' | 'pgboss' | 'floor';
  mode: 'drain' | 'latency' | 'hold';
  /** Concurrency: total handler slots. */
  concurrency: number;
  /** leasehold: gRPC URL and agent tokens (one agent per token); peers: database URL. */
  url: string;
  tokens?: string[];
  queue: string;
}

const cfg = JSON.parse(process.argv[2]!) as WorkerConfig;
const send = (m: unknown) => process.send?.(m);

/**
 * The handlers' start times are sent in batches: a message per job made the measurement itself a
 * cost of every system measured (an IPC write here, a wake-up and a JSON parse in the benchmark
 * process: ~4 % of Leasehold's agent CPU one at a time in a profile). The time is read when the
 * handler starts, so when it is sent changes no latency; the benchmark waits for every start.
 */
const STARTS_FLUSH_MS = 20;
let starts: Array<[unknown, number]> = [];
setInterval(() => {
  if (starts.length === 0) return;
  send({ type: 'started', starts });
  starts = [];
}, STARTS_FLUSH_MS).unref();

const onJob = (payload: Record<string, unknown> | undefined) => {
  if (cfg.mode !== 'drain') starts.push([payload?.id, clockMs()]);
  if (cfg.mode === 'hold') return new Promise<never>(() => undefined); // until the process is killed
  return undefined;
};

async function leasehold() {
  const { createAgent } = await import('@leasehold/agent-client');
  const tokens = cfg.tokens!;
  const per = Math.ceil(cfg.concurrency / tokens.length);
  for (const token of tokens) {
    const agent = createAgent({
      url: cfg.url,
      token,
      slots: per,
      outboxDir: mkdtempSync(path.join(process.env.BENCH_OUTBOX_DIR ?? os.tmpdir(), 'bench-outbox-')),
      handleSignals: false,
      log: pino({ level: 'warn' }),
    });
    agent.handle(cfg.queue, async (job) => {
      await onJob(job.payload);
      return {};
    });
    await agent.start();
  }
}

async function graphile(batching: boolean) {
  const { run } = await import('graphile-worker');
  await run({
    connectionString: cfg.url,
    concurrency: cfg.concurrency,
    noHandleSignals: true,
    pollInterval: 2000,
    logger: new (await import('graphile-worker')).Logger(() => () => undefined),
    taskList: {
      [cfg.queue]: async (payload) => {
        await onJob(payload as Record<string, unknown>);
      },
    },
    // BENCH_GRAPHILE_COMPLETE_DELAY (ms): its completions' batch delay for a side run, to set
    // beside Leasehold's completion linger (docs/performance.md); 0, within one turn, otherwise.
    preset: batching ? { worker: { localQueue: { size: 500 }, completeJobBatchDelay: Number(process.env.BENCH_GRAPHILE_COMPLETE_DELAY ?? 0), failJobBatchDelay: 0 } } : {},
  });
}

async function pgboss() {
  const { default: PgBoss } = await import('pg-boss');
  // Supervision (which expires jobs of dead workers) runs every second, as fast as pg-boss allows.
  const boss = new PgBoss({ connectionString: cfg.url, schema: 'pgboss', max: Math.max(4, Math.ceil(cfg.concurrency / 8)), supervise: true, maintenanceIntervalSeconds: 1, schedule: false });
  boss.on('error', () => undefined);
  await boss.start();
  // pg-boss 10 polls each worker no faster than every 0.5 s; several workers make the concurrency.
  const workers = Math.max(1, Math.ceil(cfg.concurrency / 50));
  for (let i = 0; i < workers; i++) {
    await boss.work(cfg.queue, { batchSize: Math.min(50, cfg.concurrency), pollingIntervalSeconds: 0.5 }, async (jobs) => {
      await Promise.all(jobs.map((j) => onJob(j.data as Record<string, unknown>)));
    });
  }
}

async function floor() {
  const { floorAgent } = await import('./floor-agent.js');
  await floorAgent(cfg.url, cfg.tokens!.length, cfg.concurrency, mkdtempSync(path.join(process.env.BENCH_OUTBOX_DIR ?? os.tmpdir(), 'bench-outbox-')), onJob);
}

const start = { leasehold, 'graphile-off': () => graphile(false), 'graphile-on': () => graphile(true), pgboss, floor }[cfg.system];
start().then(
  () => send({ type: 'ready' }),
  (err: unknown) => {
    send({ type: 'error', message: String((err as Error)?.stack ?? err) });
    process.exit(1);
  },
);

// A clean exit on SIGINT (so `--cpu-prof` can write its profile); the benchmark itself kills with SIGKILL.
process.on('SIGINT', () => process.exit(0));
// The benchmark gone (it crashed or was killed): nothing is left to measure for, so no orphan
// keeps running (and using the CPU the next run measures).
process.on('disconnect', () => process.exit(0));
