/**
 * `leasehold`: the coordinator's command line. `serve` (what `npm start` runs), `migrate`
 * (what `npm run migrate` runs), and `agents add|list|revoke` (on the database directly: the
 * embedded one is shared with a running coordinator).
 */
import { Command } from 'commander';
import { ConfigError, loadConfig, type ConfigFlags } from './config.js';
import { startCoordinator } from './coordinator.js';
import { createLogger } from './log.js';
import { agentCreate, agentList, agentRevoke, migrateDatabase, openDatabase, type Database } from './store/index.js';

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

/** Runs `fn` on a migrated database, then closes it. */
async function withDb<T>(flags: ConfigFlags, fn: (db: Database) => Promise<T>): Promise<T> {
  const config = loadConfig(flags);
  const db = await openDatabase({ databaseUrl: config.databaseUrl, dataDir: config.dataDir, log, max: 2 });
  try {
    await migrateDatabase(db.pool);
    return await fn(db);
  } finally {
    await db.close();
  }
}

/** Prints an outcome's failure to stderr and sets a non-zero exit code; true when it failed. */
function failed(o: { outcome: string; message?: string; field?: string }): boolean {
  if (o.outcome === 'ok') return false;
  process.stderr.write(`error: ${o.field ? `${o.field} ` : ''}${o.message ?? o.outcome}\n`);
  process.exitCode = o.outcome === 'invalid' ? 2 : 1;
  return true;
}

const agentsCmd = program.command('agents').description('agent identities: each agent connects with its own token');

withDbFlags(agentsCmd.command('add <name>').description('create an agent and print its token (shown once)'))
  .option('--json', 'print JSON')
  .action((name: string, flags: ConfigFlags & { json?: boolean }) =>
    withDb(flags, async (db) => {
      const o = await agentCreate(db.pool, { agentId: name });
      if (failed(o) || o.outcome !== 'ok') return;
      if (flags.json) process.stdout.write(`${JSON.stringify(o.value)}\n`);
      else process.stdout.write(`agent ${o.value.agentId} created; its token (shown once, keep it secret):\n${o.value.token}\n`);
    }),
  );

withDbFlags(agentsCmd.command('list').description('list agents'))
  .option('--json', 'print JSON')
  .action((flags: ConfigFlags & { json?: boolean }) =>
    withDb(flags, async (db) => {
      const rows = await agentList(db.pool);
      if (flags.json) {
        process.stdout.write(`${JSON.stringify(rows.map(({ tokenHash: _, ...r }) => r))}\n`);
        return;
      }
      const lines = rows.map((r) => [r.id, r.revokedAt ? 'revoked' : 'active', r.createdAt.toISOString(), r.lastSeenAt?.toISOString() ?? '-']);
      for (const l of [['AGENT', 'STATE', 'CREATED', 'LAST SEEN'], ...lines]) process.stdout.write(`${l.map((c, i) => (i < 3 ? c.padEnd(i === 2 ? 26 : 24) : c)).join(' ')}\n`);
    }),
  );

withDbFlags(agentsCmd.command('revoke <name>').description('revoke an agent: its token stops working'))
  .action((name: string, flags: ConfigFlags) =>
    withDb(flags, async (db) => {
      const o = await agentRevoke(db.pool, { agentId: name });
      if (!failed(o)) process.stdout.write(`agent ${name} revoked\n`);
    }),
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
