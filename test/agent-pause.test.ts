/**
 * A frozen agent (SIGSTOP, as a debugger, a VM pause or a stalled machine freezes it) that wakes
 * after its lease: meanwhile another agent took the job over and finished it; on waking, the
 * frozen agent's handler is aborted before its next step reaches the downstream system, its late
 * report is refused as stale and kept aside in its outbox, and every effect happened once. The
 * same when it froze while its step's reservation was being answered: the answer (and the
 * renewals sent before the freeze) waiting in its socket on waking do not let the effect through.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pino from 'pino';
import { afterAll, afterEach, beforeAll, expect, it } from 'vitest';
import { createAgent, readOutbox, type Agent } from '@leasehold/agent-client';
import { jobEnqueue } from '../server/store/index.js';
import { agentBundle, spawnAgent, type AgentProcess } from './helpers/agent-process.js';
import { until, useCoordinator, waitFor } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { checkInvariants } from './helpers/invariants.js';
import { handleWithSteps, startSink, type Sink } from './helpers/sink.js';
import { startFaultProxy, type FaultProxy } from './chaos/fault-proxy.js';

const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_LEASE_TTL: '3s', LEASEHOLD_CLAIM_TTL: '3s', LEASEHOLD_HEARTBEAT_INTERVAL: '300ms' });
let bundlePath = '';
const dirs: string[] = [];
const procs: AgentProcess[] = [];
const inproc: Agent[] = [];
let sink: Sink | undefined;
let proxy: FaultProxy | undefined;
beforeAll(async () => {
  bundlePath = await agentBundle();
});
afterEach(async () => {
  for (const p of procs.splice(0)) {
    if (p.child.pid) process.kill(p.child.pid, 'SIGCONT');
    await p.kill();
  }
  for (const a of inproc.splice(0)) await a.stop();
  await sink?.close();
  await proxy?.close();
});
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
  if (bundlePath) await rm(bundlePath, { force: true });
});
const tmp = async () => {
  const d = await mkdtemp(path.join(os.tmpdir(), 'leasehold-pause-'));
  dirs.push(d);
  return d;
};

it('a frozen agent wakes after its lease: aborted before its next step, its late report refused, every effect once', async () => {
  sink = await startSink();
  const s = sink;
  const outbox = await tmp();
  const frozen = spawnAgent(bundlePath, {
    LH_URL: lh.url,
    LH_TOKEN: await lh.agent('sleeper'),
    LH_OUTBOX: outbox,
    LH_QUEUE: 'pause',
    LH_MODE: 'pause',
    LH_SINK: s.url,
  });
  procs.push(frozen);
  await frozen.waitFor((l) => l.event === 'connected');
  // Ten seconds between its two steps: only an abort ends that wait early.
  const enq = await jobEnqueue(t.pool, { queue: 'pause', payload: { n: 7, workMs: 10_000 } });
  if (enq.outcome !== 'ok') throw new Error(JSON.stringify(enq));
  const job = enq.value;
  const between = await frozen.waitFor((l) => l.msg === 'between steps');
  const first = String(between.attemptId);
  process.kill(frozen.child.pid!, 'SIGSTOP');

  // Frozen past its lease (3 s): the job is requeued and another agent finishes it.
  const rescuer = createAgent({ url: lh.url, token: await lh.agent('waker'), queues: ['pause'], outboxDir: await tmp(), handleSignals: false, log: pino({ level: 'silent' }) });
  inproc.push(rescuer);
  handleWithSteps(rescuer, 'pause', s, 'rescuer');
  await rescuer.start();
  await until(lh, 'finished by the rescuer', async () => (await t.pool.query(`SELECT status::text FROM jobs WHERE id = $1`, [job.id])).rows[0].status === 'succeeded', 15_000);

  // It wakes: its handler is aborted (its deadline passed while it slept; the coordinator revokes
  // it too), its next step is refused, its report is refused and kept aside.
  process.kill(frozen.child.pid!, 'SIGCONT');
  const woke = await frozen.waitFor((l) => l.msg === 'woke between steps');
  expect(woke).toMatchObject({ attemptId: first, aborted: true });
  await frozen.waitFor((l) => l.setAside === 'superseded' && l.attemptId === first);
  const left = await readOutbox(outbox);
  // The agent's log says what it did with the report, if it is still pending.
  expect(left.pending, JSON.stringify(frozen.lines.slice(-40))).toEqual([]);
  expect(left.superseded).toEqual([expect.objectContaining({ attemptId: first, reason: 'STALE' })]);

  // Every effect once: the charge by the frozen attempt (the rescuer found it recorded), the
  // email by the rescuer; the frozen attempt never reached the sink again.
  expect(s.applies.get(`${job.id}:charge`)).toBe(1);
  expect(s.applies.get(`${job.id}:email`)).toBe(1);
  const row = (await t.pool.query(`SELECT status::text, attempt_no, result FROM jobs WHERE id = $1`, [job.id])).rows[0];
  expect(row).toMatchObject({ status: 'succeeded', attempt_no: 2, result: { by: 'rescuer', charge: { applied: 7, key: `${job.id}:charge` }, email: { applied: 70, key: `${job.id}:email` } } });
  await checkInvariants(t.pool);
}, 60_000);

it('frozen while its step is being reserved: the reservation answered meanwhile does not let the effect through on waking', async () => {
  sink = await startSink();
  const s = sink;
  // What the coordinator sends it is held back from the moment it gets to its second step, so
  // that the reservation's answer is still on its way when it is frozen, and arrives meanwhile.
  proxy = await startFaultProxy(lh.port);
  const p = proxy;
  const frozen = spawnAgent(bundlePath, {
    LH_URL: `127.0.0.1:${p.port}`,
    LH_TOKEN: await lh.agent('reserver'),
    LH_OUTBOX: await tmp(),
    LH_QUEUE: 'reserve',
    LH_MODE: 'pause',
    LH_SINK: s.url,
  });
  procs.push(frozen);
  await frozen.waitFor((l) => l.event === 'connected');
  const enq = await jobEnqueue(t.pool, { queue: 'reserve', payload: { n: 5, workMs: 300 } });
  if (enq.outcome !== 'ok') throw new Error(JSON.stringify(enq));
  const job = enq.value;
  const first = String((await frozen.waitFor((l) => l.msg === 'between steps')).attemptId);
  p.set({ kind: 'hold' });
  await waitFor('the reservation recorded for the frozen attempt', async () => (await t.pool.query(`SELECT 1 FROM steps WHERE job_id = $1 AND step = 'email'`, [job.id])).rowCount === 1, 5000);
  process.kill(frozen.child.pid!, 'SIGSTOP');
  const stoppedAt = Date.now();
  // The answer, and every renewal held back, reach its socket while it is frozen.
  p.set({ kind: 'ok' });

  // Past its lease, another agent finishes the job: the email step's outcome is unknown to it,
  // the sink says it never happened, so it applies it.
  const rescuer = createAgent({ url: lh.url, token: await lh.agent('reserve-rescuer'), queues: ['reserve'], outboxDir: await tmp(), handleSignals: false, log: pino({ level: 'silent' }) });
  inproc.push(rescuer);
  handleWithSteps(rescuer, 'reserve', s, 'rescuer');
  await rescuer.start();
  await until(lh, 'finished by the rescuer', async () => (await t.pool.query(`SELECT status::text FROM jobs WHERE id = $1`, [job.id])).rows[0].status === 'succeeded', 15_000);
  expect(s.applies.get(`${job.id}:email`)).toBe(1);

  // It wakes with the reservation's answer in its socket: the step stops before the effect.
  process.kill(frozen.child.pid!, 'SIGCONT');
  expect(await frozen.waitFor((l) => l.event === 'handler.finished' && l.attemptId === first)).toMatchObject({ kind: 'failed', aborted: true });
  // It was frozen with its attempt alive (renewals held back for less than its lease), and
  // aborted after it woke: by its deadline, not by the answer's delay.
  const aborted = frozen.lines.filter((l) => l.event === 'attempt.aborted' && l.attemptId === first);
  expect(aborted).toHaveLength(1);
  expect(aborted[0]!.time).toBeGreaterThan(stoppedAt);
  await frozen.waitFor((l) => l.setAside === 'superseded' && l.attemptId === first);
  expect(s.applies.get(`${job.id}:charge`)).toBe(1);
  expect(s.applies.get(`${job.id}:email`)).toBe(1);
  await checkInvariants(t.pool);
}, 60_000);
