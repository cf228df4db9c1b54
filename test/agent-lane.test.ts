/**
 * The gRPC listener's own lane for AgentService.Connect (server/transport/agent-lane.ts): frames
 * cut from the bytes however they arrive, the refusals Connect gives (size, compression, a
 * stream cut mid-frame), the handler's errors as trailers, the signal on a reset; which requests
 * take it (the SDK's do) and which go to Connect (and are still served there).
 */
import { mkdtemp, rm } from 'node:fs/promises';
import http2 from 'node:http2';
import os from 'node:os';
import path from 'node:path';
import pino from 'pino';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { Code, ConnectError } from '@connectrpc/connect';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { createAgent } from '@leasehold/agent-client';
import { AgentMessageSchema, ServerMessageSchema, type AgentMessage, type ServerMessage } from '../gen/leasehold/v1/agent_service_pb.js';
import { AGENT_CONNECT_PATH, forAgentLane, serveAgentLane, type AgentStreamHandler } from '../server/transport/agent-lane.js';
import { useTestDb } from './helpers/db.js';
import { useCoordinator } from './helpers/coordinator.js';

const t = useTestDb();
const lh = useCoordinator(t);
const servers: http2.Http2Server[] = [];
const dirs: string[] = [];

afterEach(async () => {
  for (const s of servers.splice(0)) await new Promise((r) => s.close(r));
});
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

/** An HTTP/2 server answering every request with `onRequest`; resolves with its port. */
async function serve(onRequest: (req: http2.Http2ServerRequest, res: http2.Http2ServerResponse) => void): Promise<number> {
  const server = http2.createServer(onRequest);
  servers.push(server);
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  return (server.address() as { port: number }).port;
}

const frame = (m: AgentMessage, flags = 0) => {
  const b = toBinary(AgentMessageSchema, m);
  const f = Buffer.alloc(5 + b.length);
  f[0] = flags;
  f.writeUInt32BE(b.length, 1);
  f.set(b, 5);
  return f;
};
const credit = (n: number) => create(AgentMessageSchema, { kind: { case: 'credit', value: { n } } });

interface Exchange {
  messages: ServerMessage[];
  trailers: http2.IncomingHttpHeaders;
  headers: http2.IncomingHttpHeaders;
}

/**
 * A gRPC call on AgentService.Connect with plain node:http2: `write` gets the request stream
 * (write frames, end, reset); resolves when the stream closes with what came back.
 */
function call(port: number, write: (s: http2.ClientHttp2Stream) => unknown, headers: http2.OutgoingHttpHeaders = {}): Promise<Exchange> {
  const session = http2.connect(`http://127.0.0.1:${port}`);
  const s = session.request({ ':method': 'POST', ':path': AGENT_CONNECT_PATH, 'content-type': 'application/grpc', te: 'trailers', ...headers });
  const out: Exchange = { messages: [], trailers: {}, headers: {} };
  let pending = Buffer.alloc(0);
  s.on('response', (h) => (out.headers = h));
  s.on('trailers', (h) => {
    out.trailers = h;
    s.end(); // as gRPC clients do: the call is over
  });
  s.on('data', (chunk: Buffer) => {
    pending = Buffer.concat([pending, chunk]);
    while (pending.length >= 5 && pending.length >= 5 + pending.readUInt32BE(1)) {
      const n = pending.readUInt32BE(1);
      out.messages.push(fromBinary(ServerMessageSchema, pending.subarray(5, 5 + n)));
      pending = pending.subarray(5 + n);
    }
  });
  s.on('error', () => undefined);
  const closed = new Promise<Exchange>((resolve) =>
    s.on('close', () => {
      session.close();
      resolve(out);
    }),
  );
  void write(s);
  return closed;
}

/** A handler that answers each Credit{n} with GoAway{detail: "credit n"}, and records how it ended. */
function echo(seen: { end?: 'done' | unknown; signal?: AbortSignal }, pace?: () => Promise<void>): AgentStreamHandler {
  return async function* (requests, signal) {
    seen.signal = signal;
    try {
      for await (const m of requests) {
        if (pace) await pace();
        yield create(ServerMessageSchema, { kind: { case: 'goAway', value: { detail: `${m.kind.case} ${m.kind.case === 'credit' ? m.kind.value.n : ''}`.trim() } } });
      }
      seen.end = 'done';
    } catch (err) {
      seen.end = err;
      throw err;
    }
  };
}
const details = (e: Exchange) => e.messages.map((m) => (m.kind.case === 'goAway' ? m.kind.value.detail : m.kind.case));

describe('the agent lane', () => {
  it('cuts frames from bytes however they arrive: one byte at a time, several in one write', async () => {
    const seen = {};
    const port = await serve((req, res) => serveAgentLane(echo(seen), req, res, 1 << 20));
    const bytes = Buffer.concat([frame(credit(1)), frame(credit(2)), frame(credit(300))]);
    const e = await call(port, async (s) => {
      for (const b of bytes.subarray(0, 9)) await new Promise<void>((r) => s.write(Buffer.from([b]), () => r()));
      s.end(bytes.subarray(9));
    });
    expect(details(e)).toEqual(['credit 1', 'credit 2', 'credit 300']);
    expect(e.headers['content-type']).toBe('application/grpc+proto');
    expect(e.trailers['grpc-status']).toBe('0');
  });

  it('delivers every message in order to a handler slower than the agent (reading pauses, then resumes)', async () => {
    const seen = {};
    const port = await serve((req, res) => serveAgentLane(echo(seen, () => new Promise((r) => setImmediate(r))), req, res, 1 << 20));
    // 300 frames of ~1 kB: more than HTTP/2's initial window, and far above the lane's high water.
    const big = (i: number) => frame(create(AgentMessageSchema, { kind: { case: 'hello', value: { agentId: `${i}-${'x'.repeat(1000)}` } } }));
    const e = await call(port, (s) => {
      for (let i = 0; i < 300; i++) s.write(big(i));
      s.end();
    });
    expect(e.messages).toHaveLength(300);
    expect(e.trailers['grpc-status']).toBe('0');
  });

  it('refuses what Connect refuses, with its codes and texts, after the messages before it', async () => {
    const cases: Array<[string, Buffer, string, string]> = [
      ['over the size limit', Buffer.from([0, 0, 0, 0, 17]), String(Code.ResourceExhausted), 'message size 17 is larger than configured readMaxBytes 16'],
      ['compressed', frame(credit(5), 1), String(Code.Internal), 'received compressed envelope, but do not know how to decompress'],
      ['cut mid-frame', frame(credit(5)).subarray(0, 4), String(Code.InvalidArgument), 'protocol error: incomplete envelope'],
      ['not an AgentMessage', Buffer.from([0, 0, 0, 0, 2, 0xff, 0xff]), String(Code.Internal), 'parse binary: '],
    ];
    for (const [what, tail, code, message] of cases) {
      const seen: { end?: unknown } = {};
      const port = await serve((req, res) => serveAgentLane(echo(seen), req, res, 16));
      const e = await call(port, (s) => s.end(Buffer.concat([frame(credit(1)), tail])));
      expect(details(e), what).toEqual(['credit 1']);
      expect(e.trailers['grpc-status'], what).toBe(code);
      expect(decodeURIComponent(String(e.trailers['grpc-message'])), what).toContain(message);
      expect(seen.end, what).toBeInstanceOf(ConnectError);
    }
  });

  it("ends with the handler's error as its status: a ConnectError as it is, anything else as INTERNAL", async () => {
    const fails = (err: unknown): AgentStreamHandler =>
      async function* (requests) {
        for await (const m of requests) {
          yield create(ServerMessageSchema, { kind: { case: 'goAway', value: { detail: m.kind.case ?? '' } } });
          throw err;
        }
      };
    let port = await serve((req, res) => serveAgentLane(fails(new ConnectError('Hello refused: token, agent', Code.Unauthenticated)), req, res, 1 << 20));
    let e = await call(port, (s) => s.write(frame(credit(1))));
    expect(details(e)).toEqual(['credit']);
    expect(e.trailers['grpc-status']).toBe(String(Code.Unauthenticated));
    expect(decodeURIComponent(String(e.trailers['grpc-message']))).toBe('Hello refused: token, agent');
    port = await serve((req, res) => serveAgentLane(fails(new Error('a bug')), req, res, 1 << 20));
    e = await call(port, (s) => s.write(frame(credit(1))));
    expect(e.trailers['grpc-status']).toBe(String(Code.Internal));
    expect(decodeURIComponent(String(e.trailers['grpc-message']))).toBe('internal error');
  });

  it("ends the handler's input and aborts its signal (CANCELED) when the agent resets the stream", async () => {
    const seen: { end?: unknown; signal?: AbortSignal } = {};
    const port = await serve((req, res) => serveAgentLane(echo(seen), req, res, 1 << 20));
    await call(port, (s) => {
      s.write(frame(credit(1)));
      s.once('data', () => s.close(http2.constants.NGHTTP2_CANCEL));
    });
    // Node ends the request body before it reports the reset, so the input ends as it does
    // under Connect (the hub counts a stream that ends without Bye as lost either way).
    await expect.poll(() => seen.end).toBeDefined();
    await expect.poll(() => seen.signal?.aborted).toBe(true);
    expect((seen.signal!.reason as ConnectError).code).toBe(Code.Canceled);
  });

  it('ends the handler (its finally runs) when it yields after the agent is gone', async () => {
    // The hub closes a session in its handler's finally; a write into the closed stream that
    // waited for a drain never coming would leave the session open, and jobs assigned to it.
    const seen: { finished?: boolean } = {};
    const late: AgentStreamHandler = async function* (_requests, signal) {
      try {
        await new Promise((r) => signal.addEventListener('abort', r, { once: true }));
        yield create(ServerMessageSchema, { kind: { case: 'goAway', value: { detail: 'after the reset' } } });
        yield create(ServerMessageSchema, { kind: { case: 'goAway', value: { detail: 'never read' } } });
      } finally {
        seen.finished = true;
      }
    };
    const port = await serve((req, res) => serveAgentLane(late, req, res, 1 << 20));
    await call(port, (s) => s.write(frame(credit(1)), () => s.close(http2.constants.NGHTTP2_CANCEL)));
    await expect.poll(() => seen.finished).toBe(true);
  });
});

describe('which streams take the lane', () => {
  it("takes the SDK's stream (grpc-js: gRPC + protobuf, no compression, no deadline)", async () => {
    let taken: boolean | undefined;
    const port = await serve((req, res) => {
      taken ??= forAgentLane(req);
      res.writeHead(200, { 'content-type': 'application/grpc+proto' });
      res.addTrailers({ 'grpc-status': String(Code.Unavailable), 'grpc-message': 'recorded' });
      res.end();
    });
    const outboxDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-lane-'));
    dirs.push(outboxDir);
    const agent = createAgent({ url: `http://127.0.0.1:${port}`, token: 'x', queues: ['q'], slots: 1, outboxDir, handleSignals: false, log: pino({ level: 'silent' }) });
    agent.handle('q', async () => ({}));
    void agent.start().catch(() => undefined);
    try {
      await expect.poll(() => taken).toBe(true);
    } finally {
      await agent.stop();
    }
  });

  it('leaves the rest to Connect, which still serves them: a deadline, compression, gRPC-JSON', async () => {
    const taken: boolean[] = [];
    const port = await serve((req, res) => {
      taken.push(forAgentLane(req));
      res.writeHead(200);
      res.end();
    });
    for (const h of [{}, { 'content-type': 'application/grpc+proto' }, { 'grpc-timeout': '10S' }, { 'grpc-encoding': 'gzip' }, { 'content-type': 'application/grpc+json' }]) {
      await call(port, (s) => s.end(), h);
    }
    expect(taken).toEqual([true, true, false, false, false]);

    // A stream with a deadline goes through Connect on the real coordinator and is served there.
    const token = await lh.agent('by-connect');
    const hello = create(AgentMessageSchema, { kind: { case: 'hello', value: { agentId: 'by-connect', token, queues: ['q'], slots: 1 } } });
    const e = await call(
      lh.port,
      (s) => {
        s.write(frame(hello));
        s.once('data', () => s.close(http2.constants.NGHTTP2_CANCEL));
      },
      { 'grpc-timeout': '30S' },
    );
    expect(e.messages.map((m) => m.kind.case)).toEqual(['welcome']);
  });
});
