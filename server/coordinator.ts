/**
 * The coordinator process: opens the database (embedded or `DATABASE_URL`), applies migrations,
 * starts the maintenance services, the agent hub and dispatcher, and the gRPC listener; stops
 * them in the reverse order.
 */
import type { Config } from './config.js';
import { AgentHub } from './core/agent-hub.js';
import { Dispatcher } from './core/dispatcher.js';
import { Reaper } from './core/reaper.js';
import type { Logger } from './log.js';
import { Listener, migrateDatabase, openDatabase, type Database } from './store/index.js';
import { listenGrpc, type GrpcServer } from './transport/server.js';

export interface Coordinator {
  db: Database;
  reaper: Reaper;
  hub: AgentHub;
  dispatcher: Dispatcher;
  grpc: GrpcServer;
  /** Stops the listener, services, pool and embedded database, in that order. Safe to call twice. */
  stop(): Promise<void>;
}

/** Starts a coordinator with `config`; throws (after cleaning up) if any part fails to start. */
export async function startCoordinator(config: Config, log: Logger): Promise<Coordinator> {
  const db = await openDatabase({ databaseUrl: config.databaseUrl, dataDir: config.dataDir, log });
  const cleanups: Array<() => Promise<void>> = [() => db.close()];
  const cleanup = async () => {
    for (const c of cleanups.reverse()) await c().catch((err: unknown) => log.warn({ err }, 'stop step failed'));
  };
  try {
    const applied = await migrateDatabase(db.pool);
    log.info({ applied }, applied ? 'migrations applied' : 'schema up to date');

    const hub = new AgentHub(db.pool, log.child({ component: 'agents' }), {
      leaseTtlMs: config.leaseTtlMs,
      claimTtlMs: config.claimTtlMs,
      heartbeatIntervalMs: config.heartbeatIntervalMs,
    });
    const dispatcher = new Dispatcher(db.pool, hub, log.child({ component: 'dispatcher' }), { claimTtlMs: config.claimTtlMs });
    hub.on('credit', () => dispatcher.wake());
    hub.start();
    dispatcher.start();
    cleanups.push(() => dispatcher.stop());

    const listener = new Listener(db.url, log.child({ component: 'listener' }));
    listener.on('jobs', (queue) => dispatcher.wake(queue));
    listener.on('connected', () => dispatcher.wake());
    listener.on('control', (m) => {
      if (m.type === 'cancel') hub.revoke(m.attemptIds, 'job canceled', 'cancel');
    });
    await listener.start();
    cleanups.push(() => listener.stop());

    const reaper = new Reaper(db.pool, log.child({ component: 'reaper' }), { intervalMs: config.reaperIntervalMs });
    reaper.on('reaper:run', (r) => {
      if (!r.rescued.length) return;
      log.debug({ claimExpired: r.claimExpired, leaseExpired: r.leaseExpired, timedOut: r.timedOut, dead: r.dead }, 'reaper run');
      for (const reason of ['claim_expired', 'lease_expired', 'timed_out'] as const) {
        const ids = r.rescued.filter((x) => x.reason === reason).map((x) => x.attemptId);
        if (ids.length) hub.revoke(ids, reason.replace('_', ' '));
      }
    });
    reaper.start();
    cleanups.push(() => reaper.stop());

    const grpc = await listenGrpc(
      {
        db: db.pool,
        hub,
        log: log.child({ component: 'grpc' }),
        adminKey: config.adminKey,
        leaseTtlMs: config.leaseTtlMs,
        claimTtlMs: config.claimTtlMs,
        heartbeatIntervalMs: config.heartbeatIntervalMs,
      },
      config.grpcAddr,
      config.tls,
    );
    cleanups.push(() => grpc.close());

    let stopping: Promise<void> | undefined;
    return { db, reaper, hub, dispatcher, grpc, stop: () => (stopping ??= cleanup()) };
  } catch (err) {
    await cleanup();
    throw err;
  }
}
