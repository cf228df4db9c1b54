/**
 * `leasehold-agent --config agent.json`: an agent that runs a local command per queue.
 * `--check` validates the configuration, reaches the coordinator, authenticates, prints what it
 * would serve and exits. Exit codes: 0 fine, 1 runtime failure, 2 bad configuration.
 */
import { writeSync } from 'node:fs';
import { mkdtemp, readdir, readFile, rm, stat } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Command } from 'commander';
import pino from 'pino';
import { createAgent, envLogLevel } from '../agent.js';
import { LOCK_FILE } from '../outbox-lock.js';
import { readOutbox } from '../outbox.js';
import { ConfigError, loadConfig, secretsOpenToOthers, type AgentConfig } from './config.js';
import { killLeftover, type PidRecord } from './process-tree.js';
import { killRunningCommands, runCommand } from './run-command.js';

const log = pino({ level: logLevelOrExit(), base: { pid: process.pid } });

/** `LEASEHOLD_LOG_LEVEL`'s level; a bad one is a bad setting: one line, exit code 2. */
function logLevelOrExit(): string {
  try {
    return envLogLevel();
  } catch (err) {
    // Written at once: process.exit() does not wait for a pipe's pending write.
    writeSync(2, `leasehold-agent: ${(err as Error).message}\n`);
    process.exit(2);
  }
}

const program = new Command()
  .name('leasehold-agent')
  .description('Runs a local command for each job of the configured queues (see docs/agent.md).')
  .requiredOption('-c, --config <file>', 'the configuration file (JSON)')
  .option('--check', 'validate the configuration, reach and authenticate with the coordinator, print what would be served, exit')
  .showHelpAfterError()
  .action(async (flags: { config: string; check?: boolean }) => {
    const config = await loadConfig(flags.config);
    if (flags.check) return check(config);
    return serve(config);
  });

function agentFor(config: AgentConfig, handleSignals: boolean, outboxDir = config.outboxDir) {
  return createAgent({
    url: config.url,
    token: config.token,
    slots: config.slots,
    labels: config.labels,
    outboxDir,
    graceMs: config.grace,
    handleSignals,
    log,
    ...(config.tls === undefined ? {} : { tls: config.tls }),
  });
}

async function serve(config: AgentConfig): Promise<void> {
  for (const o of await secretsOpenToOthers(config.secretFiles)) log.warn({ event: 'config.secret_readable', file: o.file, mode: o.mode }, o.message);
  const pidDir = path.join(config.outboxDir, 'running');
  const agent = agentFor(config, true);
  // When the agent before this one was last alive, read before the lock is taken over.
  const lastAlive = await previousAgentLastAlive(config.outboxDir);
  // The outbox's lock first: a second runner on the same outbox (a console start beside the
  // service) is refused here, before it takes the running agent's pid files for leftovers.
  await agent.open();
  await killLeftovers(pidDir, lastAlive);
  // However the process ends (drained, a second Ctrl-C, a crash), no command outlives it: one that
  // ignored the drain's polite stop would otherwise run on, reparented, while its job is redone
  // elsewhere (the drain exits before the queue's killGrace has passed).
  process.on('exit', killLeftBehind);
  for (const [queue, cmd] of Object.entries(config.queues)) {
    agent.handle(queue, (job, ctx) => runCommand(cmd, job, ctx, { log, pidDir }));
  }
  // Revoked (or its token unknown) while it ran: the agent has stopped for good, as it would have
  // at start; retrying could never work, so the process ends saying why (exit code 1).
  agent.on('refused', ({ error }) => {
    writeSync(2, `leasehold-agent: ${error.message}: stopped (its token no longer works: make a new agent with \`leasehold agents add NAME\` and put its token in the configuration)\n`);
    process.exit(1);
  });
  // Another process took this outbox over (a second agent started on the same directory after
  // its lock was deleted): the agent stopped writing and stopped; the process ends saying so.
  agent.on('outboxLockLost', ({ error }) => {
    writeSync(2, `leasehold-agent: ${error.message}: stopped (another process writes this outbox now: run one agent per outbox directory)\n`);
    process.exit(1);
  });
  try {
    await agent.start();
  } catch (err) {
    // Stopped (Ctrl-C, a service stop) before the coordinator answered: the drain exits 0.
    if (agent.isStopping) return;
    throw err;
  }
  log.info({ event: 'serving', queues: Object.keys(config.queues), slots: config.slots, outboxDir: config.outboxDir }, 'leasehold-agent serving');
}

async function check(config: AgentConfig): Promise<void> {
  const out = (s: string) => process.stdout.write(`${s}\n`);
  out(`config ok: ${Object.keys(config.queues).length} queue(s), ${config.slots} slot(s), outbox ${config.outboxDir}`);
  for (const o of await secretsOpenToOthers(config.secretFiles)) out(`warning: ${o.message}`);
  for (const [q, c] of Object.entries(config.queues)) {
    out(`  ${q}: ${c.shell ? c.command[0] : JSON.stringify(c.command)}${c.cwd ? ` in ${c.cwd}` : ''}${c.timeout ? `, timeout ${c.timeout} ms` : ''}${c.retryableExitCodes.length ? `, retry on exit ${c.retryableExitCodes.join(',')}` : ''}`);
  }
  // The real outbox may be in use (and locked) by the running service: read it, do not open
  // it. The check connects with an empty outbox of its own, so it resends nothing.
  const { pending } = await readOutbox(config.outboxDir);
  if (pending.length) out(`outbox holds ${pending.length} report(s) not yet acknowledged`);
  const scratch = await mkdtemp(path.join(os.tmpdir(), 'leasehold-check-'));
  const agent = agentFor(config, false, scratch);
  // A queue nobody enqueues to, so the check never takes real work.
  agent.handle('leasehold-check', () => ({}));
  // Why the last try to connect failed (a refused port, a certificate not trusted), for the timeout.
  let lastError: string | undefined;
  agent.on('disconnected', ({ error }) => {
    if (error) lastError = (error as { details?: string }).details || error.message;
  });
  const started = agent.start();
  const timeout = new Promise<never>((_, reject) =>
    setTimeout(() => reject(new Error(`cannot reach the coordinator at ${config.url} within 10 s${lastError ? `: ${lastError}${tlsHint(lastError)}` : ''}`)), 10_000).unref(),
  );
  try {
    await Promise.race([started, timeout]);
    out(`coordinator ok: ${config.url} accepted this agent's token`);
  } finally {
    await agent.stop();
    await rm(scratch, { recursive: true, force: true });
  }
}

/** What to do about a certificate the agent does not trust (`tls.ca`, `NODE_EXTRA_CA_CERTS`), if the error is one. */
function tlsHint(error: string): string {
  if (!/unable to verify the first certificate|self[- ]signed certificate|unable to get (local )?issuer certificate/i.test(error)) return '';
  return ' (the coordinator\'s TLS certificate is not trusted: set "tls": {"ca": "ca.pem"} to the CA that signed it, or NODE_EXTRA_CA_CERTS=ca.pem to trust it beside the public ones)';
}

/** On exit: kills the commands still running, and says so (synchronously: the process is ending). */
function killLeftBehind(): void {
  const pids = killRunningCommands();
  if (pids.length) pino({ base: { pid: process.pid } }, pino.destination({ dest: 1, sync: true })).warn({ event: 'commands.killed', pids }, 'exiting: killed the commands still running');
}

/** How long after its last touch of the outbox lock an agent may still have run: it touches it every 10 s (outbox-lock.ts), with room for a busy event loop. */
const LOCK_TOUCH_SLACK_MS = 30_000;

/**
 * A time (µs since 1970) by which the previous agent on this outbox had ended: its lock's last
 * touch, plus the slack of the touch interval. On Windows its commands ended with it (Node puts
 * them in a job object killed when the agent's process ends), so a process created later is no
 * child of theirs (`killLeftover`). Undefined without a lock (the agent before released it on a
 * clean exit, where it killed its commands itself): no such bound then.
 */
async function previousAgentLastAlive(outboxDir: string): Promise<number | undefined> {
  const st = await stat(path.join(outboxDir, LOCK_FILE)).catch(() => undefined);
  return st && (st.mtimeMs + LOCK_TOUCH_SLACK_MS) * 1000;
}

/**
 * Stops command trees that a previous run of this agent left behind (it was killed outright).
 * `exitedBy`: when that run was last alive (`previousAgentLastAlive`).
 */
async function killLeftovers(pidDir: string, exitedBy: number | undefined): Promise<void> {
  const names = await readdir(pidDir).catch(() => [] as string[]);
  for (const name of names) {
    const file = path.join(pidDir, name);
    const rec = await readFile(file, 'utf8')
      .then((t) => JSON.parse(t) as PidRecord)
      .catch(() => undefined);
    if (rec && (await killLeftover(rec, log, exitedBy === undefined ? {} : { exitedBy }))) log.warn({ pid: rec.pid, file }, 'stopped a command left running by an earlier agent process');
    await rm(file, { force: true });
  }
}

program.parseAsync().catch((err: unknown) => {
  if (err instanceof ConfigError) {
    process.stderr.write(`leasehold-agent: invalid configuration: ${err.message}\n`);
    process.exit(2);
  }
  process.stderr.write(`leasehold-agent: ${(err as Error).message}\n`);
  process.exit(1);
});
