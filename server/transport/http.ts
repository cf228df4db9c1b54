/**
 * The HTTP/1.1 listener: the gateway for n8n and scripts. It serves the same router as the gRPC
 * listener (`routes()`, same auth interceptor) in Connect's protocol — `POST
 * /leasehold.v1.<Service>/<Method>` with a JSON body — plus `GET /healthz`, `GET /metrics`
 * (Prometheus, with a `read` key) and the dashboard at `/` (`dashboard.ts`).
 *
 * What it adds to a plain Connect adapter, so an n8n IF node can branch on any answer:
 * - every error body is JSON: Connect's `code` / `message` / `details`, plus `status` (the HTTP
 *   status), `outcome` (stale, conflict, invalid, too_large, not_found, forbidden,
 *   unauthenticated, …), `field` for bad input, `current` (the job's state) for stale and
 *   conflict, and `limitBytes` for oversized input;
 * - oversized input is 413: a body over `HTTP_READ_MAX_BYTES` is refused before it is read, and
 *   a document over its own bound (payload, result) is `too_large` from the store;
 * - a call that needs a key is answered 401 before its body is read, from its `Authorization`
 *   header alone (`refuseKey`), so a caller without a key makes the listener hold nothing, and
 *   429 once its address has had too many keys refused (key-gate.ts); a JSON body nested past
 *   `BODY_DEPTH_MAX` is refused before it is parsed (`jsonDepthOver`);
 * - unknown paths are 404 JSON; responses carry every field, zero values included;
 * - `EnqueueJob` with a plain JSON body, the call n8n makes per job, is answered past Connect's
 *   per-call machinery, with the same bytes (gateway-enqueue.ts).
 */
import { readFileSync } from 'node:fs';
import http from 'node:http';
import https from 'node:https';
import type { AddressInfo } from 'node:net';
import { fromJson, toJson, type DescMessage, type JsonValue } from '@bufbuild/protobuf';
import {
  Code,
  ConnectError,
  createConnectRouter,
  createContextKey,
  createContextValues,
  type ContextValues,
  type Interceptor,
} from '@connectrpc/connect';
import type { UniversalHandler, UniversalServerRequest, UniversalServerResponse } from '@connectrpc/connect/protocol';
import { CurrentStateSchema } from '../../gen/leasehold/v1/job_pb.js';
import { LogSummary } from '../lib/log-summary.js';
import type { Failure } from '../domain/outcomes.js';
import { databasePing } from '../store/index.js';
import { limits } from '../domain/validation.js';
import { authInterceptor, bearer, bearerToken, hasScope, MISSING_KEY, needsKey, principalKey, type Principal } from './auth.js';
import { toPbCurrent } from './codec.js';
import { httpStatusOf, outcomeOfCode } from './outcome-wire.js';
import { directEnqueue, ENQUEUE_PATH, takesDirectPath, type DirectAnswer, type DirectEnqueue } from './gateway-enqueue.js';
import { impossibleRunAt } from './enqueue-request.js';
import { enqueueJobCall } from './job-routes.js';
import { databaseUnavailable, storeErrors, unavailableLog, unavailableMessage } from './store-errors.js';
import { isDashboardPath, serveDashboard } from './dashboard.js';
import { createHealth, type HealthController } from './health.js';
import { createKeyGate, type KeyGate } from './key-gate.js';
import { BODY_TIMEOUT_MS, listenOn, malformedMessage, OPEN_READ_MAX_BYTES, routes, type ServerDeps, type TlsFiles } from './server.js';

/** How long `/healthz` waits for the database before answering 503. */
export const HEALTHZ_PING_MS = 2_000;

/** How long `/healthz` keeps the database's answer (`databaseCheck`). */
export const HEALTHZ_CACHE_MS = 1_000;

/** How long an idle kept-alive connection is kept (longer than clients and proxies keep theirs). */
export const KEEP_ALIVE_MS = 65_000;

/** Largest request body the gateway reads (documents inside are bounded lower, 256 KiB). */
export const HTTP_READ_MAX_BYTES = 1024 * 1024;

/** How much of an oversized body is read away after its 413 before the connection is closed. */
export const HTTP_DISCARD_MAX_BYTES = 16 * 1024 * 1024;

/** How long a request's headers may take to arrive (at most the body's deadline, `ServerDeps.bodyTimeoutMs`). */
export const HEADERS_TIMEOUT_MS = 15_000;

/**
 * Deepest nesting of a JSON body: the documents in it (payload, result) are refused past
 * `limits.jsonDepth` by their validation, which names the field; this bound, a few levels
 * above, is checked before the body is parsed, since parsing a megabyte of `[[[[…` takes the
 * event loop for a third of a second.
 */
export const BODY_DEPTH_MAX = limits.jsonDepth + 8;

/** Bodies up to this size are parsed without the depth scan: they cannot nest deep enough to cost anything. */
export const DEPTH_SCAN_MIN_BYTES = 16 * 1024;

export interface HttpServer {
  /** The bound address (the port is real when 0 was asked for). */
  address: AddressInfo;
  health: HealthController;
  /** Stops accepting, lets requests in flight finish (closing idle connections). Safe to call twice. */
  close(): Promise<void>;
}

/** Holds the failure a handler threw, for the error body. */
const failureKey = createContextKey<{ failure?: Failure }>({}, { description: 'the outcome behind an error' });

const isFailure = (v: unknown): v is Failure =>
  typeof v === 'object' && v !== null && typeof (v as { outcome?: unknown }).outcome === 'string';

/** Keeps the `Failure` a handler threw (the `cause` of its ConnectError, see toConnectError). */
const captureFailure: Interceptor = (next) => async (req) => {
  try {
    return await next(req);
  } catch (err) {
    if (err instanceof ConnectError && isFailure(err.cause)) req.contextValues.get(failureKey).failure = err.cause;
    throw err;
  }
};

/** Listens on `addr` (`host:port`) with every service, over HTTP/1.1 (HTTPS when `tls` is given). */
export async function listenHttp(deps: ServerDeps, addr: string, tls?: TlsFiles): Promise<HttpServer> {
  const health = createHealth({ services: ['leasehold.v1.JobService', 'leasehold.v1.AttemptService', 'leasehold.v1.AdminService'] });
  const interceptors = [captureFailure, storeErrors(deps.log), authInterceptor({ db: deps.db, credentials: deps.credentials })];
  // n8n reads fields by name: emit zero values too (attemptNo: 0, priority: 0, ...). A field
  // the API does not have is a typo to report (400 naming it), not something to ignore.
  const jsonOptions = { alwaysEmitImplicit: true, ignoreUnknownFields: false };
  const router = createConnectRouter({
    // The Connect protocol only (JSON, or application/proto): gRPC is the gRPC listener's.
    grpc: false,
    grpcWeb: false,
    interceptors,
    // Over the limit the request never reaches the router; this is a second guard.
    readMaxBytes: HTTP_READ_MAX_BYTES,
    // Error bodies are rewritten here, so they must not be compressed; n8n does not need it.
    acceptCompression: [],
    jsonOptions,
  });
  routes(deps, health, undefined, { grpc: false, grpcWeb: false, readMaxBytes: OPEN_READ_MAX_BYTES })(router);
  const handlers = new Map<string, Route>(router.handlers.map((h) => [h.requestPath, { handler: h, keyed: needsKey(h.service.typeName) }]));
  const direct =
    deps.directEnqueue === false ? undefined : directEnqueue({ interceptors, jsonOptions, readMaxBytes: HTTP_READ_MAX_BYTES, impl: enqueueJobCall(deps) });
  const keys = createKeyGate({ db: deps.db, credentials: deps.credentials, log: deps.log, metrics: deps.metrics, trustProxy: deps.trustProxy, listener: 'http' });
  const databaseUp = databaseCheck(deps);

  // Once closing, every answer not yet begun closes its connection: a client keeping it alive
  // (n8n, Node's agent, a proxy upstream) sends its next request elsewhere, rather than on a
  // socket cut when the close's deadline comes (ECONNRESET, or a proxy's 502, for a request
  // perhaps done).
  let stopping = false;
  // Keys that could not be checked for want of the database: one line every 10 s (store-errors.ts).
  const down = unavailableLog(deps.log);
  const answering = new Set<http.ServerResponse>();
  const onRequest = (req: http.IncomingMessage, res: http.ServerResponse) => {
    if (stopping) res.setHeader('connection', 'close');
    answering.add(res);
    res.once('close', () => answering.delete(res));
    handle(deps, health, handlers, direct, keys, databaseUp, down, req, res).catch((err: unknown) => {
      deps.log.error({ err, path: req.url }, 'HTTP request failed');
      if (!res.headersSent) sendJson(res, 500, { code: 'internal', message: 'internal error', status: 500, outcome: 'error' });
      else res.destroy();
    });
  };
  // A request must arrive in full (headers and body) within the body's deadline: past it Node
  // answers 408 and closes the connection. Node checks every `connectionsCheckingInterval`, so the
  // cut comes up to that much later; kept-alive connections between requests are not concerned.
  const requestTimeout = deps.bodyTimeoutMs ?? BODY_TIMEOUT_MS;
  const timeouts: http.ServerOptions = {
    requestTimeout,
    headersTimeout: Math.min(HEADERS_TIMEOUT_MS, requestTimeout),
    connectionsCheckingInterval: Math.max(50, Math.min(5_000, Math.floor(requestTimeout / 4))),
  };
  const server = tls
    ? https.createServer({ cert: readFileSync(tls.certFile), key: readFileSync(tls.keyFile), ...timeouts }, onRequest)
    : http.createServer(timeouts, onRequest);
  // An idle kept-alive connection stays open longer than clients keep theirs (Node's global
  // agent 5 s, load balancers commonly 60 s): the client closes first, and never sends a request
  // into a socket the server is closing at that very moment (ECONNRESET). Node's own default
  // (5 s) races with exactly those clients.
  server.keepAliveTimeout = KEEP_ALIVE_MS;
  const address = await listenOn(server, addr, deps.log);
  deps.log.info({ addr: `${address.address}:${address.port}`, tls: Boolean(tls) }, 'HTTP listening');
  let closing: Promise<void> | undefined;
  return {
    address,
    health,
    close: () =>
      (closing ??= (async () => {
        stopping = true;
        for (const res of answering) if (!res.headersSent) res.setHeader('connection', 'close');
        health.shutdown();
        // What the summaries counted and have not said yet.
        keys.flush();
        down.flush();
        const closed = new Promise<void>((resolve) => server.close(() => resolve()));
        server.closeIdleConnections();
        const deadline = setTimeout(() => server.closeAllConnections(), 2000);
        await closed;
        clearTimeout(deadline);
      })()),
  };
}

/** A method the gateway serves: Connect's handler, and whether it needs a key (`needsKey`). */
interface Route {
  handler: UniversalHandler;
  keyed: boolean;
}

const EMPTY = Buffer.alloc(0);

async function handle(
  deps: ServerDeps,
  health: HealthController,
  handlers: Map<string, Route>,
  direct: DirectEnqueue | undefined,
  keys: KeyGate,
  databaseUp: () => Promise<boolean>,
  down: LogSummary,
  req: http.IncomingMessage,
  res: http.ServerResponse,
): Promise<void> {
  const [path, query] = splitUrl(req.url ?? '/');
  const leaked = query && credentialParam(query);
  if (leaked) {
    // Refused, not ignored: a key in a URL is written to proxy logs, shell and browser histories.
    return sendJson(res, 400, {
      code: 'invalid_argument',
      message: `credentials are never read from the URL (query parameter "${leaked}"): send "Authorization: Bearer <key>", and revoke a key that was sent this way`,
      status: 400,
      outcome: 'invalid',
      field: leaked,
    });
  }
  if (path === '/healthz') return healthz(deps, health, databaseUp, req, res);
  if (path === '/metrics' && deps.metrics) return metrics(deps, keys, req, res);
  if (isDashboardPath(path)) return serveDashboard(path, req, res);
  const route = handlers.get(path);
  if (!route) {
    const rpc = /^\/[\w.]+\.[\w]+\/\w+$/.test(path);
    return sendJson(res, 404, {
      code: rpc ? 'unimplemented' : 'not_found',
      message: rpc ? `no such method: ${path}` : `no such path: ${path} (methods are POST /leasehold.v1.<Service>/<Method>)`,
      status: 404,
      outcome: 'not_found',
    });
  }
  const { handler, keyed } = route;
  // Calls that stream their answers (reflection, Health/Watch, the agent stream) are the gRPC
  // listener's, where they are bounded: Connect served Health/Watch here, open to anyone, and
  // answered a body it could not frame with a 500 and an error logged with its stack.
  if (handler.method.methodKind !== 'unary') {
    readAway(req, res);
    return sendJson(res, 505, { ...codeOfStatus(505), message: `${path} streams its answers: call it on the gRPC listener (grpcurl, buf curl --protocol grpc)`, status: 505 });
  }
  // Other verbs are Connect's to answer (405), without a body: none is read.
  const post = req.method === 'POST';
  // The key before the body: a caller without one is answered from the headers alone.
  let principal: Principal | undefined;
  if (post && keyed) {
    const token = bearerToken(req.headers.authorization);
    if (!token) return refuseKey(req, res, MISSING_KEY);
    try {
      principal = await keys.check(token, req.socket.remoteAddress, req.headers['x-forwarded-for']);
    } catch (err) {
      if (err instanceof ConnectError) return err.code === Code.ResourceExhausted ? refuseLimited(req, res, err) : refuseKey(req, res, err.rawMessage);
      if (!databaseUnavailable(err)) throw err;
      // The key could not be checked: the database cannot answer now (store-errors.ts).
      down.note({ err, path });
      readAway(req, res);
      res.setHeader('retry-after', '1');
      return sendJson(res, 503, { code: 'unavailable', message: unavailableMessage(err), status: 503, outcome: 'error' });
    }
  }
  const limit = keyed ? HTTP_READ_MAX_BYTES : OPEN_READ_MAX_BYTES;
  const body = post ? await readBody(req, limit) : EMPTY;
  if (body === 'too_large') {
    readAway(req, res);
    return sendJson(res, 413, {
      code: 'invalid_argument',
      message: `the request body is over the limit of ${limit} bytes`,
      status: 413,
      outcome: 'too_large',
      limitBytes: limit,
    });
  }
  // An empty JSON body is an empty message (curl -d '', a node that sends no body): `{}`.
  const isJson = /^application\/json\b/i.test(req.headers['content-type'] ?? '');
  const payload = body.length === 0 && isJson ? Buffer.from('{}') : body;
  if (isJson && payload.length > DEPTH_SCAN_MIN_BYTES && jsonDepthOver(payload, BODY_DEPTH_MAX)) {
    return sendJson(res, 400, {
      code: 'invalid_argument',
      message: `the request body nests deeper than ${BODY_DEPTH_MAX} levels (a document in it, at most ${limits.jsonDepth})`,
      status: 400,
      outcome: 'invalid',
    });
  }
  const holder: { failure?: Failure } = {};
  const contextValues = createContextValues().set(failureKey, holder);
  // The auth interceptor takes the caller checked above, and does not look the key up again.
  if (principal) contextValues.set(principalKey, principal);
  const header = requestHeaders(req, payload.length);
  const url = requestUrl(req);
  const isDirect = direct && path === ENQUEUE_PATH && takesDirectPath(req.method, header);
  // Connect parses the request's URL, made from the Host header: a Host that is no host
  // (`a b`, `x:99999`) is the caller's mistake, not a 500.
  if (!isDirect && !URL.canParse(url)) {
    return sendJson(res, 400, { code: 'invalid_argument', message: `the Host header is not a valid host: ${JSON.stringify(req.headers.host ?? '')}`, status: 400, outcome: 'invalid', field: 'host' });
  }
  // An EnqueueJob that Connect decodes (a compressed body, a `connect-timeout-ms`): protobuf-es
  // moves an impossible runAt (February 30th, 24:00) to another day; refused as the direct path
  // refuses it (enqueue-request.ts). A compressed body is Connect's to read, and is not checked.
  if (!isDirect && path === ENQUEUE_PATH && isJson && !req.headers['content-encoding']) {
    let json: unknown;
    try {
      json = JSON.parse(payload.toString('utf8'));
    } catch {
      json = undefined; // Connect answers what does not parse
    }
    const bad = impossibleRunAt(json);
    if (bad) return sendJson(res, 400, { code: 'invalid_argument', message: bad.rawMessage, status: 400, outcome: 'invalid', field: 'runAt' });
  }
  const answer = isDirect
    ? await direct(url, header, payload, contextValues)
    : await viaConnect(handler, universalRequest(req, res, url, header, payload, contextValues));
  const raw = answer.body;
  if (answer.status === 200) {
    const headers: http.OutgoingHttpHeaders = {};
    answer.header.forEach((v, k) => (headers[k] = v));
    res.writeHead(200, headers);
    return void res.end(raw);
  }
  let connect: Record<string, unknown> | undefined;
  try {
    const parsed: unknown = JSON.parse(Buffer.from(raw.buffer, raw.byteOffset, raw.byteLength).toString('utf8'));
    if (parsed && typeof parsed === 'object' && !Array.isArray(parsed)) connect = parsed as Record<string, unknown>;
  } catch {
    connect = undefined;
  }
  // Bytes that do not decode as the method's input are the caller's mistake, not INTERNAL.
  if (connect?.code === 'internal' && typeof connect.message === 'string' && connect.message.startsWith('parse binary: ')) {
    connect = { code: 'invalid_argument', message: malformedMessage(handler.method.input.typeName, connect.message) };
    answer.status = 400;
  }
  const { status, json } = errorBody(answer.status, connect, holder.failure, () => failingKey(handler.method.input, payload));
  answer.header.forEach((v, k) => {
    if (k !== 'content-type' && k !== 'content-length' && k !== 'content-encoding') res.setHeader(k, v);
  });
  sendJson(res, status, json);
}

/**
 * The request as Connect's handler reads it, for a body this listener has already read: the
 * bytes as they are (a unary handler parses a byte body without iterating it; the declared type
 * lists only streams and parsed JSON) and a signal that aborts if the client goes away before its
 * answer is written. connect-node's adapter (`universalRequestFromNodeRequest`) wraps the body in
 * an async iterable and aborts the signal after every answer too; that abort's `DOMException`
 * alone was 1.9 % of the coordinator's profile with jobs arriving one by one (docs/performance.md).
 */
function universalRequest(
  req: http.IncomingMessage,
  res: http.ServerResponse,
  url: string,
  header: Headers,
  body: Buffer,
  contextValues: ContextValues,
): UniversalServerRequest {
  const abort = new AbortController();
  res.once('close', () => {
    if (!res.writableFinished) abort.abort(new ConnectError('the client closed the connection', Code.Canceled));
  });
  return {
    httpVersion: req.httpVersion,
    method: req.method ?? '',
    url,
    header,
    body: body as unknown as JsonValue,
    signal: abort.signal,
    contextValues,
  };
}

/** A request's headers as Fetch's `Headers`, with the length of the body as read. */
function requestHeaders(req: http.IncomingMessage, bodyLength: number): Headers {
  const header = new Headers();
  for (const [name, value] of Object.entries(req.headers)) {
    if (typeof value === 'string') header.set(name, value);
    else if (value) for (const v of value) header.append(name, v);
  }
  header.set('content-length', String(bodyLength));
  return header;
}

function requestUrl(req: http.IncomingMessage): string {
  const secure = 'encrypted' in req.socket && req.socket.encrypted;
  return `${secure ? 'https' : 'http'}://${req.headers.host ?? 'localhost'}${req.url ?? '/'}`;
}

/** Connect's answer, its body read. */
async function viaConnect(handler: UniversalHandler, req: UniversalServerRequest): Promise<DirectAnswer> {
  const uRes = await handler(req);
  return { status: uRes.status, header: uRes.header ?? new Headers(), body: await readAll(uRes) };
}

/** The path of a request target and its query string (without the `?`), if any. */
function splitUrl(url: string): [string, string | undefined] {
  const q = url.indexOf('?');
  return q < 0 ? [url, undefined] : [url.slice(0, q), url.slice(q + 1)];
}

/** Query parameter names that carry a credential in other APIs; none is ever read here. */
const CREDENTIAL_PARAMS = new Set(['key', 'api_key', 'apikey', 'token', 'access_token', 'auth', 'authorization', 'bearer', 'password']);

/** The first query parameter named like a credential, if any. */
function credentialParam(query: string): string | undefined {
  for (const name of new URLSearchParams(query).keys()) if (CREDENTIAL_PARAMS.has(name.toLowerCase())) return name;
  return undefined;
}

/** Connect codes and outcomes for bodiless protocol answers (415, 405, ...). */
function codeOfStatus(status: number): { code: string; message: string; outcome: string } {
  switch (status) {
    case 404:
      return { code: 'unimplemented', message: 'no such method', outcome: 'not_found' };
    case 405:
      return { code: 'unimplemented', message: 'use POST', outcome: 'method_not_allowed' };
    case 415:
      return { code: 'invalid_argument', message: 'send "content-type: application/json" (or application/proto)', outcome: 'invalid' };
    case 505:
      return { code: 'unimplemented', message: 'this call needs HTTP/2 (the agent stream is served on the gRPC listener)', outcome: 'error' };
    default:
      return { code: 'unknown', message: `HTTP ${status}`, outcome: 'error' };
  }
}

/**
 * The JSON body of an error: Connect's error (`code`, `message`, `details`) with plain fields
 * added for callers that cannot decode details: `status`, `outcome`, and as they apply `field`,
 * `current` and `limitBytes`.
 */
function errorBody(
  httpStatus: number,
  connect: Record<string, unknown> | undefined,
  failure: Failure | undefined,
  /** The body's top-level key that does not decode, asked only when the message names no field. */
  failingField?: () => string | undefined,
): { status: number; json: Record<string, unknown> } {
  const bare = typeof connect?.code === 'string' ? undefined : codeOfStatus(httpStatus);
  const base: Record<string, unknown> = bare ? { ...(connect ?? {}), code: bare.code, message: bare.message } : { ...connect };
  const code = String(base.code);
  const outcome = failure?.outcome ?? bare?.outcome ?? outcomeOfCode(code);
  const status = failure ? httpStatusOf(failure.outcome) : httpStatus;
  const json: Record<string, unknown> = { ...base, status, outcome };
  if (failure && (failure.outcome === 'invalid' || failure.outcome === 'too_large')) json.field = failure.field;
  else if (code === 'invalid_argument' && typeof base.message === 'string') {
    const field = fieldOfDecodeError(base.message) ?? (/cannot decode message /.test(base.message) ? failingField?.() : undefined);
    if (field) json.field = field;
  }
  if (failure && (failure.outcome === 'stale' || failure.outcome === 'conflict') && failure.current) {
    json.current = toJson(CurrentStateSchema, toPbCurrent(failure.current), { alwaysEmitImplicit: true });
  }
  if (failure?.outcome === 'too_large') json.limitBytes = failure.limitBytes;
  return { status, json };
}

/** The field a protobuf JSON decoding error names (`key "x" is unknown`, `cannot decode field a.B.x`). */
function fieldOfDecodeError(message: string): string | undefined {
  const unknown = /key "([^"]+)" is unknown/.exec(message);
  if (unknown) return unknown[1];
  const field = /cannot decode field [\w.]+\.(\w+) from JSON/.exec(message);
  return field?.[1];
}

/**
 * The top-level key of a JSON `body` that does not decode as a field of `input`, by its JSON name
 * (`runAt` for `run_at` too). A value of a message type that does not decode (`"payload": "{…}"`,
 * `"runAt": "tomorrow"`) makes protobuf-es say which message it could not decode, not which field
 * held it: each key is decoded alone to find it. Only on the error path.
 */
function failingKey(input: DescMessage, body: Uint8Array): string | undefined {
  let json: unknown;
  try {
    json = JSON.parse(Buffer.from(body.buffer, body.byteOffset, body.byteLength).toString('utf8'));
  } catch {
    return undefined;
  }
  if (typeof json !== 'object' || json === null || Array.isArray(json)) return undefined;
  for (const [key, value] of Object.entries(json as Record<string, JsonValue>)) {
    try {
      fromJson(input, { [key]: value }, { ignoreUnknownFields: false });
    } catch {
      return input.fields.find((f) => f.name === key || f.jsonName === key)?.jsonName ?? key;
    }
  }
  return undefined;
}

async function healthz(deps: ServerDeps, health: HealthController, databaseUp: () => Promise<boolean>, req: http.IncomingMessage, res: http.ServerResponse) {
  if (req.method !== 'GET' && req.method !== 'HEAD') {
    res.setHeader('allow', 'GET');
    return sendJson(res, 405, { code: 'unimplemented', message: 'use GET', status: 405, outcome: 'error' });
  }
  // Up or not, nothing more: this path is open to anyone who reaches the listener. Why it is not
  // up (stopping, the database unreachable) goes to the log.
  res.setHeader('cache-control', 'no-store');
  if (health.status('') !== 'SERVING') {
    deps.log.debug('healthz: stopping');
    return sendJson(res, 503, { status: 'unavailable' });
  }
  if (!(await databaseUp())) return sendJson(res, 503, { status: 'unavailable' });
  return sendJson(res, 200, { status: 'ok' });
}

/**
 * Whether the database answers, as `/healthz` says: one ping for all the requests that come while
 * it runs, its answer kept `HEALTHZ_CACHE_MS` after it. Anyone may ask `/healthz`, and with a ping
 * each, 4,000 requests a second took a third of PostgreSQL's CPU and slowed n8n's enqueues
 * (.scratch/review-security.md, 5). An outage still shows within about a second, and the end of
 * one too.
 */
function databaseCheck(deps: ServerDeps): () => Promise<boolean> {
  let last: { up: Promise<boolean>; at?: number } | undefined;
  return () => {
    if (last && (last.at === undefined || performance.now() - last.at < HEALTHZ_CACHE_MS)) return last.up;
    const ping: { up: Promise<boolean>; at?: number } = { up: pingWithin(deps) };
    void ping.up.then(() => (ping.at = performance.now()));
    last = ping;
    return ping.up;
  };
}

/**
 * One ping, bounded: a database that does not answer (a lock, a silent connection, every pooled
 * connection taken) is unhealthy now, not whenever it answers.
 */
async function pingWithin(deps: ServerDeps): Promise<boolean> {
  let bound: NodeJS.Timeout | undefined;
  try {
    await Promise.race([
      databasePing(deps.db),
      new Promise<never>((_, reject) => {
        bound = setTimeout(() => reject(new Error(`the database did not answer within ${HEALTHZ_PING_MS} ms`)), HEALTHZ_PING_MS);
      }),
    ]);
    return true;
  } catch (err) {
    deps.log.warn({ err }, 'healthz: database unavailable');
    return false;
  } finally {
    clearTimeout(bound);
  }
}

/**
 * GET /metrics: Prometheus exposition. Needs a key with the `read` scope (or `admin`), like
 * reading jobs does: the listener may face the internet (n8n Cloud), and queue names and volumes
 * are the operator's business. Prometheus sends it with `authorization: {credentials: <key>}`.
 */
async function metrics(deps: ServerDeps, keys: KeyGate, req: http.IncomingMessage, res: http.ServerResponse) {
  if (req.method !== 'GET' && req.method !== 'HEAD') {
    res.setHeader('allow', 'GET');
    return sendJson(res, 405, { code: 'unimplemented', message: 'use GET', status: 405, outcome: 'error' });
  }
  const token = bearer(new Headers({ authorization: req.headers.authorization ?? '' }));
  if (!token) {
    res.setHeader('www-authenticate', 'Bearer');
    return sendJson(res, 401, { code: 'unauthenticated', message: 'missing "Authorization: Bearer <key>" (a key with the read scope)', status: 401, outcome: 'unauthenticated' });
  }
  try {
    const principal = await keys.check(token, req.socket.remoteAddress, req.headers['x-forwarded-for']);
    if (!hasScope(principal, 'read')) {
      return sendJson(res, 403, { code: 'permission_denied', message: '/metrics needs the read scope', status: 403, outcome: 'forbidden' });
    }
  } catch (err) {
    if (err instanceof ConnectError && err.code === Code.ResourceExhausted) return refuseLimited(req, res, err);
    if (err instanceof ConnectError) return sendJson(res, 401, { code: 'unauthenticated', message: err.rawMessage, status: 401, outcome: 'unauthenticated' });
    throw err;
  }
  const { contentType, body } = await deps.metrics!.render();
  res.writeHead(200, { 'content-type': contentType, 'content-length': Buffer.byteLength(body), 'cache-control': 'no-store' });
  res.end(req.method === 'HEAD' ? undefined : body);
}

/** 401 for a call whose key is missing or refused, answered at once: its body is never kept (`readAway`). */
function refuseKey(req: http.IncomingMessage, res: http.ServerResponse, message: string): void {
  readAway(req, res);
  sendJson(res, 401, { code: 'unauthenticated', message, status: 401, outcome: 'unauthenticated' });
}

/** 429 for a call from an address past its refused keys (key-gate.ts), answered as `refuseKey` answers. */
function refuseLimited(req: http.IncomingMessage, res: http.ServerResponse, err: ConnectError): void {
  readAway(req, res);
  res.setHeader('retry-after', err.metadata.get('retry-after') ?? '1');
  sendJson(res, 429, { code: 'resource_exhausted', message: err.rawMessage, status: 429, outcome: 'error' });
}

/**
 * For a request answered without its body (413, 401): the rest is read and thrown away, up to
 * HTTP_DISCARD_MAX_BYTES, so that the connection stays usable and a proxy still writing the body
 * (Caddy, nginx) gets to read the answer: closing a socket with unread data makes the kernel
 * reset it, and the proxy then answers 502 instead (test/proxies.test.ts,
 * test/preauth-limits.test.ts). Nothing is kept, and a body that does not come is cut at the
 * body deadline (408, `ServerDeps.bodyTimeoutMs`). A body declared past that size closes the
 * connection after the answer.
 */
function readAway(req: http.IncomingMessage, res: http.ServerResponse): void {
  const declared = Number(req.headers['content-length']);
  if (Number.isFinite(declared) && declared > HTTP_DISCARD_MAX_BYTES) res.setHeader('connection', 'close');
  else discardRest(req);
}

/**
 * Whether the JSON text `body` nests arrays and objects deeper than `max`: one pass over the
 * bytes, strings skipped, nothing parsed. Exact for valid JSON; what is not valid JSON fails its
 * parse anyway.
 */
export function jsonDepthOver(body: Uint8Array, max: number): boolean {
  let depth = 0;
  let inString = false;
  for (let i = 0; i < body.length; i++) {
    const b = body[i]!;
    if (inString) {
      if (b === 0x5c) i++; // a backslash: the next byte is escaped
      else if (b === 0x22) inString = false;
    } else if (b === 0x22) inString = true;
    else if (b === 0x5b || b === 0x7b) {
      if (++depth > max) return true;
    } else if (b === 0x5d || b === 0x7d) depth--;
  }
  return false;
}

/**
 * The whole request body, or `too_large` past `limit` bytes. Past the limit reading stops (the
 * 413 goes out with `connection: close`, so the rest is never read).
 */
function readBody(req: http.IncomingMessage, limit: number): Promise<Buffer | 'too_large'> {
  const declared = Number(req.headers['content-length']);
  if (Number.isFinite(declared) && declared > limit) return Promise.resolve('too_large');
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let size = 0;
    const onData = (chunk: Buffer) => {
      size += chunk.length;
      if (size <= limit) return void chunks.push(chunk);
      req.off('data', onData);
      req.pause();
      resolve('too_large');
    };
    req.on('data', onData);
    req.once('end', () => resolve(Buffer.concat(chunks)));
    req.once('error', reject);
  });
}

/** Reads what is left of a request's body and drops it; past HTTP_DISCARD_MAX_BYTES, closes the connection. */
function discardRest(req: http.IncomingMessage): void {
  let discarded = 0;
  req.on('data', (chunk: Buffer) => {
    discarded += chunk.length;
    if (discarded > HTTP_DISCARD_MAX_BYTES) req.socket.destroy();
  });
  req.resume();
}

async function readAll(uRes: UniversalServerResponse): Promise<Buffer> {
  const chunks: Uint8Array[] = [];
  if (uRes.body) for await (const c of uRes.body) chunks.push(c);
  return Buffer.concat(chunks);
}

function sendJson(res: http.ServerResponse, status: number, json: unknown) {
  const text = JSON.stringify(json);
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text) });
  res.end(text);
}
