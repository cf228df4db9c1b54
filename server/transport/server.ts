/**
 * The gRPC listener: one Connect router for every service (gRPC, gRPC-Web and Connect on
 * HTTP/2), cleartext h2c by default, TLS when a certificate and key are configured.
 */
import { readFileSync } from 'node:fs';
import http2 from 'node:http2';
import type { AddressInfo, Server } from 'node:net';
import { Code, type ConnectRouter } from '@connectrpc/connect';
import { connectNodeAdapter } from '@connectrpc/connect-node';
import type { Activity } from '../core/activity.js';
import type { AgentHub } from '../core/agent-hub.js';
import type { Dispatcher } from '../core/dispatcher.js';
import type { CredentialCache } from '../core/credential-cache.js';
import type { Logger } from '../log.js';
import type { Queryable } from '../store/index.js';
import { adminRoutes } from './admin-routes.js';
import { forAgentLane, serveAgentLane } from './agent-lane.js';
import { agentStreams } from './agent-routes.js';
import { attemptRoutes } from './attempt-routes.js';
import { authInterceptor, type Principal } from './auth.js';
import { createHealth, healthRoutes, type HealthController } from './health.js';
import { jobRoutes } from './job-routes.js';
import type { QueueWaker } from '../core/queue-waker.js';
import { endsWithin } from '../core/settle.js';
import type { Metrics } from './metrics.js';
import { readDescriptorSet, reflectionRoutes } from './reflection.js';

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
   * Verified credentials, shared by both listeners (the coordinator keeps it in step with
   * revocations); without it every call is verified in the database.
   */
  credentials?: CredentialCache<Principal> | undefined;
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
}

export interface TlsFiles {
  certFile: string;
  keyFile: string;
}

/** Largest message accepted (a Completed with many results); single documents are bounded lower. */
export const READ_MAX_BYTES = 8 * 1024 * 1024;

/**
 * Every service on one router: JobService, AttemptService, AgentService, AdminService, health,
 * reflection. `agents`: the agent stream's handler when the listener also serves it itself.
 */
export function routes(deps: ServerDeps, health: HealthController, agents = agentStreams(deps)) {
  return (router: ConnectRouter) => {
    jobRoutes(deps)(router);
    attemptRoutes(deps)(router);
    agents.routes(router);
    adminRoutes(deps)(router);
    healthRoutes({ health })(router);
    reflectionRoutes({ sourceInfo: readDescriptorSet() })(router);
  };
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
  // The input message of each method, to name it when its bytes do not decode.
  const inputs = new Map<string, string>();
  const agents = agentStreams(deps);
  const connectHandler: NodeHandler = connectNodeAdapter({
      // No compression: agents sit on the same machine or LAN, where gzip costs more CPU on both
      // ends than the bytes it saves (assignments of hundreds of jobs were being gzipped).
      acceptCompression: [],
      // gRPC only on this listener (grpcurl, buf curl --protocol grpc, agents); the Connect
      // protocol is the HTTP listener's.
      connect: false,
      grpcWeb: false,
      routes: (router) => {
        routes(deps, health, agents)(router);
        for (const h of router.handlers) inputs.set(h.requestPath, h.method.input.typeName);
      },
      interceptors: [authInterceptor({ db: deps.db, credentials: deps.credentials })],
      readMaxBytes: READ_MAX_BYTES,
    });
  // Agents' streams past Connect's per-message pipeline (agent-lane.ts); everything else through it.
  const handler = plainGrpcMessages((req, res) => {
    if (forAgentLane(req)) return serveAgentLane(agents.handler, req, res, READ_MAX_BYTES);
    try {
      connectHandler(req, res);
    } catch (err) {
      // connect-node builds the request's URL synchronously from `:authority` (or `Host`), in
      // Node's 'request' event: a value that is no URL's host (`x:99999`) threw there, and ended
      // the process, before any key was looked at.
      deps.log.warn({ err, authority: req.headers[':authority'] ?? req.headers.host, path: req.url }, 'request refused: its authority (Host) is not a valid host');
      if (res.headersSent) return void (req.httpVersionMajor === 2 ? res.stream.close(http2.constants.NGHTTP2_PROTOCOL_ERROR) : res.destroy());
      if (req.httpVersionMajor !== 2) return void res.writeHead(400, { 'content-type': 'text/plain' }).end('bad Host header\n');
      res.writeHead(200, { 'content-type': 'application/grpc', 'grpc-status': String(Code.InvalidArgument), 'grpc-message': 'bad :authority' }).end();
    }
  }, inputs);
  const server = tls
    ? http2.createSecureServer({ cert: readFileSync(tls.certFile), key: readFileSync(tls.keyFile), allowHTTP1: true }, handler)
    : http2.createServer(handler);
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
  deps.log.info({ addr: `${address.address}:${address.port}`, tls: Boolean(tls) }, 'gRPC listening');
  let closing: Promise<void> | undefined;
  return {
    address,
    health,
    close: () =>
      (closing ??= (async () => {
        health.shutdown();
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

type NodeHandler = (req: http2.Http2ServerRequest, res: http2.Http2ServerResponse) => void;

/**
 * Error messages every gRPC client reads as sent. Connect percent-encodes `grpc-message` with
 * `encodeURIComponent`; grpc-js (our SDK's transport, and others') decodes it with `decodeURI`,
 * which leaves `%3A`, `%2C`, `%3B`… as they are, so "Hello refused: …" arrived as
 * "Hello refused%3A …". The gRPC spec asks only for bytes outside 0x20–0x7E and `%` to be
 * encoded, which every decoder undoes: the header is re-encoded that way, in the headers of an
 * error without messages and in the trailers.
 */
function plainGrpcMessages(handler: NodeHandler, inputs: ReadonlyMap<string, string>): NodeHandler {
  return (req, res) => {
    const input = inputs.get((req.url ?? '').split('?', 1)[0]!);
    const writeHead = res.writeHead.bind(res) as (status: number, headers?: http2.OutgoingHttpHeaders) => unknown;
    const addTrailers = res.addTrailers.bind(res);
    (res as { writeHead: unknown }).writeHead = (status: number, headers?: http2.OutgoingHttpHeaders) => writeHead(status, headers && withPlainMessage(headers, input));
    res.addTrailers = (trailers) => addTrailers(withPlainMessage(trailers, input));
    handler(req, res);
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
