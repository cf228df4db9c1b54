/**
 * `AttemptReports` alone, over a fake batcher whose writes the test answers one by one: what a
 * session holds after `Started`, `Completed` and `Failed` whichever write finishes first, and
 * what the agent is told (`Renewed`, `Revoke`, `Ack`).
 */
import { EventEmitter } from 'node:events';
import pino from 'pino';
import { expect, it } from 'vitest';
import { AttemptReports } from '../server/core/attempt-reports.js';
import type { Outcome } from '../server/domain/outcomes.js';
import { REVOKE_DETAIL, Session, type HubEvents } from '../server/core/session.js';
import type { JobSummary } from '../server/store/index.js';
import { sentTo as sent } from './helpers/core.js';

const log = pino({ level: 'silent' });
const TTL = 30_000;

/** A write the test answers. */
interface Write {
  kind: 'start' | 'complete' | 'fail';
  p: Record<string, unknown>;
  answer(o: Outcome<JobSummary>): void;
  fail(err: Error): void;
}

/** A batcher that queues every write until the test answers it. */
function fakeBatcher() {
  const writes: Write[] = [];
  const add = (kind: Write['kind']) => (p: object) =>
    new Promise<Outcome<JobSummary>>((resolve, reject) => writes.push({ kind, p: p as Record<string, unknown>, answer: resolve, fail: reject }));
  return { writes, batcher: { start: add('start'), complete: add('complete'), fail: add('fail') } };
}

function summary(attemptId: string, over: Partial<JobSummary> = {}): JobSummary {
  return {
    id: `job-${attemptId}`,
    queue: 'q',
    status: 'running',
    attemptNo: 1,
    currentAttemptId: attemptId,
    runAt: new Date(),
    updatedAt: new Date(),
    leaseExpiresAt: new Date(),
    ...over,
  } as JobSummary;
}

const okStarted = (id: string): Outcome<JobSummary> => ({ outcome: 'ok', value: summary(id) });

function setup() {
  const { writes, batcher } = fakeBatcher();
  const events = new EventEmitter<HubEvents>();
  const seen: string[] = [];
  events.on('credit', () => seen.push('credit'));
  events.on('attempt:start', (x) => seen.push(`start ${x.attemptId} ${x.outcome.outcome}`));
  events.on('attempt:report', (x) => seen.push(`${x.kind} ${x.attemptId} ${x.outcome.outcome}`));
  const s = new Session('agent-a', ['q'], {}, 4);
  return { writes, s, seen, reports: new AttemptReports(batcher, log, events, TTL) };
}

/** Waits until the fake has `n` writes queued (they are queued from promise callbacks). */
async function writesReach(writes: Write[], n: number): Promise<void> {
  while (writes.length < n) await new Promise((r) => setImmediate(r));
}

it('Started: the attempts that start are held running and confirmed with one Renewed; the others are revoked (not_started) and their slots freed', async () => {
  const { writes, s, seen, reports } = setup();
  for (const id of ['a', 'b', 'c', 'd']) s.held.set(id, { jobId: `job-${id}`, status: 'claimed' });
  const done = reports.started(s, ['a', 'b', 'c', 'd'], 7n);
  await writesReach(writes, 4);
  expect(writes.map((w) => [w.kind, w.p])).toEqual(['a', 'b', 'c', 'd'].map((id) => ['start', { attemptId: id, agentId: 'agent-a' }]));
  expect([...s.starting.keys()]).toEqual(['a', 'b', 'c', 'd']);
  writes[0]!.answer(okStarted('a'));
  writes[1]!.answer({ outcome: 'duplicate', value: summary('b') });
  writes[2]!.answer({ outcome: 'stale', message: 'superseded', current: { attemptNo: 2, status: 'running' } } as Outcome<JobSummary>);
  writes[3]!.answer({ outcome: 'ok', value: summary('d', { currentAttemptId: 'another' }) });
  await done;
  expect(s.starting.size).toBe(0);
  expect(Object.fromEntries(s.held)).toEqual({ a: { jobId: 'job-a', status: 'running' }, b: { jobId: 'job-b', status: 'running' }, d: { jobId: 'job-d', status: 'claimed' } });
  expect(await sent(s)).toEqual([
    { type: 'renewed', attemptIds: ['a', 'b'], leaseTtlMs: TTL, seq: 7n },
    { type: 'revoke', attemptIds: ['c'], reason: 'not_started', detail: REVOKE_DETAIL.not_started },
  ]);
  expect(seen).toEqual(['start a ok', 'start b duplicate', 'start c stale', 'start d ok', 'credit']);
});

it('Completed: the slot is free at once (credit before the write), and one Ack answers every item in order', async () => {
  const { writes, s, seen, reports } = setup();
  for (const id of ['a', 'b', 'c', 'd']) s.held.set(id, { jobId: `job-${id}`, status: 'running' });
  const done = reports.report(s, {
    type: 'completed',
    results: ['a', 'b', 'c', 'd'].map((id) => ({ attemptId: id, result: { id } })),
  });
  // Not held any more, though nothing is written yet.
  expect(s.held.size).toBe(0);
  expect([...s.reporting]).toEqual(['a', 'b', 'c', 'd']);
  expect(seen).toEqual(['credit']);
  await writesReach(writes, 4);
  expect(writes[0]).toMatchObject({ kind: 'complete', p: { attemptId: 'a', agentId: 'agent-a', result: { id: 'a' } } });
  writes[3]!.answer({ outcome: 'conflict', message: 'a different result is stored' } as Outcome<JobSummary>);
  writes[2]!.answer({ outcome: 'stale', message: 'not current', current: { attemptNo: 3, status: 'queued' } } as Outcome<JobSummary>);
  writes[1]!.answer({ outcome: 'duplicate', value: { ...summary('b', { status: 'succeeded' }), result: { first: true } } as JobSummary });
  writes[0]!.answer({ outcome: 'ok', value: summary('a', { status: 'succeeded' }) });
  await done;
  expect(s.reporting.size).toBe(0);
  expect(s.held.size).toBe(0);
  const [ack] = await sent(s);
  expect(ack).toEqual({
    type: 'ack',
    items: [
      { attemptId: 'a', outcome: 'ok', message: '' },
      { attemptId: 'b', outcome: 'duplicate', storedResult: { first: true }, message: expect.any(String) },
      { attemptId: 'c', outcome: 'stale', current: { attemptNo: 3, status: 'queued' }, message: 'not current' },
      { attemptId: 'd', outcome: 'conflict', message: 'a different result is stored' },
    ],
  });
  expect(seen.slice(1).sort()).toEqual(['completed a ok', 'completed b duplicate', 'completed c stale', 'completed d conflict']);
});

it('Failed: the error and retryable reach the store verb; a refused report (too large) leaves the attempt held', async () => {
  const { writes, s, reports } = setup();
  s.held.set('a', { jobId: 'job-a', status: 'running' });
  s.held.set('b', { jobId: 'job-b', status: 'running' });
  const done = reports.report(s, {
    type: 'failed',
    failures: [
      { attemptId: 'a', error: { message: 'boom', details: { code: 7 } }, retryable: true },
      { attemptId: 'b', error: { message: 'huge' }, retryable: false },
    ],
  });
  await writesReach(writes, 2);
  expect(writes.map((w) => [w.kind, w.p])).toEqual([
    ['fail', { attemptId: 'a', agentId: 'agent-a', error: { message: 'boom', details: { code: 7 } }, retryable: true }],
    ['fail', { attemptId: 'b', agentId: 'agent-a', error: { message: 'huge' }, retryable: false }],
  ]);
  writes[0]!.answer({ outcome: 'ok', value: summary('a', { status: 'queued' }) });
  writes[1]!.answer({ outcome: 'too_large', field: 'error', message: 'is larger than 64 KiB' } as Outcome<JobSummary>);
  await done;
  expect(Object.fromEntries(s.held)).toEqual({ b: { jobId: 'job-b', status: 'running' } });
  expect(await sent(s)).toEqual([
    {
      type: 'ack',
      items: [
        { attemptId: 'a', outcome: 'ok', message: '' },
        { attemptId: 'b', outcome: 'too_large', message: 'error is larger than 64 KiB' },
      ],
    },
  ]);
});

it('a report that arrives while its start is being written waits for the start, and the start answered after it does not hold the attempt again', async () => {
  const { writes, s, seen, reports } = setup();
  s.held.set('a', { jobId: 'job-a', status: 'claimed' });
  const starting = reports.started(s, ['a'], 1n);
  await writesReach(writes, 1);
  const reporting = reports.report(s, { type: 'completed', results: [{ attemptId: 'a', result: {} }] });
  expect(s.reportedWhileStarting.has('a')).toBe(true);
  // The completion is not written before the start is answered.
  await new Promise((r) => setImmediate(r));
  expect(writes).toHaveLength(1);
  writes[0]!.answer(okStarted('a'));
  await starting;
  // Started and running, but reported: not held, and no Renewed for it.
  expect(s.held.has('a')).toBe(false);
  expect(s.reportedWhileStarting.size).toBe(0);
  await writesReach(writes, 2);
  expect(writes[1]!.kind).toBe('complete');
  writes[1]!.answer({ outcome: 'ok', value: summary('a', { status: 'succeeded' }) });
  await reporting;
  expect(s.held.size).toBe(0);
  expect(await sent(s)).toEqual([{ type: 'ack', items: [{ attemptId: 'a', outcome: 'ok', message: '' }] }]);
  expect(seen).toEqual(['credit', 'start a ok', 'completed a ok']);
});

it('a start answered after the session closed is not held; a batch that fails rejects the report (the hub ends that stream)', async () => {
  const { writes, s, reports } = setup();
  const starting = reports.started(s, ['a'], 1n);
  await writesReach(writes, 1);
  s.closed = true;
  writes[0]!.answer(okStarted('a'));
  await starting;
  expect(s.held.size).toBe(0);
  const reporting = reports.report(s, { type: 'completed', results: [{ attemptId: 'b', result: {} }] });
  await writesReach(writes, 2);
  writes[1]!.fail(new Error('connection reset'));
  await expect(reporting).rejects.toThrow('connection reset');
  expect(s.reporting.size).toBe(0);
});
