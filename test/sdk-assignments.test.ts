/**
 * The agent SDK's assignments (agent-client/src/assignments.ts) on their own, with a fake session
 * (the lease's clock) and a fake reporter: a handler runs only once its start is confirmed, its
 * report is written before the attempt is let go, aborts before the start free the slot without
 * running, the local deadline and the zombie report follow the monotonic clock, and the watchdog
 * ticks only while something is held. Fake timers move the clock; no coordinator.
 */
import { EventEmitter, once } from 'node:events';
import { create } from '@bufbuild/protobuf';
import pino from 'pino';
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { JobError, type JobContext } from '@leasehold/agent-client';
import { Assignments, type Handler } from '../agent-client/src/assignments.js';
import type { CoordinatorChannel } from '../agent-client/src/channel.js';
import type { AgentEvents } from '../agent-client/src/events.js';
import { ClaimedJobSchema } from '../agent-client/src/gen/leasehold/v1/job_pb.js';
import type { OutboxEntry } from '../agent-client/src/outbox.js';

const TTL = 10_000;
const HEARTBEAT = 1000;
const ID = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;

function claimed(n: number, queue = 'q') {
  return create(ClaimedJobSchema, { job: { id: `job-${n}`, queue, payload: { n }, priority: 2, labels: { os: 'x' } }, attemptId: ID(n), attemptNo: 1 });
}

interface Fixture {
  a: Assignments;
  events: EventEmitter<AgentEvents>;
  written: OutboxEntry[];
  finished: OutboxEntry[];
  freed: number;
  silenceChecks: number;
  /** Held attempts at the moment each report's write began. */
  heldAtWrite: string[][];
  /** Resolves the write in flight when set (else writes resolve at once). */
  holdWrites: boolean;
  releaseWrite: () => void;
}

function setup(handlers: Record<string, Handler>): Fixture {
  const events = new EventEmitter<AgentEvents>();
  const f: Fixture = {
    events,
    written: [],
    finished: [],
    freed: 0,
    silenceChecks: 0,
    heldAtWrite: [],
    holdWrites: false,
    releaseWrite: () => {},
    a: undefined as never,
  };
  f.a = new Assignments({
    log: pino({ level: 'silent' }),
    events,
    handler: (queue) => handlers[queue],
    session: {
      heartbeatMs: HEARTBEAT,
      localDeadline: (from = performance.now(), ttlMs = TTL) => from + ttlMs - HEARTBEAT,
      checkSilence: () => void f.silenceChecks++,
      channel: {} as CoordinatorChannel,
    },
    reporter: {
      write: (e) => {
        f.written.push(e);
        f.heldAtWrite.push(f.a.ids());
        return f.holdWrites ? new Promise<void>((r) => (f.releaseWrite = r)) : Promise.resolve();
      },
      finished: (e) => void f.finished.push(e),
      freeSlot: () => void f.freed++,
    },
  });
  return f;
}

const live: Fixture[] = [];
function fixture(handlers: Record<string, Handler>): Fixture {
  const f = setup(handlers);
  live.push(f);
  return f;
}

beforeEach(() => void vi.useFakeTimers());
afterEach(() => {
  for (const f of live.splice(0)) f.a.stop('test over');
  vi.useRealTimers();
});

const ahead = () => performance.now() + 5000;

describe('assignments', () => {
  it('runs a handler only once its start is confirmed, and writes its report before letting the attempt go', async () => {
    const seen: Array<{ job: unknown; attempt: JobContext['attempt'] }> = [];
    const f = fixture({ q: async (job, ctx) => (seen.push({ job, attempt: ctx.attempt }), { ok: true }) });
    const assigned = once(f.events, 'assigned');
    f.a.assign(claimed(1));
    expect(await assigned).toEqual([{ attemptId: ID(1), jobId: 'job-1', attemptNo: 1 }]);
    expect(f.a.ids()).toEqual([ID(1)]);
    expect(f.a.unconfirmed()).toEqual([ID(1)]);
    await vi.advanceTimersByTimeAsync(0);
    expect(seen, 'claimed only: the handler waits').toEqual([]);

    const finished = once(f.events, 'finished');
    expect(f.a.renewed([ID(1)], ahead())).toBeUndefined();
    expect(await finished).toEqual([{ attemptId: ID(1), kind: 'completed' }]);
    expect(seen).toEqual([{ job: { id: 'job-1', queue: 'q', payload: { n: 1 }, priority: 2, attemptNo: 1, labels: { os: 'x' } }, attempt: { id: ID(1), number: 1 } }]);
    expect(f.heldAtWrite, 'still held while its report is written').toEqual([[ID(1)]]);
    expect(f.written).toEqual([expect.objectContaining({ attemptId: ID(1), jobId: 'job-1', queue: 'q', attemptNo: 1, kind: 'completed', result: { ok: true } })]);
    expect(f.finished).toEqual(f.written);
    expect(f.a.ids()).toEqual([]);
  });

  it('keeps the attempt held (resumable) for as long as its report is being written', async () => {
    const f = fixture({ q: async () => ({}) });
    f.holdWrites = true;
    f.a.assign(claimed(1));
    f.a.renewed([ID(1)], ahead());
    await vi.advanceTimersByTimeAsync(0);
    expect(f.written).toHaveLength(1);
    expect(f.a.resumable()).toEqual([ID(1)]);
    expect(f.finished).toEqual([]);
    f.releaseWrite();
    await vi.advanceTimersByTimeAsync(0);
    expect(f.a.ids()).toEqual([]);
    expect(f.finished).toHaveLength(1);
  });

  it('turns results and throws into reports: non-objects under value, JobError with its details and retryable flag', async () => {
    const f = fixture({
      num: () => 42,
      none: () => undefined,
      final: () => {
        throw new JobError('bad input', { retryable: false, details: { field: 'x' } });
      },
      flaky: () => {
        throw new Error('flaky');
      },
    });
    const queues = ['num', 'none', 'final', 'flaky', 'unhandled'];
    queues.forEach((q, i) => f.a.assign(claimed(i + 1, q)));
    f.a.renewed(queues.map((_, i) => ID(i + 1)), ahead());
    await vi.advanceTimersByTimeAsync(0);
    const byQueue = Object.fromEntries(f.written.map((e) => [e.queue, { kind: e.kind, result: e.result, error: e.error, retryable: e.retryable }]));
    expect(byQueue).toEqual({
      num: { kind: 'completed', result: { value: 42 }, error: undefined, retryable: undefined },
      none: { kind: 'completed', result: {}, error: undefined, retryable: undefined },
      final: { kind: 'failed', result: undefined, error: { message: 'bad input', details: { field: 'x' } }, retryable: false },
      flaky: { kind: 'failed', result: undefined, error: { message: 'flaky' }, retryable: true },
      unhandled: { kind: 'failed', result: undefined, error: { message: expect.any(String) }, retryable: false },
    });
  });

  it('an attempt aborted before its start is confirmed never runs: its slot is freed, nothing reported', async () => {
    const handler = vi.fn(async () => ({}));
    const f = fixture({ q: handler });
    f.a.assign(claimed(1));
    const aborted = once(f.events, 'aborted');
    f.a.abort(ID(1), 'revoked', 'lease_expired');
    expect(await aborted).toEqual([{ attemptId: ID(1), reason: 'revoked', revoke: 'lease_expired' }]);
    expect(f.freed).toBe(1);
    expect(f.a.ids()).toEqual([]);
    expect(f.a.renewed([ID(1)], ahead()), 'a renewal for it now: not held').toEqual([ID(1)]);
    await f.a.settled(1000);
    expect(handler).not.toHaveBeenCalled();
    expect(f.written).toEqual([]);
  });

  it('keeps the attempt it holds when the same attempt is assigned again: one handler, still watched', async () => {
    let signal: AbortSignal | undefined;
    const handler = vi.fn((_job: unknown, ctx: JobContext) => {
      signal = ctx.signal;
      return new Promise<void>((r) => ctx.signal.addEventListener('abort', () => r()));
    });
    const f = fixture({ q: handler });
    const assigned: unknown[] = [];
    f.events.on('assigned', (e) => assigned.push(e));
    f.a.assign(claimed(1));
    f.a.renewed([ID(1)], performance.now() + 2000);
    await vi.advanceTimersByTimeAsync(0);
    f.a.assign(claimed(1));
    f.a.renewed([ID(1)], performance.now() + 1000);
    await vi.advanceTimersByTimeAsync(0);
    expect(handler).toHaveBeenCalledTimes(1);
    expect(assigned).toHaveLength(1);
    expect(f.a.ids()).toEqual([ID(1)]);
    // The handler's own signal is the one the watchdog aborts when the deadline passes.
    await vi.advanceTimersByTimeAsync(2200);
    expect(signal?.aborted).toBe(true);
  });

  it('a deadline that is not a number counts as passed: the handler never starts', async () => {
    const handler = vi.fn(async () => ({}));
    const f = fixture({ q: handler });
    f.a.assign(claimed(1));
    f.a.renewed([ID(1)], Number.NaN);
    await vi.advanceTimersByTimeAsync(0);
    expect(handler).not.toHaveBeenCalled();
    expect(f.freed).toBe(1);
    expect(f.a.ids()).toEqual([]);
  });

  it('a renewal whose deadline is not a number leaves no started attempt unwatched', async () => {
    let signal: AbortSignal | undefined;
    const f = fixture({ q: (_job, ctx) => ((signal = ctx.signal), new Promise<void>((r) => ctx.signal.addEventListener('abort', () => r()))) });
    f.a.assign(claimed(1));
    f.a.renewed([ID(1)], performance.now() + 1000);
    await vi.advanceTimersByTimeAsync(0);
    f.a.renewed([ID(1)], Number.NaN);
    await vi.advanceTimersByTimeAsync(1200);
    expect(signal?.aborted).toBe(true);
  });

  it('a start confirmed after its deadline is given up without running the handler', async () => {
    const handler = vi.fn(async () => ({}));
    const f = fixture({ q: handler });
    f.a.assign(claimed(1));
    f.a.renewed([ID(1)], performance.now());
    await vi.advanceTimersByTimeAsync(0);
    expect(handler).not.toHaveBeenCalled();
    expect(f.freed).toBe(1);
    expect(f.a.ids()).toEqual([]);
  });

  it('aborts on the local deadline, moved only forward by renewals, and reports a handler that keeps running as a zombie', async () => {
    let signal: AbortSignal | undefined;
    let finish!: () => void;
    const f = fixture({
      q: (_job, ctx) => {
        signal = ctx.signal;
        return new Promise<void>((r) => (finish = r));
      },
    });
    const aborted: unknown[] = [];
    const zombies: unknown[] = [];
    f.events.on('aborted', (e) => aborted.push(e));
    f.events.on('zombie', (e) => zombies.push(e));
    f.a.assign(claimed(1));
    const t0 = performance.now();
    f.a.renewed([ID(1)], t0 + 3000);
    f.a.renewed([ID(1)], t0 + 2000); // an older answer, come late
    await vi.advanceTimersByTimeAsync(2500);
    expect(signal?.aborted, 'the later deadline holds').toBe(false);
    await vi.advanceTimersByTimeAsync(600);
    expect(signal?.aborted).toBe(true);
    expect(aborted).toEqual([{ attemptId: ID(1), reason: expect.any(String) }]);
    expect(f.a.holdsLeases()).toBe(false);
    expect(f.a.resumable(), 'aborted: not resumed').toEqual([]);
    expect(zombies).toEqual([]);
    await vi.advanceTimersByTimeAsync(HEARTBEAT + 100);
    expect(zombies, 'still running one interval after the abort').toEqual([{ attemptId: ID(1) }]);
    await vi.advanceTimersByTimeAsync(HEARTBEAT * 3);
    expect(zombies, 'reported once').toHaveLength(1);
    finish();
    await vi.advanceTimersByTimeAsync(0);
    expect(f.written.map((e) => e.kind)).toEqual(['completed']);
  });

  it('ticks its watchdog (deadlines, the silence check) only while it holds attempts', async () => {
    let finish!: () => void;
    const f = fixture({ q: () => new Promise<void>((r) => (finish = r)) });
    await vi.advanceTimersByTimeAsync(1000);
    expect(f.silenceChecks, 'nothing held').toBe(0);
    f.a.assign(claimed(1));
    f.a.renewed([ID(1)], ahead());
    await vi.advanceTimersByTimeAsync(1000);
    expect(f.silenceChecks).toBeGreaterThanOrEqual(9);
    finish();
    await vi.advanceTimersByTimeAsync(200);
    const after = f.silenceChecks;
    await vi.advanceTimersByTimeAsync(5000);
    expect(f.silenceChecks, 'nothing held again: no ticks').toBe(after);
    expect(vi.getTimerCount()).toBe(0);
  });

  it('sends progress with the next heartbeat only, and stop() aborts everything held', async () => {
    const f = fixture({
      q: (_job, ctx) => {
        ctx.progress({ pct: 50 });
        return new Promise<void>((_, reject) => ctx.signal.addEventListener('abort', () => reject(ctx.signal.reason as Error)));
      },
    });
    f.a.assign(claimed(1));
    f.a.assign(claimed(2));
    f.a.renewed([ID(1)], ahead());
    await vi.advanceTimersByTimeAsync(0);
    const progress = f.a.takeProgress();
    expect(progress.map((p) => [p.attemptId, p.progress])).toEqual([[ID(1), expect.objectContaining({ kind: { case: 'structValue', value: expect.anything() } })]]);
    expect(f.a.takeProgress(), 'unchanged since').toEqual([]);
    expect(f.a.unconfirmed()).toEqual([ID(2)]);

    f.a.stop('agent stopped');
    await f.a.settled(1000);
    expect(f.written.map((e) => [e.attemptId, e.kind, e.retryable])).toEqual([[ID(1), 'failed', true]]);
    expect(f.freed, 'the one never started gives its slot back here (a finished one, through the reporter)').toBe(1);
    f.a.assign(claimed(3));
    expect(vi.getTimerCount(), 'stopped: no watchdog again').toBe(0);
  });
});
