/**
 * A heartbeat is one statement for every lease a coordinator holds: one job's row held locked by
 * another transaction (an operator's `SELECT … FOR UPDATE`, a transaction left open) must not
 * hold the renewal of the others. The locked one is answered `pending` (current and running, its
 * lease left as it was) and renewed once the lock is gone.
 */
import { expect, it } from 'vitest';
import { attemptHeartbeat } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { makeJob } from './helpers/factories.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();

it('renews every lease but that of a row another transaction holds locked, which it neither waits for nor loses', async () => {
  const soon = new Date(Date.now() + 5_000);
  const locked = await makeJob(t.pool, { queue: 'hb-lock', status: 'running', agentId: 'agent-l', leaseExpiresAt: soon });
  const free = await makeJob(t.pool, { queue: 'hb-lock', status: 'running', agentId: 'agent-l', leaseExpiresAt: soon });
  const items = [locked, free].map((j) => ({ attemptId: j.currentAttemptId!, agentId: 'agent-l' }));

  const holder = await t.pool.connect();
  try {
    await holder.query('BEGIN');
    await holder.query('SELECT id FROM jobs_live WHERE id = $1 FOR UPDATE', [locked.id]);
    const t0 = performance.now();
    const o = await attemptHeartbeat(t.pool, { items, leaseTtlMs: 30_000 });
    // Before, the statement waited for the lock: as long as the holder kept it.
    expect(performance.now() - t0).toBeLessThan(2_000);
    if (o.outcome !== 'ok') throw new Error(o.outcome);
    expect(o.value.renewed.map((r) => r.attemptId)).toEqual([free.currentAttemptId]);
    expect(o.value.renewed[0]!.leaseExpiresAt.getTime()).toBeGreaterThan(Date.now() + 20_000);
    expect(o.value.pending).toEqual([locked.currentAttemptId]);
    expect(o.value.lost).toEqual([]);
  } finally {
    await holder.query('COMMIT');
    holder.release();
  }
  const { rows } = await t.pool.query<{ lease: Date }>('SELECT lease_expires_at AS lease FROM jobs_live WHERE id = $1', [locked.id]);
  expect(rows[0]!.lease.getTime()).toBe(soon.getTime());

  const again = await attemptHeartbeat(t.pool, { items, leaseTtlMs: 30_000 });
  if (again.outcome !== 'ok') throw new Error(again.outcome);
  expect(again.value.renewed.map((r) => r.attemptId).sort()).toEqual(items.map((i) => i.attemptId).sort());
  await checkInvariants(t.pool);
});
