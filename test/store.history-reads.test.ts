/**
 * Operator reads as history grows (L15): what they read must not grow with the finished jobs
 * kept. The waits of GetStats and `/metrics` read the queued jobs through jobs_claim_idx, not
 * every job; the BRIN indexes of GetStats' per-minute counts summarize new pages as they fill.
 */
import pg from 'pg';
import { describe, expect, it } from 'vitest';
import {
  attemptComplete,
  attemptFail,
  attemptStart,
  jobClaim,
  jobCountsReconcile,
  jobDepths,
  jobEnqueue,
  jobGet,
  jobList,
  jobSearch,
  statsGet,
} from '../server/store/index.js';
import { jobListQuery, type JobCursor, type JobListFilter, type JobSearchParams } from '../server/store/job-list.js';
import { statsMinutesSql, waitSql } from '../server/store/stats.js';
import type { JobStatus } from '../server/domain/statuses.js';
import { useTestDb } from './helpers/db.js';
import { makeJob, makeQueuedJobs } from './helpers/factories.js';
import { planNodes as nodes, type PlanNode } from './helpers/plan.js';

const db = useTestDb();


/**
 * The plan's nodes without the subplans that look a row's error up in its attempts (jobErrorSql:
 * run for each row returned, by attempts_job_attempt_no_uq).
 */
function withoutErrorLookup(p: PlanNode): PlanNode[] {
  const isErrorLookup = (c: PlanNode) =>
    (c as { 'Parent Relationship'?: string })['Parent Relationship'] === 'SubPlan' &&
    nodes(c).some((n) => n['Relation Name'] === 'attempts' && n['Index Name'] === 'attempts_job_attempt_no_uq');
  return [p, ...(p.Plans ?? []).filter((c) => !isErrorLookup(c)).flatMap(withoutErrorLookup)];
}

describe('operator reads with history', () => {
  it('the waits read the queued jobs from jobs_claim_idx, whatever the finished jobs kept', async () => {
    await db.pool.query(
      `INSERT INTO jobs (queue, payload, status, result, finished_at)
       SELECT 'hist-' || (i % 3), '{}', 'succeeded', '{}', now() - i * interval '1 second' FROM generate_series(1, 20000) i`,
    );
    await jobCountsReconcile(db.pool); // hand-written rows: recounted, as the count keeper does
    await makeQueuedJobs(db.pool, 40, 'hist-live');
    await db.pool.query(`UPDATE jobs SET run_at = now() + interval '1 hour' WHERE id IN (SELECT id FROM jobs WHERE queue = 'hist-live' LIMIT 10)`);
    await db.pool.query('ANALYZE jobs');
    const { rows } = await db.pool.query(`EXPLAIN (FORMAT JSON) ${waitSql.text}`);
    const plan = nodes((rows[0]['QUERY PLAN'] as Array<{ Plan: PlanNode }>)[0]!.Plan);
    // Any partition of jobs (the live jobs, a day's finished ones): none read whole.
    const onJobs = plan.filter((n) => /^jobs(_live|_done_\d{8})?$/.test(n['Relation Name'] ?? ''));
    expect(onJobs.length).toBeGreaterThan(0);
    expect(onJobs.map((n) => n['Node Type'])).not.toContain('Seq Scan');
    // An index scan of it, or a bitmap heap scan over a bitmap index scan of it.
    expect(plan.map((n) => n['Index Name'])).toContain('jobs_claim_idx');
    // And it answers as before: 30 due of 40 queued, none of the 20,000 finished.
    const { waiting, depths } = await jobDepths(db.pool);
    expect(waiting.filter((w) => w.queue.startsWith('hist'))).toEqual([expect.objectContaining({ queue: 'hist-live', due: 30 })]);
    expect(depths.filter((d) => d.queue.startsWith('hist')).reduce((a, d) => a + Number(d.count), 0)).toBe(20040);
  });

  it('every shape of ListJobs reads an index that holds what it asks for, in a custom plan and in a generic one', async () => {
    // Finished history in three queues, 10 % of it dead, plus live jobs; each success's attempt
    // kept on its row by one of fifty agents, and the row in today's partition, as the completion
    // keeps them (the dead ones in jobs_live).
    await db.pool.query(
      `INSERT INTO jobs (queue, payload, status, result, finished_at, created_at,
                         final_attempt_id, final_agent_id, final_claimed_at, final_claim_deadline, final_started_at, done_day)
       SELECT 'live-' || (i % 3), '{}', CASE WHEN i % 10 = 0 THEN 'dead' ELSE 'succeeded' END::job_status,
              CASE WHEN i % 10 = 0 THEN NULL ELSE '{}'::jsonb END, now() - i * interval '1 second', now() - i * interval '1 second',
              CASE WHEN i % 10 <> 0 THEN gen_random_uuid() END, CASE WHEN i % 10 <> 0 THEN 'agent-' || (i % 50) END,
              CASE WHEN i % 10 <> 0 THEN now() - i * interval '1 second' END, CASE WHEN i % 10 <> 0 THEN now() - i * interval '1 second' + interval '1 minute' END,
              CASE WHEN i % 10 <> 0 THEN now() - i * interval '1 second' END,
              CASE WHEN i % 10 <> 0 THEN (now() AT TIME ZONE 'UTC')::date END
       FROM generate_series(1, 20000) i`,
    );
    await jobCountsReconcile(db.pool); // hand-written rows: recounted, as the count keeper does
    await makeQueuedJobs(db.pool, 5, 'live-q');
    await Promise.all([1, 2, 3].map(() => makeJob(db.pool, { queue: 'live-r', status: 'running' })));
    await db.pool.query('ANALYZE jobs');
    const empty = new Set(
      (await db.pool.query<{ name: string }>(`SELECT relname AS name FROM pg_class WHERE relname ~ '^jobs_done_[0-9]{8}$' AND reltuples <= 0`)).rows.map((r) => r.name),
    );
    expect(empty.size).toBe(2);
    const asLive = (ix: string) => ix.replace(/^jobs_done_\d{8}_id_uq$/, 'jobs_pkey').replace(/^jobs_done_\d{8}_/, 'jobs_');
    const day = 86_400_000;
    // Each shape: the indexes its plan must read, and those it may read besides. A queue's
    // finished jobs come from the queue's index even where walking every job newest first looks
    // as cheap (1 in 3 here): a burst of another queue's jobs makes that walk long (job-list.ts).
    const shapes: Array<[string, JobListFilter, string[], string[]?]> = [
      ['running', { statuses: ['running'] }, ['jobs_current_attempt_uq']],
      ['claimed, running', { statuses: ['claimed', 'running'] }, ['jobs_current_attempt_uq']],
      ['queued', { statuses: ['queued'] }, ['jobs_claim_idx']],
      ['dead', { statuses: ['dead'] }, ['jobs_unsucceeded_idx']],
      ['failed, dead, canceled of a queue', { statuses: ['failed', 'dead', 'canceled'], queue: 'live-1' }, [], ['jobs_unsucceeded_idx', 'jobs_finished_queue_idx']],
      ['a queue', { queue: 'live-1' }, ['jobs_claim_idx', 'jobs_current_attempt_uq', 'jobs_finished_queue_idx']],
      ['succeeded of a queue', { statuses: ['succeeded'], queue: 'live-1' }, ['jobs_finished_queue_idx']],
      ['a time range', { createdAfter: new Date(Date.now() - 3 * 3_600_000), createdBefore: new Date(Date.now() - 2 * 3_600_000) }, ['jobs_created_idx']],
      ['everything', {}, ['jobs_created_idx']],
      ['before a day ago', { createdBefore: new Date(Date.now() - day) }, ['jobs_created_idx']],
      // The agent's held jobs, and its ended attempts newest job first (each job fetched by id,
      // each attempt checked for a later one by the agent).
      // (jobs_final_attempt_uq holds exactly the successes kept on their rows, as does the agent
      // index: the planner may read either on a partition too small to matter.)
      ['an agent', { agentId: 'agent-1' }, ['jobs_current_attempt_uq', 'attempts_agent_idx', 'jobs_final_agent_idx'], ['jobs_pkey', 'attempts_job_attempt_no_uq', 'jobs_final_attempt_uq']],
      ['an agent, finished', { agentId: 'agent-1', statuses: ['succeeded', 'dead'] }, ['attempts_agent_idx', 'jobs_final_agent_idx'], ['jobs_pkey', 'attempts_job_attempt_no_uq', 'jobs_final_attempt_uq']],
    ];
    const c = await db.pool.connect();
    try {
      for (const mode of ['force_custom_plan', 'force_generic_plan']) {
        await c.query(`SET plan_cache_mode = ${mode}`);
        for (const [what, filter, must, may = []] of shapes) {
          for (const after of [undefined, [Date.now() * 1000, 'ffffffff-ffff-ffff-ffff-ffffffffffff'] as JobCursor]) {
            const { statement, values } = jobListQuery(filter, 51, after);
            await c.query(`PREPARE p AS ${statement.text}`);
            const literal = (v: unknown) =>
              typeof v === 'number' ? String(v) : c.escapeLiteral(v instanceof Date ? v.toISOString() : Array.isArray(v) ? `{${v.join(',')}}` : String(v));
            const { rows } = await c.query(`EXPLAIN (FORMAT JSON) EXECUTE p${values.length ? `(${values.map(literal).join(', ')})` : ''}`);
            await c.query('DEALLOCATE p');
            const plan = nodes((rows[0]['QUERY PLAN'] as Array<{ Plan: PlanNode }>)[0]!.Plan);
            const label = `${what} (${mode}${after ? ', a later page' : ''})`;
            // A sequential scan only of an empty partition (the days ahead): nothing to read.
            expect(plan.filter((n) => n['Node Type'] === 'Seq Scan' && !empty.has(n['Relation Name'] ?? '')).map((n) => n['Relation Name']), label).toEqual([]);
            // (Whether an index is read in its order or its matches sorted is the planner's call
            // at this size; the history bench times the reads at ten million jobs.) A day's
            // partition has the indexes of jobs_live that finished jobs use, named after its table.
            // The page's rows each have their error looked up in their attempts (jobErrorSql, a
            // subplan run for the rows returned only), by attempts_job_attempt_no_uq: not a read
            // of the shape's own, so it is left out here.
            const read = [...new Set(withoutErrorLookup(plan[0]!).map((n) => n['Index Name']).filter((x): x is string => !!x).map(asLive))].sort();
            expect(read.filter((x) => !must.includes(x) && !may.includes(x)), `${label}: read ${read.join(', ')}`).toEqual([]);
            expect(must.filter((x) => !read.includes(x)), `${label}: read ${read.join(', ')}`).toEqual([]);
            if (!must.length) expect(read.length, label).toBeGreaterThan(0);
          }
        }
      }
    } finally {
      await c.query('RESET plan_cache_mode');
      c.release();
    }
  });

  it('ListJobs pages through exactly the jobs a filter matches, newest first, across live and finished jobs', async () => {
    await db.truncate();
    // Jobs of two queues in every status, created at distinct and at equal times (ties broken by id).
    await db.pool.query(
      `INSERT INTO jobs (queue, payload, status, result, finished_at, created_at)
       SELECT 'pg-' || (i % 2), '{}', s::job_status, CASE WHEN s = 'succeeded' THEN '{}'::jsonb END,
              now() - (i / 3) * interval '1 second', now() - (i / 3) * interval '1 second'
       FROM generate_series(1, 600) i, (VALUES ('succeeded'), ('dead'), ('failed'), ('canceled')) v(s)
       WHERE (i + length(s)) % 4 = 0`,
    );
    await jobCountsReconcile(db.pool);
    for (let i = 0; i < 7; i++) await makeJob(db.pool, { queue: `pg-${i % 2}`, status: (['queued', 'claimed', 'running'] as const)[i % 3] });
    // Jobs two agents ran through the real transitions: done by one, retried by the other, held now.
    const must = <T,>(o: { outcome: string; value?: T }): T => {
      if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
      return o.value as T;
    };
    for (let i = 0; i < 40; i++) {
      const q = `pga-${i % 2}`; // no other job queued there: each claim takes this one
      const job = must(await jobEnqueue(db.pool, { queue: q, payload: { i } }));
      const first = i % 4 === 0 ? 'ag-1' : 'ag-2';
      const [c] = must(await jobClaim(db.pool, { agentId: first, queues: [q], limit: 1, claimTtlMs: 60_000 }));
      expect(c!.job.id).toBe(job.id);
      must(await attemptStart(db.pool, { attemptId: c!.attemptId, agentId: first, leaseTtlMs: 60_000 }));
      if (i % 3 === 0) continue; // held by `first`
      must(await attemptFail(db.pool, { attemptId: c!.attemptId, agentId: first, error: { message: 'again' }, retryable: i % 5 !== 0, backoff: { baseMs: 0, maxMs: 0 } }));
      if (i % 5 === 0) continue; // failed for good
      const [d] = must(await jobClaim(db.pool, { agentId: 'ag-1', queues: [q], limit: 1, claimTtlMs: 60_000 }));
      must(await attemptStart(db.pool, { attemptId: d!.attemptId, agentId: 'ag-1', leaseTtlMs: 60_000 }));
      if (i % 2 === 0) must(await attemptComplete(db.pool, { attemptId: d!.attemptId, agentId: 'ag-1', result: {} }));
    }
    const ran = async (agent: string) =>
      new Set(
        (
          await db.pool.query<{ id: string }>(
            `SELECT id FROM jobs WHERE agent_id = $1 UNION SELECT job_id FROM attempt_log WHERE agent_id = $1`,
            [agent],
          )
        ).rows.map((r) => r.id),
      );
    const byAgent = { 'ag-1': await ran('ag-1'), 'ag-2': await ran('ag-2') };
    const all = (
      await db.pool.query<{ id: string; queue: string; status: JobStatus }>(
        `SELECT id, queue, status::text AS status FROM jobs WHERE queue LIKE 'pg%' ORDER BY created_at DESC, id DESC`,
      )
    ).rows;
    const filters: Array<JobListFilter> = [
      { agentId: 'ag-1' },
      { agentId: 'ag-2' },
      { agentId: 'ag-1', statuses: ['succeeded', 'running'] },
      { agentId: 'ag-2', queue: 'pga-0', statuses: ['failed', 'queued', 'claimed', 'running'] },
      { agentId: 'nobody' },
      {},
      { queue: 'pg-1' },
      { statuses: ['dead'] },
      { statuses: ['dead', 'canceled'], queue: 'pg-0' },
      { statuses: ['succeeded', 'running'] },
      { statuses: ['queued', 'claimed', 'running', 'failed'], queue: 'pg-1' },
    ];
    for (const f of filters) {
      const want = all
        .filter((j) => (!f.queue || j.queue === f.queue) && (!f.statuses || f.statuses.includes(j.status)))
        .filter((j) => !f.agentId || byAgent[f.agentId as keyof typeof byAgent]?.has(j.id))
        .map((j) => j.id);
      if (f.agentId && f.agentId !== 'nobody') expect(want.length, JSON.stringify(f)).toBeGreaterThan(3);
      const got: string[] = [];
      let token = '';
      for (let pages = 0; pages < 1000; pages++) {
        const o = await jobSearch(db.pool, { ...f, pageSize: 17, ...(token ? { pageToken: token } : {}) } as JobSearchParams);
        if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
        got.push(...o.value.jobs.filter((j) => j.queue.startsWith('pg')).map((j) => j.id));
        token = o.value.nextPageToken;
        if (!token) break;
      }
      expect(got, JSON.stringify(f)).toEqual(want);
    }
    // JobService's ListJobs pages the same way.
    const listed: string[] = [];
    let token = '';
    do {
      const o = await jobList(db.pool, { queue: 'pg-0', status: 'dead', pageSize: 5, ...(token ? { pageToken: token } : {}) });
      if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
      listed.push(...o.value.jobs.map((j) => j.id));
      token = o.value.nextPageToken;
    } while (token);
    expect(listed).toEqual(all.filter((j) => j.queue === 'pg-0' && j.status === 'dead').map((j) => j.id));
  });

  it('ListJobs runs its statements in generic plans, planned once per connection, the setting gone after each call', async () => {
    await makeQueuedJobs(db.pool, 3, 'gp');
    const c = new pg.Client({ connectionString: db.url }); // a connection of its own: no statement prepared on it yet
    await c.connect();
    try {
      for (let i = 0; i < 8; i++) {
        const page = await jobSearch(c, { queue: 'gp', pageSize: 2 });
        expect(page.outcome).toBe('ok');
        expect((await jobList(c, { queue: 'gp', pageSize: 50 })).outcome).toBe('ok');
      }
      // PostgreSQL's own choice plans the first five calls each on its own (2–3 ms at ten million jobs).
      const { rows } = await c.query<{ name: string; generic_plans: string; custom_plans: string }>(
        `SELECT name, generic_plans, custom_plans FROM pg_prepared_statements WHERE name LIKE 'jobList.%' ORDER BY name`,
      );
      expect(rows.map((r) => [r.name, Number(r.generic_plans), Number(r.custom_plans)])).toEqual([
        ['jobList.queued+held+finished.q.11', 8, 0], // AdminService: 2 + 1 rows, a LIMIT of 11
        ['jobList.queued+held+finished.q.51', 8, 0], // JobService: 50 + 1 rows
      ]);
      // SET LOCAL: the connection's other statements are planned as PostgreSQL chooses.
      expect((await c.query('SHOW plan_cache_mode')).rows[0].plan_cache_mode).toBe('auto');
    } finally {
      await c.end();
    }
  });

  it("GetJob's statement settles on a generic plan that reads each table by the job's index", async () => {
    // Finished jobs in today's partition, each with a failed attempt before its success; a live
    // job with an attempt of its own, and queued ones.
    await db.pool.query(
      `INSERT INTO jobs (id, queue, payload, status, result, finished_at, created_at, attempt_no,
                         final_attempt_id, final_agent_id, final_claimed_at, final_claim_deadline, final_started_at, done_day)
       SELECT ('00000000-0000-7000-8000-' || lpad(to_hex(i), 12, '0'))::uuid, 'gj', '{}', 'succeeded', '{}', now(), now() - i * interval '1 second', 2,
              gen_random_uuid(), 'agent-' || (i % 50), now(), now() + interval '1 minute', now(), (now() AT TIME ZONE 'UTC')::date
       FROM generate_series(1, 20000) i`,
    );
    await db.pool.query(
      `INSERT INTO attempts (id, job_id, attempt_no, agent_id, status, claimed_at, claim_deadline, started_at, ended_at, error, retryable, job_status, job_created_at)
       SELECT gen_random_uuid(), j.id, 1, j.final_agent_id, 'failed', now(), now() + interval '1 minute', now(), now(), '{"message":"x"}', true, 'queued', j.created_at
       FROM jobs j WHERE j.queue = 'gj'`,
    );
    // And for each a step, a stale report and an event, so that no table GetJob reads is empty.
    await db.pool.query(
      `INSERT INTO steps (job_id, step, status, attempt_id, output, started_at, finished_at)
       SELECT j.id, 'send', 'done', j.final_attempt_id, '{}', now(), now() FROM jobs j WHERE j.queue = 'gj'`,
    );
    await db.pool.query(
      `INSERT INTO stale_reports (job_id, attempt_id, agent_id, call, current_attempt_id, current_attempt_no, current_status, at)
       SELECT j.id, gen_random_uuid(), 'agent-1', 'complete', NULL, 2, 'succeeded', now() FROM jobs j WHERE j.queue = 'gj'`,
    );
    await db.pool.query(
      `INSERT INTO job_events (job_id, attempt_id, kind, at, data)
       SELECT j.id, NULL, 'requeued', j.created_at, '{"status":"queued"}' FROM jobs j WHERE j.queue = 'gj'`,
    );
    await makeJob(db.pool, { queue: 'gj-live', status: 'running' });
    await makeQueuedJobs(db.pool, 3000, 'gj-queued'); // jobs_live not a page or two either
    await db.pool.query('ANALYZE');
    const jobId = '00000000-0000-7000-8000-000000002710';
    const c = new pg.Client({ connectionString: db.url }); // a connection of its own: no statement prepared on it yet
    await c.connect();
    try {
      for (let i = 0; i < 10; i++) {
        const read = await jobGet(c, { jobId });
        if (read.outcome !== 'ok') throw new Error(JSON.stringify(read));
        expect(read.value.attempts.map((a) => [a.attemptNo, a.status])).toEqual([
          [1, 'failed'],
          [2, 'succeeded'],
        ]);
      }
      // PostgreSQL plans the first five calls on their own, then keeps the generic plan: it costs
      // no more than theirs, the job's id pruning nothing (the partitions are by day).
      const { rows } = await c.query<{ name: string; statement: string; generic_plans: string; custom_plans: string }>(
        `SELECT name, statement, generic_plans, custom_plans FROM pg_prepared_statements WHERE name = 'jobGetDetail'`,
      );
      expect(rows.map((r) => [r.name, Number(r.generic_plans), Number(r.custom_plans)])).toEqual([['jobGetDetail', 5, 5]]);
      // Each generic plan finds the job's rows by an index: no table read whole but the
      // partitions of the days ahead, empty.
      const empty = new Set(
        (await c.query<{ name: string }>(`SELECT relname AS name FROM pg_class WHERE relname ~ '^jobs_done_[0-9]{8}$' AND reltuples <= 0`)).rows.map((r) => r.name),
      );
      await c.query('SET plan_cache_mode = force_generic_plan');
      for (const r of rows) {
        await c.query(`PREPARE p AS ${r.statement}`);
        const plan = nodes(((await c.query(`EXPLAIN (FORMAT JSON) EXECUTE p('${jobId}')`)).rows[0]['QUERY PLAN'] as Array<{ Plan: PlanNode }>)[0]!.Plan);
        await c.query('DEALLOCATE p');
        expect(plan.filter((n) => n['Node Type'] === 'Seq Scan' && !empty.has(n['Relation Name'] ?? '')).map((n) => n['Relation Name']), r.name).toEqual([]);
        const byIndex = new Set(plan.filter((n) => n['Index Name'] || n['Node Type'] === 'Bitmap Heap Scan').map((n) => n['Relation Name']));
        for (const table of ['jobs_live', 'attempts', 'job_events', 'steps', 'stale_reports']) expect(byIndex.has(table), table).toBe(true);
      }
    } finally {
      await c.end();
    }
  });

  it("GetStats reads its window's minutes through ended_counts_minute_idx, not the whole day kept, in a custom plan and in a generic one", async () => {
    // A busy day: every minute and kind kept.
    await db.truncate();
    await db.pool.query(
      `INSERT INTO ended_counts (minute, kind, n)
       SELECT date_trunc('minute', now()) - m * interval '1 minute', k, 1
       FROM generate_series(0, 1439) m, unnest('{completed,failed,retry_scheduled,dead,canceled,lease_expired}'::text[]) k`,
    );
    await db.pool.query('ANALYZE ended_counts');
    const c = await db.pool.connect();
    try {
      for (const mode of ['force_custom_plan', 'force_generic_plan']) {
        await c.query(`SET plan_cache_mode = ${mode}`);
        await c.query(`PREPARE m(int) AS ${statsMinutesSql.text}`);
        const { rows } = await c.query('EXPLAIN (FORMAT JSON) EXECUTE m(15)');
        await c.query('DEALLOCATE m');
        const plan = nodes((rows[0]['QUERY PLAN'] as Array<{ Plan: PlanNode }>)[0]!.Plan);
        const onCounts = plan.filter((n) => n['Relation Name'] === 'ended_counts');
        expect(onCounts.map((n) => n['Node Type']), mode).not.toContain('Seq Scan');
        expect(plan.map((n) => n['Index Name']), mode).toContain('ended_counts_minute_idx');
      }
    } finally {
      await c.query('RESET plan_cache_mode');
      c.release();
    }
    // And it counts the window: 15 minutes, each with one of every kind but the two not kept.
    const stats = await statsGet(db.pool, { windowMinutes: 15 });
    expect(stats.outcome).toBe('ok');
    if (stats.outcome === 'ok') expect(stats.value.minutes.map((m) => [m.succeeded, m.dead, m.timedOut])).toEqual(Array(15).fill([1, 1, 0]));
  });

  it('the BRIN indexes summarize page ranges as they fill (autosummarize)', async () => {
    const { rows } = await db.pool.query(
      `SELECT relname, reloptions FROM pg_class WHERE relname IN ('attempts_ended_brin', 'job_events_at_brin') ORDER BY relname`,
    );
    expect(rows).toEqual([
      { relname: 'attempts_ended_brin', reloptions: ['autosummarize=on'] },
      { relname: 'job_events_at_brin', reloptions: ['autosummarize=on'] },
    ]);
  });
});
