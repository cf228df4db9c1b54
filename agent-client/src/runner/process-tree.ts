/**
 * Stopping a command and everything it started. All platform differences of the runner live
 * here, so the Windows branches can be unit-tested on Linux through the commands they build.
 *
 * - Elsewhere: the command runs as the leader of a new process group (`detached`), so
 *   `kill(-pid)` reaches its children and grandchildren: SIGTERM first, SIGKILL after the grace.
 * - Windows: `taskkill /PID <pid> /T` asks the tree to close, `taskkill /PID <pid> /T /F` forces it.
 *   Where taskkill refuses `/T` (Wine's does) or fails otherwise, the failure is logged and the
 *   runner stops the tree itself: the descendants found by parent process id (`wmic`, else
 *   PowerShell's `Get-CimInstance`), each asked to close, then terminated.
 *
 * The runner records each running command in a pid file; at the next start, trees left behind
 * by an agent that was killed outright are stopped (after checking the process is still that
 * command, so a reused pid is never killed).
 */
import { execFile, type ChildProcess, type SpawnOptions } from 'node:child_process';
import { readFile } from 'node:fs/promises';
import path from 'node:path';
import { promisify } from 'node:util';
import type { Logger } from 'pino';

const execRaw = promisify(execFile);
/**
 * The Windows tools this file runs (taskkill, tasklist, wmic, PowerShell), each given at most
 * 10 s: a tool that hangs (WMI starting on a loaded machine, say) must not leave a
 * command running past its timeout.
 */
const TOOL_OPTIONS = { timeout: 10_000, windowsHide: true };
const exec = (cmd: string, args: string[]) => execRaw(cmd, args, TOOL_OPTIONS);

export type Platform = NodeJS.Platform;

/** The spawn options that make a command's whole tree killable. */
export function treeSpawnOptions(platform: Platform = process.platform): Pick<SpawnOptions, 'detached' | 'windowsHide'> {
  return platform === 'win32' ? { detached: false, windowsHide: true } : { detached: true };
}

/** `taskkill` command lines for a tree: polite (close), then forced. */
export function windowsKillCommands(pid: number): { polite: [string, string[]]; force: [string, string[]] } {
  if (!Number.isInteger(pid) || pid <= 0) throw new Error(`not a pid: ${pid}`);
  return {
    polite: ['taskkill', ['/PID', String(pid), '/T']],
    force: ['taskkill', ['/PID', String(pid), '/T', '/F']],
  };
}

/** `tasklist` command line that tells which image a pid runs (CSV, no header), to check before killing. */
export function windowsProcessQuery(pid: number): [string, string[]] {
  if (!Number.isInteger(pid) || pid <= 0) throw new Error(`not a pid: ${pid}`);
  return ['tasklist', ['/FI', `PID eq ${pid}`, '/FO', 'CSV', '/NH']];
}

/** Parses `tasklist /FO CSV /NH` output: the image name of the first row, if any. */
export function parseTasklist(csv: string): string | undefined {
  const m = /^"([^"]+)","(\d+)"/m.exec(csv.trim());
  return m?.[1];
}

const exited = (c: ChildProcess) => c.exitCode !== null || c.signalCode !== null;
const wait = (c: ChildProcess, ms: number) =>
  new Promise<boolean>((resolve) => {
    if (exited(c)) return resolve(true);
    const t = setTimeout(() => resolve(false), ms);
    c.once('exit', () => {
      clearTimeout(t);
      resolve(true);
    });
  });

function signalGroup(pgid: number, signal: NodeJS.Signals): void {
  try {
    process.kill(-pgid, signal);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ESRCH') throw err;
  }
}

/**
 * Stops `child` and its descendants: polite first, forced after `graceMs`. Elsewhere than on
 * Windows the group gets SIGKILL even when the leader exited at once, so a grandchild that
 * ignored SIGTERM does not outlive it.
 */
export async function killTree(child: ChildProcess, graceMs: number, opts: { platform?: Platform; log?: Pick<Logger, 'warn'> } = {}): Promise<void> {
  const pid = child.pid;
  if (pid === undefined) return;
  if ((opts.platform ?? process.platform) === 'win32') {
    if (exited(child)) return;
    // The tree as it is now (once the command exits, taskkill /T can no longer find its
    // children), taken while taskkill asks it to close.
    const snapshot = windowsTree(pid);
    const { polite, force } = windowsKillCommands(pid);
    if (!(await taskkill(polite, opts.log))) await Promise.all([...(await snapshot)].map((p) => exec('taskkill', ['/PID', String(p)]).catch(() => undefined)));
    const known = await snapshot;
    if ((await wait(child, graceMs)) && known.size <= 1) return;
    if (!(await taskkill(force, opts.log)) || known.size > 1) {
      // The command (our child: this always reaches it) and what it had started, at once; then
      // whatever was started since the snapshot.
      terminate(known);
      const late = await windowsTree(pid);
      terminate(new Set([...late].filter((p) => !known.has(p))));
    }
    await wait(child, 5000);
    return;
  }
  signalGroup(pid, 'SIGTERM');
  await wait(child, graceMs);
  signalGroup(pid, 'SIGKILL');
  await wait(child, 5000);
}

/** Runs a taskkill command line; false (logged with its output) when it fails. */
async function taskkill([cmd, args]: [string, string[]], log: Pick<Logger, 'warn'> | undefined): Promise<boolean> {
  try {
    await exec(cmd, args);
    return true;
  } catch (err) {
    const e = err as { code?: unknown; stdout?: string; stderr?: string; message: string };
    const output = `${e.stdout ?? ''}${e.stderr ?? ''}`.trim() || e.message;
    // Exit 128: the process is already gone, nothing to stop.
    if (e.code !== 128) log?.warn({ command: [cmd, ...args].join(' '), exitCode: e.code, output }, 'taskkill failed: stopping the tree by parent process ids');
    return false;
  }
}

/** Terminates each pid (TerminateProcess on Windows); one already gone is skipped. */
function terminate(pids: Set<number>): void {
  for (const p of pids) {
    try {
      process.kill(p, 'SIGKILL');
    } catch {
      // gone already
    }
  }
}

/** Decodes a Windows tool's output: UTF-16LE (wmic, when not on a console) or UTF-8. */
export function decodeWindowsOutput(b: Buffer): string {
  const utf16 = (b[0] === 0xff && b[1] === 0xfe) || (b.length > 1 && b[1] === 0 && b[0] !== 0);
  return (utf16 ? b.toString('utf16le') : b.toString('utf8')).replace(/^\uFEFF/, '');
}

/**
 * Parses a process list of parent and process ids: `wmic process get ParentProcessId,ProcessId`
 * (a header, then columns) or lines of `parent pid` (PowerShell). Returns pid → parent pid.
 */
export function parseProcessParents(text: string): Map<number, number> {
  const parents = new Map<number, number>();
  const lines = text.split(/\r?\n/).map((l) => l.trim()).filter(Boolean);
  let order: [number, number] = [0, 1];
  if (lines[0] && /[a-z]/i.test(lines[0])) {
    // The columns' order from where their names stand (Wine's wmic runs the names together).
    const head = lines.shift()!.toLowerCase();
    const parentAt = head.indexOf('parentprocessid');
    const pidAt = head.replace('parentprocessid', ' '.repeat(15)).indexOf('processid');
    if (parentAt < 0 || pidAt < 0) return parents;
    order = parentAt < pidAt ? [0, 1] : [1, 0];
  }
  for (const l of lines) {
    const cols = l.split(/\s+/).map(Number);
    const parent = cols[order[0]];
    const pid = cols[order[1]];
    if (Number.isInteger(parent) && Number.isInteger(pid) && pid! > 0) parents.set(pid!, parent!);
  }
  return parents;
}

/** `pid` and its descendants, from the parent ids of every process. */
export function descendants(pid: number, parents: Map<number, number>): Set<number> {
  const tree = new Set([pid]);
  for (let grew = true; grew; ) {
    grew = false;
    for (const [p, parent] of parents) {
      if (!tree.has(p) && tree.has(parent)) {
        tree.add(p);
        grew = true;
      }
    }
  }
  return tree;
}

/** The command lines that list every process with its parent, tried in order. */
export const windowsProcessListCommands: [string, string[]][] = [
  ['wmic', ['process', 'get', 'ParentProcessId,ProcessId']],
  ['powershell.exe', ['-NoProfile', '-NonInteractive', '-Command', 'Get-CimInstance Win32_Process | ForEach-Object { "$($_.ParentProcessId) $($_.ProcessId)" }']],
];

/** `pid` and its descendants on Windows (just `pid` when no process list can be had). */
async function windowsTree(pid: number): Promise<Set<number>> {
  for (const [cmd, args] of windowsProcessListCommands) {
    const out = await execRaw(cmd, args, { ...TOOL_OPTIONS, encoding: 'buffer' }).then(
      (r) => decodeWindowsOutput(r.stdout),
      () => '',
    );
    const parents = parseProcessParents(out);
    if (parents.size) return descendants(pid, parents);
  }
  return new Set([pid]);
}

/** The image a pid runs, as tasklist says (undefined when it cannot tell, as under Wine). */
async function windowsImage(pid: number): Promise<string | undefined> {
  const [cmd, args] = windowsProcessQuery(pid);
  return parseTasklist((await exec(cmd, args).catch(() => ({ stdout: '' }))).stdout);
}

/** What a pid file records about a running command. */
export interface PidRecord {
  pid: number;
  platform: Platform;
  /** Linux: the process start time from /proc/<pid>/stat (clock ticks since boot). */
  startTicks?: string;
  /** Windows: the image name, e.g. `resize.exe`. */
  image?: string;
}

/**
 * The image name Windows shows for a command spawned as configured: the shell (`cmd.exe`, or
 * `%ComSpec%`) when it runs through one, else the file, `.exe` added when it has no extension.
 */
export function expectedImage(command: { file: string; shell?: boolean }, env: NodeJS.ProcessEnv = process.env): string {
  if (command.shell) return path.win32.basename(env.ComSpec ?? env.comspec ?? 'cmd.exe');
  const base = path.win32.basename(command.file);
  return path.win32.extname(base) ? base : `${base}.exe`;
}

/**
 * Identifies a process just spawned, for a pid file. On Windows, the image that the pid really
 * runs (`tasklist`), or, where tasklist cannot tell, the one expected from the configuration.
 */
export async function describeProcess(pid: number, command: { file: string; shell?: boolean }, platform: Platform = process.platform): Promise<PidRecord> {
  if (platform === 'linux') return { pid, platform, ...(await linuxStartTicks(pid).then((s) => (s ? { startTicks: s } : {}))) };
  if (platform === 'win32') return { pid, platform, image: (await windowsImage(pid)) ?? expectedImage(command) };
  return { pid, platform };
}

async function linuxStartTicks(pid: number): Promise<string | undefined> {
  const stat = await readFile(`/proc/${pid}/stat`, 'utf8').catch(() => undefined);
  if (!stat) return undefined;
  // Field 22, counted after the command name (which may hold spaces and parentheses).
  return stat.slice(stat.lastIndexOf(')') + 2).split(' ')[19];
}

/**
 * Stops a tree left running by an earlier agent process, if the pid still runs that command.
 * Returns whether something was killed.
 */
export async function killLeftover(rec: PidRecord, log?: Pick<Logger, 'warn'>): Promise<boolean> {
  if (rec.platform === 'win32') {
    const image = await windowsImage(rec.pid);
    if (!image || !rec.image || image.toLowerCase() !== rec.image.toLowerCase()) return false;
    const known = await windowsTree(rec.pid);
    if (!(await taskkill(windowsKillCommands(rec.pid).force, log))) terminate(known);
    return true;
  }
  if (rec.platform === 'linux') {
    const now = await linuxStartTicks(rec.pid);
    if (!now || now !== rec.startTicks) return false;
  } else {
    return false; // no safe way to tell a reused pid here
  }
  signalGroup(rec.pid, 'SIGKILL');
  return true;
}
