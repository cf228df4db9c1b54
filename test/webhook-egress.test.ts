/**
 * Where webhook sends may connect (`LEASEHOLD_WEBHOOK_DENY`, server/lib/egress.ts): the list as
 * configured, and the deliverer keeping to it against a real receiver and real PostgreSQL. A
 * denied address, given in the URL or reached through a name, is never connected to; the
 * delivery fails at once for good, saying why, with the alert; the check is made on the address
 * each connection is made to, so a name whose answer changes is checked again.
 */
import dns from 'node:dns';
import http from 'node:http';
import pino from 'pino';
import { afterAll, afterEach, beforeAll, beforeEach, describe, expect, it, vi } from 'vitest';
import { ConfigError, loadConfig } from '../server/config.js';
import { WebhookDeliverer } from '../server/core/webhook-deliverer.js';
import { ALWAYS_DENIED, DEFAULT_DENIED, EgressPolicy } from '../server/lib/egress.js';
import { attemptComplete, attemptStart, jobClaim, jobEnqueue, signingSecretGet, type EnqueueParams } from '../server/store/index.js';
import { ADMIN_KEY, useCoordinator, waitFor } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { startReceiver, type Receiver } from './helpers/http.js';

const SETTING = 'LEASEHOLD_WEBHOOK_DENY';
const policy = (text: string | undefined) => EgressPolicy.parse(text, SETTING);

describe('the list', () => {
  it('denies link-local and the metadata services by default, IPv4-mapped forms included, and allows loopback and private networks', () => {
    for (const text of [undefined, '', ' , ', 'default']) {
      const p = policy(text);
      expect(p.entries, String(text)).toEqual([...DEFAULT_DENIED]);
      for (const a of [
        '169.254.169.254',
        '169.254.170.23',
        '169.254.0.1',
        'fe80::1',
        'fd00:ec2::254',
        'fd00:ec2::23',
        'fd20:ce::254',
        '168.63.129.16',
        '100.100.100.200',
        '192.0.0.192',
        'fd00:42::42',
        '::ffff:169.254.169.254',
        '::ffff:a9fe:a9fe',
        '0.0.0.0',
        '::',
      ]) {
        expect(p.denies(a), a).toBe(true);
      }
      for (const a of ['127.0.0.1', '::1', '10.1.2.3', '192.168.1.20', '172.16.0.1', '100.100.100.201', 'fd00:ec3::254', '93.184.215.14', 'not-an-address']) {
        expect(p.denies(a), a).toBe(false);
      }
    }
  });

  it('takes addresses and CIDR networks of either family, with the default or instead of it; none denies nothing', () => {
    const p = policy('default, 10.0.0.0/8 ,fc00::/7,192.0.2.7');
    expect(p.entries).toEqual([...DEFAULT_DENIED, '10.0.0.0/8', 'fc00::/7', '192.0.2.7']);
    for (const a of ['169.254.169.254', '10.255.0.1', 'fd12::1', '192.0.2.7']) expect(p.denies(a), a).toBe(true);
    for (const a of ['11.0.0.1', '192.0.2.8', '127.0.0.1']) expect(p.denies(a), a).toBe(false);

    const only = policy('10.0.0.0/8');
    expect(only.denies('10.0.0.1')).toBe(true);
    expect(only.denies('169.254.169.254'), 'the default is replaced unless named').toBe(false);

    const none = policy('NONE');
    expect(none.entries).toEqual([]);
    expect(none.denies('169.254.169.254')).toBe(false);
    // The unspecified addresses reach this machine: denied by every list, so that denying loopback holds.
    for (const p2 of [none, only, p]) for (const a of ['0.0.0.0', '0.1.2.3', '::']) expect(p2.denies(a), a).toBe(true);
    expect(ALWAYS_DENIED).toEqual(['0.0.0.0/8', '::']);
  });

  it('refuses what is not an address, a network or a keyword, naming the setting and the entry', () => {
    for (const [text, bad] of [
      ['metadata.google.internal', 'metadata.google.internal'],
      ['10.0.0.0/33', '10.0.0.0/33'],
      ['fe80::/129', 'fe80::/129'],
      ['10.0.0.0/8x', '10.0.0.0/8x'],
      ['10.0.0.0/', '10.0.0.0/'],
      ['default,10.0.0.256', '10.0.0.256'],
      ['fe80::1%eth0', 'fe80::1%eth0'],
    ]) {
      expect(() => policy(text), text).toThrow(`${SETTING}: "${bad}" is not an IP address, a network in CIDR notation`);
    }
    expect(() => policy('none,10.0.0.0/8')).toThrow(`${SETTING}: "none" denies nothing and cannot be combined with other entries`);
  });

  it("refuses a URL whose host is a denied address, in any of the forms a URL may write it; leaves names to the connection's lookup", () => {
    const p = policy(undefined);
    for (const url of [
      'http://169.254.169.254/latest/meta-data/iam/security-credentials/',
      'http://2852039166/', // 169.254.169.254 as one number
      'http://0xA9FEA9FE/',
      'http://0251.0376.0251.0376/',
      'http://[fd00:ec2::254]/latest/',
      'http://[::ffff:169.254.169.254]/',
      'https://[fe80::1]:8443/hook',
      'http://0.0.0.0:8080/',
      'http://0:8080/',
      'http://[::]:8080/',
    ]) {
      expect(p.refusal(url)?.message, url).toMatch(/^the address \S+ is denied by LEASEHOLD_WEBHOOK_DENY$/);
    }
    for (const url of ['http://127.0.0.1:5678/webhook/x', 'http://localhost/', 'http://metadata.google.internal/', 'not a url']) {
      expect(p.refusal(url), url).toBeUndefined();
    }
  });

  it('is read from the environment at start: a bad list, or an alert URL at a denied address, stops the start with the reason', () => {
    expect(loadConfig({}, {}).webhook.egress.entries).toEqual([...DEFAULT_DENIED]);
    expect(loadConfig({}, { LEASEHOLD_WEBHOOK_DENY: 'default,10.0.0.0/8' }).webhook.egress.denies('10.9.9.9')).toBe(true);
    expect(() => loadConfig({}, { LEASEHOLD_WEBHOOK_DENY: '10.0.0.0/40' })).toThrow(ConfigError);
    expect(() => loadConfig({}, { LEASEHOLD_WEBHOOK_DENY: '10.0.0.0/40' })).toThrow('LEASEHOLD_WEBHOOK_DENY: "10.0.0.0/40" is not');
    expect(() => loadConfig({}, { LEASEHOLD_ALERT_URL: 'http://169.254.169.254/alert' })).toThrow(
      'LEASEHOLD_ALERT_URL="http://169.254.169.254/alert": the address 169.254.169.254 is denied by LEASEHOLD_WEBHOOK_DENY',
    );
    expect(loadConfig({}, { LEASEHOLD_ALERT_URL: 'http://169.254.169.254/alert', LEASEHOLD_WEBHOOK_DENY: 'none' }).alertUrl).toBe('http://169.254.169.254/alert');
  });
});

describe('the deliverer keeps to it', () => {
  const t = useTestDb();
  const log = pino({ level: process.env.LEASEHOLD_TEST_LOG ?? 'silent' });
  let rx: Receiver;
  let port: string;
  const deliverers: WebhookDeliverer[] = [];
  const deliverer = (egress: EgressPolicy) => {
    const d = new WebhookDeliverer(t.pool, log, { timeoutMs: 5000, claimMarginMs: 0, backoff: { baseMs: 0, maxMs: 0 }, egress });
    deliverers.push(d);
    return d;
  };

  beforeAll(async () => {
    rx = await startReceiver();
    port = new URL(rx.url).port;
  });
  afterAll(async () => {
    await rx.close();
  });
  beforeEach(async () => {
    await t.truncate();
    rx.received.length = 0;
    rx.events.clear();
    rx.secret('/notify', await signingSecretGet(t.pool));
  });
  afterEach(async () => {
    vi.restoreAllMocks();
    for (const d of deliverers.splice(0)) await d.stop();
  });

  /** A job finished successfully with `notifyUrl`: one delivery waiting. */
  async function finished(notifyUrl: string, extra: Partial<EnqueueParams> = {}) {
    const job = (await jobEnqueue(t.pool, { queue: 'egress', payload: {}, notifyUrl, ...extra })) as { value: { id: string } };
    const claimed = (await jobClaim(t.pool, { agentId: 'a1', queues: ['egress'], limit: 1, claimTtlMs: 30_000 })) as { value: Array<{ attemptId: string }> };
    const attemptId = claimed.value[0]!.attemptId;
    await attemptStart(t.pool, { attemptId, agentId: 'a1', leaseTtlMs: 30_000 });
    expect((await attemptComplete(t.pool, { attemptId, agentId: 'a1', result: {} })).outcome).toBe('ok');
    return job.value.id;
  }
  const deliveries = async () =>
    (await t.pool.query(`SELECT url, status::text, attempts, last_error FROM webhook_deliveries ORDER BY url`)).rows as Array<{
      url: string;
      status: string;
      attempts: number;
      last_error: string | null;
    }>;

  it('fails a delivery to a metadata address at once and for good, sending nothing, with the alert', async () => {
    const d = deliverer(policy(undefined));
    const failedLogs: unknown[] = [];
    vi.spyOn(log, 'error').mockImplementation(((obj: unknown) => void failedLogs.push(obj)) as never);
    await finished('http://169.254.169.254/latest/meta-data/iam/security-credentials/');
    const started = Date.now();
    expect(await d.runOnce()).toMatchObject({ sent: 1, delivered: 0, retried: 0, failed: 1 });
    expect(Date.now() - started, 'nothing waited on a connection').toBeLessThan(2000);
    expect(await deliveries()).toEqual([
      {
        url: 'http://169.254.169.254/latest/meta-data/iam/security-credentials/',
        status: 'failed',
        attempts: 1,
        last_error: 'the address 169.254.169.254 is denied by LEASEHOLD_WEBHOOK_DENY',
      },
    ]);
    expect(failedLogs).toContainEqual(expect.objectContaining({ alert: 'webhook.failed', final: true }));
    expect((await d.runOnce()).sent, 'not retried').toBe(0);
  });

  it('refuses the receiver when its address is denied, whether the URL gives the address or a name that resolves to it; delivers when allowed', async () => {
    const loopbackDenied = policy('default,127.0.0.0/8,::1');
    await finished(`http://127.0.0.1:${port}/notify`);
    await finished(`http://localhost:${port}/notify`);
    expect(await deliverer(loopbackDenied).runOnce()).toMatchObject({ sent: 2, delivered: 0, failed: 2 });
    expect(rx.received, 'no request reached the receiver').toEqual([]);
    const rows = await deliveries();
    expect(rows.map((r) => [r.status, r.last_error])).toEqual([
      ['failed', 'the address 127.0.0.1 is denied by LEASEHOLD_WEBHOOK_DENY'],
      ['failed', expect.stringMatching(/^localhost resolves to (127\.0\.0\.1|::1), an address denied by LEASEHOLD_WEBHOOK_DENY$/)],
    ]);

    // The same receiver, the default list: delivered.
    await t.truncate();
    await finished(`http://localhost:${port}/notify`);
    expect(await deliverer(policy(undefined)).runOnce()).toMatchObject({ sent: 1, delivered: 1 });
    expect(rx.received.map((r) => [r.path, r.valid])).toEqual([['/notify', true]]);
  });

  it('checks the address of each connection: a name whose answer turns to a denied address is refused, and denied addresses are left out of an answer with others', async () => {
    const p = policy('default,127.0.0.2');
    // A second receiver on the denied 127.0.0.2, the same port: what reaches it went to a denied address.
    const trapped: string[] = [];
    const trap = http.createServer((req, res) => {
      trapped.push(req.url ?? '');
      res.writeHead(200).end();
    });
    await new Promise<void>((resolve, reject) => trap.once('error', reject).listen(Number(port), '127.0.0.2', () => resolve()));
    try {
      const answers: string[][] = [];
      const real = dns.lookup.bind(dns);
      // hooks.example resolves to whatever the test says next (its DNS rebinding), other names as usual.
      vi.spyOn(dns, 'lookup').mockImplementation(((host: string, options: dns.LookupAllOptions, cb: (e: Error | null, a: dns.LookupAddress[]) => void) => {
        if (host !== 'hooks.example') return (real as (...a: unknown[]) => void)(host, options, cb);
        cb(null, answers.shift()!.map((address) => ({ address, family: 4 })));
      }) as never);

      // A denied address first, an allowed one after it: the connection goes to the allowed one.
      answers.push(['127.0.0.2', '127.0.0.1']);
      await finished(`http://hooks.example:${port}/notify`);
      const first = deliverer(p);
      expect(await first.runOnce()).toMatchObject({ sent: 1, delivered: 1 });
      expect(rx.received).toHaveLength(1);
      await first.stop(); // its connections closed: the next send connects, and looks the name up, again

      // The same name now answers with denied addresses only: refused, nothing sent.
      answers.push(['127.0.0.2', '169.254.169.254']);
      await t.truncate();
      await finished(`http://hooks.example:${port}/notify`);
      expect(await deliverer(p).runOnce()).toMatchObject({ sent: 1, delivered: 0, failed: 1 });
      expect(rx.received).toHaveLength(1);
      expect((await deliveries())[0]).toMatchObject({
        status: 'failed',
        last_error: 'hooks.example resolves to 127.0.0.2, an address denied by LEASEHOLD_WEBHOOK_DENY',
      });
      expect(answers, 'each connection looked the name up').toEqual([]);
      expect(trapped, 'nothing reached the denied address').toEqual([]);
    } finally {
      trap.closeAllConnections();
      await new Promise((resolve) => trap.close(resolve));
    }
  });

  it('refuses the unspecified address, which would reach a loopback the list denies', async () => {
    await finished(`http://0.0.0.0:${port}/notify`);
    await finished(`http://[::]:${port}/notify`);
    expect(await deliverer(policy('127.0.0.0/8,::1')).runOnce()).toMatchObject({ sent: 2, delivered: 0, failed: 2 });
    expect(rx.received).toEqual([]);
    expect((await deliveries()).map((r) => r.last_error)).toEqual([
      'the address 0.0.0.0 is denied by LEASEHOLD_WEBHOOK_DENY',
      'the address :: is denied by LEASEHOLD_WEBHOOK_DENY',
    ]);
  });
});

describe("the coordinator's deliverer", () => {
  const t = useTestDb();
  const lh = useCoordinator(t, { LEASEHOLD_WEBHOOK_DENY: 'default,127.0.0.0/8', LEASEHOLD_WEBHOOK_INTERVAL: '50ms' });
  let rx: Receiver;
  beforeAll(async () => {
    rx = await startReceiver();
  });
  afterAll(async () => {
    await rx.close();
  });

  it('keeps to LEASEHOLD_WEBHOOK_DENY as the coordinator was started with it', async () => {
    expect(lh.c.deliverer.egress).toBe(lh.config.webhook.egress);
    const job = await jobEnqueue(t.pool, { queue: 'egress', payload: {}, notifyUrl: `${rx.url}/notify` });
    expect(job.outcome).toBe('ok');
    const claimed = (await jobClaim(t.pool, { agentId: 'a1', queues: ['egress'], limit: 1, claimTtlMs: 30_000 })) as { value: Array<{ attemptId: string }> };
    expect((await attemptComplete(t.pool, { attemptId: claimed.value[0]!.attemptId, agentId: 'a1', result: {} })).outcome).toBe('ok');
    const row = await waitFor('the delivery ended', async () => {
      const r = (await t.pool.query(`SELECT status::text, last_error FROM webhook_deliveries`)).rows[0] as { status: string; last_error: string } | undefined;
      return r?.status === 'failed' ? r : undefined;
    });
    expect(row.last_error).toBe('the address 127.0.0.1 is denied by LEASEHOLD_WEBHOOK_DENY');
    expect(rx.received).toEqual([]);
  });

  it('refuses a notifyUrl or a subscription URL written with a denied address where it is given, storing nothing; a name is left to the send', async () => {
    const call = async (path: string, body: unknown) => {
      const res = await fetch(`${lh.httpUrl}/leasehold.v1.${path}`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', authorization: `Bearer ${ADMIN_KEY}` },
        body: JSON.stringify(body),
      });
      return { status: res.status, body: (await res.json()) as { code?: string; message?: string; job?: { id: string } } };
    };
    await t.truncate();
    for (const url of ['http://169.254.169.254/latest/meta-data/', 'http://2852039166/', `http://127.0.0.1:${new URL(rx.url).port}/notify`]) {
      const enqueued = await call('JobService/EnqueueJob', { queue: 'egress', payload: {}, notifyUrl: url });
      expect(enqueued.status, url).toBe(400);
      expect(enqueued.body).toMatchObject({ code: 'invalid_argument', message: expect.stringMatching(/^notifyUrl is refused: the address \S+ is denied by LEASEHOLD_WEBHOOK_DENY$/) });
      const subscribed = await call('AdminService/CreateSubscription', { queue: 'egress', url });
      expect(subscribed.status, url).toBe(400);
      expect(subscribed.body.message).toMatch(/^url is refused: the address \S+ is denied by LEASEHOLD_WEBHOOK_DENY$/);
    }
    expect((await t.pool.query(`SELECT (SELECT count(*) FROM jobs)::int AS jobs, (SELECT count(*) FROM subscriptions)::int AS subs`)).rows[0]).toEqual({ jobs: 0, subs: 0 });
    // A name: taken, and checked when a send connects.
    const named = await call('JobService/EnqueueJob', { queue: 'egress', payload: {}, notifyUrl: `http://localhost:${new URL(rx.url).port}/notify` });
    expect(named.status).toBe(200);
  });

  it("answers a keyed retry of an enqueue taken before the refusal with its job, as any repeat; a new key is refused", async () => {
    await t.truncate();
    const denied = 'http://169.254.169.254/hook';
    // Taken before this list (an upgrade, or another setting): the store alone does not refuse.
    const before = await jobEnqueue(t.pool, { queue: 'egress', payload: { n: 1 }, notifyUrl: denied, idempotencyKey: 'k-before' });
    expect(before.outcome).toBe('ok');
    const enqueue = async (body: Record<string, unknown>) => {
      const res = await fetch(`${lh.httpUrl}/leasehold.v1.JobService/EnqueueJob`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', authorization: `Bearer ${ADMIN_KEY}` },
        body: JSON.stringify({ queue: 'egress', notifyUrl: denied, ...body }),
      });
      return { status: res.status, body: (await res.json()) as { outcome?: string; code?: string; message?: string; job?: { id: string } } };
    };
    const retry = await enqueue({ payload: { n: 1 }, idempotencyKey: 'k-before' });
    expect(retry).toMatchObject({ status: 200, body: { outcome: 'OUTCOME_DUPLICATE', job: { id: (before as { value: { id: string } }).value.id } } });
    const other = await enqueue({ payload: { n: 2 }, idempotencyKey: 'k-before' });
    expect(other).toMatchObject({ status: 409, body: { code: 'already_exists' } });
    const fresh = await enqueue({ payload: { n: 1 }, idempotencyKey: 'k-new' });
    expect(fresh).toMatchObject({ status: 400, body: { message: 'notifyUrl is refused: the address 169.254.169.254 is denied by LEASEHOLD_WEBHOOK_DENY' } });
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM jobs`)).rows[0].n, 'nothing more stored').toBe(1);
  });
});
