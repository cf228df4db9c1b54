/**
 * `leasehold`: the coordinator's command line. `serve` (what `npm start` runs), `migrate`
 * (what `npm run migrate` runs); through a running coordinator's API (`cli-remote.ts`, with
 * `--url` and `--key`): `agents add|list|revoke|drain`, `keys add|list|revoke`,
 * `jobs ls|show|requeue|cancel|purge|stale` and `stats`; and, on the database directly (the
 * embedded one is shared with a running coordinator): `subscriptions add|list|remove`
 * (per-queue notifications), `deliveries list|retry` (the notification outbox) and `webhooks
 * secret` (the notify_url signing secret). Every command writes its answer to stdout and its
 * logs and errors to stderr.
 */
import { Command } from 'commander';
import type { ConfigFlags } from './config.js';
import { watchLauncher } from './launcher.js';
import { createLogger } from './log.js';
import { registerRemoteCommands } from './cli-remote.js';
import { WEBHOOK_EVENT_TYPES } from './store/constants.js';
import type { Database, DeliveryView } from './store/index.js';

// The configuration (zod) and the store (Drizzle, pg) are loaded by the commands that use them,
// so the API commands start without them.
const loadConfig = async (flags: ConfigFlags) => (await import('./config.js')).loadConfig(flags);
type Store = typeof import('./store/index.js');
let S: Store;
const loadStore = async () => (S ??= await import('./store/index.js'));

const log = createLogger();
/** The logger of the tool commands: stderr, so stdout holds only the answer. */
let toolLogger: ReturnType<typeof createLogger> | undefined;
const toolLog = () => (toolLogger ??= createLogger(process.env, { stderr: true }));

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
      log.info({ signal }, 'stopping');
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
  });
  log.info('stopped');
});

withDbFlags(program.command('migrate').description('apply database migrations and exit')).action(
  async (flags: ConfigFlags) => {
    const config = await loadConfig(flags);
    const { openDatabase, migrateDatabase } = await loadStore();
    const db = await openDatabase({ databaseUrl: config.databaseUrl, dataDir: config.dataDir, log });
    try {
      const applied = await migrateDatabase(db.pool);
      log.info({ applied }, applied ? 'migrations applied' : 'schema up to date');
    } finally {
      await db.close();
    }
  },
);

registerRemoteCommands(program);

/** Runs `fn` on a migrated database, then closes it. */
async function withDb<T>(flags: ConfigFlags, fn: (db: Database) => Promise<T>): Promise<T> {
  const config = await loadConfig(flags);
  const { openDatabase, migrateDatabase } = await loadStore();
  const db = await openDatabase({ databaseUrl: config.databaseUrl, dataDir: config.dataDir, log: toolLog(), max: 2 });
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

/** Prints rows as aligned columns. */
function table(rows: string[][]) {
  const widths = rows[0]!.map((_, i) => Math.max(...rows.map((r) => (r[i] ?? '').length)));
  for (const r of rows) process.stdout.write(`${r.map((c, i) => (i < r.length - 1 ? c.padEnd(widths[i]!) : c)).join('  ')}\n`);
}
const list = (s: string) => s.split(',').map((x) => x.trim()).filter(Boolean);

const subsCmd = program.command('subscriptions').description('per-queue notifications: signed POSTs when jobs end');

withDbFlags(subsCmd.command('add <queue> <url>').description("subscribe url to a queue's job events ('*': every queue); prints the signing secret"))
  .option('--events <events>', `comma-separated, default all: ${WEBHOOK_EVENT_TYPES.join(', ')}`)
  .option('--json', 'print JSON')
  .action((queue: string, url: string, flags: ConfigFlags & { events?: string; json?: boolean }) =>
    withDb(flags, async (db) => {
      const o = await S.subscriptionCreate(db.pool, { queue, url, ...(flags.events ? { events: list(flags.events) } : {}) });
      if (failed(o) || o.outcome !== 'ok') return;
      if (flags.json) return void process.stdout.write(`${JSON.stringify(o.value)}\n`);
      process.stdout.write(
        `subscription ${o.value.id} created: ${o.value.events.join(',')} of queue ${o.value.queue} to ${o.value.url}\n` +
          `its signing secret (verify the leasehold-signature header with it):\n${o.value.secret}\n`,
      );
    }),
  );

withDbFlags(subsCmd.command('list').description('list subscriptions'))
  .option('--json', 'print JSON')
  .option('--show-secrets', 'include the signing secrets')
  .action((flags: ConfigFlags & { json?: boolean; showSecrets?: boolean }) =>
    withDb(flags, async (db) => {
      const rows = await S.subscriptionList(db.pool, { withSecrets: Boolean(flags.showSecrets) });
      if (flags.json) return void process.stdout.write(`${JSON.stringify(rows)}\n`);
      table([
        ['ID', 'QUEUE', 'EVENTS', 'URL', ...(flags.showSecrets ? ['SECRET'] : [])],
        ...rows.map((r) => [r.id, r.queue, r.events.join(','), r.url, ...(flags.showSecrets ? [r.secret ?? ''] : [])]),
      ]);
    }),
  );

withDbFlags(subsCmd.command('remove <id>').description('remove a subscription (its undelivered notifications are dropped)'))
  .action((id: string, flags: ConfigFlags) =>
    withDb(flags, async (db) => {
      const o = await S.subscriptionRemove(db.pool, { id });
      if (!failed(o)) process.stdout.write(`subscription ${id} removed\n`);
    }),
  );

const deliveriesCmd = program.command('deliveries').description('the notification outbox: what was sent, what is waiting, what failed');

withDbFlags(deliveriesCmd.command('list').description('the newest deliveries'))
  .option('--status <status>', 'pending, sending, delivered or failed')
  .option('--job <jobId>', 'only those of one job')
  .option('--limit <n>', 'at most this many (default 100)')
  .option('--json', 'print JSON')
  .action((flags: ConfigFlags & { status?: string; job?: string; limit?: string; json?: boolean }) =>
    withDb(flags, async (db) => {
      const o = await S.deliveryList(db.pool, {
        ...(flags.status ? { status: flags.status as DeliveryView['status'] } : {}),
        ...(flags.job ? { jobId: flags.job } : {}),
        ...(flags.limit ? { limit: Number(flags.limit) } : {}),
      });
      if (failed(o) || o.outcome !== 'ok') return;
      if (flags.json) return void process.stdout.write(`${JSON.stringify(o.value)}\n`);
      table([
        ['ID', 'STATUS', 'ATTEMPTS', 'EVENT', 'JOB', 'URL', 'LAST ERROR'],
        ...o.value.map((d) => [String(d.id), d.status, String(d.attempts), d.type, d.jobId, d.url, d.lastError ?? '-']),
      ]);
    }),
  );

withDbFlags(deliveriesCmd.command('retry [id]').description('send failed deliveries again (one, or all with --all-failed)'))
  .option('--all-failed', 'every failed delivery')
  .action((id: string | undefined, flags: ConfigFlags & { allFailed?: boolean }) =>
    withDb(flags, async (db) => {
      if (id === undefined && !flags.allFailed) {
        failed({ outcome: 'invalid', field: 'id', message: 'is required (or --all-failed)' });
        return;
      }
      if (id !== undefined && !/^\d{1,15}$/.test(id)) {
        failed({ outcome: 'invalid', field: 'id', message: 'must be a delivery number (leasehold deliveries list --status failed)' });
        return;
      }
      const o = await S.deliveryRetry(db.pool, id === undefined ? {} : { id: Number(id) });
      if (failed(o) || o.outcome !== 'ok') return;
      process.stdout.write(`${o.value.ids.length} deliver${o.value.ids.length === 1 ? 'y' : 'ies'} queued again${o.value.ids.length ? `: ${o.value.ids.join(', ')}` : ''}\n`);
    }),
  );

const webhooksCmd = program.command('webhooks').description('the signing secret of notify_url and alert deliveries');

withDbFlags(webhooksCmd.command('secret').description('print the secret that signs notify_url and LEASEHOLD_ALERT_URL deliveries'))
  .option('--rotate', 'replace it (deliveries sent from now on use the new one)')
  .action((flags: ConfigFlags & { rotate?: boolean }) =>
    withDb(flags, async (db) => {
      process.stdout.write(`${await S.signingSecretGet(db.pool, { rotate: Boolean(flags.rotate) })}\n`);
    }),
  );

program.parseAsync().catch((err: unknown) => {
  if ((err as Error).name === 'ConfigError') {
    log.error((err as Error).message);
    process.exitCode = 2;
  } else {
    log.error({ err }, (err as Error).message);
    process.exitCode = 1;
  }
});
