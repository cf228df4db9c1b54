/**
 * Refused keys are bounded per remote address on both listeners, over real sockets
 * (server/transport/key-gate.ts, with its real bounds: a burst of 30, then 5 a second). Past the
 * burst a call whose key is not in the credential cache is answered at once, without a database
 * lookup: 429 with `retry-after` and the gateway's JSON error on HTTP, RESOURCE_EXHAUSTED on gRPC.
 * A key in the cache still works from that address, another address is not concerned, the bucket
 * refills, and the refusals are logged (once, not per key, and without the key) and counted in
 * /metrics. Before, 5,028 wrong keys in 2.4 s were each looked up, answered 401 and logged nowhere.
 */
import http from 'node:http';
import { EventEmitter } from 'node:events';
import pino from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { AgentHub } from '../server/core/agent-hub.js';
import { CredentialCache } from '../server/core/credential-cache.js';
import { ProxyTrust } from '../server/lib/proxy-trust.js';
import { keyCreate } from '../server/store/index.js';
import { principalOwner, type Principal } from '../server/transport/auth.js';
import { listenHttp, type HttpServer } from '../server/transport/http.js';
import { createMetrics, type Metrics } from '../server/transport/metrics.js';
import { listenGrpc, type GrpcServer } from '../server/transport/server.js';
import { useTestDb } from './helpers/db.js';
import { grpc, rawClient, unary } from './helpers/raw-agent.js';

const t = useTestDb();

const LIST = '/leasehold.v1.JobService/ListJobs';
const LIMITED = 'too many refused keys from this address: retry in 1 s';

/** Statements run by the listeners: one per key looked up (and one per ListJobs served). */
let lookups = 0;
const lines: Array<Record<string, unknown>> = [];
let credentials: CredentialCache<Principal>;
let metrics: Metrics;
let hub: AgentHub;
let httpServer: HttpServer;
let grpcServer: GrpcServer;
let good: string;

beforeAll(async () => {
  const pool = t.newPool(8);
  pool.on('acquire', () => lookups++);
  const log = pino({ level: 'warn' }, { write: (l: string) => void lines.push(JSON.parse(l) as Record<string, unknown>) });
  credentials = new CredentialCache<Principal>(principalOwner);
  credentials.setOnline(true);
  const deps = { db: pool, log, leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 };
  hub = new AgentHub(pool, log, deps);
  metrics = createMetrics({ db: pool, hub: Object.assign(new EventEmitter(), { sessions: new Set() }) as never, credentials, log });
  httpServer = await listenHttp({ ...deps, hub, credentials, metrics }, '127.0.0.1:0');
  grpcServer = await listenGrpc({ ...deps, hub, credentials, metrics }, '127.0.0.1:0');
  const k = await keyCreate(t.pool, { name: 'limits-reader', scopes: ['read'] });
  if (k.outcome !== 'ok') throw new Error(k.outcome);
  good = k.value.key;
});

afterAll(async () => {
  await httpServer?.close();
  await grpcServer?.close();
  await hub?.stop();
  metrics?.close();
});

interface Answer {
  status: number;
  retryAfter: string | undefined;
  json: Record<string, unknown>;
}

/** POST `path` on the gateway with `key`, from the local address `from`, on a connection of its own (with `forwardedFor` as `X-Forwarded-For`). */
function call(path: string, key: string, from = '127.0.0.1', forwardedFor?: string, port = httpServer.address.port): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const headers = { 'content-type': 'application/json', authorization: `Bearer ${key}`, ...(forwardedFor ? { 'x-forwarded-for': forwardedFor } : {}) };
    const req = http.request(
      { host: '127.0.0.1', port, localAddress: from, path, method: 'POST', agent: false, headers },
      (res) => {
        let body = '';
        res.setEncoding('utf8').on('data', (c: string) => (body += c));
        res.on('end', () => resolve({ status: res.statusCode!, retryAfter: res.headers['retry-after'], json: JSON.parse(body) as Record<string, unknown> }));
      },
    );
    req.on('error', reject);
    req.end('{}');
  });
}

/** How many of `xs` are `x`. */
const count = <T>(xs: T[], x: T) => xs.filter((y) => y === x).length;

/**
 * What `listener` logged of refused keys: one line for the first refused key and one for the first
 * call refused unchecked (the rest are counted into a line a minute later), in either order (a
 * call refused unchecked is answered before the lookups in flight); never a key.
 */
function expectSummaries(listener: string) {
  const refused = lines.filter((l) => l.listener === listener).map((l) => `${String(l.remote)} ${String(l.msg)}`);
  expect(refused.sort()).toEqual(['127.0.0.1 call refused without a check: too many refused keys from its address', '127.0.0.1 key refused']);
  expect(JSON.stringify(lines)).not.toContain('lh_key_guess');
}

/** The value of `leasehold_auth_refused_total` with these labels. */
async function refusedTotal(listener: string, reason: string): Promise<number> {
  const text = (await metrics.render()).body;
  const m = new RegExp(`^leasehold_auth_refused_total\\{listener="${listener}",reason="${reason}"\\} (\\d+)$`, 'm').exec(text);
  return m ? Number(m[1]) : 0;
}

/**
 * Sends 45 guesses at once with `send`; as soon as the first is refused unchecked (`isLimited`),
 * while the address is past its bound, sends `meanwhile`. Returns the guesses' answers and
 * `meanwhile`'s. The bucket refills a token every 200 ms, so a slow moment of this process may let
 * one or two of `meanwhile`'s guesses be checked: the tests count what they see.
 */
async function burst<A, M>(send: (key: string) => Promise<A>, isLimited: (a: A) => boolean, meanwhile: () => Promise<M>): Promise<[A[], M]> {
  const guesses = Array.from({ length: 45 }, (_, i) => send(`lh_key_guess-${i}`));
  let during: Promise<M> | undefined;
  for (const g of guesses) void g.then((a) => void (isLimited(a) && (during ??= meanwhile())));
  const answers = await Promise.all(guesses);
  if (!during) throw new Error('no guess was refused unchecked');
  return [answers, await during];
}

/**
 * Ten guesses, each key its own (`tag` keeps two sets apart: the same key sent twice at once is
 * looked up once, for both, which made a count of lookups one short now and then).
 */
const tenGuesses = <A>(send: (key: string) => Promise<A>, tag = 'meanwhile') => Promise.all(Array.from({ length: 10 }, (_, i) => send(`lh_key_guess-${tag}-${i}`)));

describe('the HTTP gateway', () => {
  it('past 30 refused keys from one address answers 429 at once without a lookup; a cached key still works, and another address is not concerned', async () => {
    expect((await call(LIST, good)).status).toBe(200);
    let before = lookups;
    expect((await call(LIST, good)).status).toBe(200);
    /** Statements of a ListJobs served with a cached key. */
    const served = lookups - before;
    before = lookups;
    const hits = credentials.stats.hits;
    const metricsCall = (key: string) =>
      new Promise<number>((resolve, reject) =>
        http.get({ host: '127.0.0.1', port: httpServer.address.port, path: '/metrics', agent: false, headers: { authorization: `Bearer ${key}` } }, (res) => resolve(res.resume().statusCode!)).on('error', reject),
      );
    // Meanwhile, from the same address: the cached key is served, guesses on the API and on
    // /metrics are refused unchecked.
    const [answers, [cached, more, viaMetrics]] = await burst(
      (key) => call(LIST, key),
      (a) => a.status === 429,
      () => Promise.all([call(LIST, good), tenGuesses((key) => call(LIST, key).then((a) => a.status)), tenGuesses(metricsCall, 'metrics')]),
    );
    expect(cached.status).toBe(200);
    expect(credentials.stats.hits).toBe(hits + 1);
    const statuses = [...answers.map((a) => a.status), ...more, ...viaMetrics];
    expect(new Set(statuses)).toEqual(new Set([401, 429]));
    const checked = count(statuses, 401);
    expect(checked).toBeGreaterThanOrEqual(30);
    expect(checked).toBeLessThanOrEqual(35);
    expect(count(viaMetrics, 429)).toBeGreaterThanOrEqual(5);
    // Only the keys answered 401 were looked up (and the cached key's ListJobs ran).
    expect(lookups - before).toBe(checked + served);
    expect(answers.find((a) => a.status === 429)).toEqual({
      status: 429,
      retryAfter: '1',
      json: { code: 'resource_exhausted', message: LIMITED, status: 429, outcome: 'error' },
    });
    // Another address has a bucket of its own.
    expect((await call(LIST, 'lh_key_guess-elsewhere', '127.0.0.2')).status).toBe(401);
    // 5 a second: a quarter of a second later one more key is checked.
    await new Promise((r) => setTimeout(r, 250));
    expect((await call(LIST, 'lh_key_guess-later')).json).toMatchObject({ status: 401, message: 'unknown key or token' });
    expectSummaries('http');
    expect([await refusedTotal('http', 'key'), await refusedTotal('http', 'limited')]).toEqual([checked + 2, count(statuses, 429)]);
  });
});

describe('the gRPC listener', () => {
  it('past 30 refused keys from one address answers RESOURCE_EXHAUSTED at once without a lookup; a cached key still works', async () => {
    const client = rawClient('JobService', `127.0.0.1:${grpcServer.address.port}`);
    // The wait also as metadata, as HTTP's retry-after.
    const retryAfter = (e: grpc.ServiceError) => e.metadata?.get('retry-after')[0];
    const end = (token: string) =>
      unary(client, 'listJobs', { pageSize: 1 }, token).then(
        () => 'ok',
        (e: grpc.ServiceError) => `${e.code} ${e.details}${retryAfter(e) === undefined ? '' : ` retry-after=${String(retryAfter(e))}`}`,
      );
    const refused = `${grpc.status.UNAUTHENTICATED} unknown key or token`;
    const limited = `${grpc.status.RESOURCE_EXHAUSTED} ${LIMITED} retry-after=1`;
    try {
      expect(await end(good)).toBe('ok');
      let before = lookups;
      expect(await end(good)).toBe('ok');
      const served = lookups - before;
      before = lookups;
      const [answers, [cached, more]] = await burst(end, (a) => a === limited, () => Promise.all([end(good), tenGuesses(end)]));
      expect(cached).toBe('ok');
      const all = [...answers, ...more];
      expect(new Set(all)).toEqual(new Set([refused, limited]));
      const checked = count(all, refused);
      expect(checked).toBeGreaterThanOrEqual(30);
      expect(checked).toBeLessThanOrEqual(35);
      expect(count(more, limited)).toBeGreaterThanOrEqual(5);
      expect(lookups - before).toBe(checked + served);
      await new Promise((r) => setTimeout(r, 250));
      expect(await end('lh_key_guess-later')).toBe(refused);
      expectSummaries('grpc');
      expect([await refusedTotal('grpc', 'key'), await refusedTotal('grpc', 'limited')]).toEqual([checked + 1, count(all, limited)]);
    } finally {
      client.close();
    }
  });
});

describe('the bootstrap admin key', () => {
  it('is warned about at start when short enough to guess, never shown', async () => {
    const { loadConfig } = await import('../server/config.js');
    const { startCoordinator } = await import('../server/coordinator.js');
    for (const [key, warned] of [
      ['short-admin-key', true],
      ['0123456789abcdef0123456789abcdef', false],
    ] as const) {
      const said: Array<Record<string, unknown>> = [];
      const log = pino({ level: 'warn' }, { write: (l: string) => void said.push(JSON.parse(l) as Record<string, unknown>) });
      const c = await startCoordinator(loadConfig({ grpcAddr: '127.0.0.1:0', httpAddr: '127.0.0.1:0' }, { DATABASE_URL: t.url, LEASEHOLD_ADMIN_KEY: key, LEASEHOLD_RETENTION: 'off' }), log);
      await c.stop();
      const weak = said.filter((l) => /^LEASEHOLD_ADMIN_KEY has \d+ characters/.test(String(l.msg)));
      expect(weak.length, key).toBe(warned ? 1 : 0);
      expect(JSON.stringify(said)).not.toContain(key);
    }
  });
});

describe('behind a proxy (LEASEHOLD_TRUST_PROXY=1)', () => {
  it("counts refused keys per X-Forwarded-For's last address: a guesser behind the proxy does not hold back another caller's new key", async () => {
    const fresh = await keyCreate(t.pool, { name: 'limits-behind-proxy', scopes: ['read'] });
    if (fresh.outcome !== 'ok') throw new Error(fresh.outcome);
    const pool = t.newPool(4);
    const log = pino({ level: 'silent' });
    const behind = await listenHttp({ db: pool, log, leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000, hub, credentials, trustProxy: ProxyTrust.parse('1', 'LEASEHOLD_TRUST_PROXY') }, '127.0.0.1:0');
    try {
      const proxy = '127.0.0.5';
      const at = (key: string, forwardedFor?: string) => call(LIST, key, proxy, forwardedFor, behind.address.port);
      const guesses = await Promise.all(Array.from({ length: 45 }, (_, i) => at(`lh_key_guess-proxied-${i}`, '198.51.100.1')));
      expect(count(guesses.map((a) => a.status), 429)).toBeGreaterThan(0);
      // Another client behind the same proxy: its key, never seen by this listener, is checked and served.
      expect((await at(fresh.value.key, '198.51.100.2')).status).toBe(200);
      // Only the last entry counts: what a client claims before it is not believed. Ten guesses
      // claiming 198.51.100.2 before the proxy's 198.51.100.1 draw on the bucket the 45 emptied,
      // so all but the few its refill (5 a second) has brought back since are limited; drawn on
      // 198.51.100.2's, still full, all ten would be checked and refused (401). Ten at once, not
      // one: a single guess after a slow second on a loaded machine found a token refilled.
      const spoofed = await Promise.all(Array.from({ length: 10 }, (_, i) => at(`lh_key_guess-spoofed-${i}`, '198.51.100.2, 198.51.100.1')));
      expect(count(spoofed.map((a) => a.status), 429)).toBeGreaterThan(0);
      expect((await at('lh_key_guess-third', '198.51.100.1, 198.51.100.3')).status).toBe(401);
    } finally {
      await behind.close();
    }
  });

  it('without it the header is not read, from loopback either: a guesser cannot pick a fresh address per guess', async () => {
    const from = '127.0.0.6';
    const guesses = await Promise.all(Array.from({ length: 45 }, (_, i) => call(LIST, `lh_key_guess-forged-${i}`, from, `198.51.100.${i + 10}`)));
    expect(count(guesses.map((a) => a.status), 429)).toBeGreaterThan(0);
  });
});
