/**
 * The claim under real concurrency: 32 connections claim from 5,000 queued jobs at once.
 * Every job is claimed exactly once and no attempt id is ever reused.
 */
import { expect, it } from 'vitest';
import { jobClaim } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { makeQueuedJobs } from './helpers/factories.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();
const JOBS = 5000;
const CLAIMERS = 32;

it(`${CLAIMERS} connections claim ${JOBS} jobs: each exactly once, attempt ids unique`, async () => {
  const ids = await makeQueuedJobs(t.pool, JOBS, 'race');
  const pool = t.newPool(CLAIMERS);
  // Hold all connections open first so the claimers really run at the same time.
  const clients = await Promise.all(Array.from({ length: CLAIMERS }, () => pool.connect()));
  const claims: Array<{ jobId: string; attemptId: string; by: number }> = [];
  let rounds = 0;
  try {
    await Promise.all(
      clients.map(async (c, i) => {
        for (;;) {
          // Batches of varying size, so claimers overlap on the same index pages.
          const o = await jobClaim(c, { agentId: `agent-${i}`, queues: ['race'], limit: 1 + (i % 7) * 3, claimTtlMs: 60_000 });
          if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
          rounds++;
          if (o.value.length === 0) return;
          for (const x of o.value) claims.push({ jobId: x.job.id, attemptId: x.attemptId, by: i });
        }
      }),
    );
  } finally {
    for (const c of clients) c.release();
  }

  expect(claims).toHaveLength(JOBS);
  expect(new Set(claims.map((c) => c.jobId)).size).toBe(JOBS);
  expect(new Set(claims.map((c) => c.jobId))).toEqual(new Set(ids));
  expect(new Set(claims.map((c) => c.attemptId)).size).toBe(JOBS);
  // Real contention: the work spread over many claimers.
  expect(new Set(claims.map((c) => c.by)).size).toBeGreaterThan(CLAIMERS / 2);
  expect(rounds).toBeGreaterThan(CLAIMERS);

  const db = await t.pool.query(`
    SELECT (SELECT count(*) FROM jobs WHERE status = 'claimed')::int AS claimed,
           (SELECT count(DISTINCT current_attempt_id) FROM jobs)::int AS distinct_attempts,
           (SELECT count(*) FROM jobs WHERE attempt_no <> 1)::int AS claimed_twice`);
  expect(db.rows[0]).toEqual({ claimed: JOBS, distinct_attempts: JOBS, claimed_twice: 0 });
  // Each job's current attempt is the one the claimer was handed.
  const handed = new Map(claims.map((c) => [c.jobId, c.attemptId]));
  const { rows } = await t.pool.query('SELECT id, current_attempt_id FROM jobs');
  for (const r of rows) expect(r.current_attempt_id).toBe(handed.get(r.id));
  await checkInvariants(t.pool);
});
