/**
 * The purge's plan: a batch must not cost more as the history grows. Its check for notifications still to be
 * delivered once read the whole of `webhook_deliveries` per batch (`status IN ('pending',
 * 'sending')` matches neither partial index), a cost that grew with the history: purging a day
 * of ten million jobs ran that scan 1,684 times.
 */
import { expect, it } from 'vitest';
import { DEFAULT_SEED, seedHistory } from '../server/seed-history.js';
import { purgeSql } from '../server/store/admin.js';
import { useTestDb } from './helpers/db.js';
import { planNodes, type PlanNode } from './helpers/plan.js';

const t = useTestDb();

it('a purge batch reads the open deliveries from their partial indexes, not every delivery', async () => {
  await seedHistory(t.pool, { ...DEFAULT_SEED, jobs: 20_000, notifyShare: 0.5 });
  await t.pool.query('ANALYZE');
  const delivered = (await t.pool.query(`SELECT count(*)::int AS n FROM webhook_deliveries WHERE status = 'delivered'`)).rows[0].n as number;
  expect(delivered).toBeGreaterThan(5000);
  for (const mode of ['force_custom_plan', 'force_generic_plan']) {
    const c = await t.pool.connect();
    try {
      await c.query('BEGIN');
      await c.query(`SET LOCAL plan_cache_mode = ${mode}`);
      await c.query(`PREPARE purge(float8, job_status[], text, timestamptz, int4) AS ${purgeSql.text}`);
      const { rows } = await c.query(`EXPLAIN (FORMAT JSON) EXECUTE purge(86400000, '{succeeded,failed,dead,canceled}', NULL, NULL, 1000)`);
      const plan = planNodes((rows[0]['QUERY PLAN'] as Array<{ Plan: PlanNode }>)[0]!.Plan);
      const deliveries = plan.filter((n) => n['Relation Name'] === 'webhook_deliveries' || /^webhook_deliveries_/.test(n['Index Name'] ?? ''));
      expect(deliveries.map((n) => n['Node Type']), mode).not.toContain('Seq Scan');
      expect(new Set(deliveries.map((n) => n['Index Name']).filter(Boolean)), mode).toEqual(
        new Set(['webhook_deliveries_due_idx', 'webhook_deliveries_sending_idx']),
      );
    } finally {
      await c.query('ROLLBACK');
      await c.query('DEALLOCATE ALL');
      c.release();
    }
  }
});
