/**
 * `/healthz` asks the database at most about once a second, however often it is asked: one ping
 * for the requests that come while it runs, its answer kept `HEALTHZ_CACHE_MS`. Anyone may ask
 * it, and with a ping per request 4,070 requests a second held PostgreSQL at 31 % CPU and tripled
 * n8n's enqueue latency (.scratch/review-security.md, 5). An outage still shows within about a
 * second, and its end too. The database here is the test's, behind a wrapper that counts the
 * pings and can fail them.
 */
import pino from 'pino';
import { afterAll, afterEach, beforeAll, expect, it } from 'vitest';
import { AgentHub } from '../server/core/agent-hub.js';
import { listenHttp, type HttpServer } from '../server/transport/http.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();

/** How long an answer is kept: about a second (`HEALTHZ_CACHE_MS`). */
const KEPT_MS = 1_000;

let pings = 0;
/** While set, every statement fails as a database that went away does. */
let down = false;
const lines: Array<Record<string, unknown>> = [];
let hub: AgentHub;
let server: HttpServer;

beforeAll(async () => {
  const pool = t.newPool(4);
  const db = new Proxy(pool, {
    get: (p, name) =>
      name === 'query'
        ? (...args: unknown[]) => {
            pings++;
            return down ? Promise.reject(new Error('connect ECONNREFUSED (test)')) : (p.query as (...a: unknown[]) => unknown)(...args);
          }
        : Reflect.get(p, name),
  });
  const log = pino({ level: 'warn' }, { write: (l: string) => void lines.push(JSON.parse(l) as Record<string, unknown>) });
  const deps = { db, log, leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 };
  hub = new AgentHub(t.pool, log, deps);
  server = await listenHttp({ ...deps, hub }, '127.0.0.1:0');
});

afterEach(() => {
  down = false;
});

afterAll(async () => {
  await server?.close();
  await hub?.stop();
});

const healthz = async () => {
  const r = await fetch(`http://127.0.0.1:${server.address.port}/healthz`);
  return `${r.status} ${JSON.stringify(await r.json())}`;
};

it('pings the database at most once a second under 200 requests, 20 at a time', async () => {
  const t0 = performance.now();
  const before = pings;
  const answers: string[] = [];
  for (let wave = 0; wave < 10; wave++) {
    answers.push(...(await Promise.all(Array.from({ length: 20 }, healthz))));
    await new Promise((r) => setTimeout(r, 150));
  }
  const seconds = (performance.now() - t0) / 1000;
  expect(new Set(answers)).toEqual(new Set(['200 {"status":"ok"}']));
  expect(answers).toHaveLength(200);
  // One at the start, then at most one a second (a ping's answer is kept a second after it came).
  expect(pings - before).toBeGreaterThanOrEqual(1);
  expect(pings - before).toBeLessThanOrEqual(1 + Math.floor(seconds / (KEPT_MS / 1000)));
});

it('shows a database outage within about a second, logged once per ping; and its end', async () => {
  expect(await healthz()).toBe('200 {"status":"ok"}');
  down = true;
  const t0 = performance.now();
  while ((await healthz()) !== '503 {"status":"unavailable"}') await new Promise((r) => setTimeout(r, 50));
  expect(performance.now() - t0).toBeLessThan(KEPT_MS + 500);
  const before = pings;
  const answers = await Promise.all(Array.from({ length: 50 }, healthz));
  expect(new Set(answers)).toEqual(new Set(['503 {"status":"unavailable"}']));
  expect(pings - before).toBeLessThanOrEqual(1);
  expect(lines.filter((l) => l.msg === 'healthz: database unavailable').length).toBeLessThanOrEqual(2);
  down = false;
  const t1 = performance.now();
  while ((await healthz()) !== '200 {"status":"ok"}') await new Promise((r) => setTimeout(r, 50));
  expect(performance.now() - t1).toBeLessThan(KEPT_MS + 500);
});

it('answers 503 at once when the listener is stopping, whatever the last ping said', async () => {
  expect(await healthz()).toBe('200 {"status":"ok"}');
  server.health.shutdown();
  expect(await healthz()).toBe('503 {"status":"unavailable"}');
});
