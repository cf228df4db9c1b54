/**
 * LISTEN/NOTIFY between coordinators: `leasehold_jobs` carries a queue name when jobs become
 * due there (sent by the requeue and rescue statements, and after a gateway enqueue by
 * `jobsNotify`, or by the enqueue statement itself for other callers); `leasehold_control` carries
 * JSON commands for whichever coordinator holds an agent's stream (a cancel, a drain, the end of
 * a revoked agent's streams) and, for every coordinator, the credentials to forget (sent by the
 * revoking statement itself, so no revocation commits without it); `leasehold_schema` carries the
 * database's new `min_reader` when a migration raised it (schema-compat.ts).
 */
import { EventEmitter } from 'node:events';
import pg from 'pg';
import type { Logger } from '../log.js';
import { run, statement, type Queryable } from './sql.js';

export const JOBS_CHANNEL = 'leasehold_jobs';
export const CONTROL_CHANNEL = 'leasehold_control';
/** The database's `min_reader` was raised (schema-compat.ts): payload, the new value. */
export const SCHEMA_CHANNEL = 'leasehold_schema';

/** A command for the coordinator that holds an agent's stream. */
export type ControlMessage =
  | { type: 'cancel'; agentId: string; attemptIds: string[] }
  | { type: 'drain'; agentId: string }
  /** The agent was revoked: end its open streams. */
  | { type: 'disconnect'; agentId: string; reason: string }
  /** Another stream of the agent (session `sessionId`) resumed these attempts: revoke them elsewhere. */
  | { type: 'superseded'; agentId: string; attemptIds: string[]; sessionId: string }
  /** The key or agent named was revoked or replaced: forget its verified credentials. */
  | { type: 'credentials'; kind: 'key' | 'agent'; name: string };

const controlSql = statement('controlNotify', `SELECT pg_notify('${CONTROL_CHANNEL}', $1)`);

// A transaction that NOTIFYs holds a database-wide lock from its commit's start to its end, WAL
// flush included, so that notifications are queued in commit order: notifying transactions
// commit one at a time, each waiting for its own flush. This one carries nothing but the
// notifications (what they announce is already committed), so it commits asynchronously
// (`set_config(…, true)` is SET LOCAL: this statement's transaction only) and holds the lock
// for microseconds instead of a flush. If PostgreSQL crashes before flushing it, the wake-up is
// lost and the dispatchers' poll finds the jobs.
const jobsNotifySql = statement(
  'jobsNotify',
  `SELECT set_config('synchronous_commit', 'off', true) AS sync,
          (SELECT count(pg_notify('${JOBS_CHANNEL}', q)) FROM unnest($1::text[]) q) AS notified`,
);

/**
 * The SQL expression that sends `{type: 'credentials', kind, name}` on the control channel, for
 * the revoking statements of keys.ts and agents.ts to embed: `nameSql` is a column of their rows.
 */
export function credentialsNotifySql(kind: 'key' | 'agent', nameSql: string): string {
  return `pg_notify('${CONTROL_CHANNEL}', json_build_object('type', 'credentials', 'kind', '${kind}', 'name', ${nameSql})::text)`;
}

/** Sends a control message to every coordinator (delivered when the caller's transaction commits). */
export async function controlNotify(db: Queryable, msg: ControlMessage): Promise<void> {
  await run(db, controlSql, [JSON.stringify(msg)]);
}

/**
 * Tells every coordinator's dispatcher that `queues` have due jobs, in a transaction of its own
 * (sent after the transaction that made them due has committed).
 */
export async function jobsNotify(db: Queryable, queues: readonly string[]): Promise<void> {
  await run(db, jobsNotifySql, [queues]);
}

export interface ListenerEvents {
  /** A queue got due jobs. */
  jobs: [queue: string];
  control: [ControlMessage];
  /** A migration raised the database's `min_reader` to this (NaN when the payload is not a number). */
  schema: [minReader: number];
  /** (Re)connected: notifications may have been missed meanwhile, so look again. */
  connected: [];
  /** The connection failed or ended: nothing is heard until the next `connected`. */
  disconnected: [];
}

/**
 * A dedicated connection that LISTENs on the three channels and reconnects (with backoff) when it
 * drops. `connected` fires after each (re)connection, `disconnected` when it is noticed that the
 * connection is gone.
 */
export class Listener extends EventEmitter<ListenerEvents> {
  private client: pg.Client | undefined;
  private stopped = false;
  private retry: NodeJS.Timeout | undefined;
  private probe: NodeJS.Timeout | undefined;
  private attempt = 0;
  private readonly probeMs: number;

  constructor(
    private readonly url: string,
    private readonly log: Logger,
    /**
     * The connection only receives, so a network that drops it silently (a NAT's or a load
     * balancer's idle timeout, a failover that sends no reset) would never be noticed: it is
     * asked `SELECT 1` this often (default 15 s), and given up when the answer takes as long.
     */
    opts: { probeMs?: number } = {},
  ) {
    super();
    this.probeMs = opts.probeMs ?? 15_000;
  }

  /** Whether notifications are being heard now (between `connected` and `disconnected`). */
  get connected(): boolean {
    return this.client !== undefined;
  }

  /** Connects and starts listening; resolves after the first LISTEN (throws if that fails). */
  async start(): Promise<void> {
    await this.connect();
  }

  async stop(): Promise<void> {
    this.stopped = true;
    clearTimeout(this.retry);
    clearTimeout(this.probe);
    const c = this.client;
    this.client = undefined;
    await c?.end().catch(() => undefined);
  }

  private async connect(): Promise<void> {
    const client = new pg.Client({ connectionString: this.url, application_name: 'leasehold-listener', keepAlive: true, keepAliveInitialDelayMillis: 10_000 });
    client.on('notification', (n) => this.onNotification(n));
    client.on('error', (err) => {
      this.log.warn({ err }, 'listener connection failed; reconnecting');
      this.reconnectSoon(client);
    });
    client.on('end', () => this.reconnectSoon(client));
    try {
      await client.connect();
      await client.query(`LISTEN ${JOBS_CHANNEL}; LISTEN ${CONTROL_CHANNEL}; LISTEN ${SCHEMA_CHANNEL}`);
    } catch (err) {
      // Connected but not listening (a standby during a failover refuses LISTEN): closed, not
      // left open for every retry.
      await client.end().catch(() => undefined);
      throw err;
    }
    if (this.stopped) {
      await client.end();
      return;
    }
    this.client = client;
    this.attempt = 0;
    this.emit('connected');
    this.scheduleProbe(client);
  }

  /** `SELECT 1` after `probeMs`; no answer within `probeMs` more ends the connection (then it reconnects). */
  private scheduleProbe(client: pg.Client): void {
    this.probe = setTimeout(() => {
      if (this.stopped || this.client !== client) return;
      const unanswered = setTimeout(() => {
        this.log.warn({ waitedMs: this.probeMs }, 'listener connection unanswered; reconnecting');
        // The socket itself: end() would wait for a goodbye that cannot come.
        (client as unknown as { connection: { stream: { destroy(): void } } }).connection.stream.destroy();
        this.reconnectSoon(client);
      }, this.probeMs);
      client.query('SELECT 1').then(
        () => {
          clearTimeout(unanswered);
          this.scheduleProbe(client);
        },
        () => {
          // A failed connection reconnects by its own 'error' or 'end'; anything else, ask again later.
          clearTimeout(unanswered);
          if (this.client === client) this.scheduleProbe(client);
        },
      );
    }, this.probeMs);
  }

  private reconnectSoon(failed: pg.Client) {
    if (this.stopped || this.client !== failed) return;
    clearTimeout(this.probe);
    this.client = undefined;
    this.emit('disconnected');
    const delay = Math.min(100 * 2 ** this.attempt++, 5000) * (0.5 + Math.random() / 2);
    this.retry = setTimeout(() => {
      this.connect().catch((err: unknown) => {
        this.log.warn({ err }, 'listener reconnect failed');
        this.client = failed; // so reconnectSoon accepts it once more
        this.reconnectSoon(failed);
      });
    }, delay);
  }

  private onNotification(n: pg.Notification) {
    if (n.channel === JOBS_CHANNEL && n.payload) this.emit('jobs', n.payload);
    if (n.channel === SCHEMA_CHANNEL) this.emit('schema', Number(n.payload));
    if (n.channel === CONTROL_CHANNEL && n.payload) {
      try {
        this.emit('control', JSON.parse(n.payload) as ControlMessage);
      } catch (err) {
        this.log.warn({ err, payload: n.payload }, 'ignoring a malformed control notification');
      }
    }
  }
}
