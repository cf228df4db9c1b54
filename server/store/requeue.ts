/**
 * Requeue: an operator's second chance for a finished job (dead, failed or canceled → queued),
 * its row moved back from its day's partition to `jobs_live`, with a `job_events` row.
 */
import { conflict, notFound, ok, type Outcome } from '../domain/outcomes.js';
import { check, schemas } from '../domain/validation.js';
import { countChangeSql } from './counts.js';
import { jobEventDeltaSql, movedRowSql } from './ends.js';
import { JOBS_CHANNEL } from './notify.js';
import { currentOf, jobErrorSql, jobRowById, toJob, withoutNotified, type Job } from './rows.js';
import { JOB_COLUMNS } from './schema.js';
import { run, statement, type Queryable } from './sql.js';

export interface RequeueParams {
  jobId: string;
  now?: Date;
}

// What a requeue changes in the row it moves back to jobs_live.
const REQUEUED: Record<string, string> = {
  status: `'queued'`,
  run_at: 'coalesce($2::timestamptz, now())',
  attempts_started: '0',
  finished_at: 'NULL',
  updated_at: 'coalesce($2::timestamptz, now())',
  done_day: 'NULL',
};

// The job moves back from its day's partition to jobs_live (m deletes it, b inserts it queued), or,
// a row that finished before jobs moved at every end (kept in jobs_live), is updated there (l). Its
// event leaves out done_day (where the row is kept, not a change of the job).
const requeueSql = statement(
  'jobRequeue',
  `WITH o AS (
     SELECT * FROM jobs WHERE id = $1 AND status IN ('dead', 'failed', 'canceled') FOR UPDATE
   ), m AS (
     DELETE FROM jobs j USING o WHERE j.id = o.id AND o.done_day IS NOT NULL AND j.done_day = o.done_day RETURNING j.*
   ), b AS (
     INSERT INTO jobs_live (${JOB_COLUMNS.join(', ')})
     SELECT ${movedRowSql('m', REQUEUED)} FROM m
     RETURNING *
   ), l AS (
     UPDATE jobs_live j SET status = 'queued', run_at = coalesce($2::timestamptz, now()), attempts_started = 0,
       finished_at = NULL, updated_at = coalesce($2::timestamptz, now())
     FROM o WHERE j.id = o.id AND o.done_day IS NULL
     RETURNING j.*
   ), u AS (
     SELECT * FROM b UNION ALL SELECT * FROM l
   ), e AS (
     INSERT INTO job_events (job_id, kind, at, data)
     SELECT u.id, 'requeued', u.updated_at, ${jobEventDeltaSql("to_jsonb(u) - 'done_day'", 'to_jsonb(o)')} FROM u JOIN o ON o.id = u.id
   ), k AS (
     ${countChangeSql('SELECT o.queue, o.status, -1 FROM o JOIN u ON u.id = o.id')}
   )
   SELECT u.*, ${jobErrorSql('u')} AS error, (SELECT count(pg_notify('${JOBS_CHANNEL}', u.queue)) FROM u) AS notified FROM u`,
);

/**
 * An operator's second chance: a `dead`, `failed` or `canceled` job goes back to `queued` with
 * its started-attempt count reset (attempt numbers keep growing). A succeeded job never moves.
 */
export async function jobRequeue(db: Queryable, p: RequeueParams): Promise<Outcome<Job>> {
  const bad = check('jobId', schemas.id, p.jobId);
  if (bad) return bad;
  const [row] = await run<Record<string, unknown>>(db, requeueSql, [p.jobId, p.now ?? null]);
  if (row) return ok(toJob(withoutNotified(row)));
  const cur = await jobRowById(db, p.jobId);
  if (!cur) return notFound(`job ${p.jobId} not found`);
  return conflict(
    `job ${p.jobId} is ${String(cur.status)}: only dead, failed or canceled jobs can be requeued`,
    currentOf(cur as never),
  );
}
