/**
 * What one EnqueueJob over the HTTP gateway costs the coordinator's process, by the direct path
 * (server/transport/gateway-enqueue.ts) and through Connect's handler: two listeners in this one
 * process on one embedded PostgreSQL 17, a keep-alive client sending one enqueue at a time (as
 * n8n does), the two taking turns in rounds so that the machine's drift falls on both alike.
 * Reports, medians over rounds: this process's CPU per enqueue (the listener, the store's
 * client side and the HTTP client, which is the same for both) and the latency of one call.
 * No agent is connected: every job stays queued.
 *
 *   node --import tsx test/bench/gateway-enqueue.ts [--calls 1000] [--rounds 8]
 */
import http from 'node:http';
import { mkdtemp } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Command } from 'commander';
import pino from 'pino';
import { AgentHub } from '../../server/core/agent-hub.js';
import { startEmbedded } from '../../server/store/embedded.js';
import { createPool, keyCreate, migrateDatabase } from '../../server/store/index.js';
import { ENQUEUE_PATH } from '../../server/transport/gateway-enqueue.js';
import { listenHttp, type HttpServer } from '../../server/transport/http.js';

const o = new Command()
  .option('--calls <n>', 'enqueues per round and path', (v) => Number(v), 1000)
  .option('--rounds <n>', 'rounds (each path once per round)', (v) => Number(v), 8)
  .parse()
  .opts<{ calls: number; rounds: number }>();

const log = pino({ level: 'warn' });
const embedded = await startEmbedded({ dataDir: await mkdtemp(path.join(os.tmpdir(), 'leasehold-gatewaybench-')), log, ephemeral: true });
const pool = createPool(embedded.url, 8, log);
await migrateDatabase(pool);
const made = await keyCreate(pool, { name: 'bench', scopes: ['enqueue'] });
if (made.outcome !== 'ok') throw new Error(JSON.stringify(made));
const token = made.value.key;
const hub = new AgentHub(pool, log, { leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 });
const deps = { db: pool, hub, log, leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 };
const servers: Record<'direct' | 'connect', HttpServer> = {
  direct: await listenHttp(deps, '127.0.0.1:0'),
  connect: await listenHttp({ ...deps, directEnqueue: false }, '127.0.0.1:0'),
};
const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });

function enqueue(server: HttpServer, n: number): Promise<void> {
  const body = JSON.stringify({ queue: 'bench', payload: { n, source: 'n8n', items: [1, 2, 3] } });
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: '127.0.0.1', port: server.address.port, path: ENQUEUE_PATH, method: 'POST', agent, headers: { 'content-type': 'application/json', authorization: `Bearer ${token}`, 'content-length': Buffer.byteLength(body) } },
      (res) => {
        const chunks: Buffer[] = [];
        res.on('data', (c: Buffer) => chunks.push(c));
        res.on('end', () => (res.statusCode === 200 ? resolve() : reject(new Error(`${res.statusCode}: ${Buffer.concat(chunks).toString()}`))));
      },
    );
    req.on('error', reject);
    req.end(body);
  });
}

async function round(path: keyof typeof servers) {
  const latencies: number[] = [];
  const cpu = process.cpuUsage();
  for (let i = 0; i < o.calls; i++) {
    const t = performance.now();
    await enqueue(servers[path], i);
    latencies.push(performance.now() - t);
  }
  const used = process.cpuUsage(cpu);
  return { cpuUs: (used.user + used.system) / o.calls, p50: median(latencies) };
}

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
const results = { direct: [] as Array<{ cpuUs: number; p50: number }>, connect: [] as Array<{ cpuUs: number; p50: number }> };
await round('direct'); // warm-up, discarded
await round('connect');
for (let r = 0; r < o.rounds; r++) {
  for (const p of (r % 2 ? ['connect', 'direct'] : ['direct', 'connect']) as Array<keyof typeof servers>) {
    const x = await round(p);
    results[p].push(x);
    console.error(`round ${r + 1} ${p}: ${x.cpuUs.toFixed(0)} µs CPU per enqueue, p50 ${x.p50.toFixed(2)} ms`);
  }
}
const cpu = { direct: median(results.direct.map((x) => x.cpuUs)), connect: median(results.connect.map((x) => x.cpuUs)) };
const p50 = { direct: median(results.direct.map((x) => x.p50)), connect: median(results.connect.map((x) => x.p50)) };
console.log(`| path | CPU µs per enqueue (this process) | p50 ms |\n|---|---:|---:|`);
for (const p of ['connect', 'direct'] as const) console.log(`| ${p} | ${cpu[p].toFixed(0)} | ${p50[p].toFixed(2)} |`);
console.log(`\ndirect / connect: CPU ${(cpu.direct / cpu.connect).toFixed(2)}, p50 ${(p50.direct / p50.connect).toFixed(2)} (medians of ${o.rounds} rounds of ${o.calls})`);

agent.destroy();
await servers.direct.close();
await servers.connect.close();
await pool.end();
await embedded.stop();
