/**
 * The connection: one stream to the coordinator at a time, kept open across failures.
 *
 * - Opens each stream with `Hello` (queues, labels, slots, the attempts still running locally
 *   to resume, and this agent's version), reconnecting with exponential backoff and jitter after
 *   any failure, to the next address of the list.
 * - Takes the lease TTL and heartbeat interval from `Welcome`, logs the coordinator's version it
 *   gives (the `connected` line), and sends `Heartbeat` every `heartbeat_interval` while connected.
 * - Numbers each Hello, Started and Heartbeat (`seq`) and notes when it was sent, so that a lease
 *   a `Renewed` grants counts from when the message it answers was sent (`renewalDeadline`).
 * - Moves to the next address at once on `GoAway`, or when the coordinator falls silent while
 *   leases are held (`checkSilence`).
 * What the messages mean to the agent's work is the agent's: it gets them through `SessionHooks`.
 */
import type { MessageInitShape } from '@bufbuild/protobuf';
import { durationMs, type Duration } from '@bufbuild/protobuf/wkt';
import type { Logger } from 'pino';
import { grpc } from './channel.js';
import { monotonic } from './clock.js';
import type { AgentMessageInit } from './codec.js';
import { AGENT_VERSION } from './lane.js';
import type {
  AgentMessage_Heartbeat_ProgressSchema,
  ServerMessage,
  ServerMessage_Welcome,
} from './gen/leasehold/v1/agent_service_pb.js';

/** The agent stream as the session uses it (a grpc-js duplex call; a test gives a fake). */
export interface AgentStream {
  write(m: AgentMessageInit): boolean;
  end(): void;
  cancel(): void;
  on(event: 'data', listener: (m: ServerMessage) => void): unknown;
  on(event: 'error', listener: (err: grpc.ServiceError) => void): unknown;
  on(event: 'end', listener: () => void): unknown;
}

/** What the session needs of a channel (`CoordinatorChannel`): a stream to open, and closing. */
export interface StreamChannel {
  connect(): AgentStream;
  close(): void;
}

/** The Hello's fields that do not change between streams. */
export interface HelloFields {
  agentId: string;
  token: string;
  queues: string[];
  labels: Record<string, string>;
  slots: number;
}

/** One attempt's progress, as a heartbeat carries it. */
export type HeartbeatProgress = MessageInitShape<typeof AgentMessage_Heartbeat_ProgressSchema>;

/** What the session asks of the agent, and tells it. */
export interface SessionHooks {
  /** The attempts to resume in a Hello: those still running here. */
  resume(): string[];
  /** The progress a heartbeat carries (what changed since the last one). */
  progress(): HeartbeatProgress[];
  /** A `Welcome` set up this stream (lease, heartbeat interval, the first heartbeat sent). */
  welcomed(welcome: ServerMessage_Welcome): void;
  /** Any message but `Welcome` and `GoAway`, which the session handles itself. */
  message(m: ServerMessage): void;
  disconnected(error?: grpc.ServiceError): void;
  /**
   * The coordinator refused this agent for good (`refusedForGood`): let everything go. `started`:
   * after it had welcomed the agent once (then `ready` has resolved already, and only this hook
   * tells of it); before, `ready` rejects with `error` once this has settled.
   */
  refused(error: Error, started: boolean): Promise<void>;
}

export interface SessionOptions {
  log: Logger;
  /** Reconnect backoff: base and cap; default 250 ms and 30 s (once welcomed, half the lease at most). */
  reconnect?: { baseMs?: number; maxMs?: number };
  hooks: SessionHooks;
}

/** The `connected` line's `coordinatorVersion` for a coordinator older than `Welcome.coordinator_version`. */
const NOT_SENT = 'not sent (a coordinator from before versions were sent)';

/** Below this, a silence is a busy machine's noise (GC, a slow query), not a gone coordinator. */
const SILENCE_FLOOR_MS = 2000;

/**
 * A welcomed stream that ends in error sooner than this after its Welcome did not work either:
 * the reconnect backoff keeps growing rather than starting over (`connectLoop`).
 */
const BRIEF_SESSION_MS = 5000;

/** Permanent refusals: retrying cannot help until someone changes the config or the token. */
const PERMANENT = new Set([grpc.status.UNAUTHENTICATED, grpc.status.INVALID_ARGUMENT, grpc.status.PERMISSION_DENIED]);

/**
 * Whether a stream's end refuses the agent for good. Before the first Welcome, any permanent
 * code. After it, only a Hello refused as UNAUTHENTICATED (the stream never welcomed): the
 * coordinator answers that for a token it does not know or an agent revoked, and a revoked name
 * never comes back (server/transport/agent-routes.ts), so retrying would loop for good. What a
 * coordinator answers while it restarts or its database is down (UNAVAILABLE, INTERNAL, a dropped
 * connection) is retried; so is UNAUTHENTICATED ending a welcomed stream (the revocation itself,
 * `agent … was revoked`): the next Hello says whether it holds. INVALID_ARGUMENT or
 * PERMISSION_DENIED after a Welcome are retried too: the same Hello was welcomed before.
 */
function refusedForGood(r: { welcomed: boolean; error?: grpc.ServiceError }, started: boolean): boolean {
  if (!r.error) return false;
  if (!started) return PERMANENT.has(r.error.code);
  return !r.welcomed && r.error.code === grpc.status.UNAUTHENTICATED;
}

export class Session<C extends StreamChannel = StreamChannel> {
  private readonly log: Logger;
  private readonly hooks: SessionHooks;
  private channels: C[] = [];
  /** Index of the replica in use (or to try next). */
  private current = 0;
  /** The coordinator said GoAway: reconnect to the next address without waiting. */
  private goAway = false;
  private call: AgentStream | undefined;
  private isConnected = false;
  /** When the coordinator last said anything on this stream (`monotonic()`). */
  private lastHeard = 0;
  /** The last number given to a Hello, Started or Heartbeat (the `Renewed` answering it echoes it). */
  private seq = 0n;
  /** When each numbered message was sent (monotonic), while a lease counted from it could still run. */
  private readonly sentAt = new Map<bigint, number>();
  private ttlMs = 30_000;
  private intervalMs = 10_000;
  private heartbeatTimer: NodeJS.Timeout | undefined;
  private stopping = false;
  /** Cuts the reconnect wait short (on stop). */
  private wakeLoop: (() => void) | undefined;

  constructor(private readonly options: SessionOptions) {
    this.log = options.log;
    this.hooks = options.hooks;
  }

  /**
   * Connects, and keeps connecting until `close()`: `ready` resolves at the first `Welcome`, or
   * rejects if the coordinator refuses the agent for good (bad token, bad Hello) before that;
   * `loop` settles when the session ends: closed, or refused for good (`hooks.refused`), also
   * after a Welcome (the agent revoked, its token unknown).
   */
  start(channels: C[], hello: HelloFields): { ready: Promise<void>; loop: Promise<void> } {
    this.channels = channels;
    let first: { resolve: () => void; reject: (e: Error) => void } | undefined;
    const ready = new Promise<void>((resolve, reject) => (first = { resolve, reject }));
    return { ready, loop: this.connectLoop(hello, first!) };
  }

  /** Ends the stream in use and the reconnect loop; closes the channels. Safe to call twice. */
  close(): void {
    this.stopping = true;
    clearInterval(this.heartbeatTimer);
    this.call?.end();
    this.call?.cancel();
    for (const c of this.channels) c.close();
    this.wakeLoop?.();
  }

  /** A stream is open and welcomed. */
  get connected(): boolean {
    return this.isConnected;
  }

  /** The channel in use (it changes when the agent fails over to another replica). */
  get channel(): C {
    return this.channels[this.current]!;
  }

  /** The lease TTL the coordinator gave (its Welcome). */
  get leaseTtlMs(): number {
    return this.ttlMs;
  }

  /** The heartbeat interval the coordinator gave (its Welcome). */
  get heartbeatMs(): number {
    return this.intervalMs;
  }

  /** Sends on the stream if connected; false if not sent (or the stream wants a pause). */
  send(m: AgentMessageInit): boolean {
    if (!this.call || !this.isConnected) return false;
    return this.call.write(m);
  }

  /** A number for a message about to be sent, its send time noted. */
  nextSeq(): bigint {
    this.seq++;
    this.sentAt.set(this.seq, monotonic());
    return this.seq;
  }

  /**
   * The local end of a lease counted from `from`: one heartbeat interval before the coordinator's,
   * so the work stops before another agent can be given the job.
   */
  localDeadline(from = monotonic(), ttlMs = this.ttlMs): number {
    return from + ttlMs - this.intervalMs;
  }

  /**
   * The local end of a lease a `Renewed` granted. The lease runs from the coordinator's renewal,
   * which came after it received the message echoed in seq: counted from when that was sent,
   * never from when the answer arrived (it may have waited in a slow network, or in the socket
   * while this process was frozen). A coordinator that echoes nothing (0) is counted from the
   * answer's arrival, as before. A message too old to be remembered gives a deadline passed.
   */
  renewalDeadline(seq: bigint, leaseTtl: Duration | undefined): number {
    const sent = seq ? this.sentAt.get(seq) : monotonic();
    return sent === undefined ? -Infinity : this.localDeadline(sent, leaseTtl ? durationMs(leaseTtl) : this.ttlMs);
  }

  /**
   * A coordinator that holds this agent's leases answers every heartbeat with `Renewed`. Silent
   * for one and a half heartbeat intervals (and at least `SILENCE_FLOOR_MS`) while leases are
   * held, it is frozen, stalled or cut off without the connection noticing (keepalive takes up to
   * 15 s): the agent moves to the next address at once and resumes there while the leases run.
   */
  checkSilence(now: number, holdingLeases: () => boolean): void {
    if (!this.isConnected || !this.call) return;
    const silentMs = now - this.lastHeard;
    if (silentMs < Math.max(this.intervalMs * 1.5, SILENCE_FLOOR_MS)) return;
    if (!holdingLeases()) return;
    this.log.warn({ silentMs: Math.round(silentMs), heartbeatMs: this.intervalMs }, 'the coordinator is silent while holding leases: moving to the next address to resume them');
    this.isConnected = false;
    this.goAway = true;
    this.call.cancel();
  }

  private async connectLoop(hello: HelloFields, first: { resolve: () => void; reject: (e: Error) => void }): Promise<void> {
    let failures = 0;
    let everConnected = false;
    const base = this.options.reconnect?.baseMs ?? 250;
    const max = this.options.reconnect?.maxMs ?? 30_000;
    const onWelcome = () => {
      if (everConnected) return;
      everConnected = true;
      first.resolve();
    };
    while (!this.stopping) {
      const r = await this.session(hello, onWelcome);
      if (this.stopping) break;
      if (refusedForGood(r, everConnected)) {
        const error = new Error(`the coordinator refused this agent: ${details(r.error!)}`);
        if (everConnected) this.log.error({ event: 'agent.refused', err: details(r.error!) }, 'the coordinator refused this agent for good: stopping');
        await this.hooks.refused(error, everConnected);
        if (!everConnected) first.reject(error);
        return;
      }
      // A Welcome starts the backoff over, unless its stream ended in error within seconds: a
      // coordinator whose database refuses writes welcomes, then ends the stream at the first
      // report it cannot store, and starting over from `base` each time reconnected 3–4 times a
      // second for as long as that lasted (a Hello and a resume each, against that database).
      const brief = r.welcomed && r.error !== undefined && !this.goAway && monotonic() - (r.welcomedAt ?? 0) < BRIEF_SESSION_MS;
      failures = r.welcomed && !brief ? 1 : failures + 1;
      // Another replica may be up: try the next address (a single one is simply retried).
      this.current = (this.current + 1) % this.channels.length;
      // Once welcomed, never more than half the lease the coordinator gave: an agent comes back
      // while the leases it holds still run, and within the grace the coordinator's reaper gives
      // agents after a database outage (one lease) to deliver the results their outboxes hold.
      const cap = everConnected ? Math.max(base, Math.min(max, this.ttlMs / 2)) : max;
      // Told to go (GoAway): the next address at once; the one after it with the usual backoff.
      const delay = this.goAway ? 0 : Math.min(base * 2 ** (failures - 1), cap) * (0.5 + Math.random() / 2);
      this.goAway = false;
      this.log.warn({ delayMs: Math.round(delay), err: r.error && details(r.error) }, 'disconnected from the coordinator; reconnecting');
      await new Promise<void>((res) => {
        const t = setTimeout(res, delay);
        this.wakeLoop = () => {
          clearTimeout(t);
          res();
        };
      });
      this.wakeLoop = undefined;
    }
    // Stopped before any Welcome: `start()` says so rather than never settling.
    if (!everConnected) first.reject(new Error('the agent was stopped before the coordinator welcomed it'));
  }

  /** One stream, from Hello to its end. */
  private session(hello: HelloFields, onWelcome: () => void): Promise<{ welcomed: boolean; welcomedAt?: number; error?: grpc.ServiceError }> {
    return new Promise((resolve) => {
      let welcomed = false;
      let welcomedAt: number | undefined;
      const call = this.channels[this.current]!.connect();
      this.call = call;
      call.write({ kind: { case: 'hello', value: { ...hello, agentVersion: AGENT_VERSION, resume: this.hooks.resume(), seq: this.nextSeq() } } });
      call.on('data', (m: ServerMessage) => {
        try {
          this.onMessage(m);
          if (m.kind.case === 'welcome') {
            welcomed = true;
            welcomedAt ??= monotonic();
            onWelcome();
          }
        } catch (err) {
          this.log.error({ err }, 'failed to handle a message from the coordinator');
        }
      });
      let settled = false;
      const done = (error?: grpc.ServiceError) => {
        if (settled) return;
        settled = true;
        this.isConnected = false;
        clearInterval(this.heartbeatTimer);
        if (this.call === call) this.call = undefined;
        this.hooks.disconnected(error);
        const at = welcomedAt === undefined ? {} : { welcomedAt };
        resolve(error ? { welcomed, ...at, error } : { welcomed, ...at });
      };
      call.on('error', (err: grpc.ServiceError) => done(err));
      call.on('end', () => done());
    });
  }

  private onMessage(m: ServerMessage): void {
    this.lastHeard = monotonic();
    const k = m.kind;
    switch (k.case) {
      case 'welcome':
        this.ttlMs = k.value.leaseTtl ? durationMs(k.value.leaseTtl) : this.ttlMs;
        this.intervalMs = k.value.heartbeatInterval ? durationMs(k.value.heartbeatInterval) : this.intervalMs;
        this.isConnected = true;
        this.log.info(
          {
            event: 'connected',
            sessionId: k.value.sessionId,
            // For people (which releases talk, after a failover too): never branched on.
            agentVersion: AGENT_VERSION,
            coordinatorVersion: k.value.coordinatorVersion || NOT_SENT,
            leaseTtlMs: this.ttlMs,
            heartbeatMs: this.intervalMs,
          },
          'connected to the coordinator',
        );
        this.heartbeatTimer = setInterval(() => this.heartbeat(), this.intervalMs);
        this.heartbeat();
        this.hooks.welcomed(k.value);
        return;
      case 'goAway':
        // A restart or a deploy: move at once, keep the work running, resume it there.
        this.log.info({ detail: k.value.detail }, 'the coordinator is stopping; moving to the next address');
        this.goAway = true;
        return;
      default:
        this.hooks.message(m);
    }
  }

  private heartbeat(): void {
    if (!this.isConnected) return;
    const progress = this.hooks.progress();
    // Deadlines move only when the coordinator confirms a renewal (`Renewed`): a heartbeat
    // written into a dead connection renews nothing.
    this.send({ kind: { case: 'heartbeat', value: { progress, seq: this.nextSeq() } } });
    // A renewal answering a message older than a lease could not make a deadline still ahead.
    const old = monotonic() - this.ttlMs;
    for (const [seq, at] of this.sentAt) {
      if (at >= old) break;
      this.sentAt.delete(seq);
    }
  }
}

/** A status message as sent: gRPC percent-encodes it on the wire. */
function details(e: grpc.ServiceError): string {
  try {
    return decodeURIComponent(e.details);
  } catch {
    return e.details;
  }
}
