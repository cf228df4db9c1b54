/**
 * What a caller without a key can make the listeners hold, over real sockets. A call that needs a
 * key is answered from its headers before its body is read (401, UNAUTHENTICATED), on the HTTP
 * gateway and on the gRPC listener: a body declared at 1 MiB (HTTP) or 8 MiB (gRPC) and never
 * sent in full was waited for, and buffered, before the key was looked at. The services open to
 * anyone (health, reflection) read at most `OPEN_READ_MAX_BYTES`. A body that does not arrive in
 * full within the body deadline ends its call (gRPC: reset; HTTP: 408, connection closed), but an
 * agent's stream lives on. A JSON body nested past `BODY_DEPTH_MAX` is refused before it is
 * parsed. HTTP/2 connections announce `MAX_CONCURRENT_STREAMS`. What a refused HTTP caller still
 * sends is read and dropped, so Caddy and nginx (deploy/), streaming it on, pass the 401 on.
 */
import { readFile } from 'node:fs/promises';
import http2 from 'node:http2';
import net from 'node:net';
import pino from 'pino';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { AgentHub } from '../server/core/agent-hub.js';
import { BODY_DEPTH_MAX, HTTP_DISCARD_MAX_BYTES, jsonDepthOver, listenHttp, type HttpServer } from '../server/transport/http.js';
import { listenGrpc, MAX_CONCURRENT_STREAMS, OPEN_READ_MAX_BYTES, type GrpcServer } from '../server/transport/server.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, useCoordinator } from './helpers/coordinator.js';
import { missing, request, startCaddy, startNginx, type RunningProxy, type Upstreams } from './helpers/proxies.js';
import { grpc, RawAgent, rawClient, unary } from './helpers/raw-agent.js';

const t = useTestDb();
const lh = useCoordinator(t);

const LIST_JOBS = '/leasehold.v1.JobService/ListJobs';
const ENQUEUE = '/leasehold.v1.JobService/EnqueueJob';
const HEALTH_CHECK = '/grpc.health.v1.Health/Check';

/** `promise`'s value, or `'timeout'` after `ms`. */
async function within<T>(promise: Promise<T>, ms: number): Promise<T | 'timeout'> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<'timeout'>((resolve) => (timer = setTimeout(() => resolve('timeout'), ms)));
  try {
    return await Promise.race([promise, late]);
  } finally {
    clearTimeout(timer);
  }
}

interface RawAnswer {
  status: number;
  headers: Record<string, string>;
  body: string;
}

/** One HTTP/1.1 connection written by hand: the answers on it, and when the server closed it. */
class RawHttp {
  readonly socket: net.Socket;
  /** Milliseconds from the connection until the server ended it. */
  readonly closed: Promise<number>;
  private readonly opened = Date.now();
  private data = Buffer.alloc(0);
  private readonly answers: RawAnswer[] = [];
  private waiter: (() => void) | undefined;

  constructor(port: number) {
    this.socket = net.connect(port, '127.0.0.1');
    this.socket.on('error', () => {});
    this.closed = new Promise((resolve) => this.socket.once('close', () => resolve(Date.now() - this.opened)));
    this.socket.on('data', (chunk: Buffer) => {
      this.data = Buffer.concat([this.data, chunk]);
      for (let a = this.parse(); a; a = this.parse()) this.answers.push(a);
      this.waiter?.();
    });
  }

  /** The next answer not taken yet. */
  async answer(): Promise<RawAnswer> {
    while (this.answers.length === 0) await new Promise<void>((resolve) => (this.waiter = resolve));
    return this.answers.shift()!;
  }

  write(data: string | Buffer): this {
    this.socket.write(data);
    return this;
  }

  destroy(): void {
    this.socket.destroy();
  }

  /** The first complete answer in what was received, if any (dropped from the buffer). */
  private parse(): RawAnswer | undefined {
    const end = this.data.indexOf('\r\n\r\n');
    if (end < 0) return undefined;
    const [statusLine, ...lines] = this.data.subarray(0, end).toString('latin1').split('\r\n');
    const headers: Record<string, string> = {};
    for (const l of lines) {
      const i = l.indexOf(':');
      headers[l.slice(0, i).trim().toLowerCase()] = l.slice(i + 1).trim();
    }
    const length = Number(headers['content-length'] ?? 0);
    if (this.data.length < end + 4 + length) return undefined;
    const body = this.data.subarray(end + 4, end + 4 + length).toString('utf8');
    this.data = this.data.subarray(end + 4 + length);
    return { status: Number(statusLine!.split(' ')[1]), headers, body };
  }
}

const post = (path: string, headers: Record<string, string | number>) =>
  `POST ${path} HTTP/1.1\r\nHost: 127.0.0.1\r\n${Object.entries(headers)
    .map(([k, v]) => `${k}: ${v}\r\n`)
    .join('')}\r\n`;

interface GrpcEnd {
  /** The gRPC status, from a trailers-only answer or the trailers; undefined when the stream was reset without one. */
  status: string | undefined;
  message: string | undefined;
  /** The RST_STREAM code the stream closed with (0 when it ended cleanly). */
  rstCode: number;
  ms: number;
}

/** One gRPC call on `session` written by hand: its headers, then `chunks`, the body left unfinished unless `end`. */
function grpcCall(session: http2.ClientHttp2Session, path: string, headers: Record<string, string>, chunks: Buffer[], end = false): Promise<GrpcEnd> {
  const opened = Date.now();
  const stream = session.request({ ':method': 'POST', ':path': path, 'content-type': 'application/grpc', te: 'trailers', ...headers });
  let status: string | undefined;
  let message: string | undefined;
  const take = (h: http2.IncomingHttpHeaders) => {
    if (h['grpc-status'] !== undefined) status = String(h['grpc-status']);
    if (h['grpc-message'] !== undefined) message = decodeURIComponent(String(h['grpc-message']));
  };
  stream.on('response', take);
  stream.on('trailers', take);
  stream.on('error', () => {});
  stream.resume();
  for (const c of chunks) stream.write(c);
  if (end) stream.end();
  return new Promise((resolve) => stream.once('close', () => resolve({ status, message, rstCode: stream.rstCode ?? 0, ms: Date.now() - opened })));
}

/** A gRPC frame header declaring a message of `length` bytes. */
function frameHead(length: number): Buffer {
  const b = Buffer.alloc(5);
  b.writeUInt32BE(length, 1);
  return b;
}

const sessions: http2.ClientHttp2Session[] = [];
const raws: RawHttp[] = [];
const agents: RawAgent[] = [];
afterEach(() => {
  for (const s of sessions.splice(0)) s.destroy();
  for (const r of raws.splice(0)) r.destroy();
  for (const a of agents.splice(0)) a.close();
});
const connect = (url: string) => {
  const s = http2.connect(url);
  s.on('error', () => {});
  sessions.push(s);
  return s;
};
const raw = (port: number) => {
  const r = new RawHttp(port);
  raws.push(r);
  return r;
};

describe('the HTTP gateway, without a key', () => {
  it('answers 401 at once to a call declaring a 1 MiB body and sending 1 KB; the rest is read away and the connection serves on', async () => {
    const port = lh.c.http.address.port;
    for (const [authorization, message] of [
      [undefined, 'missing "Authorization: Bearer <key>"'],
      ['Bearer lh_key_not-a-real-key', 'unknown key or token'],
    ] as const) {
      const r = raw(port).write(post(LIST_JOBS, { 'content-type': 'application/json', 'content-length': 1024 * 1024, ...(authorization ? { authorization } : {}) }));
      r.write(Buffer.alloc(1024, 0x20));
      // Before: the gateway read the whole body first, and waited for the rest (60 s).
      const a = await within(r.answer(), 3000);
      expect(a, String(authorization)).not.toBe('timeout');
      expect(a).toMatchObject({ status: 401, headers: { connection: 'keep-alive' } });
      expect(JSON.parse((a as RawAnswer).body)).toEqual({ code: 'unauthenticated', message, status: 401, outcome: 'unauthenticated' });
      // What the client still sends is dropped (a proxy streaming it on reads the 401, not a
      // reset), and the connection takes the next request.
      r.write(Buffer.alloc(1024 * 1024 - 1024, 0x20));
      r.write('GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n');
      expect(await within(r.answer(), 3000)).toMatchObject({ status: 200, body: '{"status":"ok"}' });
    }
  });

  it(`closes the connection after the 401 when the body declared is over ${HTTP_DISCARD_MAX_BYTES} bytes`, async () => {
    const r = raw(lh.c.http.address.port).write(post(LIST_JOBS, { 'content-type': 'application/json', 'content-length': HTTP_DISCARD_MAX_BYTES + 1 }));
    expect(await within(r.answer(), 3000)).toMatchObject({ status: 401, headers: { connection: 'close' } });
    expect(await within(r.closed, 3000)).not.toBe('timeout');
  });

  it('answers 401, not 400, to a deeply nested body without a key; with a key it is refused before it is parsed', async () => {
    const deep = '['.repeat(500_000) + ']'.repeat(500_000);
    const body = `{"queue":"deep","payload":{"a":${deep}}}`;
    const none = await fetch(`${lh.httpUrl}${ENQUEUE}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body });
    expect(none.status).toBe(401);
    expect(await none.json()).toMatchObject({ outcome: 'unauthenticated' });
    // With a key, the direct path (plain JSON) and Connect's (a connect-timeout-ms header sends it there).
    for (const extra of [{}, { 'connect-timeout-ms': '10000' }] as Array<Record<string, string>>) {
      const keyed = await fetch(`${lh.httpUrl}${ENQUEUE}`, { method: 'POST', headers: { 'content-type': 'application/json', authorization: `Bearer ${ADMIN_KEY}`, ...extra }, body });
      expect(keyed.status).toBe(400);
      expect(await keyed.json()).toMatchObject({
        code: 'invalid_argument',
        outcome: 'invalid',
        message: expect.stringContaining(`nests deeper than ${BODY_DEPTH_MAX} levels`),
      });
    }
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE queue = 'deep'`)).rows[0].n).toBe(0);
  });

  it('reads at most OPEN_READ_MAX_BYTES of a call to the open health service', async () => {
    const r = raw(lh.c.http.address.port).write(post(HEALTH_CHECK, { 'content-type': 'application/json', 'content-length': 1024 * 1024 }));
    r.write('{"service":"');
    const a = await within(r.answer(), 3000);
    expect(a).toMatchObject({ status: 413 });
    expect(JSON.parse((a as RawAnswer).body)).toMatchObject({ outcome: 'too_large', limitBytes: OPEN_READ_MAX_BYTES });
    // A real health check is still answered.
    const ok = await fetch(`${lh.httpUrl}${HEALTH_CHECK}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{}' });
    expect([ok.status, await ok.json()]).toEqual([200, { status: 'SERVING' }]);
  });

  it('answers 505 to the calls that stream their answers, pointing at the gRPC listener (Health/Watch was served, and a body it could not frame was a 500)', async () => {
    for (const [path, type, body] of [
      ['/grpc.health.v1.Health/Watch', 'application/connect+json', Buffer.from([0, 0, 0, 0, 2, 0x7b, 0x7d])],
      ['/grpc.health.v1.Health/Watch', 'application/json', Buffer.from('{}')],
      ['/grpc.reflection.v1.ServerReflection/ServerReflectionInfo', 'application/connect+json', Buffer.from([0, 0, 0, 0, 2, 0x7b, 0x7d])],
    ] as const) {
      const res = await fetch(`${lh.httpUrl}${path}`, { method: 'POST', headers: { 'content-type': type }, body });
      expect([path, type, res.status]).toEqual([path, type, 505]);
      expect(await res.json()).toMatchObject({ code: 'unimplemented', message: `${path} streams its answers: call it on the gRPC listener (grpcurl, buf curl --protocol grpc)` });
    }
  });

  it('looks a key up once per call (the listener checks it before the body, the interceptor takes its answer)', async () => {
    const stats = () => ({ ...lh.c.credentials.stats });
    await fetch(`${lh.httpUrl}${LIST_JOBS}`, { method: 'POST', headers: { 'content-type': 'application/json', authorization: `Bearer ${ADMIN_KEY}` }, body: '{}' });
    const s0 = stats();
    const res = await fetch(`${lh.httpUrl}${LIST_JOBS}`, { method: 'POST', headers: { 'content-type': 'application/json', authorization: `Bearer ${ADMIN_KEY}` }, body: '{}' });
    expect(res.status).toBe(200);
    const s1 = stats();
    expect(s1.hits + s1.misses + s1.bypassed - (s0.hits + s0.misses + s0.bypassed)).toBe(1);
  });
});

describe('the gRPC listener, without a key', () => {
  it('refuses at once calls declaring 8 MiB and sending 1 KB, many on one connection', async () => {
    const s = connect(lh.url);
    const calls = Array.from({ length: 50 }, (_, i) =>
      grpcCall(s, LIST_JOBS, i % 2 ? { authorization: 'Bearer lh_key_not-a-real-key' } : {}, [frameHead(8 * 1024 * 1024 - 16), Buffer.alloc(1024)]),
    );
    // Before: each waited for its 8 MiB (buffered as they came), however long they took.
    const ends = await within(Promise.all(calls), 3000);
    expect(ends).not.toBe('timeout');
    for (const [i, e] of (ends as GrpcEnd[]).entries()) {
      expect(e).toMatchObject({ status: '16', message: i % 2 ? 'unknown key or token' : 'missing "Authorization: Bearer <key>"' });
    }
    // The connection is fine: a call with a key is served on it.
    const frame = Buffer.concat([frameHead(0)]);
    expect(await grpcCall(s, LIST_JOBS, { authorization: `Bearer ${ADMIN_KEY}` }, [frame], true)).toMatchObject({ status: '0', rstCode: 0 });
  });

  it('answers grpc-js without a key or with a refused one: UNAUTHENTICATED, the message as before', async () => {
    const client = rawClient('JobService', `127.0.0.1:${lh.port}`);
    try {
      for (const [token, details] of [
        ['', 'missing "Authorization: Bearer <key>"'],
        ['lh_key_not-a-real-key', 'unknown key or token'],
      ] as const) {
        const err = (await unary(client, 'listJobs', {}, token).catch((e: grpc.ServiceError) => e)) as grpc.ServiceError;
        expect({ code: err.code, details: err.details }).toEqual({ code: grpc.status.UNAUTHENTICATED, details });
      }
      await expect(unary(client, 'listJobs', { pageSize: 1 }, ADMIN_KEY)).resolves.toBeDefined();
    } finally {
      client.close();
    }
  });

  it('reads at most OPEN_READ_MAX_BYTES of a call to the open health service', async () => {
    const s = connect(lh.url);
    const e = await within(grpcCall(s, HEALTH_CHECK, {}, [frameHead(8 * 1024 * 1024 - 16), Buffer.alloc(64 * 1024)]), 3000);
    expect(e).toMatchObject({ status: '8' }); // RESOURCE_EXHAUSTED
    expect(await grpcCall(s, HEALTH_CHECK, {}, [frameHead(0)], true)).toMatchObject({ status: '0' });
  });

  it(`announces at most ${MAX_CONCURRENT_STREAMS} streams per connection`, async () => {
    const s = connect(lh.url);
    const settings = await new Promise<http2.Settings>((resolve) => s.once('remoteSettings', resolve));
    expect(settings.maxConcurrentStreams).toBe(MAX_CONCURRENT_STREAMS);
  });
});

describe('the body deadline (300 ms here)', () => {
  let grpcServer: GrpcServer;
  let httpServer: HttpServer;
  beforeAll(async () => {
    const log = pino({ level: 'silent' });
    const deps = { db: t.pool, log, leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000, bodyTimeoutMs: 300 };
    grpcServer = await listenGrpc({ ...deps, hub: new AgentHub(t.pool, log, deps) }, '127.0.0.1:0');
    httpServer = await listenHttp({ ...deps, hub: new AgentHub(t.pool, log, deps) }, '127.0.0.1:0');
  });
  afterAll(async () => {
    await grpcServer?.close();
    await httpServer?.close();
  });

  it('resets a gRPC call whose body has not arrived in full, with a key or to an open service', async () => {
    const s = connect(`http://127.0.0.1:${grpcServer.address.port}`);
    for (const [path, headers] of [
      [LIST_JOBS, { authorization: `Bearer ${ADMIN_KEY}` }],
      [HEALTH_CHECK, {}],
    ] as const) {
      const e = await within(grpcCall(s, path, headers, [frameHead(100), Buffer.alloc(10)]), 3000);
      expect(e, path).not.toBe('timeout');
      expect(e).toMatchObject({ status: undefined, rstCode: http2.constants.NGHTTP2_CANCEL });
      expect((e as GrpcEnd).ms).toBeGreaterThanOrEqual(250);
    }
    // A whole body is served as always.
    expect(await grpcCall(s, LIST_JOBS, { authorization: `Bearer ${ADMIN_KEY}` }, [frameHead(0)], true)).toMatchObject({ status: '0' });
  });

  it('does not cut an agent stream that lives past it', async () => {
    const token = await lh.agent('deadline-agent');
    const a = RawAgent.open(`127.0.0.1:${grpcServer.address.port}`, { agentId: 'deadline-agent', token, queues: ['deadline'], slots: 1 });
    agents.push(a);
    await a.next('welcome');
    expect(await within(a.ended, 1000)).toBe('timeout');
  });

  it('answers 408 to an HTTP request whose body has not arrived in full, and closes its connection', async () => {
    const r = raw(httpServer.address.port).write(post(LIST_JOBS, { 'content-type': 'application/json', 'content-length': 100, authorization: `Bearer ${ADMIN_KEY}` }));
    r.write('{"pa');
    const a = await within(r.answer(), 3000);
    expect(a).toMatchObject({ status: 408 });
    expect(await within(r.closed, 3000)).not.toBe('timeout');
    // A call refused for its key whose body never comes: its connection is not held past it either.
    const refused = raw(httpServer.address.port).write(post(LIST_JOBS, { 'content-type': 'application/json', 'content-length': 100 }));
    expect(await within(refused.answer(), 3000)).toMatchObject({ status: 401 });
    expect(await within(refused.closed, 3000)).not.toBe('timeout');
    // A connection that never sends its headers is closed too.
    const silent = raw(httpServer.address.port);
    expect(await within(silent.closed, 3000)).not.toBe('timeout');
  });
});

describe('open streaming calls (reflection, Health/Watch): 2 a connection, 3 in all, 3 s each here', () => {
  const REFLECTION = '/grpc.reflection.v1.ServerReflection/ServerReflectionInfo';
  const WATCH = '/grpc.health.v1.Health/Watch';
  let grpcServer: GrpcServer;
  beforeAll(async () => {
    const log = pino({ level: 'silent' });
    const deps = { db: t.pool, log, leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000, openStreams: { perConnection: 2, max: 3, maxMs: 3000 } };
    grpcServer = await listenGrpc({ ...deps, hub: new AgentHub(t.pool, log, deps) }, '127.0.0.1:0');
  });
  afterAll(() => grpcServer?.close());

  it('refuses one past either bound at once, ends each after its time, and counts none of the unary calls', async () => {
    const url = `http://127.0.0.1:${grpcServer.address.port}`;
    const [one, two] = [connect(url), connect(url)];
    // Held as a client that meant to exhaust memory would hold them: open, never ended.
    // 3 s each: what follows must be done while they are open, also on a loaded machine (at
    // 500 ms it had 300–400 ms to spare).
    const held = [grpcCall(one, REFLECTION, {}, []), grpcCall(one, REFLECTION, {}, [])];
    await new Promise((r) => setTimeout(r, 200));
    expect(await within(grpcCall(one, REFLECTION, {}, []), 1000)).toMatchObject({ status: '8', message: expect.stringMatching(/too many open reflection and health streams \(2 a connection, 3 in all\)/) });
    held.push(grpcCall(two, WATCH, {}, [frameHead(0)], true));
    await new Promise((r) => setTimeout(r, 200));
    expect(await within(grpcCall(two, REFLECTION, {}, []), 1000)).toMatchObject({ status: '8' });
    // Health/Check is unary: served while the bound is full.
    expect(await grpcCall(two, HEALTH_CHECK, {}, [frameHead(0)], true)).toMatchObject({ status: '0' });
    // Before, they stayed open for good (6,000 of them took the coordinator to 935 MB).
    const ends = await within(Promise.all(held), 6000);
    expect(ends).not.toBe('timeout');
    for (const e of ends as GrpcEnd[]) {
      expect(e.rstCode).toBe(http2.constants.NGHTTP2_CANCEL);
      expect(e.ms).toBeGreaterThanOrEqual(2900);
    }
    // Their places are free again.
    expect(await within(grpcCall(one, REFLECTION, {}, []), 300)).toBe('timeout');
  });

  it('counts no agent stream, also one that Connect serves (with a deadline) rather than the lane', async () => {
    const url = `http://127.0.0.1:${grpcServer.address.port}`;
    const s = connect(url);
    // Before, these took the open streams' places (the third refused at once: 2 a connection) and were cut after their time.
    const agentStreams = Array.from({ length: 4 }, () => grpcCall(s, '/leasehold.v1.AgentService/Connect', { 'grpc-timeout': '100S' }, []));
    // Compared as text: a failing toBe on the raced object made vitest's worker run out of memory.
    const first = await within(Promise.race(agentStreams), 900);
    expect(first === 'timeout' ? 'still open' : JSON.stringify(first)).toBe('still open');
    expect(await within(grpcCall(connect(url), REFLECTION, {}, []), 300)).toBe('timeout');
  });
});

describe('jsonDepthOver', () => {
  it('counts arrays and objects, not brackets inside strings', () => {
    const nest = (d: number) => '['.repeat(d) + ']'.repeat(d);
    const enc = (s: string) => Buffer.from(s);
    expect(jsonDepthOver(enc(nest(3)), 3)).toBe(false);
    expect(jsonDepthOver(enc(nest(4)), 3)).toBe(true);
    expect(jsonDepthOver(enc('{"a":{"b":[1,2,{"c":"[[[[[[\\"[[[["}]}}'), 4)).toBe(false);
    expect(jsonDepthOver(enc('{"a":{"b":[1,2,{"c":"[[[[[[\\"[[[["}]}}'), 3)).toBe(true);
    expect(jsonDepthOver(enc(`{"k":"é${'['.repeat(10)}"}`), 1)).toBe(false);
  });
});

describe.each([
  { name: 'caddy' as const, start: startCaddy },
  { name: 'nginx' as const, start: startNginx },
])('behind $name (deploy/)', ({ name, start }: { name: 'caddy' | 'nginx'; start: (up: Upstreams) => Promise<RunningProxy> }) => {
  const absent = missing(name);
  let proxy: RunningProxy | undefined;
  beforeAll(async () => {
    if (!absent) proxy = await start({ grpcPort: lh.port, httpPort: lh.c.http.address.port });
  });
  afterAll(async () => {
    await proxy?.dispose();
  });

  it.skipIf(absent)('passes on the 401 of a call without a key whose 1 MiB body was never read (not a 502)', async () => {
    const body = JSON.stringify({ queue: 'proxied', payload: { blob: 'x'.repeat(1024 * 1024 - 100) } });
    for (const chunked of [false, true]) {
      for (const headers of [{}, { authorization: 'Bearer lh_key_not-a-real-key' }] as Array<Record<string, string>>) {
        const r = await request(proxy!, 'POST', ENQUEUE, { body, chunked, headers: { 'content-type': 'application/json', ...headers } });
        expect(r.status, `${JSON.stringify({ chunked, headers })} ${r.body.slice(0, 300)}`).toBe(401);
        expect(JSON.parse(r.body)).toMatchObject({ code: 'unauthenticated', outcome: 'unauthenticated' });
      }
    }
    expect((await request(proxy!, 'GET', '/healthz')).status).toBe(200);
  });

  it.skipIf(absent)('passes on UNAUTHENTICATED at once to a gRPC call without a key declaring 8 MiB', async () => {
    const s = http2.connect(`https://localhost:${proxy!.port}`, { ca: await readFile(proxy!.caFile) });
    s.on('error', () => {});
    sessions.push(s);
    const e = await within(grpcCall(s, LIST_JOBS, {}, [frameHead(8 * 1024 * 1024 - 16), Buffer.alloc(1024)]), 5000);
    expect(e).toMatchObject({ status: '16', message: 'missing "Authorization: Bearer <key>"' });
    expect(await grpcCall(s, LIST_JOBS, { authorization: `Bearer ${ADMIN_KEY}` }, [frameHead(0)], true)).toMatchObject({ status: '0' });
  });
});
