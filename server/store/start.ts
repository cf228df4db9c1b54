/**
 * Start: a claimed attempt begins to run (claimed → running) and takes its run lease, capped by
 * the job's execution timeout. One attempt (the unary API) or many (the agent stream's `Started`
 * of every agent, per tick) in one statement.
 */
import { duplicate, ok, type Outcome } from '../domain/outcomes.js';
import { check, schemas } from '../domain/validation.js';
import { batchFence, checkRef, fenceParams, firstOfEach, type AttemptRef, type Shape } from './batch.js';
import { explain, withJob } from './explain.js';
import { jobColumns, summaryColumns, toJob, toSummary, type Job, type JobSummary } from './rows.js';
import { run, statement, type Queryable } from './sql.js';

export interface StartParams extends AttemptRef {
  leaseTtlMs: number;
}

// The fence (batchFence), and the attempt still only claimed. Many attempts (of any agents) in
// one statement; an item that matches nothing is explained afterwards, on its own. Nothing it
// changes is indexed, so with room on the page it is a HOT update.
const startSql = (shape: Shape) =>
  statement(
    shape === 'job' ? 'attemptStart' : 'attemptStartMany',
    `UPDATE jobs_live j SET status = 'running', attempts_started = j.attempts_started + 1,
       started_at = coalesce($5::timestamptz, now()),
       execution_deadline = coalesce($5::timestamptz, now()) + make_interval(secs => j.execution_timeout_ms / 1000.0),
       lease_expires_at = least(coalesce($5::timestamptz, now()) + make_interval(secs => $4::float8 / 1000.0),
                                coalesce($5::timestamptz, now()) + make_interval(secs => j.execution_timeout_ms / 1000.0)),
       heartbeat_at = coalesce($5::timestamptz, now()), updated_at = coalesce($5::timestamptz, now())
     WHERE ${batchFence} AND j.status = 'claimed'
     RETURNING ${shape === 'job' ? jobColumns('j') : summaryColumns('j')}`,
  );
const startSqls = { job: startSql('job'), summary: startSql('summary') };

/**
 * Moves a claimed job to `running` and sets its lease (capped by the execution timeout).
 * A repeat from the running attempt is `duplicate`.
 */
export async function attemptStart(db: Queryable, p: StartParams): Promise<Outcome<Job>> {
  const [o] = await startMany(db, { items: [p], leaseTtlMs: p.leaseTtlMs, ...(p.now ? { now: p.now } : {}) }, 'job');
  return o as Outcome<Job>;
}

/**
 * Starts many attempts in one statement (the coordinator groups the `Started` of all its agents
 * per tick); returns one outcome per item, in order, as `attemptStart` would, each with a
 * summary of the job.
 */
export async function attemptStartMany(
  db: Queryable,
  p: { items: AttemptRef[]; leaseTtlMs: number; now?: Date },
): Promise<Array<Outcome<JobSummary>>> {
  return startMany(db, p, 'summary');
}

async function startMany(
  db: Queryable,
  p: { items: AttemptRef[]; leaseTtlMs: number; now?: Date },
  shape: Shape,
): Promise<Array<Outcome<JobSummary>>> {
  const bad = check('leaseTtlMs', schemas.ttlMs, p.leaseTtlMs);
  if (bad) return p.items.map(() => bad);
  const out: Array<Outcome<JobSummary> | undefined> = p.items.map((i) => checkRef(i));
  const batch = firstOfEach(p.items, out);
  if (batch.length) {
    const rows = await run<Record<string, unknown>>(db, startSqls[shape], [...fenceParams(batch.map((k) => p.items[k]!)), p.leaseTtlMs, p.now ?? null]);
    const started = new Map(rows.map((r) => [r.current_attempt_id as string, r]));
    for (const k of batch) {
      const row = started.get(p.items[k]!.attemptId.toLowerCase());
      if (row) out[k] = ok(shape === 'job' ? toJob(row) : toSummary(row as never));
    }
  }
  for (const [k, item] of p.items.entries()) {
    if (out[k]) continue;
    // A start that arrives after its own attempt already ran (started, or even reported: a
    // completion of a claimed attempt starts it implicitly) repeats what happened: duplicate.
    const o = await explain(db, { ...item, call: 'start' }, { json: null, retryable: null }, (l) =>
      (l.current_attempt_id === item.attemptId.toLowerCase() && l.status === 'running') || l.kind ? duplicate(l.job_id) : undefined,
    );
    out[k] = await withJob(db, o);
  }
  return out as Array<Outcome<JobSummary>>;
}
