/**
 * The agent stream (`AgentService.Connect`) written to and read from an HTTP/2 stream directly,
 * the client half of the coordinator's agent lane (server/transport/agent-lane.ts).
 *
 * grpc-js carries each message through its call stack (a resolving call, a retrying call, a
 * compression filter, a subchannel call, a stream decoder), with promises and callbacks at every
 * layer, five messages per job: in the benchmark's agent process one job at a time, grpc-js was
 * about a tenth of the CPU (docs/performance.md, "The speed work, measured"). Here a message
 * is one gRPC frame written (the hand encoder, codec.ts), and frames are cut from the bytes as
 * they arrive and decoded.
 *
 * What grpc-js gave the stream, kept: the gRPC wire (`application/grpc+proto`, uncompressed
 * frames, `grpc-status` and `grpc-message` in the trailers or in a trailers-only answer, the HTTP
 * status mapped as gRPC says when there is none); errors as grpc-js reports them (a
 * `ServiceError` with the status code: UNAVAILABLE for a connection that fails or drops,
 * CANCELLED for `cancel()`, RESOURCE_EXHAUSTED for a message over the limit); keepalive (a PING
 * every 10 s, the connection dropped when one is not answered in 5 s); TLS with Node's CA store
 * (bundled Mozilla roots plus `NODE_EXTRA_CA_CERTS`) or given PEM files. One HTTP/2 connection per address, kept for the next stream while it lasts.
 *
 * With an HTTP proxy configured for gRPC (`grpc_proxy`, `https_proxy`, `http_proxy`), which grpc-js
 * goes through with CONNECT and this does not, the stream stays on grpc-js (channel.ts).
 */
import { EventEmitter } from 'node:events';
import http2 from 'node:http2';
import * as grpc from '@grpc/grpc-js';
import { decodeServerMessage, encodeAgentMessage } from './codec.js';
import { AgentService } from './gen/leasehold/v1/agent_service_pb.js';
import { grpcFrame } from './wire.js';
import type { AgentStream } from './session.js';
import type { TlsFiles } from './channel.js';
import agentPackage from '../package.json' with { type: 'json' };

/**
 * What this agent is, for people: the package and its version, Node's version and the OS, e.g.
 * `leasehold-agent-client/0.1.0 (node v20.11.1; win32)`. Sent in every Hello (`agent_version`,
 * which the coordinator logs) and as the `user-agent` of every call. The version is
 * agent-client/package.json's, imported as JSON: Node reads the file beside src/ (tsx) and
 * dist/ (the installed package), and esbuild writes its contents into the single file
 * (agent-client/bundle.mjs), which has no package.json beside it.
 */
export const AGENT_VERSION = `leasehold-agent-client/${agentPackage.version} (node ${process.version}; ${process.platform})`;

/** The agent stream's method, named from the generated service. */
export const AGENT_CONNECT_PATH = `/${AgentService.typeName}/${AgentService.method.connect.name}`;

/** Keepalive, as grpc-js was given it: a PING this often, the connection gone if unanswered this long. */
export const KEEPALIVE_MS = 10_000;
export const KEEPALIVE_TIMEOUT_MS = 5_000;

/** Largest message read (as grpc-js's `grpc.max_receive_message_length` was set). */
export const MAX_RECEIVE_BYTES = 16 * 1024 * 1024;

/** How long a unary call (the step ledger's) may take, as it was given grpc-js. */
export const UNARY_DEADLINE_MS = 30_000;

const headersOf = (path: string): http2.OutgoingHttpHeaders => ({
  [http2.constants.HTTP2_HEADER_METHOD]: 'POST',
  [http2.constants.HTTP2_HEADER_PATH]: path,
  'content-type': 'application/grpc+proto',
  te: 'trailers',
  'user-agent': AGENT_VERSION,
});
const STREAM_HEADERS = headersOf(AGENT_CONNECT_PATH);

/** A gRPC error as grpc-js gives one: the code, the (decoded) message, the trailers. */
export function serviceError(code: grpc.status, details: string, metadata = new grpc.Metadata()): grpc.ServiceError {
  return Object.assign(new Error(`${code} ${grpc.status[code]}: ${details}`), { code, details, metadata });
}

/** The status of an answer without `grpc-status`, from its HTTP status (gRPC's http-grpc-status-mapping). */
function statusOfHttp(status: number): grpc.status {
  if (status === 400) return grpc.status.INTERNAL;
  if (status === 401) return grpc.status.UNAUTHENTICATED;
  if (status === 403) return grpc.status.PERMISSION_DENIED;
  if (status === 404) return grpc.status.UNIMPLEMENTED;
  if (status === 429 || status === 502 || status === 503 || status === 504) return grpc.status.UNAVAILABLE;
  return grpc.status.UNKNOWN;
}

/** The trailers' metadata (binary `-bin` values decoded, as grpc-js does). */
function metadataOf(headers: http2.IncomingHttpHeaders): grpc.Metadata {
  const md = new grpc.Metadata();
  for (const [k, v] of Object.entries(headers)) {
    if (k.startsWith(':') || k === 'grpc-status' || k === 'grpc-message' || v === undefined) continue;
    for (const one of Array.isArray(v) ? v : [v]) {
      if (k.endsWith('-bin')) md.add(k, Buffer.from(one, 'base64'));
      else md.add(k, one);
    }
  }
  return md;
}

function decodeMessage(raw: string | string[] | undefined): string {
  const s = Array.isArray(raw) ? raw.join(',') : (raw ?? '');
  try {
    return decodeURIComponent(s);
  } catch {
    return s;
  }
}

/** True when grpc-js would go through an HTTP proxy for this target (its `getProxiedConnection` env). */
export function proxyConfigured(env: NodeJS.ProcessEnv = process.env): boolean {
  return Boolean(env.grpc_proxy || env.https_proxy || env.http_proxy);
}

/**
 * Why a connection ended, for its streams to end with: dropped from here (set before its streams
 * close, which is before its `error` is emitted), or its own `error`, whichever came first.
 */
const ended = new WeakMap<http2.ClientHttp2Session, Error>();

function drop(session: http2.ClientHttp2Session, why: Error): void {
  ended.set(session, why);
  session.destroy(why);
}

/** One address's HTTP/2 connection, opened when a stream needs it and reopened after it ends. */
export class LaneConnection {
  private session: http2.ClientHttp2Session | undefined;
  private readonly authority: string;
  private readonly options: http2.SecureClientSessionOptions;

  constructor(
    target: string,
    secure: boolean,
    /** With TLS, the PEM files given (channel.ts `tlsFiles`); none: Node's CA store (channel.ts `TlsOption`). */
    tls: TlsFiles | undefined,
    private readonly keepalive = { everyMs: KEEPALIVE_MS, timeoutMs: KEEPALIVE_TIMEOUT_MS },
  ) {
    this.authority = `${secure ? 'https' : 'http'}://${target}`;
    this.options = secure ? { ...tls } : {};
  }

  /** Opens the agent stream (on the connection there is, or a new one). */
  connect(): AgentStream {
    return new LaneCall(this.current(), STREAM_HEADERS, encodeAgentMessage, decodeServerMessage);
  }

  /**
   * A unary call (the step ledger's) on the same connection, with the token and a deadline as
   * grpc-js sent them: the answer, or a `ServiceError` (CANCELLED when `signal` aborts it,
   * DEADLINE_EXCEEDED past `UNARY_DEADLINE_MS`).
   */
  unary<O>(path: string, token: string, message: Uint8Array, decode: (bytes: Buffer) => O, signal?: AbortSignal): Promise<O> {
    return new Promise<O>((resolve, reject) => {
      if (signal?.aborted) return reject(serviceError(grpc.status.CANCELLED, 'Cancelled on client'));
      const headers = { ...headersOf(path), authorization: `Bearer ${token}`, 'grpc-timeout': `${UNARY_DEADLINE_MS}m` };
      const call = new LaneCall<Uint8Array, O>(this.current(), headers, (m) => m, decode);
      let answer: { value: O } | undefined;
      const deadline = setTimeout(() => call.abandon(grpc.status.DEADLINE_EXCEEDED, 'Deadline exceeded'), UNARY_DEADLINE_MS);
      const onAbort = () => call.cancel();
      signal?.addEventListener('abort', onAbort, { once: true });
      const settled = () => {
        clearTimeout(deadline);
        signal?.removeEventListener('abort', onAbort);
      };
      call.on('data', (m: O) => {
        if (answer) call.abandon(grpc.status.UNIMPLEMENTED, 'Too many responses received');
        else answer = { value: m };
      });
      call.on('error', (e: grpc.ServiceError) => {
        settled();
        reject(e);
      });
      call.on('end', () => {
        settled();
        if (answer) resolve(answer.value);
        else reject(serviceError(grpc.status.UNIMPLEMENTED, 'No message received'));
      });
      call.write(message);
      call.end();
    });
  }

  close(): void {
    this.session?.close();
    this.session = undefined;
  }

  private current(): http2.ClientHttp2Session {
    const s = this.session;
    if (s && !s.closed && !s.destroyed && !(s as { goingAway?: boolean }).goingAway) return s;
    const next = http2.connect(this.authority, this.options);
    this.session = next;
    let ping: NodeJS.Timeout | undefined;
    let pending: NodeJS.Timeout | undefined;
    const forget = () => {
      clearInterval(ping);
      clearTimeout(pending);
      if (this.session === next) this.session = undefined;
    };
    ping = setInterval(() => {
      if (pending) return;
      // Destroyed (dropped, cut) and its 'close' not emitted yet: that comes after the socket's
      // own close, a turn of the loop or more later, and ping() would throw (ERR_HTTP2_INVALID_SESSION)
      // out of this timer and end the agent's process.
      if (next.destroyed || next.closed) return forget();
      pending = setTimeout(() => drop(next, new Error(`keepalive: no answer to a PING within ${this.keepalive.timeoutMs} ms`)), this.keepalive.timeoutMs);
      let sent: boolean;
      try {
        sent = next.ping((err) => {
          clearTimeout(pending);
          pending = undefined;
          if (err && !next.destroyed) drop(next, err);
        });
      } catch (err) {
        clearTimeout(pending);
        pending = undefined;
        return drop(next, err as Error);
      }
      if (!sent) {
        clearTimeout(pending);
        pending = undefined;
      }
    }, this.keepalive.everyMs);
    ping.unref();
    // The connection's error, kept for its streams to end with (one listener for all of them:
    // one per call went over Node's limit of 10, and its warning, with ten calls at once).
    next.on('error', (err: Error) => {
      if (!ended.has(next)) ended.set(next, err);
    });
    next.on('goaway', () => {
      if (this.session === next) this.session = undefined;
    });
    next.on('close', forget);
    return next;
  }
}

/**
 * One call on the connection (the agent stream, or a unary call): `write` frames a message,
 * `data` gives each message read, and it ends once, with `end` (status OK) or `error`.
 */
export class LaneCall<I, O> extends EventEmitter {
  private readonly req: http2.ClientHttp2Stream;
  private pending: Buffer | undefined;
  private status: { code: grpc.status; details: string; metadata: grpc.Metadata } | undefined;
  private httpStatus = 0;
  private finished = false;
  private readonly session: http2.ClientHttp2Session;
  /** How the stream ends, decided here (cancel, a message that cannot be read) before it closed. */
  private ending: grpc.ServiceError | undefined;

  constructor(
    session: http2.ClientHttp2Session,
    headers: http2.OutgoingHttpHeaders,
    private readonly encode: (m: I) => Uint8Array,
    private readonly decode: (bytes: Buffer) => O,
  ) {
    super();
    this.session = session;
    this.req = session.request(headers);
    const req = this.req;
    req.on('response', (headers) => {
      this.httpStatus = Number(headers[':status']);
      // A trailers-only answer: the status in the headers.
      if (headers['grpc-status'] !== undefined) this.readStatus(headers);
    });
    req.on('trailers', (trailers) => this.readStatus(trailers));
    req.on('data', (chunk: Buffer) => this.read(chunk));
    // A reset stream errs too (its code is read at the end); the connection's error says more.
    // But a connection that could not be made (refused, a certificate not trusted) closes its
    // streams before it emits its error: the stream's error carries it as its cause
    // (ERR_HTTP2_STREAM_CANCEL), kept here as the connection's, so the stream ends saying why.
    req.on('error', (err: Error) => {
      if (!this.session.destroyed || ended.has(this.session)) return;
      ended.set(this.session, err.cause instanceof Error ? err.cause : err);
    });
    // The coordinator ended its side (its status in the trailers): the call is over, whether or
    // not this side has ended its own (a refused Hello ends the stream while the agent still writes).
    req.on('end', () => {
      this.finish();
      if (!req.closed) req.close(http2.constants.NGHTTP2_NO_ERROR);
    });
    req.on('close', () => this.finish());
  }

  write(m: I): boolean {
    if (this.finished || this.ending || this.req.destroyed || this.req.writableEnded) return false;
    return this.req.write(grpcFrame(this.encode(m)));
  }

  end(): void {
    if (!this.req.destroyed && !this.req.writableEnded) this.req.end();
  }

  /** Resets the stream; it ends with CANCELLED, on a later tick (as grpc-js's call does). */
  cancel(): void {
    this.abandon(grpc.status.CANCELLED, 'Cancelled on client');
  }

  private read(chunk: Buffer): void {
    if (this.finished || this.ending) return;
    const buf = this.pending ? Buffer.concat([this.pending, chunk]) : chunk;
    let pos = 0;
    while (buf.length - pos >= 5) {
      if (buf[pos] !== 0) return this.abandon(grpc.status.INTERNAL, 'received a compressed message, which this client never asks for');
      const n = buf.readUInt32BE(pos + 1);
      if (n > MAX_RECEIVE_BYTES) return this.abandon(grpc.status.RESOURCE_EXHAUSTED, `Received message larger than max (${n} vs. ${MAX_RECEIVE_BYTES})`);
      if (buf.length - pos - 5 < n) break;
      let m: O;
      try {
        m = this.decode(buf.subarray(pos + 5, pos + 5 + n));
      } catch (err) {
        return this.abandon(grpc.status.INTERNAL, `Response message parsing error: ${(err as Error).message}`);
      }
      pos += 5 + n;
      this.emit('data', m);
      if (this.finished || this.ending) return;
    }
    this.pending = pos === buf.length ? undefined : buf.subarray(pos);
  }

  private readStatus(headers: http2.IncomingHttpHeaders): void {
    const code = Number(headers['grpc-status']);
    this.status = {
      code: Number.isInteger(code) && code >= 0 && code <= 16 ? (code as grpc.status) : grpc.status.UNKNOWN,
      details: decodeMessage(headers['grpc-message']),
      metadata: metadataOf(headers),
    };
  }

  /** The stream is closed: its status, as grpc-js would report it. */
  private finish(): void {
    if (this.finished) return;
    if (this.ending) return this.fail(this.ending);
    if (this.status) {
      if (this.status.code === grpc.status.OK && this.pending) {
        return this.fail(serviceError(grpc.status.INTERNAL, 'the stream ended in the middle of a message'));
      }
      if (this.status.code === grpc.status.OK) {
        this.finished = true;
        this.emit('end');
        return;
      }
      return this.fail(serviceError(this.status.code, this.status.details, this.status.metadata));
    }
    if (this.httpStatus && this.httpStatus !== 200) {
      return this.fail(serviceError(statusOfHttp(this.httpStatus), `Received HTTP status code ${this.httpStatus}`));
    }
    // The connection failed or dropped (its streams close with it): UNAVAILABLE, to reconnect.
    if (ended.has(this.session) || this.session.destroyed || this.session.closed) {
      const why = ended.get(this.session);
      return this.fail(serviceError(grpc.status.UNAVAILABLE, `Connection dropped: ${why?.message ?? 'the connection closed'}`));
    }
    // The coordinator reset this stream alone: its code, as grpc-js maps it.
    const rst = this.req.rstCode ?? http2.constants.NGHTTP2_NO_ERROR;
    const why = `Received RST_STREAM with code ${rst}`;
    if (rst === http2.constants.NGHTTP2_REFUSED_STREAM) return this.fail(serviceError(grpc.status.UNAVAILABLE, why));
    if (rst === http2.constants.NGHTTP2_CANCEL) return this.fail(serviceError(grpc.status.CANCELLED, why));
    if (rst === http2.constants.NGHTTP2_ENHANCE_YOUR_CALM) return this.fail(serviceError(grpc.status.RESOURCE_EXHAUSTED, why));
    return this.fail(serviceError(grpc.status.INTERNAL, why));
  }

  /** Resets the stream; it ends with this status when it has closed (unless it had ended already). */
  abandon(code: grpc.status, details: string): void {
    if (this.finished || this.ending) return;
    this.ending = serviceError(code, details);
    this.pending = undefined;
    if (this.req.closed) process.nextTick(() => this.finish());
    else this.req.close(http2.constants.NGHTTP2_CANCEL);
  }

  private fail(err: grpc.ServiceError): void {
    if (this.finished) return;
    this.finished = true;
    this.pending = undefined;
    this.emit('error', err);
  }
}
