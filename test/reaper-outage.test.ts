/**
 * The reaper after a database outage (docs/reliability.md, "After a database outage"): while
 * writes are refused no lease can be renewed and no result stored, so when they come back every
 * running job's lease has passed and its agent is on its way back with the result. The reaper's
 * runs fail meanwhile; from the first that works it leaves expired leases alone for its grace
 * (one lease TTL in the coordinator), and takes back start deadlines and timeouts at once.
 *
 * The refusal is PostgreSQL's own: meanwhile the reaper's statements go to read-only sessions,
 * as after a failover to a standby (a full disk or a database down fail them otherwise; the
 * reaper counts any failed run). Time is pinned with `runOnce(now)` and the store's `now`;
 * nothing sleeps.
 */
import pg from 'pg';
import pino from 'pino';
import { afterAll, afterEach, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { Reaper, type ReaperRun } from '../server/core/reaper.js';
import { attemptComplete, attemptHeartbeat, jobGet } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { quietPool } from './helpers/quiet-pool.js';
import { makeJob } from './helpers/factories.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();
const log = pino({ level: 'silent' });
const GRACE_MS = 30_000;
/** The reaper's pool: while writes are refused, its statements go to connections that refuse them. */
let flaky: pg.Pool;
let refusing = false;
const pools: pg.Pool[] = [];
let reaper: Reaper | undefined;

beforeAll(() => {
  // Two real pools, one of read-only sessions, behind one pool the reaper holds (a Proxy: still
  // `instanceof pg.Pool`, as the store's pool paths check).
  const rw = t.newPool(2);
  const ro = quietPool({ connectionString: t.url, max: 2, options: '-c default_transaction_read_only=on' });
  pools.push(ro);
  flaky = new Proxy(rw, {
    get: (_, key) => {
      const p = refusing ? ro : rw;
      const v: unknown = Reflect.get(p, key);
      return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(p) : v;
    },
  });
});
afterAll(() => Promise.all(pools.map((p) => p.end())));
beforeEach(async () => {
  await t.truncate();
  writes(true);
});
afterEach(async () => {
  await reaper?.stop();
  reaper = undefined;
});

/** Writes refused (as after a read-only failover) or taken again, for the reaper's statements. */
function writes(on: boolean): void {
  refusing = !on;
}

const counts = (r: ReaperRun) => ({ claim: r.claimExpired, lease: r.leaseExpired, timedOut: r.timedOut, held: r.leaseExpiriesHeld });
const status = async (jobId: string) => {
  const o = await jobGet(t.pool, { jobId });
  if (o.outcome !== 'ok') throw new Error(o.outcome);
  return { status: o.value.job.status, attemptNo: o.value.job.attemptNo };
};

describe('Reaper after its runs failed', () => {
  it('leaves expired leases to their agents for the grace: a result delivered then ends its job on attempt 1; the rest is taken back after', async () => {
    const t0 = Date.now();
    const at = (s: number) => new Date(t0 + s * 1000);
    // Leases to t0+5 s: they pass while writes are refused (t0+2 s … t0+40 s).
    const done = await makeJob(t.pool, { status: 'running', leaseExpiresAt: at(5) }); // finished; its result waits in the agent's outbox
    const silent = await makeJob(t.pool, { status: 'running', leaseExpiresAt: at(5) }); // its agent never comes back
    const renewed = await makeJob(t.pool, { status: 'running', leaseExpiresAt: at(5) }); // still running; its agent reconnects and heartbeats
    const claim = await makeJob(t.pool, { status: 'claimed', leaseExpiresAt: at(5) }); // never started: not an attempt
    const overdue = await makeJob(t.pool, { status: 'running', leaseExpiresAt: at(5), executionDeadline: at(5) }); // ran into its own deadline
    reaper = new Reaper(flaky, log, { outageGraceMs: GRACE_MS });

    expect(counts(await reaper.runOnce(at(1)))).toEqual({ claim: 0, lease: 0, timedOut: 0, held: false });
    writes(false);
    for (const s of [2, 3, 10, 40]) await expect(reaper.runOnce(at(s)), `t0+${s} s`).rejects.toThrow(/in a read-only transaction/);
    writes(true);

    // The first run that works, and the next ones within the grace: claims and timeouts at once,
    // the expired leases left alone.
    expect(counts(await reaper.runOnce(at(41)))).toEqual({ claim: 1, lease: 0, timedOut: 1, held: true });
    expect(counts(await reaper.runOnce(at(42)))).toEqual({ claim: 0, lease: 0, timedOut: 0, held: true });
    expect(await status(claim.id)).toEqual({ status: 'queued', attemptNo: 1 });
    expect(await status(overdue.id)).toEqual({ status: 'queued', attemptNo: 1 });

    // The agents come back: the outbox's completion is taken, the running job's lease renewed.
    const c = await attemptComplete(t.pool, { jobId: done.id, attemptId: done.currentAttemptId!, agentId: done.agentId!, result: { ok: true }, now: at(43) });
    expect(c.outcome).toBe('ok');
    const h = await attemptHeartbeat(t.pool, { items: [{ attemptId: renewed.currentAttemptId!, agentId: renewed.agentId! }], leaseTtlMs: GRACE_MS, now: at(43) });
    expect(h.outcome === 'ok' && h.value.renewed.map((r) => r.attemptId)).toEqual([renewed.currentAttemptId]);
    expect(counts(await reaper.runOnce(at(70.9)))).toEqual({ claim: 0, lease: 0, timedOut: 0, held: true });
    expect(await status(silent.id)).toEqual({ status: 'running', attemptNo: 1 });

    // The grace over (t0+41 s + 30 s): what nobody reported is taken back as ever.
    const after = await reaper.runOnce(at(71));
    expect(counts(after)).toEqual({ claim: 0, lease: 1, timedOut: 0, held: false });
    expect(after.rescued.map((r) => r.jobId)).toEqual([silent.id]);
    expect(await status(done.id), 'its handler ran once').toEqual({ status: 'succeeded', attemptNo: 1 });
    expect(await status(silent.id)).toEqual({ status: 'queued', attemptNo: 1 });
    expect(await status(renewed.id), 'renewed within the grace').toEqual({ status: 'running', attemptNo: 1 });
    await checkInvariants(t.pool, { rescuedAt: at(71) });
  });

  it('holds even a run that fails again within the grace: the grace counts from the last run that works after failures', async () => {
    const t0 = Date.now();
    const at = (s: number) => new Date(t0 + s * 1000);
    const job = await makeJob(t.pool, { status: 'running', leaseExpiresAt: at(5) });
    reaper = new Reaper(flaky, log, { outageGraceMs: GRACE_MS });

    writes(false);
    await expect(reaper.runOnce(at(10))).rejects.toThrow(/read-only transaction/);
    writes(true);
    expect(counts(await reaper.runOnce(at(11)))).toEqual({ claim: 0, lease: 0, timedOut: 0, held: true });
    // A second outage within the grace: the grace starts over when runs work again.
    writes(false);
    await expect(reaper.runOnce(at(20))).rejects.toThrow(/read-only transaction/);
    writes(true);
    expect(counts(await reaper.runOnce(at(50)))).toEqual({ claim: 0, lease: 0, timedOut: 0, held: true });
    expect(counts(await reaper.runOnce(at(79.9)))).toEqual({ claim: 0, lease: 0, timedOut: 0, held: true });
    const after = await reaper.runOnce(at(80));
    expect(after.rescued.map((r) => [r.jobId, r.reason])).toEqual([[job.id, 'lease_expired']]);
  });

  it('rescues expired leases at once when its runs never failed, or with no grace configured', async () => {
    const t0 = Date.now();
    const at = (s: number) => new Date(t0 + s * 1000);
    await makeJob(t.pool, { status: 'running', leaseExpiresAt: at(5) });
    reaper = new Reaper(flaky, log, { outageGraceMs: GRACE_MS });
    expect(counts(await reaper.runOnce(at(6)))).toEqual({ claim: 0, lease: 1, timedOut: 0, held: false });

    await reaper.stop();
    await makeJob(t.pool, { status: 'running', leaseExpiresAt: at(5) });
    reaper = new Reaper(flaky, log, { outageGraceMs: 0 });
    writes(false);
    await expect(reaper.runOnce(at(10))).rejects.toThrow(/read-only transaction/);
    writes(true);
    expect(counts(await reaper.runOnce(at(11)))).toEqual({ claim: 0, lease: 1, timedOut: 0, held: false });
  });

  it('takes back, in the grace, the claims behind a full batch of held leases', async () => {
    const t0 = Date.now();
    const at = (s: number) => new Date(t0 + s * 1000);
    // Leases that passed first, so that a scan ordered by lease meets them before the claims.
    for (let i = 0; i < 3; i++) await makeJob(t.pool, { status: 'running', leaseExpiresAt: at(1) });
    for (let i = 0; i < 2; i++) await makeJob(t.pool, { status: 'claimed', leaseExpiresAt: at(5) });
    reaper = new Reaper(flaky, log, { outageGraceMs: GRACE_MS, batchSize: 2 });
    writes(false);
    await expect(reaper.runOnce(at(10))).rejects.toThrow(/read-only transaction/);
    writes(true);
    expect(counts(await reaper.runOnce(at(11)))).toEqual({ claim: 2, lease: 0, timedOut: 0, held: true });
  });
});
