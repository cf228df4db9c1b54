/**
 * One job as operators read it (JobService and AdminService GetJob): its row, its attempts
 * (ended, from `attempt_log`, and the live one from its row), its history as a list of
 * transitions, its steps and its stale reports, from one read-only snapshot.
 */
import { notFound, ok, type Outcome } from '../domain/outcomes.js';
import type { EventKind, JobStatus } from '../domain/statuses.js';
import { check, schemas } from '../domain/validation.js';
import { camelRow, jobColumns, toJob, type Job } from './rows.js';
import type { AttemptRow, JobEventRow, StaleReportRow, StepRow } from './schema.js';
import { run, statement, type Queryable } from './sql.js';

/**
 * An attempt as operators see it: ended (a row of `attempt_log`: its `attempts` row, or for a
 * success its job's row, `seq` NULL) or live (from its job's row, `endedAt` NULL).
 */
export type AttemptView = Omit<AttemptRow, 'endedAt' | 'jobStatus' | 'seq' | 'jobCreatedAt'> & { endedAt: Date | null; jobStatus: JobStatus | null; seq: number | null };

/** A job with everything that happened to it. */
export interface JobDetail {
  job: Job;
  /** Oldest first; the live attempt, if the job is held, last. */
  attempts: AttemptView[];
  events: JobEventRow[];
  steps: StepRow[];
  staleReports: StaleReportRow[];
}

/** The live attempt a held job's row holds, as an attempt. */
export function liveAttempt(job: Job): AttemptView | undefined {
  if (!job.currentAttemptId || (job.status !== 'claimed' && job.status !== 'running')) return undefined;
  return {
    id: job.currentAttemptId,
    jobId: job.id,
    attemptNo: job.attemptNo,
    agentId: job.agentId ?? '',
    status: job.status,
    claimedAt: job.claimedAt ?? job.updatedAt,
    claimDeadline: job.claimDeadline ?? job.updatedAt,
    startedAt: job.startedAt,
    endedAt: null,
    suspectSince: job.suspectSince,
    error: null,
    retryable: null,
    jobStatus: null,
    runAt: null,
    seq: null,
  };
}

/** What an attempt's end was, as a transition of its job. */
function endKind(a: AttemptView): EventKind {
  if (a.jobStatus === 'dead') return 'dead';
  switch (a.status) {
    case 'succeeded':
      return 'completed';
    case 'failed':
      return a.jobStatus === 'queued' ? 'retry_scheduled' : 'failed';
    default:
      return a.status as EventKind;
  }
}

/**
 * A job's transitions in order, as operators read them (GetJob's `events`), from its history:
 * the enqueue (its row), each attempt's claim, start and end (the attempt), and the stored
 * events (requeues, cancels of queued jobs). `id` is the position in this list.
 */
export function jobHistory(job: Job, attemptsOf: AttemptView[], events: JobEventRow[]): JobEventRow[] {
  type Entry = Omit<JobEventRow, 'id'>;
  const out: Entry[] = [{ jobId: job.id, attemptId: null, kind: 'enqueued', at: job.createdAt, data: { status: 'queued' } }];
  // Ended attempts and stored events in the order they happened (one sequence numbers both; a
  // success kept on its job's row has none and is the job's last transition), then the live
  // attempt.
  const ordered: Array<{ seq: number; a?: AttemptView; e?: JobEventRow }> = [
    ...attemptsOf.filter((a) => a.endedAt !== null).map((a) => ({ seq: a.seq ?? Number.MAX_SAFE_INTEGER, a })),
    ...events.map((e) => ({ seq: e.id, e })),
  ].sort((x, y) => x.seq - y.seq);
  const live = attemptsOf.find((a) => a.endedAt === null);
  if (live) ordered.push({ seq: Infinity, a: live });
  for (const { a, e } of ordered) {
    if (e) {
      const { id: _, ...rest } = e;
      out.push(rest);
      continue;
    }
    out.push({
      jobId: job.id,
      attemptId: a!.id,
      kind: 'claimed',
      at: a!.claimedAt,
      data: { status: 'claimed', attempt_no: a!.attemptNo, agent_id: a!.agentId, claim_deadline: a!.claimDeadline },
    });
    if (a!.startedAt) out.push({ jobId: job.id, attemptId: a!.id, kind: 'started', at: a!.startedAt, data: { status: 'running' } });
    if (a!.endedAt && a!.jobStatus) {
      out.push({
        jobId: job.id,
        attemptId: a!.id,
        kind: endKind(a!),
        at: a!.endedAt,
        data: { status: a!.jobStatus, ...(a!.error ? { error: a!.error } : {}), ...(a!.runAt ? { run_at: a!.runAt } : {}) },
      });
    }
  }
  return out.map((e, i) => ({ id: i + 1, ...e }));
}

// GetJob's read: the job's row, and its ended attempts (`attempt_log`), events, steps and stale
// reports as JSON arrays, in one named statement, so one snapshot without a transaction and one
// round trip. Five statements in a REPEATABLE READ transaction took 1.7 ms a call here, this one
// 0.5 (docs/performance.md, "Statements planned on every call"). Each list is read by its
// table's index on the job (attempts_job_attempt_no_uq and the partitions' primary keys,
// job_events_job_idx, the steps' primary key, stale_reports_job_idx); PostgreSQL plans the first
// five calls on a connection on their own, then keeps a generic plan
// (test/store.history-reads.test.ts).
const detailSql = statement(
  'jobGetDetail',
  `SELECT ${jobColumns('j')},
     (SELECT coalesce(json_agg(a ORDER BY a.attempt_no), '[]') FROM attempt_log a WHERE a.job_id = $1) AS detail_attempts,
     (SELECT coalesce(json_agg(e ORDER BY e.id), '[]')
      FROM (SELECT id, job_id, attempt_id, kind, at, data FROM job_events WHERE job_id = $1) e) AS detail_events,
     (SELECT coalesce(json_agg(s ORDER BY s.started_at), '[]')
      FROM (SELECT job_id, step, status, attempt_id, previous_attempt_id, output, reservations, started_at, finished_at
            FROM steps WHERE job_id = $1) s) AS detail_steps,
     (SELECT coalesce(json_agg(r ORDER BY r.id DESC), '[]')
      FROM (SELECT id, job_id, attempt_id, agent_id, call, current_attempt_id, current_attempt_no, current_status, at
            FROM stale_reports WHERE job_id = $1) r) AS detail_stale_reports
   FROM jobs j WHERE j.id = $1`,
);

/**
 * A row of a JSON list as its table's row reads through `pg`: camelCase keys, and each time
 * (`keys`, which JSON gives as text) a Date, to the millisecond as `pg` reads it.
 */
function listRows<T>(list: unknown, keys: readonly string[]): T[] {
  return (list as Array<Record<string, unknown>>).map((r) => {
    for (const k of keys) if (typeof r[k] === 'string') r[k] = new Date(r[k]);
    return camelRow<T>(r);
  });
}
const ATTEMPT_TIMES = ['claimed_at', 'claim_deadline', 'started_at', 'ended_at', 'suspect_since', 'run_at', 'job_created_at'] as const;
const EVENT_TIMES = ['at'] as const;
const STEP_TIMES = ['started_at', 'finished_at'] as const;
const STALE_TIMES = ['at'] as const;

/** One job with its attempts, history, steps and stale reports, read from one snapshot. */
export async function jobGet(db: Queryable, p: { jobId: string }): Promise<Outcome<JobDetail>> {
  const bad = check('jobId', schemas.id, p.jobId);
  if (bad) return bad;
  const [r] = await run<Record<string, unknown>>(db, detailSql, [p.jobId]);
  if (!r) return notFound(`job ${p.jobId} not found`);
  const { detail_attempts, detail_events, detail_steps, detail_stale_reports, ...row } = r;
  const job = toJob(row);
  const live = liveAttempt(job);
  const ended = listRows<AttemptView>(detail_attempts, ATTEMPT_TIMES);
  const all = live ? [...ended, live] : ended;
  return ok<JobDetail>({
    job,
    attempts: all,
    events: jobHistory(job, all, listRows<JobEventRow>(detail_events, EVENT_TIMES)),
    steps: listRows<StepRow>(detail_steps, STEP_TIMES),
    staleReports: listRows<StaleReportRow>(detail_stale_reports, STALE_TIMES),
  });
}
