/**
 * `LeaseTicker` alone: a tick on real PostgreSQL renews what the heartbeating sessions hold (one
 * statement), answers each with `Renewed` echoing its message number, hands the lost attempts
 * to the revoker by reason, and does nothing while the coordinator wakes from a pause; its loop,
 * on fake timers, never runs two ticks at once and stops for good.
 */
import { randomUUID } from 'node:crypto';
import { EventEmitter } from 'node:events';
import pino from 'pino';
import { afterEach, expect, it, vi } from 'vitest';
import { LeaseTicker } from '../server/core/lease-ticker.js';
import { Session, type HubEvents, type RevokeReason } from '../server/core/session.js';
import { attemptComplete, jobCancel, jobRescueExpired } from '../server/store/index.js';
import { sentTo as sent } from './helpers/core.js';
import { useTestDb } from './helpers/db.js';
import { makeJob } from './helpers/factories.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();
const log = pino({ level: 'silent' });
const TTL = 60_000;

afterEach(() => {
  vi.useRealTimers();
  vi.restoreAllMocks();
});

function setup(sessions: Session[], stalled = () => false) {
  const events = new EventEmitter<HubEvents>();
  const ticks: Array<{ renewed: number; lost: number }> = [];
  events.on('lease:tick', (x) => ticks.push(x));
  const revoked: Array<[string[], RevokeReason | 'canceled']> = [];
  const revoker = { revoke: (ids: string[], reason: RevokeReason | 'canceled') => void revoked.push([[...ids].sort(), reason]) };
  const ticker = new LeaseTicker(t.pool, log, new Set(sessions), revoker, events, { leaseTtlMs: TTL, tickMs: 200, stalled });
  return { ticker, ticks, revoked };
}

/** A running job of `agentId` whose lease ends in 5 s, held by `s`. */
async function runningFor(s: Session, agentId = s.agentId, extra: Parameters<typeof makeJob>[1] = {}) {
  const job = await makeJob(t.pool, { status: 'running', agentId, leaseExpiresAt: new Date(Date.now() + 5_000), ...extra });
  s.held.set(job.currentAttemptId!, { jobId: job.id, status: 'running' });
  return job;
}

async function leaseOf(jobId: string): Promise<{ leftMs: number; progress: unknown }> {
  const { rows } = await t.pool.query(`SELECT extract(epoch FROM lease_expires_at - now()) * 1000 AS left_ms, progress FROM jobs WHERE id = $1`, [jobId]);
  return { leftMs: Number(rows[0].left_ms), progress: rows[0].progress };
}

it('renews what the sessions that heartbeated hold, keeps their progress, and answers each with Renewed and its message number', async () => {
  const a = new Session('tick-a', ['q'], {}, 4);
  const b = new Session('tick-b', ['q'], {}, 4);
  const quiet = new Session('tick-c', ['q'], {}, 4);
  const a1 = await runningFor(a);
  const a2 = await runningFor(a);
  const b1 = await runningFor(b);
  const c1 = await runningFor(quiet);
  a.heartbeatPending = true;
  a.seq = 41n;
  a.progress.set(a1.currentAttemptId!, { pct: 30 });
  b.heartbeatPending = true;
  b.seq = 9n;
  const { ticker, ticks, revoked } = setup([a, b, quiet]);
  await ticker.tick();
  for (const j of [a1, a2, b1]) expect((await leaseOf(j.id)).leftMs).toBeGreaterThan(50_000);
  // The session that did not heartbeat is not renewed.
  expect((await leaseOf(c1.id)).leftMs).toBeLessThan(6_000);
  expect((await leaseOf(a1.id)).progress).toEqual({ pct: 30 });
  expect(a.heartbeatPending).toBe(false);
  expect(a.progress.size).toBe(0);
  expect(quiet.heartbeatPending).toBe(false);
  const [toA] = await sent(a);
  expect(toA).toMatchObject({ type: 'renewed', leaseTtlMs: TTL, seq: 41n });
  expect((toA as { attemptIds: string[] }).attemptIds.sort()).toEqual([a1.currentAttemptId, a2.currentAttemptId].sort());
  expect(await sent(b)).toEqual([{ type: 'renewed', attemptIds: [b1.currentAttemptId], leaseTtlMs: TTL, seq: 9n }]);
  expect(await sent(quiet)).toEqual([]);
  expect(ticks).toEqual([{ renewed: 3, lost: 0 }]);
  expect(revoked).toEqual([]);
  await checkInvariants(t.pool);
});

it('hands the attempts the heartbeat lost to the revoker, one call per reason; a canceled or reaped one with the reason of that push', async () => {
  const s = new Session('tick-lost', ['q'], {}, 8);
  const live = await runningFor(s);
  const canceled = await runningFor(s);
  expect((await jobCancel(t.pool, { jobId: canceled.id })).outcome).toBe('ok');
  // Ended otherwise (here by a completion the session did not see): no longer current.
  const ended = await runningFor(s);
  expect((await attemptComplete(t.pool, { attemptId: ended.currentAttemptId!, agentId: s.agentId, result: {} })).outcome).toBe('ok');
  // Taken back by the reaper (of this coordinator or another), its push not seen here.
  const reaped = await runningFor(s, s.agentId, { leaseExpiresAt: new Date(Date.now() - 1000) });
  const rescue = await jobRescueExpired(t.pool, { limit: 10 });
  expect(rescue.outcome === 'ok' && rescue.value.map((r) => r.jobId)).toEqual([reaped.id]);
  const othersJob = await runningFor(s, 'someone-else');
  const overdue = await runningFor(s, s.agentId, { executionTimeoutMs: 1000, executionDeadline: new Date(Date.now() - 1000) });
  const unknown = randomUUID();
  s.held.set(unknown, { jobId: randomUUID(), status: 'running' });
  s.heartbeatPending = true;
  const { ticker, ticks, revoked } = setup([s]);
  await ticker.tick();
  expect(revoked.sort((x, y) => x[1].localeCompare(y[1]))).toEqual([
    // A canceled attempt is told Cancel, as the cancel's own push would: the ticker can find
    // it before that push reaches the session.
    [[canceled.currentAttemptId], 'canceled'],
    [[othersJob.currentAttemptId], 'forbidden'],
    [[reaped.currentAttemptId], 'lease_expired'],
    [[ended.currentAttemptId], 'not_current'],
    [[unknown], 'not_found'],
    [[overdue.currentAttemptId], 'timed_out'],
  ]);
  expect(ticks).toEqual([{ renewed: 1, lost: 6 }]);
  // Revoking is the revoker's job (a fake here): the ticker only told it; Renewed names the live one.
  expect(await sent(s)).toEqual([{ type: 'renewed', attemptIds: [live.currentAttemptId], leaseTtlMs: TTL, seq: 0n }]);
});

it('renews nothing while the coordinator wakes from a pause, and leaves the heartbeat pending', async () => {
  const s = new Session('tick-paused', ['q'], {}, 2);
  const job = await runningFor(s);
  s.heartbeatPending = true;
  const { ticker, ticks } = setup([s], () => true);
  await ticker.tick();
  expect((await leaseOf(job.id)).leftMs).toBeLessThan(6_000);
  expect(s.heartbeatPending).toBe(true);
  expect(ticks).toEqual([]);
  expect(await sent(s)).toEqual([]);
});

it('ticks every tickMs, one at a time, goes on after a failed tick, and stops for good', async () => {
  vi.useFakeTimers();
  const { ticker } = setup([]);
  const pending: Array<{ resolve: () => void; reject: (e: Error) => void }> = [];
  const tick = vi.spyOn(ticker, 'tick').mockImplementation(() => new Promise<void>((resolve, reject) => pending.push({ resolve, reject })));
  ticker.start();
  ticker.start();
  await vi.advanceTimersByTimeAsync(199);
  expect(tick).toHaveBeenCalledTimes(0);
  await vi.advanceTimersByTimeAsync(1);
  expect(tick).toHaveBeenCalledTimes(1);
  // A slow tick: no other starts while it runs.
  await vi.advanceTimersByTimeAsync(2_000);
  expect(tick).toHaveBeenCalledTimes(1);
  pending[0]!.reject(new Error('database gone'));
  await vi.advanceTimersByTimeAsync(200);
  expect(tick).toHaveBeenCalledTimes(2);
  // stop() waits for the tick in progress.
  let stopped = false;
  const stopping = ticker.stop().then(() => (stopped = true));
  await vi.advanceTimersByTimeAsync(0);
  expect(stopped).toBe(false);
  pending[1]!.resolve();
  await stopping;
  await vi.advanceTimersByTimeAsync(2_000);
  expect(tick).toHaveBeenCalledTimes(2);
});
