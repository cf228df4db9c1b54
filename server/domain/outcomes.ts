/**
 * The outcomes of DESIGN.md as values. Every store verb returns one of these; infrastructure
 * failures are thrown instead. One table, `transport/outcome-wire.ts`, maps them to the
 * stream's per-item outcome, gRPC codes and HTTP statuses.
 */
import type { JobStatus } from './statuses.js';

/** What a `stale` caller is told: the job's state now, so it can log something useful. */
export interface CurrentState {
  jobId: string;
  status: JobStatus;
  /** Number of the job's newest attempt. */
  attemptNo: number;
  /** The job's current attempt, when it is held (`claimed` or `running`). */
  currentAttemptId: string | null;
}

export type Outcome<T> =
  | { outcome: 'ok'; value: T }
  /** The same attempt repeated the same call: `value` is what the first call stored. */
  | { outcome: 'duplicate'; value: T }
  /** The attempt is not current: nothing changed, a `stale_reports` row was written. */
  | { outcome: 'stale'; message: string; current: CurrentState }
  /** The same attempt reported something different, or an idempotency key was reused with another payload. */
  | { outcome: 'conflict'; message: string; current?: CurrentState }
  | { outcome: 'not_found'; message: string }
  /** The attempt belongs to another agent. */
  | { outcome: 'forbidden'; message: string }
  /** Malformed input; `field` names the parameter (dotted path). Nothing was written. */
  | { outcome: 'invalid'; field: string; message: string }
  /** Input over its size bound. Nothing was written. */
  | { outcome: 'too_large'; field: string; message: string; limitBytes: number };

/** Outcomes that carry no value: every failure kind. */
export type Failure = Exclude<Outcome<never>, { outcome: 'ok' | 'duplicate' }>;

export const ok = <T>(value: T): Outcome<T> => ({ outcome: 'ok', value });
export const duplicate = <T>(value: T): Outcome<T> => ({ outcome: 'duplicate', value });
export const notFound = (message: string): Failure => ({ outcome: 'not_found', message });
export const forbidden = (message: string): Failure => ({ outcome: 'forbidden', message });
export const conflict = (message: string, current?: CurrentState): Failure =>
  current ? { outcome: 'conflict', message, current } : { outcome: 'conflict', message };
export const stale = (message: string, current: CurrentState): Failure => ({ outcome: 'stale', message, current });
export const invalid = (field: string, message: string): Failure => ({ outcome: 'invalid', field, message });

/** True for `ok` and `duplicate`: the outcomes that carry a value. */
export function succeeded<T>(o: Outcome<T>): o is Extract<Outcome<T>, { value: T }> {
  return o.outcome === 'ok' || o.outcome === 'duplicate';
}
