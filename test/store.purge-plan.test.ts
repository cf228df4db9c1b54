/**
 * The purge's plan: a batch must not cost more as the history grows. Its check for notifications still to be
 * delivered once read the whole of `webhook_deliveries` per batch (`status IN ('pending',
 * 'sending')` matches neither partial index), a cost that grew with the history: purging a day
 * of ten million jobs ran that scan 1,684 times. And a run's batches go on from one another
 * rather than each walking the entries of the jobs the run already deleted.
 */
import pino from 'pino';
import { expect, it } from 'vitest';
import { Purger } from '../server/core/purger.js';
import { DEFAULT_SEED, seedHistory } from '../server/seed-history.js';
import { jobPurge, purgeSql } from '../server/store/purge.js';
import { JOB_REFERENCES } from '../server/store/schema.js';
import { useTestDb } from './helpers/db.js';
import { planNodes, type PlanNode } from './helpers/plan.js';

const t = useTestDb();

it('a purge batch reads the open deliveries from their partial indexes, not every delivery', async () => {
  await seedHistory(t.pool, { ...DEFAULT_SEED, jobs: 20_000, notifyShare: 0.5 });
  // The history writes few events and no stale reports or notify headers: a few thousand of
  // each, so that no table is small enough to excuse a scan of it.
  await t.pool.query(
    `WITH j AS (SELECT id FROM jobs ORDER BY id LIMIT 5000),
          r AS (INSERT INTO stale_reports (job_id, attempt_id, call, current_attempt_no, current_status, at)
                SELECT id, gen_random_uuid(), 'complete', 1, 'succeeded', now() FROM j),
          e AS (INSERT INTO job_events (job_id, kind, at, data) SELECT id, 'requeued', now(), '{}' FROM j)
     INSERT INTO notify_headers (job_id, name, value) SELECT id, 'X-Token', 'secret' FROM j`,
  );
  await t.pool.query('ANALYZE');
  const delivered = (await t.pool.query(`SELECT count(*)::int AS n FROM webhook_deliveries WHERE status = 'delivered'`)).rows[0].n as number;
  expect(delivered).toBeGreaterThan(5000);
  for (const mode of ['force_custom_plan', 'force_generic_plan']) {
    const c = await t.pool.connect();
    try {
      await c.query('BEGIN');
      await c.query(`SET LOCAL plan_cache_mode = ${mode}`);
      await c.query(`PREPARE purge(float8, job_status[], text, timestamptz, int4, timestamptz) AS ${purgeSql.text}`);
      const { rows } = await c.query(`EXPLAIN (FORMAT JSON) EXECUTE purge(86400000, '{succeeded,failed,dead,canceled}', NULL, NULL, 1000, NULL)`);
      const plan = planNodes((rows[0]['QUERY PLAN'] as Array<{ Plan: PlanNode }>)[0]!.Plan);
      const deliveries = plan.filter((n) => n['Relation Name'] === 'webhook_deliveries' || /^webhook_deliveries_/.test(n['Index Name'] ?? ''));
      expect(deliveries.map((n) => n['Node Type']), mode).not.toContain('Seq Scan');
      expect(new Set(deliveries.map((n) => n['Index Name']).filter(Boolean)), mode).toEqual(
        new Set(['webhook_deliveries_due_idx', 'webhook_deliveries_sending_idx']),
      );
      // What belongs to the batch's jobs is deleted through each table's job_id index: joined
      // with the batch, steps were read whole (a hash join) once the table had 60,000 rows.
      const owned = plan.filter((n) => (['attempts', ...JOB_REFERENCES] as string[]).includes(n['Relation Name'] ?? ''));
      expect(owned.filter((n) => n['Node Type'] === 'Seq Scan').map((n) => n['Relation Name']), mode).toEqual([]);
      expect(new Set(owned.filter((n) => n['Node Type'] === 'ModifyTable').map((n) => n['Relation Name'])), mode).toEqual(new Set(['attempts', ...JOB_REFERENCES]));
    } finally {
      await c.query('ROLLBACK');
      await c.query('DEALLOCATE ALL');
      c.release();
    }
  }
});

it("a run's batches go on from the finish time the last one reached, and still take every job", async () => {
  await t.truncate();
  await t.pool.query(
    `INSERT INTO jobs (queue, payload, status, result, finished_at)
     SELECT 'after', '{}', 'succeeded', '{}', now() - interval '2 days' + g * interval '1 second' FROM generate_series(1, 250) g`,
  );
  const seen: Date[] = [];
  let after: Date | undefined;
  let purged = 0;
  for (;;) {
    const o = await jobPurge(t.pool, { olderThanMs: 86_400_000, limit: 100, ...(after ? { after } : {}) });
    if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
    purged += o.value.purged;
    if (o.value.last) seen.push(o.value.last);
    after = o.value.last;
    if (o.value.purged < 100) break;
  }
  expect(purged).toBe(250);
  expect(seen).toHaveLength(3);
  expect([...seen].sort((a, b) => a.getTime() - b.getTime())).toEqual(seen);
  // Past every job left, a batch finds nothing.
  await t.pool.query(`INSERT INTO jobs (queue, payload, status, result, finished_at) VALUES ('after', '{}', 'succeeded', '{}', now() - interval '3 days')`);
  const none = await jobPurge(t.pool, { olderThanMs: 86_400_000, limit: 100, after: seen[2]! });
  expect(none.outcome === 'ok' && none.value.purged).toBe(0);
  const all = await jobPurge(t.pool, { olderThanMs: 86_400_000, limit: 100 });
  expect(all.outcome === 'ok' && all.value.purged).toBe(1);
});

it('the purger takes every job past the retention in batches that go on from one another', async () => {
  await t.truncate();
  await t.pool.query(
    `INSERT INTO jobs (queue, payload, status, result, finished_at)
     SELECT 'purger', '{}', 'succeeded', '{}', now() - interval '2 days' + g * interval '1 second' FROM generate_series(1, 250) g`,
  );
  await t.pool.query(
    `INSERT INTO jobs (queue, payload, status, result, finished_at) VALUES ('purger', '{}', 'succeeded', '{}', now() - interval '1 hour')`,
  );
  const purger = new Purger(t.pool, pino({ level: 'silent' }), { retentionMs: 86_400_000, batchSize: 100 });
  expect(await purger.runOnce()).toMatchObject({ purged: 250, batches: 3 });
  expect((await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE queue = 'purger'`)).rows[0].n).toBe(1);
});
