/**
 * The agent: one stream to the coordinator, kept open across failures, running the handlers of
 * the jobs it is assigned. This class composes its parts and owns its lifecycle (start, drain,
 * stop); each part says what it does:
 *
 * - session.ts: the stream, Hello and Welcome, reconnects, heartbeats, the coordinator's silence;
 * - assignments.ts: the attempts held, their local lease deadlines, running their handlers once
 *   the start is confirmed;
 * - reporter.ts: Started, the durable reports and their sending, freed slots (credit);
 * - acks.ts: what each `Ack` does to the outbox;
 * - signals.ts: SIGINT/SIGTERM drain and exit.
 */
import { EventEmitter } from 'node:events';
import pino, { type Logger } from 'pino';
import { Acks } from './acks.js';
import { Assignments, type Handler } from './assignments.js';
import { CoordinatorChannel, type TlsOption } from './channel.js';
import { assignedJobProblem } from './codec.js';
import { monotonic } from './clock.js';
import type { AgentEmitter, AgentEvents as PartEvents } from './events.js';
import { RevokeReason, type ServerMessage } from './gen/leasehold/v1/agent_service_pb.js';
import type { ClaimedJob } from './gen/leasehold/v1/job_pb.js';
import { Outbox, reserveBytesFor, type OutboxOptions } from './outbox.js';
import { Reporter } from './reporter.js';
import { Session } from './session.js';
import { installSignals } from './signals.js';

export type { Handler } from './assignments.js';

/** The agent's events: those of its parts (events.ts), and its own. */
export interface AgentEvents extends PartEvents {
  /**
   * After `start()` resolved, the coordinator refused this agent for good: its token was revoked
   * (`leasehold agents revoke`), or is unknown there. The agent has stopped (handlers aborted,
   * outbox closed) and does not reconnect: a revoked name never works again. `error` says what
   * the coordinator answered. (Refused at the first start, `start()` rejects instead.)
   */
  refused: [{ error: Error }];
  /**
   * Another process took this agent's outbox lock over (someone deleted `outbox.lock` and started
   * a second agent on the same `outboxDir`, or a lock not touched for a minute was taken as
   * stale): two processes writing one outbox would overwrite each other's reports. The agent has
   * stopped, as for `refused` (handlers aborted, nothing more written to the outbox, whose lock
   * it leaves to the other process); `error` says what the lock file holds now. A program should
   * exit with an error: starting again fails while the other process holds the lock.
   */
  outboxLockLost: [{ error: Error }];
}

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
  /**
   * TLS: `true`, or PEM paths; default from the URL scheme. `true` trusts Node's CA store: the
   * Mozilla roots bundled with Node plus `NODE_EXTRA_CA_CERTS` (on Node 20 not the Windows or
   * macOS certificate store). `ca` replaces that store: to trust a corporate CA as well as the
   * public ones, set `NODE_EXTRA_CA_CERTS=/path/corp-ca.pem` instead.
   */
  tls?: TlsOption;
  /**
   * A pino logger; default JSON to stdout at `LEASEHOLD_LOG_LEVEL` (`info` when unset or empty;
   * a value that is not a level name makes the constructor throw, see `envLogLevel`).
   */
  log?: Logger;
  /** How long running handlers may take to finish on drain or shutdown; default 30 s. */
  graceMs?: number;
  /** Drain on SIGINT/SIGTERM and exit; default true. */
  handleSignals?: boolean;
  /** Reconnect backoff: base and cap; default 250 ms and 30 s. */
  reconnect?: { baseMs?: number; maxMs?: number };
  /**
   * The outbox's tuning, for tests and unusual disks: `reserveBytes` (default
   * `reserveBytesFor(slots)`: 1 MiB + 260 KiB a slot, at most 32 slots counted), `checkMs` (how often the lock and the
   * directory are checked; 10 s), `retryMs`, `compactBytes` (see `OutboxOptions`).
   */
  outboxOptions?: OutboxOptions;
}

export class Agent extends EventEmitter<AgentEvents> {
  readonly log: Logger;
  private readonly handlers = new Map<string, Handler>();
  private readonly outbox: Outbox;
  private readonly session: Session<CoordinatorChannel>;
  private readonly assignments: Assignments;
  private readonly reporter: Reporter;
  private readonly acks: Acks;
  private stopping = false;
  private draining = false;
  /**
   * The coordinator refused this agent for good, or another process took its outbox over: it
   * stopped itself, nobody called `stop()`.
   */
  private refusal: Error | undefined;
  private loop: Promise<void> | undefined;
  private opened: Promise<void> | undefined;
  private removeSignals: (() => void) | undefined;
  /** Server message kinds this agent does not know, already logged on this stream (`onMessage`). */
  private readonly unknownKinds = new Set<string>();

  constructor(readonly options: AgentOptions) {
    super();
    this.log = options.log ?? pino({ level: envLogLevel(), base: { pid: process.pid } });
    const log = this.log;
    this.outbox = new Outbox(options.outboxDir, log, { reserveBytes: reserveBytesFor(options.slots ?? 1), ...options.outboxOptions });
    this.session = new Session({
      log,
      reconnect: options.reconnect,
      hooks: {
        resume: () => this.assignments.resumable(),
        progress: () => this.assignments.takeProgress(),
        welcomed: (w) => {
          this.reporter.welcomed(w.creditWithReports);
          if (this.draining) this.session.send({ kind: { case: 'bye', value: { drain: true } } });
          this.reporter.resend();
          // Starts that were never confirmed (the stream dropped first) are asked for again.
          const unconfirmed = this.assignments.unconfirmed();
          if (unconfirmed.length) this.reporter.started(unconfirmed);
          this.emit('connected', { sessionId: w.sessionId });
        },
        message: (m) => this.onMessage(m),
        disconnected: (error) => {
          this.unknownKinds.clear();
          this.emit('disconnected', error ? { error } : {});
        },
        refused: async (error, started) => {
          this.refusal = error;
          this.shutdown();
          await this.assignments.settled(1000);
          await this.outbox.close().catch((err: unknown) => this.log.warn({ err }, 'closing the outbox failed'));
          if (started) this.emit('refused', { error });
        },
      },
    });
    this.reporter = new Reporter({ log, outbox: this.outbox, session: this.session, draining: () => this.draining });
    // The parts emit the events of events.ts; `refused` is the agent's own, which they never name
    // (the cast: an emitter of more events does not type as one of fewer, for its eventNames()).
    const events = this as unknown as AgentEmitter;
    this.assignments = new Assignments({
      log,
      events,
      handler: (queue) => this.handlers.get(queue),
      session: this.session,
      reporter: this.reporter,
    });
    this.acks = new Acks({ log, events, outbox: this.outbox, reporter: this.reporter });
    // After the reporter's own watch: it stops taking work before anyone hears of it.
    this.outbox.watch((failure) => (failure ? this.emit('outboxFailing', { error: failure }) : this.emit('outboxRecovered', {})));
    this.outbox.onLockLost((error) => void this.lockLost(error));
  }

  /** Another process took the outbox over (the outbox logged it): stop for good, as when refused. */
  private async lockLost(error: Error): Promise<void> {
    if (this.stopping) return; // stopping anyway; the outbox writes nothing more
    this.refusal = error;
    this.shutdown();
    await this.assignments.settled(1000);
    await this.outbox.close().catch((err: unknown) => this.log.warn({ err }, 'closing the outbox failed'));
    this.emit('outboxLockLost', { error });
  }

  /** Registers the handler of a queue; its return value is the job's result (a JSON object). */
  handle(queue: string, handler: Handler): this {
    this.handlers.set(queue, handler);
    return this;
  }

  /**
   * Opens the outbox and takes its directory's lock (refused while another process holds it),
   * without connecting; `start()` does this first when it was not done. A program that cleans up
   * after an earlier run of itself (the runner stops commands it left running) opens first, so a
   * second process on the same outbox is refused before it touches anything.
   */
  open(): Promise<void> {
    this.opened ??= this.outbox.open().then((replay) => {
      if (replay.length) this.log.info({ entries: replay.length, dir: this.outbox.dir }, 'outbox holds reports from an earlier run: resending');
    });
    return this.opened;
  }

  /**
   * Opens the outbox (`open()`) and connects; resolves at the first `Welcome`. Rejects if the coordinator
   * refuses the agent for good (bad token, bad Hello), or if the agent is stopped (or drained)
   * before any Welcome; otherwise keeps retrying until it answers.
   */
  async start(): Promise<void> {
    if (this.loop) throw new Error('agent already started');
    if (this.refusal) throw this.refusal;
    const queues = this.options.queues ?? [...this.handlers.keys()];
    if (!queues.length) throw new Error('no queues: call agent.handle(queue, fn) or pass queues');
    await this.open();
    const urls = Array.isArray(this.options.url) ? this.options.url : [this.options.url];
    if (!urls.length) throw new Error('url: give at least one coordinator address');
    const channels = urls.map((u) => new CoordinatorChannel(u, this.options.token, this.options.tls));
    if (this.options.handleSignals !== false) this.removeSignals = installSignals({ log: this.log, drain: () => this.drain() });
    const { ready, loop } = this.session.start(channels, {
      agentId: this.options.agentId ?? '',
      token: this.options.token,
      queues,
      labels: this.options.labels ?? {},
      slots: this.options.slots ?? 1,
    });
    this.loop = loop;
    // Stopped by itself before the first Welcome (its outbox taken over): say why.
    return ready.catch((err: unknown) => {
      throw this.refusal ?? err;
    });
  }

  /**
   * Stops taking work (`Bye{drain}`), lets running handlers finish within the grace period
   * (then aborts them), waits for the outbox to be acknowledged, and disconnects.
   */
  async drain(graceMs = this.options.graceMs ?? 30_000): Promise<void> {
    if (this.stopping) return this.loop;
    this.draining = true;
    const until = monotonic() + graceMs;
    if (this.session.connected) this.session.send({ kind: { case: 'bye', value: { drain: true } } });
    this.log.info({ running: this.assignments.size, graceMs }, 'draining: no new jobs, waiting for running handlers');
    await this.assignments.settled(until - monotonic());
    this.assignments.abortAll('agent shutting down');
    await this.assignments.settled(2000);
    await this.acks.flush(Math.max(until - monotonic(), 5000));
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
    await this.assignments.settled(1000);
    await this.outbox.close();
  }

  private shutdown(): void {
    this.stopping = true;
    this.assignments.stop('agent stopped');
    this.removeSignals?.();
    this.removeSignals = undefined;
    this.session.close();
  }

  /** `stop()` or `drain()` was called (a signal's drain included); not when the agent stopped itself (refused for good, its outbox taken over). */
  get isStopping(): boolean {
    return (this.stopping || this.draining) && !this.refusal;
  }

  /** Attempts whose handlers are running now. */
  get runningAttempts(): string[] {
    return this.assignments.ids();
  }

  /** Every message but `Welcome` and `GoAway` (the session's own), to the part it concerns. */
  private onMessage(m: ServerMessage): void {
    const k = m.kind;
    switch (k.case) {
      case 'assign': {
        const jobs = k.value.jobs.filter((c) => this.acceptable(c));
        if (!jobs.length) return;
        // The outbox cannot be written: a result could not be kept, so the job is not started.
        if (this.reporter.paused) return this.reporter.decline(jobs.map((j) => j.attemptId));
        for (const c of jobs) this.assignments.assign(c);
        this.reporter.started(jobs.map((j) => j.attemptId));
        return;
      }
      case 'ack':
        for (const item of k.value.items) void this.acks.onAck(item);
        return;
      case 'revoke': {
        const why = revokeReasonName(k.value.reason);
        for (const id of k.value.attemptIds) this.assignments.abort(id, `revoked by the coordinator (${why}): ${k.value.detail || why}`, why);
        return;
      }
      case 'cancel':
        for (const id of k.value.attemptIds) this.assignments.abort(id, 'the job was canceled', 'canceled');
        return;
      case 'renewed': {
        const deadline = this.session.renewalDeadline(k.value.seq, k.value.leaseTtl);
        const notRunning = this.assignments.renewed(k.value.attemptIds, deadline);
        if (notRunning) this.reporter.release(notRunning);
        return;
      }
      case 'drain':
        this.log.info('the coordinator asked this agent to drain');
        void this.drain();
        return;
      default:
        this.unknownKind(m);
    }
  }

  /**
   * A message of a kind this SDK does not know (a newer coordinator's; protobuf keeps its field in
   * `$unknown`): ignored, as it always was, but said once per kind per stream, at warn.
   */
  private unknownKind(m: ServerMessage): void {
    const fields = [...new Set((m.$unknown ?? []).map((f) => f.no))];
    const kind = fields.length ? `field ${fields.join('+')}` : 'empty';
    if (this.unknownKinds.has(kind)) return;
    this.unknownKinds.add(kind);
    this.log.warn(
      { event: 'message.unknown', kind, fields },
      fields.length
        ? `ignored a message from the coordinator of a kind this agent does not know (field ${fields.join(', ')} of ServerMessage: the coordinator is newer?); logged once per kind per connection`
        : 'ignored an empty message from the coordinator (no kind set); logged once per connection',
    );
  }

  /**
   * Whether an assigned job may be taken: one without a job, or whose job id or attempt id is no
   * UUID (`assignedJobProblem`), is refused and logged, never started: its claim expires and it
   * goes back to the queue without counting as an attempt; its slot is given back at once.
   */
  private acceptable(c: ClaimedJob): boolean {
    const problem = assignedJobProblem(c);
    if (problem === undefined) return true;
    this.log.error({ event: 'job.refused', reason: problem }, `refused an assigned job: ${problem}; not starting it (its claim expires and it goes back to the queue)`);
    this.reporter.freeSlot();
    return false;
  }
}

/** The levels `LEASEHOLD_LOG_LEVEL` takes (pino's), most verbose first; `silent` logs nothing. */
export const LOG_LEVELS = ['trace', 'debug', 'info', 'warn', 'error', 'fatal', 'silent'] as const;

/**
 * The level `LEASEHOLD_LOG_LEVEL` sets: `info` when unset or empty, a level name in any case.
 * Anything else throws an error naming the setting and the levels: given to pino it would throw
 * its own, naming neither (the runner turns this one into exit code 2).
 */
export function envLogLevel(env: NodeJS.ProcessEnv = process.env): (typeof LOG_LEVELS)[number] {
  const raw = env.LEASEHOLD_LOG_LEVEL;
  const name = raw?.trim().toLowerCase();
  if (!name) return 'info';
  const level = LOG_LEVELS.find((l) => l === name);
  if (!level) throw new Error(`LEASEHOLD_LOG_LEVEL=${JSON.stringify(raw)} is not a log level: use ${LOG_LEVELS.join(', ')} (default info)`);
  return level;
}

/** Creates an agent: `createAgent(opts).handle(queue, fn).start()`. */
export function createAgent(options: AgentOptions): Agent {
  return new Agent(options);
}

/** `RevokeReason.LEASE_EXPIRED` → `lease_expired` (`unspecified` from an older coordinator). */
function revokeReasonName(reason: RevokeReason): string {
  return (RevokeReason[reason] ?? 'UNSPECIFIED').toLowerCase();
}
