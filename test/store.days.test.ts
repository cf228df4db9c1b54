/**
 * The table of days (server/store/days.ts, migration 0019): every end (a success, a failure for
 * good, a dead letter, a cancel) moves its job's row to the partition of its UTC day, a requeue
 * moves it back; readers see it where they saw it; idempotency keys stay unique across
 * partitions; the purger drops a day whole, with everything that hangs off its jobs, the counts
 * corrected, a job whose notification is undelivered kept; a drop cut short is finished later.
 */
import pg from 'pg';
import { afterEach, beforeAll, beforeEach, describe, expect, it, vi } from 'vitest';
import {
  attemptComplete,
  attemptFail,
  attemptStart,
  jobClaim,
  jobCancel,
  jobCounts,
  jobEnqueue,
  jobGet,
  jobRequeue,
  jobRescueExpired,
  jobSearch,
  type Claimed,
} from '../server/store/index.js';
import { daysDrop, daysEnsure, dayTable } from '../server/store/days.js';
import { REFERENCE_TABLES } from '../server/store/references.js';
import { endedCountsReconcile } from '../server/store/counts.js';
import type { Outcome } from '../server/domain/outcomes.js';
import { useTestDb } from './helpers/db.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();
const TTL = 30_000;

function value<T>(o: Outcome<T>): T {
  if (o.outcome !== 'ok' && o.outcome !== 'duplicate') throw new Error(`expected a value, got ${JSON.stringify(o)}`);
  return o.value;
}

const today = async () => (await t.pool.query<{ d: string }>(`SELECT to_char((now() AT TIME ZONE 'UTC')::date, 'YYYY-MM-DD') AS d`)).rows[0]!.d;
const partitions = async () =>
  (
    await t.pool.query<{ name: string; bound: string }>(
      `SELECT c.relname AS name, pg_get_expr(c.relpartbound, c.oid) AS bound FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
       WHERE i.inhparent = 'jobs'::regclass ORDER BY 1`,
    )
  ).rows;
const whereIs = async (id: string) => (await t.pool.query<{ p: string }>(`SELECT tableoid::regclass::text AS p FROM jobs WHERE id = $1`, [id])).rows.map((r) => r.p);

async function claimOne(queue = 'd'): Promise<Claimed> {
  const c = value(await jobClaim(t.pool, { agentId: 'a1', queues: [queue], limit: 1, claimTtlMs: TTL }));
  expect(c).toHaveLength(1);
  return c[0]!;
}

/** A job that failed once and then succeeded: an attempts row, and its success on its row. */
async function succeeded(extra: Partial<Parameters<typeof jobEnqueue>[1]> = {}) {
  const job = value(await jobEnqueue(t.pool, { queue: 'd', payload: { n: Math.random() }, ...extra }));
  const c1 = await claimOne();
  value(await attemptStart(t.pool, { attemptId: c1.attemptId, agentId: 'a1', leaseTtlMs: TTL }));
  value(await attemptFail(t.pool, { attemptId: c1.attemptId, agentId: 'a1', error: { message: 'once' }, retryable: true, backoff: { baseMs: 0, maxMs: 0 } }));
  const c2 = await claimOne();
  value(await attemptStart(t.pool, { attemptId: c2.attemptId, agentId: 'a1', leaseTtlMs: TTL }));
  value(await attemptComplete(t.pool, { attemptId: c2.attemptId, agentId: 'a1', result: { ok: true } }));
  return { job, first: c1, second: c2 };
}

beforeEach(async () => {
  await t.truncate();
  await daysEnsure(t.pool); // a test before may have dropped some
});
afterEach(() => checkInvariants(t.pool));

describe('the table of days', () => {
  it('jobs is partitioned by done_day: jobs_live for NULL, today and the next two days made ahead', async () => {
    const d = await today();
    const parts = await partitions();
    expect(parts.find((p) => p.name === 'jobs_live')?.bound).toBe('FOR VALUES IN (NULL)');
    expect(parts.map((p) => p.name)).toContain(dayTable(d));
    expect(parts.filter((p) => p.name !== 'jobs_live')).toHaveLength(3);
    // Made again: nothing to do.
    expect(await daysEnsure(t.pool)).toEqual([]);
  });

  it("a success moves its job to its day's partition; reads find it there with its whole history", async () => {
    const { job, first, second } = await succeeded();
    expect(await whereIs(job.id)).toEqual([dayTable(await today())]);
    const d = value(await jobGet(t.pool, { jobId: job.id }));
    expect(d.job).toMatchObject({ id: job.id, status: 'succeeded', result: { ok: true }, attemptNo: 2 });
    expect(d.attempts.map((a) => [a.id, a.status])).toEqual([
      [first.attemptId, 'failed'],
      [second.attemptId, 'succeeded'],
    ]);
    expect(d.events.map((e) => e.kind)).toEqual(['enqueued', 'claimed', 'started', 'retry_scheduled', 'claimed', 'started', 'completed']);
    const page = value(await jobSearch(t.pool, { queue: 'd', statuses: ['succeeded'] }));
    expect(page.jobs.map((j) => j.id)).toEqual([job.id]);
    // A repeated report of the success is answered from the moved row.
    expect(await attemptComplete(t.pool, { attemptId: second.attemptId, agentId: 'a1', result: { ok: true } })).toMatchObject({ outcome: 'duplicate' });
    expect(await attemptComplete(t.pool, { attemptId: second.attemptId, agentId: 'a1', result: { ok: false } })).toMatchObject({ outcome: 'conflict' });
  });

  it('every end moves its job to its day; a retry stays live; repeats answer from the moved row; a requeue moves it back', async () => {
    const day = dayTable(await today());
    const live = async () => (await t.pool.query<{ id: string; status: string }>(`SELECT id, status FROM jobs_live ORDER BY created_at`)).rows;
    // A failure for good, with a key.
    const failed = value(await jobEnqueue(t.pool, { queue: 'd', payload: { n: 1 }, idempotencyKey: 'k-failed' }));
    const c1 = await claimOne();
    value(await attemptStart(t.pool, { attemptId: c1.attemptId, agentId: 'a1', leaseTtlMs: TTL }));
    const retry = { attemptId: c1.attemptId, agentId: 'a1', error: { message: 'again' }, retryable: true, backoff: { baseMs: 0, maxMs: 0 } };
    // A retry first: the job stays in jobs_live, queued.
    expect(value(await attemptFail(t.pool, retry)).status).toBe('queued');
    expect(await whereIs(failed.id)).toEqual(['jobs_live']);
    const c2 = await claimOne();
    const bad = { attemptId: c2.attemptId, agentId: 'a1', error: { message: 'bad input' }, retryable: false };
    expect(value(await attemptFail(t.pool, bad)).status).toBe('failed');
    expect(await whereIs(failed.id)).toEqual([day]);
    // Repeats of the report, answered from the moved row; the key stays taken.
    expect(await attemptFail(t.pool, bad)).toMatchObject({ outcome: 'duplicate', value: { id: failed.id, status: 'failed' } });
    expect(await attemptFail(t.pool, { ...bad, error: { message: 'other' } })).toMatchObject({ outcome: 'conflict' });
    expect(await attemptComplete(t.pool, { attemptId: c2.attemptId, agentId: 'a1', result: {} })).toMatchObject({ outcome: 'conflict' });
    expect(await jobEnqueue(t.pool, { queue: 'd', payload: { n: 1 }, idempotencyKey: 'k-failed' })).toMatchObject({ outcome: 'duplicate', value: { id: failed.id } });

    // A dead letter by the failure at the cap, and one by the reaper.
    const capped = value(await jobEnqueue(t.pool, { queue: 'd', payload: { n: 2 }, maxAttempts: 1 }));
    const c3 = await claimOne();
    value(await attemptStart(t.pool, { attemptId: c3.attemptId, agentId: 'a1', leaseTtlMs: TTL }));
    expect(value(await attemptFail(t.pool, { attemptId: c3.attemptId, agentId: 'a1', error: { message: 'x' }, retryable: true })).status).toBe('dead');
    const reaped = value(await jobEnqueue(t.pool, { queue: 'd', payload: { n: 3 }, maxAttempts: 1 }));
    const c4 = await claimOne();
    value(await attemptStart(t.pool, { attemptId: c4.attemptId, agentId: 'a1', leaseTtlMs: TTL }));
    const rescued = value(await jobRescueExpired(t.pool, { limit: 10, now: new Date(Date.now() + 2 * TTL) }));
    expect(rescued.map((r) => [r.jobId, r.reason, r.status])).toEqual([[reaped.id, 'lease_expired', 'dead']]);
    // A reaped claim goes back to the queue, live.
    const expiring = value(await jobEnqueue(t.pool, { queue: 'd', payload: { n: 4 } }));
    await claimOne();
    expect(value(await jobRescueExpired(t.pool, { limit: 10, now: new Date(Date.now() + 2 * TTL) })).map((r) => r.status)).toEqual(['queued']);
    // Cancels of a queued job and of a held one.
    const canceledHeld = value(await jobEnqueue(t.pool, { queue: 'e', payload: { n: 5 } }));
    const c6 = await claimOne('e');
    const cancel = value(await jobCancel(t.pool, { jobId: canceledHeld.id }));
    expect(cancel.canceledAttempt).toEqual({ attemptId: c6.attemptId, agentId: 'a1' });
    expect(await jobCancel(t.pool, { jobId: expiring.id })).toMatchObject({ outcome: 'ok' });
    expect(await jobCancel(t.pool, { jobId: expiring.id })).toMatchObject({ outcome: 'duplicate' });
    // A late heartbeat and start of the canceled attempt: stale.
    expect(await attemptStart(t.pool, { attemptId: c6.attemptId, agentId: 'a1', leaseTtlMs: TTL })).toMatchObject({ outcome: 'stale' });

    for (const id of [failed.id, capped.id, reaped.id, canceledHeld.id, expiring.id]) expect(await whereIs(id), id).toEqual([day]);
    expect(await live()).toEqual([]);
    // Reads find them where they are, with their history.
    const got = value(await jobGet(t.pool, { jobId: failed.id }));
    expect(got.job).toMatchObject({ status: 'failed', error: { message: 'bad input' }, attemptNo: 2 });
    expect(got.attempts.map((a) => a.status)).toEqual(['failed', 'failed']);
    expect(value(await jobGet(t.pool, { jobId: reaped.id })).job).toMatchObject({ status: 'dead', error: { reason: 'lease_expired' } });
    expect(value(await jobSearch(t.pool, { statuses: ['dead'] })).jobs.map((j) => j.id).sort()).toEqual([capped.id, reaped.id].sort());
    expect(value(await jobSearch(t.pool, { queue: 'd', statuses: ['canceled'] })).jobs.map((j) => j.id)).toEqual([expiring.id]);
    expect(value(await jobSearch(t.pool, { statuses: ['failed'] })).jobs.map((j) => j.id)).toEqual([failed.id]);

    // A requeue moves the job back to jobs_live, queued; its event says what changed, not where it is kept.
    const back = value(await jobRequeue(t.pool, { jobId: failed.id }));
    expect(back).toMatchObject({ id: failed.id, status: 'queued', attemptsStarted: 0, finishedAt: null });
    expect(await whereIs(failed.id)).toEqual(['jobs_live']);
    const events = value(await jobGet(t.pool, { jobId: failed.id })).events;
    const requeued = events.find((e) => e.kind === 'requeued')!;
    expect(Object.keys(requeued.data as object).sort()).toEqual(['attempts_started', 'finished_at', 'run_at', 'status']);
    expect(await jobRequeue(t.pool, { jobId: failed.id })).toMatchObject({ outcome: 'conflict' });
    const canceledEvent = value(await jobGet(t.pool, { jobId: expiring.id })).events.find((e) => e.kind === 'canceled')!;
    expect(Object.keys(canceledEvent.data as object)).not.toContain('done_day');
    // Claimed again, it ends again in its day.
    const c7 = await claimOne();
    expect(c7.job.id).toBe(failed.id);
    expect(c7.attemptNo).toBe(3);
    value(await attemptComplete(t.pool, { attemptId: c7.attemptId, agentId: 'a1', result: { ok: 3 } }));
    expect(await whereIs(failed.id)).toEqual([day]);
    expect(await live()).toEqual([]);
  });

  it('an idempotency key stays taken when its job has moved: duplicate, or conflict for another payload', async () => {
    const { job } = await succeeded({ idempotencyKey: 'k-moved', payload: { same: 1 } });
    expect(await whereIs(job.id)).toEqual([dayTable(await today())]);
    expect(await jobEnqueue(t.pool, { queue: 'd', payload: { same: 1 }, idempotencyKey: 'k-moved' })).toMatchObject({ outcome: 'duplicate', value: { id: job.id } });
    expect(await jobEnqueue(t.pool, { queue: 'd', payload: { same: 2 }, idempotencyKey: 'k-moved' })).toMatchObject({ outcome: 'conflict' });
    expect(Number((await t.pool.query(`SELECT count(*) FROM jobs WHERE idempotency_key = 'k-moved'`)).rows[0].count)).toBe(1);
  });

  it('100 rounds of an enqueue racing the completion that moves the job of its key: one job per key', async () => {
    for (let round = 0; round < 100; round++) {
      const key = `race-${round}`;
      const job = value(await jobEnqueue(t.pool, { queue: 'd', payload: { round }, idempotencyKey: key }));
      const c = await claimOne();
      value(await attemptStart(t.pool, { attemptId: c.attemptId, agentId: 'a1', leaseTtlMs: TTL }));
      const complete = () => attemptComplete(t.pool, { attemptId: c.attemptId, agentId: 'a1', result: {} });
      const enqueue = () => jobEnqueue(t.pool, { queue: 'd', payload: { round }, idempotencyKey: key });
      const [done, again] = round % 2 ? await Promise.all([complete(), enqueue()]) : (await Promise.all([enqueue(), complete()])).reverse();
      expect(done!.outcome).toBe('ok');
      expect(again).toMatchObject({ outcome: 'duplicate', value: { id: job.id } });
    }
    const keys = (await t.pool.query(`SELECT idempotency_key, count(*)::int AS n FROM jobs GROUP BY 1 HAVING count(*) > 1`)).rows;
    expect(keys).toEqual([]);
  });

  it("the purger's drop takes a day whole, with its jobs' attempts, steps and keys, and corrects the counts", async () => {
    const { job } = await succeeded({ idempotencyKey: 'k-drop' });
    const kept = await succeeded({ notifyUrl: 'https://example.com/hook' });
    // Its notification still to deliver: the drop must keep it.
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM webhook_deliveries WHERE status = 'pending'`)).rows[0].n).toBe(1);
    const before = (await jobCounts(t.pool)).find((c) => c.queue === 'd' && c.status === 'succeeded')?.count;
    expect(Number(before)).toBe(2);
    // Today ends before a cutoff a day from now, by the database's clock (a retention of minus a day).
    const dropped = await daysDrop(t.pool, { olderThanMs: -86_400_000 });
    expect(dropped).toMatchObject({ days: [await today()], jobs: 1, kept: 1, swept: 0, unswept: false });
    expect(await whereIs(job.id)).toEqual([]);
    expect(await whereIs(kept.job.id)).toEqual(['jobs_live']);
    expect((await t.pool.query(`SELECT done_day FROM jobs WHERE id = $1`, [kept.job.id])).rows[0].done_day).toBeNull();
    for (const table of ['attempts', 'job_events', 'steps', 'stale_reports', 'webhook_events']) {
      expect((await t.pool.query(`SELECT count(*)::int AS n FROM ${table} WHERE job_id = $1`, [job.id])).rows[0].n, table).toBe(0);
    }
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM job_keys WHERE key = 'k-drop'`)).rows[0].n).toBe(0);
    expect(Number((await jobCounts(t.pool)).find((c) => c.queue === 'd' && c.status === 'succeeded')?.count)).toBe(1);
    expect((await partitions()).map((p) => p.name)).not.toContain(dayTable(await today()));
    // The key is free again.
    expect(await jobEnqueue(t.pool, { queue: 'other', payload: {}, idempotencyKey: 'k-drop' })).toMatchObject({ outcome: 'ok' });
  });

  /**
   * Jobs of today, made to look as if they had ended three days ago (before the per-minute counts'
   * window), so that the drop takes the path of a day past the retention: gone at once, swept after.
   */
  async function endedDaysAgo(n: number) {
    const jobs = [];
    for (let i = 0; i < n; i++) jobs.push(await succeeded({ idempotencyKey: `k-old-${i}` }));
    const ids = jobs.map((j) => j.job.id);
    await t.pool.query(`UPDATE jobs SET finished_at = finished_at - interval '3 days' WHERE id = ANY($1::uuid[])`, [ids]);
    await t.pool.query(`UPDATE attempts SET ended_at = ended_at - interval '3 days' WHERE job_id = ANY($1::uuid[])`, [ids]);
    await t.pool.query(`INSERT INTO steps (job_id, step, status, attempt_id, output, started_at, finished_at)
                        SELECT id, 'fetch', 'done', final_attempt_id, '{}', finished_at, finished_at FROM jobs WHERE id = ANY($1::uuid[])`, [ids]);
    await endedCountsReconcile(t.pool);
    return ids;
  }
  const rowsOf = async (ids: string[]) => {
    const out: Record<string, number> = {};
    for (const table of ['attempts', 'steps']) {
      out[table] = (await t.pool.query(`SELECT count(*)::int AS n FROM ${table} WHERE job_id = ANY($1::uuid[])`, [ids])).rows[0].n;
    }
    out.job_keys = (await t.pool.query(`SELECT count(*)::int AS n FROM job_keys WHERE job_id = ANY($1::uuid[])`, [ids])).rows[0].n;
    return out;
  };

  /** VACUUMs each table of `REFERENCE_TABLES` had since `before` (a `vacuumCounts()`), in its order. */
  const vacuumCounts = async () =>
    new Map((await t.pool.query(`SELECT relname, vacuum_count::int AS n FROM pg_stat_user_tables`)).rows.map((r) => [r.relname as string, r.n as number]));
  let before = new Map<string, number>();
  beforeAll(async () => {
    // The drop's VACUUM (SKIP_LOCKED) passes over a table an autovacuum holds: these tests count
    // its VACUUMs table by table, so autovacuum is kept off them.
    for (const table of REFERENCE_TABLES) await t.pool.query(`ALTER TABLE ${table} SET (autovacuum_enabled = false)`);
  });
  beforeEach(async () => {
    before = await vacuumCounts();
  });
  const vacuumsSince = async (then: Map<string, number>) => {
    const now = await vacuumCounts();
    return REFERENCE_TABLES.map((table) => [table, (now.get(table) ?? 0) - (then.get(table) ?? 0)]);
  };

  it('a day past the per-minute window leaves the reads and the counts at once, and is swept after in batches', async () => {
    const ids = await endedDaysAgo(5);
    expect(await rowsOf(ids)).toEqual({ attempts: 5, steps: 5, job_keys: 5 });
    const dropped = await daysDrop(t.pool, { olderThanMs: -86_400_000, batch: 2 });
    expect(dropped).toMatchObject({ days: [await today()], jobs: 5, kept: 0, swept: 5, unswept: false });
    expect(await rowsOf(ids)).toEqual({ attempts: 0, steps: 0, job_keys: 0 });
    expect((await t.pool.query(`SELECT relname FROM pg_class WHERE relname ~ '^jobs_(done|gone)_'`)).rows.map((r) => r.relname)).not.toContain(
      `jobs_gone_${(await today()).replaceAll('-', '')}`,
    );
    expect(Number((await jobCounts(t.pool)).find((c) => c.queue === 'd' && c.status === 'succeeded')?.count ?? 0)).toBe(0);
    // And the tables it deleted from were vacuumed: their dead rows would stay for a day.
    expect(dropped.vacuumMs).toBeGreaterThan(0);
    expect(await vacuumsSince(before)).toEqual(REFERENCE_TABLES.map((table) => [table, 1]));
  });

  it("a held sweep does no work until its hold resolves, and its pause is reckoned from the batch alone", async () => {
    const ids = await endedDaysAgo(5);
    let calls = 0;
    let atGate!: () => void;
    const reached = new Promise<void>((r) => (atGate = r));
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    let releasedAt = 0;
    let nextCall: number | undefined;
    // Held before its second batch of two jobs; with share 0.5 the pause after a batch equals
    // the batch, so counting the second hold's second would pause the third batch by as much.
    const hold = async () => {
      calls++;
      if (calls === 2) {
        atGate();
        await gate;
        releasedAt = performance.now();
      } else if (calls === 3) nextCall = performance.now();
    };
    const dropping = daysDrop(t.pool, { olderThanMs: -86_400_000, batch: 2, share: 0.5, hold });
    await reached;
    expect(await rowsOf(ids)).toEqual({ attempts: 3, steps: 3, job_keys: 3 });
    await new Promise((r) => setTimeout(r, 1000));
    expect(await rowsOf(ids)).toEqual({ attempts: 3, steps: 3, job_keys: 3 });
    release();
    const dropped = await dropping;
    expect(dropped).toMatchObject({ swept: 5, unswept: false });
    expect(await rowsOf(ids)).toEqual({ attempts: 0, steps: 0, job_keys: 0 });
    expect(nextCall! - releasedAt).toBeLessThan(1000);
  });

  it('a drop stopped while it vacuums cancels the VACUUM and leaves its connection and lock clean', async () => {
    await endedDaysAgo(2);
    const stop = new AbortController();
    // Stopped just as the second table's VACUUM is sent (the cancel goes from another connection).
    const query = pg.Client.prototype.query;
    let vacuums = 0;
    const spy = vi.spyOn(pg.Client.prototype, 'query').mockImplementation(function (this: pg.Client, ...args: unknown[]) {
      if (typeof args[0] === 'string' && args[0].startsWith('VACUUM') && ++vacuums === 2) stop.abort();
      return (query as (...a: unknown[]) => unknown).apply(this, args);
    } as typeof query);
    try {
      const dropped = await daysDrop(t.pool, { olderThanMs: -86_400_000, signal: stop.signal });
      expect(dropped).toMatchObject({ jobs: 2, swept: 2, unswept: false });
    } finally {
      spy.mockRestore();
    }
    expect(vacuums).toBe(2);
    expect((await vacuumsSince(before)).filter(([, n]) => n).map(([table]) => table)).toContain(REFERENCE_TABLES[0]);
    expect((await vacuumsSince(before)).slice(2).every(([, n]) => n === 0)).toBe(true);
    // No advisory lock left held in this database (other files' run beside it), and the connection
    // runs statements as before.
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM pg_locks WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`)).rows[0].n).toBe(0);
    for (let i = 0; i < 5; i++) expect((await t.pool.query('SELECT 1 AS one')).rows).toEqual([{ one: 1 }]);
  });

  it('a sweep stopped before it ends leaves the day gone, its rows for the next run, every invariant holding', async () => {
    const ids = await endedDaysAgo(3);
    const stop = new AbortController();
    stop.abort();
    const dropped = await daysDrop(t.pool, { olderThanMs: -86_400_000, signal: stop.signal });
    expect(dropped).toMatchObject({ jobs: 3, swept: 0, unswept: true, vacuumMs: 0 });
    expect((await vacuumsSince(before)).every(([, n]) => n === 0)).toBe(true);
    // Gone from every read and from the counts; the rows wait in jobs_gone_* for the sweep.
    expect(await whereIs(ids[0]!)).toEqual([]);
    expect(value(await jobSearch(t.pool, { queue: 'd' })).jobs).toEqual([]);
    expect(Number((await jobCounts(t.pool)).find((c) => c.queue === 'd' && c.status === 'succeeded')?.count ?? 0)).toBe(0);
    expect(await rowsOf(ids)).toEqual({ attempts: 3, steps: 3, job_keys: 3 });
    await checkInvariants(t.pool);
    // A key of a gone job is free already.
    expect(await jobEnqueue(t.pool, { queue: 'other', payload: {}, idempotencyKey: 'k-old-0' })).toMatchObject({ outcome: 'ok' });
    // The day's partition can be made again meanwhile (its indexes' names are free).
    expect(await daysEnsure(t.pool)).toEqual([await today()]);
    const next = await daysDrop(t.pool, { olderThanMs: 30 * 86_400_000 });
    expect(next).toMatchObject({ days: [], jobs: 0, swept: 3, unswept: false });
    expect(await rowsOf(ids)).toEqual({ attempts: 0, steps: 0, job_keys: 0 });
    // The key taken again meanwhile stays with its new job.
    expect((await t.pool.query(`SELECT job_id FROM job_keys WHERE key = 'k-old-0'`)).rows.map((r) => r.job_id)).toEqual([
      (await t.pool.query(`SELECT id FROM jobs WHERE idempotency_key = 'k-old-0'`)).rows[0].id,
    ]);
  });

  it("a completion whose day has no partition makes it and succeeds (the coordinator was stopped for days)", async () => {
    await t.pool.query(`ALTER TABLE jobs DETACH PARTITION "${dayTable(await today())}"`);
    await t.pool.query(`DROP TABLE "${dayTable(await today())}"`);
    const { job } = await succeeded();
    expect(await whereIs(job.id)).toEqual([dayTable(await today())]);
  });

  it('a drop cut short after its detach is finished by the next run', async () => {
    const { job } = await succeeded();
    const table = dayTable(await today());
    await t.pool.query(`ALTER TABLE jobs DETACH PARTITION "${table}"`);
    // The job is gone from jobs, its earlier attempt still there until the drop finishes.
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM attempts WHERE job_id = $1`, [job.id])).rows[0].n).toBe(1);
    const dropped = await daysDrop(t.pool, { olderThanMs: 30 * 86_400_000 });
    expect(dropped.jobs).toBe(1);
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM attempts WHERE job_id = $1`, [job.id])).rows[0].n).toBe(0);
    expect((await t.pool.query(`SELECT to_regclass($1) AS r`, [table])).rows[0].r).toBeNull();
    expect(Number((await jobCounts(t.pool)).find((c) => c.queue === 'd' && c.status === 'succeeded')?.count ?? 0)).toBe(0);
    // And today's partition is made again for the next success.
    await daysEnsure(t.pool);
    expect((await partitions()).map((p) => p.name)).toContain(table);
  });
});
