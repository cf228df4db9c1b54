/**
 * Opens the database: `DATABASE_URL` when set, otherwise the embedded PostgreSQL. Returns a
 * connection pool and a `close()` that ends the pool and stops an embedded server we started.
 */
import pg from 'pg';
import type { Logger } from '../log.js';
import { startEmbedded, type EmbeddedDatabase } from './embedded.js';
import { sessionProblem } from './session-check.js';
import { LogSummary } from '../lib/log-summary.js';

export interface Database {
  pool: pg.Pool;
  /**
   * The pool of the transitions that run all the time (claims, starts, reports, heartbeats, the
   * reaper): its connections plan generically and never by a sequential scan of a table that
   * has an index for the job (see `HOT_SETTINGS`).
   */
  hot: pg.Pool;
  url: string;
  /** Set when the embedded server is in use. */
  embedded: EmbeddedDatabase | undefined;
  /** Ends the pool, then stops the embedded server if this process started it. Safe to call twice. */
  close(): Promise<void>;
}

export interface OpenOptions {
  databaseUrl: string | undefined;
  dataDir: string;
  log: Logger;
  /** Pool size; default `POOL_MAX`. */
  max?: number;
  /** Size of the pool of the hot transitions; default `HOT_POOL_MAX`. */
  hotMax?: number;
}

/** The main pool's size when `LEASEHOLD_DB_POOL_MAX` is not set. */
export const POOL_MAX = 20;
/**
 * The hot pool's size when `LEASEHOLD_DB_HOT_POOL_MAX` is not set. A burst of 500 enqueues 40 ms
 * from the database filled it, and the main pool too.
 */
export const HOT_POOL_MAX = 8;

/**
 * Session settings of the hot pool's connections. The hot statements are named prepared
 * statements run hundreds of times a second: planning each call afresh (a custom plan) costs
 * more than running it, so they use the generic plan. A generic plan is made from the table's
 * statistics at that moment, and a queue table's statistics can say "empty" just before a burst
 * of a hundred thousand jobs (analyzed while idle, or freshly truncated): a plan made then
 * believes reading all of `jobs` is free, and scans it (or hashes all of it for a join) on every
 * call until the next ANALYZE; measured, a 128-job claim took 40–50 ms instead of 2. Every hot
 * statement is written to find its rows by index, a few at a time, so on these connections the
 * planner may not do otherwise: no sequential scans, and joins by nested loop over an index
 * (test/store.claim-plan.test.ts holds every hot statement to that on "empty" statistics).
 * Operator reads keep the main pool and the planner's free choice.
 */
export const HOT_SETTINGS =
  'SET enable_seqscan = off; SET enable_hashjoin = off; SET enable_mergejoin = off; SET plan_cache_mode = force_generic_plan';

/**
 * How long a statement of the hot pool may take, in PostgreSQL (`statement_timeout`, which also
 * ends a wait for a lock) and, a little longer, here (`query_timeout`: an answer that never comes,
 * the connection black-holed by a failover or a partition without a reset). Its statements take
 * milliseconds; without a bound, one job's row locked by an operator's transaction, a table locked
 * by an `ALTER TABLE`, or a connection gone silent held the claims, starts, completions and the
 * reaper for as long as that lasted (a silent connection: about 15 minutes, the kernel's
 * retransmission limit; the keepalive below does not help a socket with data in flight). A
 * statement cut off fails as an error does: its caller retries (the agent's outbox, the next
 * tick, the next reaper run), and the pool drops the client whose answer never came.
 */
export const HOT_STATEMENT_TIMEOUT_MS = 15_000;
/** How long opening a connection may take (both pools): a server that does not answer fails the caller. */
export const CONNECT_TIMEOUT_MS = 10_000;

// int8 (bigint ids, counts) as numbers: every value we keep in one fits in 2^53.
pg.types.setTypeParser(pg.types.builtins.INT8, (v) => Number(v));

// Every Date parameter is written in UTC (`…T…+00:00`). node-postgres writes it in the process's
// local time by default, with the offset `getTimezoneOffset()` gives, in whole minutes: for a
// time before its zone's standard time (local mean time, e.g. +00:17:30 in Europe/Amsterdam in
// 1800) that offset is not the zone's, and a job's runAt of 1800-01-01T00:00:00Z was stored 30 s
// later. Every time column is a timestamptz, so UTC changes nothing else. Set once, for the
// process (Leasehold is no library sharing it); the store's index loads this module.
pg.defaults.parseInputDatesAsUTC = true;

/** Opens a pool on `DATABASE_URL` or on a freshly started embedded PostgreSQL. */
export async function openDatabase(opts: OpenOptions): Promise<Database> {
  const log = opts.log.child({ component: 'database' });
  const embedded = opts.databaseUrl ? undefined : await startEmbedded({ dataDir: opts.dataDir, log: opts.log });
  const url = opts.databaseUrl ?? embedded!.url;
  const budget = { max: opts.max ?? POOL_MAX, hotMax: opts.hotMax ?? HOT_POOL_MAX };
  const pool = createPool(url, budget.max, log);
  const hot = createPool(url, budget.hotMax, log, { hot: true });
  try {
    await pool.query('SELECT 1');
    await hot.query('SELECT 1');
  } catch (err) {
    await pool.end().catch(() => undefined);
    await hot.end().catch(() => undefined);
    await embedded?.stop();
    const setting = databaseSettingProblem(url, err as Error & { code?: string; path?: string });
    const why = setting ? `${setting} (${(err as Error).message})` : (noFreeConnection(url, err as Error, budget) ?? (err as Error).message);
    throw new (setting ? DatabaseSettingError : Error)(`cannot connect to PostgreSQL at ${redact(url)}: ${why}`, { cause: err });
  }
  // Read before the session check opens its two connections, so that only the pools' are ours.
  const room = await connectionRoomGet(pool, pool.totalCount + hot.totalCount).catch((err: Error) => {
    log.debug({ err: { message: err.message } }, 'could not read the connection limits');
    return undefined;
  });
  // A server given by URL may be a pooler that shares sessions between connections, which
  // Leasehold cannot run on (session-check.ts); the embedded one is PostgreSQL itself.
  const problem = embedded ? undefined : await sessionProblem(url, { connectTimeoutMs: CONNECT_TIMEOUT_MS }).catch(async (err: unknown) => {
    await Promise.all([pool.end().catch(() => undefined), hot.end().catch(() => undefined)]);
    throw new Error(`cannot connect to PostgreSQL at ${redact(url)}: ${noFreeConnection(url, err as Error, budget) ?? (err as Error).message}`, { cause: err });
  });
  if (problem) {
    await Promise.all([pool.end().catch(() => undefined), hot.end().catch(() => undefined)]);
    throw new DatabaseSettingError(`cannot use PostgreSQL at ${redact(url)}: ${problem}`);
  }
  log.info({ url: redact(url), embedded: Boolean(embedded) }, 'database connected');
  if (room) budgetCheck(room, budget, log);
  let closed: Promise<void> | undefined;
  return {
    pool,
    hot,
    url,
    embedded,
    close: () =>
      (closed ??= (async () => {
        await hot.end();
        await pool.end();
        await embedded?.stop();
      })()),
  };
}

/**
 * A first connection refused because of what `DATABASE_URL` asks for: its TLS settings do not fit
 * the server (a CA that did not sign its certificate, a host name the certificate does not list,
 * no sslmode where the server requires TLS, an unreadable sslrootcert), or it points at a pooler
 * that shares server sessions between connections (session-check.ts). Restarting will not help
 * and changing the URL will (also when the provider changed its CA: the fix is a new
 * sslrootcert), so `leasehold serve` and `migrate` report it as they do a `ConfigError`: one line
 * naming the setting, exit code 2. Unreachable servers, refused passwords and everything else stay
 * plain errors with exit code 1, as before: they may pass by themselves (a server starting, a
 * password being rotated), and their own messages already say what happened.
 */
export class DatabaseSettingError extends Error {
  override readonly name = 'DatabaseSettingError';
}

// Node's codes for a certificate chain that the trusted CAs do not vouch for.
const UNTRUSTED_CERT = new Set([
  'UNABLE_TO_VERIFY_LEAF_SIGNATURE',
  'SELF_SIGNED_CERT_IN_CHAIN',
  'DEPTH_ZERO_SELF_SIGNED_CERT',
  'UNABLE_TO_GET_ISSUER_CERT',
  'UNABLE_TO_GET_ISSUER_CERT_LOCALLY',
  'CERT_SIGNATURE_FAILURE',
]);

/**
 * What in `url` a failed first connection points at, in words an operator can act on; undefined
 * when the failure is not about its TLS settings. node-postgres's own messages ("unable to verify
 * the first certificate") name neither the setting nor the fix.
 */
function databaseSettingProblem(url: string, err: Error & { code?: string; path?: string }): string | undefined {
  let params: URLSearchParams;
  try {
    params = new URL(url).searchParams;
  } catch {
    return undefined;
  }
  const rootcert = params.get('sslrootcert');
  const mode = params.get('sslmode');
  const libpq = params.get('uselibpqcompat') === 'true';
  if (err.code && UNTRUSTED_CERT.has(err.code)) {
    if (rootcert) return `its TLS certificate is not signed by the CA in sslrootcert (${rootcert}); check sslrootcert / sslmode in DATABASE_URL`;
    // node-postgres (8.x) verifies the certificate for sslmode=require, prefer and verify-ca too.
    const modeHint = mode && mode !== 'verify-full' && !libpq ? ` (node-postgres verifies it for sslmode=${mode} too; uselibpqcompat=true&sslmode=require encrypts without verifying)` : '';
    return `its TLS certificate is not signed by a CA that Node.js trusts; give your provider's CA file with sslrootcert=<file> in DATABASE_URL${modeHint}`;
  }
  if (err.code === 'ERR_TLS_CERT_ALTNAME_INVALID') return 'its TLS certificate is not for the host name in DATABASE_URL; connect by a name the certificate lists, or check sslmode';
  if (err.code === 'ENOENT' || err.code === 'EACCES') {
    for (const name of ['sslrootcert', 'sslcert', 'sslkey'])
      if (err.path && params.get(name) === err.path) return `the ${name} file of DATABASE_URL cannot be read`;
  }
  // PostgreSQL 14+ says "no encryption", earlier versions "SSL off".
  if (/no pg_hba\.conf entry .*(no encryption|SSL off)/.test(err.message))
    return "the server accepts only encrypted connections and DATABASE_URL asks for none; add sslmode=verify-full&sslrootcert=<your provider's CA file> to it";
  if (err.message === 'The server does not support SSL connections') return "DATABASE_URL asks for TLS (sslmode) and the server has none; check the host, or the server's ssl setting";
  return undefined;
}

/** The pools' sizes: a coordinator opens up to `max + hotMax + 1` connections (the listener's is the one). */
interface Budget {
  max: number;
  hotMax: number;
}

const SIZE_SETTINGS = 'LEASEHOLD_DB_POOL_MAX and LEASEHOLD_DB_HOT_POOL_MAX';

const budgetWords = (b: Budget) => `${b.max + b.hotMax + 1} (LEASEHOLD_DB_POOL_MAX=${b.max} + LEASEHOLD_DB_HOT_POOL_MAX=${b.hotMax} + 1 to listen)`;

/**
 * A first connection refused with SQLSTATE 53300: no slot left under `max_connections` (less the
 * slots it reserves), or under the role's or the database's CONNECTION LIMIT. The
 * driver's words name neither Leasehold's share nor what sizes it. A plain error, exit code 1: it
 * passes when other clients let go of theirs.
 */
function noFreeConnection(url: string, err: Error & { code?: string }, budget: Budget): string | undefined {
  if (err.code !== '53300') return undefined;
  let role = '';
  try {
    role = decodeURIComponent(new URL(url).username);
  } catch {
    // An unparseable URL fails before it connects; the words below do without the name.
  }
  // Also "remaining connection slots are reserved for roles with …": max_connections.
  const limit = /^too many connections for role/.test(err.message)
    ? "the role's CONNECTION LIMIT"
    : /^too many connections for database/.test(err.message)
      ? "the database's CONNECTION LIMIT"
      : 'max_connections';
  return (
    `PostgreSQL has no free connection for ${role ? `role "${role}"` : 'its role'} (${err.message}). ` +
    `Leasehold needs up to ${budgetWords(budget)} connections per coordinator, and 2 more while one starts: ` +
    `close other clients' connections, raise ${limit}, or lower ${SIZE_SETTINGS} (docs/deploy.md, "A managed PostgreSQL")`
  );
}

/** What PostgreSQL lets this role open, and what is open now, as `connectionRoomGet` read it. */
interface ConnectionRoom {
  role: string;
  database: string;
  maxConnections: number;
  /** Slots this role may not take: `superuser_reserved_connections`, and `reserved_connections` (PostgreSQL 16+). */
  reserved: number;
  /** `rolconnlimit` and `datconnlimit` (-1: none), as they bind this role (not a superuser). */
  roleLimit: number;
  databaseLimit: number;
  /** Client connections open now, not counting this coordinator's: all of them, the role's, the database's. */
  open: number;
  roleOpen: number;
  databaseOpen: number;
}

/**
 * The connection limits that bind this session's role and what is open under each, in one
 * statement; `ours`: connections of this process among them. Another role's `backend_type` reads
 * as null unless this role may see all statistics (pg_read_all_stats), so a backend in a database
 * counts as a client's: an autovacuum or parallel worker running at that moment counts too.
 */
async function connectionRoomGet(pool: pg.Pool, ours: number): Promise<ConnectionRoom> {
  const { rows } = await pool.query<ConnectionRoom>(
    `SELECT session_user AS role, current_database() AS database,
            current_setting('max_connections')::int AS "maxConnections",
            CASE WHEN r.rolsuper THEN 0
                 ELSE current_setting('superuser_reserved_connections')::int
                      + CASE WHEN coalesce(pg_has_role(session_user, to_regrole('pg_use_reserved_connections'), 'USAGE'), false) THEN 0
                             ELSE coalesce(current_setting('reserved_connections', true)::int, 0) END
            END AS reserved,
            CASE WHEN r.rolsuper THEN -1 ELSE r.rolconnlimit END AS "roleLimit",
            CASE WHEN r.rolsuper THEN -1 ELSE d.datconnlimit END AS "databaseLimit",
            a.open - $1 AS open, a.role_open - $1 AS "roleOpen", a.database_open - $1 AS "databaseOpen"
       FROM pg_roles r, pg_database d,
            (SELECT count(*) AS open,
                    count(*) FILTER (WHERE usename = session_user) AS role_open,
                    count(*) FILTER (WHERE datname = current_database()) AS database_open
               FROM pg_stat_activity
              WHERE datid IS NOT NULL AND coalesce(backend_type, 'client backend') = 'client backend') a
      WHERE r.rolname = session_user AND d.datname = current_database()`,
    [ours],
  );
  return rows[0]!;
}

/**
 * Warns when the pools may grow past what PostgreSQL leaves this role: under a burst their calls
 * would then fail with SQLSTATE 53300 (too many connections), and the connections they did open stay
 * for `IDLE_CONNECTION_MS`, keeping other clients out. It only warns: other clients may let go,
 * and a coordinator that never meets a burst never fills its pools. Other coordinators count as
 * the connections they hold now, which may be fewer than their pools may hold.
 */
function budgetCheck(r: ConnectionRoom, budget: Budget, log: Logger): void {
  const limits = [
    { left: r.maxConnections - r.reserved - r.open, why: `max_connections ${r.maxConnections}, ${r.reserved} of them reserved, ${r.open} open by others`, raise: 'max_connections' },
  ];
  if (r.roleLimit >= 0) {
    limits.push({ left: r.roleLimit - r.roleOpen, why: `role "${r.role}" CONNECTION LIMIT ${r.roleLimit}, ${r.roleOpen} open by others`, raise: "the role's CONNECTION LIMIT" });
  }
  if (r.databaseLimit >= 0) {
    limits.push({ left: r.databaseLimit - r.databaseOpen, why: `database "${r.database}" CONNECTION LIMIT ${r.databaseLimit}, ${r.databaseOpen} open by others`, raise: "the database's CONNECTION LIMIT" });
  }
  const tight = limits.reduce((a, b) => (b.left < a.left ? b : a));
  const left = Math.max(0, tight.left);
  const needs = budget.max + budget.hotMax + 1;
  if (needs <= left) return;
  log.warn(
    { ...r, left, needs, poolMax: budget.max, hotPoolMax: budget.hotMax },
    `this coordinator may open up to ${budgetWords(budget)} connections and PostgreSQL has room for ${left} (${tight.why}): ` +
      `under load its calls will fail with SQLSTATE 53300 (too many connections). Lower ${SIZE_SETTINGS}, or raise ${tight.raise} (docs/deploy.md, "A managed PostgreSQL")`,
  );
}

/**
 * How long a pool keeps a connection nobody uses (pg's default is 10 s). Opening one costs a
 * backend process, a SCRAM exchange and every statement planned afresh; with the 10 s default a
 * pool shrank between bursts and grew again in the next one, opening a dozen connections at once
 * on a busy machine: enqueues waited half a second for them (docs/performance-history.md, "Connections
 * that came and went").
 */
export const IDLE_CONNECTION_MS = 600_000;

/**
 * A pool whose idle-client errors (a server restart, a killed backend) are logged, not thrown.
 * `hot`: its connections take `HOT_SETTINGS` before their first query.
 */
export function createPool(url: string, max: number, log?: Logger, opts: { hot?: boolean; statementTimeoutMs?: number; connectTimeoutMs?: number } = {}): pg.Pool {
  const statementTimeoutMs = opts.statementTimeoutMs ?? HOT_STATEMENT_TIMEOUT_MS;
  const pool = new ClosingPool(
    {
      connectionString: url,
      max,
      idleTimeoutMillis: IDLE_CONNECTION_MS,
      connectionTimeoutMillis: opts.connectTimeoutMs ?? CONNECT_TIMEOUT_MS,
      // The server's own limit first (it ends the statement and keeps the connection); this one only
      // for an answer that never comes.
      ...(opts.hot ? { query_timeout: statementTimeoutMs + 5_000 } : {}),
      application_name: opts.hot ? 'leasehold-hot' : 'leasehold',
      // TCP keepalive from 10 s of silence: a connection to a server gone without a reset (a
      // failover, a partition) fails in minutes rather than the kernel's two hours.
      keepAlive: true,
      keepAliveInitialDelayMillis: 10_000,
      ...(opts.hot ? { Client: hotClient(`${HOT_SETTINGS}; SET statement_timeout = ${statementTimeoutMs}`) } : {}),
    },
    log && new LogSummary(log, 'warn', `PostgreSQL has no room for another connection of the ${opts.hot ? 'hot ' : ''}pool: its calls wait for the connections it has`),
  );
  // pg attaches the client to the error; logging it would dump the connection and its statements.
  pool.on('error', (err: Error & { code?: string }) => log?.warn({ err: { message: err.message, code: err.code } }, 'idle database connection failed'));
  // A connection that dies while its client is checked out (PostgreSQL restarting, a failover, a
  // killed backend) emits 'error' on the client, and pg-pool listens only while it is idle: with
  // no listener Node would throw it and end the process. The statement running fails with it (its
  // caller says so); the pool drops the client when it comes back.
  pool.on('connect', (client) =>
    client.on('error', (err: Error & { code?: string }) => log?.debug({ err: { message: err.message, code: err.code } }, 'database connection failed while in use')),
  );
  return pool;
}

/** How long a pool that met PostgreSQL's connection limit keeps to the connections it has before it opens more again. */
export const ROOM_RETRY_MS = 30_000;

/** pg-pool's error for a checkout that waited `connectionTimeoutMillis` in vain. */
const POOL_TIMEOUT = 'timeout exceeded when trying to connect';

/**
 * A pool whose `end()` resolves when its connections are closed. pg-pool's resolves once it has
 * asked them to close: a database stopped right after it (the embedded one at shutdown) ended
 * them first, and every one logged "idle database connection failed" (57P01).
 *
 * And a pool that keeps to the room PostgreSQL has: a new connection refused with SQLSTATE 53300
 * (`max_connections` or a `CONNECTION LIMIT` reached) while the pool holds others makes the call
 * wait for one of those (as a full pool's calls do, up to about its `connectionTimeoutMillis`
 * from the first try; then it fails with the refusal) instead of failing at once, and the pool
 * opens no more for `ROOM_RETRY_MS`. A burst of n8n enqueues on a small
 * managed database got 503s by the dozen (whose HTTP Request node, retry off by default, fails
 * the workflow on one); a pool with no connection open or being opened still fails the call, as
 * nothing would free one.
 */
class ClosingPool extends pg.Pool {
  private readonly open = new Set<pg.PoolClient>();
  private readonly configuredMax: number;
  private roomTimer: NodeJS.Timeout | undefined;

  constructor(
    config: pg.PoolConfig,
    private readonly noRoom?: LogSummary,
  ) {
    super(config);
    this.configuredMax = this.options.max;
    this.on('connect', (c) => this.open.add(c));
    this.on('remove', (c) => this.open.delete(c));
  }

  override connect(): Promise<pg.PoolClient>;
  override connect(callback: (err: Error | undefined, client: pg.PoolClient | undefined, done: (release?: boolean | Error) => void) => void): void;
  override connect(
    callback?: (err: Error | undefined, client: pg.PoolClient | undefined, done: (release?: boolean | Error) => void) => void,
  ): Promise<pg.PoolClient> | void {
    const started = performance.now();
    if (!callback) return this.connectWithinRoom(started);
    // pool.query checks out this way: straight through unless the connection was refused for room.
    super.connect((err, client, done) => {
      if (!this.noRoomFor(err, 0, started)) return callback(err, client, done);
      this.keepToRoom(err!);
      this.connectWithinRoom(started, err).then(
        (c) => callback(undefined, c, c.release),
        (e: Error) => callback(e, undefined, () => undefined),
      );
    });
  }

  /**
   * Whether `err` refused a new connection for want of room while the pool holds or opens others,
   * after `refused` refusals, within the checkout's `connectionTimeoutMillis` from `started`.
   */
  private noRoomFor(err: Error | undefined, refused: number, started: number): boolean {
    return (
      (err as { code?: string } | undefined)?.code === '53300' &&
      this.totalCount > 0 &&
      refused < 10 &&
      !this.ending &&
      performance.now() - started < (this.options.connectionTimeoutMillis || CONNECT_TIMEOUT_MS)
    );
  }

  private async connectWithinRoom(started: number, refusal?: Error): Promise<pg.PoolClient> {
    // Each refusal lowers the bound to the connections the pool has (at least 1), so the next
    // try waits for one of those; one being opened may be refused too, lowering it again. With
    // none open or being opened, nothing would free one: the call fails.
    for (let refused = refusal ? 1 : 0; ; refused++) {
      try {
        return await super.connect();
      } catch (err) {
        if (this.noRoomFor(err as Error, refused, started)) {
          refusal ??= err as Error;
          this.keepToRoom(err as Error);
          continue;
        }
        // A wait after a refusal that ran out of time: the refusal says why (no free connection),
        // where pg-pool's timeout would read as the database unavailable (store-errors.ts).
        throw refusal && (err as Error).message === POOL_TIMEOUT ? refusal : err;
      }
    }
  }

  private keepToRoom(err: Error): void {
    // The connections open (`open` keeps one being closed a moment longer; pg-pool's count, one being opened).
    const held = Math.min(this.open.size, this.totalCount);
    this.options.max = Math.max(1, held);
    this.noRoom?.note({ held, max: this.configuredMax, retryInMs: ROOM_RETRY_MS, err: { message: err.message, code: '53300' } });
    clearTimeout(this.roomTimer);
    this.roomTimer = setTimeout(() => {
      this.options.max = this.configuredMax;
      // Calls still waiting may now open connections: pg-pool looks at its queue only when a
      // connection comes back or goes.
      if (!this.ending) (this as unknown as { _pulseQueue(): void })._pulseQueue();
    }, ROOM_RETRY_MS);
    this.roomTimer.unref();
  }

  override async end(): Promise<void> {
    clearTimeout(this.roomTimer);
    this.noRoom?.flush();
    await super.end();
    if (!this.open.size) return;
    // Each closes within a round trip; the bound only keeps a dead server from holding a shutdown.
    await new Promise<void>((resolve) => {
      const finish = () => {
        clearTimeout(bound);
        this.off('remove', closed);
        resolve();
      };
      const closed = () => {
        if (!this.open.size) finish();
      };
      const bound = setTimeout(finish, 5000);
      this.on('remove', closed);
    });
  }
}

/** A client that takes `HOT_SETTINGS` as part of connecting, so a pool hands it out ready. */
// (A SET after connecting, not a startup `options` parameter: poolers such as PgBouncer refuse those.)
const hotClient = (settings: string) =>
  class HotClient extends pg.Client {
    override connect(): Promise<pg.Client>;
    override connect(callback: ((err: Error) => void) | ((err: null, c: pg.Client) => void)): void;
    override connect(callback?: ((err: Error) => void) | ((err: null, c: pg.Client) => void)): Promise<pg.Client> | void {
      const ready = super.connect().then(() => super.query(settings)).then(() => this as pg.Client);
      if (!callback) return ready;
      const cb = callback as (err: Error | null, c?: pg.Client) => void;
      ready.then((c) => cb(null, c), (err: Error) => cb(err));
    }
  };

/**
 * Query parameters of a connection URL that hold a secret, or say where one is (pg reads
 * `password` there as it reads the URL's own, `sslpassword` unlocks the client key that `sslkey`
 * names). Compared without case: a name spelt otherwise is still not logged.
 */
const SECRET_PARAMS = new Set(['password', 'sslpassword', 'sslkey']);

/**
 * The URL with its secrets hidden, for logs and errors: the password in it and the values of the
 * `password`, `sslpassword` and `sslkey` query parameters become `***`.
 */
export function redact(url: string): string {
  try {
    const u = new URL(url);
    if (u.password) u.password = '***';
    // Set only when one is there: rewriting the query re-encodes all of it.
    if ([...u.searchParams.keys()].some((k) => SECRET_PARAMS.has(k.toLowerCase()))) {
      const params = new URLSearchParams();
      for (const [k, v] of u.searchParams) params.append(k, SECRET_PARAMS.has(k.toLowerCase()) ? '***' : v);
      u.search = params.toString();
    }
    return u.toString();
  } catch {
    return '(unparseable DATABASE_URL)';
  }
}
