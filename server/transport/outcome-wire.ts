/**
 * The one mapping of DESIGN.md's outcomes to the wire ("Outcomes, not exceptions"): for each
 * outcome, the `Outcome` enum of per-item answers (the stream's acks, OK against DUPLICATE in
 * unary responses), the gRPC status of a failure, and the HTTP status the gateway answers with.
 * Every route reaches the wire through these functions; test/outcome-wire.test.ts holds the
 * table against DESIGN.md and against Connect's own code → HTTP mapping.
 */
import { Code, ConnectError } from '@connectrpc/connect';
import { CurrentStateSchema, Outcome as PbOutcome } from '../../gen/leasehold/v1/job_pb.js';
import type { Failure, Outcome } from '../domain/outcomes.js';
import { toPbCurrent } from './codec.js';

type OutcomeName = Outcome<unknown>['outcome'];

interface Wire {
  pb: PbOutcome;
  /** The gRPC status of a failure (an `ok` or `duplicate` answer is the call's OK). */
  code?: Code;
  http: number;
}

export const OUTCOME_WIRE: Readonly<Record<OutcomeName, Wire>> = {
  ok: { pb: PbOutcome.OK, http: 200 },
  duplicate: { pb: PbOutcome.DUPLICATE, http: 200 },
  stale: { pb: PbOutcome.STALE, code: Code.Aborted, http: 409 },
  conflict: { pb: PbOutcome.CONFLICT, code: Code.AlreadyExists, http: 409 },
  not_found: { pb: PbOutcome.NOT_FOUND, code: Code.NotFound, http: 404 },
  forbidden: { pb: PbOutcome.FORBIDDEN, code: Code.PermissionDenied, http: 403 },
  invalid: { pb: PbOutcome.INVALID, code: Code.InvalidArgument, http: 400 },
  // Bad input like `invalid`, so INVALID_ARGUMENT on gRPC: RESOURCE_EXHAUSTED (HTTP 429) means a
  // quota, not a document over its bound. Only HTTP has a status of its own for it.
  too_large: { pb: PbOutcome.INVALID, code: Code.InvalidArgument, http: 413 },
};

/** The per-item wire outcome. */
export function toPbOutcome(o: OutcomeName): PbOutcome {
  return OUTCOME_WIRE[o].pb;
}

/** The HTTP status of an outcome. */
export function httpStatusOf(o: OutcomeName): number {
  return OUTCOME_WIRE[o].http;
}

/**
 * A failure as a `ConnectError`. A stale or conflict answer carries the job's current state as
 * an error detail; the failure itself is the error's `cause`, which the HTTP gateway turns into
 * plain JSON fields.
 */
export function toConnectError(f: Failure): ConnectError {
  const details = 'current' in f && f.current ? [{ desc: CurrentStateSchema, value: toPbCurrent(f.current) }] : [];
  const message = f.outcome === 'invalid' || f.outcome === 'too_large' ? `${f.field} ${f.message}` : f.message;
  return new ConnectError(message, OUTCOME_WIRE[f.outcome].code, undefined, details, f);
}

/** The value of an `ok`/`duplicate` outcome, or the failure thrown as a `ConnectError`. */
export function unwrap<T>(o: Outcome<T>): { value: T; outcome: PbOutcome } {
  if (o.outcome === 'ok' || o.outcome === 'duplicate') return { value: o.value, outcome: toPbOutcome(o.outcome) };
  throw toConnectError(o);
}

/**
 * The outcome the HTTP gateway names for an error that did not come from a store outcome (an
 * unknown JSON field, a missing key, an unknown method): the outcome whose gRPC status it is
 * where exactly one outcome has it; `unauthenticated` and `failed_precondition` as themselves;
 * `error` for the rest (an internal error, a quota: RESOURCE_EXHAUSTED is not `too_large`).
 * Connect names codes in snake case.
 */
export function outcomeOfCode(code: string): string {
  return OUTCOME_BY_CODE.get(code) ?? 'error';
}

const snake = (c: Code) => Code[c]!.replace(/[a-z](?=[A-Z])/g, '$&_').toLowerCase();
const OUTCOME_BY_CODE = new Map<string, string>([
  ...(['stale', 'conflict', 'not_found', 'forbidden', 'invalid'] as const).map((o) => [snake(OUTCOME_WIRE[o].code!), o] as const),
  // An unknown method is a path that is not there.
  ['unimplemented', 'not_found'],
  ['unauthenticated', 'unauthenticated'],
  ['failed_precondition', 'failed_precondition'],
]);
