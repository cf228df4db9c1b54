/**
 * The agent SDK's session (agent-client/src/session.ts) on its own, against fake channels whose
 * streams record what is written and answer what the test makes them answer: Hello and Welcome,
 * heartbeats, reconnecting to the next address (after a backoff, or at once on GoAway or a
 * silent coordinator), a permanent refusal, and the lease deadline a `Renewed` grants. Fake
 * timers move the clock; no coordinator.
 */
import { EventEmitter } from 'node:events';
import { create, type MessageInitShape } from '@bufbuild/protobuf';
import { durationFromMs } from '@bufbuild/protobuf/wkt';
import pino from 'pino';
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { grpc } from '../agent-client/src/channel.js';
import type { AgentMessageInit } from '../agent-client/src/codec.js';
import { ServerMessageSchema, type ServerMessage } from '../agent-client/src/gen/leasehold/v1/agent_service_pb.js';
import { AGENT_VERSION } from '../agent-client/src/lane.js';
import { Session, type AgentStream, type SessionHooks, type StreamChannel } from '../agent-client/src/session.js';

class FakeStream extends EventEmitter implements AgentStream {
  readonly written: AgentMessageInit[] = [];
  ended = false;
  canceled = false;
  write(m: AgentMessageInit): boolean {
    this.written.push(m);
    return true;
  }
  end(): void {
    this.ended = true;
  }
  /** As grpc-js does: a canceled call ends with CANCELLED, on a later tick. */
  cancel(): void {
    this.canceled = true;
    process.nextTick(() => this.fail(grpc.status.CANCELLED));
  }
  receive(m: MessageInitShape<typeof ServerMessageSchema>['kind']): void {
    this.emit('data', create(ServerMessageSchema, { kind: m }));
  }
  fail(code: grpc.status, details = ''): void {
    this.emit('error', Object.assign(new Error(details), { code, details, metadata: new grpc.Metadata() }));
  }
  kinds(): Array<string | undefined> {
    return this.written.map((m) => m.kind?.case);
  }
}

class FakeChannel implements StreamChannel {
  readonly streams: FakeStream[] = [];
  closed = false;
  connect(): FakeStream {
    const s = new FakeStream();
    this.streams.push(s);
    return s;
  }
  close(): void {
    this.closed = true;
  }
  get last(): FakeStream {
    return this.streams.at(-1)!;
  }
}

const hello = { agentId: 'a1', token: 'tok', queues: ['q'], labels: { os: 'linux' }, slots: 3 };
const welcome = (over: { leaseTtlMs?: number; heartbeatMs?: number } = {}) =>
  ({
    case: 'welcome',
    value: { sessionId: 's1', leaseTtl: durationFromMs(over.leaseTtlMs ?? 10_000), heartbeatInterval: durationFromMs(over.heartbeatMs ?? 1000) },
  }) as const;
const goAway = { case: 'goAway', value: { detail: 'deploy' } } as const;

function hooks(over: Partial<SessionHooks> = {}): SessionHooks & { calls: Record<string, unknown[][]> } {
  const calls: Record<string, unknown[][]> = { welcomed: [], message: [], disconnected: [], refused: [] };
  return {
    calls,
    resume: () => ['r1'],
    progress: () => [],
    welcomed: (...a) => void calls.welcomed!.push(a),
    message: (...a) => void calls.message!.push(a),
    disconnected: (...a) => void calls.disconnected!.push(a),
    refused: async (...a) => void calls.refused!.push(a),
    ...over,
  };
}

const sessions: Session[] = [];
function session(h: SessionHooks, reconnect = { baseMs: 100, maxMs: 1000 }): Session<FakeChannel> {
  const s = new Session<FakeChannel>({ log: pino({ level: 'silent' }), reconnect, hooks: h });
  sessions.push(s);
  return s;
}

beforeEach(() => {
  vi.useFakeTimers();
  // The backoff's jitter at its top: the wait is exactly the backoff.
  vi.spyOn(Math, 'random').mockReturnValue(1);
});
afterEach(() => {
  for (const s of sessions.splice(0)) s.close();
  vi.useRealTimers();
  vi.restoreAllMocks();
});

describe('session', () => {
  it('says Hello with the resumed attempts, is ready at Welcome, takes its lease and heartbeat, and heartbeats on the interval', async () => {
    let progressAsked = 0;
    const h = hooks({ progress: () => (progressAsked++, []) });
    const s = session(h);
    const ch = new FakeChannel();
    const { ready } = s.start([ch], hello);
    const stream = ch.last;
    expect(stream.written[0]).toEqual({ kind: { case: 'hello', value: { ...hello, agentVersion: AGENT_VERSION, resume: ['r1'], seq: 1n } } });
    expect(s.connected).toBe(false);
    expect(s.send({ kind: { case: 'credit', value: { n: 1 } } }), 'nothing goes out before Welcome').toBe(false);

    stream.receive(welcome({ leaseTtlMs: 8000, heartbeatMs: 2000 }));
    await ready;
    expect(s.connected).toBe(true);
    expect([s.leaseTtlMs, s.heartbeatMs]).toEqual([8000, 2000]);
    expect(h.calls.welcomed).toHaveLength(1);
    expect(stream.kinds(), 'the first heartbeat at once').toEqual(['hello', 'heartbeat']);

    await vi.advanceTimersByTimeAsync(1999);
    expect(stream.kinds()).toEqual(['hello', 'heartbeat']);
    await vi.advanceTimersByTimeAsync(1);
    expect(stream.kinds()).toEqual(['hello', 'heartbeat', 'heartbeat']);
    expect(progressAsked).toBe(2);
    const seqs = stream.written.map((m) => (m.kind?.value as { seq?: bigint }).seq);
    expect(seqs, 'each numbered').toEqual([1n, 2n, 3n]);
  });

  it('hands every message but Welcome and GoAway to the agent', async () => {
    const h = hooks();
    const s = session(h);
    const ch = new FakeChannel();
    s.start([ch], hello);
    ch.last.receive(welcome());
    ch.last.receive(goAway);
    ch.last.receive({ case: 'drain', value: {} });
    expect(h.calls.message!.map(([m]) => (m as ServerMessage).kind.case)).toEqual(['drain']);
  });

  it('reconnects to the next address after a backoff that doubles, and to the one after a GoAway at once', async () => {
    const h = hooks();
    const s = session(h);
    const a = new FakeChannel();
    const b = new FakeChannel();
    s.start([a, b], hello);
    a.last.fail(grpc.status.UNAVAILABLE);
    expect(h.calls.disconnected).toHaveLength(1);
    await vi.advanceTimersByTimeAsync(99);
    expect(b.streams).toHaveLength(0);
    await vi.advanceTimersByTimeAsync(1);
    expect(b.streams, 'the next address after 100 ms').toHaveLength(1);

    b.last.fail(grpc.status.UNAVAILABLE);
    await vi.advanceTimersByTimeAsync(199);
    expect(a.streams).toHaveLength(1);
    await vi.advanceTimersByTimeAsync(1);
    expect(a.streams, 'a second failure in a row waits twice as long').toHaveLength(2);

    a.last.receive(welcome());
    a.last.receive(goAway);
    a.last.emit('end');
    await vi.advanceTimersByTimeAsync(0);
    expect(b.streams, 'told to go: the next address without waiting').toHaveLength(2);
    expect(b.last.written[0]?.kind?.case).toBe('hello');
  });

  it('gives up when the coordinator refuses the agent for good before any Welcome: the agent lets go, ready rejects', async () => {
    const h = hooks();
    const s = session(h);
    const ch = new FakeChannel();
    const { ready, loop } = s.start([ch], hello);
    const refused = expect(ready).rejects.toThrow(/refused this agent: bad token/);
    ch.last.fail(grpc.status.UNAUTHENTICATED, 'bad%20token');
    await refused;
    await loop;
    expect(h.calls.refused).toEqual([[new Error('the coordinator refused this agent: bad token'), false]]);
    await vi.advanceTimersByTimeAsync(60_000);
    expect(ch.streams, 'no retry').toHaveLength(1);
  });

  it('settles ready when stopped before any Welcome (the coordinator unreachable): it rejects, the loop ends', async () => {
    const h = hooks();
    const s = session(h);
    const ch = new FakeChannel();
    const { ready, loop } = s.start([ch], hello);
    const stopped = expect(ready).rejects.toThrow(/stopped before the coordinator welcomed it/);
    ch.last.fail(grpc.status.UNAVAILABLE);
    await vi.advanceTimersByTimeAsync(50);
    s.close();
    await stopped;
    await loop;
    await vi.advanceTimersByTimeAsync(60_000);
    expect(ch.streams, 'no retry after close').toHaveLength(1);
  });

  it('retries a refusal that comes after it was welcomed once', async () => {
    const h = hooks();
    const s = session(h);
    const ch = new FakeChannel();
    const { ready } = s.start([ch], hello);
    ch.last.receive(welcome());
    await ready;
    ch.last.fail(grpc.status.UNAUTHENTICATED);
    await vi.advanceTimersByTimeAsync(100);
    expect(ch.streams).toHaveLength(2);
    expect(h.calls.refused).toHaveLength(0);
  });

  it('after it was welcomed, gives up on a Hello refused as UNAUTHENTICATED (revoked, unknown token), and only on that', async () => {
    const h = hooks();
    const s = session(h);
    const ch = new FakeChannel();
    const { ready, loop } = s.start([ch], hello);
    ch.last.receive(welcome());
    await ready;
    // What a coordinator answers while it restarts or its database is down, before a Welcome:
    // retried, as is a Hello the same coordinator welcomed before and now finds invalid.
    const transient = [grpc.status.UNAVAILABLE, grpc.status.INTERNAL, grpc.status.UNKNOWN, grpc.status.INVALID_ARGUMENT, grpc.status.PERMISSION_DENIED];
    for (const [i, code] of transient.entries()) {
      ch.last.fail(code, 'transient');
      await vi.advanceTimersByTimeAsync(1000);
      expect(ch.streams, grpc.status[code]).toHaveLength(i + 2);
    }
    expect(h.calls.refused).toHaveLength(0);

    ch.last.fail(grpc.status.UNAUTHENTICATED, 'Hello%20refused:%20agent%20a1%20was%20revoked');
    await loop;
    expect(h.calls.refused).toEqual([[new Error('the coordinator refused this agent: Hello refused: agent a1 was revoked'), true]]);
    await vi.advanceTimersByTimeAsync(60_000);
    expect(ch.streams, 'no retry').toHaveLength(transient.length + 1);
  });

  it('counts a renewal from when the message it answers was sent, not from when the answer came', async () => {
    const s = session(hooks());
    const ch = new FakeChannel();
    s.start([ch], hello);
    ch.last.receive(welcome({ leaseTtlMs: 10_000, heartbeatMs: 1000 }));
    const sentAt = performance.now();
    const seq = s.nextSeq();
    await vi.advanceTimersByTimeAsync(3000); // the answer is slow
    expect(s.renewalDeadline(seq, undefined)).toBe(sentAt + 10_000 - 1000);
    expect(s.renewalDeadline(seq, durationFromMs(4000)), "the Renewed's own TTL when it gives one").toBe(sentAt + 4000 - 1000);
    expect(s.renewalDeadline(0n, undefined), 'no seq echoed: from the arrival').toBe(performance.now() + 10_000 - 1000);
    expect(s.renewalDeadline(9999n, undefined), 'a message it does not know: passed').toBe(-Infinity);
  });

  it('forgets send times older than a lease at each heartbeat: a renewal answering one grants nothing', async () => {
    const s = session(hooks());
    const ch = new FakeChannel();
    s.start([ch], hello);
    ch.last.receive(welcome({ leaseTtlMs: 5000, heartbeatMs: 1000 }));
    const old = s.nextSeq();
    expect(s.renewalDeadline(old, undefined)).toBeGreaterThan(performance.now());
    await vi.advanceTimersByTimeAsync(6000);
    expect(s.renewalDeadline(old, undefined)).toBe(-Infinity);
  });

  it('moves to the next address at once when the coordinator is silent while leases are held', async () => {
    const s = session(hooks());
    const a = new FakeChannel();
    const b = new FakeChannel();
    s.start([a, b], hello);
    a.last.receive(welcome({ heartbeatMs: 2000 }));
    let holding = false;
    await vi.advanceTimersByTimeAsync(3000);
    s.checkSilence(performance.now(), () => holding);
    expect(a.last.canceled, 'nothing held: the silence does not matter').toBe(false);
    holding = true;
    s.checkSilence(performance.now() - 1, () => holding);
    expect(a.last.canceled, 'under one and a half intervals').toBe(false);
    s.checkSilence(performance.now(), () => holding);
    expect(a.last.canceled).toBe(true);
    expect(s.connected).toBe(false);
    await vi.advanceTimersByTimeAsync(0);
    expect(b.streams).toHaveLength(1);
  });

  it('close() ends the stream and the loop and closes every channel', async () => {
    const s = session(hooks());
    const a = new FakeChannel();
    const b = new FakeChannel();
    const { loop } = s.start([a, b], hello);
    a.last.receive(welcome());
    s.close();
    expect(a.last.ended && a.last.canceled).toBe(true);
    expect(a.closed && b.closed).toBe(true);
    await vi.advanceTimersByTimeAsync(0);
    await loop;
    expect(b.streams).toHaveLength(0);
  });
});
