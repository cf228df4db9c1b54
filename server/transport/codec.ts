/**
 * Domain rows ↔ protobuf messages, and the one mapping of outcomes to the wire: the `Outcome`
 * enum for per-item answers (stream acks) and `ConnectError` codes for unary calls.
 */
import { create, fromJson, toJson, type JsonObject, type JsonValue } from '@bufbuild/protobuf';
import { durationFromMs, timestampFromDate, ValueSchema, type Value } from '@bufbuild/protobuf/wkt';
import { Code, ConnectError } from '@connectrpc/connect';
import {
  AttemptSchema,
  AttemptStatus,
  ClaimedJobSchema,
  CurrentStateSchema,
  JobEventSchema,
  JobSchema,
  JobStatus,
  Outcome as PbOutcome,
  StaleReportSchema,
  StepSchema,
  StepStatus,
  type Attempt,
  type ClaimedJob,
  type CurrentState as PbCurrentState,
  type Job as PbJob,
  type StaleReport,
} from '../../gen/leasehold/v1/job_pb.js';
import type { CurrentState, Failure, Outcome } from '../domain/outcomes.js';
import type { AttemptView, Claimed, Job, JobDetail } from '../store/index.js';
import type { AttemptRow, StepRow, StaleReportRow, JobEventRow } from '../store/schema.js';
import type { JobStatus as DbJobStatus } from '../domain/statuses.js';

/** A protobuf Timestamp, or unset for a missing date. */
export const ts = (d: Date | null | undefined) => (d ? timestampFromDate(d) : undefined);
const obj = (v: unknown) => (v && typeof v === 'object' && !Array.isArray(v) ? (v as JsonObject) : undefined);

const jobStatus: Record<DbJobStatus, JobStatus> = {
  queued: JobStatus.QUEUED,
  claimed: JobStatus.CLAIMED,
  running: JobStatus.RUNNING,
  succeeded: JobStatus.SUCCEEDED,
  failed: JobStatus.FAILED,
  dead: JobStatus.DEAD,
  canceled: JobStatus.CANCELED,
};
const dbJobStatus = Object.fromEntries(Object.entries(jobStatus).map(([k, v]) => [v, k])) as Record<JobStatus, DbJobStatus>;

/**
 * A status filter from a request: undefined for UNSPECIFIED (no filter); a value the enum does
 * not have (proto3 lets unknown numbers through) is INVALID_ARGUMENT naming `field`.
 */
export function statusFilter(s: JobStatus, field: string): DbJobStatus | undefined {
  if (s === JobStatus.UNSPECIFIED) return undefined;
  const db = dbJobStatus[s];
  if (!db) throw new ConnectError(`${field} ${s} is not a job status`, Code.InvalidArgument);
  return db;
}

const attemptStatus: Record<AttemptRow['status'], AttemptStatus> = {
  claimed: AttemptStatus.CLAIMED,
  running: AttemptStatus.RUNNING,
  succeeded: AttemptStatus.SUCCEEDED,
  failed: AttemptStatus.FAILED,
  claim_expired: AttemptStatus.CLAIM_EXPIRED,
  lease_expired: AttemptStatus.LEASE_EXPIRED,
  timed_out: AttemptStatus.TIMED_OUT,
  canceled: AttemptStatus.CANCELED,
};

/** A JSON value as a `google.protobuf.Value`. */
export const toValue = (v: unknown): Value => fromJson(ValueSchema, (v ?? null) as JsonValue);
/** A `google.protobuf.Value` as plain JSON. */
export const fromValue = (v: Value | undefined): unknown => (v ? toJson(ValueSchema, v) : undefined);

export function toPbJob(j: Job): PbJob {
  return create(JobSchema, {
    id: j.id,
    queue: j.queue,
    payload: obj(j.payload),
    priority: j.priority,
    status: jobStatus[j.status],
    runAt: ts(j.runAt),
    maxAttempts: j.maxAttempts,
    attemptNo: j.attemptNo,
    attemptsStarted: j.attemptsStarted,
    currentAttemptId: j.currentAttemptId ?? '',
    agentId: j.agentId ?? '',
    leaseExpiresAt: ts(j.leaseExpiresAt),
    executionTimeout: j.executionTimeoutMs ? durationFromMs(j.executionTimeoutMs) : undefined,
    idempotencyKey: j.idempotencyKey ?? '',
    result: obj(j.result),
    error: obj(j.error),
    createdAt: ts(j.createdAt),
    updatedAt: ts(j.updatedAt),
    finishedAt: ts(j.finishedAt),
    labels: (obj(j.labels) as Record<string, string> | undefined) ?? {},
    notifyUrl: j.notifyUrl ?? '',
    progress: j.progress === null || j.progress === undefined ? undefined : toValue(j.progress),
  });
}

export function toPbClaimed(c: Claimed): ClaimedJob {
  return create(ClaimedJobSchema, {
    job: toPbJob(c.job),
    attemptId: c.attemptId,
    attemptNo: c.attemptNo,
    claimDeadline: timestampFromDate(c.claimDeadline),
  });
}

export function toPbAttempt(a: AttemptView): Attempt {
  return create(AttemptSchema, {
    id: a.id,
    attemptNo: a.attemptNo,
    agentId: a.agentId,
    status: attemptStatus[a.status],
    claimedAt: ts(a.claimedAt),
    claimDeadline: ts(a.claimDeadline),
    startedAt: ts(a.startedAt),
    endedAt: ts(a.endedAt),
    suspectSince: ts(a.suspectSince),
    error: obj(a.error),
  });
}

export function toPbDetail(d: JobDetail) {
  return {
    job: toPbJob(d.job),
    attempts: d.attempts.map(toPbAttempt),
    events: d.events.map((e: JobEventRow) =>
      create(JobEventSchema, { id: BigInt(e.id), kind: e.kind, attemptId: e.attemptId ?? '', at: ts(e.at), data: obj(e.data) }),
    ),
    steps: d.steps.map((s: StepRow) =>
      create(StepSchema, {
        step: s.step,
        status: s.status === 'done' ? StepStatus.DONE : StepStatus.STARTED,
        attemptId: s.attemptId,
        previousAttemptId: s.previousAttemptId ?? '',
        output: s.status === 'done' ? toValue(s.output) : undefined,
        reservations: s.reservations,
        startedAt: ts(s.startedAt),
        finishedAt: ts(s.finishedAt),
      }),
    ),
    staleReports: d.staleReports.map(toPbStaleReport),
  };
}

export function toPbStaleReport(r: StaleReportRow): StaleReport {
  return create(StaleReportSchema, {
    id: BigInt(r.id),
    jobId: r.jobId,
    attemptId: r.attemptId,
    agentId: r.agentId ?? '',
    call: r.call,
    currentAttemptId: r.currentAttemptId ?? '',
    currentAttemptNo: r.currentAttemptNo,
    currentStatus: jobStatus[r.currentStatus],
    at: ts(r.at),
  });
}

/** The protobuf `JobStatus` of a database status. */
export const toPbStatus = (s: DbJobStatus): JobStatus => jobStatus[s];
/** The protobuf `AttemptStatus` of a database attempt status. */
export const toPbAttemptStatus = (s: AttemptRow['status']): AttemptStatus => attemptStatus[s];

export function toPbCurrent(c: CurrentState): PbCurrentState {
  return create(CurrentStateSchema, {
    jobId: c.jobId,
    status: jobStatus[c.status],
    attemptNo: c.attemptNo,
    currentAttemptId: c.currentAttemptId ?? '',
  });
}

/** The per-item wire outcome (stream acks, OK vs DUPLICATE in unary responses). */
export function toPbOutcome(o: Outcome<unknown>['outcome']): PbOutcome {
  switch (o) {
    case 'ok':
      return PbOutcome.OK;
    case 'duplicate':
      return PbOutcome.DUPLICATE;
    case 'stale':
      return PbOutcome.STALE;
    case 'conflict':
      return PbOutcome.CONFLICT;
    case 'not_found':
      return PbOutcome.NOT_FOUND;
    case 'forbidden':
      return PbOutcome.FORBIDDEN;
    case 'invalid':
    case 'too_large':
      return PbOutcome.INVALID;
  }
}

/**
 * The one mapping of a failure outcome to a gRPC status (DESIGN.md, "Outcomes, not
 * exceptions"). Connect's HTTP mapping then gives 409 for ABORTED and ALREADY_EXISTS, 404, 403
 * and 400 (the HTTP gateway answers `too_large` with 413). A stale or conflict answer carries
 * the job's current state as an error detail; the failure itself is the error's `cause`, which
 * the HTTP gateway turns into plain JSON fields.
 */
export function toConnectError(f: Failure): ConnectError {
  const details = 'current' in f && f.current ? [{ desc: CurrentStateSchema, value: toPbCurrent(f.current) }] : [];
  switch (f.outcome) {
    case 'stale':
      return new ConnectError(f.message, Code.Aborted, undefined, details, f);
    case 'conflict':
      return new ConnectError(f.message, Code.AlreadyExists, undefined, details, f);
    case 'not_found':
      return new ConnectError(f.message, Code.NotFound, undefined, undefined, f);
    case 'forbidden':
      return new ConnectError(f.message, Code.PermissionDenied, undefined, undefined, f);
    case 'invalid':
      return new ConnectError(`${f.field} ${f.message}`, Code.InvalidArgument, undefined, undefined, f);
    case 'too_large':
      return new ConnectError(`${f.field} ${f.message}`, Code.InvalidArgument, undefined, undefined, f);
  }
}

/** The value of an `ok`/`duplicate` outcome, or the failure thrown as a `ConnectError`. */
export function unwrap<T>(o: Outcome<T>): { value: T; outcome: PbOutcome } {
  if (o.outcome === 'ok' || o.outcome === 'duplicate') return { value: o.value, outcome: toPbOutcome(o.outcome) };
  throw toConnectError(o);
}
