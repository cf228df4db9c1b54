/**
 * What authentication costs a gateway call: sequential `POST /leasehold.v1.JobService/GetJob`
 * calls with keep-alive against an in-process coordinator on an embedded PostgreSQL, with the
 * credential cache off (a database lookup per call, as before the cache) and on. Per call: the
 * CPU of this process (client and coordinator together, from `process.cpuUsage()`; nothing
 * subtracted), the CPU of PostgreSQL (every backend, from /proc), and the mean and p99 latency.
 *
 * Three views, because this machine's noise is larger than the difference:
 * 1. `restart`: a coordinator per repetition and `LEASEHOLD_AUTH_CACHE_TTL` (`--modes`), modes
 *    alternating so drift hits both.
 * 2. `paired`: one coordinator, blocks of calls alternating between the cache served and
 *    bypassed (`setOnline(false)`: the path of a coordinator whose listener is down, which is
 *    the database lookup of TTL 0), so both see the same process state.
 * 3. `authenticate()` alone in a loop: the lookup itself, without HTTP.
 *
 *   node --import tsx test/bench/gateway-auth.ts [--calls 3000] [--reps 3] [--blocks 20]
 */
import http from 'node:http';
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Command } from 'commander';
import pg from 'pg';
import pino from 'pino';
import { loadConfig } from '../../server/config.js';
import { startCoordinator, type Coordinator } from '../../server/coordinator.js';
import { startEmbedded } from '../../server/store/embedded.js';
import { jobEnqueue, keyCreate } from '../../server/store/index.js';
import { authenticate } from '../../server/transport/auth.js';
import { postgresCpu, postmasterPid } from './cpu.js';

const opts = new Command()
  .option('--calls <n>', 'calls per repetition', (v) => Number(v), 3000)
  .option('--reps <n>', 'repetitions per mode (restart view)', (v) => Number(v), 3)
  .option('--modes <list>', 'cache TTLs to compare (restart view)', '0,60s')
  .option('--blocks <n>', 'blocks per side (paired view), each of calls/10', (v) => Number(v), 20)
  .parse()
  .opts<{ calls: number; reps: number; modes: string; blocks: number }>();

const log = pino({ level: 'warn' });
const dataDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-authbench-'));
const db = await startEmbedded({ dataDir, log, ephemeral: true });
const admin = new pg.Client({ connectionString: db.url });
await admin.connect();
await admin.query('CREATE DATABASE authbench');
await admin.end();
const url = new URL(db.url);
url.pathname = '/authbench';

interface Sample {
  mode: string;
  cpuMsPerCall: number;
  pgCpuMsPerCall: number;
  meanMs: number;
  p99Ms: number;
}
const views: Record<'restart' | 'paired' | 'lookup', Sample[]> = { restart: [], paired: [], lookup: [] };
let key: string | undefined;
let jobId: string | undefined;

async function coordinator(ttl: string): Promise<Coordinator> {
  const config = loadConfig(
    { grpcAddr: '127.0.0.1:0', httpAddr: '127.0.0.1:0' },
    { DATABASE_URL: url.toString(), LEASEHOLD_AUTH_CACHE_TTL: ttl, LEASEHOLD_RETENTION: 'off' },
  );
  const c = await startCoordinator(config, log);
  if (!key) {
    const k = await keyCreate(c.db.pool, { name: 'bench-reader', scopes: ['read'] });
    if (k.outcome !== 'ok') throw new Error(JSON.stringify(k));
    key = k.value.key;
    const j = await jobEnqueue(c.db.pool, { queue: 'authbench', payload: { n: 1 } });
    if (j.outcome !== 'ok') throw new Error(JSON.stringify(j));
    jobId = j.value.id;
  }
  return c;
}

/** A keep-alive client of `c`'s GetJob (one socket). */
function getJobClient(c: Coordinator) {
  const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
  const body = JSON.stringify({ jobId });
  const call = () =>
    new Promise<void>((resolve, reject) => {
      const req = http.request(
        {
          agent,
          host: '127.0.0.1',
          port: c.http.address.port,
          method: 'POST',
          path: '/leasehold.v1.JobService/GetJob',
          headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body), authorization: `Bearer ${key}` },
        },
        (res) => {
          res.resume();
          res.on('end', () => (res.statusCode === 200 ? resolve() : reject(new Error(`GetJob answered ${res.statusCode}`))));
        },
      );
      req.on('error', reject);
      req.end(body);
    });
  return { call, close: () => agent.destroy() };
}

/** Runs `fn` `n` times in sequence and measures it. */
async function measure(mode: string, pm: number | undefined, n: number, fn: () => Promise<unknown>): Promise<Sample> {
  const lat: number[] = [];
  const pg0 = pm && postgresCpu(pm);
  const cpu0 = process.cpuUsage();
  for (let i = 0; i < n; i++) {
    const t = performance.now();
    await fn();
    lat.push(performance.now() - t);
  }
  const cpu = process.cpuUsage(cpu0);
  const pg1 = pm && postgresCpu(pm);
  lat.sort((a, b) => a - b);
  return {
    mode,
    cpuMsPerCall: (cpu.user + cpu.system) / 1000 / n,
    pgCpuMsPerCall: pg0 !== undefined && pg1 !== undefined ? ((pg1 - pg0) * 1000) / n : NaN,
    meanMs: lat.reduce((a, b) => a + b, 0) / n,
    p99Ms: lat[Math.floor(n * 0.99)]!,
  };
}

try {
  // 1. restart
  for (let rep = 0; rep < opts.reps; rep++) {
    for (const mode of opts.modes.split(',')) {
      const c = await coordinator(mode);
      const client = getJobClient(c);
      try {
        const pm = await postmasterPid(c.db.pool);
        for (let i = 0; i < 300; i++) await client.call(); // warm-up: JIT, prepared statements, the cache
        views.restart.push(await measure(mode, pm, opts.calls, client.call));
        // 3. the lookup alone, as the interceptor does it
        views.lookup.push(await measure(mode, pm, opts.calls, () => authenticate(c.db.pool, key!, c.credentials)));
        console.log(JSON.stringify({ restart: views.restart.at(-1), lookup: views.lookup.at(-1) }));
      } finally {
        client.close();
        await c.stop();
      }
    }
  }
  // 2. paired
  const c = await coordinator('60s');
  const client = getJobClient(c);
  try {
    const pm = await postmasterPid(c.db.pool);
    for (let i = 0; i < 600; i++) await client.call();
    const n = Math.max(10, Math.round(opts.calls / 10));
    for (let b = 0; b < opts.blocks * 2; b++) {
      const cached = b % 2 === 0;
      c.credentials.setOnline(cached);
      if (cached) await client.call(); // the miss that fills the cache again, outside the block
      views.paired.push(await measure(cached ? 'served' : 'bypassed', pm, n, client.call));
    }
    c.credentials.setOnline(true);
  } finally {
    client.close();
    await c.stop();
  }
} finally {
  await db.stop();
  await rm(dataDir, { recursive: true, force: true });
}

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
function table(title: string, samples: Sample[]) {
  console.log(`\n${title}\n`);
  console.log('| cache | Node CPU ms/call (client + coordinator) | PostgreSQL CPU ms/call | mean latency ms | p99 ms |');
  console.log('|---|---|---|---|---|');
  for (const mode of [...new Set(samples.map((s) => s.mode))]) {
    const s = samples.filter((x) => x.mode === mode);
    const f = (k: keyof Omit<Sample, 'mode'>) => median(s.map((x) => x[k])).toFixed(3);
    console.log(`| ${mode} | ${f('cpuMsPerCall')} | ${f('pgCpuMsPerCall')} | ${f('meanMs')} | ${f('p99Ms')} |`);
  }
}
table(`restart: ${opts.calls} sequential GetJob calls per coordinator, median of ${opts.reps} (cache = LEASEHOLD_AUTH_CACHE_TTL)`, views.restart);
table(`paired: one coordinator, ${opts.blocks} blocks of ${Math.round(opts.calls / 10)} GetJob calls per side, alternating, median`, views.paired);
table(`authenticate() alone, ${opts.calls} sequential calls, median of ${opts.reps}`, views.lookup);
