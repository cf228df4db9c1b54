/**
 * Cancel: a job that is not terminal ends as `canceled` (queued, claimed or running → canceled).
 * A held job's attempt ends as `canceled` (its `attempts` row); a queued job's cancel is a
 * `job_events` row. The job.canceled notification goes to the outbox in the same statement.
 */
import { conflict, duplicate, notFound, ok, type Outcome } from '../domain/outcomes.js';
import { check, schemas } from '../domain/validation.js';
import { countChangeSql, endedCountSql } from './counts.js';
import { withDays } from './days.js';
import { attemptEndSql, endedColumn, jobEventDeltaSql, movedRowSql, notifiedJob } from './ends.js';
import { outboxSql } from './outbox.js';
import { currentOf, jobErrorSql, jobRowById, toJob, type Job } from './rows.js';
import { JOB_COLUMNS } from './schema.js';
import { run, statement, type Queryable } from './sql.js';

export interface CancelParams {
  jobId: string;
  now?: Date;
}

/** What a cancel did: the job, and the attempt it took away (to push `Cancel` to its agent). */
export interface Canceled {
  job: Job;
  canceledAttempt: { attemptId: string; agentId: string } | null;
}

// The job moves to its day's partition of jobs, as every end does (ends.ts, endedColumn). A
// held job's attempt ends as `canceled` (its row written here); a queued job's cancel is a
// job_events row (no attempt made it), without done_day (where the row is kept, not a change).
// The end's time `t` is the clock read once the row is locked, not now(): an operator's cancel
// can race a claim or a start, and now() (when the cancel's transaction began) may come before
// the claim or start it follows and ends (docs/decisions.md, "A claim is stamped with the clock").
const cancelSql = statement(
  'jobCancel',
  `WITH o AS (
     SELECT * FROM jobs_live WHERE id = $1 AND status IN ('queued', 'claimed', 'running') FOR UPDATE
   ), t AS MATERIALIZED (
     SELECT coalesce($2::timestamptz, clock_timestamp()) AS at FROM o
   ), m AS (
     DELETE FROM jobs_live j USING o WHERE j.id = o.id RETURNING j.*
   ), u AS (
     INSERT INTO jobs (${JOB_COLUMNS.join(', ')})
     SELECT ${movedRowSql('m', { ...endedColumn('t.at'), status: "'canceled'" })} FROM m, t
     RETURNING *
   ), a AS (
     ${attemptEndSql(`SELECT o.current_attempt_id, o.id, o.attempt_no, o.agent_id, o.claimed_at, o.claim_deadline, o.started_at,
       u.finished_at, o.suspect_since, 'canceled', NULL, NULL, 'canceled', NULL, o.created_at
     FROM u JOIN o ON o.id = u.id WHERE o.current_attempt_id IS NOT NULL`)}
   ), e AS (
     INSERT INTO job_events (job_id, kind, at, data)
     SELECT u.id, 'canceled', u.finished_at, ${jobEventDeltaSql("to_jsonb(u) - 'done_day'", 'to_jsonb(o)')}
     FROM u JOIN o ON o.id = u.id WHERE o.current_attempt_id IS NULL
     RETURNING at
   ), k AS (
     ${countChangeSql('SELECT u.queue, u.status, 1 FROM u')}
   ), ec AS (
     ${endedCountSql(`SELECT a.ended_at, 'canceled' FROM a UNION ALL SELECT e.at, 'canceled' FROM e`)}
   )${outboxSql(`SELECT u.id AS job_id, u.queue, u.notify_url, 'job.canceled' AS type, u.finished_at AS at,
       ${notifiedJob(jobErrorSql('u'))} AS job,
       coalesce((SELECT to_jsonb(a) FROM a),
                (SELECT to_jsonb(la) FROM attempts la WHERE la.job_id = u.id AND la.attempt_no = u.attempt_no)) AS attempt
     FROM u`)}
   SELECT u.*, ${jobErrorSql('u')} AS error, o.current_attempt_id AS canceled_attempt_id, o.agent_id AS canceled_agent_id
   FROM u JOIN o ON o.id = u.id`,
);

/**
 * Cancels a job that is not terminal (its current attempt, if any, ends as `canceled`).
 * A canceled job is `duplicate`; another terminal job is `conflict`.
 */
export async function jobCancel(db: Queryable, p: CancelParams): Promise<Outcome<Canceled>> {
  const bad = check('jobId', schemas.id, p.jobId);
  if (bad) return bad;
  const [row] = await withDays(db, () => run<Record<string, unknown>>(db, cancelSql, [p.jobId, p.now ?? null]));
  if (row) {
    const { canceled_attempt_id, canceled_agent_id, ...job } = row;
    return ok({
      job: toJob(job),
      canceledAttempt: canceled_attempt_id
        ? { attemptId: canceled_attempt_id as string, agentId: canceled_agent_id as string }
        : null,
    });
  }
  const cur = await jobRowById(db, p.jobId);
  if (!cur) return notFound(`job ${p.jobId} not found`);
  const job = toJob(cur);
  if (job.status === 'canceled') return duplicate({ job, canceledAttempt: null });
  return conflict(`job ${p.jobId} is already ${job.status}`, currentOf(cur as never));
}
