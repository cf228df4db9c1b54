/**
 * The reaper service: counts per run, the dead-letter alert, scheduling that never overlaps,
 * and start/stop that are safe to repeat. Waits on its events, never on sleeps.
 */
import { once } from 'node:events';
import pino from 'pino';
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import { Reaper, type ReaperRun } from '../server/core/reaper.js';
import { useTestDb } from './helpers/db.js';
import { makeJob } from './helpers/factories.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();
const log = pino({ level: 'silent' });
const past = () => new Date(Date.now() - 1000);
let reaper: Reaper | undefined;

beforeEach(() => t.truncate());
afterEach(async () => {
  await reaper?.stop();
  reaper = undefined;
});

describe('Reaper', () => {
  it('runOnce rescues every expired attempt in batches and returns the counts', async () => {
    for (let i = 0; i < 5; i++) await makeJob(t.pool, { status: 'claimed', leaseExpiresAt: past() });
    for (let i = 0; i < 4; i++) await makeJob(t.pool, { status: 'running', leaseExpiresAt: past(), maxAttempts: 3 });
    await makeJob(t.pool, { status: 'running', leaseExpiresAt: past(), maxAttempts: 1, attemptsStarted: 1 });
    await makeJob(t.pool, { status: 'running' }); // lease still live
    reaper = new Reaper(t.pool, log, { batchSize: 3 });
    const dead: string[] = [];
    reaper.on('job:dead', (r) => dead.push(r.jobId));
    const run = await reaper.runOnce();
    expect({ c: run.claimExpired, l: run.leaseExpired, t: run.timedOut, d: run.dead }).toEqual({ c: 5, l: 5, t: 0, d: 1 });
    expect(dead).toHaveLength(1);
    expect((await reaper.runOnce()).rescued).toEqual([]);
    await checkInvariants(t.pool, { rescuedAt: new Date() });
  });

  it('joins a run in progress instead of overlapping it', async () => {
    await makeJob(t.pool, { status: 'claimed', leaseExpiresAt: past() });
    reaper = new Reaper(t.pool, log);
    const [a, b] = await Promise.all([reaper.runOnce(), reaper.runOnce()]);
    expect(a).toBe(b);
    expect(a.claimExpired).toBe(1);
  });

  it('runs on its own schedule once started; start and stop are safe twice', async () => {
    reaper = new Reaper(t.pool, log, { intervalMs: 20 });
    reaper.start();
    reaper.start();
    await makeJob(t.pool, { status: 'running', leaseExpiresAt: past() });
    let run: ReaperRun;
    do [run] = (await once(reaper, 'reaper:run')) as [ReaperRun];
    while (run.leaseExpired === 0);
    expect(run.leaseExpired).toBe(1);
    expect(reaper.scheduled).toBe(true);
    await reaper.stop();
    await reaper.stop();
    expect(reaper.scheduled).toBe(false);
  });

  it('refuses a bad configuration at construction', () => {
    expect(() => new Reaper(t.pool, log, { intervalMs: 0 })).toThrow(/intervalMs/);
    expect(() => new Reaper(t.pool, log, { batchSize: -1 })).toThrow(/batchSize/);
  });
});
