/**
 * Runs one job as a local command: the payload on stdin (JSON) and in `LEASEHOLD_*`
 * environment variables; the last JSON line on stdout is the result; the exit code decides
 * between success, a retryable failure and a final one. Timeout, cancel, revoke and shutdown
 * stop the whole process tree, and no command outlives the runner (`killRunningCommands`).
 */
import { execFileSync, spawn, type ChildProcessWithoutNullStreams } from 'node:child_process';
import { rmSync } from 'node:fs';
import { mkdir, rm, stat, writeFile } from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from 'pino';
import { isUuid } from '../codec.js';
import { JobError, type JobContext, type JobInfo } from '../context.js';
import type { CommandConfig } from './config.js';
import {
  decodeWindowsOutput,
  descendants,
  describeProcess,
  killTree,
  parseProcessList,
  stopLeftBehind,
  treeSpawnOptions,
  windowsProcessListCommands,
  type PidRecord,
  type ProcessList,
} from './process-tree.js';
import { cleanText, TextTail } from './stderr-tail.js';

export { TextTail } from './stderr-tail.js';

const PAYLOAD_ENV_MAX = 32 * 1024;
/**
 * The longest stdout line read, in bytes: a longer one is dropped and counted, never held whole
 * (a line of hundreds of megabytes would take the agent's memory, and past V8's string limit
 * kill it). Above the coordinator's result limit (256 KiB), so a result too large is refused
 * there with its reason.
 */
export const MAX_LINE_BYTES = 1024 * 1024;
/** How much of a JSON line that does not parse its failure shows, in characters. */
const LINE_START_SHOWN = 120;

/**
 * stdout read as lines on its bytes: each line (up to `maxBytes`) is decoded whole, so a UTF-8
 * character split between two reads stays intact; a longer line is dropped as it comes, so at
 * most `maxBytes` are held. Lines end at `\n`, `\r\n` or a lone `\r` (progress output:
 * `10%\r20%\r`), where Node's readline ends them, so the `\r` of a CRLF never counts toward the
 * cap. `lastJson` is the last line that parsed as JSON (an object or an array), trimmed as
 * `String.prototype.trim` does (whitespace and a UTF-8 byte order mark, which PowerShell may
 * write). A line after it that looks like JSON (`looksLikeJson`, and ending with the matching
 * `}` or `]`) but is no result stands where the result would have been: `resultTooLong` the
 * size of one dropped for its length, `badJson` the parse error and the start of one that does
 * not parse (a Windows path with unescaped backslashes, say). At most one of the two is set.
 */
export class OutputLines {
  private parts: Buffer[] = [];
  private size = 0;
  /** Bytes of the current line past the cap (0: within it). */
  private over = 0;
  /** The byte closing the over-cap line if it is JSON (`}` or `]`; 0 when its start is no JSON's). */
  private overClose = 0;
  private overLast = 0;
  /** The last line ended at a `\r`: a `\n` right after it ends nothing more (a CRLF). */
  private afterCr = false;
  /** Lines dropped for their length. */
  discarded = 0;
  lastJson: unknown;
  resultTooLong: number | undefined;
  badJson: { error: string; start: string } | undefined;

  constructor(private readonly maxBytes = MAX_LINE_BYTES) {}

  /** Bytes held for the line not yet ended (at most `maxBytes`). */
  get buffered(): number {
    return this.size;
  }

  write(chunk: Buffer): void {
    let from = 0;
    if (this.afterCr && chunk.length) {
      this.afterCr = false;
      if (chunk[0] === 0x0a) from = 1; // the \n of a CRLF split between two reads
    }
    // The next \n and \r at or after `from` (-1: none in the chunk), each searched again only
    // once passed, so a chunk of many lines is scanned once.
    let nl = -2;
    let cr = -2;
    while (from < chunk.length) {
      if (nl !== -1 && nl < from) nl = chunk.indexOf(0x0a, from);
      if (cr !== -1 && cr < from) cr = chunk.indexOf(0x0d, from);
      const eol = nl < 0 ? cr : cr < 0 ? nl : Math.min(nl, cr);
      this.add(chunk.subarray(from, eol < 0 ? chunk.length : eol));
      if (eol < 0) return;
      this.endLine();
      from = eol + 1;
      if (eol === cr) {
        if (from === chunk.length) this.afterCr = true;
        else if (chunk[from] === 0x0a) from++;
      }
    }
  }

  /**
   * The output ended, or is read no longer (a process it started holds the pipe): its last line
   * may have had no newline. Calling it again does nothing.
   */
  end(): void {
    this.afterCr = false;
    if (this.size || this.over) this.endLine();
  }

  private add(b: Buffer): void {
    if (!b.length) return;
    if (this.over) {
      this.over += b.length;
      this.overLast = lastNonSpace(b) ?? this.overLast;
      return;
    }
    if (this.size + b.length <= this.maxBytes) {
      this.parts.push(b);
      this.size += b.length;
      return;
    }
    const held = Buffer.concat([...this.parts, b]);
    const open = looksLikeJson(held);
    this.over = held.length;
    this.overClose = open === '{' ? 0x7d : open === '[' ? 0x5d : 0;
    this.overLast = lastNonSpace(held) ?? 0;
    this.parts = [];
    this.size = 0;
  }

  private endLine(): void {
    if (this.over) {
      this.discarded++;
      if (this.overClose && this.overLast === this.overClose) {
        this.resultTooLong = this.over;
        this.badJson = undefined;
      }
      this.over = 0;
      return;
    }
    const line = Buffer.concat(this.parts, this.size);
    this.parts = [];
    this.size = 0;
    const first = line[textStart(line)];
    if (first !== 0x7b && first !== 0x5b) return; // only JSON lines can be the result
    const text = line.toString('utf8').trim();
    try {
      this.lastJson = JSON.parse(text);
      this.resultTooLong = undefined;
      this.badJson = undefined;
    } catch (err) {
      // A log line that starts with a bracket is no JSON; one that looks like JSON to its end is
      // a result gone wrong.
      const open = looksLikeJson(line);
      if (!open || lastNonSpace(line) !== (open === '{' ? 0x7d : 0x5d)) return;
      const start = cleanText(text.slice(0, LINE_START_SHOWN));
      this.badJson = { error: cleanText((err as Error).message.slice(0, 200)), start: text.length > LINE_START_SHOWN ? `${start}…` : start };
      this.resultTooLong = undefined;
    }
  }
}

/**
 * Whether a line, by its start, looks like JSON (an object or an array), and which: `{`, or `[`
 * followed by `{`, `[`, `"` or `]`, or by a number, `true`, `false` or `null` and then `,` or
 * `]` (whitespace allowed between, and whitespace or byte order marks before). So a log line
 * in brackets (`[INFO] …`, `[2024-05-01 10:00] …`, `[12:00:01] …`) does not.
 */
export function looksLikeJson(line: Buffer): '{' | '[' | undefined {
  const at = textStart(line);
  if (line[at] === 0x7b) return '{';
  if (line[at] !== 0x5b) return undefined;
  const head = line.subarray(at + 1, at + 513).toString('latin1');
  return /^[ \t]*(?:[{["\]]|(?:-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null)[ \t]*[,\]])/.test(head) ? '[' : undefined;
}

const isSpace = (c: number) => c === 0x20 || c === 0x09 || c === 0x0d || c === 0x0b || c === 0x0c;
/** Where a line's text starts: past ASCII whitespace and UTF-8 byte order marks (EF BB BF). */
function textStart(b: Buffer): number {
  let i = 0;
  while (i < b.length) {
    if (isSpace(b[i]!)) i++;
    else if (b[i] === 0xef && b[i + 1] === 0xbb && b[i + 2] === 0xbf) i += 3;
    else break;
  }
  return i;
}
function lastNonSpace(b: Buffer): number | undefined {
  for (let i = b.length - 1; i >= 0; i--) if (!isSpace(b[i]!)) return b[i];
  return undefined;
}

const STOP_SIGNALS: ReadonlySet<string> = new Set(['SIGTERM', 'SIGINT', 'SIGKILL', 'SIGHUP', 'SIGQUIT']);
/** Windows' exit code of a process ended by Ctrl+C (WinSW stops a service's children so). */
export const STATUS_CONTROL_C_EXIT = 0xc000013a;

/**
 * Whether a command was stopped rather than failed: killed by a signal nobody in the agent sent
 * (a service manager stopping the children first, the OOM killer, a user's kill), or on Windows
 * ended with STATUS_CONTROL_C_EXIT. Its attempt fails retryable. Node gives Windows exit codes
 * as unsigned 32-bit numbers; a negative one is read as the same 32 bits.
 */
export function stoppedFromOutside(code: number | null, signal: NodeJS.Signals | null): boolean {
  if (code === null) return signal !== null && STOP_SIGNALS.has(signal);
  return code >>> 0 === STATUS_CONTROL_C_EXIT;
}

/** The commands running now: pid → pid file. `killRunningCommands` kills them when the runner exits. */
const running = new Map<number, string>();

/**
 * Kills at once, synchronously, every command this process still runs and what each started
 * (its process group; on Windows `taskkill /T /F`, else the tree found by parent ids), and
 * removes their pid files: for the runner's exit (`process.on('exit')`), so that no command
 * outlives it. A command that ignored the polite stop of a drain would otherwise run on,
 * reparented, after its attempt was given to another agent. It never throws, and one failure
 * stops nothing else: a command whose kill failed (or whose tree could not be listed on
 * Windows) keeps its pid file, for the next start to clean up (`killLeftover`); a pid file that
 * cannot be removed (EPERM, EBUSY: an antivirus holding it) is left. Returns the pids of the
 * commands it found running.
 */
export function killRunningCommands(platform: NodeJS.Platform = process.platform): number[] {
  const pids = [...running.keys()];
  if (!pids.length) return pids;
  let killed: Set<number>;
  try {
    killed = platform === 'win32' ? killWindowsTrees(pids) : new Set(pids.filter(killGroup));
  } catch {
    killed = new Set(); // nothing is known to be dead: every pid file stays
  }
  for (const pid of pids) {
    const file = running.get(pid)!;
    running.delete(pid);
    if (!killed.has(pid)) continue;
    try {
      rmSync(file, { force: true });
    } catch {
      // left for the next start, which finds the command gone
    }
  }
  return pids;
}

/** SIGKILL to a command's process group; whether it is gone now (killed, or already empty). */
function killGroup(pid: number): boolean {
  try {
    process.kill(-pid, 'SIGKILL');
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'ESRCH';
  }
}

/**
 * `taskkill /T /F` for all of them in one call; where it fails, the trees by parent ids. Returns
 * the commands whose whole tree is known killed: all when taskkill succeeded, else those whose
 * tree the process list gave and every process of which was killed (or already gone).
 */
function killWindowsTrees(pids: number[]): Set<number> {
  const sync = { timeout: 5000, windowsHide: true, stdio: 'pipe' as const };
  try {
    execFileSync('taskkill', ['/T', '/F', ...pids.flatMap((p) => ['/PID', String(p)])], sync);
    return new Set(pids);
  } catch {
    // refused (Wine's taskkill has no /T) or partly failed: find the trees ourselves
  }
  let list: ProcessList = { parents: new Map(), created: new Map() };
  for (const [cmd, args] of windowsProcessListCommands) {
    try {
      list = parseProcessList(decodeWindowsOutput(execFileSync(cmd, args, { ...sync, timeout: 10_000 })));
    } catch {
      continue;
    }
    if (list.parents.size) break;
  }
  const killed = new Set<number>();
  for (const pid of pids) {
    // With creation times where the list has them: a stale parent id is no link (process-tree.ts).
    // Without a list, the command alone is killed: what it started is left to the next start.
    let all = list.parents.size > 0;
    for (const p of descendants(pid, list.parents, list.created)) {
      try {
        process.kill(p, 'SIGKILL');
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== 'ESRCH') all = false;
      }
    }
    if (all) killed.add(pid);
  }
  return killed;
}

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

/**
 * Runs `cmd` for `job`; resolves with the result object or throws a `JobError`. A job or attempt
 * id that is not a UUID is refused before anything is started or written: the pid file is named
 * after the attempt id (the SDK declines such assignments already; this is the second fence).
 */
export async function runCommand(cmd: CommandConfig, job: JobInfo, ctx: JobContext, opts: { log: Logger; pidDir: string }): Promise<Record<string, unknown>> {
  for (const [what, id] of [['job id', job.id], ['attempt id', ctx.attempt.id]] as const) {
    if (typeof id !== 'string' || !isUuid(id)) throw new JobError(`not started: the ${what} ${JSON.stringify(String(id).slice(0, 100))} is not a UUID`, { retryable: true });
  }
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
  const cannotStart = async (err: unknown) => {
    const code = (err as NodeJS.ErrnoException).code ?? (err as Error).message;
    // Node refuses to run a batch file without a shell (EINVAL, thrown by spawn itself).
    let hint = code === 'EINVAL' && /\.(cmd|bat)$/i.test(file) && !cmd.shell ? ': a .cmd or .bat file needs "shell": true (docs/agent.md)' : '';
    // A missing working directory fails the spawn as a missing command does (ENOENT): say which.
    if (cmd.cwd && !hint) {
      const dir = await stat(cmd.cwd).catch((e: NodeJS.ErrnoException) => e.code ?? 'unreadable');
      if (typeof dir === 'string') hint = `: its working directory (cwd) ${JSON.stringify(cmd.cwd)} ${dir === 'ENOENT' ? 'does not exist' : `cannot be used: ${dir}`}`;
      else if (!dir.isDirectory()) hint = `: its working directory (cwd) ${JSON.stringify(cmd.cwd)} is not a directory`;
    }
    const retryable = !spawnFailureIsFinal(code);
    return new JobError(`cannot start ${JSON.stringify(file)}: ${code}${hint}${retryable ? ' (retried: the machine may start it later)' : ''}`, { retryable });
  };
  // When the command is started, as a lower bound of its creation time (µs since 1970) where
  // Windows' tools cannot tell it (a batch file that exits at once is gone before wmic answers).
  const spawnedAt = Date.now() * 1000;
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
    throw await cannotStart(err);
  }
  // Every listener goes on now, before the first await: a command that ends within a
  // millisecond (a two-line shell script) would otherwise exit, and close its pipes, unheard.
  const spawned = new Promise<void>((resolve, reject) => {
    child.once('spawn', resolve);
    child.once('error', reject);
  });
  const pidFile = path.join(opts.pidDir, `${ctx.attempt.id}.json`);
  const pid = child.pid;
  if (pid !== undefined) running.set(pid, pidFile);
  // When it had exited, by the clock the process list's creation times use (µs since 1970): a
  // process created later is no child of it, whatever parent id it claims (stopLeftBehind).
  let exitedAt = 0;
  const done = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) =>
    child.once('exit', (code, signal) => {
      exitedAt = Date.now() * 1000;
      if (pid !== undefined) running.delete(pid);
      // Whatever it left running in its group goes too (a backgrounded grandchild, say): a job's
      // processes end with the job, as systemd's KillMode=control-group does.
      if (pid !== undefined && process.platform !== 'win32') {
        try {
          process.kill(-pid, 'SIGKILL');
        } catch {
          // the group is already empty
        }
      }
      resolve({ code, signal });
    }),
  );
  const closed = new Promise<void>((resolve) => child.once('close', () => resolve()));
  const stdout = new OutputLines();
  child.stdout.on('data', (d: Buffer) => stdout.write(d));
  child.stdout.on('end', () => stdout.end());
  const stderr = new TextTail();
  child.stderr.on('data', (d: Buffer) => stderr.write(d));
  child.stderr.on('end', () => stderr.end());
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
    throw await cannotStart(err);
  }
  // Ending with a newline: a line reader (a batch file's `set /p`, `read` in sh) keeps the whole line.
  child.stdin.end(`${payload}\n`);
  let pidWritten = false;
  let record: PidRecord | undefined;
  try {
    await mkdir(opts.pidDir, { recursive: true });
    record = await describeProcess(child.pid!, { file, shell: cmd.shell }, process.platform, { spawnedAt });
    // A write that fails (a full disk) may leave the file created and empty: it goes, as a
    // written one goes when the command ends.
    await writeFile(pidFile, JSON.stringify(record)).catch(async (err: unknown) => {
      await rm(pidFile, { force: true }).catch(() => undefined);
      throw err;
    });
    pidWritten = true;
  } catch (err) {
    // The command runs and is watched all the same; only a crash of this agent would leave it
    // behind unseen by the next start.
    opts.log.warn({ jobId: job.id, attemptId: ctx.attempt.id, pid: child.pid, err }, 'could not write the pid file');
  }
  opts.log.info({ event: 'command.started', jobId: job.id, attemptId: ctx.attempt.id, pid: child.pid, command: file }, 'command started');

  const { code, signal } = await done;
  unwatch();
  // Output still buffered in the pipes (bounded: a grandchild elsewhere may hold them open).
  const pipesClosed = await Promise.race([closed.then(() => true), new Promise<false>((r) => setTimeout(r, 2000, false))]);
  // On Windows nothing stops what the command left running when it exits (elsewhere its group
  // was killed above). Pipes still open 2 s after it exited say something it started holds them
  // (cmd's `start /b`, a tool spawning a helper): those processes are stopped, found by parent
  // id with the creation times the pid record holds (or its estimate from the spawn) and the
  // exit time as the upper bound (`stopLeftBehind`; nothing where the process list has no times,
  // as under Wine). Not looked for after every command: a process list costs a wmic run.
  if (process.platform === 'win32' && !pipesClosed && record) {
    await stopLeftBehind(record, { log: opts.log, exitedBy: exitedAt }).catch((err: unknown) =>
      opts.log.warn({ jobId: job.id, attemptId: ctx.attempt.id, pid: child.pid, err }, 'could not stop what the command left running'),
    );
  }
  // The output is read no further (a process left holding the pipes may keep it open): a last
  // line without a newline counts, as it does when the pipes end ('end' calls these too; the
  // second call does nothing).
  stdout.end();
  stderr.end();
  if (pidWritten) await rm(pidFile, { force: true }).catch((err: unknown) => opts.log.warn({ jobId: job.id, attemptId: ctx.attempt.id, err }, 'could not remove the pid file'));
  const discarded = stdout.discarded ? { discardedLines: stdout.discarded } : {};
  opts.log.info({ jobId: job.id, attemptId: ctx.attempt.id, code, signal, stopped, ...discarded }, 'command ended');
  if (stdout.discarded) opts.log.warn({ jobId: job.id, attemptId: ctx.attempt.id, lines: stdout.discarded, maxBytes: MAX_LINE_BYTES }, 'dropped stdout lines longer than the limit');

  // The end of stderr goes into the report once (in the message where the message names no
  // other cause), bounded so that the report stays within the coordinator's limits.
  const tail = stderr.text.trim();
  if (stopped) throw new JobError(`${stopped}${tail ? `; stderr: ${tail}` : ''}`, { retryable: true, details: { stopped } });
  if (code === 0) {
    // The last JSON line was too long to read, or does not parse: an earlier one is not the
    // result, and another attempt would print the same.
    if (stdout.resultTooLong !== undefined) {
      throw new JobError(`result too long: the last JSON line on stdout has ${stdout.resultTooLong} bytes, over the limit of ${MAX_LINE_BYTES} (a result is at most 256 KiB)`, {
        retryable: false,
        details: { exitCode: code, resultBytes: stdout.resultTooLong, stderr: tail },
      });
    }
    if (stdout.badJson) {
      throw new JobError(`the last JSON line on stdout is not valid JSON: ${stdout.badJson.error} (the line starts: ${stdout.badJson.start})`, {
        retryable: false,
        details: { exitCode: code, stderr: tail },
      });
    }
    const lastJson = stdout.lastJson;
    if (lastJson === undefined) return {};
    return lastJson && typeof lastJson === 'object' && !Array.isArray(lastJson) ? (lastJson as Record<string, unknown>) : { value: lastJson };
  }
  const outside = stoppedFromOutside(code, signal);
  const retryable = outside || (code !== null && cmd.retryableExitCodes.includes(code >>> 0));
  const how = code === null ? `signal ${signal}` : code >>> 0 === STATUS_CONTROL_C_EXIT ? `code ${code >>> 0} (0xC000013A, Ctrl+C)` : `code ${code}`;
  throw new JobError(`exited with ${how}${outside ? ' (stopped from outside: retried)' : ''}${tail ? `: ${tail}` : ''}`, {
    retryable,
    details: { exitCode: code, signal, ...(outside ? { stoppedFromOutside: true } : {}) },
  });
}
