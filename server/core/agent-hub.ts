/**
 * The agents connected to this coordinator: one session per stream, what each holds, and the
 * rules of the agent stream (DESIGN.md "The agent stream"). The hub keeps the sessions and reads
 * their messages; its parts do the rest:
 *
 * - `Hello` authenticates the agent, resumes the attempts it lists that are still its own and
 *   current (the rest get `Revoke`), and is answered with `Welcome`.
 * - Credit: `Hello.slots` is the first grant; `Credit{n}` (or `credit` on a report) grants n
 *   more; each assigned job uses one. The dispatcher never assigns beyond
 *   min(credit, slots − held − reserved).
 * - `Heartbeat` marks the session; the lease ticker (`lease-ticker.ts`) renews what the marked
 *   sessions hold, one UPDATE per tick, and confirms it with `Renewed`.
 * - `Started`, `Completed`, `Failed` go to the fenced store verbs through the report batcher
 *   and are answered when their batch is written (`attempt-reports.ts`).
 * - Attempts taken away (canceled, reaped, lost, resumed by another stream) are revoked from
 *   the sessions that hold them (`revoker.ts`).
 * - Losing the stream marks the held attempts suspect; their leases run down untouched.
 * - A pause of this process (frozen, asleep, a blocked event loop) longer than a heartbeat
 *   interval ends every stream on waking, before anything buffered meanwhile is acted on: its
 *   agents may have resumed elsewhere, so nothing is renewed, assigned or marked suspect on the
 *   strength of what they said before (`StallWatch`).
 * - `Bye` stops new assignments.
 *
 * Messages here are domain values (`session.ts`); the transport translates them from and to protobuf.
 */
import { EventEmitter } from 'node:events';
import { Code, ConnectError } from '@connectrpc/connect';
import type { Logger } from '../log.js';
import { agentAuthenticate, attemptsMarkSuspect, attemptsResume, claimsExpire, controlNotify, type Claimed, type Queryable } from '../store/index.js';
import { AttemptReports } from './attempt-reports.js';
import { ReportBatcher } from './batcher.js';
import { LeaseTicker } from './lease-ticker.js';
import { Revoker } from './revoker.js';
import { ProtocolError, REVOKE_DETAIL, Session, type AgentInput, type Hello, type HubEvents, type RevokeReason } from './session.js';
import { endsWithin } from './settle.js';
import { StallWatch } from './stall-watch.js';
import type { Failure, Outcome } from '../domain/outcomes.js';
import { check, checkAll, limits, schemas } from '../domain/validation.js';
import { z } from 'zod';

// The stream's vocabulary lives in session.ts, which the hub's parts share; the hub's callers
// (transport, dispatcher, registry, metrics) import it from here, as the one door to the agents.
export {
  ProtocolError,
  REVOKE_DETAIL,
  Session,
  type AckItem,
  type AgentInput,
  type AgentOutput,
  type Hello,
  type HubEvents,
  type RevokeReason,
} from './session.js';

export interface HubConfig {
  leaseTtlMs: number;
  claimTtlMs: number;
  heartbeatIntervalMs: number;
  /** How often heartbeats are flushed to the database in one UPDATE; default 200 ms. */
  tickMs?: number;
  /** How long a completion that finds its lane idle waits for others to share its statement (batcher.ts); default 0. */
  completionLingerMs?: number;
  /**
   * A pause of this process longer than this ends every stream on waking; default the heartbeat
   * interval, at least 1 s (agents give a silent coordinator up after 1.5 intervals, at least 2 s).
   */
  stallMs?: number;
  /**
   * How long `stop()` waits for the statements in flight (heartbeats, reports) before it tells
   * the streams to go anyway; default 10 s. A database that stopped answering would otherwise
   * hold the stop until TCP gave its connection up, minutes later; the agents resend what was not
   * acknowledged to the replica they resume on.
   */
  stopWaitMs?: number;
}

const helloSchema = z.object({
  agentId: z.union([z.literal(''), schemas.agentId]),
  token: z.string().min(1, 'is required'),
  queues: z.array(schemas.queue).min(1, 'must name at least one queue').max(limits.queuesPerClaim),
  labels: schemas.labels,
  slots: z.int().min(1, 'must be at least 1').max(limits.claimBatch, `must be at most ${limits.claimBatch}`),
  resume: z.array(schemas.id).max(limits.heartbeatBatch),
});

/** Longest `Hello.agent_version` kept for the logs; the rest is cut. */
const AGENT_VERSION_MAX = 200;

/**
 * `Hello.agent_version` as the logs show it: free-form text from the agent, never refused for
 * its content (a version is no reason to turn work away), but cut to `AGENT_VERSION_MAX` with
 * control characters replaced. Empty: said so, for an agent from before the field.
 */
function agentVersion(v: string | undefined): string {
  if (!v) return 'not sent (an agent from before versions were sent)';
  const clean = v.replace(/[\u0000-\u001f\u007f]/g, '?');
  return clean.length > AGENT_VERSION_MAX ? `${clean.slice(0, AGENT_VERSION_MAX)}…` : clean;
}

/** The sessions of this coordinator and the rules of their streams. */
export class AgentHub extends EventEmitter<HubEvents> {
  readonly sessions = new Set<Session>();
  /** Set by `stop()`: a session that finishes opening afterwards is told to go at once. */
  private stopping = false;
  private stopped: Promise<void> | undefined;
  /** Starts, completions and failures of all sessions, grouped per turn of the event loop. */
  readonly batcher: ReportBatcher;
  /** Sees this process waking from a pause. */
  readonly watch: StallWatch;
  private readonly ticker: LeaseTicker;
  private readonly reports: AttemptReports;
  private readonly revoker: Revoker;

  constructor(
    private readonly db: Queryable,
    private readonly log: Logger,
    readonly config: HubConfig,
  ) {
    super();
    this.batcher = new ReportBatcher(db, log, config.leaseTtlMs, { completionLingerMs: config.completionLingerMs ?? 0 });
    this.watch = new StallWatch(config.stallMs ?? Math.max(config.heartbeatIntervalMs, 1000));
    this.watch.on('stall', ({ ms }) => this.wake(ms));
    this.revoker = new Revoker(this.sessions, log, this);
    this.reports = new AttemptReports(this.batcher, log, this, config.leaseTtlMs);
    this.ticker = new LeaseTicker(db, log, this.sessions, this.revoker, this, {
      leaseTtlMs: config.leaseTtlMs,
      tickMs: config.tickMs ?? 200,
      stalled: () => this.watch.stalled(),
    });
  }

  /** Starts the heartbeat ticker. */
  start(): void {
    this.watch.start();
    this.ticker.start();
  }

  /**
   * Stops the ticker and ends every stream (agents reconnect elsewhere and resume). A second
   * call waits for the first (the gRPC listener's close and the coordinator's cleanup both call it).
   */
  stop(): Promise<void> {
    this.stopped ??= this.stopOnce();
    return this.stopped;
  }

  /** How long a stop waits for the statements in flight (`HubConfig.stopWaitMs`). */
  get stopWaitMs(): number {
    return this.config.stopWaitMs ?? 10_000;
  }

  private async stopOnce(): Promise<void> {
    this.stopping = true;
    this.watch.stop();
    const waitMs = this.stopWaitMs;
    if (!(await endsWithin(Promise.all([this.ticker.stop(), this.batcher.idle()]), waitMs))) this.log.warn({ waitedMs: waitMs }, 'the database has not answered the statements in flight: telling the streams to go anyway (their agents resend what is unacknowledged)');
    // Every stream is told to reconnect elsewhere and resume what it holds, then ends with
    // UNAVAILABLE (a status clients retry), not OK.
    for (const s of this.sessions) goAway(s, STOPPING);
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
    session.agentVersion = agentVersion(h.agentVersion);
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
    this.log.info({ agentId, sessionId: session.id, agentVersion: session.agentVersion, queues: session.queues, slots: h.slots }, 'agent connected');
    this.emit('session:open', session);
    if (this.stopping) {
      // Its Hello was being answered while this coordinator began to stop (stop() has told the
      // others already): told the same, so its agent resumes elsewhere at once rather than on
      // the stream's reset seconds later; it is given no work.
      goAway(session, STOPPING);
      return { outcome: 'ok', value: session };
    }
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
        this.background(s, this.reports.started(s, m.attemptIds, m.seq));
        return;
      case 'completed':
      case 'failed':
        if (m.credit) {
          if (!Number.isInteger(m.credit) || m.credit < 0) throw new ProtocolError(`${m.type === 'completed' ? 'Completed' : 'Failed'}.credit must not be negative, got ${m.credit}`);
          // As a Credit right after the report: the slot is free now, the report is written later.
          this.grant(s, m.credit);
        }
        this.background(s, this.reports.report(s, m));
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
      this.log.warn({ agentId: s.agentId, sessionId: s.id, held, paused: true }, 'agent stream ended after a pause of this coordinator: its attempts are left as they are');
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
    if (s.closed || s.out.closed) {
      // The stream ended, or is ending (its queue drains before `close`), while these were
      // claimed for it (a dispatcher round or an enqueue's hand-off in flight): an Assign would
      // never go out, so nobody will start them: their start deadline is moved to now and
      // the reaper's next run puts them back, instead of after the claim TTL (30 s by default).
      const attemptIds = jobs.map((c) => c.attemptId);
      claimsExpire(this.db, { attemptIds }).catch((err: unknown) => {
        this.log.warn({ err, agentId: s.agentId, attemptIds }, 'could not give back jobs claimed for a stream that ended: they go back at their claim deadline');
      });
      return;
    }
    for (const c of jobs) s.held.set(c.attemptId, { jobId: c.job.id, status: 'claimed' });
    s.send({ type: 'assign', jobs });
  }

  /**
   * Tells the sessions holding these attempts to stop them: `Cancel` for a canceled job,
   * `Revoke` with `reason` otherwise (the reaper took them, a heartbeat found them lost).
   */
  revoke(attemptIds: string[], reason: RevokeReason | 'canceled'): void {
    this.revoker.revoke(attemptIds, reason);
  }

  /** One UPDATE renews what every heartbeating session holds; the lost attempts are revoked. */
  tick(): Promise<void> {
    return this.ticker.tick();
  }

  /** Runs work for a session without blocking its stream; a failure ends that stream only. */
  private background(s: Session, work: Promise<void>): void {
    work.catch((err: unknown) => {
      this.log.warn({ err, agentId: s.agentId }, 'could not process an agent report: ending its stream (it will resend)');
      // What is queued for the agent goes out first: Assigns above all, whose jobs are claimed for
      // it and which it resumes on its next stream. Failing the stream at once dropped them, and
      // their jobs waited out their claim deadline; and the agent read INTERNAL, a bug's code, for
      // what is mostly a database that could not answer.
      const why = err instanceof Error ? err.message.slice(0, 200) : String(err);
      s.out.close(new ConnectError(`the coordinator could not store a report (${why}): reconnect and send it again`, Code.Unavailable));
    });
  }

  /**
   * Attempts another stream of `agentId` (session `by`) resumed: every other session of that
   * agent here that holds one gets `Revoke` (superseded) and the slot back.
   */
  supersede(agentId: string, attemptIds: readonly string[], by: string): void {
    this.revoker.supersede(agentId, attemptIds, by);
  }
}

const STOPPING = 'this coordinator is stopping: reconnect (to another replica if there is one) and resume what you hold';

/** Tells a stream to reconnect elsewhere and resume what it holds; it then ends with UNAVAILABLE (a status clients retry), not OK. */
function goAway(s: Session, detail: string): void {
  s.send({ type: 'goAway', detail });
  s.out.close(new ConnectError(detail, Code.Unavailable));
}
