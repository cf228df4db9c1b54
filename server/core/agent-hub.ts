/**
 * The agents connected to this coordinator: one session per stream, what each holds, and the
 * rules of the agent stream (DESIGN.md "The agent stream").
 *
 * - `Hello` authenticates the agent, resumes the attempts it lists that are still its own and
 *   current (the rest get `Revoke`), and is answered with `Welcome`.
 * - Credit: `Hello.slots` is the first grant; `Credit{n}` (or `credit` on a report) grants n
 *   more; each assigned job uses one. The dispatcher never assigns beyond
 *   min(credit, slots − held − reserved).
 * - `Heartbeat` marks the session; every tick one UPDATE renews the attempts held by all
 *   sessions that heartbeated (claimed ones are checked too, so a claim the reaper took back
 *   is revoked). Renewed leases are confirmed with `Renewed` (and a start with one too), which
 *   agents follow for their local deadlines; an attempt no longer current gets `Revoke`.
 * - `Started`, `Completed`, `Failed` go to the fenced store verbs; completions and failures are
 *   answered with one `Ack` per message, an item per attempt (the stored result on duplicate).
 * - Losing the stream marks the held attempts suspect; their leases run down untouched.
 * - A pause of this process (frozen, asleep, a blocked event loop) longer than a heartbeat
 *   interval ends every stream on waking, before anything buffered meanwhile is acted on: its
 *   agents may have resumed elsewhere, so nothing is renewed, assigned or marked suspect on the
 *   strength of what they said before (`StallWatch`).
 * - `Bye` stops new assignments.
 *
 * Messages here are domain values; the transport translates them from and to protobuf.
 */
import { randomUUID } from 'node:crypto';
import { EventEmitter } from 'node:events';
import { Code, ConnectError } from '@connectrpc/connect';
import type { Logger } from '../log.js';
import {
  agentAuthenticate,
  attemptHeartbeat,
  attemptsMarkSuspect,
  attemptsResume,
  controlNotify,
  type Claimed,
  type JobSummary,
  type Queryable,
} from '../store/index.js';
import { ReportBatcher } from './batcher.js';
import { Channel } from './channel.js';
import { StallWatch } from './stall-watch.js';
import type { CurrentState, Failure, Outcome } from '../domain/outcomes.js';
import { check, checkAll, limits, schemas } from '../domain/validation.js';
import { z } from 'zod';

export interface Hello {
  /** Empty: the agent the token belongs to. Set: must be that agent. */
  agentId: string;
  token: string;
  queues: string[];
  labels: Record<string, string>;
  slots: number;
  resume: string[];
  /** The agent's number for this message (0: none); see `Session.seq`. */
  seq: bigint;
}

/** What an agent sends after `Hello`. */
export type AgentInput =
  | { type: 'credit'; n: number }
  | { type: 'started'; attemptIds: string[]; seq: bigint }
  | { type: 'heartbeat'; progress: Array<{ attemptId: string; progress: unknown }>; seq: bigint }
  | { type: 'completed'; results: Array<{ attemptId: string; result: unknown }>; credit?: number }
  | { type: 'failed'; failures: Array<{ attemptId: string; error: { message: string; details?: unknown }; retryable: boolean }>; credit?: number }
  | { type: 'bye'; drain: boolean }
  | { type: 'hello' };

export interface AckItem {
  attemptId: string;
  outcome: Outcome<unknown>['outcome'];
  /** On `duplicate` of a completion: the result stored the first time. */
  storedResult?: unknown;
  current?: CurrentState;
  message: string;
}

/** What the coordinator sends an agent. */
export type AgentOutput =
  | { type: 'welcome'; sessionId: string; leaseTtlMs: number; heartbeatIntervalMs: number }
  | { type: 'assign'; jobs: Claimed[] }
  | { type: 'ack'; items: AckItem[] }
  | { type: 'revoke'; attemptIds: string[]; reason: RevokeReason; detail: string }
  | { type: 'cancel'; attemptIds: string[] }
  | { type: 'renewed'; attemptIds: string[]; leaseTtlMs: number; seq: bigint }
  | { type: 'drain' }
  | { type: 'goAway'; detail: string };

/** A protocol violation: ends that stream (INVALID_ARGUMENT), never another. */
/** Why the coordinator takes attempts away (`RevokeReason` in the proto, lower case). */
export type RevokeReason =
  | 'claim_expired'
  | 'lease_expired'
  | 'timed_out'
  | 'not_current'
  | 'not_resumed'
  | 'not_started'
  | 'forbidden'
  | 'not_found'
  | 'superseded';

/** `Revoke.detail`: each reason in words. */
export const REVOKE_DETAIL: Record<RevokeReason, string> = {
  claim_expired: 'claim expired: not started before its claim deadline',
  lease_expired: 'lease expired: no heartbeat renewed it in time',
  timed_out: 'execution timeout passed',
  not_current: 'lease lost: the attempt is no longer current',
  not_resumed: 'not current: superseded or ended while disconnected',
  not_started: 'cannot start: not current, not found or not this agent',
  forbidden: 'the attempt belongs to another agent',
  not_found: 'unknown attempt',
  superseded: 'resumed by another stream of this agent',
};

export class ProtocolError extends Error {
  override readonly name = 'ProtocolError';
}

/** One agent stream. */
export class Session {
  readonly id = randomUUID();
  readonly out = new Channel<AgentOutput>();
  /** Attempts this stream holds: claimed (assigned, not started yet) or running. */
  readonly held = new Map<string, { jobId: string; status: 'claimed' | 'running' }>();
  /** Attempts whose report arrived and is being written: never held again by a late start answer. */
  readonly reporting = new Set<string>();
  /** Attempts whose start is being written, and that write (a report of the attempt waits for it). */
  readonly starting = new Map<string, Promise<unknown>>();
  /**
   * Attempts reported while their start was being written. Starts and reports are written by
   * separate statements that may finish in either order: a start answered after its attempt's
   * report (even one already written) must not make the session hold the attempt again.
   */
  readonly reportedWhileStarting = new Set<string>();
  credit: number;
  /**
   * Slots taken by claims in flight (a dispatcher round, an enqueue hand-off): neither free nor
   * held yet. A `Credit` that arrives meanwhile must not free them again.
   */
  reserved = 0;
  draining = false;
  closed = false;
  heartbeatPending = false;
  /**
   * The largest number the agent gave a message on this stream (Hello, Started, Heartbeat), 0
   * if none: a `Renewed` echoes the one it answers, and the agent counts the lease from when it
   * sent that message, not from when the answer arrived.
   */
  seq = 0n;
  readonly progress = new Map<string, unknown>();
  readonly connectedAt = new Date();
  /** The dispatcher's key for sessions that are claimed for together (same queues and labels). */
  groupKey: string | undefined;

  constructor(
    readonly agentId: string,
    readonly queues: string[],
    readonly labels: Record<string, string>,
    readonly slots: number,
    /** True while the coordinator is waking from a pause: nothing is assigned then. */
    private readonly paused: () => boolean = () => false,
  ) {
    this.credit = slots;
  }

  /** Free slots the dispatcher may fill now. */
  get available(): number {
    if (this.closed || this.draining || this.paused()) return 0;
    return Math.max(0, Math.min(this.credit, this.slots - this.held.size - this.reserved));
  }

  /** Takes a free slot for a claim about to run (`available` must be positive). */
  reserve(): void {
    this.credit--;
    this.reserved++;
  }

  /** The claim for a reserved slot ended: `filled` (then `assign` holds its job) or not (the slot is free again). */
  unreserve(filled: boolean): void {
    this.reserved--;
    if (!filled) this.credit++;
  }

  send(msg: AgentOutput): void {
    this.out.push(msg);
  }
}

export interface HubConfig {
  leaseTtlMs: number;
  claimTtlMs: number;
  heartbeatIntervalMs: number;
  /** How often heartbeats are flushed to the database in one UPDATE; default 200 ms. */
  tickMs?: number;
  /**
   * A pause of this process longer than this ends every stream on waking; default the heartbeat
   * interval, at least 1 s (agents give a silent coordinator up after 1.5 intervals, at least 2 s).
   */
  stallMs?: number;
}

export interface HubEvents {
  /** A session has free slots (new, more credit, a slot freed): the dispatcher should look. */
  credit: [Session];
  /** One coalesced heartbeat UPDATE ran. */
  'lease:tick': [{ renewed: number; lost: number }];
  'lease:revoked': [{ agentId: string; attemptIds: string[]; reason: RevokeReason | 'canceled' }];
  'session:open': [Session];
  'session:close': [Session, { lost: boolean }];
  /** A `Started` item was answered (metrics: starts, enqueue-to-start latency, stale reports). */
  'attempt:start': [{ attemptId: string; agentId: string; outcome: Outcome<JobSummary> }];
  /** A `Completed` / `Failed` item was answered (metrics: outcomes, stale reports). */
  'attempt:report': [{ kind: 'completed' | 'failed'; attemptId: string; agentId: string; outcome: Outcome<JobSummary> }];
}

const helloSchema = z.object({
  agentId: z.union([z.literal(''), schemas.agentId]),
  token: z.string().min(1, 'is required'),
  queues: z.array(schemas.queue).min(1, 'must name at least one queue').max(limits.queuesPerClaim),
  labels: schemas.labels,
  slots: z.int().min(1, 'must be at least 1').max(limits.claimBatch, `must be at most ${limits.claimBatch}`),
  resume: z.array(schemas.id).max(limits.heartbeatBatch),
});

/** The sessions of this coordinator and the rules of their streams. */
export class AgentHub extends EventEmitter<HubEvents> {
  readonly sessions = new Set<Session>();
  private readonly tickMs: number;
  private timer: NodeJS.Timeout | undefined;
  private ticking: Promise<void> | undefined;
  /** Starts, completions and failures of all sessions, grouped per turn of the event loop. */
  readonly batcher: ReportBatcher;
  /** Sees this process waking from a pause. */
  readonly watch: StallWatch;

  constructor(
    private readonly db: Queryable,
    private readonly log: Logger,
    readonly config: HubConfig,
  ) {
    super();
    this.tickMs = config.tickMs ?? 200;
    this.batcher = new ReportBatcher(db, log, config.leaseTtlMs);
    this.watch = new StallWatch(config.stallMs ?? Math.max(config.heartbeatIntervalMs, 1000));
    this.watch.on('stall', ({ ms }) => this.wake(ms));
  }

  /** Starts the heartbeat ticker. */
  start(): void {
    if (this.timer) return;
    this.watch.start();
    const loop = () => {
      this.timer = setTimeout(() => {
        this.ticking = this.tick()
          .catch((err: unknown) => this.log.warn({ err }, 'heartbeat tick failed; retrying next tick'))
          .finally(() => {
            this.ticking = undefined;
            if (this.timer) loop();
          });
      }, this.tickMs);
    };
    loop();
  }

  /** Stops the ticker and ends every stream (agents reconnect elsewhere and resume). */
  async stop(): Promise<void> {
    clearTimeout(this.timer);
    this.timer = undefined;
    this.watch.stop();
    await this.ticking;
    await this.batcher.idle();
    // Every stream is told to reconnect elsewhere and resume what it holds, then ends with
    // UNAVAILABLE (a status clients retry), not OK.
    const detail = 'this coordinator is stopping: reconnect (to another replica if there is one) and resume what you hold';
    for (const s of this.sessions) {
      s.send({ type: 'goAway', detail });
      s.out.close(new ConnectError(detail, Code.Unavailable));
    }
  }

  /**
   * This process ran again after a pause of `ms`: every stream it held ends (GoAway, then
   * UNAVAILABLE), at once and before any message buffered meanwhile is acted on. Its agents may
   * have given it up as silent and resumed their attempts on another replica, so what those
   * sessions held is neither renewed nor marked suspect from here; an agent that stayed simply
   * reconnects and resumes.
   */
  private wake(ms: number): void {
    const sessions = [...this.sessions];
    this.log.warn(
      { pausedMs: ms, streams: sessions.length, held: sessions.reduce((n, s) => n + s.held.size, 0) },
      'this coordinator was paused longer than a heartbeat interval: ending its streams (their agents may have resumed elsewhere)',
    );
    const detail = `this coordinator was paused for ${ms} ms: reconnect and resume what you hold`;
    for (const s of sessions) {
      s.send({ type: 'goAway', detail });
      s.out.close(new ConnectError(detail, Code.Unavailable));
      void this.close(s, { lost: true, paused: true });
    }
  }

  /** Authenticates a `Hello` and opens its session: `Welcome` first, then `Revoke` for what cannot resume. */
  async open(h: Hello): Promise<Outcome<Session>> {
    const bad = checkAll(check('hello', helloSchema, h));
    if (bad) return bad;
    const auth = await agentAuthenticate(this.db, { token: h.token, ...(h.agentId ? { agentId: h.agentId } : {}) });
    if (auth.outcome !== 'ok') return auth as Failure;
    const agentId = auth.value.agentId;
    const session = new Session(agentId, [...new Set(h.queues)], h.labels, h.slots, () => this.watch.stalled());
    session.send({
      type: 'welcome',
      sessionId: session.id,
      leaseTtlMs: this.config.leaseTtlMs,
      heartbeatIntervalMs: this.config.heartbeatIntervalMs,
    });
    if (h.resume.length) {
      const r = await attemptsResume(this.db, { agentId, attemptIds: h.resume });
      if (r.outcome !== 'ok') return r as Failure;
      // Another stream of this agent that still holds one of these is told before it can report
      // it: here at once, on other coordinators through NOTIFY.
      this.supersede(agentId, r.value.resumed.map((a) => a.attemptId), session.id);
      if (r.value.resumed.length) {
        await controlNotify(this.db, { type: 'superseded', agentId, attemptIds: r.value.resumed.map((a) => a.attemptId), sessionId: session.id });
      }
      for (const a of r.value.resumed) session.held.set(a.attemptId, { jobId: a.jobId, status: a.status });
      if (r.value.gone.length) session.send({ type: 'revoke', attemptIds: r.value.gone, reason: 'not_resumed', detail: REVOKE_DETAIL.not_resumed });
      this.log.info({ agentId, sessionId: session.id, resumed: r.value.resumed.length, gone: r.value.gone.length }, 'agent resumed');
    }
    session.heartbeatPending = session.held.size > 0;
    session.seq = h.seq;
    this.sessions.add(session);
    this.log.info({ agentId, sessionId: session.id, queues: session.queues, slots: h.slots }, 'agent connected');
    this.emit('session:open', session);
    this.emit('credit', session);
    return { outcome: 'ok', value: session };
  }

  /**
   * Handles one message of an open session, in order. Throws `ProtocolError` for a violation.
   * Starts and reports are handed to the batcher and answered when their batch is written, so
   * reading the stream never waits for the database (the batcher keeps starts before reports).
   */
  async handle(s: Session, m: AgentInput): Promise<void> {
    switch (m.type) {
      case 'hello':
        throw new ProtocolError('Hello was already received on this stream');
      case 'credit':
        if (!Number.isInteger(m.n) || m.n < 1) throw new ProtocolError(`Credit.n must be a positive number of jobs, got ${m.n}`);
        this.grant(s, m.n);
        return;
      case 'heartbeat':
        s.heartbeatPending = true;
        if (m.seq > s.seq) s.seq = m.seq;
        for (const p of m.progress) if (s.held.has(p.attemptId)) s.progress.set(p.attemptId, p.progress);
        return;
      case 'started':
        if (m.seq > s.seq) s.seq = m.seq;
        this.background(s, this.started(s, m.attemptIds, m.seq));
        return;
      case 'completed':
      case 'failed':
        if (m.credit) {
          if (!Number.isInteger(m.credit) || m.credit < 0) throw new ProtocolError(`${m.type === 'completed' ? 'Completed' : 'Failed'}.credit must not be negative, got ${m.credit}`);
          // As a Credit right after the report: the slot is free now, the report is written later.
          this.grant(s, m.credit);
        }
        this.background(s, this.report(s, m));
        return;
      case 'bye':
        s.draining = true;
        this.log.info({ agentId: s.agentId, sessionId: s.id, drain: m.drain, held: s.held.size }, 'agent said bye');
        return;
    }
  }

  /** More credit from the agent. Over-granting is harmless: credit never exceeds Hello's slots. */
  private grant(s: Session, n: number): void {
    s.credit = Math.min(s.credit + n, s.slots);
    this.emit('credit', s);
  }

  /**
   * The stream ended: without `Bye`, or with attempts still held, those become suspect (unless
   * this coordinator is waking from a pause: another stream may hold them now).
   */
  async close(s: Session, why: { lost: boolean; error?: unknown; paused?: boolean }): Promise<void> {
    if (s.closed) return;
    s.closed = true;
    s.out.close();
    this.sessions.delete(s);
    const held = [...s.held.keys()];
    if (held.length && (why.paused || this.watch.stalled())) {
      this.log.warn({ agentId: s.agentId, sessionId: s.id, held }, 'agent stream ended after a pause of this coordinator: its attempts are left as they are');
    } else if (held.length) {
      const r = await attemptsMarkSuspect(this.db, { attemptIds: held }).catch((err: unknown) => {
        this.log.warn({ err, agentId: s.agentId }, 'could not mark attempts suspect');
        return undefined;
      });
      this.log.warn({ agentId: s.agentId, sessionId: s.id, suspect: r?.outcome === 'ok' ? r.value : held, err: why.error }, 'agent stream lost: its attempts are suspect');
    } else {
      this.log.info({ agentId: s.agentId, sessionId: s.id, lost: why.lost }, 'agent disconnected');
    }
    this.emit('session:close', s, { lost: why.lost });
  }

  /**
   * Gives claimed jobs to a session, into slots the caller reserved (took from its credit)
   * before claiming: a claim made for a session never outruns its free slots, however the
   * dispatcher's rounds and enqueue hand-offs interleave.
   */
  assign(s: Session, jobs: Claimed[]): void {
    for (const c of jobs) s.held.set(c.attemptId, { jobId: c.job.id, status: 'claimed' });
    s.send({ type: 'assign', jobs });
  }

  /**
   * Tells the sessions holding these attempts to stop them: `Cancel` for a canceled job,
   * `Revoke` with `reason` otherwise (the reaper took them, a heartbeat found them lost).
   */
  revoke(attemptIds: string[], reason: RevokeReason | 'canceled'): void {
    const bySession = new Map<Session, string[]>();
    for (const id of attemptIds) {
      for (const s of this.sessions) {
        if (!s.held.has(id)) continue;
        s.held.delete(id);
        s.progress.delete(id);
        bySession.set(s, [...(bySession.get(s) ?? []), id]);
      }
    }
    for (const [s, ids] of bySession) {
      s.send(reason === 'canceled' ? { type: 'cancel', attemptIds: ids } : { type: 'revoke', attemptIds: ids, reason, detail: REVOKE_DETAIL[reason] });
      this.log.info({ agentId: s.agentId, attemptIds: ids, reason }, reason === 'canceled' ? 'attempts canceled' : 'attempts revoked');
      this.emit('lease:revoked', { agentId: s.agentId, attemptIds: ids, reason });
      this.emit('credit', s);
    }
  }

  /** One UPDATE renews what every heartbeating session holds; the lost attempts are revoked. */
  async tick(): Promise<void> {
    // Waking from a pause: these heartbeats are old news (the watch ends the streams next).
    if (this.watch.stalled()) return;
    const items: Array<{ attemptId: string; agentId: string; progress?: unknown }> = [];
    // What each session's renewal answers: the messages received before the UPDATE is written.
    const answers = new Map<Session, bigint>();
    for (const s of this.sessions) {
      if (!s.heartbeatPending) continue;
      s.heartbeatPending = false;
      answers.set(s, s.seq);
      for (const id of s.held.keys()) {
        const progress = s.progress.get(id);
        items.push(progress === undefined ? { attemptId: id, agentId: s.agentId } : { attemptId: id, agentId: s.agentId, progress });
      }
      s.progress.clear();
    }
    if (!items.length) return;
    const o = await attemptHeartbeat(this.db, { items, leaseTtlMs: this.config.leaseTtlMs });
    if (o.outcome !== 'ok') {
      this.log.warn({ outcome: o }, 'heartbeat batch refused');
      return;
    }
    // Tell each session which of its leases now run: the agents' local deadlines follow these.
    const renewed = new Set(o.value.renewed.map((r) => r.attemptId));
    for (const [s, seq] of answers) {
      const ids = [...s.held.keys()].filter((id) => renewed.has(id));
      if (ids.length) s.send({ type: 'renewed', attemptIds: ids, leaseTtlMs: this.config.leaseTtlMs, seq });
    }
    const lost = new Map<string, RevokeReason>();
    for (const l of o.value.lost) lost.set(l.attemptId, lostReason(l.reason));
    for (const reason of new Set(lost.values())) {
      this.revoke([...lost].filter(([, r]) => r === reason).map(([id]) => id), reason);
    }
    this.emit('lease:tick', { renewed: o.value.renewed.length, lost: lost.size });
  }

  /** Runs work for a session without blocking its stream; a failure ends that stream only. */
  private background(s: Session, work: Promise<void>): void {
    work.catch((err: unknown) => {
      this.log.warn({ err, agentId: s.agentId }, 'could not process an agent report: ending its stream (it will resend)');
      s.out.fail(err);
    });
  }

  private async started(s: Session, attemptIds: string[], seq: bigint): Promise<void> {
    const gone: string[] = [];
    const running: string[] = [];
    await Promise.all(
      attemptIds.map(async (attemptId) => {
        const write = this.batcher.start({ attemptId, agentId: s.agentId });
        s.starting.set(attemptId, write);
        const o = await write.finally(() => s.starting.delete(attemptId));
        const reported = s.reportedWhileStarting.delete(attemptId);
        this.emit('attempt:start', { attemptId, agentId: s.agentId, outcome: o });
        if (o.outcome === 'ok' || o.outcome === 'duplicate') {
          // Hold it only while it is still this attempt's and running, and not reported: the
          // start can be answered after the attempt's report was received, or even written.
          if (o.value.currentAttemptId === attemptId && o.value.status === 'running' && !s.closed && !reported && !s.reporting.has(attemptId)) {
            s.held.set(attemptId, { jobId: o.value.id, status: 'running' });
            running.push(attemptId);
          }
          if (this.log.isLevelEnabled('info')) this.log.info({ jobId: o.value.id, attemptId, attemptNo: o.value.attemptNo, agentId: s.agentId }, 'attempt started');
        } else {
          if (o.outcome === 'stale') this.log.warn({ attemptId, agentId: s.agentId, current: o.current }, 'late start rejected');
          gone.push(attemptId);
        }
      }),
    );
    if (running.length) s.send({ type: 'renewed', attemptIds: running, leaseTtlMs: this.config.leaseTtlMs, seq });
    if (gone.length) {
      for (const id of gone) s.held.delete(id);
      s.send({ type: 'revoke', attemptIds: gone, reason: 'not_started', detail: REVOKE_DETAIL.not_started });
      this.emit('credit', s);
    }
  }

  private async report(s: Session, m: Extract<AgentInput, { type: 'completed' | 'failed' }>): Promise<void> {
    const calls =
      m.type === 'completed'
        ? m.results.map((r) => ({
            attemptId: r.attemptId,
            run: () => this.batcher.complete({ attemptId: r.attemptId, agentId: s.agentId, result: r.result }),
          }))
        : m.failures.map((f) => ({
            attemptId: f.attemptId,
            run: () =>
              this.batcher.fail({
                attemptId: f.attemptId,
                agentId: s.agentId,
                error: f.error.details === undefined ? { message: f.error.message } : { message: f.error.message, details: f.error.details },
                retryable: f.retryable,
              }),
          }));
    // A reported attempt stops occupying the agent now, not when its report is written: the
    // next claim for this slot overlaps the write, and heartbeats no longer include it.
    const was = new Map(calls.map((c) => [c.attemptId, s.held.get(c.attemptId)]));
    for (const c of calls) {
      s.held.delete(c.attemptId);
      s.reporting.add(c.attemptId);
      if (s.starting.has(c.attemptId)) s.reportedWhileStarting.add(c.attemptId);
    }
    this.emit('credit', s);
    const items = await Promise.all(
      calls.map(async ({ attemptId, run }): Promise<AckItem> => {
        // An agent that reports an attempt before its start was answered (the SDK waits for
        // Renewed; a hand-written agent may send both at once) has the start written first, so
        // the attempt is started by its Started, not implicitly by the report: the same outcome
        // and counts whichever statement PostgreSQL would have finished first.
        await s.starting.get(attemptId)?.catch(() => undefined);
        const o: Outcome<JobSummary> = await run().finally(() => s.reporting.delete(attemptId));
        this.emit('attempt:report', { kind: m.type, attemptId, agentId: s.agentId, outcome: o });
        // A refused report (a result too large, say) leaves the attempt running: hold it again.
        const h = was.get(attemptId);
        if ((o.outcome === 'invalid' || o.outcome === 'too_large') && h && !s.closed) s.held.set(attemptId, h);
        return ackItem(attemptId, o, m.type, s.agentId, this.log);
      }),
    );
    s.send({ type: 'ack', items });
  }

  /** Removes an attempt from any session that still holds it (it moved to another stream). */
  /**
   * Attempts another stream of `agentId` (session `by`) resumed: every other session of that
   * agent here that holds one gets `Revoke` (superseded) and the slot back.
   */
  supersede(agentId: string, attemptIds: readonly string[], by: string): void {
    for (const s of this.sessions) {
      if (s.agentId !== agentId || s.id === by) continue;
      const ids = attemptIds.filter((id) => s.held.has(id));
      if (!ids.length) continue;
      for (const id of ids) {
        s.held.delete(id);
        s.progress.delete(id);
      }
      s.send({ type: 'revoke', attemptIds: ids, reason: 'superseded', detail: REVOKE_DETAIL.superseded });
      this.log.info({ agentId, sessionId: s.id, attemptIds: ids, by }, 'attempts revoked: resumed by another stream');
      this.emit('lease:revoked', { agentId, attemptIds: ids, reason: 'superseded' });
      this.emit('credit', s);
    }
  }
}

function ackItem(attemptId: string, o: Outcome<JobSummary>, kind: 'completed' | 'failed', agentId: string, log: Logger): AckItem {
  switch (o.outcome) {
    case 'ok':
      if (log.isLevelEnabled('info')) log.info({ jobId: o.value.id, attemptId, agentId, status: o.value.status }, kind === 'completed' ? 'attempt completed' : 'attempt failed');
      // No message: Ack.Item.message says why, for anything but OK (and it is on every job).
      return { attemptId, outcome: 'ok', message: '' };
    case 'duplicate':
      return { attemptId, outcome: 'duplicate', storedResult: o.value.result ?? undefined, message: 'already recorded: the stored outcome stands' };
    case 'stale':
      log.warn({ attemptId, agentId, current: o.current }, `late ${kind === 'completed' ? 'completion' : 'failure'} rejected: ${o.message}`);
      return { attemptId, outcome: 'stale', current: o.current, message: o.message };
    case 'conflict':
      return { attemptId, outcome: 'conflict', ...(o.current ? { current: o.current } : {}), message: o.message };
    case 'invalid':
    case 'too_large':
      return { attemptId, outcome: o.outcome, message: `${o.field} ${o.message}` };
    default:
      return { attemptId, outcome: o.outcome, message: o.message };
  }
}

/** Why a heartbeat lost an attempt (the store's reason), as the agent is told. */
function lostReason(reason: string): RevokeReason {
  switch (reason) {
    case 'timed_out':
      return 'timed_out';
    case 'stale':
      return 'not_current';
    case 'forbidden':
      return 'forbidden';
    default:
      return 'not_found';
  }
}
