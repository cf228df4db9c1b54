/**
 * Runs one job as a local command: the payload on stdin (JSON) and in `LEASEHOLD_*`
 * environment variables; the last JSON line on stdout is the result; the exit code decides
 * between success, a retryable failure and a final one. Timeout, cancel, revoke and shutdown
 * stop the whole process tree.
 */
import { spawn, type ChildProcessWithoutNullStreams } from 'node:child_process';
import { mkdir, rm, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { createInterface } from 'node:readline';
import type { Logger } from 'pino';
import { JobError, type JobContext, type JobInfo } from '../context.js';
import type { CommandConfig } from './config.js';
import { describeProcess, killTree, treeSpawnOptions } from './process-tree.js';

const STDERR_TAIL = 4096;
const PAYLOAD_ENV_MAX = 32 * 1024;

/**
 * Spawn errors that another attempt would meet again: the command is missing, not executable or
 * badly written (Node's own `ERR_*` validation codes too). Any other (EAGAIN, EMFILE, ENOMEM,
 * ETXTBSY while the file is being replaced, Windows' UNKNOWN) says the machine could not start
 * it now: the attempt fails retryable, as a timeout does.
 */
const FINAL_SPAWN_ERRORS = new Set(['ENOENT', 'EACCES', 'EPERM', 'EINVAL', 'ENOTDIR', 'EISDIR', 'ENAMETOOLONG', 'ENOEXEC', 'ELOOP', 'E2BIG']);
export function spawnFailureIsFinal(code: string): boolean {
  return FINAL_SPAWN_ERRORS.has(code) || code.startsWith('ERR_');
}

/**
 * The agent's environment as its commands get it: without `LEASEHOLD_TOKEN`, the agent's own
 * credential, which would let a command (or what it runs) claim and report as this agent. A
 * command that needs it is given it in its queue's `env`.
 */
function inherited(): NodeJS.ProcessEnv {
  const { LEASEHOLD_TOKEN: _token, ...rest } = process.env;
  return rest;
}

/** Runs `cmd` for `job`; resolves with the result object or throws a `JobError`. */
export async function runCommand(cmd: CommandConfig, job: JobInfo, ctx: JobContext, opts: { log: Logger; pidDir: string }): Promise<Record<string, unknown>> {
  if (ctx.signal.aborted) throw new JobError(`not started: ${String((ctx.signal.reason as Error)?.message ?? ctx.signal.reason)}`);
  const payload = JSON.stringify(job.payload);
  const env: NodeJS.ProcessEnv = {
    ...inherited(),
    ...cmd.env,
    LEASEHOLD_JOB_ID: job.id,
    LEASEHOLD_QUEUE: job.queue,
    LEASEHOLD_ATTEMPT_ID: ctx.attempt.id,
    LEASEHOLD_ATTEMPT_NO: String(ctx.attempt.number),
    LEASEHOLD_IDEMPOTENCY_KEY: ctx.idempotencyKey('run'),
    ...(payload.length <= PAYLOAD_ENV_MAX ? { LEASEHOLD_PAYLOAD: payload } : {}),
  };
  const [file, ...args] = cmd.command as [string, ...string[]];
  const cannotStart = (err: unknown) => {
    const code = (err as NodeJS.ErrnoException).code ?? (err as Error).message;
    // Node refuses to run a batch file without a shell (EINVAL, thrown by spawn itself).
    const hint = code === 'EINVAL' && /\.(cmd|bat)$/i.test(file) && !cmd.shell ? ': a .cmd or .bat file needs "shell": true (docs/agent.md)' : '';
    const retryable = !spawnFailureIsFinal(code);
    return new JobError(`cannot start ${JSON.stringify(file)}: ${code}${hint}${retryable ? ' (retried: the machine may start it later)' : ''}`, { retryable });
  };
  let child: ChildProcessWithoutNullStreams;
  try {
    child = spawn(file, args, {
      cwd: cmd.cwd,
      env,
      shell: cmd.shell,
      stdio: ['pipe', 'pipe', 'pipe'],
      ...treeSpawnOptions(),
    });
  } catch (err) {
    throw cannotStart(err);
  }
  // Every listener goes on now, before the first await: a command that ends within a
  // millisecond (a two-line shell script) would otherwise exit, and close its pipes, unheard.
  const spawned = new Promise<void>((resolve, reject) => {
    child.once('spawn', resolve);
    child.once('error', reject);
  });
  const done = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) => child.once('exit', (code, signal) => resolve({ code, signal })));
  const closed = new Promise<void>((resolve) => child.once('close', () => resolve()));
  let lastJson: unknown;
  createInterface({ input: child.stdout }).on('line', (line) => {
    const t = line.trim();
    if (!t.startsWith('{') && !t.startsWith('[')) return;
    try {
      lastJson = JSON.parse(t);
    } catch {
      // not JSON: only JSON lines can be the result
    }
  });
  let stderr = '';
  child.stderr.on('data', (d: Buffer) => {
    stderr = (stderr + d.toString('utf8')).slice(-STDERR_TAIL);
  });
  child.stdin.on('error', () => undefined); // a command that does not read its input
  child.stdout.on('error', () => undefined); // a pipe that fails ends the output; the exit still decides
  child.stderr.on('error', () => undefined);
  // The timeout and the attempt's signal are watched from the spawn on too: a cancel, a revoke or
  // a drain that comes while the pid file is written (on Windows, tasklist can take seconds) would
  // otherwise fire unheard, and the command run on after its attempt was taken away.
  let stopped: string | undefined;
  const stop = (why: string) => {
    if (stopped) return;
    stopped = why;
    opts.log.warn({ jobId: job.id, attemptId: ctx.attempt.id, pid: child.pid, why }, 'stopping the command and its children');
    killTree(child, cmd.killGrace, { log: opts.log }).catch((err: unknown) =>
      opts.log.warn({ jobId: job.id, attemptId: ctx.attempt.id, pid: child.pid, err }, 'could not stop the command and its children'),
    );
  };
  const timer = cmd.timeout ? setTimeout(() => stop(`timed out after ${cmd.timeout} ms`), cmd.timeout) : undefined;
  const onAbort = () => stop(String((ctx.signal.reason as Error)?.message ?? 'aborted'));
  ctx.signal.addEventListener('abort', onAbort);
  const unwatch = () => {
    clearTimeout(timer);
    ctx.signal.removeEventListener('abort', onAbort);
  };
  try {
    await spawned;
  } catch (err) {
    unwatch();
    throw cannotStart(err);
  }
  // Ending with a newline: a line reader (a batch file's `set /p`, `read` in sh) keeps the whole line.
  child.stdin.end(`${payload}\n`);
  const pidFile = path.join(opts.pidDir, `${ctx.attempt.id}.json`);
  let pidWritten = false;
  try {
    await mkdir(opts.pidDir, { recursive: true });
    await writeFile(pidFile, JSON.stringify(await describeProcess(child.pid!, { file, shell: cmd.shell })));
    pidWritten = true;
  } catch (err) {
    // The command runs and is watched all the same; only a crash of this agent would leave it
    // behind unseen by the next start.
    opts.log.warn({ jobId: job.id, attemptId: ctx.attempt.id, pid: child.pid, err }, 'could not write the pid file');
  }
  opts.log.info({ event: 'command.started', jobId: job.id, attemptId: ctx.attempt.id, pid: child.pid, command: file }, 'command started');

  const { code, signal } = await done;
  unwatch();
  // Whatever it left running in its group goes too (a backgrounded grandchild, say): a job's
  // processes end with the job, as systemd's KillMode=control-group does.
  if (process.platform !== 'win32') {
    try {
      process.kill(-child.pid!, 'SIGKILL');
    } catch {
      // the group is already empty
    }
  }
  // Output still buffered in the pipes (bounded: a grandchild elsewhere may hold them open).
  await Promise.race([closed, new Promise((r) => setTimeout(r, 2000))]);
  if (pidWritten) await rm(pidFile, { force: true }).catch((err: unknown) => opts.log.warn({ jobId: job.id, attemptId: ctx.attempt.id, err }, 'could not remove the pid file'));
  opts.log.info({ jobId: job.id, attemptId: ctx.attempt.id, code, signal, stopped }, 'command ended');

  const tail = stderr.trim();
  if (stopped) throw new JobError(`${stopped}${tail ? `; stderr: ${tail}` : ''}`, { retryable: true, details: { stopped, stderr: tail } });
  if (code === 0) {
    if (lastJson === undefined) return {};
    return lastJson && typeof lastJson === 'object' && !Array.isArray(lastJson) ? (lastJson as Record<string, unknown>) : { value: lastJson };
  }
  const retryable = code !== null && cmd.retryableExitCodes.includes(code);
  throw new JobError(`exited with ${code === null ? `signal ${signal}` : `code ${code}`}${tail ? `: ${tail}` : ''}`, {
    retryable,
    details: { exitCode: code, signal, stderr: tail },
  });
}
