/**
 * `ReportBatcher` alone, on real PostgreSQL through a pool that counts the named statements and
 * can hold them: what arrives in one turn goes out as one statement per kind, each kind in its
 * own lane of at most two statements at once, every item gets its own outcome, a failed
 * statement fails its items only, and `idle()` waits for everything queued. With a completion
 * linger, a completion that finds its lane idle waits for company; nothing else ever waits.
 */
import pino from 'pino';
import { afterEach, describe, expect, it, vi } from 'vitest';
import { ReportBatcher } from '../server/core/batcher.js';
import { allEnded } from '../server/core/settle.js';
import { limits } from '../server/domain/validation.js';
import { interceptPool } from './helpers/core.js';
import { useTestDb } from './helpers/db.js';
import { makeJob } from './helpers/factories.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();
const log = pino({ level: 'silent' });
const TTL = 30_000;

/**
 * The file's pool, seen through a proxy: `started[name]` counts the statements of that name that
 * began; `hold(name)` keeps the next ones waiting (after PostgreSQL answered) until `release`;
 * `breakNext(name)` makes the next one throw.
 */
function watchedPool() {
  const started: Record<string, number> = {};
  const held = new Map<string, Array<() => void>>();
  const gates = new Set<string>();
  const broken = new Set<string>();
  const db = interceptPool(t.pool, async (q, run) => {
    const name = q.name ?? '';
    started[name] = (started[name] ?? 0) + 1;
    if (broken.delete(name)) throw new Error(`${name}: connection reset`);
    const res = await run();
    if (gates.has(name)) await new Promise<void>((r) => held.set(name, [...(held.get(name) ?? []), r]));
    return res;
  });
  return {
    db,
    started,
    hold: (name: string) => gates.add(name),
    /** Lets the held statements of `name` answer and stops holding new ones. */
    release: (name: string) => {
      gates.delete(name);
      for (const r of held.get(name) ?? []) r();
      held.delete(name);
    },
    /** Waits until `n` statements of `name` are being held. */
    heldReach: async (name: string, n: number) => {
      while ((held.get(name)?.length ?? 0) < n) await new Promise((r) => setImmediate(r));
    },
    breakNext: (name: string) => broken.add(name),
  };
}

async function claimedJobs(n: number, agentId: string) {
  return Promise.all(Array.from({ length: n }, () => makeJob(t.pool, { status: 'claimed', agentId })));
}

async function runningJobs(n: number, agentId: string) {
  return Promise.all(Array.from({ length: n }, () => makeJob(t.pool, { status: 'running', agentId })));
}

it('what arrives in one turn goes out as one statement per kind, each item answered with its own outcome', async () => {
  const w = watchedPool();
  const b = new ReportBatcher(w.db, log, TTL);
  const toStart = await claimedJobs(3, 'batch-a');
  const toComplete = await runningJobs(2, 'batch-a');
  const toFail = await runningJobs(2, 'batch-a');
  const outcomes = await Promise.all([
    ...toStart.map((j) => b.start({ attemptId: j.currentAttemptId!, agentId: 'batch-a' })),
    // Another agent's attempt: refused, alone, in the same statement.
    b.start({ attemptId: toStart[0]!.currentAttemptId!, agentId: 'batch-b' }),
    ...toComplete.map((j) => b.complete({ attemptId: j.currentAttemptId!, agentId: 'batch-a', result: { ok: j.id } })),
    ...toFail.map((j, i) => b.fail({ attemptId: j.currentAttemptId!, agentId: 'batch-a', error: { message: 'no' }, retryable: i === 0 })),
  ]);
  expect(outcomes.map((o) => o.outcome)).toEqual(['ok', 'ok', 'ok', 'forbidden', 'ok', 'ok', 'ok', 'ok']);
  const values = outcomes.map((o) => (o.outcome === 'ok' ? o.value : undefined));
  expect(values.slice(0, 3).map((v) => [v?.id, v?.status])).toEqual(toStart.map((j) => [j.id, 'running']));
  expect(values.slice(4, 6).map((v) => [v?.id, v?.status])).toEqual(toComplete.map((j) => [j.id, 'succeeded']));
  expect(values.slice(6).map((v) => [v?.id, v?.status])).toEqual([
    [toFail[0]!.id, 'queued'],
    [toFail[1]!.id, 'failed'],
  ]);
  expect(w.started.attemptStartMany).toBe(1);
  expect(w.started.attemptCompleteManyUnheard).toBe(1);
  // Failures are one statement each, run as one batch.
  expect(w.started.attemptFail).toBe(2);
  expect(b.stats).toMatchObject({ statements: 3, items: 8 });
  await checkInvariants(t.pool);
});

it('a kind runs at most two statements at once; what waits meanwhile goes out together; other kinds are not held up', async () => {
  const w = watchedPool();
  const b = new ReportBatcher(w.db, log, TTL);
  const jobs = await claimedJobs(5, 'lane-a');
  const [done] = await runningJobs(1, 'lane-a');
  w.hold('attemptStartMany');
  const first = b.start({ attemptId: jobs[0]!.currentAttemptId!, agentId: 'lane-a' });
  await w.heldReach('attemptStartMany', 1);
  const second = b.start({ attemptId: jobs[1]!.currentAttemptId!, agentId: 'lane-a' });
  await w.heldReach('attemptStartMany', 2);
  // Both lanes' slots are taken: these three wait, in separate turns.
  const rest: Array<ReturnType<ReportBatcher['start']>> = [];
  for (const j of jobs.slice(2)) {
    rest.push(b.start({ attemptId: j.currentAttemptId!, agentId: 'lane-a' }));
    await new Promise((r) => setImmediate(r));
  }
  expect(w.started.attemptStartMany).toBe(2);
  // A completion meanwhile has a lane of its own.
  const completed = await b.complete({ attemptId: done!.currentAttemptId!, agentId: 'lane-a', result: {} });
  expect(completed.outcome).toBe('ok');
  w.release('attemptStartMany');
  const outcomes = await Promise.all([first, second, ...rest]);
  expect(outcomes.map((o) => o.outcome)).toEqual(['ok', 'ok', 'ok', 'ok', 'ok']);
  // The three that waited went out in one statement.
  expect(w.started.attemptStartMany).toBe(3);
  expect(b.stats).toMatchObject({ statements: 4, items: 6 });
});

it('a statement that fails rejects the items of its batch only; the next batch is written', async () => {
  const w = watchedPool();
  const b = new ReportBatcher(w.db, log, TTL);
  const jobs = await runningJobs(3, 'broken-a');
  w.breakNext('attemptCompleteManyUnheard');
  const lost = jobs.slice(0, 2).map((j) => b.complete({ attemptId: j.currentAttemptId!, agentId: 'broken-a', result: {} }));
  for (const p of lost) await expect(p).rejects.toThrow('connection reset');
  const again = await b.complete({ attemptId: jobs[2]!.currentAttemptId!, agentId: 'broken-a', result: {} });
  expect(again.outcome).toBe('ok');
  expect(b.stats).toMatchObject({ statements: 1, items: 1 });
});

it('idle() resolves once everything queued so far is written', async () => {
  const w = watchedPool();
  const b = new ReportBatcher(w.db, log, TTL);
  const jobs = await claimedJobs(2, 'idle-a');
  w.hold('attemptStartMany');
  let answered = 0;
  for (const j of jobs) void b.start({ attemptId: j.currentAttemptId!, agentId: 'idle-a' }).then(() => answered++);
  let idle = false;
  const waiting = b.idle().then(() => (idle = true));
  await w.heldReach('attemptStartMany', 1);
  expect(idle).toBe(false);
  w.release('attemptStartMany');
  await waiting;
  // Every write was answered before idle() resolved.
  expect(answered).toBe(2);
});

describe('the completion linger', () => {
  const LINGER = 50;
  // Only the linger's timer is faked: the other lanes' turns (setImmediate) and PostgreSQL run for real.
  const fakeTimeouts = () => vi.useFakeTimers({ toFake: ['setTimeout', 'clearTimeout'] });
  afterEach(() => vi.useRealTimers());
  const turns = async (n = 20) => {
    for (let i = 0; i < n; i++) await new Promise((r) => setImmediate(r));
  };

  it('a completion that finds its lane idle waits the linger for others, then all go out in one statement', async () => {
    const w = watchedPool();
    const jobs = await runningJobs(3, 'linger-a');
    fakeTimeouts();
    const b = new ReportBatcher(w.db, log, TTL, { completionLingerMs: LINGER });
    const first = b.complete({ attemptId: jobs[0]!.currentAttemptId!, agentId: 'linger-a', result: { n: 0 } });
    await turns();
    expect(w.started.attemptCompleteManyUnheard).toBeUndefined();
    vi.advanceTimersByTime(LINGER - 1);
    const later = jobs.slice(1).map((j, i) => b.complete({ attemptId: j.currentAttemptId!, agentId: 'linger-a', result: { n: i + 1 } }));
    await turns();
    expect(w.started.attemptCompleteManyUnheard).toBeUndefined();
    vi.advanceTimersByTime(1);
    const outcomes = await Promise.all([first, ...later]);
    expect(outcomes.map((o) => [o.outcome, o.outcome === 'ok' && o.value.status])).toEqual(jobs.map(() => ['ok', 'succeeded']));
    expect(w.started.attemptCompleteManyUnheard).toBe(1);
    expect(b.stats).toMatchObject({ statements: 1, items: 3 });
    await checkInvariants(t.pool);
  });

  it('starts and failures never linger', async () => {
    const w = watchedPool();
    const [toStart] = await claimedJobs(1, 'linger-b');
    const [toFail] = await runningJobs(1, 'linger-b');
    fakeTimeouts();
    const b = new ReportBatcher(w.db, log, TTL, { completionLingerMs: LINGER });
    // No timer is advanced: both are written on the event loop's next turns.
    const started = await b.start({ attemptId: toStart!.currentAttemptId!, agentId: 'linger-b' });
    const failed = await b.fail({ attemptId: toFail!.currentAttemptId!, agentId: 'linger-b', error: { message: 'no' }, retryable: false });
    expect([started.outcome, failed.outcome]).toEqual(['ok', 'ok']);
  });

  it('while a completion statement runs, the next batch goes out at once: under load nothing lingers', async () => {
    const w = watchedPool();
    const jobs = await runningJobs(2, 'linger-c');
    fakeTimeouts();
    const b = new ReportBatcher(w.db, log, TTL, { completionLingerMs: LINGER });
    w.hold('attemptCompleteManyUnheard');
    const first = b.complete({ attemptId: jobs[0]!.currentAttemptId!, agentId: 'linger-c', result: {} });
    vi.advanceTimersByTime(LINGER);
    await w.heldReach('attemptCompleteManyUnheard', 1);
    // The first statement is still running: the second completion does not wait for a timer.
    const second = b.complete({ attemptId: jobs[1]!.currentAttemptId!, agentId: 'linger-c', result: {} });
    await w.heldReach('attemptCompleteManyUnheard', 2);
    w.release('attemptCompleteManyUnheard');
    expect((await Promise.all([first, second])).map((o) => o.outcome)).toEqual(['ok', 'ok']);
    expect(b.stats).toMatchObject({ statements: 2, items: 2 });
  });

  it('a full batch does not wait for the linger, and idle() ends a linger at once', async () => {
    const w = watchedPool();
    const jobs = await runningJobs(limits.claimBatch + 1, 'linger-d');
    fakeTimeouts();
    const b = new ReportBatcher(w.db, log, TTL, { completionLingerMs: LINGER });
    const full = jobs.slice(0, limits.claimBatch).map((j) => b.complete({ attemptId: j.currentAttemptId!, agentId: 'linger-d', result: {} }));
    // No timer is advanced: the batch is full, so it goes on the next turn.
    expect((await Promise.all(full)).every((o) => o.outcome === 'ok')).toBe(true);
    expect(w.started.attemptCompleteManyUnheard).toBe(1);
    const last = b.complete({ attemptId: jobs[limits.claimBatch]!.currentAttemptId!, agentId: 'linger-d', result: {} });
    await turns();
    expect(w.started.attemptCompleteManyUnheard).toBe(1);
    // A stopping hub waits for idle(): the lingering completion is written now, not after the linger.
    await b.idle();
    expect((await last).outcome).toBe('ok');
    expect(w.started.attemptCompleteManyUnheard).toBe(2);
  });
});

describe('allEnded', () => {
  it("gives Promise.all's answer only once every promise has ended", async () => {
    expect(await allEnded([Promise.resolve(1), Promise.resolve(2)])).toEqual([1, 2]);
    let lateDone = false;
    const late = new Promise<number>((r) => setTimeout(() => ((lateDone = true), r(3)), 50));
    await expect(allEnded([Promise.reject(new Error('first')), late, Promise.reject(new Error('second'))])).rejects.toThrow('first');
    // Promise.all would have rejected at once, the 50 ms one still running.
    expect(lateDone).toBe(true);
  });
});
