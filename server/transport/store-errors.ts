/**
 * What a caller hears when a call fails for a reason of the coordinator's own (a thrown error,
 * not an outcome): every such failure is logged once, with its method and cause, and one that
 * comes from the database being unavailable (unreachable, restarting, read-only after a failover,
 * out of connections or disk, a statement cut off by its timeout) answers UNAVAILABLE (HTTP 503)
 * with `retry-after`, which callers retry, instead of INTERNAL's "internal error" (500), which says
 * nothing. Before, the gateway answered those with 500 and logged nothing at all.
 */
import { Code, ConnectError, type Interceptor } from '@connectrpc/connect';
import type { Logger } from '../log.js';

// SQLSTATE classes and codes of a database that cannot take the call now: connection exceptions
// (08), insufficient resources (53: too many connections, disk full), operator intervention (57:
// shutdown, crash, statement timeout, query canceled), read-only transaction (25006).
const UNAVAILABLE_STATE = /^(08|53|57)|^25006$/;
// pg's and the socket's own words for a connection that failed or an answer that never came.
const UNAVAILABLE_TEXT = /Query read timeout|timeout exceeded when trying to connect|Connection terminated|connect ECONNREFUSED|ECONNRESET|EPIPE|ETIMEDOUT|the database is read-only/;

/** Whether `err` (or an error in its `cause` chain) says the database is unavailable. */
export function databaseUnavailable(err: unknown): boolean {
  for (let e = err as { code?: unknown; message?: unknown; cause?: unknown } | undefined, n = 0; e && n < 5; e = e.cause as typeof e, n++) {
    if (typeof e.code === 'string' && UNAVAILABLE_STATE.test(e.code)) return true;
    if (typeof e.message === 'string' && UNAVAILABLE_TEXT.test(e.message)) return true;
  }
  return false;
}

/** The interceptor: thrown errors logged and, when the database is unavailable, answered UNAVAILABLE. */
export function storeErrors(log: Logger): Interceptor {
  return (next) => async (req) => {
    try {
      return await next(req);
    } catch (err) {
      if (err instanceof ConnectError) throw err;
      const method = `${req.service.typeName}/${req.method.name}`;
      if (databaseUnavailable(err)) {
        log.warn({ err, method }, 'call failed: the database is unavailable');
        throw new ConnectError('the database is unavailable: retry later', Code.Unavailable, { 'retry-after': '1' }, undefined, err);
      }
      log.error({ err, method }, 'call failed');
      throw new ConnectError('internal error', Code.Internal, undefined, undefined, err);
    }
  };
}
