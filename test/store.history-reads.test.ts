/**
 * Operator reads as history grows (L15): what they read must not grow with the finished jobs
 * kept. The waits of GetStats and `/metrics` read the queued jobs through jobs_claim_idx, not
 * every job; the BRIN indexes of GetStats' per-minute counts summarize new pages as they fill.
 */
import { describe, expect, it } from 'vitest';
import { jobDepths, jobList, jobSearch } from '../server/store/index.js';
import { listSql } from '../server/store/jobs.js';
import { searchSql, waitSql } from '../server/store/admin.js';
import { useTestDb } from './helpers/db.js';
import { makeJob, makeQueuedJobs } from './helpers/factories.js';
import { planNodes as nodes, type PlanNode } from './helpers/plan.js';

const db = useTestDb();


describe('operator reads with history', () => {
  it('the waits read the queued jobs from jobs_claim_idx, whatever the finished jobs kept', async () => {
    await db.pool.query(
      `INSERT INTO jobs (queue, payload, status, result, finished_at)
       SELECT 'hist-' || (i % 3), '{}', 'succeeded', '{}', now() - i * interval '1 second' FROM generate_series(1, 20000) i`,
    );
    await makeQueuedJobs(db.pool, 40, 'hist-live');
    await db.pool.query(`UPDATE jobs SET run_at = now() + interval '1 hour' WHERE id IN (SELECT id FROM jobs WHERE queue = 'hist-live' LIMIT 10)`);
    await db.pool.query('ANALYZE jobs');
    const { rows } = await db.pool.query(`EXPLAIN (FORMAT JSON) ${waitSql.text}`);
    const plan = nodes((rows[0]['QUERY PLAN'] as Array<{ Plan: PlanNode }>)[0]!.Plan);
    const onJobs = plan.filter((n) => n['Relation Name'] === 'jobs');
    expect(onJobs.map((n) => n['Node Type'])).not.toContain('Seq Scan');
    // An index scan of it, or a bitmap heap scan over a bitmap index scan of it.
    expect(plan.map((n) => n['Index Name'])).toContain('jobs_claim_idx');
    // And it answers as before: 30 due of 40 queued, none of the 20,000 finished.
    const { waiting, depths } = await jobDepths(db.pool);
    expect(waiting.filter((w) => w.queue.startsWith('hist'))).toEqual([expect.objectContaining({ queue: 'hist-live', due: 30 })]);
    expect(depths.filter((d) => d.queue.startsWith('hist')).reduce((a, d) => a + Number(d.count), 0)).toBe(20040);
  });

  it('ListJobs of queued or of running jobs reads the partial index that holds them, not the finished jobs', async () => {
    await db.pool.query(
      `INSERT INTO jobs (queue, payload, status, result, finished_at)
       SELECT 'live-' || (i % 3), '{}', 'succeeded', '{}', now() - i * interval '1 second' FROM generate_series(1, 20000) i`,
    );
    const queued = await makeQueuedJobs(db.pool, 5, 'live-q');
    const running = await Promise.all([1, 2, 3].map(() => makeJob(db.pool, { queue: 'live-r', status: 'running' })));
    const claimed = await makeJob(db.pool, { queue: 'live-r', status: 'claimed' });
    await db.pool.query('ANALYZE jobs');
    // The plan PostgreSQL makes for the call's values (a custom plan, as the main pool uses).
    const plan = async (statuses: string[]) => {
      const c = await db.pool.connect();
      try {
        await c.query(`PREPARE s AS ${searchSql.text}`);
        const literals = `ARRAY[${statuses.map((x) => `'${x}'`).join(', ')}]::job_status[], 'live-r', NULL, NULL, NULL, NULL, NULL, 51`;
        const { rows } = await c.query(`EXPLAIN (FORMAT JSON) EXECUTE s(${literals})`);
        await c.query('DEALLOCATE s');
        return nodes((rows[0]['QUERY PLAN'] as Array<{ Plan: PlanNode }>)[0]!.Plan);
      } finally {
        c.release();
      }
    };
    for (const [statuses, index] of [
      [['running'], 'jobs_current_attempt_uq'],
      [['claimed', 'running'], 'jobs_current_attempt_uq'],
      [['queued'], 'jobs_claim_idx'],
    ] as const) {
      const p = await plan([...statuses]);
      expect(p.map((n) => n['Node Type']), statuses.join()).not.toContain('Seq Scan');
      expect(p.map((n) => n['Index Name']), statuses.join()).toContain(index);
    }
    // JobService's ListJobs (one status) likewise.
    for (const [status, index] of [
      ['running', 'jobs_current_attempt_uq'],
      ['queued', 'jobs_claim_idx'],
    ] as const) {
      const c = await db.pool.connect();
      try {
        await c.query(`PREPARE l AS ${listSql.text}`);
        const { rows } = await c.query(`EXPLAIN (FORMAT JSON) EXECUTE l(NULL, '${status}', NULL, NULL, 51)`);
        await c.query('DEALLOCATE l');
        const p = nodes((rows[0]['QUERY PLAN'] as Array<{ Plan: PlanNode }>)[0]!.Plan);
        expect(p.map((n) => n['Node Type']), status).not.toContain('Seq Scan');
        expect(p.map((n) => n['Index Name']), status).toContain(index);
      } finally {
        c.release();
      }
    }
    const listed = await jobList(db.pool, { status: 'running' });
    if (listed.outcome !== 'ok') throw new Error(JSON.stringify(listed));
    expect(listed.value.jobs.filter((j) => j.queue.startsWith('live-')).map((j) => j.id).sort()).toEqual(running.map((j) => j.id).sort());
    // And the answers: exactly the live jobs asked for, newest first as always.
    const ids = async (statuses: Array<'queued' | 'claimed' | 'running' | 'succeeded'>) => {
      const o = await jobSearch(db.pool, { statuses });
      if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
      return o.value.jobs.filter((j) => j.queue.startsWith('live-')).map((j) => j.id).sort();
    };
    expect(await ids(['running'])).toEqual(running.map((j) => j.id).sort());
    expect(await ids(['claimed', 'running'])).toEqual([...running, claimed].map((j) => j.id).sort());
    expect(await ids(['queued'])).toEqual([...queued].sort());
    // A filter that mixes live and finished statuses is answered as before.
    expect((await ids(['running', 'succeeded'])).length).toBe(50);
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
