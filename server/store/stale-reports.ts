/**
 * Stale reports: a call made for an attempt that is no longer current (superseded, ended,
 * canceled) is answered `stale` and leaves a `stale_reports` row, which operators list.
 */
import { stale, type CurrentState, type Failure } from '../domain/outcomes.js';
import type { JobStatus } from '../domain/statuses.js';
import { run, statement, type Queryable } from './sql.js';

/** The call that came too late: the `call` column of `stale_reports`. */
export type Call = 'start' | 'heartbeat' | 'complete' | 'fail' | 'step';

// FOR KEY SHARE: a job purged (or deleted) while its late report is answered is skipped, not a
// foreign-key error: the lock waits for the delete and then finds no row, where the key's own
// check would have failed the statement (and with it a heartbeat tick of every agent). It does
// not conflict with the transitions' updates, which change no key.
const staleReportSql = statement(
  'staleReportInsert',
  `INSERT INTO stale_reports (job_id, attempt_id, agent_id, call, current_attempt_id, current_attempt_no, current_status, at)
   SELECT j.id, $2, $3, $4, j.current_attempt_id, j.attempt_no, j.status, coalesce($5::timestamptz, now())
   FROM jobs j WHERE j.id = $1
   FOR KEY SHARE
   RETURNING current_attempt_id, current_attempt_no, current_status`,
);

/** Writes the `stale_reports` row for a late call and returns the `stale` outcome. */
export async function reportStale(
  db: Queryable,
  p: { jobId: string; attemptId: string; agentId: string; call: Call; now?: Date | undefined },
): Promise<Failure> {
  type Row = { current_attempt_id: string | null; current_attempt_no: number; current_status: JobStatus };
  const params = [p.jobId, p.attemptId, p.agentId, p.call, p.now ?? null];
  // No row: the job was purged, or a success was moving its row to its day's partition while the
  // lock waited (a delete and an insert, which the lock does not follow): a new snapshot sees it
  // moved.
  let [r] = await run<Row>(db, staleReportSql, params);
  if (!r) [r] = await run<Row>(db, staleReportSql, params);
  const current: CurrentState = {
    jobId: p.jobId,
    status: r?.current_status ?? 'canceled',
    attemptNo: r?.current_attempt_no ?? 0,
    currentAttemptId: r?.current_attempt_id ?? null,
  };
  return stale(
    `attempt ${p.attemptId} is not current: job ${p.jobId} is ${current.status} at attempt ${current.attemptNo}` +
      (current.currentAttemptId ? ` (current attempt ${current.currentAttemptId})` : ''),
    current,
  );
}
