/**
 * `Dispatcher` alone, over a hub that is not started (its sessions put there by the test) and
 * real PostgreSQL: which sessions a round claims for and together, how their slots are shared,
 * when a group found empty is claimed for again, the enqueue hand-off's reserve and settle, and
 * a failed claim giving its slots back. test/dispatcher.test.ts covers it inside a coordinator.
 */
import { Code, ConnectError } from '@connectrpc/connect';
import pino from 'pino';
import { afterEach, expect, it } from 'vitest';
import { AgentHub, Session } from '../server/core/agent-hub.js';
import { Dispatcher } from '../server/core/dispatcher.js';
import { jobClaim, jobEnqueue, jobRescueExpired, type Claimed } from '../server/store/index.js';
import { interceptPool, sentTo } from './helpers/core.js';
import { useTestDb } from './helpers/db.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();
const log = pino({ level: 'silent' });
const dispatchers: Dispatcher[] = [];

afterEach(async () => {
  await Promise.all(dispatchers.splice(0).map((d) => d.stop()));
  await t.truncate();
});

/** A hub with `sessions`, and a dispatcher on a pool that counts claims and can fail the next. */
function setup(...sessions: Session[]) {
  const hub = new AgentHub(t.pool, log, { leaseTtlMs: 30_000, claimTtlMs: 30_000, heartbeatIntervalMs: 5_000 });
  for (const s of sessions) hub.sessions.add(s);
  const stats = { claims: 0, breakNext: false };
  const db = interceptPool(t.pool, async (q, run) => {
    if (q.name === 'jobClaim') {
      stats.claims++;
      if (stats.breakNext) {
        stats.breakNext = false;
        throw new Error('connection reset');
      }
    }
    return run();
  });
  const dispatcher = new Dispatcher(db, hub, log, { claimTtlMs: 30_000, pollMs: 3_600_000 });
  dispatchers.push(dispatcher);
  const rounds: Array<{ claimed: number; groups: number }> = [];
  dispatcher.on('dispatch:round', (r) => rounds.push({ claimed: r.claimed, groups: r.groups }));
  dispatcher.start();
  return { hub, dispatcher, stats, rounds };
}

async function enqueue(queue: string, n: number, labels?: Record<string, string>): Promise<string[]> {
  const ids: string[] = [];
  for (let i = 0; i < n; i++) {
    const o = await jobEnqueue(t.pool, { queue, payload: { i }, ...(labels ? { labels } : {}) });
    if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
    ids.push(o.value.id);
  }
  return ids;
}

/** The jobs assigned to a session so far (its channel ends). */
async function assigned(s: Session): Promise<Claimed[]> {
  return (await sentTo(s)).flatMap((m) => (m.type === 'assign' ? m.jobs : []));
}

it('one round claims for the sessions of a group in one statement, their slots interleaved, never beyond a session\'s free slots', async () => {
  const a = new Session('disp-a', ['work'], {}, 2);
  const b = new Session('disp-b', ['work'], {}, 2);
  const { dispatcher, stats, rounds } = setup(a, b);
  await enqueue('work', 3);
  await dispatcher.runOnce();
  expect(stats.claims).toBe(1);
  expect(rounds).toEqual([{ claimed: 3, groups: 1 }]);
  // Interleaved: one session got two, the other one (not three and none).
  expect([a.held.size, b.held.size].sort()).toEqual([1, 2]);
  expect([...a.held.values(), ...b.held.values()].every((h) => h.status === 'claimed')).toBe(true);
  expect(a.available + b.available).toBe(1);
  const toA = await assigned(a);
  const toB = await assigned(b);
  expect(toA.map((c) => c.attemptId).sort()).toEqual([...a.held.keys()].sort());
  expect(toB.map((c) => c.attemptId).sort()).toEqual([...b.held.keys()].sort());
  expect(new Set([...toA, ...toB].map((c) => c.job.id)).size).toBe(3);
  await checkInvariants(t.pool);
});

it('sessions with other queues or labels are claimed for apart; a job that requires a label goes only to a session that has it', async () => {
  const plain = new Session('disp-plain', ['render'], {}, 3);
  const gpu = new Session('disp-gpu', ['render'], { gpu: 'yes' }, 3);
  const closed = new Session('disp-closed', ['render'], {}, 3);
  closed.closed = true;
  const draining = new Session('disp-draining', ['render'], {}, 3);
  draining.draining = true;
  const { dispatcher, rounds } = setup(plain, gpu, closed, draining);
  const [needsGpu] = await enqueue('render', 1, { gpu: 'yes' });
  await dispatcher.runOnce();
  expect(rounds).toEqual([{ claimed: 1, groups: 2 }]);
  expect([...gpu.held.values()].map((h) => h.jobId)).toEqual([needsGpu]);
  expect(plain.held.size + closed.held.size + draining.held.size).toBe(0);
});

it('a group whose claim came back short is not claimed for again on credit alone, only when its queue is woken', async () => {
  const s = new Session('disp-short', ['short'], {}, 4);
  const { dispatcher, stats, rounds } = setup(s);
  await enqueue('short', 1);
  await dispatcher.runOnce();
  expect(s.held.size).toBe(1);
  expect(stats.claims).toBe(1);
  // A freed slot: the queue was found empty, so no claim.
  dispatcher.credit();
  await dispatcher.idle();
  expect(stats.claims).toBe(1);
  // A wake for a queue nobody here serves changes nothing either.
  dispatcher.wake('elsewhere');
  await dispatcher.idle();
  expect(stats.claims).toBe(1);
  // A wake for its queue: claimed again, and the new job assigned.
  await enqueue('short', 1);
  dispatcher.wake('short');
  await dispatcher.idle();
  expect(stats.claims).toBe(2);
  expect(s.held.size).toBe(2);
  expect(rounds.map((r) => r.claimed)).toEqual([1, 1]);
});

it('a failed claim gives the reserved slots back and reports dispatch:error', async () => {
  const s = new Session('disp-fail', ['fail'], {}, 2);
  const { dispatcher, stats } = setup(s);
  const errors: Error[] = [];
  dispatcher.on('dispatch:error', (e) => errors.push(e));
  stats.breakNext = true;
  dispatcher.credit();
  await dispatcher.idle();
  expect(errors).toHaveLength(1);
  expect(s.available).toBe(2);
  expect(s.reserved).toBe(0);
  // The next round claims normally.
  await enqueue('fail', 1);
  await dispatcher.runOnce();
  expect(s.held.size).toBe(1);
});

it('reserve takes a free slot of a session that serves the queue and has the labels, sessions taking turns; settle assigns the claimed job or frees the slot', async () => {
  const one = new Session('disp-one', ['hand'], { os: 'windows' }, 1);
  const two = new Session('disp-two', ['hand'], { os: 'windows' }, 1);
  const linux = new Session('disp-linux', ['hand'], { os: 'linux' }, 1);
  const { hub, dispatcher } = setup(one, two, linux);
  const handoffs: Claimed[] = [];
  dispatcher.on('dispatch:handoff', (c) => handoffs.push(c));
  const credited: Session[] = [];
  hub.on('credit', (s) => credited.push(s));
  expect(dispatcher.reserve('other-queue', undefined)).toBeUndefined();
  const first = dispatcher.reserve('hand', { os: 'windows' })!;
  const second = dispatcher.reserve('hand', { os: 'windows' })!;
  expect([first.session, second.session].sort((x, y) => x.agentId.localeCompare(y.agentId))).toEqual([one, two]);
  expect([one.available, two.available]).toEqual([0, 0]);
  // Every Windows slot is taken.
  expect(dispatcher.reserve('hand', { os: 'windows' })).toBeUndefined();
  // The enqueue claimed its job for the first: it is assigned there.
  const job = await jobEnqueue(t.pool, { queue: 'hand', payload: {}, labels: { os: 'windows' }, handOff: first });
  if (job.outcome !== 'ok') throw new Error(JSON.stringify(job));
  expect(job.value.currentAttemptId).toBe(first.attemptId);
  const claimedFor = (h: typeof first): Claimed => ({
    job: job.value,
    slot: 0,
    agentId: h.agentId,
    attemptId: job.value.currentAttemptId!,
    attemptNo: job.value.attemptNo,
    claimDeadline: new Date(Date.now() + h.claimTtlMs),
  });
  dispatcher.settle(first, claimedFor(first));
  expect(first.session.held.get(first.attemptId)).toEqual({ jobId: job.value.id, status: 'claimed' });
  expect(handoffs.map((c) => c.attemptId)).toEqual([first.attemptId]);
  expect(second.session.held.size).toBe(0);
  // The other enqueue's job went elsewhere (another attempt id) or nowhere: its slot is free again.
  dispatcher.settle(second, claimedFor(second));
  expect(second.session.available).toBe(1);
  expect(credited).toEqual([second.session]);
  // A stopped dispatcher hands nothing off.
  await dispatcher.stop();
  expect(dispatcher.reserve('hand', { os: 'linux' })).toBeUndefined();
  expect(linux.available).toBe(1);
});

it.each([
  ['ended', (s: Session) => void (s.closed = true)],
  // Its queue draining before `hub.close` (a report the database refused): an Assign pushed now is never written.
  ['ending', (s: Session) => s.out.close()],
])('jobs claimed for a stream %s while the claim ran go back at the reaper\'s next run, not at their claim deadline', async (_, end) => {
  const s = new Session('disp-gone', ['gone'], {}, 2);
  const { hub } = setup(s);
  const [id] = await enqueue('gone', 1);
  // The stream ends while the round's claim is in the database.
  const db = interceptPool(t.pool, async (q, run) => {
    if (q.name === 'jobClaim') end(s);
    return run();
  });
  const d = new Dispatcher(db, hub, log, { claimTtlMs: 30_000, pollMs: 3_600_000 });
  dispatchers.push(d);
  d.start();
  await d.runOnce();
  expect(s.held.size).toBe(0);
  // Before, its claim deadline stayed 30 s ahead and the reaper found nothing for that long.
  await expect.poll(async () => {
    const r = await jobRescueExpired(t.pool, { limit: 10 });
    return r.outcome === 'ok' ? r.value.map((x) => [x.jobId, x.reason, x.status]) : r;
  }).toEqual([[id, 'claim_expired', 'queued']]);
  await checkInvariants(t.pool);
});

it('a report the database could not store ends the stream after what was queued for it, with UNAVAILABLE', async () => {
  const s = new Session('disp-report', ['report'], {}, 2);
  const db = interceptPool(t.pool, async (q, run) => {
    if (String(q.name).startsWith('attemptStart')) throw new Error('Connection terminated unexpectedly');
    return run();
  });
  const hub = new AgentHub(db, log, { leaseTtlMs: 30_000, claimTtlMs: 30_000, heartbeatIntervalMs: 5_000 });
  hub.sessions.add(s);
  await enqueue('report', 2);
  const claimed = await jobClaim(t.pool, { agentId: 'disp-report', queues: ['report'], limit: 2, claimTtlMs: 30_000 });
  if (claimed.outcome !== 'ok') throw new Error(JSON.stringify(claimed));
  hub.assign(s, [claimed.value[0]!]);
  await hub.handle(s, { type: 'started', attemptIds: [claimed.value[0]!.attemptId], seq: 1n });
  hub.assign(s, [claimed.value[1]!]);
  // The second Assign was queued after the first report, before its failure came back: both go out.
  const out: unknown[] = [];
  const end = await (async () => {
    try {
      for await (const m of s.out) out.push(m);
    } catch (err) {
      return err;
    }
  })();
  expect(out.filter((m) => (m as { type: string }).type === 'assign')).toHaveLength(2);
  expect(end).toBeInstanceOf(ConnectError);
  expect((end as ConnectError).code).toBe(Code.Unavailable);
  expect((end as ConnectError).rawMessage).toMatch(/^the coordinator could not store a report \(.*Connection terminated unexpectedly\): reconnect and send it again$/);
});
