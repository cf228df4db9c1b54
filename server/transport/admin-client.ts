/**
 * The client side of the operator API, for the `leasehold` CLI: generated clients of
 * AdminService and JobService over Connect's protocol (JSON on HTTP/1.1) to the coordinator's
 * HTTP listener, with the key as the bearer, and one function that turns any failure into a
 * message a person can act on and an exit code.
 */
import { Code, ConnectError, createClient, type Client, type Interceptor } from '@connectrpc/connect';
import { createConnectTransport } from '@connectrpc/connect-node';
import { AdminService } from '../../gen/leasehold/v1/admin_service_pb.js';
import { JobService } from '../../gen/leasehold/v1/job_service_pb.js';

/** Where the coordinator's HTTP listener is, and the key to call it with. */
export interface ApiTarget {
  url: string;
  key: string;
}

export interface ApiClients {
  admin: Client<typeof AdminService>;
  jobs: Client<typeof JobService>;
  target: ApiTarget;
}

/** Exit codes of the CLI's remote commands. */
export const EXIT = {
  /** The call was refused (not found, conflict, not in a state for it) or failed. */
  failed: 1,
  /** Bad input (a flag, a name, an id). */
  invalid: 2,
  /** The coordinator could not be reached. */
  unreachable: 3,
  /** The key is missing, unknown, revoked, or lacks the scope. */
  unauthorized: 4,
} as const;

/** Clients of the coordinator at `target.url`, authenticating with `target.key`. */
export function createApiClients(target: ApiTarget, opts: { timeoutMs?: number } = {}): ApiClients {
  const auth: Interceptor = (next) => (req) => {
    req.header.set('authorization', `Bearer ${target.key}`);
    return next(req);
  };
  const transport = createConnectTransport({
    baseUrl: target.url,
    httpVersion: '1.1',
    interceptors: [auth],
    defaultTimeoutMs: opts.timeoutMs ?? 30_000,
  });
  return { admin: createClient(AdminService, transport), jobs: createClient(JobService, transport), target };
}

/** A failure of a remote command, ready to print: what went wrong, what to do, and the exit code. */
export interface ApiFailure {
  message: string;
  exitCode: number;
}

const NETWORK = /ECONNREFUSED|ENOTFOUND|EHOSTUNREACH|ENETUNREACH|ECONNRESET|EAI_AGAIN|socket hang up|fetch failed|Parse Error|HPE_|ETIMEDOUT/i;

/**
 * Node's codes (OpenSSL's verify results) for a certificate whose issuer is not trusted here: a
 * private CA, a self-signed certificate. Trusting the CA (`NODE_EXTRA_CA_CERTS`) fixes them.
 */
const UNTRUSTED_CERT = new Set([
  'UNABLE_TO_VERIFY_LEAF_SIGNATURE',
  'UNABLE_TO_GET_ISSUER_CERT',
  'UNABLE_TO_GET_ISSUER_CERT_LOCALLY',
  'DEPTH_ZERO_SELF_SIGNED_CERT',
  'SELF_SIGNED_CERT_IN_CHAIN',
  'CERT_UNTRUSTED',
]);
/** The other certificate checks that fail a connection: dates, the host name, a revoked or unfit certificate. */
const BAD_CERT = new Set([
  'CERT_HAS_EXPIRED',
  'CERT_NOT_YET_VALID',
  'ERR_TLS_CERT_ALTNAME_INVALID',
  'HOSTNAME_MISMATCH',
  'CERT_REVOKED',
  'CERT_REJECTED',
  'CERT_SIGNATURE_FAILURE',
  'INVALID_CA',
  'INVALID_PURPOSE',
  'CERT_CHAIN_TOO_LONG',
  'PATH_LENGTH_EXCEEDED',
]);

/** Explains an error thrown by a call to `target`. */
export function explainFailure(err: unknown, target: ApiTarget): ApiFailure {
  const e = ConnectError.from(err);
  const cause = causeText(e.cause);
  const detail = cause && !e.rawMessage.includes(cause) && !cause.includes(e.rawMessage) ? `${e.rawMessage}: ${cause}` : e.rawMessage || cause;
  // The connection's own failure, from the client's side (the coordinator never answered): the
  // code on the causes, which nothing the server sends can carry.
  const codes = causeCodes(e.cause);
  if (codes.some((c) => UNTRUSTED_CERT.has(c))) {
    return {
      exitCode: EXIT.unreachable,
      message: `cannot reach the coordinator at ${target.url}: ${detail} (its TLS certificate is not trusted here: if a private CA signed it, trust that CA with NODE_EXTRA_CA_CERTS=ca.pem)`,
    };
  }
  if (codes.some((c) => BAD_CERT.has(c))) {
    return { exitCode: EXIT.unreachable, message: `cannot reach the coordinator at ${target.url}: ${detail} (its TLS certificate is refused: check its dates, and that it names the host of --url)` };
  }
  const ssl = codes.includes('EPROTO') ? /SSL routines:[^:]*:([^:]+)/.exec(detail)?.[1] : undefined;
  if (ssl) {
    return { exitCode: EXIT.unreachable, message: `cannot reach the coordinator at ${target.url}: the TLS handshake failed (${ssl}) (an https:// --url to a listener without TLS? use http://)` };
  }
  if (e.code === Code.Unauthenticated) {
    return { exitCode: EXIT.unauthorized, message: `the coordinator at ${target.url} refused the key: ${e.rawMessage} (pass --key, or set LEASEHOLD_KEY)` };
  }
  if (e.code === Code.PermissionDenied && /scope/.test(e.rawMessage)) {
    return { exitCode: EXIT.unauthorized, message: `${e.rawMessage} (operator commands need a key with the admin scope)` };
  }
  const network = codes.some((c) => NETWORK.test(c)) || ((e.code === Code.Unknown || e.code === Code.Internal) && NETWORK.test(detail));
  if (e.code === Code.Unavailable || e.code === Code.DeadlineExceeded || network) {
    const hint = /Parse Error|HPE_|ECONNRESET|socket hang up/i.test(detail)
      ? ' (is --url the HTTP listener, 127.0.0.1:8080 by default, rather than the gRPC one? with TLS on, https://)'
      : ' (is `leasehold serve` running there? pass --url, or set LEASEHOLD_URL)';
    return { exitCode: EXIT.unreachable, message: `cannot reach the coordinator at ${target.url}: ${detail || 'no answer'}${hint}` };
  }
  if (e.code === Code.InvalidArgument) return { exitCode: EXIT.invalid, message: e.rawMessage };
  if (e.code === Code.Unimplemented) {
    return { exitCode: EXIT.failed, message: `the server at ${target.url} does not serve this call (${e.rawMessage}): is it a Leasehold coordinator of this version?` };
  }
  return { exitCode: EXIT.failed, message: e.rawMessage || String(err) };
}

/** The string `code`s (ECONNRESET, UNABLE_TO_VERIFY_LEAF_SIGNATURE…) along a chain of causes. */
function causeCodes(cause: unknown): string[] {
  const codes: string[] = [];
  for (let c = cause, depth = 0; c && typeof c === 'object' && depth < 8; c = (c as { cause?: unknown }).cause, depth++) {
    const code = (c as { code?: unknown }).code;
    if (typeof code === 'string') codes.push(code);
  }
  return codes;
}

function causeText(cause: unknown): string {
  if (!cause || typeof cause !== 'object') return '';
  const c = cause as { code?: unknown; message?: unknown; cause?: unknown };
  const inner = c.cause ? causeText(c.cause) : '';
  const own = typeof c.message === 'string' && c.message ? c.message : typeof c.code === 'string' ? c.code : '';
  return own && inner && !own.includes(inner) ? `${own}: ${inner}` : own || inner;
}
