/**
 * The coordinator process: opens the database (embedded or `DATABASE_URL`), applies migrations,
 * runs the maintenance services, and stops them all in order.
 */
import type { Config } from './config.js';
import { Reaper } from './core/reaper.js';
import type { Logger } from './log.js';
import { migrateDatabase, openDatabase, type Database } from './store/index.js';

export interface Coordinator {
  db: Database;
  reaper: Reaper;
  /** Stops services, closes the pool, stops the embedded database. Safe to call twice. */
  stop(): Promise<void>;
}

/** Starts a coordinator with `config`; throws (after cleaning up) if any part fails to start. */
export async function startCoordinator(config: Config, log: Logger): Promise<Coordinator> {
  const db = await openDatabase({ databaseUrl: config.databaseUrl, dataDir: config.dataDir, log });
  try {
    const applied = await migrateDatabase(db.pool);
    log.info({ applied }, applied ? 'migrations applied' : 'schema up to date');
    const reaper = new Reaper(db.pool, log.child({ component: 'reaper' }), { intervalMs: config.reaperIntervalMs });
    reaper.on('reaper:run', (r) => {
      if (r.rescued.length) log.debug({ claimExpired: r.claimExpired, leaseExpired: r.leaseExpired, timedOut: r.timedOut, dead: r.dead }, 'reaper run');
    });
    reaper.start();
    let stopping: Promise<void> | undefined;
    return {
      db,
      reaper,
      stop: () =>
        (stopping ??= (async () => {
          await reaper.stop();
          await db.close();
        })()),
    };
  } catch (err) {
    await db.close().catch(() => undefined);
    throw err;
  }
}
