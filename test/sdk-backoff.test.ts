/**
 * The agent SDK's reconnect backoff (agent-client/src/session.ts) after streams that were
 * welcomed: a coordinator whose database refuses writes welcomes the agent, then ends the
 * stream at the first report it cannot store. Such streams, ended in error within seconds of
 * their Welcome, make the wait grow as refusals do; a stream that lived starts it over; once
 * welcomed, the wait never passes half the lease. Fake channels and fake timers, no coordinator
 * (as test/sdk-session.test.ts); the jitter is pinned at its top, so a wait is the backoff.
 */
import { EventEmitter } from 'node:events';
import { create, type MessageInitShape } from '@bufbuild/protobuf';
import { durationFromMs } from '@bufbuild/protobuf/wkt';
import pino from 'pino';
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { grpc } from '../agent-client/src/channel.js';
import type { AgentMessageInit } from '../agent-client/src/codec.js';
import { ServerMessageSchema } from '../agent-client/src/gen/leasehold/v1/agent_service_pb.js';
import { Session, type AgentStream, type StreamChannel } from '../agent-client/src/session.js';

class FakeStream extends EventEmitter implements AgentStream {
  write(_m: AgentMessageInit): boolean {
    return true;
  }
  end(): void {}
  cancel(): void {
    process.nextTick(() => this.fail(grpc.status.CANCELLED));
  }
  receive(m: MessageInitShape<typeof ServerMessageSchema>['kind']): void {
    this.emit('data', create(ServerMessageSchema, { kind: m }));
  }
  fail(code: grpc.status, details = ''): void {
    this.emit('error', Object.assign(new Error(details), { code, details, metadata: new grpc.Metadata() }));
  }
}

class FakeChannel implements StreamChannel {
  readonly streams: FakeStream[] = [];
  connect(): FakeStream {
    const s = new FakeStream();
    this.streams.push(s);
    return s;
  }
  close(): void {}
  get last(): FakeStream {
    return this.streams.at(-1)!;
  }
}

const hello = { agentId: 'a1', token: 'tok', queues: ['q'], labels: {}, slots: 1 };
const welcome = (leaseTtlMs: number) =>
  ({ case: 'welcome', value: { sessionId: 's1', leaseTtl: durationFromMs(leaseTtlMs), heartbeatInterval: durationFromMs(1000) } }) as const;

const sessions: Session[] = [];
function start(reconnect: { baseMs: number; maxMs: number }): FakeChannel {
  const s = new Session<FakeChannel>({
    log: pino({ level: 'silent' }),
    reconnect,
    hooks: { resume: () => [], progress: () => [], welcomed: () => {}, message: () => {}, disconnected: () => {}, refused: async () => {} },
  });
  sessions.push(s);
  const ch = new FakeChannel();
  s.start([ch], hello);
  return ch;
}

/** How long after its stream ended the session opened the next one (ms, on the fake clock). */
async function waitBeforeNext(ch: FakeChannel): Promise<number> {
  const n = ch.streams.length;
  const from = Date.now();
  await vi.advanceTimersByTimeAsync(0);
  while (ch.streams.length === n) {
    if (Date.now() - from > 120_000) throw new Error('no reconnect within 120 s');
    await vi.advanceTimersToNextTimerAsync();
  }
  return Date.now() - from;
}

/** Welcomed, then ended in error at once (a report the coordinator could not store): the waits before each next stream. */
async function welcomedThenFailed(ch: FakeChannel, times: number, leaseTtlMs: number): Promise<number[]> {
  const waits: number[] = [];
  for (let i = 0; i < times; i++) {
    ch.last.receive(welcome(leaseTtlMs));
    ch.last.fail(grpc.status.INTERNAL, 'jobs_live: could not extend file: No space left on device');
    waits.push(await waitBeforeNext(ch));
  }
  return waits;
}

beforeEach(() => {
  vi.useFakeTimers();
  vi.spyOn(Math, 'random').mockReturnValue(1);
});
afterEach(() => {
  for (const s of sessions.splice(0)) s.close();
  vi.useRealTimers();
  vi.restoreAllMocks();
});

describe('reconnect backoff after a Welcome', () => {
  it('grows when each welcomed stream ends in error at once, instead of starting over from the base', async () => {
    const ch = start({ baseMs: 100, maxMs: 10_000 });
    expect(await welcomedThenFailed(ch, 7, 60_000)).toEqual([100, 200, 400, 800, 1600, 3200, 6400]);
  });

  it('starts over after a stream that lived longer than a few seconds', async () => {
    const ch = start({ baseMs: 100, maxMs: 10_000 });
    expect(await welcomedThenFailed(ch, 3, 60_000)).toEqual([100, 200, 400]);
    ch.last.receive(welcome(60_000));
    await vi.advanceTimersByTimeAsync(5000);
    ch.last.fail(grpc.status.UNAVAILABLE);
    expect(await waitBeforeNext(ch), 'a stream that worked: the base again').toBe(100);
    expect(await welcomedThenFailed(ch, 2, 60_000)).toEqual([200, 400]);
  });

  it('starts over after a welcomed stream that ended without error; after a GoAway, reconnects at once', async () => {
    const ch = start({ baseMs: 100, maxMs: 10_000 });
    expect(await welcomedThenFailed(ch, 3, 60_000)).toEqual([100, 200, 400]);
    ch.last.receive(welcome(60_000));
    ch.last.emit('end');
    expect(await waitBeforeNext(ch)).toBe(100);
    ch.last.receive(welcome(60_000));
    ch.last.receive({ case: 'goAway', value: { detail: 'deploy' } });
    ch.last.fail(grpc.status.UNAVAILABLE, 'stopping');
    expect(await waitBeforeNext(ch)).toBe(0);
  });

  it('never waits more than half the lease once welcomed, refused streams after it included', async () => {
    const ch = start({ baseMs: 100, maxMs: 10_000 });
    // A 2 s lease: waits up to 1 s, so the agent is back while its leases run.
    expect(await welcomedThenFailed(ch, 6, 2000)).toEqual([100, 200, 400, 800, 1000, 1000]);
    ch.last.fail(grpc.status.UNAVAILABLE, 'the database is down');
    expect(await waitBeforeNext(ch), 'a Hello refused after it').toBe(1000);
  });
});
