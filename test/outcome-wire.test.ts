/**
 * The one outcome → wire mapping (server/transport/outcome-wire.ts) against DESIGN.md's table
 * ("Outcomes, not exceptions"), and against Connect's own code → HTTP mapping, which answers for
 * every failure the gateway does not map itself.
 */
import { Code, ConnectError } from '@connectrpc/connect';
import { codeToHttpStatus, codeToString } from '@connectrpc/connect/protocol-connect';
import { describe, expect, it } from 'vitest';
import { Outcome as PbOutcome } from '../gen/leasehold/v1/job_pb.js';
import type { Failure } from '../server/domain/outcomes.js';
import { OUTCOME_WIRE, httpStatusOf, outcomeOfCode, toConnectError, toPbOutcome, unwrap } from '../server/transport/outcome-wire.js';

const current = { jobId: '0190a3c4-0000-7000-8000-000000000001', status: 'running' as const, attemptNo: 2, currentAttemptId: null };
const failures: Failure[] = [
  { outcome: 'stale', message: 'attempt a is not current', current },
  { outcome: 'conflict', message: 'a different result', current },
  { outcome: 'not_found', message: 'no such job' },
  { outcome: 'forbidden', message: 'another agent' },
  { outcome: 'invalid', field: 'queue', message: 'must not be empty' },
  { outcome: 'too_large', field: 'payload', message: 'is over 262144 bytes', limitBytes: 262144 },
];

describe('outcomes on the wire', () => {
  it('are DESIGN.md’s table', () => {
    // DESIGN.md: outcome | gRPC | HTTP.
    const design = {
      ok: [undefined, 200],
      duplicate: [undefined, 200],
      stale: [Code.Aborted, 409],
      conflict: [Code.AlreadyExists, 409],
      not_found: [Code.NotFound, 404],
      forbidden: [Code.PermissionDenied, 403],
      invalid: [Code.InvalidArgument, 400],
      too_large: [Code.InvalidArgument, 413],
    };
    expect(Object.fromEntries(Object.entries(OUTCOME_WIRE).map(([o, w]) => [o, [w.code, w.http]]))).toEqual(design);
    for (const f of failures) expect(toConnectError(f).code, f.outcome).toBe(design[f.outcome][0]);
  });

  it('give the HTTP status Connect gives the gRPC code, except too_large’s 413', () => {
    for (const f of failures) {
      const viaConnect = codeToHttpStatus(OUTCOME_WIRE[f.outcome].code!);
      expect(httpStatusOf(f.outcome), f.outcome).toBe(f.outcome === 'too_large' ? 413 : viaConnect);
    }
  });

  it('name the per-item outcome of every answer, bad input of both kinds as INVALID', () => {
    expect(['ok', 'duplicate', ...failures.map((f) => f.outcome)].map((o) => PbOutcome[toPbOutcome(o as Failure['outcome'])])).toEqual([
      'OK',
      'DUPLICATE',
      'STALE',
      'CONFLICT',
      'NOT_FOUND',
      'FORBIDDEN',
      'INVALID',
      'INVALID',
    ]);
  });

  it('carry the failure as the cause, the field in the message, the current state as a detail', () => {
    const stale = toConnectError(failures[0]!);
    expect(stale.cause).toBe(failures[0]);
    expect(stale.details).toHaveLength(1);
    expect(toConnectError(failures[2]!).details).toHaveLength(0);
    expect(toConnectError(failures[4]!).rawMessage).toBe('queue must not be empty');
    expect(() => unwrap(failures[3]!)).toThrow(ConnectError);
    expect(unwrap({ outcome: 'duplicate', value: 7 })).toEqual({ value: 7, outcome: PbOutcome.DUPLICATE });
  });

  it('read back from a code that did not come from an outcome; a quota is not too_large', () => {
    for (const f of failures.filter((x) => x.outcome !== 'too_large')) {
      expect(outcomeOfCode(codeToString(OUTCOME_WIRE[f.outcome].code!)), f.outcome).toBe(f.outcome);
    }
    expect(outcomeOfCode(codeToString(Code.Unimplemented))).toBe('not_found');
    expect(outcomeOfCode(codeToString(Code.Unauthenticated))).toBe('unauthenticated');
    expect(outcomeOfCode(codeToString(Code.FailedPrecondition))).toBe('failed_precondition');
    expect(outcomeOfCode(codeToString(Code.ResourceExhausted))).toBe('error');
    expect(outcomeOfCode(codeToString(Code.Internal))).toBe('error');
  });
});
