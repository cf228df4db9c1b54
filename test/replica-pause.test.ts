/**
 * A coordinator replica frozen (SIGSTOP, as a debugger, a VM pause or a stalled host freezes it)
 * for longer than the lease while it holds an agent's stream. The agent finds it silent, moves to
 * the other replica and resumes its running attempt there; new work reaches it there too. When
 * the frozen replica wakes, with the agent's old heartbeats and the end of its stream still in
 * its socket, it ends its streams first: it renews nothing, revokes nothing and marks nothing
 * suspect that the other replica now holds, and the job ends once, by its first attempt.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, afterEach, beforeAll, expect, it } from 'vitest';
import { jobEnqueue } from '../server/store/index.js';
import { agentBundle, spawnAgent, type AgentProcess } from './helpers/agent-process.js';
import { ADMIN_KEY, useCoordinator, waitFor } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { checkInvariants } from './helpers/invariants.js';
import { killAll, serve, type Proc } from './helpers/serve.js';
import { startSink, type Sink } from './helpers/sink.js';

const LEASE = {
  LEASEHOLD_LEASE_TTL: '6s',
  LEASEHOLD_CLAIM_TTL: '6s',
  LEASEHOLD_HEARTBEAT_INTERVAL: '500ms',
  LEASEHOLD_REAPER_INTERVAL: '100ms',
};
const t = useTestDb();
/** Replica B, in this process. */
const b = useCoordinator(t, LEASE);
let bundlePath = '';
let dir = '';
const procs: AgentProcess[] = [];
let replicaA: Proc | undefined;
let sink: Sink | undefined;
beforeAll(async () => {
  bundlePath = await agentBundle();
  dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-replica-pause-'));
});
afterEach(async () => {
  if (replicaA?.child.pid && replicaA.child.exitCode === null) process.kill(replicaA.child.pid, 'SIGCONT');
  for (const p of procs.splice(0)) await p.kill();
  killAll();
  await sink?.close();
});
afterAll(async () => {
  if (dir) await rm(dir, { recursive: true, force: true });
  if (bundlePath) await rm(bundlePath, { force: true });
});

const jobRow = async (id: string) =>
  (await t.pool.query(`SELECT status::text, attempt_no, current_attempt_id, suspect_since, lease_expires_at > now() AS leased FROM jobs WHERE id = $1`, [id])).rows[0];

it('a replica frozen past the lease: its agent resumes on the other, and on waking it renews, revokes and marks nothing', async () => {
  sink = await startSink();
  const s = sink;
  // Replica A, a process of its own so that it can be frozen.
  replicaA = serve(['serve', '--grpc-addr', '127.0.0.1:0', '--http-addr', '127.0.0.1:0'], { DATABASE_URL: t.url, LEASEHOLD_ADMIN_KEY: ADMIN_KEY, ...LEASE });
  const a = replicaA;
  const aGrpc = String((await a.waitFor(/gRPC listening/)).addr);
  await a.waitFor(/leasehold coordinator ready/);

  const agent = spawnAgent(bundlePath, {
    LH_URL: `http://${aGrpc},${b.url}`,
    LH_TOKEN: await b.agent('mover'),
    LH_OUTBOX: path.join(dir, 'outbox'),
    LH_QUEUE: 'freeze',
    LH_MODE: 'pause',
    LH_SLOTS: '2',
    LH_SINK: s.url,
  });
  procs.push(agent);
  await agent.waitFor((l) => l.event === 'connected');
  await a.waitFor(/agent connected/);

  // A job runs on A: its first step done, 14 s of work before the second.
  const enq = await jobEnqueue(t.pool, { queue: 'freeze', payload: { n: 3, workMs: 14_000 } });
  if (enq.outcome !== 'ok') throw new Error(JSON.stringify(enq));
  const job = enq.value;
  const attemptId = String((await agent.waitFor((l) => l.msg === 'between steps')).attemptId);

  // A freezes for 8 s, longer than the 6 s lease.
  process.kill(a.child.pid!, 'SIGSTOP');
  const frozenAt = performance.now();
  // The agent finds it silent and resumes the attempt on B before the lease runs out.
  await agent.waitFor((l) => l.silentMs !== undefined, 10_000);
  await agent.waitFor((l) => l.event === 'connected' && agent.lines.filter((x) => x.event === 'connected').length === 2, 10_000);
  await waitFor('the attempt renewed through B', async () => {
    const r = await jobRow(job.id);
    return r.current_attempt_id === attemptId && r.status === 'running' && r.leased && r.suspect_since === null;
  });
  // New work reaches the agent through B while A sleeps.
  const second = await jobEnqueue(t.pool, { queue: 'freeze', payload: { n: 4, workMs: 0 } });
  if (second.outcome !== 'ok') throw new Error(JSON.stringify(second));
  await waitFor('the second job done through B', async () => (await jobRow(second.value.id)).status === 'succeeded', 10_000);
  await new Promise((r) => setTimeout(r, Math.max(0, 8000 - (performance.now() - frozenAt))));
  expect((await jobRow(job.id)).current_attempt_id).toBe(attemptId); // B kept its lease; nothing was reaped

  // A wakes with the agent's heartbeats and the end of its stream in its socket.
  const before = a.lines.length;
  process.kill(a.child.pid!, 'SIGCONT');
  // Once it has seen the stream end, let it run a while (heartbeat ticks, reaper, registry), then
  // look at what it did.
  await waitFor('A sees the stream end', () => a.lines.slice(before).some((l) => /^agent (stream|disconnected)/.test(String(l.msg))), 5000);
  await new Promise((r) => setTimeout(r, 1500));
  const after = a.lines.slice(before);
  // It noticed its pause. Whether its stall watch beat before it read the stream's end from the
  // socket (then it ended the stream itself: one stream, one attempt) or after (none left) is the
  // event loop's choice; either way the stream's close says it left the attempt alone, below
  // (both orders, deterministically: core-hub-pause.test.ts).
  const woke = after.find((l) => l.pausedMs !== undefined);
  expect(woke?.pausedMs).toBeGreaterThan(7_000);
  expect([{ streams: 1, held: 1 }, { streams: 0, held: 0 }]).toContainEqual({ streams: woke!.streams, held: woke!.held });
  // Nothing it held was marked suspect from here (that line carries `suspect`).
  expect(after.filter((l) => l.suspect !== undefined)).toEqual([]);
  expect(after.filter((l) => Array.isArray(l.attemptIds) && l.reason !== undefined), 'attempts revoked').toEqual([]);
  expect(after.find((l) => l.paused === true)).toMatchObject({ held: [attemptId] });
  const row = await jobRow(job.id);
  expect(row).toMatchObject({ status: 'running', current_attempt_id: attemptId, suspect_since: null, leased: true });

  // The job ends once, by its first attempt, never aborted or revoked; every effect once.
  await waitFor('the first job done', async () => (await jobRow(job.id)).status === 'succeeded', 15_000);
  expect(await agent.waitFor((l) => l.msg === 'woke between steps' && l.attemptId === attemptId)).toMatchObject({ aborted: false });
  expect(agent.lines.filter((l) => /revoked|aborted|refused/.test(String(l.msg)))).toEqual([]);
  expect((await jobRow(job.id)).attempt_no).toBe(1);
  const history = (await t.pool.query(`SELECT id, suspect_since FROM attempt_log WHERE job_id = $1`, [job.id])).rows;
  expect(history).toEqual([{ id: attemptId, suspect_since: null }]);
  for (const key of [`${job.id}:charge`, `${job.id}:email`, `${second.value.id}:charge`, `${second.value.id}:email`]) expect(s.applies.get(key)).toBe(1);
  expect(Number((await t.pool.query(`SELECT count(*) AS n FROM stale_reports`)).rows[0].n)).toBe(0);
  await checkInvariants(t.pool);
}, 90_000);
