/**
 * Stopping a command and everything it started. All platform differences of the runner live
 * here, so the Windows branches can be unit-tested on Linux through the commands they build.
 *
 * - Elsewhere: the command runs as the leader of a new process group (`detached`), so
 *   `kill(-pid)` reaches its children and grandchildren: SIGTERM first, SIGKILL after the grace.
 * - Windows: `taskkill /PID <pid> /T` asks the tree to close, `taskkill /PID <pid> /T /F` forces it.
 *   Where taskkill refuses `/T` (Wine's does) or fails otherwise, the failure is logged and the
 *   runner stops the tree itself: the descendants found by parent process id (`wmic`, else
 *   PowerShell's `Get-CimInstance`), each asked to close, then terminated. A parent process id
 *   may name a process that has exited and whose id was reused (Microsoft says so of
 *   `Win32_Process.ParentProcessId`): where the list gives creation times, a "child" created
 *   before its parent is not taken for one. Once a command has exited, what it left running is
 *   found the same way (`stopLeftBehind`), and only with creation times: after the command's
 *   (recorded, or estimated from its spawn) and before its exit (at the next start: before
 *   the earlier agent was last alive).
 *
 * The runner records each running command in a pid file; at the next start, trees left behind
 * by an agent that was killed outright are stopped (`killLeftover`), after checking that the
 * pid still is that command (Linux: its start time and the boot; Windows: its creation time,
 * else its image name), so that a reused pid is never killed; where the command itself has
 * exited, what it left is found by its process group (Linux) or parent ids (Windows).
 */
import { execFile, type ChildProcess, type SpawnOptions } from 'node:child_process';
import { readdir, readFile } from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from 'pino';

/**
 * The Windows tools this file runs (taskkill, tasklist, wmic, PowerShell), each given at most
 * 10 s: a tool that hangs (WMI starting on a loaded machine, say) must not leave a
 * command running past its timeout.
 */
const TOOL_OPTIONS = { timeout: 10_000, windowsHide: true };

/**
 * Runs a tool with its stdin closed at once, as promisified `execFile` does otherwise (its error
 * carries `stdout` and `stderr`). execFile leaves the child a pipe for stdin, open until the child
 * exits (it takes no `stdio` option), and powershell.exe run that way does not exit until its
 * stdin ends (nodejs/node#25645): each process list on a Windows without wmic (11 24H2 on) would
 * have waited out the 10 s, and then given nothing.
 */
function tool(cmd: string, args: string[]): Promise<{ stdout: string; stderr: string }>;
function tool(cmd: string, args: string[], encoding: 'buffer'): Promise<{ stdout: Buffer; stderr: Buffer }>;
function tool(cmd: string, args: string[], encoding: 'buffer' | 'utf8' = 'utf8'): Promise<{ stdout: string | Buffer; stderr: string | Buffer }> {
  return new Promise((resolve, reject) => {
    const child = execFile(cmd, args, { ...TOOL_OPTIONS, encoding }, (err, stdout, stderr) =>
      err ? reject(Object.assign(err, { stdout, stderr })) : resolve({ stdout, stderr }),
    );
    // (A tool that could not start has its pipes destroyed: ending one then is no error of ours.)
    child.stdin?.on('error', () => undefined).end();
  });
}
const exec = (cmd: string, args: string[]) => tool(cmd, args);

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

/** A Windows stop that takes this much longer than its grace is logged with where the time went. */
const SLOW_STOP_MS = 5_000;

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
    // Where the time went, logged when the stop took long (a process list that hung, say).
    const started = performance.now();
    const lists: number[] = [];
    const timedTree = async (...args: Parameters<typeof windowsTree>) => {
      const t = performance.now();
      try {
        return await windowsTree(...args);
      } finally {
        lists.push(Math.round(performance.now() - t));
      }
    };
    const slow = () => {
      const ms = Math.round(performance.now() - started);
      if (ms > graceMs + SLOW_STOP_MS) opts.log?.warn({ pid, ms, graceMs, processListsMs: lists }, 'stopping the tree took long');
    };
    // The tree as it is now (once the command exits, taskkill /T can no longer find its
    // children), taken while taskkill asks it to close.
    const snapshot = timedTree(pid);
    const { polite, force } = windowsKillCommands(pid);
    if (!(await taskkill(polite, opts.log))) await Promise.all([...(await snapshot).pids].map((p) => exec('taskkill', ['/PID', String(p)]).catch(() => undefined)));
    const { pids: known, created } = await snapshot;
    if ((await wait(child, graceMs)) && known.size <= 1) return slow();
    if (!(await taskkill(force, opts.log)) || known.size > 1) {
      // The command (our child: this always reaches it) and what it had started, at once; then
      // whatever was started since the snapshot (the creation times of the snapshot tell, when
      // the command has exited meanwhile, its children from those of a process given its id).
      terminate(known);
      const late = await timedTree(pid, created);
      terminate(new Set([...late.pids].filter((p) => !known.has(p))));
    }
    await wait(child, 5000);
    return slow();
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

/** Terminates each pid (TerminateProcess on Windows); one already gone is skipped, and never this process. */
function terminate(pids: Iterable<number>): void {
  for (const p of pids) {
    if (p === process.pid) continue;
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

/** 100-ns intervals from 1601 (Windows' FILETIME epoch) to 1970, in microseconds. */
const FILETIME_1970_US = 11_644_473_600_000_000n;

/**
 * A Windows creation time as microseconds since 1970 (UTC): WMI's `CIM_DATETIME`
 * (`yyyymmddHHMMSS.mmmmmm+UUU`, local time and its offset in minutes, as wmic prints
 * `CreationDate`) or a FILETIME (100-ns intervals since 1601, PowerShell's `ToFileTimeUtc()`).
 * Both come from the same kernel value, so one process gives the same number either way.
 */
export function parseWindowsTime(s: string): number | undefined {
  const cim = /^(\d{4})(\d{2})(\d{2})(\d{2})(\d{2})(\d{2})\.(\d{6})([+-])(\d{3})$/.exec(s);
  if (cim) {
    const [y, mo, d, h, mi, sec, us, sign, offset] = cim.slice(1);
    const local = Date.UTC(Number(y), Number(mo) - 1, Number(d), Number(h), Number(mi), Number(sec));
    return (local - (sign === '-' ? -1 : 1) * Number(offset) * 60_000) * 1000 + Number(us);
  }
  // A FILETIME of these centuries has 17 or 18 digits (above 2^53: read as a bigint).
  if (/^\d{17,18}$/.test(s)) return Number(BigInt(s) / 10n - FILETIME_1970_US);
  return undefined;
}

/**
 * Whether two creation times are one process's: equal within a millisecond (WMI's datetime and
 * a FILETIME may round the same instant differently; no process starts, ends and has its id
 * given to another within a millisecond).
 */
const sameProcess = (a: number, b: number) => Math.abs(a - b) < 1000;

/** A process list: each pid's parent pid and, where the tool gives it, its creation time (µs since 1970). */
export interface ProcessList {
  parents: Map<number, number>;
  created: Map<number, number>;
}

/**
 * Parses a process list: `wmic process get [CreationDate,]ParentProcessId,ProcessId` (a header,
 * then columns, which wmic prints in alphabetical order whatever order they were asked in) or
 * lines of `parent pid [creation FILETIME]` (PowerShell). A row without a creation time (wmic
 * leaves it empty for the System process; Wine's `Win32_Process` has none) is kept without one.
 */
export function parseProcessList(text: string): ProcessList {
  const list: ProcessList = { parents: new Map(), created: new Map() };
  const lines = text.split(/\r?\n/).map((l) => l.trim()).filter(Boolean);
  let order: [number, number] = [0, 1];
  if (lines[0] && /[a-z]/i.test(lines[0])) {
    // The columns' order from where their names stand (Wine's wmic runs the names together).
    const head = lines.shift()!.toLowerCase().replace('creationdate', '');
    const parentAt = head.indexOf('parentprocessid');
    const pidAt = head.replace('parentprocessid', ' '.repeat(15)).indexOf('processid');
    if (parentAt < 0 || pidAt < 0) return list;
    order = parentAt < pidAt ? [0, 1] : [1, 0];
  }
  for (const l of lines) {
    const tokens = l.split(/\s+/);
    // The creation time is told by its shape: a CIM datetime, or a third number (a FILETIME).
    const dateAt = tokens.findIndex((t, i) => t.includes('.') || (i === 2 && /^\d{17,18}$/.test(t)));
    const created = dateAt < 0 ? undefined : parseWindowsTime(tokens[dateAt]!);
    const ids = tokens.filter((_, i) => i !== dateAt).map(Number);
    const parent = ids[order[0]];
    const pid = ids[order[1]];
    if (!Number.isInteger(parent) || !Number.isInteger(pid) || pid! <= 0) continue;
    list.parents.set(pid!, parent!);
    if (created !== undefined) list.created.set(pid!, created);
  }
  return list;
}

/** The parent ids of a process list (see `parseProcessList`): pid → parent pid. */
export function parseProcessParents(text: string): Map<number, number> {
  return parseProcessList(text).parents;
}

/**
 * `pid` and its descendants, from the parent ids of every process. Parent ids can be stale: a
 * process keeps its parent's id after the parent exits, and Windows gives that id to new
 * processes. So, where creation times are known (`created`), a process created before its
 * claimed parent is not its child.
 *
 * - `known`: creation times recorded for members of the tree that may have exited since (the
 *   command, once it has ended): their children are looked for too, and where the list shows
 *   their pid held by a process created at another time, that process is not them, and
 *   only children created before it are theirs.
 * - `strict`: leave out any process whose creation time, or its parent's, is unknown (for a
 *   command that has exited, whose id may have been reused: a parent id alone cannot tell).
 * - `exitedBy`: a time by which `pid` had exited: a process created later is not its child. It
 *   covers what the check on the pid's holder cannot see: the pid given to another process,
 *   which started one of its own and exited in turn. (Only `pid`: a descendant that still runs
 *   may start more.)
 */
export function descendants(
  pid: number,
  parents: Map<number, number>,
  created: Map<number, number> = new Map(),
  opts: { known?: Map<number, number>; strict?: boolean; exitedBy?: number } = {},
): Set<number> {
  const known = opts.known ?? new Map<number, number>();
  const tree = new Set([pid, ...known.keys()]);
  const createdOf = (p: number) => known.get(p) ?? created.get(p);
  for (let grew = true; grew; ) {
    grew = false;
    for (const [p, parent] of parents) {
      if (tree.has(p) || !tree.has(parent)) continue;
      const mine = created.get(p);
      const theirs = createdOf(parent);
      if (mine === undefined || theirs === undefined) {
        if (opts.strict) continue;
      } else if (mine < theirs) {
        continue; // a stale parent id: that "parent" was created after this process
      }
      // Created after the command had exited: a child of another process given its pid since.
      if (parent === pid && opts.exitedBy !== undefined && mine !== undefined && mine > opts.exitedBy) continue;
      // The parent's pid now held by another process (created then): only children from before it are the parent's.
      const holder = known.has(parent) ? created.get(parent) : undefined;
      if (holder !== undefined && !sameProcess(holder, known.get(parent)!) && (mine === undefined || mine >= holder)) continue;
      tree.add(p);
      grew = true;
    }
  }
  return tree;
}

/**
 * The command lines that list every process with its parent, tried in order: with creation
 * times (wmic, else PowerShell, for Windows without wmic); then without (Wine's wmic, whose
 * `Win32_Process` has no `CreationDate`).
 */
export const windowsProcessListCommands: [string, string[]][] = [
  ['wmic', ['process', 'get', 'CreationDate,ParentProcessId,ProcessId']],
  [
    'powershell.exe',
    ['-NoProfile', '-NonInteractive', '-Command', 'Get-CimInstance Win32_Process | ForEach-Object { "$($_.ParentProcessId) $($_.ProcessId) $(if ($_.CreationDate) { $_.CreationDate.ToFileTimeUtc() })" }'],
  ],
  ['wmic', ['process', 'get', 'ParentProcessId,ProcessId']],
];

/** Every process with its parent (and creation time, where a tool gives it); undefined when no list can be had. */
async function windowsProcessList(): Promise<ProcessList | undefined> {
  for (const [cmd, args] of windowsProcessListCommands) {
    const out = await tool(cmd, args, 'buffer').then(
      (r) => decodeWindowsOutput(r.stdout),
      () => '',
    );
    const list = parseProcessList(out);
    if (list.parents.size) return list;
  }
  return undefined;
}

/**
 * `pid` and its descendants on Windows (just `pid` when no process list can be had), with the
 * creation times of those the list dated. `known`: creation times from an earlier snapshot.
 */
async function windowsTree(pid: number, known?: Map<number, number>): Promise<{ pids: Set<number>; created: Map<number, number> }> {
  const list = await windowsProcessList();
  if (!list) return { pids: new Set([pid]), created: new Map() };
  const pids = descendants(pid, list.parents, list.created, known ? { known } : {});
  const created = new Map([...pids].flatMap((p) => (known?.has(p) ? [[p, known.get(p)!] as const] : list.created.has(p) ? [[p, list.created.get(p)!] as const] : [])));
  return { pids, created };
}

/** The image a pid runs, as tasklist says (undefined when it cannot tell, as under Wine). */
async function windowsImage(pid: number): Promise<string | undefined> {
  const [cmd, args] = windowsProcessQuery(pid);
  return parseTasklist((await exec(cmd, args).catch(() => ({ stdout: '' }))).stdout);
}

/** The command lines that tell when one process was created, tried in order (wmic, PowerShell). */
export function windowsCreationQueries(pid: number): [string, string[]][] {
  if (!Number.isInteger(pid) || pid <= 0) throw new Error(`not a pid: ${pid}`);
  return [
    ['wmic', ['process', 'where', `ProcessId=${pid}`, 'get', 'CreationDate']],
    ['powershell.exe', ['-NoProfile', '-NonInteractive', '-Command', `(Get-CimInstance Win32_Process -Filter 'ProcessId=${pid}').CreationDate.ToFileTimeUtc()`]],
  ];
}

/** The first creation time (CIM datetime or FILETIME) in a tool's answer, if any. */
export function parseCreationTime(text: string): number | undefined {
  for (const t of text.split(/\s+/)) {
    const us = parseWindowsTime(t);
    if (us !== undefined) return us;
  }
  return undefined;
}

/** When a pid's process was created (µs since 1970), or undefined when no tool tells (Wine's do not). */
async function windowsCreated(pid: number): Promise<number | undefined> {
  for (const [cmd, args] of windowsCreationQueries(pid)) {
    const out = await tool(cmd, args, 'buffer').then(
      (r) => decodeWindowsOutput(r.stdout),
      () => '',
    );
    const us = parseCreationTime(out);
    if (us !== undefined) return us;
  }
  return undefined;
}

/** What a pid file records about a running command. */
export interface PidRecord {
  pid: number;
  platform: Platform;
  /** Linux: the process start time from /proc/<pid>/stat (clock ticks since boot). */
  startTicks?: string;
  /** Linux: the boot it started in (/proc/sys/kernel/random/boot_id): start ticks count from it. */
  bootId?: string;
  /** Windows: the image name, e.g. `resize.exe`. */
  image?: string;
  /**
   * Windows: the creation time, µs since 1970 (UTC), where wmic or PowerShell could tell it;
   * else (the command gone before they answered) a lower bound from when it was spawned, and
   * `createdEstimate` is set.
   */
  created?: number;
  /** `created` is an estimate (earlier than the real time): it tells no pid's reuse. */
  createdEstimate?: boolean;
}

/** How much earlier than the spawn a `createdEstimate` is set (the clock Date.now() reads may lag the kernel's). */
export const CREATED_ESTIMATE_MARGIN_US = 1_000_000;

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
 * Identifies a process just spawned, for a pid file. Linux: its start time and the boot. Windows:
 * the image that the pid really runs (`tasklist`), or, where tasklist cannot tell, the one
 * expected from the configuration; and its creation time where a tool tells it, else, given
 * `spawnedAt` (µs since 1970, taken just before the spawn), that time less a margin, marked as
 * an estimate: a lower bound still tells the command's children from older processes.
 */
export async function describeProcess(
  pid: number,
  command: { file: string; shell?: boolean },
  platform: Platform = process.platform,
  opts: { spawnedAt?: number } = {},
): Promise<PidRecord> {
  if (platform === 'linux') {
    const [startTicks, bootId] = await Promise.all([linuxStartTicks(pid), linuxBootId()]);
    return { pid, platform, ...(startTicks ? { startTicks } : {}), ...(bootId ? { bootId } : {}) };
  }
  if (platform === 'win32') {
    const [image, created] = await Promise.all([windowsImage(pid), windowsCreated(pid)]);
    const when =
      created !== undefined ? { created } : opts.spawnedAt !== undefined ? { created: opts.spawnedAt - CREATED_ESTIMATE_MARGIN_US, createdEstimate: true } : {};
    return { pid, platform, image: image ?? expectedImage(command), ...when };
  }
  return { pid, platform };
}

/** The fields of /proc/<pid>/stat after the command name (which may hold spaces and parentheses): field 3 is index 0. */
async function linuxStat(pid: number | string): Promise<string[] | undefined> {
  const stat = await readFile(`/proc/${pid}/stat`, 'utf8').catch(() => undefined);
  return stat?.slice(stat.lastIndexOf(')') + 2).split(' ');
}

async function linuxStartTicks(pid: number): Promise<string | undefined> {
  return (await linuxStat(pid))?.[19]; // field 22, starttime
}

async function linuxBootId(): Promise<string | undefined> {
  return (await readFile('/proc/sys/kernel/random/boot_id', 'utf8').catch(() => undefined))?.trim() || undefined;
}

/**
 * The live processes of the group and session `pgid` (a detached command makes both with its
 * own pid), the command having exited. Undefined when the group cannot be the command's: a
 * member started before `startTicks` (only the command's descendants are in its session), or
 * one has the pid `pgid` itself (a new process given the pid since the list of /proc began), or
 * this very process is in it.
 */
async function linuxGroupMembers(pgid: number, startTicks: bigint): Promise<number[] | undefined> {
  const members: number[] = [];
  for (const name of await readdir('/proc').catch(() => [] as string[])) {
    if (!/^\d+$/.test(name)) continue;
    const f = await linuxStat(name);
    // f[0] state, f[2] process group, f[3] session, f[19] start time
    if (!f?.[19] || Number(f[2]) !== pgid || Number(f[3]) !== pgid || f[0] === 'Z') continue;
    if (BigInt(f[19]) < startTicks || Number(name) === pgid || Number(name) === process.pid) return undefined;
    members.push(Number(name));
  }
  return members;
}

/**
 * Stops what a command left running when it exited (a grandchild started in the background),
 * as a job's processes end with the job. For the runner to call once the command has exited,
 * with the command's pid record (`describeProcess`). Elsewhere than on Windows: SIGKILL to its
 * process group. On Windows: its descendants by parent process id (they keep its id after it
 * exits), terminated; only those whose creation times say they are (`descendants`, strict:
 * the command's pid may already be another process's); nothing when its creation time was not
 * recorded (Wine's tools give none). `exitedBy` (µs since 1970): when the command had exited
 * at the latest; a process created after it is not its child (its pid reused, `descendants`).
 * A child that exited before its own children is no link: those are not found. Returns the
 * pids terminated (none elsewhere than on Windows).
 */
export async function stopLeftBehind(rec: PidRecord, opts: { platform?: Platform; log?: Pick<Logger, 'warn'>; exitedBy?: number } = {}): Promise<Set<number>> {
  const stopped = new Set<number>();
  if ((opts.platform ?? process.platform) !== 'win32') {
    signalGroup(rec.pid, 'SIGKILL');
    return stopped;
  }
  if (rec.created === undefined) return stopped;
  const known = new Map([[rec.pid, rec.created]]);
  // A few rounds: a process stopped may have started another between the list and its end.
  for (let round = 0; round < 3; round++) {
    const list = await windowsProcessList();
    if (!list) break;
    const fresh = [...descendants(rec.pid, list.parents, list.created, { known, strict: true, ...(opts.exitedBy === undefined ? {} : { exitedBy: opts.exitedBy }) })].filter(
      (p) => !known.has(p),
    );
    if (!fresh.length) break;
    terminate(fresh);
    for (const p of fresh) {
      stopped.add(p);
      known.set(p, list.created.get(p)!);
    }
  }
  if (stopped.size) opts.log?.warn({ pid: rec.pid, left: [...stopped] }, 'stopped processes the command left running');
  return stopped;
}

/**
 * Stops a tree left running by an earlier agent process, if the pid still runs that command,
 * or what the command left running if it has exited. `exitedBy` (Windows, µs since 1970): a
 * time by which the command had exited (the earlier agent's last sign of life: Windows ends
 * its commands with it), for `stopLeftBehind`. Returns whether something was killed.
 */
export async function killLeftover(rec: PidRecord, log?: Pick<Logger, 'warn'>, opts: { exitedBy?: number } = {}): Promise<boolean> {
  // A pid record of this very process (a restarted agent given the pid of a dead command).
  if (rec.pid === process.pid) return false;
  if (rec.platform === 'win32') return killWindowsLeftover(rec, log, opts.exitedBy);
  if (rec.platform !== 'linux') return false; // no safe way to tell a reused pid here
  if (!rec.startTicks) return false;
  const bootId = await linuxBootId();
  // Another boot: all its processes are gone, and start ticks count from that boot.
  if (rec.bootId !== undefined && rec.bootId !== bootId) return false;
  const now = await linuxStartTicks(rec.pid);
  if (now === rec.startTicks) {
    signalGroup(rec.pid, 'SIGKILL');
    return true;
  }
  // The pid runs another process: Linux gives a pid to no new process while any process still
  // has it as its group (or session) id, so the command's group was empty when this one
  // started, and it is not looked for (this process's own group would be found instead).
  if (now !== undefined) return false;
  // The command has exited; its group lives on while a member does (a grandchild in the
  // background). Its members have the recorded pid as group and session, and started no
  // earlier than the command. Another group with that id could exist only if the pid
  // went round (pid_max) since the command's group emptied, and was taken by a new session
  // leader that has exited in turn: not told apart here. Needs the boot the ticks count from.
  if (rec.bootId === undefined) return false;
  const members = await linuxGroupMembers(rec.pid, BigInt(rec.startTicks));
  if (!members?.length) return false;
  signalGroup(rec.pid, 'SIGKILL');
  return true;
}

/**
 * What a Windows process list says of a pid record at the next start: the command still runs
 * (`running`: its pid created at the recorded time), has exited (`exited`: its pid gone, or held
 * by a process created at another time), or cannot be told by the times (`unknown`: none
 * recorded, or only an estimate, a lower bound, which the process now holding the pid was
 * created after: the command itself, or a process given its pid since).
 */
export function windowsLeftoverState(rec: PidRecord, list: ProcessList): 'running' | 'exited' | 'unknown' {
  if (rec.created === undefined) return 'unknown';
  const now = list.created.get(rec.pid);
  if (now === undefined) return 'exited';
  if (rec.createdEstimate) return now < rec.created ? 'exited' : 'unknown';
  return sameProcess(now, rec.created) ? 'running' : 'exited';
}

/**
 * Windows: with creation times (recorded at the start and listed now), the command still running
 * is its pid created at the recorded time: its tree is stopped; else its descendants that
 * outlived it are (`stopLeftBehind`). Without them (Wine's tools give none, or no tool answers
 * now), or with only an estimate recorded (`createdEstimate`), only the image name tells the pid
 * runs the command: it is killed when tasklist shows the recorded image (never under Wine, whose
 * tasklist lists nothing); a pid reused by another process of the same image (`node.exe`,
 * `cmd.exe`) is not told apart then. With an estimate and another image there, the command has
 * exited: what it left is looked for as above.
 */
async function killWindowsLeftover(rec: PidRecord, log?: Pick<Logger, 'warn'>, exitedBy?: number): Promise<boolean> {
  const list = rec.created === undefined ? undefined : await windowsProcessList();
  const dated = list !== undefined && list.created.size > 0;
  const state = dated ? windowsLeftoverState(rec, list) : 'unknown';
  const leftBehind = async () => (await stopLeftBehind(rec, { platform: 'win32', ...(log ? { log } : {}), ...(exitedBy === undefined ? {} : { exitedBy }) })).size > 0;
  if (state === 'exited') return leftBehind();
  if (state === 'running') {
    const tree = descendants(rec.pid, list!.parents, list!.created);
    if (!(await taskkill(windowsKillCommands(rec.pid).force, log))) terminate(tree);
    return true;
  }
  const image = await windowsImage(rec.pid);
  if (!image || !rec.image) return false;
  if (image.toLowerCase() !== rec.image.toLowerCase()) return dated ? leftBehind() : false;
  const { pids } = await windowsTree(rec.pid);
  if (!(await taskkill(windowsKillCommands(rec.pid).force, log))) terminate(pids);
  return true;
}
