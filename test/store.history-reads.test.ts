/**
 * Operator reads as history grows (L15): what they read must not grow with the finished jobs
 * kept. The waits of GetStats and `/metrics` read the queued jobs through jobs_claim_idx, not
 * every job; the BRIN indexes of GetStats' per-minute counts summarize new pages as they fill.
 */
import { describe, expect, it } from 'vitest';
import { jobDepths } from '../server/store/index.js';
import { waitSql } from '../server/store/admin.js';
import { useTestDb } from './helpers/db.js';
import { makeQueuedJobs } from './helpers/factories.js';
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
