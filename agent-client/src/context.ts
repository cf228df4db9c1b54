/**
 * What a handler gets besides the job: its attempt, an abort signal, progress, stable
 * idempotency keys and the step ledger.
 */
import { setTimeout as sleep } from 'node:timers/promises';
import { fromJson, toJson, type JsonValue } from '@bufbuild/protobuf';
import { ValueSchema } from '@bufbuild/protobuf/wkt';
import type { CoordinatorChannel } from './channel.js';
import { grpc } from './channel.js';

/** The waits between sends of a step's ledger call that got no answer: 50 ms, doubling up to 1 s. */
const STEP_RETRY_FIRST_MS = 50;
const STEP_RETRY_MAX_MS = 1000;

/** A job as a handler sees it. */
export interface JobInfo {
  id: string;
  queue: string;
  /** The job's input (a JSON object). */
  payload: Record<string, unknown>;
  priority: number;
  /** The number of this attempt (1 for the first). */
  attemptNo: number;
  labels: Record<string, string>;
}

/** What `onUnknown` answers after asking the downstream system with the idempotency key. */
export type Reconciled<T> = { done: true; output: T } | { done: false };

export interface StepOptions<T> {
  /**
   * Called when an earlier attempt reserved this step and never recorded its outcome: the
   * effect may or may not have happened. Ask the downstream system with `idempotencyKey`:
   * `{ done: true, output }` records that output and skips `fn`; `{ done: false }` runs `fn`.
   * Without it, such a step throws `StepOutcomeUnknownError` (the attempt fails for good) rather
   * than risk doing the effect twice.
   */
  onUnknown?: (info: { step: string; idempotencyKey: string; previousAttemptId: string; signal: AbortSignal }) => Promise<Reconciled<T>>;
}

export interface JobContext {
  job: JobInfo;
  attempt: { id: string; number: number };
  /**
   * Aborted when the coordinator revokes the attempt (lease lost, claim expired, execution
   * timeout), cancels the job, or when the local lease deadline passes without a heartbeat
   * getting through; `signal.reason` says which. Pass it to fetch, child processes, timers.
   */
  signal: AbortSignal;
  /** Reports progress (any JSON value); sent with the next heartbeat, shown to operators. */
  progress(value: unknown): void;
  /** `job_id:step`: the same in every attempt of this job, for downstream idempotency. */
  idempotencyKey(step: string): string;
  /**
   * Runs `fn` at most once per job for this step name, across attempts: the outcome is recorded
   * on the coordinator, fenced by this attempt. A later attempt gets the recorded output without
   * running `fn`; a step whose outcome is unknown goes through `opts.onUnknown`.
   */
  step<T>(name: string, fn: (s: { idempotencyKey: string; signal: AbortSignal }) => Promise<T> | T, opts?: StepOptions<T>): Promise<T>;
}

/** A failure the handler throws on purpose; `retryable: false` fails the job for good. */
export class JobError extends Error {
  override readonly name = 'JobError';
  constructor(
    message: string,
    readonly options: { retryable?: boolean; details?: Record<string, unknown>; cause?: unknown } = {},
  ) {
    super(message, { cause: options.cause });
  }
  get retryable(): boolean {
    return this.options.retryable ?? true;
  }
}

/** A step's outcome is unknown and the handler gave no `onUnknown`: not retried, to be safe. */
export class StepOutcomeUnknownError extends JobError {
  constructor(step: string, key: string, previousAttemptId: string) {
    super(
      `step ${JSON.stringify(step)} was started by attempt ${previousAttemptId} and its outcome is unknown; ` +
        `reconcile with the downstream system using the key ${key} (pass onUnknown to ctx.step)`,
      { retryable: false, details: { step, idempotencyKey: key, previousAttemptId } },
    );
  }
}

/** The attempt is no longer this agent's to work on (the coordinator said stale). */
export class LeaseLostError extends Error {
  override readonly name = 'LeaseLostError';
}

const toValue = (v: unknown) => fromJson(ValueSchema, (v === undefined ? null : v) as JsonValue);

/** Builds the context of one attempt. */
export function createContext(opts: {
  job: JobInfo;
  attemptId: string;
  /** Gives the attempt's abort signal, made when first asked for (assignments.ts, LazyAbort). */
  abort: { readonly signal: AbortSignal };
  /** The channel of the stream in use (it changes when the agent fails over to another replica). */
  channel: () => CoordinatorChannel;
  onProgress: (v: unknown) => void;
  onLeaseLost: (why: string) => void;
  /**
   * Checks the local lease deadline now, on the monotonic clock, aborting the attempt if it has
   * passed. Called right before a step's effect: a process frozen while it waited for the ledger
   * wakes with that answer in its socket, and may read it before its watchdog timer runs.
   * Returns when it checked (`monotonic()`) and the milliseconds then left before the deadline
   * (below 0: the attempt is aborted).
   */
  checkLease: () => { at: number; left: number };
  /** A step's effect runs next (the agent's `effect` event): called after the lease check, right before `fn`. */
  onEffect: (e: { step: string; idempotencyKey: string; checkedAt: number; leaseLeftMs: number }) => void;
}): JobContext {
  const { job, attemptId, abort, channel } = opts;
  const key = (step: string) => `${job.id}:${step}`;
  const ref = { jobId: job.id, attemptId };
  // A ledger call that got no answer (UNAVAILABLE: the connection dropped or is being made again)
  // is sent again by this attempt until it is answered or the attempt is over (its signal: the
  // lease lost, a cancel, the local deadline passed). Both calls are idempotent for their
  // attempt: a reservation it already holds is reserved to it again (or unknown again, if it took
  // it over from an earlier attempt), and the same output recorded again is a duplicate, answered
  // OK. Thrown instead, a lost answer failed the attempt and left the step reserved: the next
  // attempt found it unknown.
  const call = async <R>(f: () => Promise<R>): Promise<R> => {
    for (let wait = STEP_RETRY_FIRST_MS; ; wait = Math.min(2 * wait, STEP_RETRY_MAX_MS)) {
      try {
        return await f();
      } catch (err) {
        const e = err as grpc.ServiceError;
        if (e.code === grpc.status.ABORTED) {
          opts.onLeaseLost(e.details);
          throw new LeaseLostError(`attempt ${attemptId} is no longer current: ${e.details}`, { cause: err });
        }
        if (e.code !== grpc.status.UNAVAILABLE || abort.signal.aborted) throw err;
        await sleep(wait, undefined, { signal: abort.signal }).catch(() => undefined);
        abort.signal.throwIfAborted();
      }
    }
  };
  const record = async (name: string, output: unknown) => {
    await call(() => channel().recordStep({ ...ref, step: name, output: toValue(output) }, abort.signal));
  };

  return {
    job,
    attempt: { id: attemptId, number: job.attemptNo },
    get signal() {
      return abort.signal;
    },
    progress: (v) => opts.onProgress(v),
    idempotencyKey: key,
    async step(name, fn, stepOpts) {
      const idempotencyKey = key(name);
      const signal = abort.signal;
      const r = await call(() => channel().reserveStep({ ...ref, step: name }, signal));
      const state = r.state;
      if (state.case === 'done') return (state.value.output ? toJson(ValueSchema, state.value.output) : null) as never;
      if (state.case === 'unknown') {
        const previousAttemptId = state.value.previousAttemptId;
        if (!stepOpts?.onUnknown) throw new StepOutcomeUnknownError(name, idempotencyKey, previousAttemptId);
        const rec = await stepOpts.onUnknown({ step: name, idempotencyKey, previousAttemptId, signal });
        if (rec.done) {
          await record(name, rec.output);
          return rec.output;
        }
      }
      // The last moment to notice that the lease is gone before the effect: the reservation may
      // have come back after a pause longer than the lease (another attempt may be doing it now).
      const lease = opts.checkLease();
      signal.throwIfAborted();
      opts.onEffect({ step: name, idempotencyKey, checkedAt: lease.at, leaseLeftMs: lease.left });
      const output = await fn({ idempotencyKey, signal });
      await record(name, output);
      return output;
    },
  };
}
