/**
 * Whether each connection to `DATABASE_URL` is a server session of its own, as Leasehold needs:
 * its listener hears NOTIFY only on the session that ran LISTEN (revoked credentials forgotten
 * on every replica, cancels and drains sent to the replica holding the stream, the schema
 * level), its statements are prepared once per session, and the hot pool's settings are SET
 * once per session. A connection pooler in transaction or statement mode (PgBouncer's
 * `pool_mode = transaction`, the pooled connection strings of hosted PostgreSQL) hands each
 * transaction whichever server session is free: the LISTEN is left on a session nobody reads,
 * and statements meet another client's prepared names. Measured through Debian's PgBouncer 1.18
 * in transaction mode: the first start on fresh server sessions served, with none of the
 * notifications arriving; the next start stopped on `prepared statement "schemaCompatGet"
 * already exists` (test/pooler.test.ts).
 *
 * The check does what the listener does, once: one connection LISTENs, another NOTIFYs, and the
 * first must hear it. Without a pooler the notification arrives within milliseconds of the
 * NOTIFY's commit; through one in transaction mode it never does. Only simple and unnamed
 * statements are used, so the check itself works through any pooler.
 */
import { randomBytes } from 'node:crypto';
import pg from 'pg';

const CHANNEL = 'leasehold_session_check';

/** How long the listening connection waits for the notification (a direct server takes milliseconds). */
export const SESSION_CHECK_WAIT_MS = 5_000;

/**
 * What keeps `url` from serving Leasehold, in words an operator can act on; undefined when the
 * notification arrived. Connection errors are thrown as they come (the caller has just connected
 * once, so they are rare here and their own messages say what happened).
 */
export async function sessionProblem(url: string, opts: { waitMs?: number; connectTimeoutMs?: number } = {}): Promise<string | undefined> {
  const waitMs = opts.waitMs ?? SESSION_CHECK_WAIT_MS;
  const options = { connectionString: url, application_name: 'leasehold-session-check', connectionTimeoutMillis: opts.connectTimeoutMs };
  const listener = new pg.Client(options);
  const sender = new pg.Client(options);
  // A failure after the check (the other side closing first) must not become an unhandled 'error'.
  listener.on('error', () => undefined);
  sender.on('error', () => undefined);
  const token = randomBytes(12).toString('hex');
  let heard!: () => void;
  const arrived = new Promise<void>((resolve) => (heard = resolve));
  listener.on('notification', (n) => {
    if (n.channel === CHANNEL && n.payload === token) heard();
  });
  let timer: NodeJS.Timeout | undefined;
  try {
    // Both connections opened at once: a start far from its database pays each one's round trips.
    await Promise.all([listener.connect().then(() => listener.query(`LISTEN ${CHANNEL}`)), sender.connect()]);
    await sender.query(`SELECT pg_notify('${CHANNEL}', $1)`, [token]);
    const timedOut = new Promise<'timeout'>((resolve) => (timer = setTimeout(() => resolve('timeout'), waitMs)));
    if ((await Promise.race([arrived, timedOut])) !== 'timeout') return undefined;
    return (
      `a notification sent on one connection did not reach another that listens for it within ${waitMs} ms, so ` +
      'connections to this address do not each keep a server session of their own: a connection pooler in transaction or statement mode ' +
      "(PgBouncer's pool_mode = transaction, a hosted database's pooled or transaction-mode connection string). " +
      'Leasehold keeps state in its sessions (LISTEN, prepared statements, settings): point DATABASE_URL at the database itself, ' +
      'or at a pooler in session mode (docs/deploy.md, "A pooler in front")'
    );
  } finally {
    clearTimeout(timer);
    await Promise.all([listener.end().catch(() => undefined), sender.end().catch(() => undefined)]);
  }
}
