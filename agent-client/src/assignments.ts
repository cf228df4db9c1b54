/**
 * The attempts this agent holds, from `Assign` to the handler's report.
 *
 * - An assigned attempt is only claimed: its handler runs once the coordinator confirms the start
 *   (a `Renewed` for it). One aborted before that gives its slot back without running.
 * - Keeps a local lease deadline per attempt: sent_at + lease TTL − one heartbeat interval, where
 *   sent_at is when the agent sent the Started or Heartbeat that a `Renewed` answers (echoed in
 *   its `seq`), never when the answer arrived; when it passes, or on `Revoke` or `Cancel`, the
 *   attempt's signal aborts. A handler still running one interval after that is reported as a
 *   zombie.
 * - A `Renewed` for an attempt it does not run (given up before its start was confirmed) is
 *   returned to the caller, which gives it back (`Reporter.release`).
 * - A handler's return value or throw becomes an outbox entry, written before the attempt is let
 *   go, so that a reconnect resumes it or a renewal finds its report. A result of more than
 *   `RESULT_MAX_BYTES` of JSON (the coordinator's limit) fails the attempt for good instead,
 *   naming its size and the limit, as the coordinator's refusal would: it is never written or sent.
 */
import { fromJson, type JsonObject, type JsonValue } from '@bufbuild/protobuf';
import { ValueSchema } from '@bufbuild/protobuf/wkt';
import type { Logger } from 'pino';
import type { CoordinatorChannel } from './channel.js';
import { monotonic } from './clock.js';
import { createContext, JobError, type JobContext, type JobInfo } from './context.js';
import type { AgentEmitter } from './events.js';
import type { ClaimedJob } from './gen/leasehold/v1/job_pb.js';
import type { OutboxEntry } from './outbox.js';
import { RESULT_MAX_BYTES, resultTooLargeMessage, type Reporter } from './reporter.js';
import type { HeartbeatProgress, Session } from './session.js';

export type Handler = (job: JobInfo, ctx: JobContext) => unknown;

export interface AssignmentsOptions {
  log: Logger;
  events: AgentEmitter;
  /** The handler of a queue. */
  handler(queue: string): Handler | undefined;
  /** The lease's clock, the silence check, and the channel of the step ledger. */
  session: Pick<Session<CoordinatorChannel>, 'heartbeatMs' | 'localDeadline' | 'checkSilence' | 'channel'>;
  /** Where handlers' reports go, and freed slots. */
  reporter: Pick<Reporter, 'write' | 'finished' | 'freeSlot'>;
}

/**
 * An attempt's abort: the `AbortController` is made only when the handler asks for its signal.
 * Most never do, and making one (an EventTarget) cost more in this process than the rest of an
 * assignment's bookkeeping. Once made, it follows: aborted already if the attempt was.
 */
export class LazyAbort {
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

export class Assignments {
  private readonly running = new Map<string, Running>();
  private watchdog: NodeJS.Timeout | undefined;
  private stopped = false;

  constructor(private readonly o: AssignmentsOptions) {}

  /** Attempts held now (assigned, running, or finishing their report), oldest first. */
  ids(): string[] {
    return [...this.running.keys()];
  }

  get size(): number {
    return this.running.size;
  }

  /** The attempts to resume on a new stream: every one held and not aborted. */
  resumable(): string[] {
    return [...this.running.values()].filter((r) => !r.abort.aborted).map((r) => r.attemptId);
  }

  /** Starts that were never confirmed (the stream dropped first), to ask for again. */
  unconfirmed(): string[] {
    return [...this.running.values()].filter((r) => !r.started && !r.abort.aborted).map((r) => r.attemptId);
  }

  /** Some attempt is held and not aborted: its lease matters. */
  holdsLeases(): boolean {
    return [...this.running.values()].some((r) => !r.abort.aborted);
  }

  /** Progress reported since the last call, for a heartbeat. */
  takeProgress(): HeartbeatProgress[] {
    return [...this.running.values()]
      .filter((r) => r.progressDirty)
      .map((r) => {
        r.progressDirty = false;
        return { attemptId: r.attemptId, progress: toValueMsg(r.progress) };
      });
  }

  /** An `Assign`'s job: held, its handler waiting for the start to be confirmed. */
  assign(c: ClaimedJob): void {
    const j = c.job!;
    if (this.running.has(c.attemptId)) {
      // Already held (a coordinator that sent it twice): a second entry would take the first's
      // place, and its running handler would be left with a signal nothing aborts any more.
      this.o.log.warn({ event: 'job.assigned_twice', jobId: j.id, attemptId: c.attemptId }, 'an attempt already held was assigned again: keeping the one held');
      return;
    }
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
      deadline: this.o.session.localDeadline(),
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
        this.o.reporter.freeSlot();
        resolve();
      };
    });
    this.running.set(c.attemptId, r);
    this.armWatchdog();
    if (this.o.log.isLevelEnabled('info')) this.o.log.info({ event: 'job.assigned', jobId: job.id, attemptId: c.attemptId, attemptNo: c.attemptNo, queue: job.queue }, 'job assigned');
    this.o.events.emit('assigned', { attemptId: c.attemptId, jobId: job.id, attemptNo: c.attemptNo });
  }

  /**
   * A `Renewed` for `attemptIds`, granting a lease that ends here at `deadline`: moves the
   * deadlines of started attempts and begins the handlers of those whose start it confirms.
   * Returns the attempts this agent does not hold (undefined if none).
   */
  renewed(attemptIds: string[], deadline: number): string[] | undefined {
    // A deadline that is not a number (a malformed lease TTL) counts as passed: it fails closed.
    if (Number.isNaN(deadline)) deadline = -Infinity;
    let notRunning: string[] | undefined;
    for (const id of attemptIds) {
      const r = this.running.get(id);
      if (!r) {
        // Not held: this agent gave the attempt up (its start came back after the local
        // deadline), lost its report, or has its report in the outbox (`Reporter.release`
        // tells these apart).
        (notRunning ??= []).push(id);
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
      if (this.o.log.isLevelEnabled('debug')) this.o.log.debug({ event: 'handler.started', jobId: r.job.id, attemptId: id }, 'start confirmed; running the handler');
      r.begin?.();
    }
    return notRunning;
  }

  /** Aborts an attempt if it is held; `revoke` is the coordinator's reason, if it took it away. */
  abort(attemptId: string, reason: string, revoke?: string): void {
    const r = this.running.get(attemptId);
    if (r) this.abortAttempt(r, reason, revoke);
  }

  /** Aborts every attempt held. */
  abortAll(reason: string): void {
    for (const r of this.running.values()) this.abortAttempt(r, reason);
  }

  /** For good: aborts every attempt held, and the watchdog stops. */
  stop(reason: string): void {
    this.stopped = true;
    this.abortAll(reason);
    clearInterval(this.watchdog);
  }

  /** Resolves when the handlers held now have settled, or after `ms`, whichever comes first. */
  settled(ms: number): Promise<void> {
    return race([...this.running.values()].map((r) => r.done), ms);
  }

  private async run(r: Running): Promise<void> {
    const handler = this.o.handler(r.job.queue);
    const ctx = createContext({
      job: r.job,
      attemptId: r.attemptId,
      abort: r.abort,
      channel: () => this.o.session.channel,
      onProgress: (v) => {
        r.progress = v;
        r.progressDirty = true;
      },
      onLeaseLost: (why) => this.abortAttempt(r, `lease lost: ${why}`),
      checkLease: () => {
        const at = monotonic();
        const left = r.deadline - at;
        // Fails closed: a deadline that is not a number stops the effect too.
        if (!(left >= 0)) this.abortAttempt(r, 'local lease deadline passed before a step could run its effect');
        return { at, left };
      },
      onEffect: (e) => {
        // A notice, not a gate: the step is reserved already, so a listener's throw must not
        // leave it reserved with no effect (the next attempt would find its outcome unknown).
        try {
          this.o.events.emit('effect', { attemptId: r.attemptId, jobId: r.job.id, ...e });
        } catch (err) {
          this.o.log.error({ err, jobId: r.job.id, attemptId: r.attemptId, step: e.step }, 'an effect listener threw; the step runs');
        }
      },
    });
    let entry: OutboxEntry;
    const base = { attemptId: r.attemptId, jobId: r.job.id, queue: r.job.queue, attemptNo: r.job.attemptNo, writtenAt: '' };
    try {
      if (!handler) throw new JobError(`this agent has no handler for queue ${r.job.queue}`, { retryable: false });
      const { result, bytes } = asResult(await handler(r.job, ctx));
      if (bytes > RESULT_MAX_BYTES) {
        this.o.log.error({ event: 'result.too_large', jobId: r.job.id, attemptId: r.attemptId, resultBytes: bytes, limitBytes: RESULT_MAX_BYTES }, 'the handler returned a result too large for the coordinator: the attempt fails for good');
        throw new JobError(resultTooLargeMessage(bytes), { retryable: false, details: { resultBytes: bytes, limitBytes: RESULT_MAX_BYTES } });
      }
      entry = { ...base, kind: 'completed', result };
    } catch (err) {
      const e = err as Error;
      const retryable = err instanceof JobError ? err.retryable : true;
      const details = err instanceof JobError && err.options.details ? (JSON.parse(JSON.stringify(err.options.details)) as JsonObject) : undefined;
      entry = { ...base, kind: 'failed', error: { message: e?.message || String(err), ...(details ? { details } : {}) } as OutboxEntry['error'], retryable };
    }
    entry.writtenAt = new Date().toISOString();
    if (this.o.log.isLevelEnabled('debug')) this.o.log.debug({ event: 'handler.returned', jobId: r.job.id, attemptId: r.attemptId, kind: entry.kind }, 'handler returned; writing the outbox');
    // Held until the report is on disk: a Hello meanwhile resumes it, a renewal finds it held.
    await this.o.reporter.write(entry);
    this.running.delete(r.attemptId);
    if (this.o.log.isLevelEnabled('info')) {
      const failure = entry.kind === 'failed' ? { error: entry.error?.message, retryable: entry.retryable } : {};
      this.o.log.info({ event: 'handler.finished', jobId: r.job.id, attemptId: r.attemptId, kind: entry.kind, aborted: r.abort.aborted, ...failure }, 'handler finished');
    }
    this.o.events.emit('finished', { attemptId: r.attemptId, kind: entry.kind });
    this.o.reporter.finished(entry);
  }

  /**
   * The lease deadlines and the coordinator's silence matter only while attempts are held: the
   * watchdog ticks (every 100 ms) from an assignment until nothing is held, so an idle agent
   * wakes only for its heartbeats.
   */
  private armWatchdog(): void {
    if (this.watchdog || this.stopped) return;
    this.watchdog = setInterval(() => this.checkDeadlines(), 100);
  }

  private checkDeadlines(): void {
    if (this.running.size === 0) {
      clearInterval(this.watchdog);
      this.watchdog = undefined;
      return;
    }
    const now = monotonic();
    this.o.session.checkSilence(now, () => this.holdsLeases());
    for (const r of this.running.values()) {
      if (!r.abort.aborted && !(now <= r.deadline)) {
        this.abortAttempt(r, 'local lease deadline passed without a renewal');
      } else if (r.abortedAt && !r.zombieReported && now > r.abortedAt + this.o.session.heartbeatMs) {
        r.zombieReported = true;
        this.o.log.warn(
          { jobId: r.job.id, attemptId: r.attemptId, abortedMsAgo: now - r.abortedAt, reason: String(r.abort.reason) },
          'zombie handler: still running after its signal aborted (its lease is gone); make it honour ctx.signal',
        );
        this.o.events.emit('zombie', { attemptId: r.attemptId });
      }
    }
  }

  private abortAttempt(r: Running, reason: string, revoke?: string): void {
    if (r.abort.aborted) return;
    r.abortedAt = monotonic();
    r.abort.abort(new Error(reason));
    if (!r.started) r.cancelBegin?.(); // never ran: nothing to stop, nothing to report
    this.o.log.warn({ event: 'attempt.aborted', jobId: r.job.id, attemptId: r.attemptId, reason }, 'attempt aborted');
    this.o.events.emit('aborted', { attemptId: r.attemptId, reason, ...(revoke ? { revoke } : {}) });
  }
}

/**
 * A handler's return value as a job result: objects as they are, anything else under `value`;
 * with its size in bytes of JSON, as the coordinator measures it.
 */
function asResult(v: unknown): { result: NonNullable<OutboxEntry['result']>; bytes: number } {
  if (v === undefined || v === null) return { result: {}, bytes: 2 };
  const text = JSON.stringify(v);
  const json = JSON.parse(text) as unknown;
  const bytes = Buffer.byteLength(text, 'utf8');
  if (json && typeof json === 'object' && !Array.isArray(json)) return { result: json as NonNullable<OutboxEntry['result']>, bytes };
  return { result: { value: json as never }, bytes: bytes + '{"value":}'.length };
}

const toValueMsg = (v: unknown) => fromJson(ValueSchema, (v === undefined ? null : JSON.parse(JSON.stringify(v))) as JsonValue);

/** Resolves when all promises settle or after `ms`, whichever comes first. */
async function race(ps: Array<Promise<unknown>>, ms: number): Promise<void> {
  if (!ps.length || ms <= 0) return;
  let t: NodeJS.Timeout | undefined;
  await Promise.race([Promise.allSettled(ps), new Promise((r) => (t = setTimeout(r, ms)))]);
  clearTimeout(t);
}
