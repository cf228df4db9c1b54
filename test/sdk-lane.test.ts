/**
 * The agent SDK's stream client (agent-client/src/lane.ts) against scripted HTTP/2 servers: the
 * frames it writes and reads however the bytes are cut, and every way a call ends, reported as
 * grpc-js reported it (the code the session decides on: a refusal for good, a reconnect): the
 * status in the trailers or in a trailers-only answer, an HTTP status without one, a reset, a
 * dropped connection, a cancel, a compressed or oversized message, a PING left unanswered. The
 * SDK's tests against a real coordinator (sdk*.test.ts, agent-*.test.ts) run over it too.
 */
import http2 from 'node:http2';
import type { AddressInfo } from 'node:net';
import { create, toBinary } from '@bufbuild/protobuf';
import { afterEach, describe, expect, it, vi } from 'vitest';
import { CoordinatorChannel, grpc } from '../agent-client/src/channel.js';
import { getEventListeners } from 'node:events';
import { AgentMessageSchema, ServerMessageSchema, type ServerMessage } from '../agent-client/src/gen/leasehold/v1/agent_service_pb.js';
import { AGENT_CONNECT_PATH, LaneConnection, MAX_RECEIVE_BYTES, proxyConfigured } from '../agent-client/src/lane.js';
import { fromBinary } from '@bufbuild/protobuf';
import type { AgentStream } from '../agent-client/src/session.js';
import { waitFor, within } from './helpers/coordinator.js';
import { deferred } from './helpers/deferred.js';
import { startProxy } from './helpers/tcp-proxy.js';

const servers: http2.Http2Server[] = [];
/** The port of the server `serve` started last. */
let lastPort = 0;
const lanes: LaneConnection[] = [];

afterEach(async () => {
  for (const l of lanes.splice(0)) l.close();
  await Promise.all(servers.splice(0).map((s) => new Promise<void>((r) => s.close(() => r()))));
});

/** An h2c server whose agent streams `script` answers; its sessions are closed after the test. */
async function serve(
  script: (stream: http2.ServerHttp2Stream, headers: http2.IncomingHttpHeaders, session: http2.ServerHttp2Session) => void,
  keepalive?: { everyMs: number; timeoutMs: number },
): Promise<LaneConnection> {
  const server = http2.createServer();
  const sessions = new Set<http2.ServerHttp2Session>();
  server.on('session', (s) => {
    sessions.add(s);
    s.on('close', () => sessions.delete(s));
  });
  server.on('stream', (stream, headers) => {
    stream.on('error', () => undefined); // a stream the script resets errs on this side too
    script(stream, headers, stream.session as http2.ServerHttp2Session);
  });
  const close = server.close.bind(server);
  server.close = ((cb?: (err?: Error) => void) => {
    for (const s of sessions) s.destroy();
    return close(cb);
  }) as typeof server.close;
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', () => r()));
  servers.push(server);
  lastPort = (server.address() as AddressInfo).port;
  const lane = new LaneConnection(`127.0.0.1:${lastPort}`, false, undefined, keepalive);
  lanes.push(lane);
  return lane;
}

const frame = (bytes: Uint8Array, flag = 0) => {
  const f = Buffer.alloc(5 + bytes.length);
  f[0] = flag;
  f.writeUInt32BE(bytes.length, 1);
  f.set(bytes, 5);
  return f;
};
const renewed = (seq: bigint) => toBinary(ServerMessageSchema, create(ServerMessageSchema, { kind: { case: 'renewed', value: { attemptIds: ['a'], seq } } }));

/** What a stream gave: its messages, and how it ended. */
function outcome(call: AgentStream): Promise<{ messages: ServerMessage[]; end: 'end' | grpc.ServiceError }> {
  const messages: ServerMessage[] = [];
  return new Promise((resolve) => {
    let ended = false;
    const done = (end: 'end' | grpc.ServiceError) => {
      expect(ended, 'a call ends once').toBe(false);
      ended = true;
      // A moment more: no second end, no message after it.
      setTimeout(() => resolve({ messages, end }), 50);
    };
    call.on('data', (m: ServerMessage) => {
      expect(ended).toBe(false);
      messages.push(m);
    });
    call.on('error', (e: grpc.ServiceError) => done(e));
    call.on('end', () => done('end'));
  });
}

const codeOf = (end: 'end' | grpc.ServiceError) => (end === 'end' ? 'end' : grpc.status[end.code]);

describe('the SDK stream client', () => {
  it('sends no keepalive PING on a connection destroyed whose close has not come yet (ping() threw out of a timer and ended the agent: CI, 2026-12-06)', async () => {
    vi.useFakeTimers({ toFake: ['setInterval', 'clearInterval'] });
    try {
      const lane = await serve((stream) => stream.respond({ ':status': 200, 'content-type': 'application/grpc+proto' }), { everyMs: 1000, timeoutMs: 500 });
      const ended = outcome(lane.connect());
      const session = (lane as unknown as { session: http2.ClientHttp2Session }).session;
      if (session.connecting) await new Promise((r) => session.once('connect', r));
      session.destroy(); // as a keepalive's or a cut's drop does; 'close' comes after the socket's
      expect(session.destroyed).toBe(true);
      expect(() => vi.advanceTimersByTime(1000), 'the keepalive timer, due in between').not.toThrow();
      expect(codeOf((await ended).end)).toBe('UNAVAILABLE');
    } finally {
      vi.useRealTimers();
    }
  });

  it('writes gRPC frames of the hand encoder, and reads messages however the bytes are cut', async () => {
    const received: Buffer[] = [];
    let seen: http2.IncomingHttpHeaders = {};
    const lane = await serve((stream, headers) => {
      seen = headers;
      stream.on('data', (b: Buffer) => received.push(b));
      stream.on('end', () => {
        stream.respond({ ':status': 200, 'content-type': 'application/grpc+proto' }, { waitForTrailers: true });
        stream.on('wantTrailers', () => stream.sendTrailers({ 'grpc-status': '0' }));
        const bytes = Buffer.concat([frame(renewed(1n)), frame(renewed(2n)), frame(renewed(3n))]);
        // One byte at a time for the first message, then the rest at once.
        const first = frame(renewed(1n)).length;
        let i = 0;
        const drip = () => {
          if (i < first) {
            stream.write(bytes.subarray(i, i + 1));
            i++;
            setImmediate(drip);
          } else stream.end(bytes.subarray(first));
        };
        drip();
      });
    });
    const call = lane.connect();
    const result = outcome(call);
    call.write({ kind: { case: 'credit', value: { n: 3 } } });
    call.write({ kind: { case: 'started', value: { attemptIds: ['x', 'y'], seq: 9n } } });
    call.end();
    const r = await result;
    expect(r.end).toBe('end');
    expect(r.messages.map((m) => (m.kind.case === 'renewed' ? m.kind.value.seq : -1n))).toEqual([1n, 2n, 3n]);
    expect(seen[':path']).toBe(AGENT_CONNECT_PATH);
    expect(seen['content-type']).toBe('application/grpc+proto');
    expect(seen.te).toBe('trailers');
    // Two frames, each decoding to what was written.
    const all = Buffer.concat(received);
    const first = all.readUInt32BE(1);
    const m1 = fromBinary(AgentMessageSchema, all.subarray(5, 5 + first));
    const m2 = fromBinary(AgentMessageSchema, all.subarray(10 + first, 10 + first + all.readUInt32BE(6 + first)));
    expect(m1.kind).toEqual({ case: 'credit', value: expect.objectContaining({ n: 3 }) });
    expect(m2.kind).toEqual({ case: 'started', value: expect.objectContaining({ attemptIds: ['x', 'y'], seq: 9n }) });
    expect(all.length).toBe(10 + first + all.readUInt32BE(6 + first));
  });

  it('ends with the status in the trailers, or in a trailers-only answer, its message decoded', async () => {
    const inTrailers = await serve((stream) => {
      stream.respond({ ':status': 200, 'content-type': 'application/grpc+proto' }, { waitForTrailers: true });
      stream.on('wantTrailers', () => stream.sendTrailers({ 'grpc-status': String(grpc.status.PERMISSION_DENIED), 'grpc-message': 'queue%20not%20allowed', 'x-why': 'a' }));
      stream.end(frame(renewed(1n)));
    });
    const a = await outcome(inTrailers.connect());
    expect(a.messages).toHaveLength(1);
    expect(codeOf(a.end)).toBe('PERMISSION_DENIED');
    expect((a.end as grpc.ServiceError).details).toBe('queue not allowed');
    expect((a.end as grpc.ServiceError).metadata.get('x-why')).toEqual(['a']);

    // The Hello refused while the agent has not ended its side (the session never does).
    const trailersOnly = await serve((stream) => {
      stream.respond({ ':status': 200, 'content-type': 'application/grpc+proto', 'grpc-status': String(grpc.status.UNAUTHENTICATED), 'grpc-message': 'bad token' }, { endStream: true });
    });
    const call = trailersOnly.connect();
    const b = outcome(call);
    call.write({ kind: { case: 'credit', value: { n: 1 } } });
    expect(codeOf((await b).end)).toBe('UNAUTHENTICATED');
    expect(((await b).end as grpc.ServiceError).details).toBe('bad token');
  });

  it('maps an HTTP status without grpc-status as gRPC does, and a reset or a dropped connection to a code', async () => {
    for (const [status, code] of [
      [503, 'UNAVAILABLE'],
      [401, 'UNAUTHENTICATED'],
      [404, 'UNIMPLEMENTED'],
      [500, 'UNKNOWN'],
    ] as const) {
      const lane = await serve((stream) => stream.respond({ ':status': status }, { endStream: true }));
      expect(codeOf((await outcome(lane.connect())).end), String(status)).toBe(code);
    }
    const reset = await serve((stream) => stream.close(http2.constants.NGHTTP2_REFUSED_STREAM));
    expect(codeOf((await outcome(reset.connect())).end)).toBe('UNAVAILABLE');
    const internal = await serve((stream) => stream.close(http2.constants.NGHTTP2_INTERNAL_ERROR));
    expect(codeOf((await outcome(internal.connect())).end)).toBe('INTERNAL');
    const dropped = await serve((stream, _h, session) => {
      stream.respond({ ':status': 200, 'content-type': 'application/grpc+proto' });
      stream.write(frame(renewed(1n)), () => session.destroy());
    });
    const d = await outcome(dropped.connect());
    expect(d.messages).toHaveLength(1);
    expect(codeOf(d.end)).toBe('UNAVAILABLE');
    // Nothing listening: a connection refused is UNAVAILABLE too (the session retries).
    const nowhere = new LaneConnection('127.0.0.1:1', false, undefined);
    lanes.push(nowhere);
    expect(codeOf((await outcome(nowhere.connect())).end)).toBe('UNAVAILABLE');
  });

  it('ends a canceled call with CANCELLED on a later tick, and the coordinator sees the reset', async () => {
    let reset: number | undefined;
    const closed = new Promise<void>((r) => {
      void serve((stream) => {
        stream.respond({ ':status': 200, 'content-type': 'application/grpc+proto' });
        stream.on('close', () => {
          reset = stream.rstCode;
          r();
        });
      }).then((lane) => {
        const call = lane.connect();
        let sync = true;
        const o = outcome(call);
        call.on('error', () => expect(sync).toBe(false));
        setTimeout(() => {
          call.cancel();
          sync = false;
          void o.then((x) => expect(codeOf(x.end)).toBe('CANCELLED'));
        }, 50);
      });
    });
    await closed;
    expect(reset).toBe(http2.constants.NGHTTP2_CANCEL);
  });

  it('refuses a compressed message and one over the size limit, after the messages before them', async () => {
    const compressed = await serve((stream) => {
      stream.respond({ ':status': 200, 'content-type': 'application/grpc+proto' });
      stream.write(Buffer.concat([frame(renewed(1n)), frame(renewed(2n), 1)]));
    });
    const c = await outcome(compressed.connect());
    expect(c.messages).toHaveLength(1);
    expect(codeOf(c.end)).toBe('INTERNAL');
    const huge = await serve((stream) => {
      stream.respond({ ':status': 200, 'content-type': 'application/grpc+proto' });
      const head = Buffer.alloc(5);
      head.writeUInt32BE(MAX_RECEIVE_BYTES + 1, 1);
      stream.write(Buffer.concat([frame(renewed(1n)), head]));
    });
    const h = await outcome(huge.connect());
    expect(h.messages).toHaveLength(1);
    expect(codeOf(h.end)).toBe('RESOURCE_EXHAUSTED');
    const garbage = await serve((stream) => {
      stream.respond({ ':status': 200, 'content-type': 'application/grpc+proto' });
      stream.write(frame(Buffer.from([0xff, 0xff, 0xff])));
    });
    expect(codeOf((await outcome(garbage.connect())).end)).toBe('INTERNAL');
  });

  it('drops a connection whose PING goes unanswered, and opens a new one for the next stream', async () => {
    let streams = 0;
    await serve((stream) => {
      streams++;
      stream.respond({ ':status': 200, 'content-type': 'application/grpc+proto' });
    });
    const proxy = await startProxy(lastPort);
    // A PING unanswered for 1 s ends the connection: long enough that a stall of this process
    // (client, proxy and server share its event loop) does not drop a healthy one.
    const lane = new LaneConnection(`127.0.0.1:${proxy.port}`, false, undefined, { everyMs: 100, timeoutMs: 1000 });
    lanes.push(lane);
    const streamsReach = (n: number) => waitFor(`${n} streams at the server`, () => streams >= n, 5_000);
    try {
      const first = lane.connect();
      const f = outcome(first);
      await streamsReach(1);
      // PINGs answered meanwhile (one every 100 ms, each given 1 s): the stream stays open.
      await new Promise((r) => setTimeout(r, 1500));
      expect(await Promise.race([f.then(() => 'ended'), new Promise((r) => setImmediate(() => r('open')))])).toBe('open');
      expect(streams).toBe(1);
      // The network goes silent, the connection stays open: only an unanswered PING can tell.
      const t0 = performance.now();
      proxy.blackhole();
      const { end } = await within(f, 3000, 'the stream did not end after the network went silent');
      expect(codeOf(end)).toBe('UNAVAILABLE');
      expect((end as grpc.ServiceError).details).toMatch(/PING/);
      expect(performance.now() - t0).toBeLessThan(3000);
      proxy.cutAll();
      const second = lane.connect();
      const s = outcome(second);
      await streamsReach(2);
      second.cancel();
      expect(codeOf((await s).end)).toBe('CANCELLED');
    } finally {
      await proxy.close();
    }
  });

  it('makes a unary call on the same connection: the token, the deadline, one answer; a cancel and a missing answer as grpc-js reports them', async () => {
    let seen: http2.IncomingHttpHeaders = {};
    let streams = 0;
    const lane = await serve((stream, headers) => {
      streams++;
      seen = headers;
      const body: Buffer[] = [];
      stream.on('data', (b: Buffer) => body.push(b));
      stream.on('end', () => {
        const req = Buffer.concat(body);
        stream.respond({ ':status': 200, 'content-type': 'application/grpc+proto' }, { waitForTrailers: true });
        stream.on('wantTrailers', () => stream.sendTrailers({ 'grpc-status': '0' }));
        // Echoes the request's message, or answers nothing for an empty one.
        if (req.readUInt32BE(1) > 0) stream.end(req);
        else stream.end();
      });
    });
    const echo = await lane.unary('/leasehold.v1.AttemptService/ReserveStep', 'tok', Buffer.from('hello'), (b) => b.toString());
    expect(echo).toBe('hello');
    expect(seen.authorization).toBe('Bearer tok');
    expect(seen['grpc-timeout']).toBe('30000m');
    expect(seen[':path']).toBe('/leasehold.v1.AttemptService/ReserveStep');
    const none = await lane.unary('/x.Y/Z', 'tok', Buffer.alloc(0), (b) => b).catch((e: grpc.ServiceError) => e);
    expect(codeOf(none as grpc.ServiceError)).toBe('UNIMPLEMENTED');
    expect(streams).toBe(2);
    const aborted = new AbortController();
    aborted.abort();
    const early = await lane.unary('/x.Y/Z', 'tok', Buffer.from('a'), (b) => b).catch((e: grpc.ServiceError) => e);
    expect(early).toBeInstanceOf(Buffer);
    const pre = await lane.unary('/x.Y/Z', 'tok', Buffer.from('a'), (b) => b, aborted.signal).catch((e: grpc.ServiceError) => e);
    expect(codeOf(pre as grpc.ServiceError)).toBe('CANCELLED');
    // Aborted while the coordinator has not answered: CANCELLED, and the stream is reset.
    const reset = deferred<number>();
    const silent = await serve((stream) => stream.on('close', () => reset.resolve(stream.rstCode)));
    const later = new AbortController();
    setTimeout(() => later.abort(), 50);
    const mid = await silent.unary('/x.Y/Z', 'tok', Buffer.from('a'), (b) => b, later.signal).catch((e: grpc.ServiceError) => e);
    expect(codeOf(mid as grpc.ServiceError)).toBe('CANCELLED');
    expect(await within(reset.promise, 2000, 'no reset')).toBe(http2.constants.NGHTTP2_CANCEL);
  });

  it('holds fifty calls at once on one connection without a listener a call on it, and a dropped connection ends each UNAVAILABLE', async () => {
    const warnings: Error[] = [];
    const onWarning = (w: Error) => warnings.push(w);
    process.on('warning', onWarning);
    try {
      // Answers nothing until all fifty are open, then echoes each; or, told to, drops the
      // connection with them open.
      let drop = false;
      const open: Array<{ stream: http2.ServerHttp2Stream; body: Buffer }> = [];
      const lane = await serve((stream, _headers, session) => {
        const body: Buffer[] = [];
        stream.on('data', (b: Buffer) => body.push(b));
        stream.on('end', () => {
          open.push({ stream, body: Buffer.concat(body) });
          if (open.length < 50) return;
          // A reset connection (TCP RST): the client's connection errs (ECONNRESET).
          if (drop) return void (session.socket as unknown as { resetAndDestroy(): void }).resetAndDestroy();
          for (const o of open.splice(0)) {
            o.stream.respond({ ':status': 200, 'content-type': 'application/grpc+proto' }, { waitForTrailers: true });
            o.stream.on('wantTrailers', () => o.stream.sendTrailers({ 'grpc-status': '0' }));
            o.stream.end(o.body);
          }
        });
      });
      const fifty = () => Array.from({ length: 50 }, (_, i) => lane.unary('/x.Y/Z', 'tok', Buffer.from(`m${i}`), (b) => b.toString()));
      expect(await Promise.all(fifty())).toEqual(Array.from({ length: 50 }, (_, i) => `m${i}`));
      drop = true;
      const ends = await Promise.all(fifty().map((p) => p.then(() => 'answered', (e: grpc.ServiceError) => `${grpc.status[e.code]}: ${e.details.split(':')[0]}`)));
      expect(new Set(ends)).toEqual(new Set(['UNAVAILABLE: Connection dropped']));
      await new Promise((r) => setTimeout(r, 20)); // a warning is emitted on a later tick
      expect(warnings.map((w) => `${w.name}: ${w.message}`)).toEqual([]);
    } finally {
      process.off('warning', onWarning);
    }
  });

  it('leaves the stream to grpc-js when a proxy is configured (which grpc-js goes through, and this does not)', () => {
    expect(proxyConfigured({})).toBe(false);
    expect(proxyConfigured({ grpc_proxy: 'http://proxy:3128' })).toBe(true);
    expect(proxyConfigured({ https_proxy: 'http://proxy:3128' })).toBe(true);
    expect(proxyConfigured({ http_proxy: 'http://proxy:3128' })).toBe(true);
  });
});

describe('the step ledger through grpc-js (an HTTP proxy configured)', () => {
  it("leaves no listener on the attempt's signal after each call, and sends nothing once it is aborted", async () => {
    const saved = { http_proxy: process.env.http_proxy, no_proxy: process.env.no_proxy };
    // A proxy configured, 127.0.0.1 exempt: grpc-js, connecting directly (to a port nobody listens on).
    process.env.http_proxy = 'http://127.0.0.1:9';
    process.env.no_proxy = '127.0.0.1';
    const ch = new CoordinatorChannel('http://127.0.0.1:1', 'token');
    try {
      const abort = new AbortController();
      const req = { attemptId: '01a24a00-0000-7000-8000-0000000000a1', step: 's' };
      // As a step retried while the coordinator is away: one call after another on one signal.
      for (let i = 0; i < 12; i++) await expect(ch.reserveStep(req, abort.signal)).rejects.toMatchObject({ code: grpc.status.UNAVAILABLE });
      expect(getEventListeners(abort.signal, 'abort')).toHaveLength(0);
      abort.abort();
      await expect(ch.reserveStep(req, abort.signal)).rejects.toMatchObject({ code: grpc.status.CANCELLED });
    } finally {
      ch.close();
      for (const [k, v] of Object.entries(saved)) {
        if (v === undefined) delete process.env[k];
        else process.env[k] = v;
      }
    }
  });
});
