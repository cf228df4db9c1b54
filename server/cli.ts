/**
 * `leasehold`: the coordinator's command line. `serve` (what `npm start` runs), `migrate`
 * (what `npm run migrate` runs), `seed-history` (`npm run seed:history`, `seed-history.ts`);
 * everything else through a running coordinator's API, with
 * `--url` and `--key`: `agents add|list|revoke|drain`, `keys add|list|revoke`,
 * `jobs ls|show|requeue|cancel|purge|stale` and `stats` (`cli-remote.ts`), and the
 * notifications: `subscriptions add|list|remove|rotate`, `webhooks secret`, `deliveries
 * list|retry` (`cli-webhooks.ts`). Every command writes its answer to stdout and its logs and
 * errors to stderr.
 */
import { Command } from 'commander';
import type { ConfigFlags } from './config.js';
import { watchLauncher } from './launcher.js';
import { createLogger } from './log.js';
import { registerRemoteCommands } from './cli-remote.js';
import { registerWebhookCommands } from './cli-webhooks.js';
import { registerSeedCommand } from './seed-history.js';

// The configuration (zod) and the store (Drizzle, pg) are loaded by the commands that use them,
// so the API commands start without them.
const loadConfig = async (flags: ConfigFlags) => (await import('./config.js')).loadConfig(flags);
type Store = typeof import('./store/index.js');
let S: Store;
const loadStore = async () => (S ??= await import('./store/index.js'));

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
    .option('--http-addr <host:port>', 'HTTP listener (env LEASEHOLD_HTTP_ADDR, default 127.0.0.1:8080)')
    .option('--insecure', 'allow cleartext listeners on a non-loopback address (env LEASEHOLD_INSECURE=1)'),
).action(async (flags: ConfigFlags) => {
  const config = await loadConfig(flags);
  // Loaded here, not at the top: the tool commands need only the store, and start faster without
  // the transports.
  const { startCoordinator } = await import('./coordinator.js');
  const coordinator = await startCoordinator(config, log);
  log.info(
    { leaseTtlMs: config.leaseTtlMs, claimTtlMs: config.claimTtlMs, reaperIntervalMs: config.reaperIntervalMs },
    'leasehold coordinator ready',
  );
  await new Promise<void>((resolve) => {
    let signals = 0;
    let firstAt = 0;
    const onSignal = (signal: NodeJS.Signals) => {
      // Under `npm start`, one Ctrl-C arrives twice: from the terminal, and forwarded by npm.
      if (signals && performance.now() - firstAt < 1000) return;
      if (++signals > 1) {
        log.warn({ signal }, 'second signal: exiting without a clean stop');
        process.exit(1);
      }
      firstAt = performance.now();
      log.info({ event: 'stopping', signal }, 'stopping');
      coordinator.stop().then(resolve, (err: unknown) => {
        log.error({ err }, 'clean stop failed');
        process.exitCode = 1;
        resolve();
      });
    };
    process.on('SIGINT', onSignal);
    process.on('SIGTERM', onSignal);
    // Where a process stands between npm and this one (cmd.exe on Windows), a signal to npm alone
    // never reaches this one: it stops when npm is gone (see launcher.ts); unless already stopping.
    watchLauncher(log, (why) => {
      if (signals) return;
      log.info({ why }, 'the process that started this one is gone');
      onSignal('SIGTERM');
    });
    // The database was migrated past what this release can run beside (coordinator.ts said why,
    // at error level, and is stopping): exit code 2, as a refusal at start, so systemd's
    // Restart=on-failure tries again and is refused until the replica is upgraded.
    void coordinator.halted.then(() => {
      if (signals++) return;
      firstAt = performance.now();
      process.exitCode = 2;
      coordinator.stop().then(resolve, (err: unknown) => {
        log.error({ err }, 'clean stop failed');
        resolve();
      });
    });
  });
  log.info('stopped');
});

withDbFlags(program.command('migrate').description('apply database migrations and exit')).action(
  async (flags: ConfigFlags) => {
    const config = await loadConfig(flags);
    const { openDatabase, migrateDatabase } = await loadStore();
    const db = await openDatabase({ databaseUrl: config.databaseUrl, dataDir: config.dataDir, log, max: config.dbPoolMax, hotMax: config.dbHotPoolMax });
    try {
      const applied = await migrateDatabase(db.pool, { log: log.child({ component: 'migrate' }), allowNewerSchema: config.allowNewerSchema });
      log.info({ applied }, applied ? 'migrations applied' : 'schema up to date');
    } finally {
      await db.close();
    }
  },
);

// An online copy of the embedded PostgreSQL, and putting one back (backup.ts; README, "Backups").
// Their answer goes to stdout, their logs and a refusal's one line to stderr (exit code 2).
const toolLog = () => createLogger(process.env, { stderr: true });
const embeddedTool =
  <A extends unknown[]>(what: string, fn: (config: Awaited<ReturnType<typeof loadConfig>>, ...args: A) => Promise<string>) =>
  async (...args: [...A, ConfigFlags, Command]) => {
    // commander passes the arguments, then the options, then the command.
    const flags = args.at(-2) as ConfigFlags;
    try {
      const config = await loadConfig(flags);
      if (config.databaseUrl) {
        const { ConfigError } = await import('./config.js');
        throw new ConfigError(
          `leasehold ${what} works on the embedded PostgreSQL (DATABASE_URL unset); for the server in DATABASE_URL use its own tools: pg_dump or pg_basebackup of its version, or your provider's snapshots`,
        );
      }
      process.stdout.write(`${await fn(config, ...(args.slice(0, -2) as unknown as A))}\n`);
    } catch (err) {
      if (!['ConfigError', 'BackupError'].includes((err as Error).name)) throw err;
      process.stderr.write(`${(err as Error).message}\n`);
      process.exitCode = 2;
    }
  };
withDbFlags(program.command('backup <dir>').description('copy the embedded PostgreSQL into a new directory while the coordinator runs')).action(
  embeddedTool('backup', async (config, dir: string) => {
    const { backupEmbedded } = await import('./store/backup.js');
    const m = await backupEmbedded({ dataDir: config.dataDir, to: dir, log: toolLog() });
    return `backup of ${m.files} files (${(m.bytes / 1048576).toFixed(1)} MiB, PostgreSQL ${m.postgres}) in ${dir}`;
  }),
);
withDbFlags(program.command('restore <dir>').description('replace the embedded PostgreSQL with a backup (the coordinator stopped)')).action(
  embeddedTool('restore', async (config, dir: string) => {
    const { restoreEmbedded } = await import('./store/backup.js');
    const r = await restoreEmbedded({ dataDir: config.dataDir, from: dir, log: toolLog() });
    return `restored the backup of ${r.manifest.createdAt} (${r.jobs} jobs)${r.previous ? `; the cluster that was there is in ${r.previous}` : ''}`;
  }),
);

registerSeedCommand(program, { withDbFlags });
registerRemoteCommands(program);
registerWebhookCommands(program);

program.parseAsync().catch((err: unknown) => {
  // A bad setting (DatabaseSettingError: DATABASE_URL's TLS settings, or a pooler that shares
  // sessions, found on the first connection; NewerSchemaError: a database migrated by a newer release, at `serve` or `migrate`)
  // is one line and exit code 2; anything else is logged with its stack, exit code 1.
  const oneLine = ['ConfigError', 'DatabaseSettingError', 'NewerSchemaError'];
  if (oneLine.includes((err as Error).name)) {
    log.error((err as Error).message);
    process.exitCode = 2;
  } else {
    log.error({ err }, (err as Error).message);
    process.exitCode = 1;
  }
});
