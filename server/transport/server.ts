/**
 * The gRPC listener: one Connect router for every service (gRPC, gRPC-Web and Connect on
 * HTTP/2), cleartext h2c by default, TLS when a certificate and key are configured.
 */
import { readFileSync } from 'node:fs';
import http2 from 'node:http2';
import type { AddressInfo, Server } from 'node:net';
import { Code, ConnectError, createContextValues, type ConnectRouter, type ConnectRouterOptions } from '@connectrpc/connect';
import { connectNodeAdapter } from '@connectrpc/connect-node';
import type { Activity } from '../core/activity.js';
import type { AgentHub } from '../core/agent-hub.js';
import type { Dispatcher } from '../core/dispatcher.js';
import type { CredentialCache } from '../core/credential-cache.js';
import type { EgressPolicy } from '../lib/egress.js';
import type { ProxyTrust } from '../lib/proxy-trust.js';
import { LogSummary } from '../lib/log-summary.js';
import type { Logger } from '../log.js';
import type { Queryable } from '../store/index.js';
import { adminRoutes } from './admin-routes.js';
import { forAgentLane, serveAgentLane } from './agent-lane.js';
import { agentStreams } from './agent-routes.js';
import { attemptRoutes } from './attempt-routes.js';
import { authInterceptor, bearerToken, MISSING_KEY, needsKey, principalKey, type Principal } from './auth.js';
import { createHealth, healthRoutes, type HealthController } from './health.js';
import { jobRoutes } from './job-routes.js';
import { createKeyGate } from './key-gate.js';
import type { QueueWaker } from '../core/queue-waker.js';
import { endsWithin } from '../core/settle.js';
import type { Metrics } from './metrics.js';
import { readDescriptorSet, reflectionRoutes } from './reflection.js';
import { databaseUnavailable, storeErrors, unavailableLog, unavailableMessage } from './store-errors.js';

export interface ServerDeps {
  db: Queryable;
  hub: AgentHub;
  log: Logger;
  leaseTtlMs: number;
  claimTtlMs: number;
  heartbeatIntervalMs: number;
  /** How long a new agent stream may take to say Hello (default 10 s), and how many may wait at once (default 256). */
  helloTimeoutMs?: number | undefined;
  helloPendingMax?: number | undefined;
  /** A PING to each connection this often, closed when the ack takes as long again (`LEASEHOLD_AGENT_KEEPALIVE`); none when unset. */
  agentKeepaliveMs?: number | undefined;
  /** What the unary routes did, for metrics; optional (tests build listeners without it). */
  activity?: Activity | undefined;
  /** AdminService.PurgeJobs without older_than purges past this (`LEASEHOLD_RETENTION`). */
  retentionMs?: number | undefined;
  /** Sessions of `agent_sessions` not stamped for this long belong to a dead coordinator. */
  sessionStaleAfterMs?: number | undefined;
  /** Served at GET /metrics on the HTTP listener when given. */
  metrics?: Metrics | undefined;
  /**
   * A proxy is the only way to the listeners (`LEASEHOLD_TRUST_PROXY`): the caller's address, for
   * the limit on refused keys, is read from `X-Forwarded-For` (caller-address.ts).
   */
  trustProxy?: ProxyTrust | undefined;
  /**
   * Verified credentials, shared by both listeners (the coordinator keeps it in step with
   * revocations); without it every call is verified in the database.
   */
  credentials?: CredentialCache<Principal> | undefined;
  /** Where webhooks may not go (`LEASEHOLD_WEBHOOK_DENY`): a notifyUrl or a subscription's URL written with such an address is refused. */
  egress?: EgressPolicy | undefined;
  /** When given, an enqueue can claim its job for a waiting agent here at once (`Dispatcher.reserve`). */
  dispatcher?: Dispatcher | undefined;
  /**
   * When given, a gateway enqueue wakes the dispatchers after its commit through it, instead of
   * a NOTIFY inside the enqueue's transaction.
   */
  waker?: QueueWaker | undefined;
  /**
   * Whether the HTTP gateway takes JSON EnqueueJob calls past Connect's handler
   * (gateway-enqueue.ts). Default true; test/gateway-enqueue.test.ts compares with false.
   */
  directEnqueue?: boolean | undefined;
  /**
   * How long a request's body may take to arrive in full (default `BODY_TIMEOUT_MS`): past it a
   * gRPC call is reset (CANCEL) and an HTTP request answered 408, its connection closed. Calls
   * that send messages both ways (the agent stream, reflection) have no such deadline.
   */
  bodyTimeoutMs?: number | undefined;
  /** The bounds of open streaming calls (reflection, Health/Watch); default `OPEN_STREAMS`. */
  openStreams?: OpenStreamBounds | undefined;
}

/**
 * Calls anyone may make without a key that stream their answers: reflection (grpcurl's `list`
 * and `describe`, a few requests on one stream) and Health/Watch. Without bounds a client could
 * hold thousands of them, about 130 KB of memory each, for as long as it liked: 6,000 streams on
 * 24 connections took the coordinator from 151 to 935 MB, and opening them slowed n8n's enqueues
 * to 3.8 s (.scratch/review-security.md, 2). Each is ended after `maxMs`; past `perConnection` on
 * one connection or `max` in all a new one is refused with RESOURCE_EXHAUSTED. Agents, n8n and
 * Health/Check (unary) are not counted.
 */
export interface OpenStreamBounds {
  perConnection: number;
  max: number;
  maxMs: number;
}
export const OPEN_STREAMS: OpenStreamBounds = { perConnection: 8, max: 64, maxMs: 60_000 };

export interface TlsFiles {
  certFile: string;
  keyFile: string;
  /**
   * The CA certificate(s) that sign agents' client certificates (`LEASEHOLD_TLS_CLIENT_CA`, PEM).
   * Read by `listenGrpc` alone: it then fails the TLS handshake of every connection without a
   * certificate signed by one of them (mTLS), before any call or token is read. `listenHttp`
   * (n8n, the dashboard, the CLI) never asks for a client certificate.
   */
  clientCaFile?: string | undefined;
}

/** Largest message accepted (a Completed with many results); single documents are bounded lower. */
export const READ_MAX_BYTES = 8 * 1024 * 1024;

/**
 * Largest message of the services anyone may call without a key (health, reflection), whose
 * requests carry a name or two: what a caller without a key can make a listener hold per call.
 */
export const OPEN_READ_MAX_BYTES = 16 * 1024;

/**
 * Streams one HTTP/2 connection may have open at once (its SETTINGS_MAX_CONCURRENT_STREAMS). An
 * agent holds one (its stream) and a few step calls; a gRPC client past the limit waits for a
 * stream to end before it opens the next (HTTP/2 clients queue them), it is not refused.
 */
export const MAX_CONCURRENT_STREAMS = 256;

/** How long a request's body may take to arrive in full, unless `ServerDeps.bodyTimeoutMs` says otherwise. */
export const BODY_TIMEOUT_MS = 30_000;

/**
 * Every service on one router: JobService, AttemptService, AgentService, AdminService, health,
 * reflection. `agents`: the agent stream's handler when the listener also serves it itself.
 * `open`: the options of health and reflection, which anyone may call (`OPEN_READ_MAX_BYTES`);
 * Connect reads a service's protocols from its own options, so they repeat the router's.
 */
export function routes(deps: ServerDeps, health: HealthController, agents = agentStreams(deps), open?: ConnectRouterOptions) {
  return (router: ConnectRouter) => {
    jobRoutes(deps)(router);
    attemptRoutes(deps)(router);
    agents.routes(router);
    adminRoutes(deps)(router);
    const openRouter = open ? withOptions(router, open) : router;
    healthRoutes({ health })(openRouter);
    reflectionRoutes({ sourceInfo: readDescriptorSet() })(openRouter);
  };
}

/** `router`, registering every service with `options` (below a service's own). Reflection reads every handler of `router` from it. */
function withOptions(router: ConnectRouter, options: ConnectRouterOptions): ConnectRouter {
  const wrapped: ConnectRouter = {
    handlers: router.handlers,
    service: (service, implementation, own) => {
      router.service(service, implementation, { ...options, ...own });
      return wrapped;
    },
    rpc: (method, impl, own) => {
      router.rpc(method, impl, { ...options, ...own });
      return wrapped;
    },
  };
  return wrapped;
}

export interface GrpcServer {
  /** The bound address (the port is real when 0 was asked for). */
  address: AddressInfo;
  health: HealthController;
  /** Stops accepting, ends streams, waits for open sessions to close. Safe to call twice. */
  close(): Promise<void>;
}

/** Listens on `addr` (`host:port`) with every service. */
export async function listenGrpc(deps: ServerDeps, addr: string, tls?: TlsFiles): Promise<GrpcServer> {
  const health = createHealth({
    services: ['leasehold.v1.JobService', 'leasehold.v1.AttemptService', 'leasehold.v1.AgentService', 'leasehold.v1.AdminService'],
  });
  // What the listener knows of each method before Connect's handler runs (`MethodInfo`).
  const methods = new Map<string, MethodInfo>();
  const agents = agentStreams(deps);
  const bodyTimeoutMs = deps.bodyTimeoutMs ?? BODY_TIMEOUT_MS;
  // Principals of calls authenticated before their bodies were read, for the auth interceptor.
  const admitted = new WeakMap<object, Principal>();
  const connectHandler: NodeHandler = connectNodeAdapter({
      // No compression: agents sit on the same machine or LAN, where gzip costs more CPU on both
      // ends than the bytes it saves (assignments of hundreds of jobs were being gzipped).
      acceptCompression: [],
      // gRPC only on this listener (grpcurl, buf curl --protocol grpc, agents); the Connect
      // protocol is the HTTP listener's.
      connect: false,
      grpcWeb: false,
      routes: (router) => {
        routes(deps, health, agents, { connect: false, grpcWeb: false, readMaxBytes: OPEN_READ_MAX_BYTES })(router);
        for (const h of router.handlers) {
          const kind = h.method.methodKind;
          methods.set(h.requestPath, {
            input: h.method.input.typeName,
            keyed: needsKey(h.service.typeName),
            oneMessage: kind === 'unary' || kind === 'server_streaming',
            // Agents' streams are not open calls: some are served here, not by the lane (agent-lane.ts).
            streaming: kind !== 'unary' && h.service.typeName !== 'leasehold.v1.AgentService',
          });
        }
      },
      contextValues: (req) => {
        const principal = admitted.get(req);
        return principal ? createContextValues().set(principalKey, principal) : createContextValues();
      },
      interceptors: [storeErrors(deps.log), authInterceptor({ db: deps.db, credentials: deps.credentials })],
      readMaxBytes: READ_MAX_BYTES,
    });
  const serve = (req: http2.Http2ServerRequest, res: http2.Http2ServerResponse) => {
    try {
      connectHandler(req, res);
    } catch (err) {
      // connect-node builds the request's URL synchronously from `:authority` (or `Host`), in
      // Node's 'request' event: a value that is no URL's host (`x:99999`) threw there, and ended
      // the process, before any key was looked at.
      deps.log.warn({ err, authority: req.headers[':authority'] ?? req.headers.host, path: req.url }, 'request refused: its authority (Host) is not a valid host');
      if (res.headersSent) return void (req.httpVersionMajor === 2 ? res.stream.close(http2.constants.NGHTTP2_PROTOCOL_ERROR) : res.destroy());
      if (req.httpVersionMajor !== 2) return void res.writeHead(400, { 'content-type': 'text/plain' }).end('bad Host header\n');
      refuse(req, res, undefined, 'bad :authority', Code.InvalidArgument);
    }
  };
  const openStreams = openStreamGate(deps.openStreams ?? OPEN_STREAMS, deps.log);
  // Keys that could not be checked for want of the database: one line every 10 s (store-errors.ts).
  const down = unavailableLog(deps.log);
  const keys = createKeyGate({ db: deps.db, credentials: deps.credentials, log: deps.log, metrics: deps.metrics, trustProxy: deps.trustProxy, listener: 'grpc' });
  // Agents' streams past Connect's per-message pipeline (agent-lane.ts); everything else through
  // it, a call that needs a key only once its key is known good: Connect reads the whole body
  // (up to READ_MAX_BYTES) before its interceptors run, so callers without a key could make the
  // listener hold 8 MiB per stream.
  const handler = plainGrpcMessages((req, res, method) => {
    if (forAgentLane(req)) return serveAgentLane(agents.handler, req, res, READ_MAX_BYTES);
    // Unknown paths and other verbs: Connect answers them without reading a body.
    if (!method || req.method !== 'POST') return serve(req, res);
    if (method.oneMessage) bodyDeadline(req, bodyTimeoutMs, deps.log);
    if (!method.keyed) {
      if (method.streaming && !openStreams(req, res, method.input)) return;
      return serve(req, res);
    }
    const token = bearerToken(req.headers.authorization);
    if (!token) return refuse(req, res, method.input, MISSING_KEY);
    keys
      .check(token, remoteOf(req), req.headers['x-forwarded-for'])
      .then(
        (principal) => {
          if (ended(req)) return;
          admitted.set(req, principal);
          serve(req, res);
        },
        (err: unknown) => {
          if (err instanceof ConnectError) return refuse(req, res, method.input, err.rawMessage, err.code, err.metadata);
          if (databaseUnavailable(err)) {
            down.note({ err, path: req.url });
            return refuse(req, res, method.input, unavailableMessage(err), Code.Unavailable);
          }
          deps.log.error({ err, path: req.url }, 'gRPC request failed: its key could not be checked');
          refuse(req, res, method.input, 'internal error', Code.Internal);
        },
      )
      // Nothing above may end the process (an unhandled rejection would, with every agent stream).
      .catch((err: unknown) => {
        deps.log.error({ err, path: req.url }, 'gRPC request failed');
        if (!ended(req)) res.stream.close(http2.constants.NGHTTP2_INTERNAL_ERROR);
      });
  }, methods);
  // The limits are HTTP/2 SETTINGS: a client learns them when it connects.
  const settings: http2.Settings = { maxConcurrentStreams: MAX_CONCURRENT_STREAMS };
  const server = tls
    ? http2.createSecureServer({ cert: readFileSync(tls.certFile), key: readFileSync(tls.keyFile), allowHTTP1: true, settings, ...clientCertificates(tls) }, handler)
    : http2.createServer({ settings }, handler);
  if (tls?.clientCaFile) refusedHandshakes(server as http2.Http2SecureServer, deps.log);
  const sessions = new Set<http2.ServerHttp2Session>();
  server.on('session', (s) => {
    sessions.add(s);
    const unwatch = deps.agentKeepaliveMs ? keepalive(s, deps.agentKeepaliveMs, deps.log) : undefined;
    s.on('close', () => {
      sessions.delete(s);
      unwatch?.();
    });
  });
  const address = await listenOn(server, addr, deps.log);
  deps.log.info({ addr: `${address.address}:${address.port}`, tls: Boolean(tls), clientCertificates: Boolean(tls?.clientCaFile) }, 'gRPC listening');
  let closing: Promise<void> | undefined;
  return {
    address,
    health,
    close: () =>
      (closing ??= (async () => {
        health.shutdown();
        // What the summaries counted and have not said yet.
        keys.flush();
        down.flush();
        const closed = new Promise<void>((resolve) => server.close(() => resolve()));
        // No job is claimed for a stream from here on (a claim whose Assign could no longer be
        // sent would wait out its claim deadline); then every stream is told to go elsewhere.
        // A claim still in flight is waited for as the hub waits for its statements (a database
        // that stopped answering must not hold the stop until TCP gives up, minutes later).
        await endsWithin(deps.dispatcher?.stop(), deps.hub.stopWaitMs);
        await deps.hub.stop();
        // Streams end once their sessions' output closes; give HTTP/2 sessions a moment, then cut.
        const deadline = setTimeout(() => sessions.forEach((s) => s.destroy()), 2000);
        for (const s of sessions) s.close();
        await closed;
        clearTimeout(deadline);
      })()),
  };
}

/**
 * mTLS (`TlsFiles.clientCaFile`): every connection must present a certificate signed by one of
 * its CAs, or its handshake fails (no call is read, so neither is a token: the token is still
 * checked on every call that gets through). Nothing without it.
 */
function clientCertificates(tls: TlsFiles): Pick<http2.SecureServerOptions, 'requestCert' | 'rejectUnauthorized' | 'ca'> {
  if (!tls.clientCaFile) return {};
  return { requestCert: true, rejectUnauthorized: true, ca: readFileSync(tls.clientCaFile) };
}

/**
 * Logs the handshakes mTLS refused for want of a client certificate, with the peer's address:
 * what an operator looks for when an agent cannot connect. A certificate no configured CA signed
 * cannot be logged: Node checks the chain after the handshake and destroys the socket without an
 * alert or an event. Other failed handshakes (scanners, plain HTTP on the TLS port) go unlogged,
 * as without mTLS.
 */
function refusedHandshakes(server: http2.Http2SecureServer, log: Pick<Logger, 'warn'>): void {
  server.on('tlsClientError', (err: NodeJS.ErrnoException, socket) => {
    if (/CERTIFICATE|CERT_/.test(String(err.code))) {
      log.warn({ remote: `${socket.remoteAddress}:${socket.remotePort}`, code: err.code, reason: err.message }, 'TLS handshake refused: no client certificate signed by LEASEHOLD_TLS_CLIENT_CA');
    }
    // Node destroys the socket itself (a failed handshake), listener or not.
  });
}

type NodeHandler = (req: http2.Http2ServerRequest, res: http2.Http2ServerResponse) => void;

/** What the gRPC listener knows of a method before Connect's handler runs. */
interface MethodInfo {
  /** The input message's type name, to name it when its bytes do not decode. */
  input: string;
  /** The call needs a key (`needsKey`): it is checked before the body is read. */
  keyed: boolean;
  /** The caller sends one message and ends (unary, server streaming): its body has a deadline. */
  oneMessage: boolean;
  /** The server may answer with more than one message (server streaming, bidi), the agent stream aside: bounded when open (`openStreamGate`). */
  streaming: boolean;
}

/**
 * Admits an open streaming call within `bounds` (see `OpenStreamBounds`) and ends it after
 * `bounds.maxMs`; refuses it otherwise (false: answered already).
 */
function openStreamGate(bounds: OpenStreamBounds, log: Logger): (req: http2.Http2ServerRequest, res: http2.Http2ServerResponse, input: string) => boolean {
  let total = 0;
  const perConnection = new WeakMap<object, number>();
  const refused = new LogSummary(log, 'warn', 'reflection or health stream refused: too many open');
  return (req, res, input) => {
    const connection: object = req.httpVersionMajor === 2 ? req.stream.session! : req.socket;
    const here = perConnection.get(connection) ?? 0;
    if (here >= bounds.perConnection || total >= bounds.max) {
      refused.note({ path: req.url, onConnection: here, total });
      refuse(req, res, input, `too many open reflection and health streams (${bounds.perConnection} a connection, ${bounds.max} in all): end some, or ask Health/Check`, Code.ResourceExhausted);
      return false;
    }
    total++;
    perConnection.set(connection, here + 1);
    const timer = setTimeout(() => {
      if (ended(req)) return;
      if (req.httpVersionMajor === 2) res.stream.close(http2.constants.NGHTTP2_CANCEL);
      else res.destroy();
    }, bounds.maxMs);
    res.once('close', () => {
      clearTimeout(timer);
      total--;
      perConnection.set(connection, (perConnection.get(connection) ?? 1) - 1);
    });
    return true;
  };
}

/**
 * Answers a call at once with `code` (UNAUTHENTICATED by default) and `message`, its body unread,
 * in one HEADERS frame that ends the stream (gRPC's trailers-only answer: grpc-js reads a status
 * only from headers that end the stream, or from trailers). Node then resets the stream with
 * NO_ERROR, which tells the client to stop sending (RFC 9113, 8.1). Over HTTP/1.1 (TLS with
 * `allowHTTP1`) the connection is closed.
 */
function refuse(
  req: http2.Http2ServerRequest,
  res: http2.Http2ServerResponse,
  input: string | undefined,
  message: string,
  code: Code = Code.Unauthenticated,
  /** Metadata sent with the status, e.g. the `retry-after` of a caller past its bound of refused keys. */
  metadata?: Headers,
): void {
  if (res.headersSent || ended(req)) return;
  const type = req.headers['content-type'];
  const headers = withPlainMessage(
    {
      ...(metadata ? Object.fromEntries(metadata) : {}),
      ':status': 200,
      'content-type': type?.startsWith('application/grpc') ? type : 'application/grpc+proto',
      'grpc-status': String(code),
      // Encoded as Connect encodes it, then the gRPC way, as for every answer (`withPlainMessage`).
      'grpc-message': encodeURIComponent(message),
    } as http2.OutgoingHttpHeaders,
    input,
  );
  if (req.httpVersionMajor === 2) return void res.stream.respond(headers, { endStream: true });
  delete headers[':status'];
  res.writeHead(200, { ...headers, connection: 'close' });
  res.end();
}

/** The address a call came from; undefined once its connection is gone (Node then throws on reading the socket of an HTTP/2 call). */
function remoteOf(req: http2.Http2ServerRequest): string | undefined {
  try {
    return req.socket.remoteAddress;
  } catch {
    return undefined;
  }
}

/** True once nothing more can be answered on the call (its stream reset or closed, its connection gone). */
function ended(req: http2.Http2ServerRequest): boolean {
  return req.httpVersionMajor === 2 ? req.stream.destroyed || req.stream.closed : req.socket.destroyed;
}

/**
 * Resets an HTTP/2 call whose body has not arrived in full within `ms` (CANCEL): a caller that
 * sends a body slowly, or never ends it, holds a stream and what it sent only that long. A call
 * answered before its body ended (an error: a message over the size limit) has its stream
 * closed once the answer is out (NO_ERROR: the client stops sending, RFC 9113 8.1); Node does
 * that by itself only for an answer without trailers whose body was never read (`refuse`).
 * Calls that arrive over HTTP/1.1 (TLS with `allowHTTP1`) are left to Node's own timeouts.
 */
function bodyDeadline(req: http2.Http2ServerRequest, ms: number, log: Pick<Logger, 'debug'>): void {
  if (req.httpVersionMajor !== 2) return;
  const stream = req.stream;
  if (stream.endAfterHeaders) return;
  const timer = setTimeout(() => {
    if (req.complete) return;
    log.debug({ path: req.url, waitedMs: ms }, 'gRPC call reset: its body did not arrive in time');
    stream.close(http2.constants.NGHTTP2_CANCEL);
  }, ms);
  stream.once('close', () => clearTimeout(timer));
  // A gRPC answer ends with trailers: once they are handed to HTTP/2 (the compatibility layer
  // sends them from its own, earlier, 'wantTrailers' listener), the reset goes out after them.
  stream.once('wantTrailers', () => {
    if (!req.complete) setImmediate(() => stream.destroyed || stream.close(http2.constants.NGHTTP2_NO_ERROR));
  });
}

/**
 * Error messages every gRPC client reads as sent. Connect percent-encodes `grpc-message` with
 * `encodeURIComponent`; grpc-js (our SDK's transport, and others') decodes it with `decodeURI`,
 * which leaves `%3A`, `%2C`, `%3B`… as they are, so "Hello refused: …" arrived as
 * "Hello refused%3A …". The gRPC spec asks only for bytes outside 0x20–0x7E and `%` to be
 * encoded, which every decoder undoes: the header is re-encoded that way, in the headers of an
 * error without messages and in the trailers.
 */
function plainGrpcMessages(
  handler: (req: http2.Http2ServerRequest, res: http2.Http2ServerResponse, method: MethodInfo | undefined) => void,
  methods: ReadonlyMap<string, MethodInfo>,
): NodeHandler {
  return (req, res) => {
    const method = methods.get((req.url ?? '').split('?', 1)[0]!);
    const input = method?.input;
    const writeHead = res.writeHead.bind(res) as (status: number, headers?: http2.OutgoingHttpHeaders) => unknown;
    const addTrailers = res.addTrailers.bind(res);
    (res as { writeHead: unknown }).writeHead = (status: number, headers?: http2.OutgoingHttpHeaders) => writeHead(status, headers && withPlainMessage(headers, input));
    res.addTrailers = (trailers) => addTrailers(withPlainMessage(trailers, input));
    handler(req, res, method);
  };
}

/**
 * `grpc-message` re-encoded as above; and bytes that do not decode as the method's input are the
 * caller's mistake: Connect answers INTERNAL ("parse binary: …"), this makes it INVALID_ARGUMENT
 * naming the message.
 */
function withPlainMessage<H extends Record<string, unknown>>(headers: H, input: string | undefined): H {
  const m = headers['grpc-message'];
  if (typeof m !== 'string') return headers;
  let text: string;
  try {
    text = decodeURIComponent(m);
  } catch {
    return headers;
  }
  const malformed = String(headers['grpc-status']) === String(Code.Internal) && text.startsWith('parse binary: ');
  if (malformed) text = malformedMessage(input, text);
  const encoded = Array.from(Buffer.from(text, 'utf8'), (b) => (b >= 0x20 && b <= 0x7e && b !== 0x25 ? String.fromCharCode(b) : `%${b.toString(16).toUpperCase().padStart(2, '0')}`)).join('');
  return { ...headers, 'grpc-message': encoded, ...(malformed ? { 'grpc-status': String(Code.InvalidArgument) } : {}) };
}

/** What a caller is told when its bytes do not decode as `input` (Connect's "parse binary: …" says which way). */
export function malformedMessage(input: string | undefined, parseError: string): string {
  return `malformed ${input ?? 'request message'}: ${parseError.replace(/^parse binary: /, '')}`;
}

/**
 * PINGs `session` every `everyMs` and destroys it when an ack takes `everyMs` more: a peer that
 * slept, lost its network or froze answers nothing, and without this its streams stayed open
 * (and its agent's free slots kept being filled) until the kernel gave the socket up. Its agent
 * streams then end as lost, their attempts suspect, as for any lost stream. Returns the stop.
 */
export function keepalive(session: http2.Http2Session, everyMs: number, log: Pick<Logger, 'warn'>): () => void {
  let unanswered: NodeJS.Timeout | undefined;
  const tick = setInterval(() => {
    if (unanswered || session.closed || session.destroyed) return;
    unanswered = setTimeout(() => {
      log.warn({ remote: `${session.socket?.remoteAddress}:${session.socket?.remotePort}`, waitedMs: everyMs }, 'connection unanswered: no PING ack; closing it (its agent streams end as lost)');
      session.destroy();
    }, everyMs);
    const sent = session.ping((err) => {
      clearTimeout(unanswered);
      unanswered = undefined;
      if (err && !session.destroyed) session.destroy();
    });
    if (!sent) {
      clearTimeout(unanswered);
      unanswered = undefined;
    }
  }, everyMs);
  return () => {
    clearInterval(tick);
    clearTimeout(unanswered);
  };
}

/** `host:port` or `[v6]:port` → [host, port]. */
export function splitAddr(addr: string): [string, number] {
  const m = /^\[?([^\]]+?)\]?:(\d+)$/.exec(addr);
  if (!m) throw new Error(`not host:port: ${addr}`);
  return [m[1]!, Number(m[2])];
}

/**
 * Listens on `host:port` (a port of 0 picks one); resolves with the bound address, rejects on a
 * listen error. Once listening, a server error (an `accept` that fails: out of file descriptors
 * or memory) is logged and the server goes on: with no listener Node would throw it and end the
 * process, every agent stream with it.
 */
export async function listenOn(server: Server, addr: string, log: Pick<Logger, 'error'>): Promise<AddressInfo> {
  const [host, port] = splitAddr(addr);
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(port, host, () => {
      server.off('error', reject);
      resolve();
    });
  });
  server.on('error', (err) => log.error({ err, addr }, 'listener error; still listening'));
  return server.address() as AddressInfo;
}
