/**
 * `npm run bench`: Leasehold, graphile-worker (batching off and on) and pg-boss on one
 * PostgreSQL, on this machine, in one run. Scenarios: throughput (N no-op jobs enqueued and
 * drained end to end), dispatch latency at a steady rate, recovery after SIGKILLing a worker,
 * heartbeat scale (Leasehold), and the database's own ceiling (pgbench). Each figure is the median
 * of the repetitions with min and max. Writes test/bench/results.md and test/bench/latency.svg.
 *
 * `--quick` is the smoke version (`npm test` runs it through test/bench.smoke.test.ts).
 */
import { execFile, fork, type ChildProcess } from 'node:child_process';
import { mkdir, mkdtemp, readdir, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { Command } from 'commander';
import pg from 'pg';
import pino from 'pino';
import { startEmbedded } from '../../server/store/embedded.js';
import { createPool } from '../../server/store/index.js';
import { clockMs } from './clock.js';
import { postgresCpu, postmasterPid, processCpu } from './cpu.js';
import { profileSelf, summarize } from './profile.js';
import { floor } from './floor.js';
import { graphile, leasehold, pgboss, type System, type SystemName } from './systems.js';
import { historyReads, HISTORY_EMPTY_JOBS, purgeOldestDay, seedFinished, type ReadTimes } from './history.js';
import { latencySvg, markdown, results, type Figure, type MetricKey, type Row } from './report.js';
import type { WorkerConfig } from './worker.js';

const run = promisify(execFile);
const here = path.dirname(new URL(import.meta.url).pathname);
const root = path.resolve(here, '../..');

export interface BenchOptions {
  jobs: number;
  reps: number;
  rate: number;
  seconds: number;
  /** Jobs a system runs at once (agent slots, worker concurrency), unless `concurrencyOf` names it. */
  concurrency: number;
  /** Per system, where its best concurrency differs (graphile-worker without batching slows down as it grows). */
  concurrencyOf?: Partial<Record<SystemName, number>>;
  /**
   * Systems whose concurrency is the best of these, found in this run (`system=best`): each is a
   * contender in the throughput repetitions (or, without that scenario, drained once after the
   * warm-up); the fastest median is reported and used for every other scenario.
   */
  sweepOf?: Partial<Record<SystemName, number[]>>;
  recoveryJobs: number;
  /** The `history` scenario: finished jobs seeded (seed:history) before the reads are timed again. */
  historyJobs: number;
  leaseMs: number;
  streams: number;
  warmupSeconds: number;
  /**
   * Seconds of the latency load each latency repetition's fresh worker process runs, discarded,
   * before it is measured (0 with no warm-up): long enough for V8 to have optimized its hot code
   * (docs/performance.md, "How the benchmark runs").
   */
  repWarmupSeconds?: number;
  /** Give up waiting for a recovery after this long (default: 4 leases, at least 20 s). */
  recoveryCapMs?: number;
  systems: SystemName[];
  scenarios: string[];
  /** Write CPU profiles of the measured scenarios here and print a summary of each. */
  profileDir?: string;
  /** Load pg_stat_statements and print the statements that cost the most in the measured scenarios. */
  pgStatements?: boolean;
  out?: string;
  /** `results.json`: every figure scripts compare, as `{scenario, system, metric, median, min, max, commit}`. */
  json?: string;
  svg?: string;
  log: (line: string) => void;
}

interface Worker {
  child: ChildProcess;
  started: Map<unknown, number>;
  onStarted?: () => void;
  /** Set when the process ended without stopWorker: every wait (`until`) then fails with it. */
  died?: Error;
}

/** The workers forked and not stopped: a wait fails as soon as one of them dies. */
const live = new Set<Worker>();

/** How long a worker process may take to say it is ready (compiled code, a few connections). */
const READY_MS = 120_000;

/** Where worker profiles go while profiling (`--profile`), after the warm-up. */
let profiling: { dir: string; n: number } | undefined;

/**
 * The directory the run's agents keep their outboxes in, one beneath it per agent (worker.ts),
 * removed when the run ends. Workers are stopped with SIGKILL and cannot clean up after
 * themselves: each left its outbox in the system's temporary directory, 13,664 of them (15 GB)
 * on this machine before this.
 */
let outboxRoot: string | undefined;

/**
 * worker.ts and the agent SDK compiled to one plain JavaScript file, its dependencies loaded from
 * node_modules as usual: workers run what users run. The SDK ships compiled (its package's dist/,
 * or the `build:agent` bundle), and the peers run their own compiled code; through the tsx loader
 * every closure the SDK makes per job would also be named at run time (esbuild's keepNames, which
 * tsx turns on), a cost only this repository's tests pay.
 */
let workerFile: Promise<string> | undefined;
function compiledWorker(): Promise<string> {
  workerFile ??= (async () => {
    const { build } = await import('esbuild');
    const outfile = path.join(root, 'node_modules', '.cache', 'leasehold-bench', 'worker.mjs');
    await build({
      entryPoints: [path.join(here, 'worker.ts')],
      bundle: true,
      platform: 'node',
      format: 'esm',
      target: 'node20',
      outfile,
      sourcemap: 'inline',
      alias: { '@leasehold/agent-client': path.join(root, 'agent-client/src/index.ts') },
      plugins: [
        {
          // Packages stay packages (resolved from node_modules at run time); only this repository's files are compiled in.
          name: 'packages-external',
          setup(b) {
            b.onResolve({ filter: /^[^./]/ }, (a) => (a.path.startsWith('@leasehold/') ? undefined : { path: a.path, external: true }));
          },
        },
      ],
      logLevel: 'warning',
    });
    return outfile;
  })();
  return workerFile;
}

async function forkWorker(cfg: WorkerConfig): Promise<Worker> {
  // One directory per worker: every thread writes a profile.
  const prof = profiling ? ['--cpu-prof', `--cpu-prof-dir=${path.join(profiling.dir, `worker-${cfg.system}-${cfg.mode}-${++profiling.n}`)}`] : [];
  const child = fork(await compiledWorker(), [JSON.stringify(cfg)], {
    cwd: root,
    execArgv: ['--enable-source-maps', ...prof],
    env: outboxRoot ? { ...process.env, BENCH_OUTBOX_DIR: outboxRoot } : process.env,
    stdio: ['ignore', 'ignore', 'inherit', 'ipc'],
  });
  const w: Worker = { child, started: new Map() };
  live.add(w);
  let ready = false;
  return new Promise<Worker>((resolve, reject) => {
    // Before 'ready' the fork fails; after it, the waits of the scenario fail with the error
    // (`until`), unless stopWorker has taken the worker out of `live` (the exit is then ours).
    const fail = (err: Error) => {
      clearTimeout(timer);
      child.kill('SIGKILL');
      if (ready) {
        w.died ??= err;
        return;
      }
      live.delete(w);
      reject(err);
    };
    const timer = setTimeout(() => fail(new Error(`${cfg.system} worker not ready within ${READY_MS / 1000} s`)), READY_MS);
    child.on('message', (m: { type: string; starts?: Array<[unknown, number]>; message?: string }) => {
      if (m.type === 'ready') {
        clearTimeout(timer);
        ready = true;
        resolve(w);
      } else if (m.type === 'started') {
        for (const [id, t] of m.starts!) w.started.set(id, t);
        w.onStarted?.();
      } else if (m.type === 'error') fail(new Error(`${cfg.system} worker failed: ${m.message}`));
    });
    child.on('error', fail);
    child.on('exit', (code, signal) => fail(new Error(`${cfg.system} worker exited (${code ?? signal})${ready ? '' : ' before it was ready'}`)));
  });
}

async function stopWorker(w: Worker, signal: NodeJS.Signals = 'SIGKILL') {
  live.delete(w);
  if (w.child.exitCode !== null || w.child.signalCode !== null) return;
  // A profiled worker writes its profile when it exits on SIGINT (worker.ts).
  if (profiling && signal === 'SIGKILL' && w.child.spawnargs.some((a) => a === '--cpu-prof')) signal = 'SIGINT';
  const gone = new Promise((r) => w.child.once('exit', r));
  w.child.kill(signal);
  await gone;
}

async function until(what: string, check: () => Promise<boolean>, ms: number, every = 25): Promise<number | undefined> {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    for (const w of live) if (w.died) throw w.died;
    if (await check()) return Date.now();
    await new Promise((r) => setTimeout(r, every));
  }
  void what;
  return undefined;
}

/** What the database counted for one database: commits, and rows inserted + updated + deleted. */
interface DbCounters {
  commits: number;
  rows: number;
}

async function dbCounters(s: System): Promise<DbCounters> {
  const read = async (): Promise<DbCounters> => {
    const r = (
      await s.pool.query(
        `SELECT xact_commit::bigint AS commits, (tup_inserted + tup_updated + tup_deleted)::bigint AS rows
         FROM pg_stat_database WHERE datname = $1`,
        [s.database],
      )
    ).rows[0] as { commits: string; rows: string };
    return { commits: Number(r.commits), rows: Number(r.rows) };
  };
  // A backend flushes its statistics at the end of a transaction at most once a second; what it
  // counted since is flushed when it next ends one, or 10 s into being idle. This process's idle
  // connections are told to flush now (the quick smoke run once read 1.23 rows per job before
  // that); the rest (other processes' backends, busy ones) within a second or two: read until
  // two reads a flush interval apart agree on the rows. Not on the commits: a system's
  // background work commits all the time (Leasehold's reaper, deliverer and vacuumer, some 20
  // empty transactions a second), so they never agreed for it, and each of its repetitions sat
  // 2 × 11 s here, idle, between its warm drain and the measured one (the warm-up itself mostly
  // that). Rows come with the same flushes.
  await flushStats(s.pools);
  let a = await read();
  for (let i = 0; i < 10; i++) {
    await new Promise((r) => setTimeout(r, 1100));
    const b = await read();
    if (b.rows === a.rows) return b;
    a = b;
  }
  return a;
}

/** Makes the idle connections of `pools` flush their pending statistics (PostgreSQL 15+). */
async function flushStats(pools: pg.Pool[]): Promise<void> {
  for (const p of pools) {
    const clients = await Promise.all(Array.from({ length: p.idleCount }, () => p.connect()));
    try {
      for (const c of clients) await c.query('SELECT pg_stat_force_next_flush()');
    } finally {
      for (const c of clients) c.release();
    }
  }
}

/** The server's WAL insert position, in bytes. */
async function walBytes(pool: pg.Pool): Promise<bigint> {
  const r = await pool.query(`SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::text AS b`);
  return BigInt((r.rows[0] as { b: string }).b.split('.')[0]!);
}

async function settle(pool: pg.Pool) {
  await pool.query('VACUUM ANALYZE');
  await pool.query('CHECKPOINT');
}

const median = (xs: number[]) => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2]! : (s[s.length / 2 - 1]! + s[s.length / 2]!) / 2;
};
const pct = (xs: number[], p: number) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))]!;
};
const fig = (values: number[], digits = 0): Omit<Figure, 'unit'> => ({ median: median(values), min: Math.min(...values), max: Math.max(...values), digits, n: values.length });

/** Two contenders in round `r`'s order: `a` first in even rounds, `b` first in odd ones. */
const inTurn = <T>(r: number, a: T, b: T): [T, T] => (r % 2 ? [b, a] : [a, b]);

/** Jobs each throughput worker drains, discarded, before the measured drain. */
const WARM_JOBS = 2000;

/** Seconds of discarded latency load per system after the warm-up (at most `--warmup`). */
const LATENCY_WARM_SECONDS = 20;
/** Each latency repetition's worker warm-up (`--rep-warmup`). */
const DEFAULT_REP_WARMUP_SECONDS = 10;

const concurrencyOf = (s: System, o: BenchOptions) => o.concurrencyOf?.[s.name] ?? o.concurrency;

/** The concurrencies `system=best` tries (graphile-worker without batching: 4 was its best here, 16 its slowest of these). */
const SWEEP = [2, 4, 8, 16];

/** CPU seconds so far of this process, a worker process and the PostgreSQL server. */
function cpuNow(worker: Worker, pm: number | undefined) {
  return { main: process.cpuUsage(), worker: processCpu(worker.child.pid!), db: pm && postgresCpu(pm) };
}

/** CPU ms per job since `c0`, per process and in all (undefined parts where /proc is missing). */
function cpuPerJob(c0: ReturnType<typeof cpuNow>, worker: Worker, pm: number | undefined, n: number) {
  const main = process.cpuUsage(c0.main);
  const w = processCpu(worker.child.pid!);
  const db = pm && postgresCpu(pm);
  const perJob = (a: number | undefined, b: number | undefined) => (a === undefined || b === undefined ? undefined : ((b - a) * 1000) / n);
  const parts = { main: (main.user + main.system) / 1000 / n, worker: perJob(c0.worker, w), db: perJob(c0.db || undefined, db || undefined) };
  return { ...parts, total: parts.worker === undefined || parts.db === undefined ? undefined : parts.main + parts.worker + parts.db };
}

/**
 * A gate the purge's sweep waits at before each batch (`PurgerConfig.sweepHold`): closed, the
 * sweep stops at its next batch and does no work until it opens. Records when the sweep first and
 * last came to it, and how long it waited.
 */
class SweepGate {
  private closed: { promise: Promise<void>; open: () => void } | undefined;
  /** When the sweep first and last reached the gate (performance.now()); undefined until it does. */
  first: number | undefined;
  last: number | undefined;
  /** Milliseconds the sweep waited at the closed gate. */
  heldMs = 0;
  readonly hold = async (): Promise<void> => {
    const t = performance.now();
    this.first ??= t;
    this.last = t;
    if (!this.closed) return;
    await this.closed.promise;
    this.heldMs += performance.now() - t;
  };
  close(): void {
    if (this.closed) return;
    let open!: () => void;
    const promise = new Promise<void>((r) => (open = r));
    this.closed = { promise, open };
  }
  open(): void {
    this.closed?.open();
    this.closed = undefined;
  }
}

/**
 * The hot path's rate while `purge` runs against its rate without, in the same minutes: drains
 * of `n` jobs one after another while the purge runs, every other one with the sweep held at its
 * gate. The sweep works a tenth of its time for minutes, and this machine's speed drifts by more
 * than the 10 % measured over that long: compared with three drains before the purge and three
 * after it, the same code read 0.88, 0.96, 1.08, 1.21 and 1.24 × in five runs. "During" are the
 * drains that ran with the purge free to work (the detach, the sweep, its VACUUM); "held" those
 * that ran, whole, while the sweep waited at its gate and went on after. Three drains before the
 * purge warm the worker and three after it are reported; they stand in for "held" only when the
 * purge was too short for any (the smoke run). If the purge ended inside the first drain, that
 * one is "during", marked `overlapped`.
 */
async function drainsAcrossPurge<P>(
  s: System,
  o: BenchOptions,
  n: number,
  purge: (sweepHold: () => Promise<void>) => Promise<P>,
): Promise<{ during: number[]; held: number[]; around: number[]; overlapped: boolean; heldMs: number; purged: P }> {
  await s.reset();
  const w = await forkWorker(await s.worker('drain', concurrencyOf(s, o)));
  try {
    await s.bulkEnqueue(WARM_JOBS);
    if (!(await until('warm drain', () => s.drained(), 60_000, 25))) throw new Error(`${s.label}: warm-up jobs not drained within 60 s`);
    const drain = async () => {
      const t0 = performance.now();
      await s.bulkEnqueue(n);
      if (!(await until('drained', () => s.drained(), 300_000, 25))) throw new Error(`${s.label}: ${n} jobs not drained within 300 s`);
      const t1 = performance.now();
      return { rate: (n / (t1 - t0)) * 1000, t0, t1 };
    };
    const around = [(await drain()).rate, (await drain()).rate, (await drain()).rate];
    const gate = new SweepGate();
    let ended = false;
    const purging = purge(gate.hold).finally(() => {
      ended = true;
      gate.open();
    });
    purging.catch(() => undefined); // awaited below
    const ran: Array<{ rate: number; t0: number; t1: number; gated: boolean }> = [];
    let overlapped = false;
    for (let i = 0; !ended; i++) {
      // Held only once the sweep has come to its gate: before, the purge is detaching the day.
      const gated = i % 2 === 1 && gate.first !== undefined;
      if (gated) gate.close();
      let d: Awaited<ReturnType<typeof drain>>;
      try {
        d = await drain();
      } finally {
        // A drain that failed must not leave the sweep held at its gate with a connection of
        // the pool the cleanup ends: that end() would wait for it for ever.
        gate.open();
      }
      if (!ended) ran.push({ ...d, gated });
      else if (!ran.length) {
        ran.push({ ...d, gated });
        overlapped = true;
      }
    }
    const purged = await purging;
    // A gated drain (the sweep had reached its gate before it began) counts as held if the sweep
    // came back to the gate after it ended: it was between batches throughout, not in its VACUUM.
    const held = ran.filter((d) => d.gated && gate.last! > d.t1);
    const during = ran.filter((d) => !held.includes(d));
    around.push((await drain()).rate, (await drain()).rate, (await drain()).rate);
    return {
      during: during.map((d) => d.rate),
      held: held.map((d) => d.rate),
      around,
      overlapped,
      heldMs: gate.heldMs,
      purged,
    };
  } finally {
    await stopWorker(w);
  }
}

/**
 * One throughput repetition: workers ready on an empty queue, then N jobs enqueued and drained.
 * Also what the drain wrote: rows inserted + updated + deleted in the system's database
 * (`pg_stat_database`) and WAL bytes (the server's WAL position before the enqueue and when the
 * last job is done), per job.
 */
async function throughputRep(s: System, o: BenchOptions, n: number, warm = Math.min(WARM_JOBS, n)) {
  await s.reset();
  const w = await forkWorker(await s.worker('drain', concurrencyOf(s, o)));
  try {
    if (warm > 0) {
      // Workers run long: a fresh process runs its first jobs on cold code (for Leasehold's
      // agent the first ~300 ms of a drain went at half speed), so each worker drains a few
      // jobs, discarded, before the measured drain (every system alike).
      await s.bulkEnqueue(warm);
      if (!(await until('warm drain', () => s.drained(), 60_000, 25))) throw new Error(`${s.label}: ${warm} warm-up jobs not drained within 60 s`);
      await s.reset();
    }
    await settle(s.pool);
    const before = await dbCounters(s);
    const pm = await postmasterPid(s.pool);
    const wal0 = await walBytes(s.pool);
    const cpu0 = cpuNow(w, pm);
    const t0 = performance.now();
    await s.bulkEnqueue(n);
    // Polled every 25 ms, as the other drains are: the drain is over at the first poll that sees it
    // so, about half an interval late (at 100 ms that took 3.5 % off graphile-worker's 1.4 s
    // drains against 1.4 % off Leasehold's 3.5 s ones).
    const ok = await until('drained', () => s.drained(), 300_000, 25);
    const ms = performance.now() - t0;
    if (!ok) throw new Error(`${s.label}: ${n} jobs not drained within 300 s`);
    const cpu = cpuPerJob(cpu0, w, pm, n);
    const wal1 = await walBytes(s.pool);
    await stopWorker(w);
    const after = await dbCounters(s);
    return {
      jobsPerSec: (n / ms) * 1000,
      commitsPerJob: (after.commits - before.commits) / n,
      rowsPerJob: (after.rows - before.rows) / n,
      walBytesPerJob: Number(wal1 - wal0) / n,
      cpuMsPerJob: cpu,
    };
  } finally {
    await stopWorker(w);
  }
}

/** Jobs enqueued one by one at `rate`/s for `seconds`, ids from `first`: when each call began. */
async function steadyLoad(s: System, rate: number, seconds: number, first: number): Promise<Map<number, number>> {
  const sent = new Map<number, number>();
  const total = Math.round(rate * seconds);
  const t0 = Date.now();
  const pending: Promise<void>[] = [];
  for (let i = 0; i < total; i++) {
    const due = t0 + (i * 1000) / rate;
    const wait = due - Date.now();
    if (wait > 0) await new Promise((r) => setTimeout(r, wait));
    sent.set(first + i, clockMs());
    const p = s.enqueueOne({ id: first + i });
    p.catch(() => undefined); // awaited below (Promise.all), not an unhandled rejection meanwhile
    pending.push(p);
  }
  await Promise.all(pending);
  return sent;
}

/**
 * One latency repetition: jobs enqueued one by one at `rate`/s; latency = handler start − enqueue
 * call. The repetition's worker process first runs `warmSeconds` of the same load, discarded: a
 * fresh process runs its first second of jobs on cold code (for Leasehold's agent, jobs of a
 * repetition's first second took 2–3 times as long as the rest), and V8 goes on optimizing it
 * for seconds after (after 2 s, its optimizing compiler still took 16 % of Leasehold's agent
 * process over the measured 10 s; after 10 s, 6 %; after 20 s, under 1 %).
 */
async function latencyRep(s: System, o: BenchOptions, warmSeconds = o.warmupSeconds > 0 ? (o.repWarmupSeconds ?? DEFAULT_REP_WARMUP_SECONDS) : 0) {
  await s.reset();
  const w = await forkWorker(await s.worker('latency', concurrencyOf(s, o)));
  let warmJobs = 0;
  try {
    if (warmSeconds > 0) {
      const warm = await steadyLoad(s, o.rate, warmSeconds, -1_000_000);
      warmJobs = warm.size;
      if (!(await until('warm-up started', async () => [...warm.keys()].every((id) => w.started.has(id)), 60_000))) {
        throw new Error(`${s.label}: the warm-up load never started`);
      }
      if (!(await until('warm-up done', () => s.drained(), 10_000))) throw new Error(`${s.label}: the warm-up load not done within 10 s`);
    }
    await settle(s.pool);
    w.started.clear();
    const total = Math.round(o.rate * o.seconds);
    const pm = await postmasterPid(s.pool);
    const cpu0 = cpuNow(w, pm);
    const sent = await steadyLoad(s, o.rate, o.seconds, 0);
    const ok = await until('all started', async () => w.started.size >= total, 60_000);
    if (!ok) throw new Error(`${s.label}: only ${w.started.size} of ${total} jobs started`);
    // Every job started; its handler returns at once and its completion follows within moments.
    // The CPU is read once every completion has committed: a system whose completions stopped
    // would otherwise be measured cheaper for the work it never did.
    if (!(await until('all done', () => s.drained(), 10_000))) throw new Error(`${s.label}: not every job completed within 10 s of the last start`);
    const cpu = cpuPerJob(cpu0, w, pm, total);
    return { latencies: [...w.started].map(([id, t]) => t - sent.get(id as number)!), cpu, warmJobs };
  } finally {
    await stopWorker(w);
  }
}

/** Recovery: a worker holding `recoveryJobs` running jobs is SIGKILLed; time until all run again elsewhere. */
async function recoveryRep(s: System, o: BenchOptions, capMs: number) {
  await s.reset();
  const a = await forkWorker(await s.worker('hold', o.recoveryJobs));
  let b: Worker | undefined;
  try {
    await s.bulkEnqueue(o.recoveryJobs, (i) => ({ id: i }));
    if (!(await until('held', async () => a.started.size >= o.recoveryJobs, 60_000))) throw new Error(`${s.label}: worker never held all jobs`);
    const killedAt = clockMs();
    await stopWorker(a);
    b = await forkWorker(await s.worker('hold', o.recoveryJobs));
    const all = await until('recovered', async () => b!.started.size >= o.recoveryJobs, capMs);
    return all === undefined ? undefined : Math.max(...b.started.values()) - killedAt;
  } finally {
    await stopWorker(a);
    if (b) await stopWorker(b);
  }
}

/** Heartbeat scale: `streams` agent streams each holding one running job, heartbeating every second. */
async function heartbeatScale(s: System, o: BenchOptions, windowMs: number) {
  await s.reset();
  const cfg = await s.worker('hold', o.streams);
  // One agent (stream) per slot.
  const tokens: string[] = [];
  while (tokens.length < o.streams) tokens.push(...(await s.worker('hold', 1)).tokens!);
  const w = await forkWorker({ ...cfg, tokens: tokens.slice(0, o.streams) });
  try {
    await s.bulkEnqueue(o.streams, (i) => ({ id: i }));
    if (!(await until('all held', async () => w.started.size >= o.streams, 120_000))) throw new Error(`only ${w.started.size} streams got a job`);
    // Let every stream heartbeat a few times, then measure a window. A renewal updates its job's row
    // in jobs_live, the live jobs' partition (jobs, the partitioned table, counts no rows itself).
    await new Promise((r) => setTimeout(r, 3000));
    const stat = async () =>
      (
        await s.pool.query(
          `SELECT d.xact_commit::bigint AS commits, t.n_tup_upd::bigint AS updated FROM pg_stat_database d, pg_stat_user_tables t
           WHERE d.datname = $1 AND t.relname = 'jobs_live'`,
          [s.database],
        )
      ).rows[0] as { commits: string; updated: string };
    await new Promise((r) => setTimeout(r, 1100));
    const a = await stat();
    const readA = performance.now();
    const cpu0 = process.cpuUsage();
    const t0 = performance.now();
    await new Promise((r) => setTimeout(r, windowMs));
    const cpu = process.cpuUsage(cpu0);
    const secs = (performance.now() - t0) / 1000;
    await new Promise((r) => setTimeout(r, 1100));
    const b = await stat();
    // The counts between the two reads are those of the time between them, the window and the
    // second after it (until 2026-12-07 divided by the window alone: a tenth too many at 10 s).
    const counted = (performance.now() - readA) / 1000;
    return {
      cpuPercent: ((cpu.user + cpu.system) / 1e6 / secs) * 100,
      commitsPerSec: (Number(b.commits) - Number(a.commits)) / counted,
      rowsRenewedPerSec: (Number(b.updated) - Number(a.updated)) / counted,
    };
  } finally {
    await stopWorker(w);
  }
}

/** pgbench: single-row UPDATEs against the same server, the database's ceiling for tiny transactions. */
async function pgbench(adminUrl: string, seconds: number): Promise<number | undefined> {
  const bin = ['/usr/lib/postgresql/17/bin/pgbench', '/usr/lib/postgresql/16/bin/pgbench', '/usr/lib/postgresql/15/bin/pgbench', 'pgbench'];
  const u = new URL(adminUrl);
  const env = { ...process.env, PGHOST: u.hostname, PGPORT: u.port, PGUSER: decodeURIComponent(u.username), PGPASSWORD: decodeURIComponent(u.password) };
  const admin = new pg.Client({ connectionString: adminUrl });
  await admin.connect();
  await admin.query('DROP DATABASE IF EXISTS bench_pgbench WITH (FORCE)');
  await admin.query('CREATE DATABASE bench_pgbench');
  await admin.end();
  for (const b of bin) {
    try {
      await run(b, ['-i', '-q', '-s', '10', 'bench_pgbench'], { env });
    } catch {
      continue;
    }
    const dir = await mkdtemp(path.join(os.tmpdir(), 'bench-pgbench-'));
    const script = path.join(dir, 'update.sql');
    await writeFile(script, '\\set aid random(1, 1000000)\nUPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n');
    const { stdout } = await run(b, ['-n', '-c', '16', '-j', '2', '-T', String(seconds), '-f', script, 'bench_pgbench'], { env });
    await rm(dir, { recursive: true, force: true });
    const m = /tps = ([\d.]+)/.exec(stdout);
    return m ? Number(m[1]) : undefined;
  }
  return undefined;
}

/** Runs the benchmark; returns the rows written to the report. */
export async function bench(o: BenchOptions): Promise<{ rows: Row[]; md: string }> {
  const log = o.log;
  const dataDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-bench-'));
  const outboxes = await mkdtemp(path.join(os.tmpdir(), 'leasehold-bench-outboxes-'));
  outboxRoot = outboxes;
  // Durable, as in production: fsync and synchronous_commit stay on.
  const statements: Record<string, string> = o.pgStatements ? { shared_preload_libraries: 'pg_stat_statements', 'pg_stat_statements.track_planning': 'on' } : {};
  const db = await startEmbedded({
    dataDir,
    log: pino({ level: 'warn' }),
    ephemeral: true,
    settings: { max_connections: '500', shared_buffers: '256MB', ...statements },
  });
  const rows: Row[] = [];
  const latencies = new Map<string, number[]>();
  const systems: System[] = [];
  try {
    const versionPool = createPool(db.url, 1);
    const version = (await versionPool.query('SHOW server_version')).rows[0].server_version as string;
    await versionPool.end();
    for (const name of o.systems) {
      if (name === 'leasehold') systems.push(await leasehold(db.url, { leaseMs: o.leaseMs, agents: 2 }));
      if (name === 'graphile-off') systems.push(await graphile(db.url, false));
      if (name === 'graphile-on') systems.push(await graphile(db.url, true));
      if (name === 'pgboss') systems.push(await pgboss(db.url, { expireMs: o.leaseMs }));
      if (name === 'floor') systems.push(await floor(db.url));
    }
    // The systems that take jobs in bulk: every scenario but latency is theirs. The contract's
    // floor (floor.ts) runs the latency scenario only, as the yardstick of its CPU per job.
    const drains = systems.filter((s) => s.name !== 'floor');
    // Warm-up: a discarded load (these machines run slower for their first ~30 s of work); bulk
    // drains for the systems that have them, the latency load for the floor (floor.ts).
    const warmEnd = Date.now() + o.warmupSeconds * 1000;
    while (Date.now() < warmEnd) {
      for (const s of drains.length ? drains : systems) {
        if (Date.now() < warmEnd) await (s.name === 'floor' ? latencyRep(s, { ...o, seconds: Math.min(o.seconds, 5) }, 0) : throughputRep(s, o, Math.min(o.jobs, 2000)));
      }
    }
    // The one-by-one enqueue path (for Leasehold an HTTP call to the gateway) is cold after a
    // bulk warm-up: a discarded stretch of the latency load, for every system alike. With 3 s of
    // it (until 2e52ce0), Leasehold's coordinator spent less CPU per job in each repetition than
    // in the one before (1.88, 1.32, 1.13 ms in one run; 1.61, 1.52, 1.21 in another): still
    // warming up while measured. After 20 s, its three repetitions spent 1.18–1.25 ms.
    if (o.warmupSeconds > 0 && o.scenarios.includes('latency')) {
      for (const s of systems) await latencyRep(s, { ...o, seconds: Math.min(o.warmupSeconds, LATENCY_WARM_SECONDS) }, 0);
    }
    log(`warm-up done (${o.warmupSeconds} s${o.scenarios.includes('latency') ? `, then ${Math.min(o.warmupSeconds, LATENCY_WARM_SECONDS)} s of the latency load per system` : ''})`);
    // `system=best`: its concurrency is the fastest in this run. With the throughput scenario,
    // every candidate is a contender of its own in the repetitions below (the fastest median
    // wins); without it, one drain each here.
    o = { ...o, concurrencyOf: { ...o.concurrencyOf } };
    const swept = new Map<System, string>();
    const pick = (s: System, tried: Array<[number, number]>, what: string) => {
      const [best] = [...tried].sort((x, y) => y[1] - x[1])[0]!;
      o.concurrencyOf![s.name] = best;
      swept.set(s, `the fastest ${what}: ${tried.map(([n, j]) => `${n}: ${Math.round(j).toLocaleString('en-US')}`).join(', ')} jobs/s`);
    };
    if (!o.scenarios.includes('throughput')) {
      for (const s of drains) {
        const tried: Array<[number, number]> = [];
        for (const n of o.sweepOf?.[s.name] ?? []) {
          const x = await throughputRep(s, { ...o, concurrencyOf: { ...o.concurrencyOf, [s.name]: n } }, o.jobs);
          tried.push([n, x.jobsPerSec]);
          log(`sweep ${s.label} concurrency ${n}: ${x.jobsPerSec.toFixed(0)} jobs/s`);
        }
        if (tried.length) pick(s, tried, 'of one drain each');
      }
    }
    const concurrencyNote = (s: System) => `concurrency ${concurrencyOf(s, o)}${swept.has(s) ? ` (${swept.get(s)})` : ''}`;
    let stopProfile: (() => Promise<void>) | undefined;
    if (o.profileDir) {
      await mkdir(o.profileDir, { recursive: true });
      profiling = { dir: o.profileDir, n: 0 };
      stopProfile = await profileSelf(path.join(o.profileDir, 'bench-process.cpuprofile'));
    }
    if (o.pgStatements) {
      for (const s of systems) await s.pool.query('CREATE EXTENSION IF NOT EXISTS pg_stat_statements');
      await systems[0]?.pool.query('SELECT pg_stat_statements_reset()');
    }

    // Repetitions take turns between the systems (1st of each, then 2nd of each, …), so that a
    // stretch of a slower machine (a shared virtual machine varies from minute to minute) falls on
    // all of them alike rather than on whichever ran then.
    if (o.scenarios.includes('throughput')) {
      type Tp = Awaited<ReturnType<typeof throughputRep>>;
      // One contender per system, or one per candidate concurrency of a swept system.
      const contenders = drains.flatMap((s) => (o.sweepOf?.[s.name]?.length ? o.sweepOf[s.name]! : [concurrencyOf(s, o)]).map((n) => ({ s, n, xs: [] as Tp[] })));
      for (let r = 0; r < o.reps; r++) {
        for (const c of contenders) {
          const { s } = c;
          const x = await throughputRep(s, { ...o, concurrencyOf: { ...o.concurrencyOf, [s.name]: c.n } }, o.jobs);
          c.xs.push(x);
          const u = x.cpuMsPerJob;
          log(
            `throughput ${s.label}${o.sweepOf?.[s.name]?.length ? ` at ${c.n}` : ''} rep ${r + 1}: ${x.jobsPerSec.toFixed(0)} jobs/s, ${x.commitsPerJob.toFixed(2)} commits/job, ` +
              `CPU ms/job ${u.main.toFixed(3)} (${s.name === 'leasehold' ? 'coordinator' : 'client'}) + ${u.worker?.toFixed(3) ?? '?'} (workers) + ${u.db?.toFixed(3) ?? '?'} (PostgreSQL)`,
          );
        }
      }
      const reps = new Map<System, Tp[]>();
      for (const s of drains) {
        const mine = contenders.filter((c) => c.s === s);
        if (mine.length > 1) pick(s, mine.map((c) => [c.n, median(c.xs.map((x) => x.jobsPerSec))]), o.reps === 1 ? 'of one drain each' : `median of ${o.reps} drains each`);
        reps.set(s, mine.find((c) => c.n === concurrencyOf(s, o))!.xs);
      }
      for (const s of drains) {
        const xs = reps.get(s)!;
        const jps = xs.map((x) => x.jobsPerSec);
        const cpj = xs.map((x) => x.commitsPerJob);
        const defined = (v: Array<number | undefined>) => v.filter((n): n is number => n !== undefined);
        const cpu = {
          main: xs.map((x) => x.cpuMsPerJob.main),
          worker: defined(xs.map((x) => x.cpuMsPerJob.worker)),
          db: defined(xs.map((x) => x.cpuMsPerJob.db)),
          total: defined(xs.map((x) => x.cpuMsPerJob.total)),
        };
        const cpuFig = (xs: number[], unit: string, metric?: MetricKey) =>
          xs.length === o.reps ? [{ ...fig(xs, 2), unit, ...(metric ? { metric } : {}) }] : [];
        rows.push({
          scenarioKey: 'throughput',
          systemKey: s.key,
          scenario: `throughput (${o.jobs} no-op jobs)`,
          system: s.label,
          note: concurrencyNote(s),
          figures: [
            { ...fig(jps), unit: 'jobs/s', metric: 'jobs_per_s' },
            { ...fig(cpj, 2), unit: 'commits/job' },
            ...cpuFig(cpu.total, 'CPU ms/job: all processes', 'cpu_ms_per_job'),
            ...cpuFig(cpu.main, 'CPU ms/job: coordinator (Leasehold) or client'),
            ...cpuFig(cpu.worker, 'CPU ms/job: workers'),
            ...cpuFig(cpu.db, 'CPU ms/job: PostgreSQL'),
          ],
        });
      }
    }
    if (o.scenarios.includes('writes')) {
      // What a job writes does not depend on the machine: one drain per system, by a fresh worker
      // (no warm-up drain: its statistics could still be reaching pg_stat_database when the
      // measured drain's are read; with one, graphile-worker's read 2.55 and 2.45 rows per job
      // instead of 3.00 and 2.00).
      for (const s of drains) {
        const x = await throughputRep(s, o, o.jobs, 0);
        log(`writes ${s.label}: ${x.rowsPerJob.toFixed(2)} rows/job, ${x.walBytesPerJob.toFixed(0)} B of WAL/job`);
        rows.push({
          scenarioKey: 'writes',
          systemKey: s.key,
          scenario: `writes: one drain of ${o.jobs} no-op jobs, enqueue to completion`,
          system: s.label,
          note: 'rows: inserted + updated + deleted in its database (pg_stat_database); WAL: the whole server',
          figures: [
            { ...fig([x.rowsPerJob], 2), unit: 'rows/job', metric: 'rows_per_job' },
            { ...fig([x.walBytesPerJob]), unit: 'WAL bytes/job', metric: 'wal_bytes_per_job' },
          ],
        });
      }
    }
    if (o.scenarios.includes('latency')) {
      type Lat = Awaited<ReturnType<typeof latencyRep>>;
      const reps = new Map<System, Lat[]>(systems.map((s) => [s, []]));
      for (let r = 0; r < o.reps; r++) {
        for (const s of systems) {
          const x = await latencyRep(s, o);
          reps.get(s)!.push(x);
          const { latencies: l, cpu: c } = x;
          log(
            `latency ${s.label} rep ${r + 1}: p50 ${pct(l, 50).toFixed(1)} ms, p95 ${pct(l, 95).toFixed(1)} ms, p99 ${pct(l, 99).toFixed(1)} ms; ` +
              `CPU ms/job ${c.main.toFixed(2)} (${s.name === 'leasehold' ? 'coordinator and HTTP client' : 'client'}) + ${c.worker?.toFixed(2) ?? '?'} (workers) + ${c.db?.toFixed(2) ?? '?'} (PostgreSQL); ` +
              `its worker warmed by ${x.warmJobs} discarded jobs`,
          );
        }
      }
      for (const s of systems) {
        const xs = reps.get(s)!;
        const p50 = xs.map((x) => pct(x.latencies, 50));
        const p95 = xs.map((x) => pct(x.latencies, 95));
        const p99 = xs.map((x) => pct(x.latencies, 99));
        const cpu = xs.map((x) => x.cpu.total).filter((n): n is number => n !== undefined);
        const all = xs.flatMap((x) => x.latencies);
        latencies.set(s.label, all);
        rows.push({
          scenarioKey: 'latency',
          systemKey: s.key,
          scenario: `dispatch latency, enqueue → handler start (${o.rate} jobs/s for ${o.seconds} s)`,
          system: s.label,
          note: concurrencyNote(s),
          figures: [
            { ...fig(p50, 1), unit: 'ms p50', metric: 'p50_ms' },
            { ...fig(p95, 1), unit: 'ms p95', metric: 'p95_ms' },
            { ...fig(p99, 1), unit: 'ms p99', metric: 'p99_ms' },
            ...(cpu.length === o.reps ? [{ ...fig(cpu, 2), unit: 'CPU ms/job: all processes', metric: 'cpu_ms_per_job' as const }] : []),
          ],
        });
      }
    }
    if (o.scenarios.includes('recovery')) {
      const cap = o.recoveryCapMs ?? Math.max(20_000, 4 * o.leaseMs);
      for (const s of drains) {
        const times: number[] = [];
        let lost = 0;
        for (let r = 0; r < o.reps; r++) {
          const t = await recoveryRep(s, o, cap);
          if (t === undefined) lost++;
          else times.push(t);
          log(`recovery ${s.label} rep ${r + 1}: ${t === undefined ? `not within ${cap / 1000} s` : `${t} ms`}`);
        }
        const note = s.leaseMs ? `lease ${s.leaseMs / 1000} s` : 'no lease: a dead worker\'s jobs stay locked (4 h)';
        rows.push({
          scenarioKey: 'recovery',
          systemKey: s.key,
          scenario: `recovery: SIGKILL a worker holding ${o.recoveryJobs} running jobs, until all run elsewhere`,
          system: s.label,
          figures: times.length
            ? [{ ...fig(times), unit: 'ms' }, ...(s.leaseMs ? [{ ...fig(times.map((t) => t / s.leaseMs!), 2), unit: '× lease', metric: 'lease_multiple' as const }] : [])]
            : [],
          note: lost ? `${lost}/${o.reps} not recovered within ${cap / 1000} s; ${note}` : note,
        });
      }
    }
    const lh = systems.find((s) => s.name === 'leasehold');
    if (o.scenarios.includes('heartbeats') && lh) {
      const cpu: number[] = [];
      const cps: number[] = [];
      const rps: number[] = [];
      for (let r = 0; r < o.reps; r++) {
        const h = await heartbeatScale(lh, o, o.seconds * 1000);
        cpu.push(h.cpuPercent);
        cps.push(h.commitsPerSec);
        rps.push(h.rowsRenewedPerSec);
        log(`heartbeats rep ${r + 1}: coordinator ${h.cpuPercent.toFixed(1)}% CPU, ${h.commitsPerSec.toFixed(1)} commits/s, ${h.rowsRenewedPerSec.toFixed(0)} leases renewed/s`);
      }
      rows.push({
        scenarioKey: 'heartbeats',
        systemKey: 'leasehold',
        scenario: `heartbeat scale: ${o.streams} agent streams, one running job each, heartbeat every ${o.leaseMs / 5000} s`,
        system: 'Leasehold',
        figures: [{ ...fig(cpu, 1), unit: '% CPU (coordinator)' }, { ...fig(cps, 1), unit: 'commits/s', metric: 'commits_per_s' }, { ...fig(rps), unit: 'leases renewed/s' }],
      });
    }
    if (o.scenarios.includes('history') && lh) {
      // A deep backlog: drains of ten times the jobs against drains of `jobs`, taking turns, on
      // the throughput scenario's database. Its jobs/s and the agents' CPU per job, each deep
      // over shallow (L15: at 100,000 jobs the agent process had spent twice the CPU per job).
      const deepJobs = o.jobs * 10;
      const sizes = { shallow: [] as Awaited<ReturnType<typeof throughputRep>>[], deep: [] as Awaited<ReturnType<typeof throughputRep>>[] };
      for (let r = 0; r < o.reps; r++) {
        for (const k of inTurn<keyof typeof sizes>(r, 'shallow', 'deep')) {
          const x = await throughputRep(lh, o, k === 'deep' ? deepJobs : o.jobs);
          sizes[k].push(x);
          log(`history backlog of ${k === 'deep' ? deepJobs : o.jobs} rep ${r + 1}: ${x.jobsPerSec.toFixed(0)} jobs/s, agents ${x.cpuMsPerJob.worker?.toFixed(3) ?? '?'} ms of CPU a job`);
        }
      }
      const jps = (k: keyof typeof sizes) => median(sizes[k].map((x) => x.jobsPerSec));
      const agentCpu = (k: keyof typeof sizes) => sizes[k].map((x) => x.cpuMsPerJob.worker).filter((n): n is number => n !== undefined);
      const cpuRatio = agentCpu('deep').length && agentCpu('shallow').length ? median(agentCpu('deep')) / median(agentCpu('shallow')) : undefined;
      rows.push({
        scenarioKey: 'history',
        systemKey: 'leasehold',
        scenario: `history: a backlog of ${deepJobs.toLocaleString('en-US')} jobs against ${o.jobs.toLocaleString('en-US')}, drains taking turns`,
        system: 'Leasehold: deep backlog',
        figures: [
          { ...fig(sizes.shallow.map((x) => x.jobsPerSec)), unit: `jobs/s, ${o.jobs.toLocaleString('en-US')}` },
          { ...fig(sizes.deep.map((x) => x.jobsPerSec)), unit: `jobs/s, ${deepJobs.toLocaleString('en-US')}` },
          { ...fig([jps('deep') / jps('shallow')], 2), unit: 'jobs/s: deep / shallow', metric: 'deep_jobs_per_s_ratio' },
          ...(cpuRatio === undefined
            ? []
            : [
                { ...fig(agentCpu('shallow'), 3), unit: `agents' CPU ms/job, ${o.jobs.toLocaleString('en-US')}` },
                { ...fig(agentCpu('deep'), 3), unit: `agents' CPU ms/job, ${deepJobs.toLocaleString('en-US')}` },
                { ...fig([cpuRatio], 2), unit: "agents' CPU per job: deep / shallow", metric: 'deep_agent_cpu_ratio' as const },
              ]),
        ],
      });
    }
    if (o.scenarios.includes('history') && o.systems.includes('leasehold')) {
      // Leasehold alone, on two databases of its own on the one server: a twin that keeps a few
      // finished jobs, and `h`, which gets `historyJobs` more. Every figure is taken on both,
      // the two taking turns round by round, so that this machine's drift falls on both alike:
      // measured one after the other (the empty round first, the full one minutes later), the
      // same reads on an unchanged database moved by 1.4 × and back between rounds (GetStats
      // 2.7, 1.9, 2.7 ms), and the ratio of the same code's GetStats was 0.97 in one run and
      // 2.83 in another (docs/performance-history.md, "Cost as the work grows").
      const twin = await leasehold(db.url, { leaseMs: o.leaseMs, agents: 2, database: 'bench_leasehold_history_empty', keepHistory: true });
      const h = await leasehold(db.url, { leaseMs: o.leaseMs, agents: 2, database: 'bench_leasehold_history', keepHistory: true }).catch(async (err: unknown) => {
        await twin.close();
        throw err;
      });
      try {
        // Each round's reads start from a settled database, as the drains do (`settle`: VACUUM
        // ANALYZE, then a checkpoint). Right after a seeding of gigabytes, PostgreSQL and the
        // kernel are still writing it out; right after drains, the dead rows they left in
        // jobs_live are still there until the vacuumer's next VACUUM. Unsettled, the reads paid
        // for whichever database had just been busier: after the purge's drains, with 6,000
        // jobs kept, the gauges read 3.1 ms against 0.7 on the idle twin.
        const readsSettled = async (s: System) => {
          await settle(s.pool);
          return historyReads(s.pool);
        };
        // Each read's timed calls of every round, pooled.
        const pooled = (into: Map<string, ReadTimes>, round: Map<string, ReadTimes>) => {
          for (const [k, v] of round) {
            const x = into.get(k);
            if (x) x.ms.push(...v.ms);
            else into.set(k, { ...v, ms: [...v.ms] });
          }
        };
        const fmtReads = (reads: Map<string, ReadTimes>) =>
          [...reads].map(([k, v]) => `${k} ${median(v.ms).toFixed(1)} ms${v.rows === undefined ? '' : ` (${v.rows} jobs)`}`).join(', ');
        const empty = { reads: new Map<string, ReadTimes>(), tp: [] as number[], wal: [] as number[], p50: [] as number[] };
        const full = { reads: new Map<string, ReadTimes>(), tp: [] as number[], wal: [] as number[], p50: [] as number[] };
        await seedFinished(twin.pool, HISTORY_EMPTY_JOBS);
        await seedFinished(h.pool, HISTORY_EMPTY_JOBS);
        const t0 = performance.now();
        await seedFinished(h.pool, o.historyJobs);
        log(`history: ${o.historyJobs} finished jobs seeded in ${((performance.now() - t0) / 1000).toFixed(0)} s`);
        // The seeding's statements are not the scenario's: without this they lead the list.
        if (o.pgStatements) await systems[0]?.pool.query('SELECT pg_stat_statements_reset()');
        for (let r = 0; r < o.reps; r++) {
          for (const [m, s] of inTurn<[typeof empty, System]>(r, [empty, twin], [full, h])) {
            const reads = await readsSettled(s);
            pooled(m.reads, reads);
            const drain = await throughputRep(s, o, o.jobs);
            m.tp.push(drain.jobsPerSec);
            m.wal.push(drain.walBytesPerJob);
            m.p50.push(pct((await latencyRep(s, o)).latencies, 50));
            log(`history round ${r + 1}, ${m === empty ? `${HISTORY_EMPTY_JOBS}` : `${o.historyJobs + HISTORY_EMPTY_JOBS}`} finished jobs: ${fmtReads(reads)}; throughput ${m.tp.at(-1)!.toFixed(0)} jobs/s, ${m.wal.at(-1)!.toFixed(0)} B of WAL a job; p50 ${m.p50.at(-1)!.toFixed(1)} ms`);
          }
        }
        // The oldest whole day purged (with the part of a day before it) as the purger does it,
        // while throughput drains run one after another: how long until the day is gone from the
        // reads, how long until its rows are swept, and the drains' rate meanwhile against after.
        const across = await drainsAcrossPurge(h, o, o.jobs, (hold) => purgeOldestDay(h.pool, hold));
        const purged = across.purged;
        // Against the drains with the sweep held, in the same minutes; the three before and three
        // after only when the purge was too short to hold it for three (drainsAcrossPurge).
        const inTurns = across.held.length >= 3;
        const without = inTurns ? across.held : across.around;
        const purgeRatio = median(across.during) / median(without);
        const sweptMs = purged.ms - across.heldMs;
        const againstWhat = inTurns
          ? `${across.held.length} drains in turn with the sweep held, ${Math.round(median(across.held)).toLocaleString('en-US')} jobs/s (median)`
          : `the three drains before it and three after, ${Math.round(median(across.around)).toLocaleString('en-US')} jobs/s (median)`;
        log(
          `history: purged the oldest whole day (${purged.days.join(', ')}: ${purged.purged} jobs, ${purged.batches} statements): gone from the reads in ${(purged.goneMs / 1000).toFixed(1)} s, swept in ${(sweptMs / 1000).toFixed(1)} s (and held ${(across.heldMs / 1000).toFixed(1)} s); ` +
            `drains of ${o.jobs} while it worked ${across.during.map((x) => x.toFixed(0)).join(', ')} jobs/s${across.overlapped ? ' (one drain, the purge ended inside it)' : ''}; with the sweep held ${across.held.map((x) => x.toFixed(0)).join(', ') || 'none'}; before and after it ${across.around.map((x) => x.toFixed(0)).join(', ')} jobs/s`,
        );
        // The reads again once the day's rows are swept (and vacuumed): what an operator meets on
        // most hours of a day, the purger dropping a day each day.
        // Taking turns with the twin again, against which they are compared.
        const afterPurge = new Map<string, ReadTimes>();
        const twinAfter = new Map<string, ReadTimes>();
        for (let r = 0; r < o.reps; r++) {
          for (const [into, s] of inTurn<[Map<string, ReadTimes>, System]>(r, [twinAfter, twin], [afterPurge, h])) {
            pooled(into, await readsSettled(s));
          }
        }
        log(`history after the purge: ${fmtReads(afterPurge)}; the twin meanwhile: ${fmtReads(twinAfter)}`);
        const scenario = `history: operator reads and the hot path, ${HISTORY_EMPTY_JOBS.toLocaleString('en-US')} finished jobs seeded against ${(o.historyJobs + HISTORY_EMPTY_JOBS).toLocaleString('en-US')} (the drains' own kept in both), two databases taking turns`;
        const worstOf = (round: Map<string, ReadTimes>, base: Map<string, ReadTimes>) =>
          [...base].map(([k, e]) => [k, median(round.get(k)!.ms) / median(e.ms)] as const).reduce((a, b) => (b[1] > a[1] ? b : a));
        const worst = worstOf(full.reads, empty.reads);
        const worstAfter = worstOf(afterPurge, twinAfter);
        rows.push({
          scenarioKey: 'history',
          systemKey: 'leasehold',
          scenario,
          system: 'Leasehold',
          figures: [
            { ...fig([worst[1]], 2), unit: 'worst read: full / empty', metric: 'read_ms_ratio' },
            { ...fig([worstAfter[1]], 2), unit: 'worst read after the purge: full / empty', metric: 'read_ms_ratio_after_purge' },
            { ...fig([median(full.tp) / median(empty.tp)], 2), unit: 'jobs/s: full / empty', metric: 'jobs_per_s_ratio' },
            // Machine-independent: what the hot path writes should not grow with the history.
            { ...fig([median(full.wal) / median(empty.wal)], 2), unit: 'WAL per job: full / empty', metric: 'wal_bytes_per_job_ratio' },
            { ...fig([median(full.p50) / median(empty.p50)], 2), unit: 'latency p50: full / empty' },
            { ...fig([purged.goneMs], 0), unit: 'ms until the oldest day is gone from the reads', metric: 'purge_gone_ms' },
            { ...fig([sweptMs], 0), unit: 'ms to purge the oldest day, its rows swept (the time held not counted)', metric: 'purge_ms' },
            { ...fig([purgeRatio], 2), unit: 'jobs/s while purging / without', metric: 'purge_jobs_per_s_ratio' },
          ],
          note: `worst read: ${worst[0]}; after the purge: ${worstAfter[0]}; throughput ${Math.round(median(empty.tp)).toLocaleString('en-US')} → ${Math.round(median(full.tp)).toLocaleString('en-US')} jobs/s, p50 ${median(empty.p50).toFixed(1)} → ${median(full.p50).toFixed(1)} ms; purge of the oldest whole day (${purged.days.join(', ')}): ${purged.purged.toLocaleString('en-US')} jobs, gone from the reads in ${(purged.goneMs / 1000).toFixed(1)} s, swept in ${(sweptMs / 1000).toFixed(1)} s (held ${(across.heldMs / 1000).toFixed(1)} s more); ${across.during.length} drains of ${o.jobs.toLocaleString('en-US')} jobs ran at ${Math.round(median(across.during)).toLocaleString('en-US')} jobs/s (median) while it worked${across.overlapped ? ' (the purge ended inside the one drain)' : ''}, against ${againstWhat}`,
        });
        for (const [k, e] of empty.reads) {
          const f = full.reads.get(k)!;
          rows.push({
            scenarioKey: 'history',
            systemKey: 'leasehold',
            read: k,
            scenario,
            system: `Leasehold: ${k}`,
            figures: [
              { ...fig(e.ms, 1), unit: 'ms, empty' },
              { ...fig(f.ms, 1), unit: 'ms, full', metric: 'read_ms' },
              { ...fig([median(f.ms) / median(e.ms)], 2), unit: 'full / empty', metric: 'read_ms_ratio' },
              { ...fig(twinAfter.get(k)!.ms, 1), unit: 'ms, empty, after the purge' },
              { ...fig(afterPurge.get(k)!.ms, 1), unit: 'ms, full, after the purge' },
              { ...fig([median(afterPurge.get(k)!.ms) / median(twinAfter.get(k)!.ms)], 2), unit: 'after the purge: full / empty', metric: 'read_ms_ratio_after_purge' },
            ],
            // A list's page in each round: a shorter page when empty would flatter the ratio's divisor.
            ...(e.rows === undefined ? {} : { note: `jobs on the page: ${e.rows} empty, ${f.rows} full${e.rows === f.rows ? '' : ' (pages differ: the ratio compares unlike reads)'}` }),
          });
        }
      } finally {
        try {
          await h.close();
        } finally {
          await twin.close();
        }
      }
    }
    if (o.scenarios.includes('pgbench')) {
      const tps: number[] = [];
      for (let r = 0; r < o.reps; r++) {
        const t = await pgbench(db.url, Math.max(2, o.seconds));
        if (t === undefined) break;
        tps.push(t);
        log(`pgbench rep ${r + 1}: ${t.toFixed(0)} tps`);
      }
      rows.push({
        scenarioKey: 'ceiling',
        systemKey: 'postgresql',
        scenario: 'ceiling: pgbench, single-row UPDATE, 16 clients',
        system: 'PostgreSQL',
        figures: tps.length ? [{ ...fig(tps), unit: 'transactions/s', metric: 'tps' }] : [],
        note: tps.length ? undefined : 'pgbench not found (apt-get install postgresql-client-15 or postgresql-15)',
      });
    }
    if (stopProfile && o.profileDir) {
      await stopProfile();
      profiling = undefined;
      const files = (await readdir(o.profileDir, { recursive: true })).filter((f) => f.endsWith('.cpuprofile')).sort();
      for (const f of files) log(`\n${f}\n${await summarize(path.join(o.profileDir, f))}`);
    }
    if (o.pgStatements && systems[0]) {
      const top = await systems[0].pool.query(
        `SELECT d.datname AS db, s.calls, round(s.total_exec_time) AS exec_ms, round(s.total_plan_time) AS plan_ms, s.rows,
                regexp_replace(left(s.query, 100), '\\s+', ' ', 'g') AS query
         FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
         ORDER BY s.total_exec_time + s.total_plan_time DESC LIMIT 40`,
      );
      log('\npg_stat_statements, the measured scenarios (exec and plan ms in all):');
      for (const r of top.rows) log(`${String(r.exec_ms).padStart(7)} ${String(r.plan_ms).padStart(6)} ${String(r.calls).padStart(7)} calls ${String(r.rows).padStart(7)} rows  ${r.db}: ${r.query}`);
    }
    const commit = await commitOf();
    const md = markdown(rows, {
      date: new Date().toISOString(),
      machine: `${os.cpus().length} × ${os.cpus()[0]?.model ?? 'cpu'}, ${(os.totalmem() / 2 ** 30).toFixed(0)} GiB, ${os.platform()} ${os.release()}`,
      node: process.version,
      postgres: `PostgreSQL ${version} (embedded, fsync and synchronous_commit on)`,
      commit,
      reps: o.reps,
    });
    if (o.out) await writeFile(o.out, md);
    if (o.json) await writeFile(o.json, `${JSON.stringify(results(rows, commit), null, 1)}\n`);
    if (o.svg && latencies.size) await writeFile(o.svg, latencySvg(latencies));
    return { rows, md };
  } finally {
    for (const s of systems) await s.close().catch(() => undefined);
    try {
      await db.stop();
    } finally {
      await rm(dataDir, { recursive: true, force: true });
      await rm(outboxes, { recursive: true, force: true });
      outboxRoot = undefined;
    }
  }
}

/** The commit measured: its short hash, `+dirty` when the tree differs from it (the bench's own outputs aside). */
async function commitOf(): Promise<string> {
  try {
    const head = (await run('git', ['rev-parse', '--short', 'HEAD'], { cwd: root })).stdout.trim();
    const outputs = ['results.md', 'results.json', 'latency.svg'].map((f) => `:!test/bench/${f}`);
    const dirty = (await run('git', ['status', '--porcelain', '--', '.', ...outputs], { cwd: root })).stdout.trim();
    return dirty ? `${head}+dirty` : head;
  } catch {
    return 'unknown';
  }
}

/**
 * `256,graphile-off=16` → a default of 256, and 16 for graphile-off; `graphile-off=best` → the
 * fastest of `SWEEP` for it, measured in the run.
 */
function concurrency(list: string): Pick<BenchOptions, 'concurrency' | 'concurrencyOf' | 'sweepOf'> {
  const o: Pick<BenchOptions, 'concurrency' | 'concurrencyOf' | 'sweepOf'> = { concurrency: 256, concurrencyOf: {}, sweepOf: {} };
  for (const item of list.split(',')) {
    const [a, b] = item.split('=');
    if (b === 'best' && ['leasehold', 'graphile-off', 'graphile-on', 'pgboss'].includes(a!)) {
      o.sweepOf![a as SystemName] = SWEEP;
      continue;
    }
    const n = Number(b ?? a);
    if (!Number.isInteger(n) || n < 1) throw new Error(`--concurrency: ${item} is not a positive whole number`);
    if (b === undefined) o.concurrency = n;
    else if (['leasehold', 'graphile-off', 'graphile-on', 'pgboss'].includes(a!)) o.concurrencyOf![a as SystemName] = n;
    else throw new Error(`--concurrency: no system ${a} (leasehold, graphile-off, graphile-on, pgboss)`);
  }
  return o;
}

const isMain = process.argv[1] && path.resolve(process.argv[1]) === path.resolve(new URL(import.meta.url).pathname);
if (isMain) {
  const program = new Command()
    .name('bench')
    .option('--quick', 'the smoke version: a few hundred jobs, a few seconds')
    .option('--jobs <n>', 'jobs per throughput repetition', '20000')
    .option('--reps <n>', 'repetitions per figure', '3')
    .option('--systems <list>', 'of leasehold,graphile-off,graphile-on,pgboss; and floor, the contract\'s steps in bare Node (floor.ts: the latency scenario only, the others skip it)', 'leasehold,graphile-off,graphile-on,pgboss,floor')
    .option(
      '--scenarios <list>',
      'throughput,writes,latency,recovery,heartbeats,history,pgbench (pgbench is the ceiling)',
      'throughput,writes,latency,recovery,heartbeats,history,pgbench',
    )
    .option('--warmup <seconds>', 'discarded load before measuring', '30')
    .option('--rep-warmup <seconds>', "discarded latency load each latency repetition's fresh worker runs before it is measured (none with --warmup 0 or --quick)", String(DEFAULT_REP_WARMUP_SECONDS))
    .option('--history-jobs <n>', 'the history scenario: finished jobs seeded before its second round', '10000000')
    .option('--profile <dir>', 'write CPU profiles of the measured scenarios (bench process, workers) to DIR and summarize them')
    .option('--pg-statements', 'load pg_stat_statements and print the costliest statements of the measured scenarios')
    .option(
      '--concurrency <list>',
      'jobs a system runs at once (slots, worker concurrency): a default, then system=n exceptions (system=best: the fastest of 2, 4, 8, 16 in this run)',
      '256,graphile-off=best',
    )
    .parse();
  const f = program.opts<{ quick?: boolean; profile?: string; pgStatements?: boolean; jobs: string; reps: string; systems: string; scenarios: string; warmup: string; repWarmup: string; concurrency: string; historyJobs: string }>();
  const quick = Boolean(f.quick);
  const known = { systems: ['leasehold', 'graphile-off', 'graphile-on', 'pgboss', 'floor'], scenarios: ['throughput', 'writes', 'latency', 'recovery', 'heartbeats', 'history', 'pgbench', 'ceiling'] };
  for (const [flag, list] of [['systems', f.systems], ['scenarios', f.scenarios]] as const) {
    const bad = list.split(',').filter((x) => !known[flag].includes(x));
    if (bad.length) program.error(`--${flag}: unknown ${bad.join(', ')} (one of ${known[flag].join(', ')})`);
  }
  // The floor takes part in the latency scenario only (and leaves pgbench's ceiling be): alone,
  // any other scenario would run nothing.
  const beyondLatency = f.scenarios.split(',').filter((x) => !['latency', 'pgbench', 'ceiling'].includes(x));
  if (f.systems.split(',').every((x) => x === 'floor') && beyondLatency.length) {
    program.error(`--systems floor runs the latency scenario only (floor.ts), not ${beyondLatency.join(', ')}: add --scenarios latency`);
  }
  const seconds = (flag: string, v: string): number => {
    const n = Number(v);
    return v.trim() !== '' && Number.isFinite(n) && n >= 0 ? n : program.error(`${flag}: ${JSON.stringify(v)} is not a number of seconds (0 or more)`);
  };
  const o: BenchOptions = {
    jobs: quick ? 300 : Number(f.jobs),
    reps: quick ? 1 : Number(f.reps),
    rate: quick ? 100 : 200,
    seconds: quick ? 2 : 10,
    ...(() => {
      try {
        return concurrency(quick ? '32' : f.concurrency);
      } catch (err) {
        return program.error((err as Error).message);
      }
    })(),
    recoveryJobs: quick ? 10 : 100,
    historyJobs: quick ? 3000 : Number(f.historyJobs),
    leaseMs: quick ? 2000 : 5000,
    streams: quick ? 50 : 2000,
    warmupSeconds: quick ? 0 : seconds('--warmup', f.warmup),
    repWarmupSeconds: seconds('--rep-warmup', f.repWarmup),
    systems: f.systems.split(',') as SystemName[],
    scenarios: f.scenarios.split(',').map((x) => (x === 'ceiling' ? 'pgbench' : x)),
    ...(f.profile ? { profileDir: path.resolve(f.profile) } : {}),
    ...(f.pgStatements ? { pgStatements: true } : {}),
    // A quick or instrumented run's figures are not the benchmark's: they go to the terminal only.
    out: quick || f.profile || f.pgStatements ? undefined : path.join(here, 'results.md'),
    json: quick || f.profile || f.pgStatements ? undefined : path.join(here, 'results.json'),
    svg: quick || f.profile || f.pgStatements ? undefined : path.join(here, 'latency.svg'),
    log: (l) => process.stdout.write(`${l}\n`),
  };
  bench(o).then(
    ({ md }) => {
      process.stdout.write(`\n${md}\n`);
      process.exit(0);
    },
    (err: unknown) => {
      process.stderr.write(`bench failed: ${(err as Error).stack ?? err}\n`);
      process.exit(1);
    },
  );
}
