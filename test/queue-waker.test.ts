/**
 * Dispatchers are woken after a gateway enqueue has committed, not by a NOTIFY inside it (which
 * makes PostgreSQL commit notifying transactions one at a time): the enqueue statement sends no
 * NOTIFY when asked not to, the gateway's `QueueWaker` sends one per queue and batch afterwards,
 * every coordinator still hears it, and a failure to send loses nothing but the wake-up.
 */
import pg from 'pg';
import pino from 'pino';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { QueueWaker } from '../server/core/queue-waker.js';
import { jobEnqueue, JOBS_CHANNEL } from '../server/store/index.js';
import { ADMIN_KEY, untilEvents, useCoordinator } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { rpc } from './helpers/http.js';

const t = useTestDb();
const lh = useCoordinator(t);
const silent = pino({ level: 'silent' });

// What another coordinator's listener hears on the jobs channel.
let listener: pg.Client;
const heard: string[] = [];
beforeAll(async () => {
  listener = new pg.Client({ connectionString: t.url });
  await listener.connect();
  listener.on('notification', (n) => heard.push(n.payload ?? ''));
  await listener.query(`LISTEN ${JOBS_CHANNEL}`);
});
afterAll(() => listener.end());

/** What was heard until now: a marker NOTIFY sent last is delivered after everything sent before it. */
async function heardSoFar(): Promise<string[]> {
  const marker = `marker-${Math.random()}`;
  await t.pool.query(`SELECT pg_notify($1, $2)`, [JOBS_CHANNEL, marker]);
  await untilEvents([[listener, 'notification']], 'the marker', () => heard.includes(marker));
  const got = heard.splice(0);
  return got.filter((q) => q !== marker);
}

it('the enqueue statement NOTIFYs a due queued job by default, and not with notify: false', async () => {
  // Each of the four statements (with or without the key's and header's CTEs, with or without the
  // NOTIFY): the quiet ones send nothing, and a job due later wakes nobody either way.
  await heardSoFar();
  const extras = [{}, { idempotencyKey: 'w-key' }, { notifyUrl: 'https://example.com/n', notifyHeader: { name: 'x-secret', value: 's' } }];
  for (const [k, extra] of extras.entries()) {
    expect((await jobEnqueue(t.pool, { queue: `w-default-${k}`, payload: {}, ...extra })).outcome).toBe('ok');
    expect((await jobEnqueue(t.pool, { queue: `w-silent-${k}`, payload: {}, notify: false, ...extra, ...('idempotencyKey' in extra ? { idempotencyKey: 'w-key-2' } : {}) })).outcome).toBe('ok');
  }
  expect((await jobEnqueue(t.pool, { queue: 'w-later', payload: {}, runAt: new Date(Date.now() + 3_600_000) })).outcome).toBe('ok');
  expect(await heardSoFar()).toEqual(['w-default-0', 'w-default-1', 'w-default-2']);
});

it('a gateway enqueue wakes every coordinator after its commit, and the enqueue statement itself sends nothing', async () => {
  await heardSoFar();
  const rounds: unknown[] = [];
  const onRound = (r: unknown) => rounds.push(r);
  lh.c.dispatcher.on('dispatch:round', onRound);
  try {
    const enqueue = (queue: string, extra: object = {}) =>
      rpc(lh.httpUrl, 'leasehold.v1.JobService/EnqueueJob', { queue, payload: {}, ...extra }, ADMIN_KEY);
    const answers = await Promise.all([...Array.from({ length: 20 }, () => enqueue('w-gateway')), enqueue('w-other')]);
    expect(answers.map((a) => a.status)).toEqual(answers.map(() => 200));
    expect(answers.every((a) => a.json.job.status === 'JOB_STATUS_QUEUED')).toBe(true);
    // The gateway answers before its waker has sent: what is heard is complete once it is idle.
    await lh.c.waker.idle();
    const got = await heardSoFar();
    expect(new Set(got)).toEqual(new Set(['w-gateway', 'w-other']));
    // One at most per enqueue: the enqueue statement itself stays silent (notify: false), or each
    // of these 21 would be heard from it as well as from the waker. How many the waker folds into
    // one NOTIFY depends on how the enqueues' commits interleave with its sends (a busy machine
    // may send each alone); the folding itself is the next test's, made deterministic there.
    expect(got.length).toBeLessThanOrEqual(answers.length);
    // A job due later wakes nobody now.
    const later = await enqueue('w-later', { runAt: new Date(Date.now() + 3_600_000).toISOString() });
    expect(later.json.job.status).toBe('JOB_STATUS_QUEUED');
    await lh.c.waker.idle();
    expect(await heardSoFar()).toEqual([]);
  } finally {
    lh.c.dispatcher.off('dispatch:round', onRound);
  }
});

it('QueueWaker wakes its own dispatcher at once, sends one NOTIFY per queue per batch, and flushes on stop', async () => {
  await heardSoFar();
  const local: string[] = [];
  const waker = new QueueWaker(t.pool, silent, (q) => local.push(q));
  for (let i = 0; i < 50; i++) waker.wake(i % 2 ? 'w-odd' : 'w-even');
  expect(local).toHaveLength(50); // in process, before any round trip
  await waker.stop();
  expect((await heardSoFar()).sort()).toEqual(['w-even', 'w-odd']);
  // Stopped: still wakes its own dispatcher, sends nothing.
  waker.wake('w-even');
  expect(local).toHaveLength(51);
  expect(await heardSoFar()).toEqual([]);
});

it('QueueWaker logs a failed NOTIFY and goes on (the jobs are committed; the poll finds them)', async () => {
  const broken = new pg.Pool({ connectionString: t.url.replace(/\/[^/]*$/, '/no_such_database'), max: 1 });
  const warnings: string[] = [];
  const log = pino({ level: 'warn' }, { write: (line: string) => void warnings.push(JSON.parse(line).msg) });
  const waker = new QueueWaker(broken, log, () => undefined);
  waker.wake('w-broken');
  await waker.stop();
  await broken.end();
  expect(warnings).toEqual(['could not notify the other coordinators of new jobs; their poll will find them']);
});
