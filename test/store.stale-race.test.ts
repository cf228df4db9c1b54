/**
 * Stale against current, concurrently, for hundreds of rounds: only the current attempt ever
 * wins; the superseded one is `stale` and logged in `stale_reports` with both attempt ids.
 */
import type pg from 'pg';
import { expect, it } from 'vitest';
import {
  attemptComplete,
  attemptStart,
  jobClaim,
  jobEnqueue,
  jobRescueExpired,
} from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();
const ROUNDS = 200;
const TTL = 1000;

function must<T>(o: { outcome: string; value?: T }): T {
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  return o.value as T;
}

/** A job of `queue` enqueued, claimed and started by `agent` at `now(0)`, and its attempt id. */
async function runningJob(queue: string, now: (ms: number) => Date): Promise<{ jobId: string; attemptId: string }> {
  const job = must(await jobEnqueue(t.pool, { queue, payload: {}, now: now(0) }));
  const [c] = must(await jobClaim(t.pool, { agentId: 'agent', queues: [queue], limit: 1, claimTtlMs: TTL, now: now(0) }));
  must(await attemptStart(t.pool, { attemptId: c!.attemptId, agentId: 'agent', leaseTtlMs: TTL, now: now(0) }));
  return { jobId: job.id, attemptId: c!.attemptId };
}

/** Waits until a statement of this database whose text has `fragment` waits on a lock (it polls pg_stat_activity). */
async function blockedOn(pool: pg.Pool, fragment: string): Promise<void> {
  for (let i = 0; ; i++) {
    const { rows } = await pool.query(`SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE $1`, [`%${fragment}%`]);
    if (rows[0].n > 0) return;
    if (i > 500) throw new Error(`no statement with "${fragment}" ever waited on a lock`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

it(`${ROUNDS} rounds of a late and a current completion racing: the current one always wins`, async () => {
  const a = t.newPool(2);
  const b = t.newPool(2);
  let t0 = Date.parse('2031-01-01T00:00:00Z');
  for (let round = 0; round < ROUNDS; round++) {
    const now = (ms: number) => new Date(t0 + ms);
    const job = must(await jobEnqueue(t.pool, { queue: `r${round}`, payload: { round }, now: now(0) }));
    const [first] = must(await jobClaim(t.pool, { agentId: 'old', queues: [`r${round}`], limit: 1, claimTtlMs: TTL, now: now(0) }));
    must(await attemptStart(t.pool, { attemptId: first!.attemptId, agentId: 'old', leaseTtlMs: TTL, now: now(0) }));
    // The old agent stops heartbeating; its lease passes and the job goes to another agent.
    must(await jobRescueExpired(t.pool, { limit: 10, now: now(TTL + 1) }));
    const [second] = must(await jobClaim(t.pool, { agentId: 'new', queues: [`r${round}`], limit: 1, claimTtlMs: TTL, now: now(TTL + 2) }));
    must(await attemptStart(t.pool, { attemptId: second!.attemptId, agentId: 'new', leaseTtlMs: TTL, now: now(TTL + 2) }));
    expect(second!.attemptNo).toBe(2);

    // Both report at once on separate connections; which reaches the database first varies.
    const late = () => attemptComplete(a, { attemptId: first!.attemptId, agentId: 'old', result: { by: 'old' }, now: now(TTL + 3) });
    const current = () => attemptComplete(b, { attemptId: second!.attemptId, agentId: 'new', result: { by: 'new' }, now: now(TTL + 3) });
    const [lo, co] = round % 2 ? await Promise.all([late(), current()]) : (await Promise.all([current(), late()])).reverse();
    expect(co!.outcome).toBe('ok');
    expect(lo).toMatchObject({
      outcome: 'stale',
      current: { jobId: job.id, attemptNo: 2 },
    });
    const row = (
      await t.pool.query(`SELECT j.status::text, j.result, a.id AS succeeded_by FROM jobs j JOIN attempt_log a ON a.job_id = j.id AND a.status = 'succeeded' WHERE j.id = $1`, [job.id])
    ).rows;
    expect(row).toEqual([{ status: 'succeeded', result: { by: 'new' }, succeeded_by: second!.attemptId }]);
    t0 += 10 * TTL;
  }
  const reports = (await t.pool.query('SELECT attempt_id, current_attempt_id, current_attempt_no, call FROM stale_reports')).rows;
  expect(reports).toHaveLength(ROUNDS);
  const oldAttempts = new Set((await t.pool.query(`SELECT id FROM attempt_log WHERE agent_id = 'old'`)).rows.map((r) => r.id));
  for (const r of reports) {
    expect(oldAttempts.has(r.attempt_id)).toBe(true);
    expect(r.call).toBe('complete');
    expect(r.current_attempt_no).toBe(2);
    // The current attempt at the time of the report: the new one (still running, or just done).
  }
  await checkInvariants(t.pool);
});

it(`${ROUNDS} rounds of a completion racing the reaper: exactly one of them takes effect`, async () => {
  const a = t.newPool(2);
  const b = t.newPool(2);
  let t0 = Date.parse('2032-01-01T00:00:00Z');
  const tally = { completed: 0, rescued: 0 };
  for (let round = 0; round < ROUNDS; round++) {
    const now = (ms: number) => new Date(t0 + ms);
    const job = must(await jobEnqueue(t.pool, { queue: `x${round}`, payload: { round }, now: now(0) }));
    const [c] = must(await jobClaim(t.pool, { agentId: 'agent', queues: [`x${round}`], limit: 1, claimTtlMs: TTL, now: now(0) }));
    must(await attemptStart(t.pool, { attemptId: c!.attemptId, agentId: 'agent', leaseTtlMs: TTL, now: now(0) }));
    // The lease has passed: the agent's completion and the reaper race for the job.
    const [co, ro] = await Promise.all([
      attemptComplete(a, { attemptId: c!.attemptId, agentId: 'agent', result: { round }, now: now(TTL + 1) }),
      jobRescueExpired(b, { limit: 10, now: now(TTL + 1) }),
    ]);
    const rescued = must(ro).filter((r) => r.jobId === job.id).length;
    if (co.outcome === 'ok') {
      expect(rescued).toBe(0);
      tally.completed++;
    } else {
      expect(co).toMatchObject({ outcome: 'stale', current: { jobId: job.id, status: 'queued', attemptNo: 1 } });
      expect(rescued).toBe(1);
      tally.rescued++;
    }
    t0 += 10 * TTL;
  }
  expect(tally.completed + tally.rescued).toBe(ROUNDS);
  const n = (await t.pool.query('SELECT count(*)::int AS n FROM stale_reports WHERE attempt_id IN (SELECT id FROM attempt_log)')).rows[0].n;
  expect(n).toBeGreaterThanOrEqual(tally.rescued);
  console.log(`completion vs reaper over ${ROUNDS} rounds: completion won ${tally.completed}, reaper won ${tally.rescued}`);
  await checkInvariants(t.pool);
});

it('a late report for a job deleted while it is answered is stale, not a foreign-key error', async () => {
  const now = (ms: number) => new Date(Date.parse('2033-01-01T00:00:00Z') + ms);
  const job = must(await jobEnqueue(t.pool, { queue: 'gone', payload: {}, now: now(0) }));
  const [c] = must(await jobClaim(t.pool, { agentId: 'old', queues: ['gone'], limit: 1, claimTtlMs: TTL, now: now(0) }));
  must(await jobRescueExpired(t.pool, { limit: 10, now: now(TTL + 1) }));
  // Another session deletes the job (as a purge does) and has not committed yet.
  const deleter = await t.newPool(1).connect();
  const reporter = t.newPool(1);
  try {
    await deleter.query('BEGIN');
    await deleter.query('DELETE FROM jobs WHERE id = $1', [job.id]);
    const late = attemptComplete(reporter, { attemptId: c!.attemptId, agentId: 'old', result: {}, now: now(TTL + 2) });
    // The late report reaches its stale_reports insert and waits on the job's row lock.
    await blockedOn(t.pool, 'INSERT INTO stale_reports');
    await deleter.query('COMMIT');
    await expect(late).resolves.toMatchObject({ outcome: 'stale', current: { jobId: job.id } });
  } finally {
    deleter.release();
  }
  expect((await t.pool.query('SELECT count(*)::int AS n FROM stale_reports WHERE job_id = $1', [job.id])).rows[0].n).toBe(0);
});

// The completion's fence is its DELETE's own condition (no row lock before it): a completion that
// waits for another statement's change to the row checks the fence again on the row as changed.
it('a completion that waits for the reaper to commit its requeue finds its attempt gone: stale, the job queued', async () => {
  const now = (ms: number) => new Date(Date.parse('2034-01-01T00:00:00Z') + ms);
  const { jobId, attemptId } = await runningJob('wait-reaper', now);
  const reaper = await t.newPool(1).connect();
  const reporter = t.newPool(1);
  try {
    await reaper.query('BEGIN');
    expect(must(await jobRescueExpired(reaper, { limit: 10, now: now(TTL + 1) })).map((r) => r.jobId)).toEqual([jobId]);
    const late = attemptComplete(reporter, { attemptId, agentId: 'agent', result: { late: true }, now: now(TTL + 2) });
    await blockedOn(t.pool, 'DELETE FROM jobs_live');
    await reaper.query('COMMIT');
    await expect(late).resolves.toMatchObject({ outcome: 'stale', current: { jobId, status: 'queued' } });
  } finally {
    reaper.release();
  }
  const row = (await t.pool.query(`SELECT status::text, result, current_attempt_id FROM jobs WHERE id = $1`, [jobId])).rows;
  expect(row).toEqual([{ status: 'queued', result: null, current_attempt_id: null }]);
});

it('a completion that waits for a lease renewal to commit completes the renewed row', async () => {
  const now = (ms: number) => new Date(Date.parse('2035-01-01T00:00:00Z') + ms);
  const { jobId, attemptId } = await runningJob('wait-renew', now);
  const other = await t.newPool(1).connect();
  const reporter = t.newPool(1);
  try {
    await other.query('BEGIN');
    await other.query(`UPDATE jobs_live SET heartbeat_at = $2, lease_expires_at = $3 WHERE id = $1`, [jobId, now(500), now(500 + TTL)]);
    const done = attemptComplete(reporter, { attemptId, agentId: 'agent', result: { n: 1 }, now: now(600) });
    await blockedOn(t.pool, 'DELETE FROM jobs_live');
    await other.query('COMMIT');
    await expect(done).resolves.toMatchObject({ outcome: 'ok', value: { id: jobId, status: 'succeeded', result: { n: 1 } } });
  } finally {
    other.release();
  }
  // The row it moved is the renewed one: the renewal's heartbeat is on it.
  const row = (await t.pool.query(`SELECT status::text, heartbeat_at FROM jobs WHERE id = $1`, [jobId])).rows;
  expect(row).toEqual([{ status: 'succeeded', heartbeat_at: now(500) }]);
});
