/**
 * AgentService.Connect for gRPC clients, read from and written to the HTTP/2 stream directly.
 *
 * Connect's handler carries every message of a stream through a chain of async generators (the
 * body's chunks, envelopes, decompression, parsing, the handler, serialization, compression,
 * joining, the response writer), several promises per stage per message, four messages per
 * job: 0.16–0.20 ms of the coordinator's CPU per job when jobs come one at a time, measured
 * (docs/performance.md). Here a frame is cut from the bytes as they arrive, decoded (the
 * messages an agent sends for every job by hand, agent-codec.ts), and handed
 * to the same `async *` handler (agent-routes.ts); what it yields is encoded and written as one
 * frame. The wire is gRPC as Connect writes it: status and
 * message in the trailers (`grpc-message` re-encoded by server.ts as for every method), the same
 * codes and texts for what it refuses (frames over the size limit, compressed frames, bytes that
 * do not decode, a stream cut mid-frame).
 *
 * Only what agents send takes this lane: gRPC with protobuf, uncompressed, without a deadline,
 * over HTTP/2. Anything else for this method (gRPC-JSON, `grpc-encoding`, `grpc-timeout`,
 * HTTP/1.1) goes to Connect as before, which answers it as it always has.
 */
import type http2 from 'node:http2';
import { constants } from 'node:http2';
import { toBinary } from '@bufbuild/protobuf';
import { Code, ConnectError } from '@connectrpc/connect';
import { setTrailerStatus } from '@connectrpc/connect/protocol-grpc';
import { AgentService, ServerMessageSchema, type AgentMessage, type ServerMessage } from '../../gen/leasehold/v1/agent_service_pb.js';
import { grpcFrame } from '../../agent-client/src/wire.js';
import { decodeAgentMessage } from './agent-codec.js';
import { handEncoded } from './assign-codec.js';

/** The method this lane serves, named from the generated service. */
export const AGENT_CONNECT_PATH = `/${AgentService.typeName}/${AgentService.method.connect.name}`;

/** The response headers of every stream this lane answers. */
const HEADERS = { 'content-type': 'application/grpc+proto' };

/** The agent stream's handler: the agent's messages in, the coordinator's out (agent-routes.ts). */
export type AgentStreamHandler = (requests: AsyncIterable<AgentMessage>, signal: AbortSignal) => AsyncIterable<ServerMessage>;

/** Decoded messages queued before the stream stops reading from the socket (and resumes below `LOW_WATER`). */
const HIGH_WATER = 64;
const LOW_WATER = 16;

/** True for a request this lane serves: the agent stream, gRPC + protobuf, uncompressed, no deadline, HTTP/2. */
export function forAgentLane(req: http2.Http2ServerRequest): boolean {
  if (req.httpVersionMajor !== 2 || req.method !== 'POST' || req.url !== AGENT_CONNECT_PATH) return false;
  const type = req.headers['content-type'];
  if (type !== 'application/grpc' && type !== 'application/grpc+proto') return false;
  const encoding = req.headers['grpc-encoding'];
  return (encoding === undefined || encoding === 'identity') && req.headers['grpc-timeout'] === undefined;
}

/** Serves one agent stream on `req`/`res` with `handler`; frames over `readMaxBytes` end it (RESOURCE_EXHAUSTED). */
export function serveAgentLane(handler: AgentStreamHandler, req: http2.Http2ServerRequest, res: http2.Http2ServerResponse, readMaxBytes: number): void {
  const abort = new AbortController();
  const inbound = new Inbound(req, readMaxBytes);
  // As Connect does: the handler's signal aborts when the stream closes, with the reason when
  // the client reset it.
  req.once('close', () => {
    const rst = req.stream.rstCode;
    if (rst !== undefined && rst !== constants.NGHTTP2_NO_ERROR && rst !== constants.NGHTTP2_STREAM_CLOSED) {
      const err = new ConnectError(`http/2 stream closed with error code 0x${rst.toString(16)}`, rst === constants.NGHTTP2_CANCEL ? Code.Canceled : Code.Internal);
      inbound.fail(err);
      abort.abort(err);
    } else {
      inbound.fail(new ConnectError('the stream closed', Code.Canceled));
      abort.abort();
    }
  });
  void respond(handler(inbound, abort.signal), res).finally(() => inbound.stop());
}

async function respond(output: AsyncIterable<ServerMessage>, res: http2.Http2ServerResponse): Promise<void> {
  let error: ConnectError | undefined;
  try {
    for await (const m of output) {
      if (gone(res)) break;
      if (!res.headersSent) res.writeHead(200, HEADERS);
      if (!res.write(grpcFrame(handEncoded(m) ?? toBinary(ServerMessageSchema, m)))) await drained(res);
    }
  } catch (err) {
    error = err instanceof ConnectError ? err : new ConnectError('internal error', Code.Internal, undefined, undefined, err);
  }
  if (gone(res)) return;
  if (!res.headersSent) res.writeHead(200, HEADERS);
  const trailers = setTrailerStatus(new Headers(), error);
  const t: Record<string, string> = {};
  trailers.forEach((v, k) => (t[k] = v));
  res.addTrailers(t);
  res.end();
}

/**
 * True once the stream is closed or destroyed: nothing more can be written. (The compatibility
 * response has no `destroyed` of its own, and a write after the close fails without an event.)
 */
function gone(res: http2.Http2ServerResponse): boolean {
  return res.stream.destroyed || res.stream.closed;
}

/** Resolves when `res` can take more, or is gone (at once if it already is). */
function drained(res: http2.Http2ServerResponse): Promise<void> {
  if (gone(res)) return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      res.off('drain', done);
      res.stream.off('close', done);
      resolve();
    };
    res.once('drain', done);
    res.stream.once('close', done);
  });
}

/**
 * The agent's messages, cut from the request body as it arrives and decoded. Reading pauses
 * while `HIGH_WATER` messages wait for the handler. A refused frame ends the iteration with its
 * error after the messages before it.
 */
class Inbound implements AsyncIterable<AgentMessage>, AsyncIterator<AgentMessage> {
  private readonly queue: AgentMessage[] = [];
  private chunks: Buffer[] = [];
  private size = 0;
  private ended = false;
  private error: unknown;
  private paused = false;
  private waiter: (() => void) | undefined;

  constructor(
    private readonly req: http2.Http2ServerRequest,
    private readonly readMaxBytes: number,
  ) {
    req.on('data', (chunk: Buffer) => this.read(chunk));
    req.once('end', () => {
      if (this.size > 0) this.fail(new ConnectError('protocol error: incomplete envelope', Code.InvalidArgument));
      this.finish();
    });
    req.once('error', (err) => this.fail(err));
  }

  [Symbol.asyncIterator](): AsyncIterator<AgentMessage> {
    return this;
  }

  async next(): Promise<IteratorResult<AgentMessage>> {
    for (;;) {
      const m = this.queue.shift();
      if (m !== undefined) {
        if (this.paused && this.queue.length < LOW_WATER) {
          this.paused = false;
          this.req.resume();
        }
        return { done: false, value: m };
      }
      if (this.error !== undefined) throw this.error;
      if (this.ended) return { done: true, value: undefined };
      await new Promise<void>((resolve) => (this.waiter = resolve));
    }
  }

  /** Ends the iteration with `err` once the messages already decoded are read (the first error wins). */
  fail(err: unknown): void {
    if (this.ended) return;
    this.error = err;
    this.finish();
  }

  /**
   * The call is over: what the agent still sends (until it reads the trailers and ends its side,
   * as gRPC clients do) is read and dropped, not queued for a handler that has returned.
   */
  stop(): void {
    if (this.paused) this.req.resume();
    this.finish();
  }

  private finish(): void {
    this.ended = true;
    this.chunks = [];
    this.size = 0;
    this.wake();
  }

  private read(chunk: Buffer): void {
    if (this.ended) return;
    this.chunks.push(chunk);
    this.size += chunk.length;
    while (this.size >= 5) {
      if (this.chunks[0]!.length < 5) this.merge();
      const head = this.chunks[0]!;
      const length = head.readUInt32BE(1);
      if (length > this.readMaxBytes) {
        return this.fail(new ConnectError(`message size ${length} is larger than configured readMaxBytes ${this.readMaxBytes}`, Code.ResourceExhausted));
      }
      if (this.size < 5 + length) break;
      // Chunks are joined only once a whole frame has arrived, never byte by byte as it trickles in.
      if (head.length < 5 + length) this.merge();
      const buf = this.chunks[0]!;
      const flags = buf[0]!;
      const data = buf.subarray(5, 5 + length);
      if (buf.length > 5 + length) this.chunks[0] = buf.subarray(5 + length);
      else this.chunks.shift();
      this.size -= 5 + length;
      if (flags & 1) return this.fail(new ConnectError('received compressed envelope, but do not know how to decompress', Code.Internal));
      try {
        this.queue.push(decodeAgentMessage(data));
      } catch (err) {
        return this.fail(new ConnectError(`parse binary: ${err instanceof Error ? err.message : String(err)}`, Code.Internal));
      }
    }
    if (!this.paused && this.queue.length >= HIGH_WATER) {
      this.paused = true;
      this.req.pause();
    }
    this.wake();
  }

  private merge(): void {
    this.chunks = [Buffer.concat(this.chunks, this.size)];
  }

  private wake(): void {
    const w = this.waiter;
    this.waiter = undefined;
    w?.();
  }
}
