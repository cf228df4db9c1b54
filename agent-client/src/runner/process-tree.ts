/**
 * Stopping a command and everything it started. All platform differences of the runner live
 * here, so the Windows branches can be unit-tested on Linux through the commands they build.
 *
 * - Elsewhere: the command runs as the leader of a new process group (`detached`), so
 *   `kill(-pid)` reaches its children and grandchildren: SIGTERM first, SIGKILL after the grace.
 * - Windows: `taskkill /PID <pid> /T` asks the tree to close, `taskkill /PID <pid> /T /F` forces it.
 *
 * The runner records each running command in a pid file; at the next start, trees left behind
 * by an agent that was killed outright are stopped (after checking the process is still that
 * command, so a reused pid is never killed).
 */
import { execFile, type ChildProcess, type SpawnOptions } from 'node:child_process';
import { readFile } from 'node:fs/promises';
import path from 'node:path';
import { promisify } from 'node:util';

const exec = promisify(execFile);

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
export async function killTree(child: ChildProcess, graceMs: number, platform: Platform = process.platform): Promise<void> {
  const pid = child.pid;
  if (pid === undefined) return;
  if (platform === 'win32') {
    if (exited(child)) return;
    const { polite, force } = windowsKillCommands(pid);
    await exec(polite[0], polite[1]).catch(() => undefined);
    if (await wait(child, graceMs)) return;
    await exec(force[0], force[1]).catch(() => undefined);
    await wait(child, 5000);
    return;
  }
  signalGroup(pid, 'SIGTERM');
  await wait(child, graceMs);
  signalGroup(pid, 'SIGKILL');
  await wait(child, 5000);
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

/** Identifies a process just spawned, for a pid file. */
export async function describeProcess(pid: number, command: string, platform: Platform = process.platform): Promise<PidRecord> {
  if (platform === 'linux') return { pid, platform, ...(await linuxStartTicks(pid).then((s) => (s ? { startTicks: s } : {}))) };
  if (platform === 'win32') return { pid, platform, image: path.win32.basename(command) };
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
export async function killLeftover(rec: PidRecord): Promise<boolean> {
  if (rec.platform === 'win32') {
    const [cmd, args] = windowsProcessQuery(rec.pid);
    const image = parseTasklist((await exec(cmd, args).catch(() => ({ stdout: '' }))).stdout);
    if (!image || !rec.image || image.toLowerCase() !== rec.image.toLowerCase()) return false;
    const { force } = windowsKillCommands(rec.pid);
    await exec(force[0], force[1]).catch(() => undefined);
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
