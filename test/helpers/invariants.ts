/**
 * The six invariants of DESIGN.md, checked against the database as it is. Every test of state
 * calls `checkInvariants` after it acts; it throws with every violation it found.
 *
 * A job's history is its row as enqueued, its ended attempts (`attempt_log`: a row of `attempts`
 * per ended attempt, written by the statement that ended it, with the claim, start and end, and
 * what became of the job; a success's attempt kept on its job's row instead) and `job_events`
 * (requeues, and cancels of jobs no attempt held); a live attempt is in the row.
 *
 * 1. At most one current attempt per job: ended attempts are numbered 1..k, the live one (if
 *    any) is k+1 and has no row yet, and no attempt overlaps the next (each was current while
 *    it acted: the next was claimed only after it ended). Every ended attempt's job exists
 *    (`attempts.job_id` has no foreign key; the purge deletes them with their job).
 * 2. A job reaches a terminal state at most once per run (an operator requeue starts another
 *    run); nothing happens after success, and the stored result is the succeeding attempt's.
 * 3. Folding a job's history rebuilds its row (status, attempt_no, attempts_started, run_at,
 *    finished_at, the live attempt).
 * 4. No job is lost: each is terminal, queued, or held by an attempt with a lease (live, when
 *    the reaper has run at `rescuedAt`).
 * 5. Completion is idempotent per attempt: one row per attempt, one success per job, matching
 *    the job.
 * 6. Each (job_id, step) has at most one recorded outcome, recorded by an attempt of that job.
 *
 * And what the counts read (the kept finished counts plus the live jobs, server/store/counts.ts)
 * is what counting every job says.
 */
import type pg from 'pg';
import { endedCutoff, endedScanSql } from '../../server/store/counts.js';
import { jobCounts } from '../../server/store/index.js';
import { JOB_REFERENCES } from '../../server/store/schema.js';

type Db = pg.Pool | pg.PoolClient | pg.Client;

const TERMINAL = new Set(['succeeded', 'failed', 'dead', 'canceled']);

export interface InvariantOptions {
  /** The reaper ran at this time: no held job may have a lease that ended before it. */
  rescuedAt?: Date;
}

/** Checks the six invariants; throws an Error listing every violation. */
export async function checkInvariants(db: Db, opts: InvariantOptions = {}): Promise<void> {
  const v: string[] = [];
  const gone = await goneJobs(db);
  await historyInvariants(db, v, gone);
  await heldInvariant(db, v, opts);
  await stepInvariant(db, v, gone);
  await countInvariant(db, v);
  await orphanInvariant(db, v, gone);
  if (v.length) throw new Error(`invariants violated (${v.length}):\n- ${v.slice(0, 30).join('\n- ')}`);
}

/**
 * The jobs of dropped days still to be swept (`jobs_gone_*`, server/store/days.ts): gone from
 * `jobs` at once, their rows in the other tables deleted behind them, which may so outlive them.
 */
async function goneJobs(db: Db): Promise<Set<string>> {
  const { rows: tables } = await db.query<{ t: string }>(`SELECT relname AS t FROM pg_class WHERE relkind = 'r' AND relname ~ '^jobs_gone_[0-9]{8}$'`);
  const gone = new Set<string>();
  for (const { t } of tables) for (const r of (await db.query<{ id: string }>(`SELECT id FROM "${t}"`)).rows) gone.add(r.id);
  return gone;
}

interface JobRow {
  id: string;
  status: string;
  attempt_no: number;
  attempts_started: number;
  current_attempt_id: string | null;
  agent_id: string | null;
  claimed_at: string | null;
  started_at: string | null;
  run_at: string;
  created_at: string;
  finished_at: string | null;
  has_result: boolean;
}

interface AttemptRow {
  id: string;
  job_id: string;
  attempt_no: number;
  agent_id: string;
  status: string;
  claimed_at: string;
  started_at: string | null;
  ended_at: string;
  job_status: string;
  run_at: string | null;
  error: unknown;
  retryable: boolean | null;
  /** NULL for a success kept on its job's row. */
  seq: string | null;
}

interface EventRow {
  id: number;
  job_id: string;
  attempt_id: string | null;
  kind: string;
  at: string;
  data: Record<string, string | number | null>;
}

/** 1, 2, 3 and 5: replay every job's history. Times are compared as the database prints them (µs). */
async function historyInvariants(db: Db, v: string[], gone: Set<string>) {
  const text = (c: string) => `to_char(${c} AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US')`;
  const jobs = (
    await db.query(
      `SELECT id, status::text, attempt_no, attempts_started, current_attempt_id, agent_id, ${text('claimed_at')} AS claimed_at,
         ${text('started_at')} AS started_at, ${text('run_at')} AS run_at, ${text('created_at')} AS created_at,
         ${text('finished_at')} AS finished_at, result IS NOT NULL AS has_result
       FROM jobs`,
    )
  ).rows as JobRow[];
  const attempts = (
    await db.query(
      `SELECT id, job_id, attempt_no, agent_id, status::text, ${text('claimed_at')} AS claimed_at, ${text('started_at')} AS started_at,
         ${text('ended_at')} AS ended_at, job_status::text, ${text('run_at')} AS run_at, error, retryable, seq
       FROM attempt_log ORDER BY job_id, attempt_no`,
    )
  ).rows as AttemptRow[];
  const events = (
    await db.query(
      `SELECT id, job_id, attempt_id, kind::text, ${text('at')} AS at,
         (SELECT jsonb_object_agg(k, CASE WHEN jsonb_typeof(x) = 'string' AND k IN ('run_at', 'finished_at')
                                           THEN to_jsonb(${text('(x #>> \'{}\')::timestamptz')}) ELSE x END)
          FROM jsonb_each(data) AS d(k, x)) AS data
       FROM job_events ORDER BY job_id, id`,
    )
  ).rows as EventRow[];
  const group = <T extends { job_id: string }>(rows: T[]) => {
    const m = new Map<string, T[]>();
    for (const r of rows) m.set(r.job_id, [...(m.get(r.job_id) ?? []), r]);
    return m;
  };
  const attemptsOf = group(attempts);
  const eventsOf = group(events);
  const current = new Set(jobs.filter((j) => j.current_attempt_id).map((j) => j.current_attempt_id!));

  for (const job of jobs) {
    const id = job.id;
    const as = attemptsOf.get(id) ?? [];
    const es = eventsOf.get(id) ?? [];
    const held = job.status === 'claimed' || job.status === 'running';
    // 1: numbering, and the live attempt.
    as.forEach((a, i) => {
      if (a.attempt_no !== i + 1) v.push(`job ${id}: attempts numbered ${as.map((x) => x.attempt_no).join(',')}`);
      if (current.has(a.id)) v.push(`job ${id}: attempt ${a.id} has ended yet is some job's current attempt`);
    });
    const expectedNo = as.length + (held ? 1 : 0);
    if (job.attempt_no !== expectedNo) v.push(`job ${id}: attempt_no ${job.attempt_no} but ${as.length} ended attempt(s)${held ? ' and a live one' : ''}`);
    if (held !== (job.current_attempt_id !== null)) v.push(`job ${id} is ${job.status} with current attempt ${job.current_attempt_id}`);

    // The history in order: ended attempts and the job's own events share one sequence.
    type Item = { seq: number; kind: 'attempt'; a: AttemptRow } | { seq: number; kind: 'event'; e: EventRow };
    const items: Item[] = [
      // A success kept on its job's row has no seq: its job's last transition.
      ...as.map((a): Item => ({ seq: a.seq === null ? Infinity : Number(a.seq), kind: 'attempt', a })),
      ...es.map((e): Item => ({ seq: Number(e.id), kind: 'event', e })),
    ].sort((x, y) => x.seq - y.seq);
    // A success kept on its job's row is ordered last by its missing seq: nothing may follow it in time either.
    const kept = as.find((a) => a.seq === null);
    if (kept && es.some((e) => e.at > kept.ended_at)) v.push(`job ${id}: an event after its success (attempt ${kept.attempt_no})`);
    if (kept && kept !== as.at(-1)) v.push(`job ${id}: attempt ${kept.attempt_no} kept on the job's row is not its last`);
    const bySeq = items.filter((x) => x.kind === 'attempt').map((x) => (x as { a: AttemptRow }).a.attempt_no);
    if (bySeq.some((n, i) => n !== i + 1)) v.push(`job ${id}: attempts ended in the order ${bySeq.join(',')}`);
    let status = 'queued';
    let started = 0;
    let finishedAt: string | null = null;
    let runAt: string | null = null;
    let lastEnd = job.created_at;
    let terminals = 0;
    let requeues = 0;
    let succeededBy: string | null = null;
    for (const it of items) {
      if (succeededBy) v.push(`job ${id}: ${it.kind === 'attempt' ? `attempt ${it.a.attempt_no} ended` : `event ${it.e.kind}`} after success`);
      if (it.kind === 'attempt') {
        const a = it.a;
        // 1: it was claimed after everything before it ended, and from a queued job.
        if (a.claimed_at < lastEnd) v.push(`job ${id}: attempt ${a.attempt_no} claimed at ${a.claimed_at}, before the previous transition at ${lastEnd}`);
        if (status !== 'queued') v.push(`job ${id}: attempt ${a.attempt_no} claimed while the job was ${status}`);
        if (a.started_at && a.started_at < a.claimed_at) v.push(`job ${id}: attempt ${a.attempt_no} started before its claim`);
        if (a.ended_at < a.claimed_at) v.push(`job ${id}: attempt ${a.attempt_no} ended before its claim`);
        if (a.started_at) started++;
        status = a.job_status;
        finishedAt = TERMINAL.has(status) ? a.ended_at : null;
        if (a.run_at) runAt = a.run_at;
        if (a.status === 'succeeded' && a.job_status !== 'succeeded') v.push(`job ${id}: attempt ${a.attempt_no} succeeded but left the job ${a.job_status}`);
        if (a.status === 'failed' && (a.error === null || a.retryable === null)) v.push(`job ${id}: failed attempt ${a.attempt_no} without its error`);
        if (a.status === 'succeeded') succeededBy = a.id;
        lastEnd = a.ended_at;
      } else {
        const e = it.e;
        if (e.kind === 'requeued') {
          if (!TERMINAL.has(status) || status === 'succeeded') v.push(`job ${id}: requeued while ${status}`);
          requeues++;
          started = 0;
        } else if (e.kind === 'canceled') {
          if (status !== 'queued') v.push(`job ${id}: a cancel event (no attempt) while the job was ${status}`);
          if (e.attempt_id !== null) v.push(`job ${id}: cancel event #${e.id} names attempt ${e.attempt_id}: an attempt's cancel is its own row`);
        } else {
          v.push(`job ${id}: unexpected event ${e.kind} (#${e.id})`);
        }
        if (typeof e.data.status === 'string') status = e.data.status;
        if ('finished_at' in e.data) finishedAt = (e.data.finished_at as string | null) ?? null;
        if (typeof e.data.run_at === 'string') runAt = e.data.run_at;
        lastEnd = e.at;
      }
      if (TERMINAL.has(status)) terminals++;
    }
    // 2
    if (terminals > requeues + 1) v.push(`job ${id}: ${terminals} terminal transitions with ${requeues} requeue(s)`);
    // 3: the live attempt, then the row.
    if (held) {
      if (status !== 'queued') v.push(`job ${id}: held, but its history leaves it ${status}`);
      if (job.claimed_at === null || job.claimed_at < lastEnd) v.push(`job ${id}: its live attempt was claimed at ${job.claimed_at}, before ${lastEnd}`);
      if ((job.status === 'running') !== (job.started_at !== null)) v.push(`job ${id} is ${job.status} with started_at ${job.started_at}`);
      if (job.status === 'running') started++;
      status = job.status;
    }
    if (status !== job.status) v.push(`job ${id}: history says ${status}, row has ${job.status}`);
    if (started !== job.attempts_started) v.push(`job ${id}: history counts ${started} started attempt(s), row has ${job.attempts_started}`);
    if (finishedAt !== job.finished_at) v.push(`job ${id}: history says finished at ${finishedAt}, row has ${job.finished_at}`);
    if (runAt !== null && runAt !== job.run_at) v.push(`job ${id}: history says due at ${runAt}, row has ${job.run_at}`);
    // 5: a success, and only a success, carries the result.
    if ((job.status === 'succeeded') !== job.has_result) v.push(`job ${id} is ${job.status} ${job.has_result ? 'with' : 'without'} a result`);
    if (job.status === 'succeeded' && (!succeededBy || as.at(-1)?.id !== succeededBy)) v.push(`job ${id} succeeded, but not by its last attempt`);
  }
  const known = new Set(jobs.map((j) => j.id));
  for (const jobId of [...attemptsOf.keys(), ...eventsOf.keys()]) if (!known.has(jobId) && !gone.has(jobId)) v.push(`history for missing job ${jobId}`);
}

/**
 * No row of a table that belongs to a job outlives its job: none has a foreign key (schema.ts,
 * `JOB_REFERENCES`); the statements that write them lock the job's row, and the purge deletes
 * them with it, or, for a dropped day, sweeps them behind it (`goneJobs`). (`job_events` and
 * `attempts` are checked with the history above.)
 */
async function orphanInvariant(db: Db, v: string[], gone: Set<string>) {
  for (const table of JOB_REFERENCES.filter((t) => t !== 'job_events')) {
    const { rows } = await db.query(
      `SELECT DISTINCT x.job_id FROM ${table} x WHERE NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = x.job_id) AND x.job_id <> ALL ($1::uuid[]) LIMIT 5`,
      [[...gone]],
    );
    for (const r of rows) v.push(`${table} rows for missing job ${r.job_id}`);
  }
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

/** 6: steps belong to attempts of their job; done steps have a finish time, started ones no output. */
async function stepInvariant(db: Db, v: string[], gone: Set<string>) {
  const { rows } = await db.query(`
    SELECT s.job_id, s.step, s.status::text, coalesce(a.job_id, l.id) AS a_job, s.output, s.finished_at
    FROM steps s LEFT JOIN attempt_log a ON a.id = s.attempt_id LEFT JOIN jobs l ON l.current_attempt_id = s.attempt_id`);
  for (const r of rows) {
    if (gone.has(r.job_id)) continue;
    if (r.a_job !== r.job_id) v.push(`step ${r.job_id}/${r.step} held by an attempt of another job`);
    if (r.status === 'started' && (r.output !== null || r.finished_at !== null)) v.push(`step ${r.job_id}/${r.step} started but has an outcome`);
    if (r.status === 'done' && r.finished_at === null) v.push(`step ${r.job_id}/${r.step} done without a finish time`);
  }
}

/**
 * The counts GetStats and `/metrics` read equal a count of every job, queue by queue and status
 * by status; the per-minute counts equal a count of what ended in each minute.
 */
async function countInvariant(db: Db, v: string[]): Promise<void> {
  // The counts read and the jobs counted in one snapshot (given a pool): read a moment apart in a
  // database still at work (a chaos run's end, jobs still moving) they differ by the jobs that
  // moved in between, where nothing was wrong. Only these two: a transaction held over every check
  // would keep its locks while the days' partitions are detached and dropped.
  const own = 'totalCount' in db ? await db.connect() : undefined;
  let read: Awaited<ReturnType<typeof jobCounts>>;
  let rows: { queue: string; status: string; count: number }[];
  try {
    const q = own ?? db;
    if (own) await own.query('BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY');
    read = await jobCounts(q);
    ({ rows } = await q.query<{ queue: string; status: string; count: number }>(
      'SELECT queue, status::text AS status, count(*)::int AS count FROM jobs GROUP BY queue, status ORDER BY queue, status',
    ));
    if (own) await own.query('COMMIT');
    own?.release();
  } catch (err) {
    own?.release(err as Error);
    throw err;
  }
  const key = (r: { queue: string; status: string }) => `${r.queue}/${r.status}`;
  const counted = new Map(rows.map((r) => [key(r), r.count]));
  const kept = new Map(read.map((r) => [key(r), r.count]));
  for (const k of new Set([...counted.keys(), ...kept.keys()])) {
    if ((counted.get(k) ?? 0) !== (kept.get(k) ?? 0)) v.push(`counts: ${k} read ${kept.get(k) ?? 0}, counted ${counted.get(k) ?? 0}`);
  }
  // The per-minute counts kept equal what the attempts and cancels of the last day say.
  const minutes = await db.query<{ minute: Date; kind: string; kept: number; counted: number }>(
    `WITH kept AS (
       SELECT minute, kind, sum(n)::int AS n FROM ended_counts WHERE minute >= ${endedCutoff} GROUP BY 1, 2
     ), counted AS (${endedScanSql})
     SELECT coalesce(k.minute, c.minute) AS minute, coalesce(k.kind, c.kind) AS kind, coalesce(k.n, 0)::int AS kept, coalesce(c.n, 0)::int AS counted
     FROM kept k FULL JOIN counted c ON c.minute = k.minute AND c.kind = k.kind
     WHERE coalesce(k.n, 0) <> coalesce(c.n, 0)`,
  );
  for (const r of minutes.rows) v.push(`per-minute counts: ${r.minute.toISOString()} ${r.kind} kept ${r.kept}, counted ${r.counted}`);
}
