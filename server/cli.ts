/**
 * `leasehold`: the coordinator's command line. `serve` (what `npm start` runs) and `migrate`
 * (what `npm run migrate` runs).
 */
import { Command } from 'commander';
import { ConfigError, loadConfig, type ConfigFlags } from './config.js';
import { startCoordinator } from './coordinator.js';
import { createLogger } from './log.js';
import { migrateDatabase, openDatabase } from './store/index.js';

const log = createLogger();

const program = new Command()
  .name('leasehold')
  .description('A fenced job coordinator: PostgreSQL leases and fencing tokens for jobs run by external agents.')
  .showHelpAfterError();

const withDbFlags = (c: Command) =>
  c.option('--data-dir <dir>', 'embedded PostgreSQL data directory (env LEASEHOLD_DATA_DIR, default .leasehold)');

withDbFlags(
  program
    .command('serve', { isDefault: true })
    .description('run the coordinator until SIGINT or SIGTERM')
    .option('--grpc-addr <host:port>', 'gRPC listener (env LEASEHOLD_GRPC_ADDR, default 127.0.0.1:50051)')
    .option('--http-addr <host:port>', 'HTTP listener (env LEASEHOLD_HTTP_ADDR, default 127.0.0.1:8080)'),
).action(async (flags: ConfigFlags) => {
  const config = loadConfig(flags);
  const coordinator = await startCoordinator(config, log);
  log.info(
    { leaseTtlMs: config.leaseTtlMs, claimTtlMs: config.claimTtlMs, reaperIntervalMs: config.reaperIntervalMs },
    'leasehold coordinator ready',
  );
  await new Promise<void>((resolve) => {
    let signals = 0;
    const onSignal = (signal: NodeJS.Signals) => {
      if (++signals > 1) {
        log.warn({ signal }, 'second signal: exiting without a clean stop');
        process.exit(1);
      }
      log.info({ signal }, 'stopping');
      coordinator.stop().then(resolve, (err: unknown) => {
        log.error({ err }, 'clean stop failed');
        process.exitCode = 1;
        resolve();
      });
    };
    process.on('SIGINT', onSignal);
    process.on('SIGTERM', onSignal);
  });
  log.info('stopped');
});

withDbFlags(program.command('migrate').description('apply database migrations and exit')).action(
  async (flags: ConfigFlags) => {
    const config = loadConfig(flags);
    const db = await openDatabase({ databaseUrl: config.databaseUrl, dataDir: config.dataDir, log });
    try {
      const applied = await migrateDatabase(db.pool);
      log.info({ applied }, applied ? 'migrations applied' : 'schema up to date');
    } finally {
      await db.close();
    }
  },
);

program.parseAsync().catch((err: unknown) => {
  if (err instanceof ConfigError) {
    log.error(err.message);
    process.exitCode = 2;
  } else {
    log.error({ err }, (err as Error).message);
    process.exitCode = 1;
  }
});
