/**
 * `npm start` runs its script through a shell (`sh -c` on Linux and macOS, `cmd.exe /d /s /c` on
 * Windows) and forwards SIGINT and SIGTERM to that shell, which does not pass them on: a signal to
 * npm alone (what Docker, pm2, service wrappers and systemd with `KillMode=process` send) left
 * the coordinator and its embedded PostgreSQL running (after SIGTERM, orphaned; after SIGINT, with
 * npm waiting for it forever).
 *
 * Two parts. The script is `exec node …`: on POSIX the shell becomes the coordinator, so npm's
 * forwarded signal reaches it (on Windows `exec.cmd` in the package root runs the rest of the
 * line). And where a process still stands between npm and the coordinator (cmd.exe on Windows,
 * where "signals" to npm are TerminateProcess and nothing is forwarded), a coordinator started by
 * an npm script watches its parent, and npm above a shell parent, and stops as on SIGTERM when
 * either is gone: within a second. Started any other way (`node server/cli.ts serve`, a service
 * manager) it watches nothing: signals reach it directly.
 */
import { execFile } from 'node:child_process';
import { readFile } from 'node:fs/promises';
import { promisify } from 'node:util';
import { alive } from './lib/process.js';
import type { Logger } from './log.js';

const run = promisify(execFile);

/** How often the launchers are looked at. */
const WATCH_MS = 1000;

export interface LauncherWatch {
  /** Stops watching. */
  stop(): void;
}

/**
 * When this process was started by an npm script, calls `onGone` once the shell or npm above it
 * has ended. Returns undefined when there is nothing to watch.
 */
export function watchLauncher(log: Logger, onGone: (why: string) => void, env: NodeJS.ProcessEnv = process.env): LauncherWatch | undefined {
  if (!env.npm_lifecycle_event) return undefined;
  const parent = process.ppid;
  const watched = new Map<number, string>([[parent, 'the process that started it'] as const]);
  let timer: NodeJS.Timeout | undefined;
  let stopped = false;
  void processInfo(parent).then((p) => {
    // A shell between npm and this process: npm is the one to outlive.
    if (p && SHELLS.test(p.name) && p.ppid > 1 && !stopped) watched.set(p.ppid, 'npm');
    log.debug({ watched: Object.fromEntries(watched) }, 'started by npm: stopping when it ends');
  });
  const check = () => {
    // A parent gone on Linux and macOS makes this process a child of another (init, a subreaper).
    if (process.ppid !== parent) return gone(`its parent (pid ${parent}, ${watched.get(parent)}) ended`);
    for (const [pid, what] of watched) if (!alive(pid)) return gone(`${what} (pid ${pid}) ended`);
    timer = setTimeout(check, WATCH_MS);
    timer.unref();
  };
  const gone = (why: string) => {
    if (stopped) return;
    stopped = true;
    onGone(why);
  };
  timer = setTimeout(check, WATCH_MS);
  timer.unref();
  return {
    stop: () => {
      stopped = true;
      clearTimeout(timer);
    },
  };
}

/** What npm runs its scripts with. */
const SHELLS = /^(sh|dash|bash|zsh|ash|cmd|cmd\.exe)$/i;

/** The name and parent of `pid`, or undefined when they cannot be found out here. */
async function processInfo(pid: number): Promise<{ name: string; ppid: number } | undefined> {
  try {
    if (process.platform === 'linux') {
      // /proc/<pid>/stat: "pid (comm) state ppid …"; comm may hold spaces and parentheses.
      const stat = await readFile(`/proc/${pid}/stat`, 'utf8');
      const name = stat.slice(stat.indexOf('(') + 1, stat.lastIndexOf(')'));
      return { name, ppid: Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]) };
    }
    const opts = { timeout: 10_000, windowsHide: true };
    if (process.platform === 'win32') return await windowsProcessInfo(pid, opts);
    const { stdout } = await run('ps', ['-o', 'comm=,ppid=', '-p', String(pid)], opts);
    const m = /^(.*\S)\s+(\d+)$/.exec(stdout.trim());
    return m ? { name: m[1]!.split('/').pop()!, ppid: Number(m[2]) } : undefined;
  } catch {
    return undefined;
  }
}

/**
 * PowerShell where it is (every Windows 10 and 11); else wmic's process table (older Windows,
 * Wine: its wmic has no `where`), which it writes in UTF-16 with the columns in name order.
 */
async function windowsProcessInfo(pid: number, opts: { timeout: number; windowsHide: boolean }): Promise<{ name: string; ppid: number } | undefined> {
  try {
    const { stdout } = await run(
      'powershell.exe',
      ['-NoProfile', '-NonInteractive', '-Command', `$p = Get-CimInstance Win32_Process -Filter 'ProcessId=${pid}'; "$($p.ParentProcessId) $($p.Name)"`],
      opts,
    );
    const m = /^(\d+) (.+)$/.exec(stdout.trim());
    if (m && Number(m[1])) return { name: m[2]!.trim(), ppid: Number(m[1]) };
  } catch {
    // no PowerShell here: wmic below
  }
  const { stdout } = await run('wmic', ['process', 'get', 'Name,ParentProcessId,ProcessId'], { ...opts, encoding: 'buffer', maxBuffer: 16 * 1024 * 1024 });
  const text = stdout.includes(0) ? stdout.toString('utf16le') : stdout.toString('utf8');
  for (const line of text.replace(/^\uFEFF/, '').split(/\r?\n/)) {
    const m = /^(.*?)\s+(\d+)\s+(\d+)\s*$/.exec(line);
    if (m && Number(m[3]) === pid) return { name: m[1]!.trim(), ppid: Number(m[2]) };
  }
  return undefined;
}
