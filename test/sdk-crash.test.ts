/**
 * The SDK against SIGKILL, with real agent processes (test/fixtures/sdk-agent.ts) and a real
 * coordinator: a result left in the outbox by a killed agent is replayed and refused as stale
 * once the job was redone; 50 kills at random moments between a handler returning and its ack
 * lose and duplicate nothing; and steps against a downstream sink are applied exactly once
 * across kills, including a step left unknown on purpose.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pino from 'pino';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { createAgent, readOutbox, type Agent } from '@leasehold/agent-client';
import { jobEnqueue } from '../server/store/index.js';
import { agentBundle, spawnAgent, type AgentProcess } from './helpers/agent-process.js';
import { useTestDb } from './helpers/db.js';
import { until, useCoordinator, waitFor } from './helpers/coordinator.js';
import { checkInvariants } from './helpers/invariants.js';
import { startSink } from './helpers/sink.js';
import { startProxy, type TcpProxy } from './helpers/tcp-proxy.js';

const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_LEASE_TTL: '1500ms', LEASEHOLD_CLAIM_TTL: '1500ms', LEASEHOLD_HEARTBEAT_INTERVAL: '300ms' });
const procs: AgentProcess[] = [];
const proxies: TcpProxy[] = [];
const inproc: Agent[] = [];
const dirs: string[] = [];

async function outboxDir() {
  const d = await mkdtemp(path.join(os.tmpdir(), 'leasehold-crash-'));
  dirs.push(d);
  return d;
}
let bundlePath: string;
beforeAll(async () => {
  bundlePath = await agentBundle();
});
function agentProcess(env: Record<string, string>): AgentProcess {
  const p = spawnAgent(bundlePath, env);
  procs.push(p);
  return p;
}
async function enqueue(queue: string, payload: Record<string, unknown>, extra: Record<string, unknown> = {}) {
  const o = await jobEnqueue(t.pool, { queue, payload, maxAttempts: 20, ...extra });
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  return o.value;
}

afterEach(async () => {
  for (const p of procs.splice(0)) await p.kill();
  for (const a of inproc.splice(0)) await a.stop();
  for (const p of proxies.splice(0)) await p.close();
});
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
  if (bundlePath) await rm(bundlePath, { force: true });
});

describe('an agent killed with SIGKILL', () => {
  it('replays its old result after a restart, which is refused as stale on both sides and changes nothing', async () => {
    const token = await lh.agent('victim');
    const outbox = await outboxDir();
    const proxy = await startProxy(lh.port);
    proxies.push(proxy);
    const env = { LH_TOKEN: token, LH_OUTBOX: outbox, LH_QUEUE: 'crash1', LH_MODE: 'echo' };
    const a = agentProcess({ ...env, LH_URL: `http://127.0.0.1:${proxy.port}` });
    await a.waitFor((l) => l.event === 'connected');
    const job = await enqueue('crash1', { n: 5, workMs: 300 });
    const assigned = await a.waitFor((l) => l.event === 'job.assigned');
    const attemptId = String(assigned.attemptId);
    await a.waitFor((l) => l.event === 'handler.started' && l.attemptId === attemptId);
    // The network goes silent: the result reaches the outbox but never the coordinator.
    proxy.blackhole();
    await waitFor('result in the outbox', async () => (await readOutbox(outbox)).pending.some((e) => e.attemptId === attemptId));
    await a.kill();

    // The lease passes; another agent redoes the job as attempt 2.
    const other = createAgent({ url: lh.url, token: await lh.agent('rescuer'), queues: ['crash1'], outboxDir: await outboxDir(), handleSignals: false, log: pino({ level: 'silent' }) });
    inproc.push(other);
    other.handle('crash1', (j) => ({ n: j.payload.n, doubled: 10, by: 'rescuer' }));
    await other.start();
    await until(lh, 'redone', async () => (await t.pool.query(`SELECT status::text FROM jobs WHERE id = $1`, [job.id])).rows[0].status === 'succeeded', 15_000);

    // The first agent comes back with the same outbox and replays its result.
    const again = agentProcess({ ...env, LH_URL: lh.url });
    const refused = await again.waitFor((l) => l.setAside === 'superseded');
    expect(refused.attemptId).toBe(attemptId);
    const left = await readOutbox(outbox);
    expect(left.superseded).toEqual([expect.objectContaining({ attemptId, reason: 'STALE' })]);
    expect(left.pending).toEqual([]);

    const row = (await t.pool.query(`SELECT status::text, attempt_no, result FROM jobs WHERE id = $1`, [job.id])).rows[0];
    expect(row).toEqual({ status: 'succeeded', attempt_no: 2, result: { n: 5, doubled: 10, by: 'rescuer' } });
    const reports = (await t.pool.query(`SELECT attempt_id, current_attempt_no, call FROM stale_reports WHERE job_id = $1`, [job.id])).rows;
    expect(reports).toContainEqual({ attempt_id: attemptId, current_attempt_no: 2, call: 'complete' });
    await checkInvariants(t.pool);
  });

  it('loses and duplicates nothing across 50 kills between a handler returning and its ack', async () => {
    const RUNS = 50;
    const token = await lh.agent('crashy');
    const outbox = await outboxDir();
    const env = { LH_URL: lh.url, LH_TOKEN: token, LH_OUTBOX: outbox, LH_QUEUE: 'crash50', LH_MODE: 'echo', LH_SLOTS: '2' };
    const jobs: string[] = [];
    // Where each kill landed, read afterwards from the outbox and the database.
    const moments = { beforeWrite: 0, writtenNotAcked: 0, acked: 0 };
    let a = agentProcess(env);
    for (let i = 0; i < RUNS; i++) {
      jobs.push((await enqueue('crash50', { n: i })).id);
      // Wait for a handler of this process to return, then kill it a random moment later. Every
      // tenth run waits for its result to be on disk instead ('handler.finished', logged after the
      // outbox write and before the report is sent) and kills it at once: on a machine whose
      // fsync takes longer than the random 15 ms, random moments alone could all land before it.
      const onDisk = i % 10 === 9;
      const returned = await a.waitFor((l) => l.event === (onDisk ? 'handler.finished' : 'handler.returned'), 30_000);
      if (!onDisk) await new Promise((r) => setTimeout(r, Math.random() * 15));
      await a.kill();
      const attemptId = String(returned.attemptId);
      if ((await readOutbox(outbox)).pending.some((e) => e.attemptId === attemptId)) moments.writtenNotAcked++;
      else if ((await t.pool.query(`SELECT 1 FROM attempt_log WHERE id = $1 AND status = 'succeeded'`, [attemptId])).rowCount) moments.acked++;
      else moments.beforeWrite++;
      a = agentProcess(env);
    }
    await until(
      lh,
      'every job done',
      async () => (await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE queue = 'crash50' AND status = 'succeeded'`)).rows[0].n === RUNS,
      120_000,
    );
    const rows = (await t.pool.query(`SELECT id, result FROM jobs WHERE queue = 'crash50'`)).rows;
    for (const r of rows) expect(r.result).toMatchObject({ doubled: r.result.n * 2 });
    expect(new Set(rows.map((r) => r.result.n)).size).toBe(RUNS);
    const completions = (await t.pool.query(
      `SELECT job_id, count(*)::int AS n FROM attempt_log WHERE status = 'succeeded' AND job_id = ANY($1::uuid[]) GROUP BY job_id`,
      [jobs],
    )).rows;
    expect(completions).toHaveLength(RUNS);
    for (const c of completions) expect(c.n).toBe(1);
    console.log(
      `50 kills: ${moments.beforeWrite} before the outbox write completed, ${moments.writtenNotAcked} with the result on disk ` +
        `but not acknowledged, ${moments.acked} after the coordinator had it`,
    );
    expect(moments.writtenNotAcked, 'no kill landed in the window that needs the outbox').toBeGreaterThan(0);
    await checkInvariants(t.pool);
  }, 420_000);
});

describe('steps against a downstream sink', () => {
  it('applies every effect exactly once across kills, and reconciles a step left unknown on purpose', async () => {
    const token = await lh.agent('stepper');
    const outbox = await outboxDir();
    let killOnKey: string | undefined;
    let current: AgentProcess | undefined;
    const sink = await startSink((key) => {
      if (key !== killOnKey) return true;
      // The effect happened; the agent dies before it hears so or records it: unknown.
      killOnKey = undefined;
      void current?.kill();
      return false;
    });
    const { applies } = sink;

    try {
      const env = { LH_URL: lh.url, LH_TOKEN: token, LH_OUTBOX: outbox, LH_QUEUE: 'steps', LH_MODE: 'sink', LH_SINK: sink.url };
      const jobs = [];
      for (let i = 1; i <= 6; i++) jobs.push(await enqueue('steps', { n: i }));
      killOnKey = `${jobs[0]!.id}:charge`;
      current = agentProcess(env);
      await current.exited;
      // Random kills while the rest run.
      for (let k = 0; k < 3; k++) {
        current = agentProcess(env);
        await current.waitFor((l) => l.event === 'job.assigned');
        await new Promise((r) => setTimeout(r, 20 + Math.random() * 80));
        await current.kill();
      }
      current = agentProcess(env);
      await until(
        lh,
        'all succeeded',
        async () => (await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE queue = 'steps' AND status = 'succeeded'`)).rows[0].n === jobs.length,
        60_000,
      );
      for (const j of jobs) {
        expect(applies.get(`${j.id}:charge`), `charge of ${j.id}`).toBe(1);
        expect(applies.get(`${j.id}:email`), `email of ${j.id}`).toBe(1);
      }
      expect(sink.statusQueries).toBeGreaterThanOrEqual(1);
      const first = (await t.pool.query(`SELECT result, attempt_no FROM jobs WHERE id = $1`, [jobs[0]!.id])).rows[0];
      expect(first.attempt_no).toBeGreaterThanOrEqual(2);
      expect(first.result.charge).toEqual({ applied: 1, key: `${jobs[0]!.id}:charge` });
      const step = (await t.pool.query(`SELECT reservations, status::text FROM steps WHERE job_id = $1 AND step = 'charge'`, [jobs[0]!.id])).rows[0];
      expect(step).toMatchObject({ status: 'done' });
      expect(step.reservations).toBeGreaterThanOrEqual(2);
      await checkInvariants(t.pool);
    } finally {
      await sink.close();
    }
  }, 120_000);
});
