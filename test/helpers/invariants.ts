/**
 * The six invariants of DESIGN.md, checked against the database as it is. Every test of state
 * calls `checkInvariants` after it acts; it throws with every violation it found.
 *
 * 1. At most one current attempt per job; a non-current attempt never changed anything
 *    (every attempt-bound event was made by the attempt current at that point of the history).
 * 2. A job reaches a terminal state at most once per run (an operator requeue starts another
 *    run); nothing happens after success, and the stored result is the completing attempt's.
 * 3. Every transition is in job_events: folding each job's event deltas rebuilds its row.
 * 4. No job is lost: each is terminal, queued, or held by an attempt with a lease (live, when
 *    the reaper has run at `rescuedAt`).
 * 5. Completion is idempotent per attempt: at most one completion per attempt, matching how
 *    the attempt ended.
 * 6. Each (job_id, step) has at most one recorded outcome, recorded by an attempt of that job.
 */
import { isDeepStrictEqual } from 'node:util';
import type pg from 'pg';

type Db = pg.Pool | pg.PoolClient | pg.Client;

/** Columns a heartbeat may move without a transition: left out of the rebuild comparison. */
const UNTRACKED = ['updated_at', 'heartbeat_at', 'lease_expires_at', 'progress'];
const TERMINAL_EVENTS = new Set(['completed', 'failed', 'dead', 'canceled']);
/** Events that a new attempt makes (`claimed`) or that need no attempt. */
const UNFENCED_EVENTS = new Set(['enqueued', 'claimed', 'requeued']);

export interface InvariantOptions {
  /** The reaper ran at this time: no held job may have a lease that ended before it. */
  rescuedAt?: Date;
}

/** Checks the six invariants; throws an Error listing every violation. */
export async function checkInvariants(db: Db, opts: InvariantOptions = {}): Promise<void> {
  const v: string[] = [];
  await attemptsInvariant(db, v);
  await historyInvariants(db, v);
  await heldInvariant(db, v, opts);
  await completionInvariant(db, v);
  await stepInvariant(db, v);
  if (v.length) throw new Error(`invariants violated (${v.length}):\n- ${v.slice(0, 30).join('\n- ')}`);
}

/** 1: one live attempt exactly for held jobs, matching the job's state; attempt numbers 1..n. */
async function attemptsInvariant(db: Db, v: string[]) {
  const { rows } = await db.query(`
    SELECT j.id, j.status::text, j.current_attempt_id, j.attempt_no,
      (SELECT count(*) FROM attempts a WHERE a.job_id = j.id AND a.status IN ('claimed', 'running'))::int AS live,
      (SELECT a.status::text FROM attempts a WHERE a.id = j.current_attempt_id) AS cur_status,
      (SELECT a.job_id FROM attempts a WHERE a.id = j.current_attempt_id) AS cur_job,
      (SELECT coalesce(max(a.attempt_no), 0) FROM attempts a WHERE a.job_id = j.id)::int AS max_no,
      (SELECT count(*) FROM attempts a WHERE a.job_id = j.id)::int AS n
    FROM jobs j`);
  for (const r of rows) {
    const held = r.status === 'claimed' || r.status === 'running';
    if (r.live > 1) v.push(`job ${r.id} has ${r.live} live attempts`);
    if (held && (r.live !== 1 || r.cur_status !== r.status || r.cur_job !== r.id)) {
      v.push(`job ${r.id} is ${r.status} but its current attempt ${r.current_attempt_id} is ${r.cur_status} (live ${r.live})`);
    }
    if (!held && r.live !== 0) v.push(`job ${r.id} is ${r.status} yet has ${r.live} live attempt(s)`);
    if (r.attempt_no !== r.max_no || r.n !== r.max_no) {
      v.push(`job ${r.id} attempt_no ${r.attempt_no} but attempts numbered up to ${r.max_no} (${r.n} rows)`);
    }
  }
}

/** 1 (history), 2 and 3: replay every job's events. */
async function historyInvariants(db: Db, v: string[]) {
  const jobs = new Map<string, Record<string, unknown>>();
  for (const r of (await db.query(`SELECT id, to_jsonb(j) AS row FROM jobs j`)).rows) jobs.set(r.id, r.row);
  const events = (
    await db.query(`SELECT id, job_id, attempt_id, kind::text, data FROM job_events ORDER BY job_id, id`)
  ).rows as Array<{ id: number; job_id: string; attempt_id: string | null; kind: string; data: Record<string, unknown> }>;
  const byJob = new Map<string, typeof events>();
  for (const e of events) {
    const list = byJob.get(e.job_id) ?? [];
    list.push(e);
    byJob.set(e.job_id, list);
  }
  for (const [id, row] of jobs) {
    const list = byJob.get(id) ?? [];
    if (list[0]?.kind !== 'enqueued') v.push(`job ${id}: history does not start with enqueued`);
    let state: Record<string, unknown> = {};
    let terminals = 0;
    let requeues = 0;
    let succeeded = false;
    for (const e of list) {
      if (succeeded) v.push(`job ${id}: event ${e.kind} (#${e.id}) after success`);
      if (e.kind === 'claimed') {
        if (state.current_attempt_id != null) v.push(`job ${id}: claimed while attempt ${String(state.current_attempt_id)} was current`);
        if (e.data.current_attempt_id !== e.attempt_id) v.push(`job ${id}: claim event #${e.id} does not install its attempt`);
      } else if (!UNFENCED_EVENTS.has(e.kind) && e.attempt_id !== null && e.attempt_id !== state.current_attempt_id) {
        v.push(`job ${id}: ${e.kind} (#${e.id}) written by attempt ${e.attempt_id} while ${String(state.current_attempt_id)} was current`);
      }
      if (TERMINAL_EVENTS.has(e.kind)) terminals++;
      if (e.kind === 'requeued') requeues++;
      if (e.kind === 'completed') succeeded = true;
      state = { ...state, ...e.data };
    }
    if (terminals > requeues + 1) v.push(`job ${id}: ${terminals} terminal transitions with ${requeues} requeue(s)`);
    const strip = (o: Record<string, unknown>) => {
      const c = { ...o };
      for (const k of UNTRACKED) delete c[k];
      return c;
    };
    if (!isDeepStrictEqual(strip(state), strip(row))) {
      const diff = Object.keys({ ...row, ...state })
        .filter((k) => !UNTRACKED.includes(k) && !isDeepStrictEqual(state[k], row[k]))
        .map((k) => `${k}: events say ${JSON.stringify(state[k])}, row has ${JSON.stringify(row[k])}`);
      v.push(`job ${id}: rebuilt from events differs: ${diff.join('; ')}`);
    }
    if ((state.lease_expires_at == null) !== (row.lease_expires_at == null)) {
      v.push(`job ${id}: lease presence differs between events and row`);
    }
  }
  for (const jobId of byJob.keys()) if (!jobs.has(jobId)) v.push(`events for missing job ${jobId}`);
}

/** 4: every job is terminal, queued, or held with a lease (not ended before `rescuedAt`). */
async function heldInvariant(db: Db, v: string[], opts: InvariantOptions) {
  const { rows } = await db.query(
    `SELECT id, status::text, lease_expires_at FROM jobs
     WHERE status IN ('claimed', 'running')
       AND (current_attempt_id IS NULL OR lease_expires_at IS NULL OR agent_id IS NULL
            OR ($1::timestamptz IS NOT NULL AND lease_expires_at < $1::timestamptz))`,
    [opts.rescuedAt ?? null],
  );
  for (const r of rows) v.push(`job ${r.id} is ${r.status} without a live lease (${String(r.lease_expires_at)})`);
}

/** 5: one completion per attempt, of the attempt's job, matching how the attempt ended. */
async function completionInvariant(db: Db, v: string[]) {
  const { rows } = await db.query(`
    SELECT c.attempt_id, c.kind, c.job_id, a.job_id AS a_job, a.status::text AS a_status
    FROM completions c LEFT JOIN attempts a ON a.id = c.attempt_id`);
  for (const r of rows) {
    if (r.job_id !== r.a_job) v.push(`completion of attempt ${r.attempt_id} names job ${r.job_id}, attempt is of ${r.a_job}`);
    const want = r.kind === 'completed' ? 'succeeded' : 'failed';
    if (r.a_status !== want) v.push(`attempt ${r.attempt_id} has a ${r.kind} completion but is ${r.a_status}`);
  }
  const bad = await db.query(`
    SELECT j.id FROM jobs j LEFT JOIN completions c ON c.attempt_id = j.last_attempt_id
    WHERE j.status = 'succeeded' AND (c.kind IS DISTINCT FROM 'completed' OR c.result IS DISTINCT FROM j.result)`);
  for (const r of bad.rows) v.push(`job ${r.id} succeeded but its result is not its last attempt's completion`);
}

/** 6: steps belong to attempts of their job; done steps have a finish time, started ones no output. */
async function stepInvariant(db: Db, v: string[]) {
  const { rows } = await db.query(`
    SELECT s.job_id, s.step, s.status::text, a.job_id AS a_job, s.output, s.finished_at
    FROM steps s LEFT JOIN attempts a ON a.id = s.attempt_id`);
  for (const r of rows) {
    if (r.a_job !== r.job_id) v.push(`step ${r.job_id}/${r.step} held by an attempt of another job`);
    if (r.status === 'started' && (r.output !== null || r.finished_at !== null)) v.push(`step ${r.job_id}/${r.step} started but has an outcome`);
    if (r.status === 'done' && r.finished_at === null) v.push(`step ${r.job_id}/${r.step} done without a finish time`);
  }
}
