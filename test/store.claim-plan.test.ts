/**
 * The claim statement's plan: it must walk jobs_claim_idx in order and stop at the LIMIT, not
 * sort every queued job. A prepared statement is planned generically (parameters unknown), so
 * the plan is taken that way; a seq scan here once cost 30–60 ms per claim at 20k queued jobs.
 */
import { describe, expect, it } from 'vitest';
import type { Outcome } from '../server/domain/outcomes.js';
import { claimSql, jobClaim, jobClaimSlots } from '../server/store/claim.js';
import { createPool } from '../server/store/database.js';
import { attemptCompleteMany, attemptFail, attemptHeartbeat, attemptStartMany, heardCompletions, jobRescueExpired } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { makeJob, makeQueuedJobs } from './helpers/factories.js';
import { planNodes as nodes, type PlanNode } from './helpers/plan.js';

const db = useTestDb();


function value<T>(o: Outcome<T>): T {
  if (o.outcome !== 'ok') throw new Error(`expected a value, got ${JSON.stringify(o)}`);
  return o.value;
}


describe('claim plan', () => {
  it('reads jobs only through indexes: queued ones in jobs_claim_idx order, claimed ones by id', async () => {
    await makeQueuedJobs(db.pool, 5000, 'plan-a');
    await makeQueuedJobs(db.pool, 5000, 'plan-b');
    await db.pool.query('ANALYZE jobs');
    const c = await db.pool.connect();
    try {
      await c.query('SET plan_cache_mode = force_generic_plan');
      await c.query(`PREPARE claim_plan AS ${claimSql.text}`);
      const { rows } = await c.query(
        `EXPLAIN (FORMAT JSON) EXECUTE claim_plan('{plan-a,plan-b}', 256, NULL, NULL, 30000, NULL, '{}', NULL)`,
      );
      // jobs_live: the partition of jobs that holds the live jobs, which the claim names.
      const onJobs = nodes(rows[0]['QUERY PLAN'][0].Plan as PlanNode).filter((n) => n['Relation Name'] === 'jobs_live');
      const reads = onJobs.filter((n) => n['Node Type'] !== 'ModifyTable');
      expect(reads.map((n) => n['Node Type'])).not.toContain('Seq Scan');
      expect(reads.some((n) => n['Node Type'] === 'Index Scan' && n['Index Name'] === 'jobs_claim_idx')).toBe(true);
    } finally {
      await c.query('DEALLOCATE ALL');
      await c.query('RESET plan_cache_mode');
      c.release();
    }
  });

  it('across queues, claims in priority, then run_at order overall; labelled jobs only for carriers', async () => {
    await db.truncate();
    const t = Date.now() - 60_000;
    const low = await makeJob(db.pool, { queue: 'q1', priority: 0, runAt: new Date(t) });
    const high = await makeJob(db.pool, { queue: 'q2', priority: 5, runAt: new Date(t + 1000) });
    const mid = await makeJob(db.pool, { queue: 'q1', priority: 1, runAt: new Date(t + 2000) });
    const older = await makeJob(db.pool, { queue: 'q2', priority: 1, runAt: new Date(t + 500) });
    await db.pool.query(`UPDATE jobs SET labels = '{"gpu": "yes"}' WHERE id = $1`, [low.id]);

    const plain = await jobClaim(db.pool, { agentId: 'plan-1', queues: ['q1', 'q2'], limit: 10, claimTtlMs: 30_000 });
    expect(value(plain).map((x) => x.job.id)).toEqual([high.id, older.id, mid.id]);
    expect(value(plain).map((x) => x.slot)).toEqual([0, 1, 2]);

    const gpu = await jobClaim(db.pool, {
      agentId: 'plan-2', queues: ['q2', 'q1'], limit: 10, claimTtlMs: 30_000, labels: { gpu: 'yes', os: 'windows' },
    });
    expect(value(gpu).map((x) => x.job.id)).toEqual([low.id]);
  });

  it('fills interleaved slots of several agents: each job goes to its slot\'s agent, with a fresh attempt id', async () => {
    await makeQueuedJobs(db.pool, 5, 'slots');
    const slots = ['slot-a', 'slot-b', 'slot-a', 'slot-c', 'slot-b', 'slot-a', 'slot-c'];
    const claimed = value(await jobClaimSlots(db.pool, { slots, queues: ['slots'], claimTtlMs: 30_000 }));
    expect(claimed.map((c) => c.slot)).toEqual([0, 1, 2, 3, 4]);
    expect(claimed.map((c) => c.agentId)).toEqual(slots.slice(0, 5));
    const { rows } = await db.pool.query(`SELECT current_attempt_id::text AS id, agent_id FROM jobs WHERE agent_id LIKE 'slot-%'`);
    expect(new Map(rows.map((r) => [r.id, r.agent_id]))).toEqual(new Map(claimed.map((c) => [c.attemptId, c.agentId])));
    const ids = claimed.map((c) => c.attemptId);
    expect(new Set(ids).size).toBe(5);
    // Fresh per statement: the same slot positions in the next claim get other ids.
    await makeQueuedJobs(db.pool, 5, 'slots');
    const again = value(await jobClaimSlots(db.pool, { slots, queues: ['slots'], claimTtlMs: 30_000 }));
    expect(again.map((c) => c.attemptId).filter((id) => ids.includes(id))).toEqual([]);
  });

  it('on the hot pool, plans every transition through its indexes, a few rows at a time, even when the statistics say the table is empty', async () => {
    // A queue table analyzed while empty (a new install, a quiet night), then a burst: the
    // generic plans the hot connections cache must not scan and sort the whole table.
    await db.truncate();
    await db.pool.query('ANALYZE jobs, attempts');
    await makeQueuedJobs(db.pool, 5000, 'burst');
    const hot = createPool(db.url, 1, undefined, { hot: true });
    const c = await hot.connect();
    try {
      const claimed = value(await jobClaimSlots(c, { slots: ['h', 'h', 'h', 'h'], queues: ['burst'], claimTtlMs: 30_000 }));
      const items = claimed.map((x) => ({ attemptId: x.attemptId, agentId: 'h' }));
      value(await attemptStartMany(c, { items, leaseTtlMs: 30_000 }).then((o) => o[0]!));
      value(await attemptHeartbeat(c, { items, leaseTtlMs: 30_000 }));
      // Both forms of the completion: without the outbox (no one listens), then with it.
      heardCompletions.until = 0;
      value(await attemptCompleteMany(c, { items: items.slice(0, 2).map((i) => ({ ...i, result: {} })) }).then((o) => o[0]!));
      heardCompletions.until = Date.now() + 60_000;
      value(await attemptCompleteMany(c, { items: [{ ...items[3]!, result: {} }] }).then((o) => o[0]!));
      heardCompletions.until = 0;
      value(await attemptFail(c, { ...items[2]!, error: { message: 'x' }, retryable: true }));
      value(await jobRescueExpired(c, { limit: 10 }));
      const prepared = (await c.query(`SELECT name, cardinality(parameter_types) AS n FROM pg_prepared_statements`)).rows as Array<{ name: string; n: number }>;
      const hotNames = ['jobClaim', 'attemptStartMany', 'attemptHeartbeat', 'attemptCompleteMany', 'attemptCompleteManyUnheard', 'attemptFail', 'jobRescueExpired'];
      expect(prepared.map((p) => p.name)).toEqual(expect.arrayContaining(hotNames));
      for (const p of prepared.filter((x) => hotNames.includes(x.name))) {
        // The plan the connection uses (generic: it does not depend on these NULLs).
        const { rows } = await c.query(`EXPLAIN (FORMAT JSON) EXECUTE "${p.name}"(${Array(p.n).fill('NULL').join(', ')})`);
        const all = nodes(rows[0]['QUERY PLAN'][0].Plan as PlanNode);
        const reads = all.filter((n) => /^(jobs|jobs_live|jobs_done_\d{8}|attempts)$/.test(n['Relation Name'] ?? '') && n['Node Type'] !== 'ModifyTable');
        expect(reads.map((n) => `${p.name}: ${n['Node Type']} on ${n['Relation Name']}`)).not.toContainEqual(expect.stringContaining('Seq Scan'));
        // A hash or merge join reads all of one side: on "empty" statistics, all of jobs.
        expect(all.map((n) => `${p.name}: ${n['Node Type']}`)).not.toContainEqual(expect.stringMatching(/Hash Join|Merge Join/));
        if (p.name === 'jobClaim') expect(reads.some((n) => n['Index Name'] === 'jobs_claim_idx')).toBe(true);
      }
    } finally {
      c.release();
      await hot.end();
    }
  });

  it('explains the heartbeats of ended attempts through attempts_pkey and jobs_final_attempt_uq, not by reading every succeeded job', async () => {
    // The lookup joins many attempt ids to attempt_log. Joined plainly, PostgreSQL does not push
    // the id into the view's second half (the succeeded jobs' rows), and read all of them on
    // every call: seconds per heartbeat tick at ten million jobs.
    await db.truncate();
    await makeQueuedJobs(db.pool, 3000, 'ended');
    const ended: Array<{ attemptId: string; agentId: string }> = [];
    for (;;) {
      const batch = value(await jobClaimSlots(db.pool, { slots: Array(500).fill('e'), queues: ['ended'], claimTtlMs: 30_000 }));
      if (!batch.length) break;
      const items = batch.map((x) => ({ attemptId: x.attemptId, agentId: 'e' }));
      value(await attemptFail(db.pool, { ...items[0]!, error: { message: 'x' }, retryable: false }));
      await attemptCompleteMany(db.pool, { items: items.slice(1).map((i) => ({ ...i, result: {} })) });
      ended.push(...items);
    }
    // Jobs held now too, so that the live partition's index of current attempts holds rows.
    await makeQueuedJobs(db.pool, 200, 'held');
    const held = value(await jobClaimSlots(db.pool, { slots: Array(100).fill('e'), queues: ['held'], claimTtlMs: 30_000 }));
    await db.pool.query('ANALYZE jobs, attempts');
    // The relations and indexes that hold rows: an empty partition (a day ahead) or an empty index
    // may be read any way, it costs nothing.
    const holding = new Set(
      (
        await db.pool.query<{ relname: string }>(
          `SELECT c.relname FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace AND c.reltuples > 0 AND c.relkind IN ('r', 'i')`,
        )
      ).rows.map((r) => r.relname),
    );
    const hot = createPool(db.url, 1, undefined, { hot: true });
    const c = await hot.connect();
    try {
      await c.query('SET plan_cache_mode = force_generic_plan');
      const some = [ended[0]!, ended[1]!, ended[700]!];
      // A held attempt's heartbeat from another agent: not renewed, so looked up too.
      const other = { attemptId: held[0]!.attemptId, agentId: 'f' };
      const beat = value(await attemptHeartbeat(c, { items: [...some, other], leaseTtlMs: 30_000 }));
      expect(beat.lost.map((x) => x.attemptId).sort()).toEqual([...some, other].map((x) => x.attemptId).sort());
      const { rows } = await c.query(`EXPLAIN (FORMAT JSON) EXECUTE "attemptHeartbeatLookup"(NULL, NULL, NULL)`);
      const reads = nodes(rows[0]['QUERY PLAN'][0].Plan as PlanNode).filter(
        (n) => /^(jobs|jobs_live|jobs_done_\d{8}|attempts)$/.test(n['Relation Name'] ?? '') && holding.has(n['Relation Name']!) && (!n['Index Name'] || holding.has(n['Index Name'])),
      );
      // Every read of jobs and attempts that hold rows finds its rows by a condition on an index.
      expect(reads.filter((n) => !n['Index Cond'] && !n['Recheck Cond']).map((n) => `${n['Node Type']} on ${n['Index Name'] ?? n['Relation Name']} without a condition`)).toEqual([]);
      const indexes = reads.map((n) => (n['Index Name'] ?? '').replace(/^jobs_done_\d{8}_/, 'jobs_done_'));
      expect(indexes).toEqual(expect.arrayContaining(['attempts_pkey', 'jobs_done_final_attempt_uq', 'jobs_current_attempt_uq']));
    } finally {
      c.release();
      await hot.end();
    }
  });

  it('refuses a bad agent id among the slots, and a batch over the limit, before touching the database', async () => {
    expect((await jobClaimSlots(db.pool, { slots: ['ok', ''], queues: ['slots'], claimTtlMs: 30_000 })).outcome).toBe('invalid');
    expect((await jobClaimSlots(db.pool, { slots: Array(100_000).fill('ok'), queues: ['slots'], claimTtlMs: 30_000 })).outcome).toBe('invalid');
  });
});
