/**
 * Each store verb, outcome by outcome, on real PostgreSQL with a pinned clock; the invariants
 * are checked after every test.
 */
import { randomUUID } from 'node:crypto';
import fc from 'fast-check';
import pg from 'pg';
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import {
  attemptComplete,
  attemptFail,
  attemptHeartbeat,
  attemptStart,
  jobCancel,
  jobClaim,
  jobEnqueue,
  jobGet,
  jobRequeue,
  jobRescueExpired,
  stepRecord,
  stepReserve,
  type Claimed,
} from '../server/store/index.js';
import type { Outcome } from '../server/domain/outcomes.js';
import { jobEventDeltaSql } from '../server/store/ends.js';
import { camelRow, jobColumns, jobErrorSql, toJob } from '../server/store/rows.js';
import { useTestDb } from './helpers/db.js';
import { makeJob } from './helpers/factories.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();
// In the past, so calls that do not pin the clock (database time) come after the pinned ones.
const T0 = new Date('2020-01-01T00:00:00Z');
const at = (ms: number) => new Date(T0.getTime() + ms);
const TTL = 30_000;

function value<T>(o: Outcome<T>): T {
  if (o.outcome !== 'ok' && o.outcome !== 'duplicate') throw new Error(`expected a value, got ${JSON.stringify(o)}`);
  return o.value;
}

async function enqueueOne(extra: Partial<Parameters<typeof jobEnqueue>[1]> = {}) {
  return value(await jobEnqueue(t.pool, { queue: 'q', payload: { n: 1 }, now: T0, ...extra }));
}
async function claimOne(agentId = 'a1', now = T0): Promise<Claimed> {
  const c = value(await jobClaim(t.pool, { agentId, queues: ['q'], limit: 1, claimTtlMs: TTL, now }));
  expect(c).toHaveLength(1);
  return c[0]!;
}
async function runningOne(extra: Partial<Parameters<typeof jobEnqueue>[1]> = {}) {
  await enqueueOne(extra);
  const c = await claimOne();
  value(await attemptStart(t.pool, { attemptId: c.attemptId, agentId: 'a1', leaseTtlMs: TTL, now: T0 }));
  return c;
}

beforeEach(() => t.truncate());
afterEach(() => checkInvariants(t.pool));

describe('jobEnqueue', () => {
  it('creates a queued job with defaults', async () => {
    const j = await enqueueOne();
    expect(j).toMatchObject({ queue: 'q', payload: { n: 1 }, status: 'queued', attemptNo: 0, maxAttempts: 5, priority: 0 });
    expect(j.runAt).toEqual(T0);
  });

  it('writes the same job whether it takes the statement with the key and header CTEs or the one without', async () => {
    // jobEnqueuePlain (no key, no header) and jobEnqueue (either): queued, and claimed by a hand-off.
    const handOff = (agentId: string) => ({ agentId, agentLabels: {}, attemptId: randomUUID(), claimTtlMs: 30_000 });
    const ask = { queue: 'both', payload: { n: 1 }, priority: 2, labels: { os: 'windows' }, maxAttempts: 3, now: T0 };
    const plain = value(await jobEnqueue(t.pool, ask));
    const keyed = value(await jobEnqueue(t.pool, { ...ask, idempotencyKey: 'both-1' }));
    const headed = value(await jobEnqueue(t.pool, { ...ask, notifyUrl: 'https://example.com/n', notifyHeader: { name: 'x-secret', value: 's' } }));
    const same = (j: Awaited<typeof plain>) => ({ ...j, id: undefined, idempotencyKey: undefined, notifyUrl: undefined });
    expect(same(keyed)).toEqual(same(plain));
    expect(same(headed)).toEqual(same(plain));
    expect(keyed.idempotencyKey).toBe('both-1');
    expect((await t.pool.query('SELECT name, value FROM notify_headers WHERE job_id = $1', [headed.id])).rows).toEqual([{ name: 'x-secret', value: 's' }]);
    expect((await t.pool.query('SELECT count(*)::int AS n FROM job_keys')).rows[0].n).toBe(1);
    // A waiting agent: the job is claimed by the enqueue itself on either statement, unless a queued
    // job of its queue comes first (the three above, of priority 2).
    const q = { queue: 'handed', payload: { n: 2 }, now: T0 };
    const a = handOff('quick-a');
    const b = handOff('quick-b');
    const claimedPlain = value(await jobEnqueue(t.pool, { ...q, handOff: a }));
    const claimedKeyed = value(await jobEnqueue(t.pool, { ...q, idempotencyKey: 'handed-1', handOff: b }));
    expect(claimedPlain).toMatchObject({ status: 'claimed', attemptNo: 1, currentAttemptId: a.attemptId, agentId: 'quick-a' });
    expect(claimedKeyed).toMatchObject({ status: 'claimed', attemptNo: 1, currentAttemptId: b.attemptId, agentId: 'quick-b' });
    const behind = value(await jobEnqueue(t.pool, { ...ask, priority: 1, handOff: handOff('quick-c') }));
    expect(behind).toMatchObject({ status: 'queued', attemptNo: 0, currentAttemptId: null });
    await checkInvariants(t.pool);
  });

  it('returns the existing job for the same key and payload, conflict for another payload', async () => {
    const a = await jobEnqueue(t.pool, { queue: 'q', payload: { x: 1, y: [1, 2] }, idempotencyKey: 'k1' });
    const b = await jobEnqueue(t.pool, { queue: 'q', payload: { y: [1, 2], x: 1 }, idempotencyKey: 'k1' });
    expect(a.outcome).toBe('ok');
    expect(b.outcome).toBe('duplicate');
    expect(value(b).id).toBe(value(a).id);
    const c = await jobEnqueue(t.pool, { queue: 'q', payload: { x: 2 }, idempotencyKey: 'k1' });
    expect(c).toMatchObject({ outcome: 'conflict' });
    const d = await jobEnqueue(t.pool, { queue: 'other', payload: { x: 1, y: [1, 2] }, idempotencyKey: 'k1' });
    expect(d).toMatchObject({ outcome: 'conflict' });
    expect((await t.pool.query('SELECT count(*)::int AS n FROM jobs')).rows[0].n).toBe(1);
  });

  it('makes one job from many concurrent enqueues with one key', async () => {
    const pool = t.newPool(16);
    const outs = await Promise.all(
      Array.from({ length: 16 }, () => jobEnqueue(pool, { queue: 'q', payload: { same: true }, idempotencyKey: 'race' })),
    );
    expect(outs.filter((o) => o.outcome === 'ok')).toHaveLength(1);
    expect(outs.filter((o) => o.outcome === 'duplicate')).toHaveLength(15);
    expect(new Set(outs.map((o) => value(o).id)).size).toBe(1);
  });
});

describe('jobClaim', () => {
  it('claims by priority, then run_at, and not before run_at', async () => {
    await enqueueOne({ payload: { i: 'low' }, priority: 0 });
    await enqueueOne({ payload: { i: 'high' }, priority: 5 });
    await enqueueOne({ payload: { i: 'later' }, priority: 9, runAt: at(60_000) });
    const c = value(await jobClaim(t.pool, { agentId: 'a1', queues: ['q'], limit: 3, claimTtlMs: TTL, now: T0 }));
    expect(c.map((x) => x.job.payload)).toEqual([{ i: 'high' }, { i: 'low' }]);
    expect(c[0]).toMatchObject({ attemptNo: 1, claimDeadline: at(TTL) });
    expect(c[0]!.job).toMatchObject({ status: 'claimed', agentId: 'a1' });
    expect(c[0]!.attemptId).toMatch(/^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/);
  });

  it('gives attempt ids in time order: the claim time in milliseconds, then random bits', async () => {
    for (let i = 0; i < 6; i++) await enqueueOne({ payload: { i } });
    const first = value(await jobClaim(t.pool, { agentId: 'a1', queues: ['q'], limit: 3, claimTtlMs: TTL, now: T0 }));
    const later = value(await jobClaim(t.pool, { agentId: 'a1', queues: ['q'], limit: 3, claimTtlMs: TTL, now: at(1) }));
    const ms = (id: string) => parseInt(id.replace(/-/g, '').slice(0, 12), 16);
    expect(first.map((c) => ms(c.attemptId))).toEqual([T0.getTime(), T0.getTime(), T0.getTime()]);
    expect(later.map((c) => ms(c.attemptId))).toEqual([T0.getTime() + 1, T0.getTime() + 1, T0.getTime() + 1]);
    // Within a claim the rest differs, so the ids do; every id of the later claim sorts after.
    expect(new Set([...first, ...later].map((c) => c.attemptId)).size).toBe(6);
    for (const a of first) for (const b of later) expect(a.attemptId < b.attemptId).toBe(true);
  });

  it('only claims from the named queues', async () => {
    await enqueueOne({ queue: 'elsewhere' });
    const c = value(await jobClaim(t.pool, { agentId: 'a1', queues: ['q'], limit: 5, claimTtlMs: TTL, now: T0 }));
    expect(c).toEqual([]);
  });
});

describe('attemptStart', () => {
  it('moves claimed to running with a lease; a repeat is duplicate', async () => {
    await enqueueOne();
    const c = await claimOne();
    const s = await attemptStart(t.pool, { attemptId: c.attemptId, agentId: 'a1', leaseTtlMs: 10_000, now: at(1000) });
    expect(s.outcome).toBe('ok');
    expect(value(s)).toMatchObject({ status: 'running', attemptsStarted: 1, leaseExpiresAt: at(11_000) });
    const again = await attemptStart(t.pool, { attemptId: c.attemptId, agentId: 'a1', leaseTtlMs: 10_000, now: at(2000) });
    expect(again.outcome).toBe('duplicate');
  });

  it('is forbidden to another agent and not_found for an unknown attempt', async () => {
    await enqueueOne();
    const c = await claimOne();
    expect(await attemptStart(t.pool, { attemptId: c.attemptId, agentId: 'a2', leaseTtlMs: TTL })).toMatchObject({
      outcome: 'forbidden',
    });
    expect(
      await attemptStart(t.pool, { attemptId: '00000000-0000-0000-0000-000000000000', agentId: 'a1', leaseTtlMs: TTL }),
    ).toMatchObject({ outcome: 'not_found' });
  });

  it('caps the lease by the execution timeout', async () => {
    await enqueueOne({ executionTimeoutMs: 5000 });
    const c = await claimOne();
    const j = value(await attemptStart(t.pool, { attemptId: c.attemptId, agentId: 'a1', leaseTtlMs: TTL, now: T0 }));
    expect(j.leaseExpiresAt).toEqual(at(5000));
    expect(j.executionDeadline).toEqual(at(5000));
  });
});

describe('attemptHeartbeat', () => {
  it('renews running attempts in one call and reports the others', async () => {
    const r1 = await runningOne();
    await enqueueOne();
    const claimedOnly = await claimOne();
    const res = value(
      await attemptHeartbeat(t.pool, {
        items: [
          { attemptId: r1.attemptId, agentId: 'a1' },
          { attemptId: claimedOnly.attemptId, agentId: 'a1' },
          { attemptId: '11111111-1111-1111-1111-111111111111', agentId: 'a1' },
          { attemptId: r1.attemptId, agentId: 'a2' },
        ],
        leaseTtlMs: TTL,
        now: at(5000),
      }),
    );
    expect(res.renewed).toEqual([{ attemptId: r1.attemptId, leaseExpiresAt: at(5000 + TTL) }]);
    expect(res.pending).toEqual([claimedOnly.attemptId]);
    expect(res.lost.map((l) => l.reason).sort()).toEqual(['forbidden', 'not_found']);
  });

  it('a renewal takes no row another transaction holds, so it is never a deadlock\'s victim: the free one renewed, the held one pending', async () => {
    // Before (heartbeat.ts without SKIP LOCKED) the renewal locked `low`, waited for `high`, and a
    // transaction asking for `low` while holding `high` made a cycle that PostgreSQL ended by
    // killing the renewal (it ran again: sql.ts `run`). Now it skips `high` and waits for nothing.
    const [low, high] = [await runningOne(), await runningOne()].sort((x, y) => (x.attemptId < y.attemptId ? -1 : 1)) as [Claimed, Claimed];
    const renewing = new pg.Pool({ connectionString: t.url, max: 1, options: '-c enable_seqscan=off -c enable_bitmapscan=off' });
    const other = await t.pool.connect();
    const deadlocks = async () => Number((await t.pool.query(`SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()`)).rows[0].deadlocks);
    try {
      const before = await deadlocks();
      await other.query('BEGIN');
      await other.query('SELECT 1 FROM jobs_live WHERE current_attempt_id = $1 FOR UPDATE', [high.attemptId]);
      const res = value(await attemptHeartbeat(renewing, { items: [low, high].map((c) => ({ attemptId: c.attemptId, agentId: 'a1' })), leaseTtlMs: TTL, now: at(5000) }));
      await other.query('SELECT 1 FROM jobs_live WHERE current_attempt_id = $1 FOR UPDATE', [low.attemptId]);
      await other.query('COMMIT');
      expect(res.renewed.map((r) => r.attemptId)).toEqual([low.attemptId]);
      expect(res.renewed[0]!.leaseExpiresAt.getTime()).toBe(at(5000 + TTL).getTime());
      expect(res.pending).toEqual([high.attemptId]);
      expect(await deadlocks()).toBe(before);
    } finally {
      other.release();
      await renewing.end();
    }
  });

  it('says lease_expired for an attempt the reaper took back and another attempt replaced, and logs it', async () => {
    const r1 = await runningOne();
    value(await jobRescueExpired(t.pool, { limit: 10, now: at(TTL + 1) }));
    const r2 = await claimOne('a1', at(TTL + 2));
    const res = value(
      await attemptHeartbeat(t.pool, { items: [{ attemptId: r1.attemptId, agentId: 'a1' }], leaseTtlMs: TTL, now: at(TTL + 3) }),
    );
    expect(res.lost).toEqual([
      {
        attemptId: r1.attemptId,
        reason: 'lease_expired',
        current: { jobId: r1.job.id, status: 'claimed', attemptNo: 2, currentAttemptId: r2.attemptId },
      },
    ]);
    const { rows } = await t.pool.query('SELECT * FROM stale_reports');
    expect(rows).toMatchObject([{ attempt_id: r1.attemptId, current_attempt_id: r2.attemptId, call: 'heartbeat' }]);
  });

  it('says stale for an attempt its own report ended (ended otherwise than taken back), and logs it', async () => {
    const r = await runningOne();
    value(await attemptComplete(t.pool, { attemptId: r.attemptId, agentId: 'a1', result: {}, now: at(100) }));
    const res = value(
      await attemptHeartbeat(t.pool, { items: [{ attemptId: r.attemptId, agentId: 'a1' }], leaseTtlMs: TTL, now: at(200) }),
    );
    expect(res.lost).toEqual([
      { attemptId: r.attemptId, reason: 'stale', current: { jobId: r.job.id, status: 'succeeded', attemptNo: 1, currentAttemptId: null } },
    ]);
    const { rows } = await t.pool.query('SELECT * FROM stale_reports');
    expect(rows).toMatchObject([{ attempt_id: r.attemptId, call: 'heartbeat' }]);
  });

  it('says canceled for an attempt a cancel ended, and logs it as stale', async () => {
    const r = await runningOne();
    value(await jobCancel(t.pool, { jobId: r.job.id, now: at(100) }));
    const res = value(
      await attemptHeartbeat(t.pool, { items: [{ attemptId: r.attemptId, agentId: 'a1' }], leaseTtlMs: TTL, now: at(200) }),
    );
    expect(res.lost).toEqual([
      { attemptId: r.attemptId, reason: 'canceled', current: { jobId: r.job.id, status: 'canceled', attemptNo: 1, currentAttemptId: null } },
    ]);
    const { rows } = await t.pool.query('SELECT * FROM stale_reports');
    expect(rows).toMatchObject([{ attempt_id: r.attemptId, call: 'heartbeat' }]);
  });

  it('stops renewing past the execution deadline and says timed_out', async () => {
    const r = await runningOne({ executionTimeoutMs: 5000 });
    const res = value(
      await attemptHeartbeat(t.pool, { items: [{ attemptId: r.attemptId, agentId: 'a1' }], leaseTtlMs: TTL, now: at(5000) }),
    );
    expect(res.lost).toMatchObject([{ attemptId: r.attemptId, reason: 'timed_out' }]);
  });
});

describe('attemptComplete', () => {
  it('stores the result once; a repeat is duplicate with it; another result is conflict', async () => {
    const r = await runningOne();
    const done = await attemptComplete(t.pool, { attemptId: r.attemptId, agentId: 'a1', result: { ok: 1 }, now: at(100) });
    expect(value(done)).toMatchObject({ status: 'succeeded', result: { ok: 1 }, currentAttemptId: null });
    const dup = await attemptComplete(t.pool, { attemptId: r.attemptId, agentId: 'a1', result: { ok: 1 } });
    expect(dup.outcome).toBe('duplicate');
    expect(value(dup).result).toEqual({ ok: 1 });
    const other = await attemptComplete(t.pool, { attemptId: r.attemptId, agentId: 'a1', result: { ok: 2 } });
    expect(other).toMatchObject({ outcome: 'conflict' });
    const fail = await attemptFail(t.pool, { attemptId: r.attemptId, agentId: 'a1', error: { message: 'x' }, retryable: true });
    expect(fail).toMatchObject({ outcome: 'conflict' });
    expect((await t.pool.query('SELECT result FROM jobs')).rows[0].result).toEqual({ ok: 1 });
  });

  it('rejects a superseded attempt as stale with the current attempt, and logs both ids', async () => {
    const r1 = await runningOne();
    value(await jobRescueExpired(t.pool, { limit: 10, now: at(TTL + 1) }));
    const r2 = await claimOne('a2', at(TTL + 2));
    const late = await attemptComplete(t.pool, { attemptId: r1.attemptId, agentId: 'a1', result: { late: true } });
    expect(late).toMatchObject({
      outcome: 'stale',
      current: { jobId: r1.job.id, status: 'claimed', attemptNo: 2, currentAttemptId: r2.attemptId },
    });
    const { rows } = await t.pool.query('SELECT * FROM stale_reports');
    expect(rows).toMatchObject([
      { job_id: r1.job.id, attempt_id: r1.attemptId, current_attempt_id: r2.attemptId, current_attempt_no: 2, call: 'complete' },
    ]);
    expect((await t.pool.query('SELECT status, result FROM jobs')).rows[0]).toEqual({ status: 'claimed', result: null });
  });

  it('accepts a completion after the lease passed but before the reaper took the job', async () => {
    const r = await runningOne();
    const o = await attemptComplete(t.pool, { attemptId: r.attemptId, agentId: 'a1', result: {}, now: at(TTL * 3) });
    expect(o.outcome).toBe('ok');
  });

  it('completing a claimed attempt starts it implicitly', async () => {
    await enqueueOne();
    const c = await claimOne();
    const j = value(await attemptComplete(t.pool, { attemptId: c.attemptId, agentId: 'a1', result: { r: 1 } }));
    expect(j).toMatchObject({ status: 'succeeded', attemptsStarted: 1 });
  });
});

describe('attemptFail', () => {
  it('retries with a backoff within [0.5, 1] of base·2^(n-1), then dead at the cap', async () => {
    await enqueueOne({ maxAttempts: 3 });
    const backoff = { baseMs: 1000, maxMs: 60_000 };
    let now = T0;
    for (let n = 1; n <= 3; n++) {
      const c = await claimOne('a1', now);
      expect(c.attemptNo).toBe(n);
      value(await attemptStart(t.pool, { attemptId: c.attemptId, agentId: 'a1', leaseTtlMs: TTL, now }));
      const j = value(
        await attemptFail(t.pool, { attemptId: c.attemptId, agentId: 'a1', error: { message: `boom ${n}` }, retryable: true, backoff, now }),
      );
      if (n < 3) {
        expect(j.status).toBe('queued');
        const delay = j.runAt.getTime() - now.getTime();
        const full = 1000 * 2 ** (n - 1);
        expect(delay).toBeGreaterThanOrEqual(full * 0.5);
        expect(delay).toBeLessThanOrEqual(full);
        now = new Date(j.runAt.getTime() + 1); // the row holds microseconds, Date only milliseconds
      } else {
        expect(j).toMatchObject({ status: 'dead', error: { message: 'boom 3' } });
      }
    }
    const events = value(await jobGet(t.pool, { jobId: (await t.pool.query('SELECT id FROM jobs')).rows[0].id })).events;
    expect(events.map((e) => e.kind)).toEqual([
      'enqueued', 'claimed', 'started', 'retry_scheduled', 'claimed', 'started', 'retry_scheduled', 'claimed', 'started', 'dead',
    ]);
  });

  it('fails for good when not retryable; a repeat is duplicate', async () => {
    const r = await runningOne();
    const p = { attemptId: r.attemptId, agentId: 'a1', error: { message: 'bad input', code: 7 }, retryable: false };
    expect(value(await attemptFail(t.pool, p))).toMatchObject({ status: 'failed', error: { message: 'bad input', code: 7 } });
    expect((await attemptFail(t.pool, p)).outcome).toBe('duplicate');
    expect((await attemptFail(t.pool, { ...p, retryable: true })).outcome).toBe('conflict');
  });
});

describe('jobCancel', () => {
  it('cancels a running job, names the attempt to revoke, and fences the attempt out', async () => {
    const r = await runningOne();
    const c = value(await jobCancel(t.pool, { jobId: r.job.id }));
    expect(c.canceledAttempt).toEqual({ attemptId: r.attemptId, agentId: 'a1' });
    expect(c.job.status).toBe('canceled');
    expect((await jobCancel(t.pool, { jobId: r.job.id })).outcome).toBe('duplicate');
    expect(await attemptComplete(t.pool, { attemptId: r.attemptId, agentId: 'a1', result: {} })).toMatchObject({
      outcome: 'stale',
      current: { status: 'canceled' },
    });
  });

  it('is conflict for a succeeded job and not_found for an unknown one', async () => {
    const r = await runningOne();
    value(await attemptComplete(t.pool, { attemptId: r.attemptId, agentId: 'a1', result: {} }));
    expect(await jobCancel(t.pool, { jobId: r.job.id })).toMatchObject({ outcome: 'conflict', current: { status: 'succeeded' } });
    expect(await jobCancel(t.pool, { jobId: '22222222-2222-2222-2222-222222222222' })).toMatchObject({ outcome: 'not_found' });
  });
});

describe('steps', () => {
  it('reserve → record → a later attempt gets the recorded output without running', async () => {
    const r1 = await runningOne();
    const ref = { attemptId: r1.attemptId, agentId: 'a1', step: 'charge' };
    expect(value(await stepReserve(t.pool, ref))).toEqual({ state: 'reserved' });
    expect(value(await stepReserve(t.pool, ref))).toEqual({ state: 'reserved' }); // a retried reserve
    expect((await stepRecord(t.pool, { ...ref, output: { charged: 42 } })).outcome).toBe('ok');
    expect((await stepRecord(t.pool, { ...ref, output: { charged: 42 } })).outcome).toBe('duplicate');
    expect((await stepRecord(t.pool, { ...ref, output: { charged: 43 } })).outcome).toBe('conflict');
    value(await jobRescueExpired(t.pool, { limit: 10, now: at(TTL + 1) }));
    const r2 = await claimOne('a1', at(TTL + 2));
    value(await attemptStart(t.pool, { attemptId: r2.attemptId, agentId: 'a1', leaseTtlMs: TTL, now: at(TTL + 2) }));
    expect(value(await stepReserve(t.pool, { ...ref, attemptId: r2.attemptId }))).toEqual({
      state: 'done',
      output: { charged: 42 },
      attemptId: r1.attemptId,
    });
  });

  it('a reservation never recorded is unknown to the next attempt, which takes it over', async () => {
    const r1 = await runningOne();
    value(await stepReserve(t.pool, { attemptId: r1.attemptId, agentId: 'a1', step: 'email' }));
    value(await jobRescueExpired(t.pool, { limit: 10, now: at(TTL + 1) }));
    const r2 = await claimOne('a1', at(TTL + 2));
    value(await attemptStart(t.pool, { attemptId: r2.attemptId, agentId: 'a1', leaseTtlMs: TTL, now: at(TTL + 2) }));
    const ref2 = { attemptId: r2.attemptId, agentId: 'a1', step: 'email' };
    expect(value(await stepReserve(t.pool, ref2))).toEqual({ state: 'unknown', previousAttemptId: r1.attemptId, reservations: 2 });
    // The old attempt can no longer record it: it is stale.
    expect(await stepRecord(t.pool, { attemptId: r1.attemptId, agentId: 'a1', step: 'email', output: 1 })).toMatchObject({
      outcome: 'stale',
    });
    expect((await stepRecord(t.pool, { ...ref2, output: { sent: true } })).outcome).toBe('ok');
  });

  it('refuses steps of an attempt that is only claimed, and records nothing for a stale one', async () => {
    await enqueueOne();
    const c = await claimOne();
    expect(await stepReserve(t.pool, { attemptId: c.attemptId, agentId: 'a1', step: 's' })).toMatchObject({ outcome: 'conflict' });
    expect((await t.pool.query('SELECT count(*)::int AS n FROM steps')).rows[0].n).toBe(0);
  });
});

describe('jobRescueExpired', () => {
  it('requeues an unstarted claim without counting it, a lost lease at once, and dead-letters at the cap', async () => {
    // The factories write at database time: the clock of this test starts a minute after it.
    const now = new Date(Date.now() + 60_000);
    const from = (ms: number) => new Date(now.getTime() + ms);
    const claimed = await makeJob(t.pool, { status: 'claimed', leaseExpiresAt: from(-1) });
    const running = await makeJob(t.pool, { status: 'running', leaseExpiresAt: from(-1), maxAttempts: 3, attemptsStarted: 1 });
    const capped = await makeJob(t.pool, { status: 'running', leaseExpiresAt: from(-1), maxAttempts: 2, attemptsStarted: 2 });
    const live = await makeJob(t.pool, { status: 'running', leaseExpiresAt: from(1000) });
    const out = value(await jobRescueExpired(t.pool, { limit: 100, now }));
    const by = new Map(out.map((r) => [r.jobId, r]));
    expect(by.get(claimed.id)).toMatchObject({ reason: 'claim_expired', status: 'queued' });
    expect(by.get(running.id)).toMatchObject({ reason: 'lease_expired', status: 'queued' });
    expect(by.get(capped.id)).toMatchObject({ reason: 'lease_expired', status: 'dead' });
    expect(by.has(live.id)).toBe(false);
    const rows = (await t.pool.query('SELECT id, status::text, attempts_started, run_at FROM jobs')).rows;
    const row = (id: string) => rows.find((r) => r.id === id);
    expect(row(claimed.id)).toMatchObject({ status: 'queued', attempts_started: 0, run_at: claimed.runAt });
    expect(row(running.id)).toMatchObject({ status: 'queued', attempts_started: 1 });
    await checkInvariants(t.pool, { rescuedAt: now });
  });

  it('fails a job past its execution timeout as retryable, with a backoff', async () => {
    const r = await runningOne({ executionTimeoutMs: 5000 });
    const out = value(await jobRescueExpired(t.pool, { limit: 10, now: at(5001), backoff: { baseMs: 1000, maxMs: 1000 } }));
    expect(out).toMatchObject([{ jobId: r.job.id, reason: 'timed_out', status: 'queued' }]);
    const j = value(await jobGet(t.pool, { jobId: r.job.id }));
    expect(j.job.runAt.getTime()).toBeGreaterThanOrEqual(at(5001 + 500).getTime());
    expect(j.job.error).toMatchObject({ reason: 'timed_out' });
    expect(j.attempts[0]!.status).toBe('timed_out');
  });
});

describe('jobRequeue and jobGet', () => {
  it('requeues a dead job with a fresh attempt budget; never a succeeded one', async () => {
    const dead = await makeJob(t.pool, { status: 'dead' });
    const j = value(await jobRequeue(t.pool, { jobId: dead.id }));
    expect(j).toMatchObject({ status: 'queued', attemptsStarted: 0, finishedAt: null });
    const r = await runningOne();
    value(await attemptComplete(t.pool, { attemptId: r.attemptId, agentId: 'a1', result: {} }));
    expect(await jobRequeue(t.pool, { jobId: r.job.id })).toMatchObject({ outcome: 'conflict' });
  });

  it('returns a job with its attempts, events, steps and stale reports', async () => {
    const r = await runningOne();
    value(await stepReserve(t.pool, { attemptId: r.attemptId, agentId: 'a1', step: 's1' }));
    value(await attemptComplete(t.pool, { attemptId: r.attemptId, agentId: 'a1', result: { z: 1 } }));
    await attemptComplete(t.pool, { attemptId: r.attemptId, agentId: 'a1', result: { z: 1 } });
    const d = value(await jobGet(t.pool, { jobId: r.job.id }));
    expect(d.job.result).toEqual({ z: 1 });
    expect(d.attempts).toMatchObject([{ id: r.attemptId, attemptNo: 1, status: 'succeeded' }]);
    expect(d.events.map((e) => e.kind)).toEqual(['enqueued', 'claimed', 'started', 'completed']);
    expect(d.steps).toMatchObject([{ step: 's1', status: 'started' }]);
    expect(d.staleReports).toEqual([]);
    expect(await jobGet(t.pool, { jobId: '33333333-3333-3333-3333-333333333333' })).toMatchObject({ outcome: 'not_found' });
  });

  it("reads each list as its table's rows read through pg, field for field (times to the millisecond, ids as numbers)", async () => {
    // Two ended attempts (a retry, then a success), a live one is not there; steps done and
    // reserved; a late report of the first attempt; a requeue's and a cancel's events.
    const c1 = await runningOne({ maxAttempts: 5 });
    value(await stepReserve(t.pool, { attemptId: c1.attemptId, agentId: 'a1', step: 'a' }));
    value(await stepRecord(t.pool, { attemptId: c1.attemptId, agentId: 'a1', step: 'a', output: { n: [1, 'x'] } }));
    value(await attemptFail(t.pool, { attemptId: c1.attemptId, agentId: 'a1', error: { message: 'm', code: 3 }, retryable: true, backoff: { baseMs: 1, maxMs: 1 }, now: at(1) }));
    const c2 = await claimOne('a1', at(10));
    value(await attemptStart(t.pool, { attemptId: c2.attemptId, agentId: 'a1', leaseTtlMs: TTL, now: at(10) }));
    value(await stepReserve(t.pool, { attemptId: c2.attemptId, agentId: 'a1', step: 'b' }));
    expect((await attemptHeartbeat(t.pool, { items: [{ attemptId: c1.attemptId, agentId: 'a1' }], leaseTtlMs: TTL })).outcome).toBe('ok');
    value(await attemptFail(t.pool, { attemptId: c2.attemptId, agentId: 'a1', error: { message: 'final' }, retryable: false, now: at(20) }));
    value(await jobRequeue(t.pool, { jobId: c1.job.id, now: at(30) }));
    value(await jobCancel(t.pool, { jobId: c1.job.id }));
    await attemptStart(t.pool, { attemptId: c1.attemptId, agentId: 'a1', leaseTtlMs: TTL }); // late: a stale report
    const d = value(await jobGet(t.pool, { jobId: c1.job.id }));
    const rows = async (sql: string) => (await t.pool.query(sql, [c1.job.id])).rows.map((r) => camelRow(r));
    const attempts = await rows('SELECT * FROM attempt_log WHERE job_id = $1 ORDER BY attempt_no');
    const steps = await rows('SELECT * FROM steps WHERE job_id = $1 ORDER BY started_at');
    const stale = await rows('SELECT * FROM stale_reports WHERE job_id = $1 ORDER BY id DESC');
    const events = await rows('SELECT * FROM job_events WHERE job_id = $1 ORDER BY id');
    expect(attempts).toHaveLength(2);
    expect(steps).toHaveLength(2);
    expect(stale.length).toBeGreaterThanOrEqual(1);
    expect(events.map((e) => (e as { kind: string }).kind)).toEqual(['requeued', 'canceled']);
    expect(d.attempts).toEqual(attempts);
    expect(d.steps).toEqual(steps);
    expect(d.staleReports).toEqual(stale);
    for (const e of events as Array<{ kind: string; at: Date; data: unknown }>) {
      expect(d.events.filter((x) => x.kind === e.kind).map((x) => [x.at, x.data])).toEqual([[e.at, e.data]]);
    }
    expect(d.job).toEqual(toJob((await t.pool.query(`SELECT ${jobColumns('j')} FROM jobs j WHERE j.id = $1`, [c1.job.id])).rows[0]));
  });
});

describe("a job's error", () => {
  it('is what job_error (migration 0005) says, in every state: the statements write that expression in (jobErrorSql)', async () => {
    const claim = async (queue: string, now: Date) => {
      const [c] = value(await jobClaim(t.pool, { agentId: 'a1', queues: [queue], limit: 1, claimTtlMs: TTL, now }));
      value(await attemptStart(t.pool, { attemptId: c!.attemptId, agentId: 'a1', leaseTtlMs: TTL, now }));
      return c!;
    };
    const failOnce = async (queue: string, n: number, retryable = true) => {
      const c = await claim(queue, at(n * 10));
      const error = { message: `${queue} ${n}` };
      return value(await attemptFail(t.pool, { attemptId: c.attemptId, agentId: 'a1', error, retryable, backoff: { baseMs: 1, maxMs: 1 }, now: at(n * 10) }));
    };
    const ids: Record<string, string> = {};
    for (const queue of ['fresh', 'queued', 'running', 'failed', 'dead', 'succeeded', 'canceled']) {
      ids[queue] = (await enqueueOne({ queue, maxAttempts: queue === 'dead' ? 2 : 5 })).id;
    }
    await failOnce('queued', 1);
    await failOnce('running', 1);
    await claim('running', at(20));
    await failOnce('failed', 1);
    await failOnce('failed', 2, false);
    await failOnce('dead', 1);
    await failOnce('dead', 2);
    await failOnce('succeeded', 1);
    value(await attemptComplete(t.pool, { attemptId: (await claim('succeeded', at(20))).attemptId, agentId: 'a1', result: { ok: true } }));
    await failOnce('canceled', 1);
    value(await jobCancel(t.pool, { jobId: ids.canceled! }));

    const rows = (
      await t.pool.query(`SELECT j.queue, j.status::text, ${jobErrorSql('j')} AS inline, job_error(j.id, j.status) AS fn FROM jobs j ORDER BY j.queue`)
    ).rows;
    expect(rows.map((r) => [r.queue, r.status, r.fn?.message ?? null])).toEqual([
      ['canceled', 'canceled', 'canceled 1'],
      ['dead', 'dead', 'dead 2'],
      ['failed', 'failed', 'failed 2'],
      ['fresh', 'queued', null],
      ['queued', 'queued', 'queued 1'],
      ['running', 'running', 'running 1'],
      ['succeeded', 'succeeded', null],
    ]);
    for (const r of rows) {
      expect(r.inline).toEqual(r.fn);
      expect(value(await jobGet(t.pool, { jobId: ids[r.queue]! })).job.error ?? null).toEqual(r.fn);
    }
  });
});

describe("a cancel's or a requeue's event", () => {
  it('holds what job_event_delta (migration 0002) says, for any two rows: the statements write that expression in (jobEventDeltaSql)', async () => {
    // Rows as jsonb: keys the delta leaves out among others, values of any JSON (no NUL, which
    // jsonb cannot hold), some equal between the two rows.
    const json = fc.jsonValue({ maxDepth: 2 }).filter((v) => !JSON.stringify(v).includes('\\u0000'));
    const key = fc.constantFrom('status', 'run_at', 'attempt_no', 'updated_at', 'heartbeat_at', 'progress', 'result', 'x');
    const row = fc.dictionary(key, json, { maxKeys: 8 });
    const sql = `SELECT ${jobEventDeltaSql('$1::jsonb', '$2::jsonb')} AS inline, job_event_delta($1::jsonb, $2::jsonb) AS fn`;
    await fc.assert(
      fc.asyncProperty(row, row, fc.boolean(), async (a, b, share) => {
        const old = share ? { ...b, ...Object.fromEntries(Object.entries(a).slice(0, 3)) } : b;
        const [r] = (await t.pool.query(sql, [JSON.stringify(a), JSON.stringify(old)])).rows;
        expect(r.inline).toEqual(r.fn);
      }),
      { numRuns: 300 },
    );
    // Not vacuous: a changed key is kept, an equal one and the left-out ones are not.
    const [r] = (
      await t.pool.query(sql, [JSON.stringify({ status: 'canceled', run_at: 1, updated_at: 2, progress: 3 }), JSON.stringify({ status: 'queued', run_at: 1 })])
    ).rows;
    expect(r.inline).toEqual({ status: 'canceled' });
  });
});

describe('the SQL functions the statements call', () => {
  it('are none that PostgreSQL plans on every call: every verb of a life, and the reads, call only functions it inlines', async () => {
    // track_functions counts the calls of a function that is not inlined: a SQL function whose
    // body reads FROM (job_error, job_event_delta), whose body PostgreSQL 17 plans again in every
    // statement that calls it (docs/performance.md, "Statements planned on every call").
    const c = await t.pool.connect();
    try {
      await c.query(`SET track_functions = 'all'`);
      const counted = async () => {
        await c.query('SELECT pg_stat_force_next_flush()');
        return (await c.query(`SELECT funcname, calls::int FROM pg_stat_user_functions ORDER BY funcname`)).rows;
      };
      const before = await counted();
      await c.query(`SELECT job_error(gen_random_uuid(), 'queued')`); // the count works: a call made
      expect(await counted()).not.toEqual(before);
      const base = await counted();
      const claimIn = async (queue: string, now: Date) => {
        const [x] = value(await jobClaim(c, { agentId: 'a1', queues: [queue], limit: 1, claimTtlMs: TTL, now }));
        value(await attemptStart(c, { attemptId: x!.attemptId, agentId: 'a1', leaseTtlMs: TTL, now }));
        return x!;
      };
      const job = value(await jobEnqueue(c, { queue: 'fn', payload: {}, notifyUrl: 'http://127.0.0.1:9/hook', idempotencyKey: 'fn-1', now: T0 }));
      let x = await claimIn('fn', T0);
      value(await attemptHeartbeat(c, { items: [{ attemptId: x.attemptId, agentId: 'a1', progress: { p: 1 } }], leaseTtlMs: TTL, now: T0 }));
      value(await stepReserve(c, { attemptId: x.attemptId, agentId: 'a1', step: 's' }));
      value(await stepRecord(c, { attemptId: x.attemptId, agentId: 'a1', step: 's', output: {} }));
      value(await attemptFail(c, { attemptId: x.attemptId, agentId: 'a1', error: { message: 'x' }, retryable: true, backoff: { baseMs: 1, maxMs: 1 }, now: T0 }));
      x = await claimIn('fn', at(10)); // a second attempt's claim reads the first one's error
      value(await attemptComplete(c, { attemptId: x.attemptId, agentId: 'a1', result: { ok: 1 } }));
      value(await attemptComplete(c, { attemptId: x.attemptId, agentId: 'a1', result: { ok: 1 } })); // a repeat
      expect((await attemptComplete(c, { attemptId: x.attemptId, agentId: 'a1', result: { ok: 2 } })).outcome).toBe('conflict');
      const other = value(await jobEnqueue(c, { queue: 'fn', payload: {}, now: at(20) }));
      value(await jobCancel(c, { jobId: other.id })); // queued: its event's delta
      value(await jobRequeue(c, { jobId: other.id, now: at(20) })); // and the requeue's
      expect((await jobRequeue(c, { jobId: job.id })).outcome).toBe('conflict'); // not requeueable: its row read
      x = await claimIn('fn', at(20));
      value(await jobRescueExpired(c, { limit: 10, now: at(20 + TTL + 1) }));
      value(await jobGet(c, { jobId: job.id }));
      expect(await counted()).toEqual(base);
    } finally {
      await c.query('RESET track_functions');
      c.release();
    }
  });
});

describe('a job that succeeds after a failed attempt', () => {
  it('carries no error of the earlier attempt (which keeps it), in GetJob and in its job.succeeded event, whose times are in milliseconds', async () => {
    const c1 = await runningOne({ notifyUrl: 'http://127.0.0.1:9/hook', maxAttempts: 3 });
    value(await attemptFail(t.pool, { attemptId: c1.attemptId, agentId: 'a1', error: { message: 'flaky' }, retryable: true, backoff: { baseMs: 1, maxMs: 1 }, now: T0 }));
    const c2 = await claimOne('a1', at(10));
    value(await attemptStart(t.pool, { attemptId: c2.attemptId, agentId: 'a1', leaseTtlMs: TTL, now: at(10) }));
    // Database time: microseconds in the row.
    value(await attemptComplete(t.pool, { attemptId: c2.attemptId, agentId: 'a1', result: { ok: true } }));

    const d = value(await jobGet(t.pool, { jobId: c1.job.id }));
    expect(d.job).toMatchObject({ status: 'succeeded', error: null, result: { ok: true } });
    expect(d.attempts.map((a) => [a.attemptNo, a.status, a.error])).toEqual([
      [1, 'failed', { message: 'flaky' }],
      [2, 'succeeded', null],
    ]);
    const events = (await t.pool.query(`SELECT type::text, body FROM webhook_events WHERE job_id = $1`, [c1.job.id])).rows;
    expect(events.map((e) => e.type)).toEqual(['job.succeeded']);
    const body = JSON.parse(events[0].body);
    expect(body).toMatchObject({ type: 'job.succeeded', error: null, result: { ok: true }, job: { error: null, result: { ok: true } } });
    // As the API shows times: milliseconds (none when zero), UTC.
    for (const ts of [body.createdAt, body.job.createdAt, body.job.finishedAt, body.attempt.claimedAt, body.attempt.startedAt, body.attempt.endedAt]) {
      expect(ts).toMatch(/^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3})?Z$/);
    }
    expect(new Date(body.job.finishedAt).getTime()).toBe(d.job.finishedAt!.getTime());
    expect(body.job.createdAt).toBe('2020-01-01T00:00:00Z');
  });
});
