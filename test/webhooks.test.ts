/**
 * Notifications end to end below the listeners: terminal transitions write the outbox in their
 * own statement; a `WebhookDeliverer` driven by `runOnce()` signs and POSTs to a real receiver
 * that verifies the signature, retries with backoff, gives up at the cap (an operator can
 * retry), takes back claims of a deliverer that died, and raises an alert for every
 * dead-lettering.
 */
import type http from 'node:http';
import v8 from 'node:v8';
import vm from 'node:vm';
import pino from 'pino';
import { afterAll, afterEach, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { CONFLICT_FINAL_ATTEMPT, WEBHOOK_HEADERS, WebhookDeliverer, type DeadLetterAlert } from '../server/core/webhook-deliverer.js';
import {
  attemptComplete,
  attemptFail,
  attemptStart,
  deliveryClaim,
  deliveryList,
  deliveryRetry,
  jobCancel,
  jobClaim,
  jobEnqueue,
  jobGet,
  jobRescueExpired,
  signingSecretGet,
  subscriptionCreate,
  subscriptionRemove,
  type EnqueueParams,
} from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { startReceiver, verifySignature, type Receiver } from './helpers/http.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();
const log = pino({ level: process.env.LEASEHOLD_TEST_LOG ?? 'silent' });
let rx: Receiver;
let notifySecret: string;
const deliverers: WebhookDeliverer[] = [];

function deliverer(config: ConstructorParameters<typeof WebhookDeliverer>[2] = {}) {
  const d = new WebhookDeliverer(t.pool, log, { timeoutMs: 2000, claimMarginMs: 0, backoff: { baseMs: 0, maxMs: 0 }, ...config });
  deliverers.push(d);
  return d;
}

beforeAll(async () => {
  rx = await startReceiver();
});
afterAll(async () => {
  await rx.close();
});
beforeEach(async () => {
  await t.truncate();
  await t.pool.query('TRUNCATE subscriptions CASCADE');
  notifySecret = await signingSecretGet(t.pool);
  rx.received.length = 0;
  rx.events.clear();
});
afterEach(async () => {
  for (const d of deliverers.splice(0)) await d.stop();
  await checkInvariants(t.pool);
});

const value = <T>(o: { outcome: string; value?: T }): T => {
  if (o.outcome !== 'ok' && o.outcome !== 'duplicate') throw new Error(JSON.stringify(o));
  return o.value as T;
};
async function running(queue: string, extra: Partial<EnqueueParams> = {}) {
  const job = value(await jobEnqueue(t.pool, { queue, payload: { q: queue }, ...extra }));
  const [c] = value(await jobClaim(t.pool, { agentId: 'a1', queues: [queue], limit: 1, claimTtlMs: 30_000 }));
  value(await attemptStart(t.pool, { attemptId: c!.attemptId, agentId: 'a1', leaseTtlMs: 30_000 }));
  return { job, attemptId: c!.attemptId };
}
async function subscribe(queue: string, path: string, events?: string[]) {
  const s = value(await subscriptionCreate(t.pool, { queue, url: `${rx.url}${path}`, ...(events ? { events } : {}) }));
  rx.secret(path, s.secret);
  return s;
}

describe('the outbox', () => {
  it('writes one event per terminal transition, delivered signed to notify_url and to subscribers, each exactly once', async () => {
    rx.secret('/notify', notifySecret);
    await subscribe('work', '/sub');
    const notifyUrl = `${rx.url}/notify`;
    const ok = await running('work', { notifyUrl });
    value(await attemptComplete(t.pool, { attemptId: ok.attemptId, agentId: 'a1', result: { pages: 3 } }));
    const bad = await running('work', { notifyUrl });
    value(await attemptFail(t.pool, { attemptId: bad.attemptId, agentId: 'a1', error: { message: 'corrupt file' }, retryable: false }));
    const dying = await running('work', { notifyUrl, maxAttempts: 1 });
    value(await attemptFail(t.pool, { attemptId: dying.attemptId, agentId: 'a1', error: { message: 'flaky' }, retryable: true }));
    const retried = await running('work', { notifyUrl, maxAttempts: 2 });
    value(await attemptFail(t.pool, { attemptId: retried.attemptId, agentId: 'a1', error: { message: 'flaky' }, retryable: true }));
    const queued = value(await jobEnqueue(t.pool, { queue: 'work', payload: {}, notifyUrl }));
    value(await jobCancel(t.pool, { jobId: queued.id }));
    const quiet = await running('elsewhere');
    value(await attemptComplete(t.pool, { attemptId: quiet.attemptId, agentId: 'a1', result: {} }));

    const events = (await t.pool.query(`SELECT job_id, type::text FROM webhook_events ORDER BY created_at`)).rows;
    expect(events.map((e) => [e.job_id, e.type])).toEqual([
      [ok.job.id, 'job.succeeded'],
      [bad.job.id, 'job.failed'],
      [dying.job.id, 'job.dead'],
      [queued.id, 'job.canceled'],
    ]);
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM webhook_deliveries`)).rows[0].n).toBe(8);

    const run = await deliverer().runOnce();
    expect(run).toMatchObject({ sent: 8, delivered: 8, retried: 0, failed: 0, alerts: 1 });
    expect(rx.received.every((r) => r.valid)).toBe(true);
    expect(rx.received.length).toBe(8);
    expect(rx.events.size).toBe(4);

    const succeeded = [...rx.events.values()].find((e) => e.type === 'job.succeeded')!;
    expect(succeeded).toMatchObject({
      type: 'job.succeeded',
      job: { id: ok.job.id, queue: 'work', status: 'JOB_STATUS_SUCCEEDED', payload: { q: 'work' }, attemptNo: 1, notifyUrl },
      attempt: { id: ok.attemptId, attemptNo: 1, agentId: 'a1', status: 'ATTEMPT_STATUS_SUCCEEDED' },
      result: { pages: 3 },
      error: null,
    });
    expect(succeeded.createdAt).toMatch(/^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3})?Z$/); // as the API shows times
    const dead = [...rx.events.values()].find((e) => e.type === 'job.dead')!;
    expect(dead).toMatchObject({ job: { status: 'JOB_STATUS_DEAD', error: { message: 'flaky' } }, attempt: { status: 'ATTEMPT_STATUS_FAILED' }, result: null });
    const canceled = [...rx.events.values()].find((e) => e.type === 'job.canceled')!;
    expect(canceled).toMatchObject({ job: { id: queued.id, status: 'JOB_STATUS_CANCELED' }, attempt: null });

    const headers = rx.received[0]!.headers;
    for (const h of Object.values(WEBHOOK_HEADERS)) expect(headers[h], h).toBeDefined();
    expect(headers['content-type']).toBe('application/json');
    expect(headers[WEBHOOK_HEADERS.signature]).toMatch(/^sha256=[0-9a-f]{64}$/);
    expect(Math.abs(Number(headers[WEBHOOK_HEADERS.timestamp]) - Date.now() / 1000)).toBeLessThan(60);
    // The same event reached both targets under one id.
    const ids = rx.received.filter((r) => r.path === '/sub').map((r) => r.eventId).sort();
    expect(ids).toEqual(rx.received.filter((r) => r.path === '/notify').map((r) => r.eventId).sort());
    expect((await deliverer().runOnce()).sent).toBe(0);
  });

  it('the receiver rejects a tampered body, a wrong secret and a replayed signature of another timestamp', async () => {
    await subscribe('tamper', '/sub');
    const j = await running('tamper');
    value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: { amount: 10 } }));
    await deliverer().runOnce();
    const got = rx.received[0]!;
    expect(got.valid).toBe(true);
    const secret = (await t.pool.query(`SELECT secret FROM subscriptions`)).rows[0].secret as string;
    const ts = got.headers[WEBHOOK_HEADERS.timestamp] as string;
    const sig = got.headers[WEBHOOK_HEADERS.signature] as string;
    expect(verifySignature(secret, ts, got.body, sig)).toBe(true);
    expect(verifySignature(secret, ts, got.body.replace('"amount": 10', '"amount": 99'), sig)).toBe(false);
    expect(verifySignature('whsec_wrong', ts, got.body, sig)).toBe(false);
    expect(verifySignature(secret, String(Number(ts) + 1), got.body, sig)).toBe(false);

    // Over HTTP: the same request with one byte of the body changed is answered 401.
    const res = await fetch(`${rx.url}/sub`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', [WEBHOOK_HEADERS.timestamp]: ts, [WEBHOOK_HEADERS.signature]: sig, [WEBHOOK_HEADERS.eventId]: got.eventId },
      body: got.body.replace('"amount": 10', '"amount": 11'),
    });
    expect(res.status).toBe(401);
    expect(rx.events.size).toBe(1);
  });
});

describe('one delivery per URL', () => {
  it("sends an event once to a URL that is the job's notify_url and subscribed, or subscribed to the queue and to '*', keeping the notify_url's (its header)", async () => {
    // docs/n8n.md subscribes …/webhook/leasehold-events to the queue and enqueues with it as notify_url.
    await subscribe('dup', '/events');
    await subscribe('*', '/events');
    await subscribe('dup', '/all');
    await subscribe('*', '/all');
    const header = { name: 'X-Resume-Token', value: 'dup-token' };
    const a = await running('dup', { notifyUrl: `${rx.url}/events`, notifyHeader: header });
    value(await attemptComplete(t.pool, { attemptId: a.attemptId, agentId: 'a1', result: {} }));
    const rows = (await t.pool.query(`SELECT url, subscription_id FROM webhook_deliveries ORDER BY url`)).rows;
    expect(rows.map((r) => [r.url.slice(rx.url.length), r.subscription_id === null])).toEqual([
      ['/all', false],
      ['/events', true], // the notify_url's row
    ]);
    expect(await deliverer().runOnce()).toMatchObject({ sent: 2, delivered: 2 });
    expect(rx.received.map((r) => [r.path, r.valid, r.headers['x-resume-token']]).sort()).toEqual([
      ['/all', true, undefined],
      ['/events', true, header.value],
    ]);
  });
  it('keeps a delivery made once for two subscriptions of a URL when the one it is kept under is removed; drops it with the last', async () => {
    const ours = await subscribe('handover', '/handover');
    const all = await subscribe('*', '/handover');
    const other = await subscribe('elsewhere', '/handover'); // the URL, but another queue: never wanted it
    const a = await running('handover');
    value(await attemptComplete(t.pool, { attemptId: a.attemptId, agentId: 'a1', result: {} }));
    const owner = async () => (await t.pool.query(`SELECT subscription_id FROM webhook_deliveries WHERE url = $1`, [`${rx.url}/handover`])).rows.map((r) => r.subscription_id as string);
    const first = await owner();
    expect(first).toHaveLength(1);
    const [kept, theOther] = first[0] === ours.id ? [ours, all] : [all, ours];
    value(await subscriptionRemove(t.pool, { id: kept.id }));
    expect(await owner(), 'handed over to the other subscription that wanted the event').toEqual([theOther.id]);
    value(await subscriptionRemove(t.pool, { id: theOther.id }));
    expect(await owner(), 'not to a subscription of another queue: dropped').toEqual([]);
    value(await subscriptionRemove(t.pool, { id: other.id }));
  });
});

describe('retries, the cap, and the operator', () => {
  it('retries a failing receiver with backoff, marks the delivery failed at the cap, and delivers it after `retry`', async () => {
    await subscribe('flaky', '/down');
    rx.policy('/down', 'fail');
    const j = await running('flaky');
    value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: {} }));
    const d = deliverer({ maxAttempts: 3, backoff: { baseMs: 200, maxMs: 200 } });

    expect(await d.runOnce()).toMatchObject({ sent: 1, retried: 1 });
    const [pending] = value(await deliveryList(t.pool, { jobId: j.job.id }));
    expect(pending).toMatchObject({ status: 'pending', attempts: 1, lastStatus: 500, lastError: 'HTTP 500 Internal Server Error: try again' });
    // Backoff: 200 ms × [0.5, 1) from now, so nothing is due at once.
    expect(pending!.nextAttemptAt.getTime()).toBeGreaterThan(Date.now() + 50);
    expect((await d.runOnce()).sent).toBe(0);

    for (let i = 2; i <= 3; i++) {
      await t.pool.query(`UPDATE webhook_deliveries SET next_attempt_at = now()`);
      expect((await d.runOnce()).sent).toBe(1);
    }
    const [failed] = value(await deliveryList(t.pool, { status: 'failed' }));
    expect(failed).toMatchObject({ jobId: j.job.id, attempts: 3, status: 'failed' });
    await t.pool.query(`UPDATE webhook_deliveries SET next_attempt_at = now()`);
    expect((await d.runOnce()).sent).toBe(0);
    expect(rx.received.length).toBe(3);
    expect(new Set(rx.received.map((r) => r.headers[WEBHOOK_HEADERS.attempt]))).toEqual(new Set(['1', '2', '3']));

    rx.policy('/down', 'ok');
    expect(value(await deliveryRetry(t.pool, { id: failed!.id })).ids).toEqual([failed!.id]);
    expect(await d.runOnce()).toMatchObject({ sent: 1, delivered: 1 });
    expect(rx.events.size).toBe(1);
    expect((await deliveryRetry(t.pool, { id: failed!.id })).outcome).toBe('not_found');
  });

  it("keeps the start of a receiver's error body in last_error: 200 bytes at most, no character cut, no control characters, the rest never read", async () => {
    await subscribe('said', '/said');
    // 19 bytes, then é (2 bytes each): byte 200 is the first half of the 91st. The answer never ends.
    const prefix = 'Bad\r\n\tgateway\u0000:\u202e ';
    expect(Buffer.byteLength(prefix)).toBe(19);
    const text = prefix + 'é'.repeat(200);
    rx.policy('/said', (res) => {
      res.writeHead(502, { 'content-type': 'text/plain; charset=utf-8' });
      res.write(text);
    });
    const j = await running('said');
    value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: {} }));
    const started = Date.now();
    expect(await deliverer({ timeoutMs: 20_000 }).runOnce()).toMatchObject({ sent: 1, retried: 1 });
    expect(Date.now() - started).toBeLessThan(10_000); // it did not wait for the end (nor the timeout)
    const [row] = value(await deliveryList(t.pool, {}));
    expect(row!.lastError).toBe(`HTTP 502 Bad Gateway: Bad gateway : ${'é'.repeat(90)}`);
  });

  it('gives up on a receiver that never answers within the timeout, and drops deliveries of a removed subscription', async () => {
    const s = await subscribe('slow', '/slow');
    rx.policy('/slow', 'hang');
    const j = await running('slow');
    value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: {} }));
    const run = await deliverer({ timeoutMs: 300 }).runOnce();
    expect(run).toMatchObject({ sent: 1, retried: 1 });
    expect(value(await deliveryList(t.pool, {}))[0]!.lastError).toBe('no answer within 300 ms');
    value(await subscriptionRemove(t.pool, { id: s.id }));
    expect(value(await deliveryList(t.pool, {}))).toEqual([]);
  });

  it('gives up in time when a garbage collection comes while the receiver keeps silent (a collection)', async () => {
    // Node 20 holds an `AbortSignal.timeout` signal weakly: combined with `AbortSignal.any`, a
    // collection took the timeout away and the send waited for ever (CI, stop 49).
    v8.setFlagsFromString('--expose-gc');
    const gc = vm.runInNewContext('gc') as () => void;
    await subscribe('collected', '/collected');
    rx.policy('/collected', 'hang');
    const j = await running('collected');
    value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: {} }));
    const started = Date.now();
    // A retry not due at once: the run ends with the send (else it sends again every interval).
    const run = deliverer({ timeoutMs: 1000, backoff: { baseMs: 60_000, maxMs: 60_000 } }).runOnce();
    await rx.waitFor('the send', (r) => r.received.length === 1);
    gc();
    gc();
    let bound: NodeJS.Timeout | undefined;
    const hung = new Promise<never>((_, reject) => {
      bound = setTimeout(() => reject(new Error('the send outlived its 1 s timeout by 10 s')), 11_000);
    });
    try {
      expect(await Promise.race([run, hung])).toMatchObject({ sent: 1, retried: 1 });
    } finally {
      clearTimeout(bound);
    }
    expect(Date.now() - started).toBeGreaterThanOrEqual(1000);
    expect(value(await deliveryList(t.pool, {}))[0]!.lastError).toBe('no answer within 1000 ms');
  });

  it('stop() cuts a send in flight at once, and the delivery is sent again later', async () => {
    await subscribe('cut', '/cut');
    rx.policy('/cut', 'hang');
    const j = await running('cut');
    value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: {} }));
    const d = deliverer({ timeoutMs: 60_000 });
    const run = d.runOnce();
    await rx.waitFor('the send', (r) => r.received.length === 1);
    const stopped = Date.now();
    await d.stop();
    expect(Date.now() - stopped).toBeLessThan(30_000);
    expect(await run).toMatchObject({ sent: 1, retried: 1, delivered: 0 });
    const [cut] = value(await deliveryList(t.pool, {}));
    expect(cut).toMatchObject({ status: 'pending', attempts: 1, lastError: 'the deliverer stopped' });
    rx.policy('/cut', 'ok');
    await t.pool.query(`UPDATE webhook_deliveries SET next_attempt_at = now()`);
    expect(await deliverer().runOnce()).toMatchObject({ sent: 1, delivered: 1 });
    expect(rx.events.size).toBe(1);
  });

  it('takes back a delivery claimed by a deliverer that died, and sends it again (deduped by event id)', async () => {
    await subscribe('sweep', '/sub');
    const j = await running('sweep');
    value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: {} }));
    // A deliverer claims it and dies before recording anything.
    const [held] = await deliveryClaim(t.pool, { limit: 10, claimId: '11111111-1111-4111-8111-111111111111', leaseMs: 60_000 });
    expect(held).toBeDefined();
    const d = deliverer();
    expect((await d.runOnce()).sent).toBe(0);
    await t.pool.query(`UPDATE webhook_deliveries SET claimed_until = now() - interval '1 second'`);
    expect(await d.runOnce()).toMatchObject({ reclaimed: 1, sent: 1, delivered: 1 });
    const [row] = value(await deliveryList(t.pool, {}));
    expect(row).toMatchObject({ status: 'delivered', attempts: 2 });
    expect(rx.events.size).toBe(1);
  });

  it('never sends one delivery twice at once from two deliverers', async () => {
    await subscribe('pair', '/sub');
    for (let i = 0; i < 20; i++) {
      const j = await running('pair');
      value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: { i } }));
    }
    const [a, b] = [deliverer({ batchSize: 3 }), deliverer({ batchSize: 3 })];
    const [ra, rb] = await Promise.all([a.runOnce(), b.runOnce()]);
    expect(ra.delivered + rb.delivered).toBe(20);
    expect(rx.received.length).toBe(20);
    expect(rx.events.size).toBe(20);
  });
});

describe('a silent receiver holds only its own sends', () => {
  /** The job id of the first delivery `d` records as delivered (fails after 5 s). */
  /** A receiver that never answers, and `n` jobs of `queue` finished with it as their notify_url. */
  const silentWith = async (queue: string, n: number) => {
    const silent = await startReceiver();
    silent.policy('/hang', 'hang');
    for (let i = 0; i < n; i++) {
      const j = await running(queue, { notifyUrl: `${silent.url}/hang` });
      value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: { i } }));
    }
    return silent;
  };

  const delivered = (d: WebhookDeliverer) => {
    const recorded = new Promise<string>((resolve, reject) => {
      const bound = setTimeout(() => reject(new Error('no delivery recorded as delivered within 5 s')), 5000);
      d.on('webhook:sent', (x) => {
        if (x.status !== 'delivered') return;
        clearTimeout(bound);
        resolve((JSON.parse(rx.received.find((r) => r.eventId === x.delivery.eventId)!.body) as { job: { id: string } }).job.id);
      });
    });
    recorded.catch(() => undefined); // a test that failed before awaiting it reports its own error
    return recorded;
  };

  it('a delivery that comes due while sends to a silent receiver are in flight goes out at once, not after their timeout', async () => {
    const silent = await silentWith('hol', 5);
    try {
      const d = deliverer({ timeoutMs: 20_000, intervalMs: 50 });
      const recorded = delivered(d);
      d.start();
      await silent.waitFor('five sends in flight', (r) => r.received.length === 5);
      rx.secret('/fast', notifySecret);
      const j = await running('hol', { notifyUrl: `${rx.url}/fast` });
      value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: {} }));
      await rx.waitFor('the delivery to the healthy receiver, well within the 20 s timeout', (r) => r.events.size === 1, 5000);
      expect(await recorded).toBe(j.job.id);
      await d.stop();
      expect(value(await deliveryList(t.pool, { status: 'pending' }))).toHaveLength(5); // cut by stop(), sent again later
    } finally {
      await silent.close();
    }
  });

  it('a retry that comes due while a send to a silent receiver is in flight goes out within an interval, not when the run ends', async () => {
    const silent = await silentWith('retry-during', 1);
    try {
      rx.policy('/busy-once', (res, _r, n) => void (n === 1 ? res.writeHead(503).end('busy') : res.writeHead(200).end('ok')));
      const b = await running('retry-during', { notifyUrl: `${rx.url}/busy-once` });
      value(await attemptComplete(t.pool, { attemptId: b.attemptId, agentId: 'a1', result: {} }));
      const d = deliverer({ timeoutMs: 20_000, intervalMs: 50, backoff: { baseMs: 100, maxMs: 100 } });
      const recorded = delivered(d); // within 5 s, well within the silent send's 20 s timeout
      const run = d.runOnce();
      expect(await recorded).toBe(b.job.id);
      expect(rx.received.filter((x) => x.path === '/busy-once')).toHaveLength(2);
      expect(silent.received).toHaveLength(1); // still in flight: the run goes on
      await d.stop();
      expect(await run).toMatchObject({ delivered: 1, retried: 2, sent: 3 });
    } finally {
      await silent.close();
    }
  });

  it('a stop during the look at the work claims nothing (a claim counts a try, and a send cut by the stop sends nothing)', async () => {
    await subscribe('stop-sweep', '/stop-sweep');
    const j = await running('stop-sweep');
    value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: {} }));
    const d = deliverer();
    const sweep = (d as unknown as { sweep: (...a: unknown[]) => Promise<boolean> }).sweep.bind(d);
    let stopped: Promise<void> | undefined;
    (d as unknown as { sweep: (...a: unknown[]) => Promise<boolean> }).sweep = async (...args) => {
      const due = await sweep(...args);
      stopped = d.stop(); // arrives while the run looks at the work
      return due;
    };
    await d.runOnce();
    await stopped;
    expect(rx.received.filter((r) => r.path === '/stop-sweep')).toHaveLength(0);
    const [row] = value(await deliveryList(t.pool, { status: 'pending' })).filter((x) => x.url.endsWith('/stop-sweep'));
    expect(row).toMatchObject({ attempts: 0 });
  });

  it('60 deliveries to a silent receiver ahead in line do not hold one to another receiver (at most 10 in flight to one)', async () => {
    const silent = await silentWith('hol60', 60);
    try {
      rx.secret('/fast', notifySecret);
      const j = await running('hol60', { notifyUrl: `${rx.url}/fast` });
      value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: {} }));
      const d = deliverer({ timeoutMs: 20_000 });
      const recorded = delivered(d);
      const run = d.runOnce();
      await rx.waitFor('the delivery to the healthy receiver, well within the 20 s timeout', (r) => r.events.size === 1, 5000);
      expect(await recorded).toBe(j.job.id);
      expect(silent.received.length).toBeLessThanOrEqual(10);
      await d.stop();
      expect(await run).toMatchObject({ delivered: 1, retried: 10, sent: 11 });
    } finally {
      await silent.close();
    }
  });
});

describe('dead-letter alerts', () => {
  it('raises one alert per dead-lettering (a failure report at the cap, or the reaper), with no subscriber, and posts it to the alert URL', async () => {
    rx.secret('/alert', notifySecret);
    const failedOut = await running('dlq', { maxAttempts: 1 });
    value(await attemptFail(t.pool, { attemptId: failedOut.attemptId, agentId: 'a1', error: { message: 'boom' }, retryable: true }));
    const lost = await running('dlq', { maxAttempts: 1 });
    value(await jobRescueExpired(t.pool, { limit: 10, now: new Date(Date.now() + 60_000) }));

    const d = deliverer({ alertUrl: `${rx.url}/alert` });
    const alerts: DeadLetterAlert[] = [];
    d.on('alert', (a) => alerts.push(a));
    const run = await d.runOnce();
    expect(run).toMatchObject({ alerts: 2, sent: 2, delivered: 2 });
    expect(alerts.map((a) => a.jobId).sort()).toEqual([failedOut.job.id, lost.job.id].sort());
    expect(alerts.find((a) => a.jobId === lost.job.id)!.event).toMatchObject({
      type: 'job.dead',
      job: { status: 'JOB_STATUS_DEAD', error: { reason: 'lease_expired' } },
      attempt: { status: 'ATTEMPT_STATUS_LEASE_EXPIRED' },
    });
    expect(rx.received.map((r) => [r.path, r.valid])).toEqual([
      ['/alert', true],
      ['/alert', true],
    ]);
    // Raised once: a second deliverer finds nothing to raise.
    expect((await deliverer({ alertUrl: `${rx.url}/alert` }).runOnce()).alerts).toBe(0);
  });
});

describe('the deliverer service', () => {
  it('validates its config, and start/stop are safe twice', async () => {
    expect(() => new WebhookDeliverer(t.pool, log, { intervalMs: 1 })).toThrow();
    expect(() => new WebhookDeliverer(t.pool, log, { alertUrl: 'ftp://x' })).toThrow();
    const d = deliverer({ intervalMs: 20 });
    await subscribe('sched', '/sub');
    const j = await running('sched');
    value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: {} }));
    d.start();
    d.start();
    await rx.waitFor('the scheduled delivery', (r) => r.events.size === 1);
    await d.stop();
    await d.stop();
  });

  it('asks the database once per run when there is nothing to do, and still does all of it when there is', async () => {
    // Every call the deliverer makes: statements on the pool, and transactions (a connection).
    const calls: string[] = [];
    const counting = new Proxy(t.pool, {
      get(pool, k) {
        if (k === 'query') return (q: { name?: string } | string, ...rest: unknown[]) => (calls.push(typeof q === 'string' ? q : (q.name ?? '?')), (pool.query as (...a: unknown[]) => unknown)(q, ...rest));
        if (k === 'connect') return () => (calls.push('connect'), pool.connect());
        const v = Reflect.get(pool, k, pool) as unknown;
        return typeof v === 'function' ? v.bind(pool) : v;
      },
    });
    const d = new WebhookDeliverer(counting, log, { timeoutMs: 2000, claimMarginMs: 0, backoff: { baseMs: 0, maxMs: 0 }, alertUrl: `${rx.url}/alert` });
    deliverers.push(d);
    expect(await d.runOnce()).toMatchObject({ reclaimed: 0, alerts: 0, sent: 0 });
    expect(calls).toEqual(['deliveryWork']);
    // A dead letter: its alert is raised and its delivery to the alert URL sent in the same run.
    const j = await running('idle-probe', { maxAttempts: 1 });
    value(await attemptFail(t.pool, { attemptId: j.attemptId, agentId: 'a1', error: { message: 'boom' }, retryable: true }));
    calls.length = 0;
    expect(await d.runOnce()).toMatchObject({ alerts: 1, sent: 1, delivered: 1 });
    // The probe, the alert scan's transaction (its statement runs on that connection), the claim.
    expect(calls[0]).toBe('deliveryWork');
    expect(calls).toContain('connect');
    expect(calls).toContain('deliveryClaim');
  });
});

describe('one secret per receiving URL', () => {
  it('signs everything sent to a subscribed URL with its secret: its subscriptions (shared between queues), notify_url deliveries and the alert', async () => {
    const first = await subscribe('one', '/shared');
    const second = await subscribe('two', '/shared');
    expect(second.secret).toBe(first.secret);
    const own = await subscribe('three', '/own');
    expect(own.secret).not.toBe(first.secret);
    // A job of queue one that also names the subscribed URL as its notify_url, and a job whose
    // notify_url is no subscription's: that one is signed with the notify secret.
    const a = await running('one', { notifyUrl: `${rx.url}/shared` });
    const b = await running('two', { notifyUrl: `${rx.url}/elsewhere` });
    rx.secret('/elsewhere', notifySecret);
    value(await attemptComplete(t.pool, { attemptId: a.attemptId, agentId: 'a1', result: { n: 1 } }));
    value(await attemptComplete(t.pool, { attemptId: b.attemptId, agentId: 'a1', result: { n: 2 } }));
    // A dead job whose alert goes to the subscribed URL too.
    const c = await running('three', { maxAttempts: 1 });
    value(await attemptFail(t.pool, { attemptId: c.attemptId, agentId: 'a1', error: { message: 'no' }, retryable: true }));
    const run = await deliverer({ alertUrl: `${rx.url}/shared` }).runOnce();
    expect(run).toMatchObject({ failed: 0, retried: 0 });
    // The receiver verifies each path with one secret: /shared with the subscriptions' shared one.
    const got = rx.received.map((r) => [r.path, r.headers[WEBHOOK_HEADERS.eventType], r.valid]);
    expect(got.filter(([, , valid]) => !valid)).toEqual([]);
    expect(got.map(([p, type]) => `${p} ${type}`).sort()).toEqual([
      '/elsewhere job.succeeded', // job b's notify_url: no subscription there, the notify secret
      '/own job.dead', // queue three's subscription, with its own secret
      '/shared job.dead', // the alert
      '/shared job.succeeded', // job a's notify_url, which is also the subscription of queue one: once
      '/shared job.succeeded', // the subscription of queue two (job b)
    ]);
    expect(got).toHaveLength(5);
  });
});

describe('a header for the notify_url (authenticated resume)', () => {
  it('sends the header given at enqueue with the notify_url deliveries only, and keeps it out of every read and event', async () => {
    await subscribe('auth', '/sub');
    rx.secret('/resume', notifySecret);
    const header = { name: 'X-Resume-Token', value: 'resume-secret-7f3a' };
    const a = await running('auth', { notifyUrl: `${rx.url}/resume`, notifyHeader: header });
    value(await attemptComplete(t.pool, { attemptId: a.attemptId, agentId: 'a1', result: { ok: 1 } }));
    expect(await deliverer().runOnce()).toMatchObject({ delivered: 2, failed: 0 });
    const byPath = Object.fromEntries(rx.received.map((r) => [r.path, r.headers['x-resume-token']]));
    expect(byPath).toEqual({ '/resume': header.value, '/sub': undefined });
    // Nowhere but its own table: not in the job row (every read of a job is jobs.*), nor the event.
    const leaks = (
      await t.pool.query(
        `SELECT 'jobs' AS t FROM jobs j WHERE to_jsonb(j)::text LIKE '%' || $1 || '%'
         UNION ALL SELECT 'webhook_events' FROM webhook_events e WHERE to_jsonb(e)::text LIKE '%' || $1 || '%'
         UNION ALL SELECT 'webhook_deliveries' FROM webhook_deliveries d WHERE to_jsonb(d)::text LIKE '%' || $1 || '%'`,
        [header.value],
      )
    ).rows;
    expect(leaks).toEqual([]);
    const got = value(await jobGet(t.pool, { jobId: a.job.id }));
    expect(JSON.stringify(got)).not.toContain(header.value);
  });

  it('refuses a header without a notify_url, one Leasehold or HTTP sets, and a value that is not visible ASCII', async () => {
    const base = { queue: 'auth', payload: {} };
    expect(await jobEnqueue(t.pool, { ...base, notifyHeader: { name: 'X-Token', value: 'v' } })).toMatchObject({ outcome: 'invalid', field: 'notifyHeader' });
    const url = `${rx.url}/resume`;
    for (const name of ['Content-Type', 'leasehold-signature', 'Host', 'bad name', '']) {
      expect(await jobEnqueue(t.pool, { ...base, notifyUrl: url, notifyHeader: { name, value: 'v' } }), name).toMatchObject({ outcome: 'invalid', field: 'notifyHeader.name' });
    }
    expect(await jobEnqueue(t.pool, { ...base, notifyUrl: url, notifyHeader: { name: 'X-Token', value: 'line\nbreak' } })).toMatchObject({ outcome: 'invalid', field: 'notifyHeader.value' });
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM jobs`)).rows[0].n).toBe(0);
  });

  it('retries a 409 from a notify_url (n8n: the execution is running already, not at its Wait node yet) and delivers it once the execution waits', async () => {
    const path = '/webhook-waiting/42';
    rx.secret(path, notifySecret);
    const running409 = JSON.stringify({ code: 409, message: 'The execution "42" is running already.' });
    rx.policy(path, (res, _got, n) => (n <= 2 ? res.writeHead(409, { 'content-type': 'application/json' }).end(running409) : res.writeHead(200).end('{}')));
    const j = await running('resume', { notifyUrl: `${rx.url}${path}` });
    value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: { n: 1 } }));
    const d = deliverer();
    expect(await d.runOnce()).toMatchObject({ sent: 1, retried: 1, failed: 0 });
    const [first] = value(await deliveryList(t.pool, { jobId: j.job.id }));
    // The receiver's reason is kept for the operator.
    expect(first).toMatchObject({ status: 'pending', attempts: 1, lastStatus: 409, lastError: `HTTP 409 Conflict: ${running409}` });
    expect(await d.runOnce()).toMatchObject({ sent: 1, retried: 1, failed: 0 });
    expect(await d.runOnce()).toMatchObject({ sent: 1, delivered: 1 });
    expect(value(await deliveryList(t.pool, { jobId: j.job.id }))[0]).toMatchObject({ status: 'delivered', attempts: 3, lastStatus: 200 });
    expect(rx.received.map((r) => [r.path, r.valid, r.headers[WEBHOOK_HEADERS.attempt]])).toEqual([1, 2, 3].map((n) => [path, true, String(n)]));
  });

  it('ends a notify_url delivery that keeps answering 409 at its 5th try (CONFLICT_FINAL_ATTEMPT), and one whose execution "has finished" at once, each with the alert', async () => {
    const lines: Array<Record<string, any>> = [];
    const d = new WebhookDeliverer(t.pool, pino({ level: 'warn' }, { write: (l: string) => void lines.push(JSON.parse(l)) }), {
      timeoutMs: 2000,
      claimMarginMs: 0,
      backoff: { baseMs: 0, maxMs: 0 },
    });
    deliverers.push(d);
    const answer = (message: string) => (res: http.ServerResponse) =>
      void res.writeHead(409, { 'content-type': 'application/json' }).end(JSON.stringify({ code: 409, message }));
    rx.secret('/webhook-waiting/7', notifySecret);
    rx.policy('/webhook-waiting/7', answer('conflict')); // no wording to go by: retried
    rx.secret('/webhook-waiting/8', notifySecret);
    rx.policy('/webhook-waiting/8', answer('The execution "8" has finished already.'));
    for (const path of ['/webhook-waiting/7', '/webhook-waiting/8']) {
      const j = await running('conflicts', { notifyUrl: `${rx.url}${path}` });
      value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: {} }));
    }
    expect(CONFLICT_FINAL_ATTEMPT).toBe(5);
    const rows = async () => (await t.pool.query(`SELECT url, status::text, attempts, last_status FROM webhook_deliveries ORDER BY url`)).rows.map((r) => [r.url.slice(rx.url.length), r.status, r.attempts, r.last_status]);
    expect(await d.runOnce()).toMatchObject({ sent: 2, retried: 1, failed: 1 });
    expect(await rows()).toEqual([
      ['/webhook-waiting/7', 'pending', 1, 409],
      ['/webhook-waiting/8', 'failed', 1, 409],
    ]);
    for (let n = 2; n <= CONFLICT_FINAL_ATTEMPT; n++) expect((await d.runOnce()).sent).toBe(1);
    expect(await rows()).toEqual([
      ['/webhook-waiting/7', 'failed', CONFLICT_FINAL_ATTEMPT, 409],
      ['/webhook-waiting/8', 'failed', 1, 409],
    ]);
    expect((await d.runOnce()).sent).toBe(0);
    const alerts = lines.filter((l) => l.alert === 'webhook.failed').map((l) => [l.url.slice(rx.url.length), l.attempt, l.level]);
    expect(alerts).toEqual([
      ['/webhook-waiting/8', 1, 50],
      ['/webhook-waiting/7', CONFLICT_FINAL_ATTEMPT, 50],
    ]);
  });

  it('retries 404 from a plain Webhook URL (n8n: the workflow is not active) like a 5xx; 404 from a resume URL and 410 are final, with the alert; a subscription retries them all', async () => {
    const lines: Array<Record<string, any>> = [];
    const d = new WebhookDeliverer(t.pool, pino({ level: 'warn' }, { write: (l: string) => void lines.push(JSON.parse(l)) }), {
      timeoutMs: 2000,
      claimMarginMs: 0,
      backoff: { baseMs: 0, maxMs: 0 },
      maxAttempts: 5,
    });
    deliverers.push(d);
    await subscribe('gone', '/sub-gone');
    rx.policy('/sub-gone', 404);
    const answers: Array<[string, number]> = [
      ['/webhook/leasehold-events', 404],
      ['/webhook-waiting/9', 404],
      ['/form-waiting/10', 404],
      ['/gone', 410],
    ];
    for (const [path, status] of answers) {
      rx.secret(path, notifySecret);
      rx.policy(path, status);
      const j = await running('gone', { notifyUrl: `${rx.url}${path}` });
      value(await attemptComplete(t.pool, { attemptId: j.attemptId, agentId: 'a1', result: {} }));
    }
    expect(await d.runOnce()).toMatchObject({ sent: 8, retried: 5, failed: 3 });
    const rows = (await t.pool.query(`SELECT url, subscription_id IS NOT NULL AS sub, status::text, attempts, last_status FROM webhook_deliveries ORDER BY sub, url`)).rows;
    expect(rows.map((r) => [r.url.slice(rx.url.length), r.status, r.attempts, r.last_status])).toEqual([
      ['/form-waiting/10', 'failed', 1, 404],
      ['/gone', 'failed', 1, 410],
      ['/webhook-waiting/9', 'failed', 1, 404],
      ['/webhook/leasehold-events', 'pending', 1, 404],
      ['/sub-gone', 'pending', 1, 404],
      ['/sub-gone', 'pending', 1, 404],
      ['/sub-gone', 'pending', 1, 404],
      ['/sub-gone', 'pending', 1, 404],
    ]);
    // Every delivery that ends failed is an alert, final answers as the cap.
    expect(lines.filter((l) => l.alert === 'webhook.failed').map((l) => l.url.slice(rx.url.length)).sort()).toEqual(['/form-waiting/10', '/gone', '/webhook-waiting/9']);
    rx.policy('/webhook/leasehold-events', 'ok'); // the workflow was activated
    expect(await d.runOnce()).toMatchObject({ sent: 5, delivered: 1, retried: 4 });
  });
});
