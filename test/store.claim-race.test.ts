/**
 * The claim under real concurrency: 32 connections claim from 5,000 queued jobs at once.
 * Every job is claimed exactly once and no attempt id is ever reused. And a claim whose
 * transaction began before the end of the attempt it follows records its claim after that end;
 * a cancel whose transaction began before the claim or the start it follows, its end after them.
 */
import { expect, it } from 'vitest';
import { attemptStart, jobCancel, jobClaim, jobEnqueue, jobRescueExpired } from '../server/store/index.js';
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

// PostgreSQL's now() is when the transaction began, and a statement sees what committed before its
// snapshot, taken later: after parsing and planning (1–2 ms for the claim, more on a busy machine
// or a new connection). Chaos caught the gap (seed 133801): the reaper ended two expired attempts
// at 12:25:44.911773 and one claim took both jobs back, recorded as claimed at 12:25:44.905183,
// before the end it followed. An explicit transaction holds that gap open here: it begins, the
// reaper ends the attempt and commits, then the claim runs in the transaction and sees the job
// queued again.
it('records a claim after the end it follows, even when its transaction began before that end', async () => {
  await t.truncate();
  const e = await jobEnqueue(t.pool, { queue: 'gap', payload: {} });
  if (e.outcome !== 'ok') throw new Error(JSON.stringify(e));
  const first = await jobClaim(t.pool, { agentId: 'a', queues: ['gap'], limit: 1, claimTtlMs: 60_000 });
  if (first.outcome !== 'ok' || first.value.length !== 1) throw new Error(JSON.stringify(first));
  // Its start deadline passed (bypassing the store: the reaper then runs on PostgreSQL's clock).
  await t.pool.query(`UPDATE jobs_live SET claim_deadline = now() - interval '1 s', lease_expires_at = now() - interval '1 s'`);

  const c = await t.pool.connect();
  try {
    await c.query('BEGIN');
    const began = (await c.query<{ at: Date }>('SELECT now() AS at')).rows[0]!.at;
    const rescued = await jobRescueExpired(t.pool, { limit: 10 });
    expect(rescued.outcome === 'ok' && rescued.value.map((r) => r.reason)).toEqual(['claim_expired']);
    const again = await jobClaim(c, { agentId: 'b', queues: ['gap'], limit: 1, claimTtlMs: 60_000 });
    await c.query('COMMIT');
    if (again.outcome !== 'ok' || again.value.length !== 1) throw new Error(JSON.stringify(again));
    const { rows } = await t.pool.query<{ ended: Date; claimed: Date }>(
      `SELECT a.ended_at AS ended, j.claimed_at AS claimed FROM attempts a JOIN jobs j ON j.id = a.job_id WHERE a.attempt_no = 1`,
    );
    expect(rows[0]!.ended.getTime()).toBeGreaterThan(began.getTime());
    expect(rows[0]!.claimed.getTime()).toBeGreaterThanOrEqual(rows[0]!.ended.getTime());
    expect(again.value[0]!.job.claimedAt!.getTime()).toBe(rows[0]!.claimed.getTime());
  } finally {
    c.release();
  }
  await checkInvariants(t.pool);
});

// The same gap the other way: an operator's cancel whose transaction began before a claim (or a
// start) committed, and that then ends the attempt the claim made, waiting for its row lock if
// the claim still holds it. With now() it was recorded as ended before it was claimed (or
// started), which the invariant checker refuses.
it('records a cancel after the claim and the start it follows, even when its transaction began before them', async () => {
  await t.truncate();
  for (const step of ['claim', 'start'] as const) {
    const e = await jobEnqueue(t.pool, { queue: `cancel-${step}`, payload: {} });
    if (e.outcome !== 'ok') throw new Error(JSON.stringify(e));
    const c = await t.pool.connect();
    try {
      await c.query('BEGIN');
      const began = (await c.query<{ at: Date }>('SELECT now() AS at')).rows[0]!.at;
      await new Promise((r) => setTimeout(r, 20)); // the clock moves on, as it does while a statement is planned
      const claimed = await jobClaim(t.pool, { agentId: 'a', queues: [`cancel-${step}`], limit: 1, claimTtlMs: 60_000 });
      if (claimed.outcome !== 'ok' || claimed.value.length !== 1) throw new Error(JSON.stringify(claimed));
      const attemptId = claimed.value[0]!.attemptId;
      let after = claimed.value[0]!.job.claimedAt!;
      if (step === 'start') {
        await new Promise((r) => setTimeout(r, 20));
        const started = await attemptStart(t.pool, { attemptId, agentId: 'a', leaseTtlMs: 60_000 });
        if (started.outcome !== 'ok') throw new Error(JSON.stringify(started));
        after = started.value.startedAt!;
      }
      const canceled = await jobCancel(c, { jobId: e.value.id });
      await c.query('COMMIT');
      if (canceled.outcome !== 'ok') throw new Error(JSON.stringify(canceled));
      expect(canceled.value.canceledAttempt?.attemptId).toBe(attemptId);
      const { rows } = await t.pool.query<{ ended: Date; finished: Date }>(
        `SELECT a.ended_at AS ended, j.finished_at AS finished FROM attempts a JOIN jobs j ON j.id = a.job_id WHERE a.id = $1`,
        [attemptId],
      );
      expect(after.getTime() - began.getTime(), step).toBeGreaterThanOrEqual(20);
      expect(rows[0]!.ended.getTime(), step).toBeGreaterThanOrEqual(after.getTime());
      expect(rows[0]!.finished.getTime(), step).toBe(rows[0]!.ended.getTime());
      expect(canceled.value.job.finishedAt!.getTime(), step).toBe(rows[0]!.finished.getTime());
    } finally {
      c.release();
    }
  }
  await checkInvariants(t.pool);
});
