/**
 * Who is calling. Gateway callers and operators send `Authorization: Bearer <key>`: the
 * bootstrap admin key (`LEASEHOLD_ADMIN_KEY`, compared in constant time), or an agent's token
 * for the stream-less agent calls. Reflection and health are open; the agent stream
 * authenticates in its `Hello`.
 */
import { Code, ConnectError, createContextKey, type Interceptor } from '@connectrpc/connect';
import { agentAuthenticate, secretsEqual, type Queryable } from '../store/index.js';

/** The authenticated caller of a unary call. */
export type Principal = { kind: 'admin' } | { kind: 'agent'; agentId: string };

export const principalKey = createContextKey<Principal | undefined>(undefined, { description: 'the authenticated caller' });

const OPEN = new Set(['grpc.reflection.v1.ServerReflection', 'grpc.reflection.v1alpha.ServerReflection', 'grpc.health.v1.Health']);

export interface AuthDeps {
  db: Queryable;
  adminKey: string | undefined;
}

/** The bearer token of a request, if any. */
export function bearer(header: Headers): string | undefined {
  const m = /^Bearer\s+(\S+)\s*$/i.exec(header.get('authorization') ?? '');
  return m?.[1];
}

/** Authenticates every call but the open services and the agent stream; sets `principalKey`. */
export function authInterceptor(deps: AuthDeps): Interceptor {
  return (next) => async (req) => {
    const service = req.service.typeName;
    if (OPEN.has(service) || service === 'leasehold.v1.AgentService') return next(req);
    const token = bearer(req.header);
    if (!token) throw new ConnectError('missing "Authorization: Bearer <key>"', Code.Unauthenticated);
    if (deps.adminKey && secretsEqual(token, deps.adminKey)) {
      req.contextValues.set(principalKey, { kind: 'admin' });
      return next(req);
    }
    const agent = await agentAuthenticate(deps.db, { token });
    if (agent.outcome === 'ok') {
      req.contextValues.set(principalKey, { kind: 'agent', agentId: agent.value.agentId });
      return next(req);
    }
    throw new ConnectError(agent.outcome === 'forbidden' ? agent.message : 'unknown key or token', Code.Unauthenticated);
  };
}

/** The caller, which must be the admin. */
export function requireAdmin(p: Principal | undefined): void {
  if (p?.kind !== 'admin') throw new ConnectError('this call needs the admin key', Code.PermissionDenied);
}

/** The calling agent's id; the admin key is not an agent. */
export function requireAgent(p: Principal | undefined): string {
  if (p?.kind !== 'agent') throw new ConnectError('this call needs an agent token (leasehold agents add NAME)', Code.PermissionDenied);
  return p.agentId;
}
