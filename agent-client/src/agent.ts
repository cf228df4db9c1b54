/**
 * The agent: one stream to the coordinator, kept open across failures, running the handlers of
 * the jobs it is assigned.
 *
 * - Connects with `Hello` (its queues, labels, slots, and the attempts still running locally to
 *   resume), reconnecting with exponential backoff and jitter after any failure.
 * - Sends `Started` before running a handler, `Heartbeat` every `heartbeat_interval` while
 *   connected, and the slot a handler frees when it finishes (on its report as
 *   `Completed.credit`, or as `Credit{1}`).
 * - Keeps a local lease deadline per attempt: sent_at + lease TTL − one heartbeat interval, where
 *   sent_at is when it sent the Started or Heartbeat that a `Renewed` answers (echoed in its
 *   `seq`), never when the answer arrived; when it passes, or on `Revoke` or `Cancel`, the
 *   attempt's signal aborts.
 *   A handler still running one interval after that is reported as a zombie. A `Renewed` for
 *   an attempt it does not run (given up before its start was confirmed) is answered with a
 *   retryable `Failed`, so the coordinator stops renewing it and the job is retried.
 * - Writes each result or failure to the durable outbox before sending it, resends what is not
 *   acknowledged at every connection, and forgets (ok, duplicate) or sets aside (stale) on `Ack`.
 */
import { EventEmitter } from 'node:events';
import { fromJson, type JsonObject, type JsonValue } from '@bufbuild/protobuf';
import { durationMs, ValueSchema } from '@bufbuild/protobuf/wkt';
import pino, { type Logger } from 'pino';
import type { AgentMessageInit } from './codec.js';
import {
  RevokeReason,
  type ServerMessage,
  type ServerMessage_Ack_Item,
} from './gen/leasehold/v1/agent_service_pb.js';
import { Outcome, type ClaimedJob } from './gen/leasehold/v1/job_pb.js';
import { CoordinatorChannel, grpc, type TlsOption } from './channel.js';
import { createContext, JobError, type JobContext, type JobInfo } from './context.js';
import { Outbox, type OutboxEntry } from './outbox.js';

export type Handler = (job: JobInfo, ctx: JobContext) => unknown;

export interface AgentOptions {
  /**
   * The coordinator's gRPC address (`http://127.0.0.1:50051`, `https://…`, `host:port`), or a
   * list of replicas: after a failure the agent reconnects to the next one and resumes there.
   */
  url: string | string[];
  /** The agent's token (`leasehold agents add NAME`). */
  token: string;
  /** The agent's name; default: the one the token belongs to. */
  agentId?: string;
  /** Queues to serve; default: those given to `handle()`. */
  queues?: string[];
  /** What this agent offers (e.g. `{ os: 'windows' }`); jobs may require labels. */
  labels?: Record<string, string>;
  /** Jobs run at once; default 1. */
  slots?: number;
  /** Where results wait for their acknowledgement; must survive restarts. */
  outboxDir: string;
  /** TLS: `true` (system roots) or PEM paths; default from the URL scheme. */
  tls?: TlsOption;
  /** A pino logger; default JSON to stdout at `LEASEHOLD_LOG_LEVEL` (info). */
  log?: Logger;
  /** How long running handlers may take to finish on drain or shutdown; default 30 s. */
  graceMs?: number;
  /** Drain on SIGINT/SIGTERM and exit; default true. */
  handleSignals?: boolean;
  /** Reconnect backoff: base and cap; default 250 ms and 30 s. */
  reconnect?: { baseMs?: number; maxMs?: number };
}

export interface AgentEvents {
  connected: [{ sessionId: string }];
  disconnected: [{ error?: Error }];
  assigned: [{ attemptId: string; jobId: string; attemptNo: number }];
  /** A handler returned or threw (its report is on disk and being sent). */
  finished: [{ attemptId: string; kind: 'completed' | 'failed' }];
  acked: [{ attemptId: string; outcome: string }];
  /**
   * A running attempt was stopped: `reason` in words; `revoke` is the coordinator's reason when it
   * took the attempt away (`lease_expired`, `claim_expired`, `timed_out`, `not_current`,
   * `not_resumed`, `not_started`, `forbidden`, `not_found`, `superseded`: `RevokeReason` in the
   * proto), `canceled` when the job was canceled, absent when this agent stopped it itself.
   */
  aborted: [{ attemptId: string; reason: string; revoke?: string }];
  zombie: [{ attemptId: string }];
}

/**
 * An attempt's abort: the `AbortController` is made only when the handler asks for its signal.
 * Most never do, and making one (an EventTarget) cost more in this process than the rest of an
 * assignment's bookkeeping. Once made, it follows: aborted already if the attempt was.
 */
class LazyAbort {
  aborted = false;
  reason: unknown;
  private controller?: AbortController;

  get signal(): AbortSignal {
    if (!this.controller) {
      this.controller = new AbortController();
      if (this.aborted) this.controller.abort(this.reason);
    }
    return this.controller.signal;
  }

  abort(reason: unknown): void {
    if (this.aborted) return;
    this.aborted = true;
    this.reason = reason;
    this.controller?.abort(reason);
  }
}

interface Running {
  job: JobInfo;
  attemptId: string;
  /** The coordinator confirmed the start (a `Renewed` for it came): the handler runs. */
  started: boolean;
  abort: LazyAbort;
  /** Local lease deadline, on the monotonic clock (`monotonic()`); never the wall clock. */
  deadline: number;
  abortedAt?: number;
  zombieReported?: boolean;
  progress?: unknown;
  progressDirty?: boolean;
  done: Promise<void>;
  /** Runs the handler (once the start is confirmed). */
  begin?: () => void;
  /** Gives the slot back without running the handler (revoked before it started). */
  cancelBegin?: () => void;
}

/** Below this, a silence is a busy machine's noise (GC, a slow query), not a gone coordinator. */
const SILENCE_FLOOR_MS = 2000;

/** Permanent refusals: retrying cannot help until someone changes the config or the token. */
const PERMANENT = new Set([grpc.status.UNAUTHENTICATED, grpc.status.INVALID_ARGUMENT, grpc.status.PERMISSION_DENIED]);

export class Agent extends EventEmitter<AgentEvents> {
  readonly log: Logger;
  private readonly handlers = new Map<string, Handler>();
  private readonly running = new Map<string, Running>();
  private readonly outbox: Outbox;
  private channels: CoordinatorChannel[] = [];
  /** Index of the replica in use (or to try next). */
  private current = 0;
  /** The coordinator said GoAway: reconnect to the next address without waiting. */
  private goAway = false;
  private call: ReturnType<CoordinatorChannel['connect']> | undefined;
  private connected = false;
  /** When the coordinator last said anything on this stream (`monotonic()`). */
  private lastHeard = 0;
  /** The last number given to a Hello, Started or Heartbeat (the `Renewed` answering it echoes it). */
  private seq = 0n;
  /** When each numbered message was sent (monotonic), while a lease counted from it could still run. */
  private readonly sentAt = new Map<bigint, number>();
  private leaseTtlMs = 30_000;
  private heartbeatMs = 10_000;
  private heartbeatTimer: NodeJS.Timeout | undefined;
  private watchdog: NodeJS.Timeout | undefined;
  private stopping = false;
  private draining = false;
  private loop: Promise<void> | undefined;
  private pendingSend: OutboxEntry[] = [];
  private creditPending = 0;
  private sendScheduled = false;
  /** The coordinator reads credit carried by Completed/Failed (its Welcome said so). */
  private creditWithReports = false;
  private ackWaiters: Array<() => void> = [];
  /** Attempts given back with `release` and not yet acknowledged. */
  private readonly released = new Set<string>();
  private signalHandlers: Array<[NodeJS.Signals, () => void]> = [];
  /** Cuts the reconnect wait short (on stop). */
  private wakeLoop: (() => void) | undefined;

  constructor(readonly options: AgentOptions) {
    super();
    this.log = options.log ?? pino({ level: process.env.LEASEHOLD_LOG_LEVEL ?? 'info', base: { pid: process.pid } });
    this.outbox = new Outbox(options.outboxDir, this.log);
  }

  /** Registers the handler of a queue; its return value is the job's result (a JSON object). */
  handle(queue: string, handler: Handler): this {
    this.handlers.set(queue, handler);
    return this;
  }

  /**
   * Opens the outbox and connects; resolves at the first `Welcome`. Rejects if the coordinator
   * refuses the agent for good (bad token, bad Hello); otherwise keeps retrying until it answers.
   */
  async start(): Promise<void> {
    if (this.loop) throw new Error('agent already started');
    const queues = this.options.queues ?? [...this.handlers.keys()];
    if (!queues.length) throw new Error('no queues: call agent.handle(queue, fn) or pass queues');
    const replay = await this.outbox.open();
    if (replay.length) this.log.info({ entries: replay.length, dir: this.outbox.dir }, 'outbox holds reports from an earlier run: resending');
    const urls = Array.isArray(this.options.url) ? this.options.url : [this.options.url];
    if (!urls.length) throw new Error('url: give at least one coordinator address');
    this.channels = urls.map((u) => new CoordinatorChannel(u, this.options.token, this.options.tls));
    if (this.options.handleSignals !== false) this.installSignals();
    let first: { resolve: () => void; reject: (e: Error) => void } | undefined;
    const ready = new Promise<void>((resolve, reject) => (first = { resolve, reject }));
    this.loop = this.connectLoop(queues, first!);
    return ready;
  }

  /**
   * Stops taking work (`Bye{drain}`), lets running handlers finish within the grace period
   * (then aborts them), waits for the outbox to be acknowledged, and disconnects.
   */
  async drain(graceMs = this.options.graceMs ?? 30_000): Promise<void> {
    if (this.stopping) return this.loop;
    this.draining = true;
    const until = monotonic() + graceMs;
    if (this.connected) this.send({ kind: { case: 'bye', value: { drain: true } } });
    this.log.info({ running: this.running.size, graceMs }, 'draining: no new jobs, waiting for running handlers');
    await race([...this.running.values()].map((r) => r.done), until - monotonic());
    for (const r of this.running.values()) this.abortAttempt(r, 'agent shutting down');
    await race([...this.running.values()].map((r) => r.done), 2000);
    await this.flushOutbox(Math.max(until - monotonic(), 5000));
    await this.stop();
  }

  /**
   * Disconnects at once; running handlers are aborted. Reports on disk are kept for next time.
   * Aborted handlers get up to a second to write theirs, then the outbox is closed (and its
   * directory unlocked); a handler returning later is reported as lost (the job is redone).
   */
  async stop(): Promise<void> {
    this.shutdown();
    await this.loop?.catch(() => undefined);
    await race([...this.running.values()].map((r) => r.done), 1000);
    await this.outbox.close();
  }

  private shutdown(): void {
    this.stopping = true;
    for (const r of this.running.values()) this.abortAttempt(r, 'agent stopped');
    clearInterval(this.heartbeatTimer);
    clearInterval(this.watchdog);
    for (const [sig, h] of this.signalHandlers) process.off(sig, h);
    this.signalHandlers = [];
    this.call?.end();
    this.call?.cancel();
    for (const c of this.channels) c.close();
    this.wakeLoop?.();
  }

  /** Attempts whose handlers are running now. */
  get runningAttempts(): string[] {
    return [...this.running.keys()];
  }

  // ───────────────────────────── connection ─────────────────────────────

  private async connectLoop(queues: string[], first: { resolve: () => void; reject: (e: Error) => void }): Promise<void> {
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
      const r = await this.session(queues, onWelcome);
      if (this.stopping) break;
      if (r.error && PERMANENT.has(r.error.code) && !everConnected) {
        this.shutdown();
        await this.outbox.close().catch((err: unknown) => this.log.warn({ err }, 'closing the outbox failed'));
        first.reject(new Error(`the coordinator refused this agent: ${details(r.error)}`));
        return;
      }
      failures = r.welcomed ? 1 : failures + 1;
      // Another replica may be up: try the next address (a single one is simply retried).
      this.current = (this.current + 1) % this.channels.length;
      // Told to go (GoAway): the next address at once; the one after it with the usual backoff.
      const delay = this.goAway ? 0 : Math.min(base * 2 ** (failures - 1), max) * (0.5 + Math.random() / 2);
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
  }

  /** One stream, from Hello to its end. */
  private session(queues: string[], onWelcome: () => void): Promise<{ welcomed: boolean; error?: grpc.ServiceError }> {
    return new Promise((resolve) => {
      let welcomed = false;
      const call = this.channels[this.current]!.connect();
      this.call = call;
      const resume = [...this.running.values()].filter((r) => !r.abort.aborted).map((r) => r.attemptId);
      call.write({
        kind: {
          case: 'hello',
          value: {
            agentId: this.options.agentId ?? '',
            token: this.options.token,
            queues,
            labels: this.options.labels ?? {},
            slots: this.options.slots ?? 1,
            resume,
            seq: this.nextSeq(),
          },
        },
      });
      call.on('data', (m: ServerMessage) => {
        try {
          this.onMessage(m);
          if (m.kind.case === 'welcome') {
            welcomed = true;
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
        this.connected = false;
        clearInterval(this.heartbeatTimer);
        if (this.call === call) this.call = undefined;
        this.emit('disconnected', error ? { error } : {});
        resolve(error ? { welcomed, error } : { welcomed });
      };
      call.on('error', (err: grpc.ServiceError) => done(err));
      call.on('end', () => done());
    });
  }

  /** A number for a message about to be sent, its send time noted. */
  private nextSeq(): bigint {
    this.seq++;
    this.sentAt.set(this.seq, monotonic());
    return this.seq;
  }

  private send(m: AgentMessageInit): boolean {
    if (!this.call || !this.connected) return false;
    return this.call.write(m);
  }

  private onMessage(m: ServerMessage): void {
    this.lastHeard = monotonic();
    const k = m.kind;
    switch (k.case) {
      case 'welcome': {
        this.leaseTtlMs = k.value.leaseTtl ? durationMs(k.value.leaseTtl) : this.leaseTtlMs;
        this.heartbeatMs = k.value.heartbeatInterval ? durationMs(k.value.heartbeatInterval) : this.heartbeatMs;
        this.creditWithReports = k.value.creditWithReports;
        this.connected = true;
        this.released.clear(); // a new session holds only what Hello resumed
        this.log.info({ sessionId: k.value.sessionId, leaseTtlMs: this.leaseTtlMs, heartbeatMs: this.heartbeatMs }, 'connected to the coordinator');
        this.heartbeatTimer = setInterval(() => this.heartbeat(), this.heartbeatMs);
        this.heartbeat();
        if (this.draining) this.send({ kind: { case: 'bye', value: { drain: true } } });
        this.resendOutbox();
        // Starts that were never confirmed (the stream dropped first) are asked for again.
        const unconfirmed = [...this.running.values()].filter((r) => !r.started && !r.abort.aborted).map((r) => r.attemptId);
        if (unconfirmed.length) this.send({ kind: { case: 'started', value: { attemptIds: unconfirmed, seq: this.nextSeq() } } });
        this.emit('connected', { sessionId: k.value.sessionId });
        return;
      }
      case 'assign':
        for (const c of k.value.jobs) this.onAssign(c);
        this.send({ kind: { case: 'started', value: { attemptIds: k.value.jobs.map((j) => j.attemptId), seq: this.nextSeq() } } });
        return;
      case 'ack':
        for (const item of k.value.items) void this.onAck(item);
        return;
      case 'revoke': {
        const why = revokeReasonName(k.value.reason);
        for (const id of k.value.attemptIds) this.abortById(id, `revoked by the coordinator (${why}): ${k.value.detail || why}`, why);
        return;
      }
      case 'cancel':
        for (const id of k.value.attemptIds) this.abortById(id, 'the job was canceled', 'canceled');
        return;
      case 'renewed': {
        // The lease runs from the coordinator's renewal, which came after it received the message
        // echoed in seq: counted from when that was sent, never from when the answer arrived (it
        // may have waited in a slow network, or in the socket while this process was frozen). A
        // coordinator that echoes nothing (0) is counted from the answer's arrival, as before.
        const sent = k.value.seq ? this.sentAt.get(k.value.seq) : monotonic();
        const deadline = sent === undefined ? -Infinity : sent + (k.value.leaseTtl ? durationMs(k.value.leaseTtl) : this.leaseTtlMs) - this.heartbeatMs;
        let notRunning: string[] | undefined;
        for (const id of k.value.attemptIds) {
          const r = this.running.get(id);
          if (!r) {
            // Neither running nor reported: this agent gave the attempt up (its start came back
            // after the local deadline) or lost its report. Heartbeats would renew it forever.
            if (!this.outbox.has(id)) (notRunning ??= []).push(id);
            continue;
          }
          if (r.abort.aborted) continue;
          if (r.started) {
            // Answers can come out of order (a start confirmed after a later heartbeat's renewal).
            r.deadline = Math.max(r.deadline, deadline);
            continue;
          }
          // The start confirmed: the lease counts from here (the deadline set on Assign was only
          // how long to wait for this).
          r.deadline = deadline;
          if (deadline <= monotonic()) {
            // Confirmed too late: the lease may be gone already; never begin the handler.
            this.abortAttempt(r, 'local lease deadline passed before the start was confirmed');
            continue;
          }
          r.started = true;
          if (this.log.isLevelEnabled('debug')) this.log.debug({ jobId: r.job.id, attemptId: id }, 'start confirmed; running the handler');
          r.begin?.();
        }
        if (notRunning) this.release(notRunning);
        return;
      }
      case 'drain':
        this.log.info('the coordinator asked this agent to drain');
        void this.drain();
        return;
      case 'goAway':
        // A restart or a deploy: move at once, keep the work running, resume it there.
        this.log.info({ detail: k.value.detail }, 'the coordinator is stopping; moving to the next address');
        this.goAway = true;
        return;
    }
  }

  // ─────────────────────────────── jobs ───────────────────────────────

  private onAssign(c: ClaimedJob): void {
    const j = c.job!;
    const job: JobInfo = {
      id: j.id,
      queue: j.queue,
      payload: (j.payload ?? {}) as Record<string, unknown>,
      priority: j.priority,
      attemptNo: c.attemptNo,
      labels: j.labels,
    };
    const abort = new LazyAbort();
    const r: Running = {
      job,
      attemptId: c.attemptId,
      started: false,
      abort,
      deadline: monotonic() + this.leaseTtlMs - this.heartbeatMs,
      done: Promise.resolve(),
    };
    // The handler waits for the coordinator to confirm the start: until then the attempt is only
    // claimed, and the step ledger (a separate call) would refuse it.
    r.done = new Promise<void>((resolve) => {
      r.begin = () => {
        r.begin = undefined;
        resolve(this.run(r));
      };
      r.cancelBegin = () => {
        r.begin = undefined;
        this.running.delete(r.attemptId);
        if (!this.draining) this.grantCredit();
        resolve();
      };
    });
    this.running.set(c.attemptId, r);
    this.armWatchdog();
    if (this.log.isLevelEnabled('info')) this.log.info({ jobId: job.id, attemptId: c.attemptId, attemptNo: c.attemptNo, queue: job.queue }, 'job assigned');
    this.emit('assigned', { attemptId: c.attemptId, jobId: job.id, attemptNo: c.attemptNo });
  }

  private async run(r: Running): Promise<void> {
    const handler = this.handlers.get(r.job.queue);
    const ctx = createContext({
      job: r.job,
      attemptId: r.attemptId,
      abort: r.abort,
      channel: () => this.channels[this.current]!,
      onProgress: (v) => {
        r.progress = v;
        r.progressDirty = true;
      },
      onLeaseLost: (why) => this.abortAttempt(r, `lease lost: ${why}`),
      checkLease: () => {
        if (monotonic() > r.deadline) this.abortAttempt(r, 'local lease deadline passed without a renewal');
      },
    });
    let entry: OutboxEntry;
    const base = { attemptId: r.attemptId, jobId: r.job.id, queue: r.job.queue, attemptNo: r.job.attemptNo, writtenAt: '' };
    try {
      if (!handler) throw new JobError(`this agent has no handler for queue ${r.job.queue}`, { retryable: false });
      const result = await handler(r.job, ctx);
      entry = { ...base, kind: 'completed', result: asResult(result) };
    } catch (err) {
      const e = err as Error;
      const retryable = err instanceof JobError ? err.retryable : true;
      const details = err instanceof JobError && err.options.details ? (JSON.parse(JSON.stringify(err.options.details)) as JsonObject) : undefined;
      entry = { ...base, kind: 'failed', error: { message: e?.message || String(err), ...(details ? { details } : {}) } as OutboxEntry['error'], retryable };
    }
    entry.writtenAt = new Date().toISOString();
    if (this.log.isLevelEnabled('debug')) this.log.debug({ jobId: r.job.id, attemptId: r.attemptId, kind: entry.kind }, 'handler returned; writing the outbox');
    try {
      await this.outbox.put(entry);
    } catch (err) {
      this.log.error({ err, attemptId: r.attemptId }, 'could not write the outbox: the report is lost and the job will be redone');
    }
    this.running.delete(r.attemptId);
    if (this.log.isLevelEnabled('info')) this.log.info({ jobId: r.job.id, attemptId: r.attemptId, kind: entry.kind, aborted: r.abort.aborted }, 'handler finished');
    this.emit('finished', { attemptId: r.attemptId, kind: entry.kind });
    if (this.outbox.has(r.attemptId)) this.queueReport(entry);
    if (!this.draining) this.grantCredit();
  }

  /**
   * Gives a freed slot back: the sum of a turn of the event loop, with that turn's reports if
   * the coordinator reads credit there, else as a `Credit` of its own.
   */
  private grantCredit(): void {
    this.creditPending++;
    this.scheduleSend();
  }

  private heartbeat(): void {
    if (!this.connected) return;
    const progress = [...this.running.values()]
      .filter((r) => r.progressDirty)
      .map((r) => {
        r.progressDirty = false;
        return { attemptId: r.attemptId, progress: toValueMsg(r.progress) };
      });
    // Deadlines move only when the coordinator confirms a renewal (`Renewed`): a heartbeat
    // written into a dead connection renews nothing.
    this.send({ kind: { case: 'heartbeat', value: { progress, seq: this.nextSeq() } } });
    // A renewal answering a message older than a lease could not make a deadline still ahead.
    const old = monotonic() - this.leaseTtlMs;
    for (const [seq, at] of this.sentAt) {
      if (at >= old) break;
      this.sentAt.delete(seq);
    }
  }

  /**
   * The lease deadlines and the coordinator's silence matter only while attempts are held: the
   * watchdog ticks (every 100 ms) from an assignment until nothing is held, so an idle agent
   * wakes only for its heartbeats.
   */
  private armWatchdog(): void {
    if (this.watchdog || this.stopping) return;
    this.watchdog = setInterval(() => this.checkDeadlines(), 100);
  }

  private checkDeadlines(): void {
    if (this.running.size === 0) {
      clearInterval(this.watchdog);
      this.watchdog = undefined;
      return;
    }
    const now = monotonic();
    this.checkSilence(now);
    for (const r of this.running.values()) {
      if (!r.abort.aborted && now > r.deadline) {
        this.abortAttempt(r, 'local lease deadline passed without a renewal');
      } else if (r.abortedAt && !r.zombieReported && now > r.abortedAt + this.heartbeatMs) {
        r.zombieReported = true;
        this.log.warn(
          { jobId: r.job.id, attemptId: r.attemptId, abortedMsAgo: now - r.abortedAt, reason: String(r.abort.reason) },
          'zombie handler: still running after its signal aborted (its lease is gone); make it honour ctx.signal',
        );
        this.emit('zombie', { attemptId: r.attemptId });
      }
    }
  }

  /**
   * A coordinator that holds this agent's leases answers every heartbeat with `Renewed`. Silent
   * for one and a half heartbeat intervals (and at least `SILENCE_FLOOR_MS`) while leases are
   * held, it is frozen, stalled or cut off without the connection noticing (keepalive takes up to
   * 15 s): the agent moves to the next address at once and resumes there while the leases run.
   */
  private checkSilence(now: number): void {
    if (!this.connected || !this.call) return;
    const silentMs = now - this.lastHeard;
    if (silentMs < Math.max(this.heartbeatMs * 1.5, SILENCE_FLOOR_MS)) return;
    if (![...this.running.values()].some((r) => !r.abort.aborted)) return;
    this.log.warn({ silentMs: Math.round(silentMs), heartbeatMs: this.heartbeatMs }, 'the coordinator is silent while holding leases: moving to the next address to resume them');
    this.connected = false;
    this.goAway = true;
    this.call.cancel();
  }

  private abortById(attemptId: string, reason: string, revoke?: string): void {
    const r = this.running.get(attemptId);
    if (r) this.abortAttempt(r, reason, revoke);
  }

  private abortAttempt(r: Running, reason: string, revoke?: string): void {
    if (r.abort.aborted) return;
    r.abortedAt = monotonic();
    r.abort.abort(new Error(reason));
    if (!r.started) r.cancelBegin?.(); // never ran: nothing to stop, nothing to report
    this.log.warn({ jobId: r.job.id, attemptId: r.attemptId, reason }, 'attempt aborted');
    this.emit('aborted', { attemptId: r.attemptId, reason, ...(revoke ? { revoke } : {}) });
  }

  /**
   * Gives back attempts the coordinator renews but this agent does not run: a retryable
   * `Failed`, so the job is retried (by this agent or another) instead of held. Not durable: if
   * it is lost, the next `Renewed` asks again.
   */
  private release(attemptIds: string[]): void {
    const ids = attemptIds.filter((id) => !this.released.has(id));
    if (!ids.length) return;
    for (const id of ids) this.released.add(id);
    this.log.warn({ attemptIds: ids }, 'the coordinator renewed attempts this agent is not running: giving them back');
    this.send({
      kind: {
        case: 'failed',
        value: {
          failures: ids.map((attemptId) => ({
            attemptId,
            error: { message: 'the agent is not running this attempt (it gave it up before the start was confirmed, or lost its report)' },
            retryable: true,
          })),
        },
      },
    });
  }

  // ─────────────────────────────── outbox ───────────────────────────────

  private queueReport(e: OutboxEntry): void {
    this.pendingSend.push(e);
    this.scheduleSend();
  }

  /** Reports and freed slots go out once per turn of the event loop, in as few messages as can be. */
  private scheduleSend(): void {
    if (this.sendScheduled) return;
    this.sendScheduled = true;
    setImmediate(() => {
      this.sendScheduled = false;
      const batch = this.pendingSend.splice(0);
      const credit = this.draining ? 0 : this.creditPending;
      this.creditPending = 0;
      this.sendReports(batch, credit);
    });
  }

  /** Sends reports; `credit` rides with the first of them if the coordinator reads it there. */
  private sendReports(entries: OutboxEntry[], credit = 0): void {
    if (!this.connected) return; // reports: sent again at the next Welcome; credit: Hello's slots
    const completed = entries.filter((e) => e.kind === 'completed');
    const failed = entries.filter((e) => e.kind === 'failed');
    const rides = this.creditWithReports && entries.length > 0;
    let carry = rides ? credit : 0;
    if (completed.length) {
      this.send({ kind: { case: 'completed', value: { results: completed.map((e) => ({ attemptId: e.attemptId, result: e.result as JsonObject })), credit: carry } } });
      carry = 0;
    }
    if (failed.length) {
      this.send({
        kind: {
          case: 'failed',
          value: {
            failures: failed.map((e) => ({
              attemptId: e.attemptId,
              error: { message: e.error!.message, ...(e.error!.details ? { details: e.error!.details as JsonObject } : {}) },
              retryable: e.retryable ?? true,
            })),
            credit: carry,
          },
        },
      });
    }
    if (credit > 0 && !rides) this.send({ kind: { case: 'credit', value: { n: credit } } });
  }

  private resendOutbox(): void {
    const pending = this.outbox.pending();
    if (pending.length) this.sendReports(pending);
  }

  private async onAck(item: ServerMessage_Ack_Item): Promise<void> {
    const id = item.attemptId;
    const outcome = Outcome[item.outcome] ?? String(item.outcome);
    if (this.released.delete(id) && !this.outbox.has(id)) {
      this.log.info({ attemptId: id, outcome, message: item.message }, 'attempt given back');
      return;
    }
    try {
      switch (item.outcome) {
        case Outcome.OK:
        case Outcome.DUPLICATE:
          await this.outbox.remove(id);
          if (this.log.isLevelEnabled('info')) this.log.info({ attemptId: id, outcome }, 'report acknowledged');
          break;
        case Outcome.STALE:
          await this.outbox.supersede(id, outcome);
          this.log.warn(
            { attemptId: id, current: item.current && { attemptNo: item.current.attemptNo, currentAttemptId: item.current.currentAttemptId }, message: item.message },
            'report refused as stale: the attempt was superseded; kept aside as superseded',
          );
          break;
        case Outcome.INVALID: {
          const e = this.outbox.pending().find((x) => x.attemptId === id);
          if (e?.kind === 'completed') {
            // The result itself was refused (too large, not JSON): report a final failure instead.
            const failed: OutboxEntry = { ...e, kind: 'failed', result: undefined, error: { message: `result refused: ${item.message}` }, retryable: false, writtenAt: new Date().toISOString() };
            delete failed.result;
            await this.outbox.put(failed);
            this.log.error({ attemptId: id, message: item.message }, 'result refused by the coordinator; reporting a failure instead');
            this.queueReport(failed);
            return;
          }
          await this.outbox.supersede(id, outcome);
          this.log.error({ attemptId: id, message: item.message }, 'report refused as invalid; kept aside');
          break;
        }
        default:
          await this.outbox.supersede(id, outcome);
          this.log.error({ attemptId: id, outcome, message: item.message }, 'report refused; kept aside');
      }
    } catch (err) {
      this.log.error({ err, attemptId: id }, 'outbox update after an ack failed');
    }
    this.emit('acked', { attemptId: id, outcome });
    const w = this.ackWaiters;
    this.ackWaiters = [];
    for (const f of w) f();
  }

  /** Waits until the outbox is empty (every report acknowledged) or `ms` passes. */
  private async flushOutbox(ms: number): Promise<void> {
    const until = monotonic() + ms;
    while (this.outbox.pending().length && monotonic() < until) {
      await new Promise<void>((resolve) => {
        const t = setTimeout(resolve, Math.min(until - monotonic(), 1000));
        this.ackWaiters.push(() => {
          clearTimeout(t);
          resolve();
        });
      });
    }
    const left = this.outbox.pending().length;
    if (left) this.log.warn({ entries: left, dir: this.outbox.dir }, 'stopping with unacknowledged reports: they are sent at the next start');
  }

  private installSignals(): void {
    let count = 0;
    const onSignal = (sig: NodeJS.Signals) => () => {
      if (++count > 1) {
        this.log.warn({ signal: sig }, 'second signal: exiting now');
        process.exit(1);
      }
      this.log.info({ signal: sig }, 'shutting down: draining');
      this.drain().then(
        () => process.exit(0),
        (err: unknown) => {
          this.log.error({ err }, 'drain failed');
          process.exit(1);
        },
      );
    };
    for (const sig of ['SIGINT', 'SIGTERM'] as const) {
      const h = onSignal(sig);
      process.on(sig, h);
      this.signalHandlers.push([sig, h]);
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

/** A handler's return value as a job result: objects as they are, anything else under `value`. */
function asResult(v: unknown): NonNullable<OutboxEntry['result']> {
  if (v === undefined || v === null) return {};
  const json = JSON.parse(JSON.stringify(v)) as unknown;
  if (json && typeof json === 'object' && !Array.isArray(json)) return json as NonNullable<OutboxEntry['result']>;
  return { value: json as never };
}

const toValueMsg = (v: unknown) => fromJson(ValueSchema, (v === undefined ? null : JSON.parse(JSON.stringify(v))) as JsonValue);

/** Resolves when all promises settle or after `ms`, whichever comes first. */
async function race(ps: Array<Promise<unknown>>, ms: number): Promise<void> {
  if (!ps.length || ms <= 0) return;
  let t: NodeJS.Timeout | undefined;
  await Promise.race([Promise.allSettled(ps), new Promise((r) => (t = setTimeout(r, ms)))]);
  clearTimeout(t);
}

/** Creates an agent: `createAgent(opts).handle(queue, fn).start()`. */
export function createAgent(options: AgentOptions): Agent {
  return new Agent(options);
}

/** `RevokeReason.LEASE_EXPIRED` → `lease_expired` (`unspecified` from an older coordinator). */
function revokeReasonName(reason: RevokeReason): string {
  return (RevokeReason[reason] ?? 'UNSPECIFIED').toLowerCase();
}

/**
 * Milliseconds on a clock that only moves forward at the pace of real time: every deadline and
 * elapsed time here is on it. The wall clock (`Date.now()`) is stepped by time services and by
 * hand; a lease deadline on it would outlive the lease when the clock goes back, and cut healthy
 * work when it goes forward. (It keeps counting while the process is frozen: a process that wakes
 * after its lease is past finds its deadline passed.)
 */
function monotonic(): number {
  return performance.now();
}
