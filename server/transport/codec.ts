/**
 * Domain rows ↔ protobuf messages. The outcomes' mapping to the wire is `outcome-wire.ts`.
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
  StaleReportSchema,
  StepSchema,
  StepStatus,
  type Attempt,
  type ClaimedJob,
  type CurrentState as PbCurrentState,
  type Job as PbJob,
  type StaleReport,
} from '../../gen/leasehold/v1/job_pb.js';
import type { CurrentState } from '../domain/outcomes.js';
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

