/**
 * Why a fenced write matched nothing. The fenced statements decide by their row count; an item of
 * start, complete or fail that matched nothing is explained afterwards, in a fresh snapshot, as
 * `not_found`, `forbidden`, the stored answer of a repeat (`duplicate` / `conflict`) or `stale`
 * (with a `stale_reports` row, stale-reports.ts). The heartbeat and the steps have lookups of
 * their own (heartbeat.ts, steps.ts; the steps' reads `attemptWhere`). The read never writes job
 * state: it only explains a write that did not happen.
 */
import { conflict, duplicate, forbidden, notFound, type Outcome } from '../domain/outcomes.js';
import type { JobStatus } from '../domain/statuses.js';
import type { AttemptRef } from './batch.js';
import { currentOf, jobRowById, toJob, type Job } from './rows.js';
import { run, statement, type Queryable } from './sql.js';
import { reportStale, type Call } from './stale-reports.js';

export interface Lookup {
  job_id: string;
  attempt_agent_id: string;
  status: JobStatus;
  attempt_no: number;
  current_attempt_id: string | null;
  /** How the attempt was reported, if it was: its row says `succeeded` or `failed`. */
  kind: 'completed' | 'failed' | null;
  result: unknown;
  error: unknown;
  retryable: boolean | null;
  /** The call's own report equals the stored one (complete: result; fail: error and retryable). */
  same: boolean | null;
}

/**
 * Where an attempt is, in SQL: `x.id` is the attempt id; the attempt is either ended (`a`, from
 * `attempt_log`: its `attempts` row, or its job's row for a success) or live (the `jobs` row `l`
 * holding it), and `j` is its job.
 */
export const attemptWhere = `LEFT JOIN attempt_log a ON a.id = x.id
   LEFT JOIN jobs_live l ON l.current_attempt_id = x.id
   JOIN jobs j ON j.id = coalesce(a.job_id, l.id)`;

// Read in a fresh snapshot after the fenced statement matched nothing, so it sees whatever
// concurrent transition made the fence fail.
const lookupSql = statement(
  'attemptLookup',
  `SELECT j.id AS job_id, coalesce(a.agent_id, l.agent_id) AS attempt_agent_id, j.status, j.attempt_no, j.current_attempt_id,
          CASE a.status WHEN 'succeeded' THEN 'completed' WHEN 'failed' THEN 'failed' END AS kind,
          CASE WHEN a.status = 'succeeded' THEN j.result END AS result, a.error, a.retryable,
          CASE a.status WHEN 'succeeded' THEN j.result = $2::jsonb
                        WHEN 'failed' THEN a.error = $2::jsonb AND a.retryable = $3 END AS same
   FROM (SELECT $1::uuid AS id) x
   ${attemptWhere}`,
);

/**
 * Explains a fenced write that matched nothing: `not_found`, `forbidden`, the stored answer
 * of a repeat (via `onRepeat`), or `stale` (logged in `stale_reports`).
 */
export async function explain(
  db: Queryable,
  p: { attemptId: string; agentId: string; jobId?: string | undefined; call: Call; now?: Date | undefined },
  report: { json: string | null; retryable: boolean | null },
  onRepeat: (l: Lookup) => Outcome<string> | undefined,
): Promise<Outcome<string>> {
  const [l] = await run<Lookup>(db, lookupSql, [p.attemptId, report.json, report.retryable]);
  if (!l || (p.jobId !== undefined && l.job_id !== p.jobId)) {
    return notFound(`attempt ${p.attemptId} not found` + (p.jobId ? ` for job ${p.jobId}` : ''));
  }
  if (l.attempt_agent_id !== p.agentId) {
    return forbidden(`attempt ${p.attemptId} belongs to another agent`);
  }
  const repeat = onRepeat(l);
  if (repeat) return repeat;
  return reportStale(db, { jobId: l.job_id, attemptId: p.attemptId, agentId: p.agentId, call: p.call, now: p.now });
}

/** Turns a `duplicate` naming a job id into a `duplicate` carrying the job as stored now. */
export async function withJob(db: Queryable, o: Outcome<string>): Promise<Outcome<Job>> {
  if (o.outcome !== 'duplicate' && o.outcome !== 'ok') return o;
  const row = await jobRowById(db, o.value);
  return row ? duplicate(toJob(row)) : notFound(`job ${o.value} not found`);
}

/** After a zero-row complete or fail: the stored answer of a repeat, or why not. */
export async function repeatOrStale(
  db: Queryable,
  p: AttemptRef,
  call: 'complete' | 'fail',
  report: { json: string; retryable: boolean | null },
  kind: 'completed' | 'failed',
): Promise<Outcome<Job>> {
  const o = await explain(db, { ...p, call }, report, (l) => {
    if (!l.kind) return undefined;
    if (l.kind === kind && l.same) return duplicate(l.job_id);
    return conflict(
      l.kind === kind
        ? `attempt ${p.attemptId} already reported a different ${kind === 'completed' ? 'result' : 'failure'}`
        : `attempt ${p.attemptId} already ${l.kind}`,
      currentOf(l),
    );
  });
  return withJob(db, o);
}
