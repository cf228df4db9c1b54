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

  it('catches a write that left no history (3)', async () => {
    const { jobId } = await succeededJob();
    await t.pool.query(`UPDATE jobs SET attempts_started = 3 WHERE id = $1`, [jobId]);
    await expect(checkInvariants(t.pool)).rejects.toThrow(/history counts 1 started attempt\(s\), row has 3/);
  });

  it('catches a result on a job that did not succeed, and a success without one (2, 5)', async () => {
    const { jobId } = await succeededJob();
    await t.pool.query(`UPDATE jobs SET result = NULL WHERE id = $1`, [jobId]);
    await expect(checkInvariants(t.pool)).rejects.toThrow(/is succeeded without a result/);
    await t.truncate();
    await jobEnqueue(t.pool, { queue: 'q', payload: {} });
    await t.pool.query(`UPDATE jobs SET result = '{"r":2}'`);
    await expect(checkInvariants(t.pool)).rejects.toThrow(/is queued with a result/);
  });

  it('catches an attempt that acted while another was current (1)', async () => {
    const { jobId } = await succeededJob();
    await t.pool.query(
      `INSERT INTO attempts (id, job_id, attempt_no, agent_id, status, claimed_at, claim_deadline, started_at, ended_at, error, retryable, job_status)
       VALUES (gen_random_uuid(), $1, 2, 'a', 'failed', now() - interval '1 hour', now(), now() - interval '1 hour', now(), '{"message":"x"}', true, 'queued')`,
      [jobId],
    );
    await expect(checkInvariants(t.pool)).rejects.toThrow(/claimed at .*, before the previous transition/);
  });

  it('catches an ended attempt that is still current (1) and a held job whose lease ended before the reaper ran (4)', async () => {
    await jobEnqueue(t.pool, { queue: 'q', payload: {} });
    const c = await jobClaim(t.pool, { agentId: 'a', queues: ['q'], limit: 1, claimTtlMs: 1000 });
    if (c.outcome !== 'ok') throw new Error('claim');
    const { attemptId, job } = c.value[0]!;
    await expect(checkInvariants(t.pool, { rescuedAt: new Date(Date.now() + 60_000) })).rejects.toThrow(/without a live lease/);
    await t.pool.query(
      `INSERT INTO attempts (id, job_id, attempt_no, agent_id, status, claimed_at, claim_deadline, ended_at, job_status)
       VALUES ($1, $2, 1, 'a', 'claim_expired', now(), now(), now(), 'queued')`,
      [attemptId, job.id],
    );
    await expect(checkInvariants(t.pool)).rejects.toThrow(/has ended yet is some job's current attempt/);
  });

  it('catches two terminal transitions without a requeue (2)', async () => {
    const { jobId } = await succeededJob();
    await t.pool.query(
      `INSERT INTO job_events (job_id, kind, at, data) VALUES ($1, 'canceled', now(), '{"status": "canceled"}')`,
      [jobId],
    );
    await expect(checkInvariants(t.pool)).rejects.toThrow(/after success|terminal transitions/);
  });
});
