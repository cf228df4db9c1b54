/**
 * What every end of an attempt or a job shares (a success, a final failure, a retry, a dead
 * letter, a cancel): the `attempts` row the ending statement writes, the attempt and the job as a
 * notification shows them, and the move of a finished job's row from `jobs_live` to its day's
 * partition of `jobs`. Used by complete.ts, fail.ts, cancel.ts and rescue.ts.
 */
import { JOB_COLUMNS } from './schema.js';

/**
 * The `attempts` row of an attempt that ends, written by the statement that ends it. `source`
 * is a SELECT yielding the columns below, in order, per ended attempt: the attempt's id, job,
 * number, agent, claim time and start deadline, start time, end time, suspect mark (as the
 * `jobs` row held them before the transition), how it ended, its error and retry flag, the job's
 * status after it, the job's new due time when it was queued again with one, and when the job
 * was created (the order of the lists of an agent's jobs, job-list.ts).
 */
export const attemptEndSql = (source: string) =>
  `INSERT INTO attempts (id, job_id, attempt_no, agent_id, claimed_at, claim_deadline, started_at, ended_at, suspect_since,
                         status, error, retryable, job_status, run_at, job_created_at)
   ${source}
   RETURNING *`;

/**
 * The attempt as a notification shows it (the fields `webhook_event_body` reads), built from the
 * values its `attempts` row is written with: a batch's notifications need no join back to the
 * inserted rows (CTEs have no statistics, so such a join is a nested loop, n² for n items).
 */
export const attemptJson = (id: string, no: string, agent: string, status: string, claimed: string, started: string, ended: string) =>
  `jsonb_build_object('id', ${id}, 'attempt_no', ${no}, 'agent_id', ${agent}, 'status', ${status}, 'claimed_at', ${claimed},
     'started_at', ${started}, 'ended_at', ${ended})`;

/**
 * The columns of a job's row that a transition set (the `data` of its `job_events` row): each key
 * of `newRow` (jsonb) whose value differs from `oldRow`'s, without the times and the progress that
 * move with every heartbeat. What the SQL function `job_event_delta` (migration 0002) returns,
 * written into the statement: a function whose body reads FROM is never inlined, and PostgreSQL 17
 * plans its body again in every statement that calls it (0.7 ms a call here), where this is
 * planned with its statement (docs/performance.md, "Statements planned on every call").
 */
export const jobEventDeltaSql = (newRow: string, oldRow: string) =>
  // Both rows as sets of keys, joined by key: each row's jsonb is computed once, where
  // `oldRow -> n.key` in the WHERE would compute it again for every key.
  `(SELECT coalesce(jsonb_object_agg(n.key, n.value), '{}'::jsonb)
    FROM jsonb_each((${newRow}) - '{updated_at,heartbeat_at,progress}'::text[]) AS n
    LEFT JOIN jsonb_each(${oldRow}) AS p ON p.key = n.key
    WHERE n.value IS DISTINCT FROM p.value)`;

/** The job as a notification shows it, from a `jobs` row named `u` and the job's error. */
export const notifiedJob = (error: string) => `to_jsonb(u) || jsonb_build_object('error', ${error})`;

/**
 * What every end (a success, a final failure, a dead letter, a cancel) changes in its job's row as
 * the row moves from `jobs_live` to its day's partition of `jobs`, `now` being the end's time: the
 * live attempt's columns are cleared, the job finishes, and done_day is the day of PostgreSQL's
 * clock (not the time a test may give: a partition exists for today and the next days, days.ts).
 * Each end adds its own (status, …); every other column is copied as it was.
 */
export const endedColumn = (now: string): Record<string, string> => ({
  current_attempt_id: 'NULL',
  agent_id: 'NULL',
  lease_expires_at: 'NULL',
  execution_deadline: 'NULL',
  claimed_at: 'NULL',
  claim_deadline: 'NULL',
  started_at: 'NULL',
  suspect_since: 'NULL',
  finished_at: now,
  updated_at: now,
  done_day: "(now() AT TIME ZONE 'UTC')::date",
});

/** The select list that inserts the moved row `alias` into `jobs` with `changed` applied. */
export const movedRowSql = (alias: string, changed: Record<string, string>): string =>
  JOB_COLUMNS.map((c) => changed[c] ?? `${alias}.${c}`).join(', ');
