/**
 * Notifications survive the coordinator being SIGKILLed between the commit of a job's end and
 * the delivery of its notification: a real `leasehold serve` process on this file's database,
 * driven over its HTTP gateway, sends to a receiver that takes every request and answers none;
 * the process is killed; a new one delivers everything, and the receiver — verifying each
 * signature and deduping by event id — has seen every event exactly once.
 */
import { afterAll, afterEach, beforeAll, expect, it } from 'vitest';
import { keyCreate, signingSecretGet, subscriptionCreate } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { waitFor } from './helpers/coordinator.js';
import { rpc, startReceiver, type Receiver } from './helpers/http.js';
import { checkInvariants } from './helpers/invariants.js';
import { killAll, serve, type Proc } from './helpers/serve.js';

const t = useTestDb();
let rx: Receiver;
const ADMIN = 'process-admin-key';

beforeAll(async () => {
  rx = await startReceiver();
});
afterEach(() => killAll());
afterAll(async () => {
  await rx.close();
});

async function start(): Promise<{ p: Proc; url: string }> {
  const p = serve(['serve', '--grpc-addr', '127.0.0.1:0', '--http-addr', '127.0.0.1:0'], {
    DATABASE_URL: t.url,
    LEASEHOLD_ADMIN_KEY: ADMIN,
    LEASEHOLD_WEBHOOK_INTERVAL: '100ms',
    LEASEHOLD_WEBHOOK_TIMEOUT: '2s',
    LEASEHOLD_WEBHOOK_BACKOFF: '100ms',
  });
  const http = await p.waitFor(/HTTP listening/);
  await p.waitFor(/leasehold coordinator ready/);
  return { p, url: `http://${String(http.addr)}` };
}

it('delivers every notification exactly once after dedupe when the coordinator is SIGKILLed between commit and delivery', async () => {
  for (const path of ['/notify', '/hook']) rx.policy(path, 'hang');
  const first = await start();
  rx.secret('/notify', await signingSecretGet(t.pool));
  const sub = await subscriptionCreate(t.pool, { queue: 'kill', url: `${rx.url}/hook` });
  if (sub.outcome !== 'ok') throw new Error(JSON.stringify(sub));
  rx.secret('/hook', sub.value.secret);
  const k = await keyCreate(t.pool, { name: 'kill-agent', scopes: ['agent'] });
  if (k.outcome !== 'ok') throw new Error(JSON.stringify(k));
  const agentKey = k.value.key;

  const call = async (url: string, path: string, body: unknown, key: string) => {
    const a = await rpc(url, path, body, key);
    if (a.status !== 200) throw new Error(`${path}: ${a.status} ${JSON.stringify(a.json)}`);
    return a.json;
  };
  const enqueue = async (n: number, extra: Record<string, unknown> = {}) =>
    (await call(first.url, 'leasehold.v1.JobService/EnqueueJob', { queue: 'kill', payload: { n }, notifyUrl: `${rx.url}/notify`, ...extra }, ADMIN)).job
      .id as string;
  const claimStart = async () => {
    const c = (await call(first.url, 'leasehold.v1.AttemptService/ClaimJobs', { queues: ['kill'] }, agentKey)).jobs[0];
    await call(first.url, 'leasehold.v1.AttemptService/StartAttempt', { attemptId: c.attemptId }, agentKey);
    return c.attemptId as string;
  };

  const ids = { succeeded: await enqueue(1), failed: await enqueue(2), canceled: await enqueue(3), dead: await enqueue(4, { maxAttempts: 1 }) };
  await call(first.url, 'leasehold.v1.AttemptService/CompleteAttempt', { attemptId: await claimStart(), result: { n: 1 } }, agentKey);
  await call(first.url, 'leasehold.v1.AttemptService/FailAttempt', { attemptId: await claimStart(), error: { message: 'bad input' }, retryable: false }, agentKey);
  await call(first.url, 'leasehold.v1.JobService/CancelJob', { jobId: ids.canceled }, ADMIN);
  // Three events are in flight: the receiver has them and answers nothing.
  await rx.waitFor('the first three events sent to both targets', (r) => new Set(r.received.map((x) => `${x.path} ${x.eventId}`)).size >= 6);
  // The fourth commits, and the coordinator dies right after answering.
  await call(first.url, 'leasehold.v1.AttemptService/FailAttempt', { attemptId: await claimStart(), error: { message: 'flaky' }, retryable: true }, agentKey);
  first.p.child.kill('SIGKILL');
  expect((await first.p.exited).signal).toBe('SIGKILL');

  const events = (await t.pool.query(`SELECT job_id, type::text FROM webhook_events`)).rows;
  expect(Object.fromEntries(events.map((e) => [e.type.slice(4), e.job_id]))).toEqual(ids);
  const before = (await t.pool.query(`SELECT status::text, count(*)::int AS n FROM webhook_deliveries GROUP BY 1`)).rows;
  expect(before.find((r) => r.status === 'delivered')).toBeUndefined();
  expect(before.reduce((n, r) => n + r.n, 0)).toBe(8);

  for (const path of ['/notify', '/hook']) rx.policy(path, 'ok');
  const second = await start();
  await waitFor(
    'every delivery delivered after the restart',
    async () => (await t.pool.query(`SELECT count(*)::int AS n FROM webhook_deliveries WHERE status = 'delivered'`)).rows[0].n === 8,
    30_000,
  );
  expect(rx.received.every((r) => r.valid)).toBe(true);
  expect(rx.events.size).toBe(4);
  expect(Object.fromEntries([...rx.events.values()].map((e) => [e.type.slice(4), e.job.id]))).toEqual(ids);
  for (const e of rx.events.keys()) {
    expect(new Set(rx.received.filter((r) => r.eventId === e).map((r) => r.path))).toEqual(new Set(['/notify', '/hook']));
  }
  // Sends whose answer never came were sent again: the receiver saw duplicates and dropped them.
  expect(rx.received.length).toBeGreaterThan(8);

  // The dead-lettering raised its alert in one of the two processes.
  const alerts = [...first.p.lines, ...second.p.lines].filter((l) => l.alert === 'job.dead' && l.jobId === ids.dead);
  expect(alerts.length).toBeGreaterThanOrEqual(1);

  second.p.child.kill('SIGINT');
  expect(await second.p.exited).toEqual({ code: 0, signal: null });
  await checkInvariants(t.pool);
});
