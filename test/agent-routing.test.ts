/**
 * Routing and leases at the level of the coordinator process: jobs go only to agents carrying
 * the labels they require; many agents' heartbeats are renewed by one UPDATE per tick; the
 * gRPC listener serves TLS when given a certificate; and `leasehold agents add` makes a token
 * that opens a stream (and `agents revoke` ends it).
 */
import { execFile } from 'node:child_process';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import pino from 'pino';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { AgentHub } from '../server/core/agent-hub.js';
import { jobEnqueue } from '../server/store/index.js';
import { listenGrpc } from '../server/transport/server.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, until, useCoordinator } from './helpers/coordinator.js';
import { grpc, rawClient, RawAgent, unary } from './helpers/raw-agent.js';

const run = promisify(execFile);
const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_LEASE_TTL: '5s', LEASEHOLD_HEARTBEAT_INTERVAL: '1s' });
const open: RawAgent[] = [];
const agent = (...args: Parameters<typeof RawAgent.open>) => {
  const a = RawAgent.open(...args);
  open.push(a);
  return a;
};
afterEach(() => {
  for (const a of open.splice(0)) a.close();
});

describe('routing', () => {
  it('gives a job that requires labels only to an agent that carries them', async () => {
    const [tl, tw] = [await lh.agent('linux-box'), await lh.agent('windows-box')];
    const linux = agent(`127.0.0.1:${lh.port}`, { agentId: 'linux-box', token: tl, queues: ['render'], slots: 5, labels: { os: 'linux' } });
    const windows = agent(`127.0.0.1:${lh.port}`, { agentId: 'windows-box', token: tw, queues: ['render'], slots: 5, labels: { os: 'windows', gpu: 'yes' } });
    await linux.next('welcome');
    await windows.next('welcome');
    const o = await jobEnqueue(t.pool, { queue: 'render', payload: {}, labels: { os: 'windows' } });
    if (o.outcome !== 'ok') throw new Error('enqueue');
    const got = (await windows.next('assign')).assign.jobs[0];
    expect(got.job.id).toBe(o.value.id);
    expect(got.job.labels).toEqual({ os: 'windows' });
    await lh.c.dispatcher.runOnce();
    expect(linux.all('assign')).toEqual([]);
  });

  it('renews the leases of many agents with one UPDATE per tick', async () => {
    const n = 6;
    const agents: RawAgent[] = [];
    for (let i = 0; i < n; i++) {
      const token = await lh.agent(`hb${i}`);
      const a = agent(`127.0.0.1:${lh.port}`, { agentId: `hb${i}`, token, queues: [`hb${i}`], slots: 1 });
      await a.next('welcome');
      await jobEnqueue(t.pool, { queue: `hb${i}`, payload: {} });
      const c = (await a.next('assign')).assign.jobs[0];
      a.send({ started: { attemptIds: [c.attemptId] } });
      agents.push(a);
    }
    await until(lh, 'all running', async () => (await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE status = 'running' AND queue LIKE 'hb%'`)).rows[0].n === n);
    const ticks: Array<{ renewed: number }> = [];
    const onTick = (x: { renewed: number }) => ticks.push(x);
    lh.c.hub.on('lease:tick', onTick);
    try {
      // Each agent heartbeats once; the hub flushes them together on its next tick.
      for (const a of agents) a.send({ heartbeat: { progress: [] } });
      await until(lh, 'a tick with every lease', () => ticks.some((x) => x.renewed === n), 5000);
    } finally {
      lh.c.hub.off('lease:tick', onTick);
    }
  });
});

describe('agent tokens from the command line', () => {
  it('`leasehold agents add NAME --json` prints a token that opens a stream; `revoke` closes the door', async () => {
    const env = { ...process.env, LEASEHOLD_URL: lh.httpUrl, LEASEHOLD_KEY: ADMIN_KEY, LEASEHOLD_LOG_LEVEL: 'warn', LEASEHOLD_LOG_FORMAT: 'json' };
    const root = path.resolve(import.meta.dirname, '..');
    const add = await run(process.execPath, ['--import', 'tsx', 'server/cli.ts', 'agents', 'add', 'cli-made', '--json'], { cwd: root, env });
    const { agentId, token } = JSON.parse(add.stdout) as { agentId: string; token: string };
    expect(agentId).toBe('cli-made');
    const a = agent(`127.0.0.1:${lh.port}`, { agentId, token, queues: ['cli'], slots: 1 });
    await a.next('welcome');
    const stored = (await t.pool.query(`SELECT token_hash FROM agents WHERE id = 'cli-made'`)).rows[0].token_hash;
    expect(stored).toMatch(/^[0-9a-f]{64}$/);
    expect(stored).not.toContain(token);

    await run(process.execPath, ['--import', 'tsx', 'server/cli.ts', 'agents', 'revoke', 'cli-made'], { cwd: root, env });
    // The revoke ended the open stream too.
    expect((await a.ended).code).toBe(grpc.status.UNAUTHENTICATED);
    const b = agent(`127.0.0.1:${lh.port}`, { agentId, token, queues: ['cli'], slots: 1 });
    expect((await b.ended).code).toBe(grpc.status.UNAUTHENTICATED);
    const dup = await run(process.execPath, ['--import', 'tsx', 'server/cli.ts', 'agents', 'add', 'cli-made'], { cwd: root, env }).catch((e: { code: number; stderr: string }) => e);
    expect((dup as { code: number }).code).toBe(1);
    expect((dup as { stderr: string }).stderr).toMatch(/already exists/);
  });

  it('`leasehold agents add NAME --quiet` prints the token alone, for scripts', async () => {
    const env = { ...process.env, LEASEHOLD_URL: lh.httpUrl, LEASEHOLD_KEY: ADMIN_KEY, LEASEHOLD_LOG_LEVEL: 'warn', LEASEHOLD_LOG_FORMAT: 'json' };
    const root = path.resolve(import.meta.dirname, '..');
    const add = await run(process.execPath, ['--import', 'tsx', 'server/cli.ts', 'agents', 'add', 'cli-quiet', '--quiet'], { cwd: root, env });
    expect(add.stdout).toMatch(/^\S+\n$/);
    const a = agent(`127.0.0.1:${lh.port}`, { agentId: 'cli-quiet', token: add.stdout.trim(), queues: ['cli'], slots: 1 });
    await a.next('welcome');
    a.close();
  });
});

describe('TLS', () => {
  const dir = mkdtemp(path.join(os.tmpdir(), 'leasehold-tls-'));
  afterAll(async () => rm(await dir, { recursive: true, force: true }));

  it('serves gRPC over TLS when a certificate and key are configured', async () => {
    const d = await dir;
    const [cert, key] = [path.join(d, 'cert.pem'), path.join(d, 'key.pem')];
    await run('openssl', ['req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-keyout', key, '-out', cert, '-days', '1', '-subj', '/CN=localhost', '-addext', 'subjectAltName=DNS:localhost,IP:127.0.0.1']);
    const log = pino({ level: 'silent' });
    const hub = new AgentHub(t.pool, log, { leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 });
    const server = await listenGrpc(
      { db: t.pool, hub, log, leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 },
      '127.0.0.1:0',
      { certFile: cert, keyFile: key },
    );
    try {
      const creds = grpc.credentials.createSsl(await readFile(cert));
      const client = rawClient('JobService', `localhost:${server.address.port}`, creds);
      try {
        const res = await unary(client, 'listJobs', { pageSize: 1 }, ADMIN_KEY);
        expect(Array.isArray(res.jobs)).toBe(true);
      } finally {
        client.close();
      }
      // Cleartext is refused on the TLS port.
      const plain = rawClient('JobService', `127.0.0.1:${server.address.port}`);
      const err = await unary(plain, 'listJobs', {}, ADMIN_KEY).catch((e: grpc.ServiceError) => e);
      plain.close();
      expect((err as grpc.ServiceError).code).toBe(grpc.status.UNAVAILABLE);
    } finally {
      await server.close();
    }
  });
});
