/**
 * EnqueueJobResponse as the gateway's JSON, written from the store's row without building
 * protobuf messages: the bytes protobuf-es's `toJsonString` writes for
 * `{ job: toPbJob(job), outcome }` with the gateway's options (`alwaysEmitImplicit`), field for
 * field in field-number order. test/job-json.test.ts holds the two equal over arbitrary jobs.
 *
 * A date protobuf-es refuses to write (outside years 1–9999) is left to it: `undefined` here.
 */
import { OutcomeSchema, JobStatusSchema, JobStatus, type Outcome } from '../../gen/leasehold/v1/job_pb.js';
import type { Job } from '../store/index.js';

const MIN_MS = Date.parse('0001-01-01T00:00:00Z');
const MAX_MS = Date.parse('9999-12-31T23:59:59Z');

const OUTCOME_NAMES = new Map(OutcomeSchema.values.map((v) => [v.number, v.name]));
const STATUS_NAMES: Record<Job['status'], string> = {
  queued: JobStatusSchema.value[JobStatus.QUEUED]!.name,
  claimed: JobStatusSchema.value[JobStatus.CLAIMED]!.name,
  running: JobStatusSchema.value[JobStatus.RUNNING]!.name,
  succeeded: JobStatusSchema.value[JobStatus.SUCCEEDED]!.name,
  failed: JobStatusSchema.value[JobStatus.FAILED]!.name,
  dead: JobStatusSchema.value[JobStatus.DEAD]!.name,
  canceled: JobStatusSchema.value[JobStatus.CANCELED]!.name,
};

class OutOfRange extends Error {}

/** A Timestamp's JSON (millisecond dates: `.mmm` unless zero). */
function time(d: Date): string {
  const ms = d.getTime();
  // protobuf-es checks the whole seconds against the range.
  const secondsMs = Math.floor(ms / 1000) * 1000;
  if (!(secondsMs >= MIN_MS && secondsMs <= MAX_MS)) throw new OutOfRange();
  const iso = d.toISOString();
  return iso.endsWith('.000Z') ? `${iso.slice(0, -5)}Z` : iso;
}

/** A Duration's JSON for a positive number of milliseconds. */
function duration(ms: number): string {
  const seconds = Math.floor(ms / 1000);
  const rest = ms - seconds * 1000;
  return rest === 0 ? `${seconds}s` : `${seconds}.${String(rest).padStart(3, '0')}s`;
}

const isObject = (v: unknown): v is Record<string, unknown> => Boolean(v) && typeof v === 'object' && !Array.isArray(v);

/** The JSON text of `{ job, outcome }`, or undefined when protobuf-es must write it. */
export function enqueueAnswerJson(j: Job, outcome: Outcome): string | undefined {
  try {
    const job: Record<string, unknown> = { id: j.id, queue: j.queue };
    if (isObject(j.payload)) job.payload = j.payload;
    job.priority = j.priority;
    job.status = STATUS_NAMES[j.status];
    job.runAt = time(j.runAt);
    job.maxAttempts = j.maxAttempts;
    job.attemptNo = j.attemptNo;
    job.attemptsStarted = j.attemptsStarted;
    job.currentAttemptId = j.currentAttemptId ?? '';
    job.agentId = j.agentId ?? '';
    if (j.leaseExpiresAt) job.leaseExpiresAt = time(j.leaseExpiresAt);
    if (j.executionTimeoutMs) job.executionTimeout = duration(j.executionTimeoutMs);
    job.idempotencyKey = j.idempotencyKey ?? '';
    if (isObject(j.result)) job.result = j.result;
    if (isObject(j.error)) job.error = j.error;
    job.createdAt = time(j.createdAt);
    job.updatedAt = time(j.updatedAt);
    if (j.finishedAt) job.finishedAt = time(j.finishedAt);
    job.notifyUrl = j.notifyUrl ?? '';
    job.labels = isObject(j.labels) ? j.labels : {};
    if (j.progress !== null && j.progress !== undefined) job.progress = j.progress;
    return JSON.stringify({ job, outcome: OUTCOME_NAMES.get(outcome) ?? outcome });
  } catch (err) {
    if (err instanceof OutOfRange) return undefined;
    throw err;
  }
}
