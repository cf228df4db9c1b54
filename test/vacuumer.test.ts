/**
 * The vacuumer (server/core/vacuumer.ts): once enough dead rows have piled up in `jobs_live` it
 * VACUUMs it, and a claim after that reads a fraction of the index pages it read before (the
 * entries of the jobs drained since are gone). Rows an open snapshot still sees cannot be removed;
 * the vacuumer counts changes, not dead rows, so the next look does not VACUUM again for them.
 */
import pg from 'pg';
import pino from 'pino';
import { beforeAll, expect, it } from 'vitest';
import { Vacuumer } from '../server/core/vacuumer.js';
import { attemptCompleteMany, attemptStartMany, claimSql, jobClaimSlots, liveChurn } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();
const log = pino({ level: 'silent' });

beforeAll(async () => {
  // Autovacuum would clean up on its own schedule, in the middle of what is measured; and an
  // ANALYZE of any table the drains write (attempts, the day partitions, the counts) holds a
  // snapshot, which keeps the last rows drained from the vacuumer's VACUUM. Every table, then
  // (a partitioned parent takes no storage option; its partitions are tables).
  await t.pool.query(`DO $$ DECLARE r regclass; BEGIN
    FOR r IN SELECT c.oid FROM pg_class c WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r' LOOP
      EXECUTE format('ALTER TABLE %s SET (autovacuum_enabled = false)', r);
    END LOOP; END $$`);
});

/** Claims, starts and completes `n` jobs of queue `v` on `db`, then flushes the statistics it wrote. */
async function drain(db: pg.PoolClient, n: number): Promise<void> {
  for (let done = 0; done < n; ) {
    const claimed = await jobClaimSlots(db, { slots: Array<string>(Math.min(64, n - done)).fill('agent-v'), queues: ['v'], claimTtlMs: 30_000 });
    if (claimed.outcome !== 'ok' || !claimed.value.length) throw new Error(`claim: ${JSON.stringify(claimed)}`);
    const refs = claimed.value.map((c) => ({ attemptId: c.attemptId, agentId: c.agentId }));
    const started = await attemptStartMany(db, { items: refs, leaseTtlMs: 30_000 });
    const completed = await attemptCompleteMany(db, { items: refs.map((r) => ({ ...r, result: { ok: true } })) });
    const bad = [...started, ...completed].find((o) => o.outcome !== 'ok');
    if (bad) throw new Error(`start or complete: ${JSON.stringify(bad)}`);
    done += claimed.value.length;
  }
  // A backend sends its statistics at most once a second; this one's, before its next idle.
  await db.query('SELECT pg_stat_force_next_flush()');
}

interface PlanNode {
  'Index Name'?: string;
  'Shared Hit Blocks': number;
  'Shared Read Blocks': number;
  Plans?: PlanNode[];
}

/** Buffers a claim of 64 jobs reads in its scan of `jobs_claim_idx` (EXPLAIN ANALYZE, rolled back). */
async function claimScanBuffers(db: pg.PoolClient): Promise<number> {
  await db.query('BEGIN');
  try {
    const { rows } = await db.query(`EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ${claimSql.text}`, [['v'], 64, Buffer.alloc(32, 1), ['agent-v'], 30_000, null, '{}', Array(64).fill(1)]);
    const find = (n: PlanNode): PlanNode | undefined => (n['Index Name'] === 'jobs_claim_idx' ? n : n.Plans?.map(find).find(Boolean));
    const scan = find((rows[0]['QUERY PLAN'] as Array<{ Plan: PlanNode }>)[0]!.Plan);
    if (!scan) throw new Error('the claim did not scan jobs_claim_idx');
    return scan['Shared Hit Blocks'] + scan['Shared Read Blocks'];
  } finally {
    await db.query('ROLLBACK');
    // The rolled-back claim's updates count as dead rows too: sent now, not a second later, so
    // that whoever reads the statistics next reads them.
    await db.query('SELECT pg_stat_force_next_flush()');
  }
}

it('VACUUMs jobs_live past the threshold, and the claim reads a fraction of what it read before', async () => {
  await t.pool.query(`INSERT INTO jobs (queue, payload) SELECT 'v', '{}'::jsonb FROM generate_series(1, 9000)`);
  const db = await t.pool.connect();
  try {
    await drain(db, 8000);
    const before = await claimScanBuffers(db);
    // Read after the scan above, whose statistics are sent: the vacuumer's first look reads the same.
    const { dead } = await liveChurn(t.pool);
    expect(dead, 'a drained job leaves dead rows (the claim, the completion)').toBeGreaterThanOrEqual(8000);

    const vacuumer = new Vacuumer(t.pool, log, { deadRows: 5000 });
    const runs: unknown[] = [];
    vacuumer.on('vacuumer:run', (r) => runs.push(r));
    const first = await vacuumer.runOnce();
    expect(first).toMatchObject({ changed: dead, vacuumed: true });
    expect(first.dead).toBeLessThan(100);
    expect(runs).toEqual([first]);
    const after = await claimScanBuffers(db);
    expect(after, `claim buffers before ${before}, after ${after}`).toBeLessThan(before / 2);

    await drain(db, 100);
    expect(await vacuumer.runOnce(), 'under the threshold again').toMatchObject({ vacuumed: false });
  } finally {
    db.release();
  }
});

it('counts what an open snapshot keeps as the baseline: no second VACUUM for rows it could not remove', async () => {
  await t.pool.query(`INSERT INTO jobs (queue, payload) SELECT 'v', '{}'::jsonb FROM generate_series(1, 4000)`);
  const vacuumer = new Vacuumer(t.pool, log, { deadRows: 2000 });
  expect(await vacuumer.runOnce(), 'what the first test left is under the threshold').toMatchObject({ vacuumed: false });
  const reader = await t.pool.connect();
  const db = await t.pool.connect();
  try {
    // A report or a backup: a snapshot older than what is drained next.
    await reader.query('BEGIN ISOLATION LEVEL REPEATABLE READ');
    await reader.query('SELECT count(*) FROM jobs_live');
    await drain(db, 3000);
    const held = await vacuumer.runOnce();
    expect(held).toMatchObject({ vacuumed: true });
    expect(held.dead, 'the rows the snapshot still sees stay').toBeGreaterThanOrEqual(3000);
    await drain(db, 10);
    expect(await vacuumer.runOnce(), 'no VACUUM for the same rows again').toMatchObject({ vacuumed: false });

    await reader.query('COMMIT');
    await drain(db, 1500); // about two changed rows a job (the claim, the completion's delete): past the threshold
    const freed = await vacuumer.runOnce();
    expect(freed).toMatchObject({ vacuumed: true });
    expect(freed.dead).toBeLessThan(100);
  } finally {
    await reader.query('ROLLBACK').catch(() => undefined);
    reader.release();
    db.release();
  }
});
