/**
 * Row shapes returned by the store, and the mapping from raw rows (snake_case) to the camelCase
 * types Drizzle infers from the schema.
 */
import type { JobRow } from './schema.js';
import type { JobStatus } from '../domain/statuses.js';
import type { CurrentState } from '../domain/outcomes.js';
import { run, statement, type Queryable } from './sql.js';

/**
 * A job as the store returns it: the `jobs` row, and its `error`: the newest error one of its
 * attempts ended with (a reported failure, an expired lease, a timeout), none once it succeeded.
 */
export type Job = Omit<JobRow, StorageColumns> & { error: unknown };

/**
 * Columns of the row that are not the job as the API shows it: a success's attempt kept on its
 * job's row (read as an attempt, `attempt_log`), and the partition the row is kept in.
 */
type StorageColumns = 'finalAttemptId' | 'finalAgentId' | 'finalClaimedAt' | 'finalClaimDeadline' | 'finalStartedAt' | 'finalSuspectSince' | 'doneDay';

/**
 * What the batched transitions (the agent stream's starts and reports) return about a job:
 * enough for the agent's answer, the logs and the metrics, without reading the whole row back.
 */
export type JobSummary = Pick<Job, 'id' | 'queue' | 'status' | 'attemptNo' | 'currentAttemptId' | 'runAt' | 'updatedAt' | 'leaseExpiresAt'> & {
  /** The stored result, where the answer carries it (a repeated completion). */
  result?: unknown;
};

/**
 * A job's error, derived from its attempts: the newest one's that has an error, none once the job
 * succeeded. What the SQL function `job_error` (migration 0005) returns, written into the
 * statement instead of called: PostgreSQL 17 plans a SQL function's body again in every statement
 * that calls it, about 140 µs a call here, where a subquery is planned with its statement once a
 * connection (docs/performance.md, "Statements planned on every call"). `alias` names the `jobs`
 * row.
 */
export const jobErrorSql = (alias: string) =>
  `CASE WHEN ${alias}.status = 'succeeded' THEN NULL ELSE (SELECT ea.error FROM attempts ea WHERE ea.job_id = ${alias}.id AND ea.error IS NOT NULL ORDER BY ea.attempt_no DESC LIMIT 1) END`;

/**
 * The select list of a job as the API shows it: its row and its derived error (`jobErrorSql`).
 * `alias` names the `jobs` row in the query.
 */
export const jobColumns = (alias: string) => `${alias}.*, ${jobErrorSql(alias)} AS error`;

// By primary key, in whichever partition of jobs holds the row (jobs_live, or its day's).
const jobByIdSql = statement('jobById', `SELECT ${jobColumns('j')} FROM jobs j WHERE j.id = $1`);

/**
 * The job's row as stored now, with its error (`jobColumns`), or undefined when there is no such
 * job: what a zero-row transition reads to say why (the job's state, a repeat's stored answer).
 */
export async function jobRowById(db: Queryable, jobId: string): Promise<Record<string, unknown> | undefined> {
  const [row] = await run<Record<string, unknown>>(db, jobByIdSql, [jobId]);
  return row;
}

const camel = (k: string) => k.replace(/_([a-z])/g, (_, c: string) => c.toUpperCase());
const camelCache = new Map<string, string>();

/** Maps a raw row with snake_case columns to its camelCase shape. */
export function camelRow<T>(row: Record<string, unknown>): T {
  const out: Record<string, unknown> = {};
  for (const k in row) {
    let c = camelCache.get(k);
    if (c === undefined) camelCache.set(k, (c = camel(k)));
    out[c] = row[k];
  }
  return out as T;
}

export const toJob = (row: Record<string, unknown>): Job => camelRow<Job>(row);

/** A row without the `notified` column (the count of the NOTIFYs its statement sent). */
export const withoutNotified = ({ notified: _, ...row }: Record<string, unknown>): Record<string, unknown> => row;

/** A summary from the columns the batched statements return (times as epoch milliseconds). */
export function toSummary(r: {
  id: string;
  queue: string;
  status: JobStatus;
  attempt_no: number;
  current_attempt_id: string | null;
  run_at_ms: number;
  updated_at_ms: number;
  lease_ms: number | null;
}): JobSummary {
  return {
    id: r.id,
    queue: r.queue,
    status: r.status,
    attemptNo: r.attempt_no,
    currentAttemptId: r.current_attempt_id,
    runAt: new Date(r.run_at_ms),
    updatedAt: new Date(r.updated_at_ms),
    leaseExpiresAt: r.lease_ms === null ? null : new Date(r.lease_ms),
  };
}

/** The select list `toSummary` reads, for the `jobs` row named `alias`. */
export const summaryColumns = (alias: string) =>
  `${alias}.id, ${alias}.queue, ${alias}.status, ${alias}.attempt_no, ${alias}.current_attempt_id,
   date_part('epoch', ${alias}.run_at) * 1000 AS run_at_ms, date_part('epoch', ${alias}.updated_at) * 1000 AS updated_at_ms,
   date_part('epoch', ${alias}.lease_expires_at) * 1000 AS lease_ms`;

/** The part of a job a `stale` or `conflict` caller is shown. */
export function currentOf(row: { id?: string; job_id?: string; status: JobStatus; attempt_no: number; current_attempt_id: string | null }): CurrentState {
  return {
    jobId: (row.job_id ?? row.id) as string,
    status: row.status,
    attemptNo: row.attempt_no,
    currentAttemptId: row.current_attempt_id,
  };
}
