/**
 * The gateway's direct EnqueueJob path (server/transport/gateway-enqueue.ts) answers exactly as
 * Connect's handler does: the same requests, good and bad, sent to a listener that takes the
 * direct path and to one that sends everything through Connect, give the same status, headers and
 * body (job ids and times aside, where each side made its own job).
 */
import pino from 'pino';
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { AgentHub } from '../server/core/agent-hub.js';
import { keyCreate } from '../server/store/index.js';
import { ENQUEUE_PATH, takesDirectPath } from '../server/transport/gateway-enqueue.js';
import { listenHttp, type HttpServer } from '../server/transport/http.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();
const log = pino({ level: 'silent' });
let direct: HttpServer;
let viaConnect: HttpServer;
let readOnly: string;
let enqueuer: string;

beforeAll(async () => {
  const hub = new AgentHub(t.pool, log, { leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 });
  const deps = { db: t.pool, hub, log, leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 };
  direct = await listenHttp(deps, '127.0.0.1:0');
  viaConnect = await listenHttp({ ...deps, directEnqueue: false }, '127.0.0.1:0');
  const made = await keyCreate(t.pool, { name: 'reader', scopes: ['read'] });
  if (made.outcome !== 'ok') throw new Error(JSON.stringify(made));
  readOnly = made.value.key;
  const writer = await keyCreate(t.pool, { name: 'n8n', scopes: ['enqueue'] });
  if (writer.outcome !== 'ok') throw new Error(JSON.stringify(writer));
  enqueuer = writer.value.key;
});
afterAll(async () => {
  await direct?.close();
  await viaConnect?.close();
});

interface Sent {
  method?: string;
  headers?: Record<string, string>;
  body?: string;
}

const json = (body: unknown, token: string | null = enqueuer, more: Record<string, string> = {}): Sent => ({
  body: typeof body === 'string' ? body : JSON.stringify(body),
  headers: { 'content-type': 'application/json', ...(token ? { authorization: `Bearer ${token}` } : {}), ...more },
});

/** What an answer says, with what differs between two new jobs (ids, times) blanked. */
async function send(server: HttpServer, s: Sent): Promise<{ status: number; headers: Record<string, string>; body: string }> {
  const res = await fetch(`http://127.0.0.1:${server.address.port}${ENQUEUE_PATH}`, {
    method: s.method ?? 'POST',
    headers: s.headers ?? {},
    ...(s.body !== undefined ? { body: s.body } : {}),
  });
  const headers: Record<string, string> = {};
  res.headers.forEach((v, k) => {
    if (k !== 'date') headers[k] = v;
  });
  const body = (await res.text())
    .replace(/[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}/g, '<uuid>')
    .replace(/\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z/g, '<time>');
  if (headers['content-length']) headers['content-length'] = '<n>';
  return { status: res.status, headers, body };
}

async function both(s: Sent) {
  const a = await send(direct, s);
  const b = await send(viaConnect, s);
  expect(a).toEqual(b);
  return a;
}

describe('the direct EnqueueJob path answers as Connect does', () => {
  it('new jobs, with every field', async () => {
    expect((await both(json({ queue: 'direct', payload: { a: 1 } }))).status).toBe(200);
    const full = await both(
      json({
        queue: 'direct',
        payload: { nested: { list: [1, 'two', null, true] } },
        priority: 7,
        maxAttempts: 3,
        runAt: '2030-01-01T00:00:00Z',
        executionTimeout: '30s',
        labels: { os: 'windows' },
        notifyUrl: 'https://example.com/hook',
        notifyHeader: { name: 'X-Token', value: 'secret' },
      }),
    );
    expect(full.status).toBe(200);
    expect(JSON.parse(full.body)).toMatchObject({ outcome: 'OUTCOME_OK', job: { queue: 'direct', priority: 7, maxAttempts: 3, status: 'JOB_STATUS_QUEUED' } });
    expect((await both(json({ queue: 'direct', payload: {} }, enqueuer, { 'content-type': 'application/json; charset=utf-8' }))).status).toBe(200);
  });

  it('a repeated idempotency key: the same job, or a conflict', async () => {
    const first = await send(viaConnect, json({ queue: 'direct', payload: { n: 1 }, idempotencyKey: 'direct-key' }));
    expect(first.status).toBe(200);
    const again = await both(json({ queue: 'direct', payload: { n: 1 }, idempotencyKey: 'direct-key' }));
    expect([again.status, JSON.parse(again.body).outcome]).toEqual([200, 'OUTCOME_DUPLICATE']);
    const other = await both(json({ queue: 'direct', payload: { n: 2 }, idempotencyKey: 'direct-key' }));
    expect([other.status, JSON.parse(other.body).outcome]).toEqual([409, 'conflict']);
  });

  it('bad input, bad credentials, other protocols', async () => {
    const answers = [
      await both(json('{')),
      await both(json('')),
      await both(json({ queue: 'direct', payload: {}, colour: 'red' })),
      await both(json({ queue: 'direct', payload: {}, priority: 'high' })),
      await both(json({ queue: 'no spaces allowed', payload: {} })),
      await both(json({ queue: 'direct', payload: { big: 'x'.repeat(300 * 1024) } })),
      await both(json({ queue: 'direct', payload: {} }, null)),
      await both(json({ queue: 'direct', payload: {} }, 'lh_key_unknown')),
      await both(json({ queue: 'direct', payload: {} }, readOnly)),
      await both({ ...json({ queue: 'direct', payload: {} }), headers: { 'content-type': 'text/plain', authorization: `Bearer ${enqueuer}` } }),
      await both({ method: 'GET', headers: { authorization: `Bearer ${enqueuer}` } }),
      await both(json({ queue: 'direct', payload: {} }, enqueuer, { 'connect-timeout-ms': '5000' })),
      await both(json({ queue: 'direct', payload: {} }, enqueuer, { 'content-encoding': 'br' })),
    ];
    expect(answers.map((a) => a.status)).toEqual([400, 400, 400, 400, 400, 413, 401, 401, 403, 415, 405, 200, 501]);
  });
});

describe('which path a call takes', () => {
  it('a plain JSON enqueue takes the direct path: Connect aborts its handler context after every call, the direct path has none', async () => {
    const abort = vi.spyOn(AbortController.prototype, 'abort');
    try {
      expect((await send(direct, json({ queue: 'direct', payload: {} }))).status).toBe(200);
      expect(abort).not.toHaveBeenCalled();
      expect((await send(viaConnect, json({ queue: 'direct', payload: {} }))).status).toBe(200);
      expect(abort).toHaveBeenCalled();
    } finally {
      abort.mockRestore();
    }
  });
});

describe('takesDirectPath', () => {
  const h = (o: Record<string, string>) => new Headers(o);
  it('takes only what Connect would read as a plain JSON POST', () => {
    expect(takesDirectPath('POST', h({ 'content-type': 'application/json' }))).toBe(true);
    expect(takesDirectPath('POST', h({ 'content-type': 'Application/JSON; charset=utf-8' }))).toBe(true);
    expect(takesDirectPath('POST', h({ 'content-type': 'application/json;charset=utf8' }))).toBe(true);
    expect(takesDirectPath('GET', h({ 'content-type': 'application/json' }))).toBe(false);
    expect(takesDirectPath('POST', h({}))).toBe(false);
    expect(takesDirectPath('POST', h({ 'content-type': 'application/proto' }))).toBe(false);
    expect(takesDirectPath('POST', h({ 'content-type': 'application/connect+json' }))).toBe(false);
    expect(takesDirectPath('POST', h({ 'content-type': 'application/json', 'content-encoding': 'gzip' }))).toBe(false);
    expect(takesDirectPath('POST', h({ 'content-type': 'application/json', 'connect-timeout-ms': '100' }))).toBe(false);
  });
});
