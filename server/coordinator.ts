/**
 * The coordinator process: opens the database (embedded or `DATABASE_URL`), applies migrations,
 * stores the bootstrap admin key, starts the maintenance services (reaper, webhook deliverer,
 * purger, vacuumer, session registry), the agent hub and dispatcher, the credential cache, the metrics,
 * and the gRPC and HTTP listeners; stops them in the reverse order. While it runs, the schema
 * watch looks at the database's `min_reader` (store/schema-compat.ts): when a newer release has
 * migrated it past what this release can run beside, the coordinator says so, answers
 * NOT_SERVING (`/healthz` 503, gRPC health), stops taking and handing out work, and stops as on
 * SIGTERM (agents get GoAway); `halted` tells the process (cli.ts exits with code 2).
 */
import { isLoopback, type Config } from './config.js';
import { Activity } from './core/activity.js';
import { AgentHub } from './core/agent-hub.js';
import { CredentialCache } from './core/credential-cache.js';
import { Dispatcher } from './core/dispatcher.js';
import { CountKeeper } from './core/count-keeper.js';
import { Purger } from './core/purger.js';
import { Vacuumer } from './core/vacuumer.js';
import { QueueWaker } from './core/queue-waker.js';
import { Reaper } from './core/reaper.js';
import { SchemaWatch } from './core/schema-watch.js';
import { SessionRegistry } from './core/session-registry.js';
import { WebhookDeliverer } from './core/webhook-deliverer.js';
import { RESCUE_REASONS } from './domain/statuses.js';
import type { Logger } from './log.js';
import {
  compatInfo,
  keyBootstrap,
  Listener,
  migrateDatabase,
  migrationsFolder,
  openDatabase,
  schemaTooNewMessage,
  signingSecretGet,
  type Database,
} from './store/index.js';
import { adminKeyWeakness, credentialOwner, principalOwner, type Principal } from './transport/auth.js';
import { listenHttp, type HttpServer } from './transport/http.js';
import { createMetrics, type Metrics } from './transport/metrics.js';
import { listenGrpc, type GrpcServer, type ServerDeps } from './transport/server.js';

export interface Coordinator {
  db: Database;
  reaper: Reaper;
  hub: AgentHub;
  dispatcher: Dispatcher;
  /** Wakes the dispatchers of every coordinator after a gateway enqueue commits. */
  waker: QueueWaker;
  deliverer: WebhookDeliverer;
  /** Purges finished jobs past the retention; undefined when `LEASEHOLD_RETENTION=off`. */
  purger: Purger | undefined;
  /** VACUUMs `jobs_live` when a drain has left many dead rows; undefined when `LEASEHOLD_VACUUM_DEAD_ROWS=off`. */
  vacuumer: Vacuumer | undefined;
  counts: CountKeeper;
  /** Keeps `agent_sessions` in step with this process's streams; its `coordinatorId` names this process. */
  registry: SessionRegistry;
  /** What the unary routes did (metrics count it). */
  activity: Activity;
  /** API keys and agent tokens verified recently, served while the listener hears revocations. */
  credentials: CredentialCache<Principal>;
  /** Looks at the database's `min_reader` while the coordinator runs. */
  schema: SchemaWatch;
  metrics: Metrics;
  grpc: GrpcServer;
  http: HttpServer;
  /**
   * Resolves when the coordinator stops by itself, with why: the database was migrated past what
   * this release can run beside. By then it answers NOT_SERVING and its `stop()` has begun
   * (await it); the process should end with exit code 2. Never rejects; pending while it runs.
   */
  halted: Promise<Error>;
  /** Stops the listener, services, pool and embedded database, in that order. Safe to call twice. */
  stop(): Promise<void>;
}

/** What a coordinator is started with besides its configuration. */
export interface StartOptions {
  /** The migrations this release ships (default `migrationsFolder`): its reader level is their number. Tests give a newer release's. */
  migrationsFolder?: string;
  /** Time between the schema watch's looks besides notifications (default 30 s). */
  schemaCheckIntervalMs?: number;
}

/** Starts a coordinator with `config`; throws (after cleaning up) if any part fails to start. */
export async function startCoordinator(config: Config, log: Logger, opts: StartOptions = {}): Promise<Coordinator> {
  const { readerLevel } = compatInfo(opts.migrationsFolder ?? migrationsFolder);
  const db = await openDatabase({ databaseUrl: config.databaseUrl, dataDir: config.dataDir, log, max: config.dbPoolMax, hotMax: config.dbHotPoolMax });
  const cleanups: Array<() => Promise<void>> = [() => db.close()];
  const cleanup = async () => {
    for (const c of cleanups.reverse()) await c().catch((err: unknown) => log.warn({ err }, 'stop step failed'));
  };
  try {
    const applied = await migrateDatabase(db.pool, {
      log: log.child({ component: 'migrate' }),
      allowNewerSchema: config.allowNewerSchema,
      migrationsFolder: opts.migrationsFolder,
    });
    log.info({ applied }, applied ? 'migrations applied' : 'schema up to date');
    if (config.adminKey) {
      // Anyone who can reach a listener may guess keys (30, then 5 a second, per address).
      const weak = adminKeyWeakness(config.adminKey);
      if (weak) log.warn(weak);
      const b = await keyBootstrap(db.pool, { key: config.adminKey });
      if (b.outcome !== 'ok') throw new Error(`LEASEHOLD_ADMIN_KEY: ${'message' in b ? b.message : b.outcome}`);
      if (b.value.created) log.info({ key: 'admin', replaced: b.value.replaced }, b.value.replaced ? 'bootstrap admin key replaced' : 'bootstrap admin key created');
    }
    await signingSecretGet(db.pool);

    const hub = new AgentHub(db.hot, log.child({ component: 'agents' }), {
      leaseTtlMs: config.leaseTtlMs,
      claimTtlMs: config.claimTtlMs,
      heartbeatIntervalMs: config.heartbeatIntervalMs,
      completionLingerMs: config.completionLingerMs,
    });
    const dispatcher = new Dispatcher(db.hot, hub, log.child({ component: 'dispatcher' }), { claimTtlMs: config.claimTtlMs });
    hub.on('credit', () => dispatcher.credit());
    hub.start();
    // Stopped by the gRPC listener's close too; here for a start that fails before it listens
    // (its port taken): the hub's lease ticker would otherwise keep the process from exiting.
    cleanups.push(() => hub.stop());
    dispatcher.start();
    cleanups.push(() => dispatcher.stop());

    // Gateway enqueues wake the dispatchers after their commit (see QueueWaker).
    const waker = new QueueWaker(db.hot, log.child({ component: 'dispatcher' }), (queue) => dispatcher.wake(queue));
    cleanups.push(() => waker.stop());

    const registry = new SessionRegistry(db.pool, hub, log.child({ component: 'sessions' }));
    registry.start();
    cleanups.push(() => registry.stop());
    log.info({ coordinatorId: registry.coordinatorId }, 'coordinator id (agent_sessions.coordinator_id of its streams)');

    // Served from only while the listener hears revocations: it goes online with the first
    // `connected`, and forgets everything whenever the listener drops or comes back.
    const credentials = new CredentialCache<Principal>(principalOwner, { maxAgeMs: config.authCacheTtlMs });
    const authLog = log.child({ component: 'auth' });
    credentials.on('credentials:dropped', (x) => authLog.debug(x, 'revoked credentials forgotten'));
    credentials.on('credentials:cleared', (x) => authLog.debug(x, 'credential cache cleared'));

    const listener = new Listener(db.url, log.child({ component: 'listener' }));
    listener.on('jobs', (queue) => dispatcher.wake(queue));
    listener.on('connected', () => {
      credentials.setOnline(true);
      dispatcher.wake();
    });
    listener.on('disconnected', () => credentials.setOnline(false));
    listener.on('control', (m) => {
      if (m.type === 'cancel') hub.revoke(m.attemptIds, 'canceled');
      else if (m.type === 'superseded') hub.supersede(m.agentId, m.attemptIds, m.sessionId);
      else if (m.type === 'drain') registry.drain(m.agentId);
      else if (m.type === 'disconnect') registry.disconnect(m.agentId, m.reason);
      else if (m.type === 'credentials') credentials.drop(credentialOwner(m.kind, m.name));
    });
    await listener.start();
    cleanups.push(async () => {
      credentials.setOnline(false); // nothing is heard from here on
      await listener.stop();
    });

    // After its runs failed (the database down, read-only, full), the reaper leaves expired
    // leases alone for one lease TTL: no lease could be renewed meanwhile, so all have passed, and
    // agents need that long to reconnect and deliver what their outboxes hold or renew what still
    // runs (the SDK keeps its reconnect wait under half a lease once welcomed). Without it the
    // reaper, every second, requeued finished jobs before their results arrived: run twice.
    const reaper = new Reaper(db.hot, log.child({ component: 'reaper' }), { intervalMs: config.reaperIntervalMs, outageGraceMs: config.leaseTtlMs });
    reaper.on('reaper:run', (r) => {
      if (!r.rescued.length) return;
      log.debug({ claimExpired: r.claimExpired, leaseExpired: r.leaseExpired, timedOut: r.timedOut, dead: r.dead }, 'reaper run');
      for (const reason of RESCUE_REASONS) {
        const ids = r.rescued.filter((x) => x.reason === reason).map((x) => x.attemptId);
        if (ids.length) hub.revoke(ids, reason);
      }
    });
    reaper.start();
    cleanups.push(() => reaper.stop());

    const deliverer = new WebhookDeliverer(db.pool, log.child({ component: 'webhooks' }), {
      intervalMs: config.webhook.intervalMs,
      timeoutMs: config.webhook.timeoutMs,
      // A claim outlives the send by a margin; past it the sweep of any replica takes it back.
      claimMarginMs: Math.min(5000, config.webhook.timeoutMs),
      maxAttempts: config.webhook.maxAttempts,
      backoff: { baseMs: config.webhook.backoffMs, maxMs: 3_600_000 },
      alertUrl: config.alertUrl,
      egress: config.webhook.egress,
    });
    deliverer.start();
    cleanups.push(() => deliverer.stop());

    const counts = new CountKeeper(db.pool, log.child({ component: 'counts' }));
    counts.start();
    cleanups.push(() => counts.stop());

    let purger: Purger | undefined;
    if (config.retentionMs !== undefined) {
      purger = new Purger(db.pool, log.child({ component: 'purger' }), {
        retentionMs: config.retentionMs,
        intervalMs: config.purgeIntervalMs,
        sweepShare: config.purgeSweepShare,
      });
      purger.start();
      const p = purger;
      cleanups.push(() => p.stop());
    }

    let vacuumer: Vacuumer | undefined;
    if (config.vacuumDeadRows !== undefined) {
      vacuumer = new Vacuumer(db.pool, log.child({ component: 'vacuumer' }), { deadRows: config.vacuumDeadRows });
      vacuumer.start();
      const v = vacuumer;
      cleanups.push(() => v.stop());
    }

    const activity = new Activity();
    const metrics = createMetrics({ db: db.pool, hub, dispatcher, reaper, deliverer, purger, vacuumer, activity, credentials, log: log.child({ component: 'metrics' }) });
    cleanups.push(async () => metrics.close());

    const deps: Omit<ServerDeps, 'log'> = {
      db: db.pool,
      hub,
      leaseTtlMs: config.leaseTtlMs,
      claimTtlMs: config.claimTtlMs,
      heartbeatIntervalMs: config.heartbeatIntervalMs,
      helloTimeoutMs: config.helloTimeoutMs,
      helloPendingMax: config.helloPendingMax,
      agentKeepaliveMs: config.agentKeepaliveMs,
      activity,
      retentionMs: config.retentionMs,
      sessionStaleAfterMs: registry.staleAfterMs,
      metrics,
      trustProxy: config.trustProxy,
      egress: config.webhook.egress,
      credentials,
      dispatcher,
      waker,
    };
    if (!config.tls) {
      const open = [config.grpcAddr, config.httpAddr].filter((a) => !isLoopback(a));
      if (open.length) {
        log.warn(
          { addrs: open, reason: config.trustProxy ? 'LEASEHOLD_TRUST_PROXY' : '--insecure' },
          config.trustProxy
            ? 'cleartext listeners beyond loopback: only a TLS-terminating proxy may reach them'
            : 'cleartext listeners beyond loopback: keys and tokens cross the network unencrypted',
        );
      }
    }
    const grpc = await listenGrpc({ ...deps, log: log.child({ component: 'grpc' }) }, config.grpcAddr, config.tls);
    cleanups.push(() => grpc.close());
    const http = await listenHttp({ ...deps, log: log.child({ component: 'http' }) }, config.httpAddr, config.tls);
    cleanups.push(() => http.close());

    let stopping: Promise<void> | undefined;
    const stop = () => (stopping ??= cleanup());

    // Watched from here, once everything it stops exists; its first look is now, which covers a
    // migration made since migrateDatabase looked.
    const schema = new SchemaWatch(db.pool, log.child({ component: 'schema' }), { readerLevel, intervalMs: opts.schemaCheckIntervalMs });
    cleanups.push(() => schema.stop());
    let halt: (err: Error) => void = () => undefined;
    const halted = new Promise<Error>((resolve) => (halt = resolve));
    schema.on('schema:incompatible', (r) => {
      if (stopping) return;
      const err = new Error(schemaTooNewMessage(r.minReader ?? 0, r.readerLevel));
      err.name = 'NewerSchemaError';
      log.error({ readerLevel: r.readerLevel, minReader: r.minReader }, `${err.message}: stopping`);
      // Unhealthy at once (the proxy's next /healthz, gRPC health watchers); no job claimed or
      // handed out, nothing reaped, purged or delivered by this release from here on; and at once
      // the stop that SIGTERM makes (GoAway to agents, requests in flight answered), which waits
      // for those services' runs in progress (a VACUUM, a recount) only after the listeners.
      http.health.shutdown();
      grpc.health.shutdown();
      for (const s of [dispatcher, reaper, deliverer, counts, purger, vacuumer, schema]) void s?.stop().catch(() => undefined);
      void stop();
      halt(err);
    });
    listener.on('schema', () => schema.look('notified'));
    listener.on('connected', () => schema.look('listener connected'));
    schema.start();
    schema.look('started');

    return { db, reaper, hub, dispatcher, waker, deliverer, purger, vacuumer, counts, registry, activity, credentials, schema, metrics, grpc, http, halted, stop };
  } catch (err) {
    await cleanup();
    throw err;
  }
}
