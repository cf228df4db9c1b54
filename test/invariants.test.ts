/**
 * The invariant checker can fail: each corruption below breaks one invariant on purpose (with
 * raw SQL that bypasses the store) and the checker must say so.
 */
import { beforeEach, describe, expect, it } from 'vitest';
import { attemptComplete, attemptStart, jobClaim, jobEnqueue } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();

async function succeededJob() {
  const j = await jobEnqueue(t.pool, { queue: 'q', payload: { a: 1 } });
  if (j.outcome !== 'ok') throw new Error('enqueue');
  const c = await jobClaim(t.pool, { agentId: 'a', queues: ['q'], limit: 1, claimTtlMs: 10_000 });
  if (c.outcome !== 'ok') throw new Error('claim');
  const attemptId = c.value[0]!.attemptId;
  await attemptStart(t.pool, { attemptId, agentId: 'a', leaseTtlMs: 10_000 });
  await attemptComplete(t.pool, { attemptId, agentId: 'a', result: { r: 1 } });
  return { jobId: j.value.id, attemptId };
}

beforeEach(() => t.truncate());

describe('checkInvariants', () => {
  it('passes on state made by the store', async () => {
    await succeededJob();
    await expect(checkInvariants(t.pool)).resolves.toBeUndefined();
  });

  it('catches a write that left no event (3)', async () => {
    const { jobId } = await succeededJob();
    await t.pool.query(`UPDATE jobs SET priority = 9 WHERE id = $1`, [jobId]);
    await expect(checkInvariants(t.pool)).rejects.toThrow(/rebuilt from events differs: priority/);
  });

  it('catches a changed result after success (2)', async () => {
    const { jobId } = await succeededJob();
    await t.pool.query(`UPDATE jobs SET result = '{"r":2}' WHERE id = $1`, [jobId]);
    await expect(checkInvariants(t.pool)).rejects.toThrow(/result is not its last attempt's completion/);
  });

  it('catches an event written by an attempt that was not current (1)', async () => {
    const { jobId } = await succeededJob();
    await t.pool.query(
      `INSERT INTO job_events (job_id, attempt_id, kind, at, data) VALUES ($1, gen_random_uuid(), 'failed', now(), '{}')`,
      [jobId],
    );
    await expect(checkInvariants(t.pool)).rejects.toThrow(/while .* was current/);
  });

  it('catches a second live attempt (1) and a held job whose lease ended before the reaper ran (4)', async () => {
    const { jobId } = await succeededJob();
    await t.pool.query(
      `INSERT INTO attempts (id, job_id, attempt_no, agent_id, status, claimed_at, claim_deadline)
       VALUES (gen_random_uuid(), $1, 2, 'a', 'running', now(), now())`,
      [jobId],
    );
    await expect(checkInvariants(t.pool)).rejects.toThrow(/live attempt/);
    await t.truncate();
    await jobEnqueue(t.pool, { queue: 'q', payload: {} });
    await jobClaim(t.pool, { agentId: 'a', queues: ['q'], limit: 1, claimTtlMs: 1000 });
    await expect(checkInvariants(t.pool, { rescuedAt: new Date(Date.now() + 60_000) })).rejects.toThrow(/without a live lease/);
  });

  it('catches two terminal transitions without a requeue (2)', async () => {
    const { jobId, attemptId } = await succeededJob();
    await t.pool.query(
      `INSERT INTO job_events (job_id, attempt_id, kind, at, data) VALUES ($1, $2, 'canceled', now(), '{}')`,
      [jobId, attemptId],
    );
    await expect(checkInvariants(t.pool)).rejects.toThrow(/after success|terminal transitions/);
  });
});
