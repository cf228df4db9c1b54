/**
 * Row shapes returned by the store, and the mapping from raw `RETURNING` rows (snake_case) to
 * the camelCase types Drizzle infers from the schema.
 */
import type { AttemptRow, JobRow, JobStatus } from './schema.js';
import type { CurrentState } from '../core/outcomes.js';

/** A job as the store returns it: the `jobs` row. */
export type Job = JobRow;

const camel = (k: string) => k.replace(/_([a-z])/g, (_, c: string) => c.toUpperCase());

/** Maps a raw row with snake_case columns to its camelCase shape. */
export function camelRow<T>(row: Record<string, unknown>): T {
  const out: Record<string, unknown> = {};
  for (const k in row) out[camel(k)] = row[k];
  return out as T;
}

export const toJob = (row: Record<string, unknown>): Job => camelRow<Job>(row);
export const toAttempt = (row: Record<string, unknown>): AttemptRow => camelRow<AttemptRow>(row);

/** The part of a job a `stale` or `conflict` caller is shown. */
export function currentOf(row: { id?: string; job_id?: string; status: JobStatus; attempt_no: number; current_attempt_id: string | null }): CurrentState {
  return {
    jobId: (row.job_id ?? row.id) as string,
    status: row.status,
    attemptNo: row.attempt_no,
    currentAttemptId: row.current_attempt_id,
  };
}
