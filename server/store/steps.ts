/**
 * The step ledger: at most one recorded outcome per `(job_id, step)`, written only by the
 * job's current attempt. An attempt reserves a step before its effect and records it after;
 * a reservation left by an earlier attempt that never recorded is the `unknown` case, which
 * the author reconciles with the downstream system (using the key `job_id:step`) before doing
 * the effect again.
 */
import { conflict, duplicate, forbidden, notFound, ok, type Outcome } from '../domain/outcomes.js';
import { check, checkAll, checkJson, limits, schemas } from '../domain/validation.js';
import { attemptWhere } from './explain.js';
import { currentOf } from './rows.js';
import type { JobStatus } from '../domain/statuses.js';
import { run, statement, type Queryable } from './sql.js';
import { reportStale } from './stale-reports.js';

interface StepRef {
  attemptId: string;
  agentId: string;
  jobId?: string;
  step: string;
  now?: Date;
}

/** What a reservation found. */
export type StepReservation =
  /** Nobody did this step yet: run the effect, then `stepRecord`. */
  | { state: 'reserved' }
  /** Done before (by this or an earlier attempt): use `output`, do not run the effect. */
  | { state: 'done'; output: unknown; attemptId: string }
  /**
   * An earlier attempt reserved the step and never recorded it: the effect may or may not have
   * happened. The reservation now belongs to this attempt; ask the downstream system first.
   */
  | { state: 'unknown'; previousAttemptId: string; reservations: number };

// The fence: FOR SHARE on the job row of the current, running attempt $1 of agent $2 (and job $3
// when given). It blocks a concurrent transition of the job (which takes FOR UPDATE) until the
// statement commits, and a transition that committed first makes the fence match nothing.
const stepFence = `WITH f AS (
     SELECT id FROM jobs_live
     WHERE current_attempt_id = $1 AND agent_id = $2 AND status = 'running' AND ($3::uuid IS NULL OR id = $3)
     FOR SHARE
   )
`;

// A reservation by another attempt that never recorded is taken over (`previous_attempt_id`
// remembers whose it was).
const reserveSql = statement(
  'stepReserve',
  `${stepFence}   INSERT INTO steps AS s (job_id, step, status, attempt_id, started_at)
   SELECT f.id, $4, 'started', $1, coalesce($5::timestamptz, now()) FROM f
   ON CONFLICT (job_id, step) DO UPDATE SET
     previous_attempt_id = CASE WHEN s.status = 'started' AND s.attempt_id <> excluded.attempt_id
                                THEN s.attempt_id ELSE s.previous_attempt_id END,
     reservations = s.reservations + (s.status = 'started' AND s.attempt_id <> excluded.attempt_id)::int,
     attempt_id = CASE WHEN s.status = 'started' THEN excluded.attempt_id ELSE s.attempt_id END
   RETURNING s.status, s.attempt_id, s.previous_attempt_id, s.output, s.reservations, (s.xmax = 0) AS inserted`,
);

// Why a step call matched nothing: the attempt, its job, and the step's row.
const stepLookupSql = statement(
  'stepLookup',
  `SELECT j.id AS job_id, coalesce(a.agent_id, l.agent_id) AS attempt_agent_id, j.status, j.attempt_no, j.current_attempt_id,
          s.status AS step_status, s.attempt_id AS step_attempt_id, s.output, s.output = $3::jsonb AS same
   FROM (SELECT $1::uuid AS id) x
   ${attemptWhere}
   LEFT JOIN steps s ON s.job_id = j.id AND s.step = $2`,
);

interface StepLookup {
  job_id: string;
  attempt_agent_id: string;
  status: JobStatus;
  attempt_no: number;
  current_attempt_id: string | null;
  step_status: 'started' | 'done' | null;
  step_attempt_id: string | null;
  output: unknown;
  same: boolean | null;
}

function checkStepRef(p: StepRef) {
  return checkAll(
    check('attemptId', schemas.id, p.attemptId),
    check('agentId', schemas.agentId, p.agentId),
    p.jobId === undefined ? undefined : check('jobId', schemas.id, p.jobId),
    check('step', schemas.stepName, p.step),
  );
}

/**
 * Explains a step call that matched nothing: `not_found`, `forbidden`, a repeat decided by
 * `onRepeat` from the step row, `stale` for an attempt that is not current (logged), and for a
 * current one `conflict` (not running, or what `onCurrent` says).
 */
async function explainStep<T>(
  db: Queryable,
  p: StepRef,
  outputJson: string | null,
  onRepeat: (l: StepLookup) => Outcome<T> | undefined,
  onCurrent: (l: StepLookup) => Outcome<T> | Promise<Outcome<T>>,
): Promise<Outcome<T>> {
  const [l] = await run<StepLookup>(db, stepLookupSql, [p.attemptId, p.step, outputJson]);
  if (!l || (p.jobId !== undefined && l.job_id !== p.jobId)) {
    return notFound(`attempt ${p.attemptId} not found` + (p.jobId ? ` for job ${p.jobId}` : ''));
  }
  if (l.attempt_agent_id !== p.agentId) return forbidden(`attempt ${p.attemptId} belongs to another agent`);
  const repeat = onRepeat(l);
  if (repeat) return repeat;
  if (l.current_attempt_id !== p.attemptId) {
    return reportStale(db, { jobId: l.job_id, attemptId: p.attemptId, agentId: p.agentId, call: 'step', now: p.now });
  }
  if (l.status !== 'running') {
    return conflict(`attempt ${p.attemptId} is ${l.status}: steps are recorded while it runs`, currentOf(l));
  }
  return onCurrent(l);
}

/** Reserves a step for the current attempt before its effect: `reserved`, `done` or `unknown`. */
export async function stepReserve(db: Queryable, p: StepRef): Promise<Outcome<StepReservation>> {
  const bad = checkStepRef(p);
  if (bad) return bad;
  const [r] = await run<{
    status: 'started' | 'done';
    attempt_id: string;
    previous_attempt_id: string | null;
    output: unknown;
    reservations: number;
    inserted: boolean;
  }>(db, reserveSql, [p.attemptId, p.agentId, p.jobId ?? null, p.step, p.now ?? null]);
  if (r) {
    if (r.status === 'done') return ok({ state: 'done', output: r.output, attemptId: r.attempt_id });
    if (r.inserted || r.previous_attempt_id === null) return ok({ state: 'reserved' });
    return ok({ state: 'unknown', previousAttemptId: r.previous_attempt_id, reservations: r.reservations });
  }
  return explainStep<StepReservation>(
    db,
    p,
    null,
    () => undefined,
    // Claimed when the fence looked, started since: reserve again now that it runs.
    () => stepReserve(db, p),
  );
}

export interface StepRecordParams extends StepRef {
  /** Any JSON value, at most `limits.stepOutputBytes` serialized. */
  output: unknown;
}

// The fence as in stepReserve, and the step must be reserved by this attempt and not yet done:
// so each (job_id, step) gets at most one recorded outcome.
const recordSql = statement(
  'stepRecord',
  `${stepFence}   UPDATE steps s SET status = 'done', output = $5::jsonb, finished_at = coalesce($6::timestamptz, now())
   FROM f WHERE s.job_id = f.id AND s.step = $4 AND s.attempt_id = $1 AND s.status = 'started'
   RETURNING s.output`,
);

/**
 * Records the outcome of a step this attempt reserved. A repeat with the same output is
 * `duplicate`; another output, or a step this attempt does not hold, is `conflict`.
 */
export async function stepRecord(db: Queryable, p: StepRecordParams): Promise<Outcome<{ output: unknown }>> {
  const bad = checkStepRef(p);
  if (bad) return bad;
  const out = checkJson('output', p.output, { maxBytes: limits.stepOutputBytes });
  if ('failure' in out) return out.failure;
  const [r] = await run<{ output: unknown }>(db, recordSql, [
    p.attemptId,
    p.agentId,
    p.jobId ?? null,
    p.step,
    out.json,
    p.now ?? null,
  ]);
  if (r) return ok({ output: r.output });
  return explainStep<{ output: unknown }>(
    db,
    p,
    out.json,
    (l) => {
      if (l.step_status !== 'done' || l.step_attempt_id !== p.attemptId) return undefined;
      return l.same
        ? duplicate({ output: l.output })
        : conflict(`step ${JSON.stringify(p.step)} was already recorded by this attempt with another output`, currentOf(l));
    },
    (l) =>
      l.step_status === 'done'
        ? conflict(`step ${JSON.stringify(p.step)} was already recorded by attempt ${l.step_attempt_id}`, currentOf(l))
        : conflict(`step ${JSON.stringify(p.step)} is not reserved by attempt ${p.attemptId}: reserve it first`, currentOf(l)),
  );
}
