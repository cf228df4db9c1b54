/**
 * The coordinator behind the reverse proxies deploy/ ships: Caddy (deploy/Caddyfile) and nginx
 * (deploy/nginx.conf), each a real process run from the shipped file (test/helpers/proxies.ts says
 * what a test changes in it: ports, paths, a certificate). Everything goes through the proxy over
 * HTTPS: an SDK agent's gRPC stream (HTTP/2), the packed `leasehold-agent` runner's, and the
 * gateway's Connect JSON (HTTP/1.1, as n8n sends it). Shown for each proxy: jobs enqueued through
 * the gateway run on the agent and on the runner; after the proxy process restarts both come back
 * by themselves, a job running across the restart is
 * finished once, and no job is lost or run twice; a body over the gateway's 1 MiB gets the
 * gateway's JSON 413, not the proxy's page.
 *
 * Skipped when caddy or nginx is not installed, unless LEASEHOLD_REQUIRE_PROXIES=1 (CI), which
 * fails instead.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import http from 'node:http';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pino from 'pino';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { createAgent, type Agent } from '@leasehold/agent-client';
import { keyCreate } from '../server/store/index.js';
import { HTTP_READ_MAX_BYTES } from '../server/transport/http.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, until, useCoordinator, waitFor } from './helpers/coordinator.js';
import { installAgent, packAgent } from './helpers/agent-package.js';
import { checkInvariants } from './helpers/invariants.js';
import { missing, request, startCaddy, startNginx, type RunningProxy, type Upstreams } from './helpers/proxies.js';
import { deferred } from './helpers/deferred.js';

const t = useTestDb();
// Leases longer than a proxy restart takes: an attempt running across the restart must resume on
// the reconnected stream, not expire and run again.
// LEASEHOLD_TRUST_PROXY=1, as docs/deploy.md sets it behind either proxy: callers' addresses from X-Forwarded-For.
const lh = useCoordinator(t, { LEASEHOLD_LEASE_TTL: '10s', LEASEHOLD_CLAIM_TTL: '10s', LEASEHOLD_HEARTBEAT_INTERVAL: '1s', LEASEHOLD_TRUST_PROXY: '1' });
const required = process.env.LEASEHOLD_REQUIRE_PROXIES === '1';
const log = pino({ level: process.env.LEASEHOLD_TEST_LOG ?? 'silent' });

interface JobView {
  id: string;
  status: string;
  attemptNo: number;
  result: unknown;
}

type Gate = ReturnType<typeof deferred<void>>;

/**
 * The packed runner, as a PC gets it: `npm pack` in agent-client/, installed from the tarball
 * into an empty folder (test/agent-package.test.ts checks that install itself). Made once, for
 * both proxies; nothing when neither is installed.
 */
let packed: { dir: string; bin: string } | undefined;
beforeAll(async () => {
  if (missing('caddy') && missing('nginx')) return;
  const dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-proxies-runner-'));
  const { tgz } = await packAgent(dir);
  await installAgent(path.join(dir, 'app'), tgz);
  // A job's command: the payload on stdin, the result on stdout.
  await writeFile(path.join(dir, 'add.mjs'), "let s = '';\nprocess.stdin.on('data', (d) => (s += d)).on('end', () => { const p = JSON.parse(s); console.log(JSON.stringify({ sum: p.a + p.b })); });\n");
  packed = { dir, bin: path.join(dir, 'app/node_modules/@leasehold/agent-client/bin/leasehold-agent.mjs') };
}, 300_000);
afterAll(async () => {
  if (packed) await rm(packed.dir, { recursive: true, force: true });
});

const PROXIES: { name: 'caddy' | 'nginx'; file: string; start: (up: Upstreams) => Promise<RunningProxy> }[] = [
  { name: 'caddy', file: 'deploy/Caddyfile', start: startCaddy },
  { name: 'nginx', file: 'deploy/nginx.conf', start: startNginx },
];

describe.each(PROXIES)('behind $name ($file)', ({ name, start }) => {
  const absent = missing(name);
  const queue = `via-${name}`;
  let proxy: RunningProxy | undefined;
  let agent: Agent | undefined;
  let outboxDir: string | undefined;
  /** The packed `leasehold-agent` runner, streaming through the proxy too, and what it printed. */
  let runner: ChildProcess | undefined;
  let runnerOut = '';
  const runnerQueue = `runner-via-${name}`;
  /** Handler invocations per job id: each must end at exactly 1. */
  const runs = new Map<string, number>();
  /** Jobs whose handler waits until the test lets it go. */
  const held = new Map<string, Gate>();

  const px = () => {
    if (!proxy) throw new Error(`${name} did not start`);
    return proxy;
  };
  const rpc = async (method: string, body: unknown) => {
    const r = await request(px(), 'POST', `/leasehold.v1.JobService/${method}`, {
      body: JSON.stringify(body),
      headers: { 'content-type': 'application/json', authorization: `Bearer ${ADMIN_KEY}` },
    });
    if (r.status !== 200) throw new Error(`${method} through ${name}: ${r.status} ${r.body.slice(0, 500)}`);
    return JSON.parse(r.body) as { job: JobView };
  };
  const enqueue = async (payload: Record<string, unknown>) => (await rpc('EnqueueJob', { queue, payload })).job.id;
  const getJob = async (id: string) => (await rpc('GetJob', { jobId: id })).job;
  const allSucceeded = (ids: string[]) =>
    until(lh, `${ids.length} jobs to succeed through ${name}`, async () => {
      const jobs = await Promise.all(ids.map(getJob));
      return jobs.every((j) => j.status === 'JOB_STATUS_SUCCEEDED') && jobs;
    }, 15_000);

  beforeAll(async () => {
    if (absent) return;
    proxy = await start({ grpcPort: lh.port, httpPort: lh.c.http.address.port });
    outboxDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-outbox-'));
    agent = createAgent({
      // Through the proxy only, with its CA: the name on the certificate is localhost.
      url: `https://localhost:${proxy.port}`,
      tls: { ca: proxy.caFile },
      token: await lh.agent(`agent-${name}`),
      queues: [queue],
      slots: 2,
      outboxDir,
      handleSignals: false,
      log,
      // Retry quickly while the proxy is down, so the restart test does not wait on backoff.
      reconnect: { baseMs: 50, maxMs: 500 },
    });
    agent.handle(queue, async (job) => {
      runs.set(job.id, (runs.get(job.id) ?? 0) + 1);
      await held.get(job.id)?.promise;
      const pad = typeof job.payload.pad === 'number' ? { pad: 'y'.repeat(job.payload.pad) } : {};
      return { echo: job.payload, attempt: job.attemptNo, ...pad };
    });
    // start() resolves on the coordinator's Welcome and retries until then: bounded here, so a
    // proxy that does not pass the stream fails this file in seconds rather than at the hook timeout.
    let timer: NodeJS.Timeout | undefined;
    const late = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`no Welcome through ${name} within 15 s:\n${proxy?.log().slice(-4000)}`)), 15_000);
    });
    await Promise.race([agent.start(), late]).finally(() => clearTimeout(timer));

    const p = packed!;
    const config = path.join(outboxDir, `runner-${name}.json`);
    await writeFile(
      config,
      JSON.stringify({
        url: `https://localhost:${proxy.port}`,
        tls: { ca: proxy.caFile },
        token: await lh.agent(`runner-${name}`),
        slots: 1,
        outboxDir: path.join(outboxDir, 'runner-outbox'),
        grace: '5s',
        queues: { [runnerQueue]: { command: [process.execPath, path.join(p.dir, 'add.mjs')], timeout: '1m' } },
      }),
    );
    runner = spawn(process.execPath, [p.bin, '--config', config], { cwd: path.join(p.dir, 'app'), stdio: ['ignore', 'pipe', 'pipe'] });
    runner.stdout!.on('data', (d: Buffer) => (runnerOut += d));
    runner.stderr!.on('data', (d: Buffer) => (runnerOut += d));
  }, 60_000);

  afterAll(async () => {
    if (runner && runner.exitCode === null) {
      const exited = once(runner, 'exit');
      runner.kill('SIGINT'); // drains, then exits
      const timer = setTimeout(() => runner?.kill('SIGKILL'), 10_000);
      await exited;
      clearTimeout(timer);
    }
    for (const h of held.values()) h.resolve();
    await agent?.stop();
    await proxy?.dispose();
    if (outboxDir) await rm(outboxDir, { recursive: true, force: true });
  });

  beforeEach((ctx) => {
    if (absent) {
      if (required) throw new Error(`${absent}, and LEASEHOLD_REQUIRE_PROXIES=1 (apt-get install caddy nginx)`);
      ctx.skip(absent);
    }
    // The proxy's own log says why a request failed.
    ctx.onTestFailed(() => console.error(`--- ${name} log (tail) ---\n${proxy?.log().slice(-6000)}\n--- leasehold-agent (tail) ---\n${runnerOut.slice(-4000)}`));
  });

  /** Jobs for the packed runner, enqueued through the gateway; resolves with their results once all succeeded. */
  const runnerJobs = async (pairs: Array<[number, number]>) => {
    const ids: string[] = [];
    for (const [a, b] of pairs) ids.push((await rpc('EnqueueJob', { queue: runnerQueue, payload: { a, b } })).job.id);
    const jobs = await until(lh, `${ids.length} runner jobs to succeed through ${name}`, async () => {
      const js = await Promise.all(ids.map(getJob));
      return js.every((j) => j.status === 'JOB_STATUS_SUCCEEDED') && js;
    }, 30_000);
    return jobs.map((j) => j.result);
  };

  it('serves /healthz, and jobs enqueued through the gateway run on an SDK agent and on the packed leasehold-agent, both streaming through it', async () => {
    const health = await request(px(), 'GET', '/healthz');
    expect(health.status).toBe(200);
    expect(JSON.parse(health.body)).toEqual({ status: 'ok' });

    const ids = await Promise.all([1, 2, 3, 4, 5].map((n) => enqueue({ n })));
    const jobs = await allSucceeded(ids);
    expect(jobs.map((j) => j.result)).toEqual([1, 2, 3, 4, 5].map((n) => ({ echo: { n }, attempt: 1 })));
    for (const id of ids) expect(runs.get(id), `runs of ${id}`).toBe(1);

    // Results of 200 KB each: 1.2 MB up one stream, more than the gateway's 1 MiB per request,
    // which is no limit for a stream.
    const padded = await Promise.all([1, 2, 3, 4, 5, 6].map((n) => enqueue({ n, pad: 200_000 })));
    const big = await allSucceeded(padded);
    expect(big.map((j) => (j.result as { pad: string }).pad.length)).toEqual(padded.map(() => 200_000));
    for (const id of padded) expect(runs.get(id), `runs of ${id}`).toBe(1);

    // The packed leasehold-agent runner, its own stream through the same proxy, runs its commands.
    expect(await runnerJobs([[2, 40], [1, 1]])).toEqual([{ sum: 42 }, { sum: 2 }]);
  });

  it("counts refused keys per client behind it (X-Forwarded-For): a guesser does not hold back another client's new key", async () => {
    const fresh = await keyCreate(t.pool, { name: `behind-${name}`, scopes: ['read'] });
    if (fresh.outcome !== 'ok') throw new Error(fresh.outcome);
    const list = (key: string, from: string) =>
      request(px(), 'POST', '/leasehold.v1.JobService/ListJobs', { body: '{}', headers: { 'content-type': 'application/json', authorization: `Bearer ${key}` }, localAddress: from });
    // A guesser at 127.0.0.2, past its 30 refused keys.
    const guesses = await Promise.all(Array.from({ length: 45 }, (_, i) => list(`lh_key_guess-${name}-${i}`, '127.0.0.2')));
    expect(guesses.filter((a) => a.status === 429).length).toBeGreaterThan(0);
    // n8n at 127.0.0.3, with a key the coordinator has not seen yet (as after a restart): served.
    const served = await list(fresh.value.key, '127.0.0.3');
    expect(served.status, served.body).toBe(200);
  });

  it('after a restart of the proxy process the agent and the runner reconnect by themselves: nothing lost, nothing run twice', async () => {
    const a = agent!;
    // A job running across the restart: its handler waits until the proxy is down.
    const gate = deferred();
    const before = await enqueue({ phase: 'before' });
    held.set(before, gate);
    await until(lh, 'the held job to be running', async () => (await getJob(before)).status === 'JOB_STATUS_RUNNING');

    const disconnected = once(a, 'disconnected');
    // Ended by SIGTERM within systemd's 5 s, agent stream open or not: no SIGKILL needed.
    expect(await px().stop(5_000)).toBe('exited');
    await disconnected;
    gate.resolve(); // the result waits in the outbox
    await waitFor('the handler to finish', () => a.runningAttempts.length === 0);

    const reconnected = once(a, 'connected');
    await px().start();
    await reconnected;

    const after = await Promise.all([1, 2, 3, 4, 5].map((n) => enqueue({ phase: 'after', n })));
    const jobs = await allSucceeded([before, ...after]);
    // The held job finished on its first attempt (resumed after the reconnect, not reclaimed).
    expect(jobs.map((j) => j.attemptNo)).toEqual([1, 1, 1, 1, 1, 1]);
    expect(jobs[0]!.result).toEqual({ echo: { phase: 'before' }, attempt: 1 });
    // Every job this agent ever saw, the first test's included, ran exactly once.
    expect([...runs.values()].every((n) => n === 1), JSON.stringify([...runs])).toBe(true);
    const { rows } = await t.pool.query<{ id: string }>(`SELECT id FROM jobs WHERE queue = $1 AND status <> 'succeeded'`, [queue]);
    expect(rows).toEqual([]);
    expect(runs.size).toBe((await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE queue = $1`, [queue])).rows[0].n);
    // The runner came back by itself too (its own backoff) and runs what was enqueued after.
    expect(await runnerJobs([[20, 22]])).toEqual([{ sum: 42 }]);
    expect(runner!.exitCode, runnerOut.slice(-2000)).toBeNull();
    await checkInvariants(t.pool);
  });

  it.each([
    { how: 'with a Content-Length', chunked: false },
    { how: 'chunked', chunked: true },
  ])('answers a body of 2 MiB sent $how with the gateway\'s JSON 413', async ({ chunked }) => {
    const big = JSON.stringify({ queue: `${queue}-big`, payload: { blob: 'x'.repeat(2 * HTTP_READ_MAX_BYTES) } });
    const r = await request(px(), 'POST', '/leasehold.v1.JobService/EnqueueJob', {
      body: big,
      chunked,
      headers: { 'content-type': 'application/json', authorization: `Bearer ${ADMIN_KEY}` },
    });
    // A proxy streams the body on while the gateway answers, and takes a failed write for a dead
    // upstream: a 502 with "broken pipe" in its log means the gateway closed the connection on
    // an unread body (a reset, under its own 413) instead of reading the rest and dropping it.
    expect(r.status, r.body.slice(0, 300)).toBe(413);
    expect(r.headers['content-type']).toMatch(/^application\/json/);
    expect(JSON.parse(r.body)).toMatchObject({ status: 413, outcome: 'too_large', limitBytes: HTTP_READ_MAX_BYTES });
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE queue = $1`, [`${queue}-big`])).rows[0].n).toBe(0);
    // The proxy serves on afterwards.
    expect((await request(px(), 'GET', '/healthz')).status).toBe(200);
  });

  it.runIf(name === 'caddy')('keeps its admin API off TCP, where a webhook to a loopback URL could POST /stop: on a socket, through which `caddy reload` works', async () => {
    // (The helper refuses a shipped file without the socket line; this shows Caddy took it.) Last:
    // the reload drops the streams through Caddy, which the tests before count on.
    const admin = px().admin!;
    const config = await new Promise<{ status: number; body: string }>((resolve, reject) => {
      // An empty Host, as caddy's own commands send over the socket (Node writes localhost unless told not to).
      const req = http.request({ socketPath: admin.socket, path: '/config/admin', setHost: false, headers: { host: '' } }, (res) => {
        let body = '';
        res.on('data', (d: Buffer) => (body += d));
        res.on('end', () => resolve({ status: res.statusCode ?? 0, body }));
      });
      req.on('error', reject);
      req.end();
    });
    expect(config.status, config.body).toBe(200);
    expect(JSON.parse(config.body)).toEqual({ listen: `unix/${admin.socket}` });
    const reloaded = await admin.reload();
    expect(reloaded.code, reloaded.output).toBe(0);
    expect((await request(px(), 'GET', '/healthz')).status).toBe(200);
  });
});
