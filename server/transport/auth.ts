/**
 * Who is calling, and may they. Callers send `Authorization: Bearer <key>`: an API key (made by
 * `leasehold keys add`, or the bootstrap key from `LEASEHOLD_ADMIN_KEY`) with scopes, or an
 * agent token (`leasehold agents add`, always prefixed `lh_agent_`). Each method needs one
 * scope (`METHOD_SCOPES`); `admin` implies `enqueue` and `read` but not `agent`, because a key
 * acting as an agent takes its name as the agent id. Reflection and health are open; the agent
 * stream authenticates in its `Hello` (once per stream, in the database).
 *
 * A credential verified in the database is kept in the coordinator's `CredentialCache` (when the
 * listeners are given one), keyed by its SHA-256: the next calls with it skip the database until
 * the entry's maximum age, or until a revocation's NOTIFY drops it.
 */
import { Code, ConnectError, createContextKey, type HandlerContext, type Interceptor } from '@connectrpc/connect';
import type { CredentialCache } from '../core/credential-cache.js';
import { agentAuthenticate, hashSecret, keyAuthenticate, type Queryable } from '../store/index.js';
import type { ApiKeyScope } from '../domain/statuses.js';

/** The authenticated caller of a unary call. */
export type Principal =
  | { kind: 'key'; name: string; scopes: readonly ApiKeyScope[] }
  | { kind: 'agent'; agentId: string };

export const principalKey = createContextKey<Principal | undefined>(undefined, { description: 'the authenticated caller' });

const OPEN = new Set(['grpc.reflection.v1.ServerReflection', 'grpc.reflection.v1alpha.ServerReflection', 'grpc.health.v1.Health']);

/** The scope each service (or `Service/Method`) needs; anything not listed needs `admin`. */
export const METHOD_SCOPES: Readonly<Record<string, ApiKeyScope>> = {
  'leasehold.v1.JobService/EnqueueJob': 'enqueue',
  'leasehold.v1.JobService/CancelJob': 'enqueue',
  'leasehold.v1.JobService/GetJob': 'read',
  'leasehold.v1.JobService/ListJobs': 'read',
  'leasehold.v1.AttemptService': 'agent',
  // Every AdminService method (listed, not left to the default, so the table says it).
  'leasehold.v1.AdminService': 'admin',
};

/** The scope a call needs. */
export function scopeOf(service: string, method: string): ApiKeyScope {
  return METHOD_SCOPES[`${service}/${method}`] ?? METHOD_SCOPES[service] ?? 'admin';
}

/** Whether `p` holds `scope` (`admin` covers everything but `agent`; an agent token is `agent`). */
export function hasScope(p: Principal, scope: ApiKeyScope): boolean {
  if (p.kind === 'agent') return scope === 'agent';
  return p.scopes.includes(scope) || (scope !== 'agent' && p.scopes.includes('admin'));
}

export interface AuthDeps {
  db: Queryable;
  /** Verified credentials of this process; without it every call is verified in the database. */
  credentials?: CredentialCache<Principal> | undefined;
}

/** The owner a revocation of `kind` `name` drops from a `CredentialCache<Principal>`. */
export function credentialOwner(kind: 'key' | 'agent', name: string): string {
  return `${kind}:${name}`;
}

/** The owner of a principal's cached credentials (see `credentialOwner`). */
export function principalOwner(p: Principal): string {
  return p.kind === 'agent' ? credentialOwner('agent', p.agentId) : credentialOwner('key', p.name);
}

/** What a call that needs a key is told without one (UNAUTHENTICATED, 401). */
export const MISSING_KEY = 'missing "Authorization: Bearer <key>"';

/**
 * Whether calls to `service` need a key: all but health and reflection (open) and the agent
 * stream (which authenticates in its Hello).
 */
export function needsKey(service: string): boolean {
  return !OPEN.has(service) && service !== 'leasehold.v1.AgentService';
}

/** The bearer token of a request, if any. */
export function bearer(header: Headers): string | undefined {
  return bearerToken(header.get('authorization') ?? undefined);
}

/** The bearer token of an `Authorization` header's value, if any (the listeners read it before the body). */
export function bearerToken(authorization: string | undefined): string | undefined {
  if (!authorization) return undefined;
  const m = /^Bearer\s+(\S+)\s*$/i.exec(authorization);
  return m?.[1];
}

/**
 * Authenticates a bearer token: an agent token or an API key; from `credentials` when it holds
 * the token verified, otherwise in the database.
 */
export async function authenticate(db: Queryable, token: string, credentials?: CredentialCache<Principal>, hash?: string): Promise<Principal> {
  // Over-long tokens go straight to the verbs, which refuse them without hashing.
  if (!credentials || token.length > TOKEN_MAX) return verify(db, token);
  // `hash`: the token's SHA-256 when the caller has it already (the key gate), not computed twice.
  return credentials.resolve(hash ?? hashSecret(token), () => verify(db, token));
}

/**
 * The principal of `token` if `credentials` holds it verified; otherwise `refusal()` is thrown
 * and the database is not asked (key-gate.ts, for an address past its refused keys). The cache
 * counts such a call as a miss.
 */
export async function authenticateCached(token: string, credentials: CredentialCache<Principal> | undefined, refusal: () => Error, hash?: string): Promise<Principal> {
  if (!credentials?.enabled || token.length > TOKEN_MAX) throw refusal();
  return credentials.resolve(hash ?? hashSecret(token), () => Promise.reject(refusal()));
}

/** Longest token looked up (the verbs refuse longer ones). */
const TOKEN_MAX = 512;

/** Shortest `LEASEHOLD_ADMIN_KEY` taken without a warning. */
export const ADMIN_KEY_MIN = 24;

/**
 * A one-line warning when `key`, the `LEASEHOLD_ADMIN_KEY`, is short enough to guess (under
 * `ADMIN_KEY_MIN` characters), undefined otherwise. The admin key opens everything, and anyone
 * who reaches a listener may try keys (a few a second once key-gate.ts limits them, but for as
 * long as they like). The warning never shows the key.
 */
export function adminKeyWeakness(key: string): string | undefined {
  if (key.length >= ADMIN_KEY_MIN) return undefined;
  return `LEASEHOLD_ADMIN_KEY has ${key.length} characters, few enough to guess: set a random one of at least ${ADMIN_KEY_MIN}, e.g. the output of \`openssl rand -hex 24\``;
}

async function verify(db: Queryable, token: string): Promise<Principal> {
  if (token.startsWith('lh_agent_')) {
    const agent = await agentAuthenticate(db, { token });
    if (agent.outcome === 'ok') return { kind: 'agent', agentId: agent.value.agentId };
    throw new ConnectError(agent.outcome === 'forbidden' ? agent.message : 'unknown key or token', Code.Unauthenticated);
  }
  const key = await keyAuthenticate(db, { key: token });
  if (key.outcome === 'ok') return { kind: 'key', name: key.value.name, scopes: key.value.scopes };
  throw new ConnectError(key.outcome === 'forbidden' ? key.message : 'unknown key or token', Code.Unauthenticated);
}

/**
 * Authenticates every call but the open services and the agent stream, checks the method's
 * scope (PERMISSION_DENIED naming it), and sets `principalKey`. A call whose listener has
 * already authenticated it, before reading its body, comes with `principalKey` set: its key is
 * not looked up twice.
 */
export function authInterceptor(deps: AuthDeps): Interceptor {
  return (next) => async (req) => {
    const service = req.service.typeName;
    if (!needsKey(service)) return next(req);
    let principal = req.contextValues.get(principalKey);
    if (!principal) {
      const token = bearer(req.header);
      if (!token) throw new ConnectError(MISSING_KEY, Code.Unauthenticated);
      principal = await authenticate(deps.db, token, deps.credentials);
    }
    const scope = scopeOf(service, req.method.name);
    if (!hasScope(principal, scope)) {
      const who = principal.kind === 'agent' ? `agent token of ${principal.agentId}` : `key ${principal.name}`;
      throw new ConnectError(
        `${service}/${req.method.name} needs the ${scope} scope, which the ${who} does not have` +
          (scope === 'agent' ? ' (use an agent token, or a key made with --scope agent)' : ''),
        Code.PermissionDenied,
      );
    }
    req.contextValues.set(principalKey, principal);
    return next(req);
  };
}

/** The calling agent's id: an agent token's agent, or the name of a key with the `agent` scope. */
/** Who made an admin call, for the log: the key's name or the agent's id. */
export function callerName(ctx: HandlerContext): string | undefined {
  const p = ctx.values.get(principalKey);
  return p?.kind === 'key' ? p.name : p?.agentId;
}

export function requireAgent(p: Principal | undefined): string {
  if (p?.kind === 'agent') return p.agentId;
  if (p?.kind === 'key' && p.scopes.includes('agent')) return p.name;
  throw new ConnectError('this call needs an agent token or a key with the agent scope', Code.PermissionDenied);
}
