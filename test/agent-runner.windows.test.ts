/**
 * The Windows branches of the runner, tested on any platform through what they build: the
 * taskkill and tasklist command lines, the parse of tasklist's answer, the spawn options and
 * the default outbox location, the process lists the tree is found in where taskkill /T is
 * refused, and the image name recorded for a crash cleanup. (Run under Wine for real:
 * test/agent-wine.test.ts.) Parent process ids can be stale (an exited parent's id given to a
 * new process): the creation times that wmic and PowerShell list keep a stale "child" out of a
 * tree, and tell what a command that has exited left running; a process created after the
 * command exited is not its child, whatever parent id it claims. A command gone before wmic
 * could date it is dated from its spawn, an estimate that never passes for its exact time.
 */
import { describe, expect, it } from 'vitest';
import { defaultOutboxDir } from '../agent-client/src/runner/config.js';
import {
  CREATED_ESTIMATE_MARGIN_US,
  decodeWindowsOutput,
  describeProcess,
  descendants,
  expectedImage,
  parseCreationTime,
  parseProcessList,
  parseProcessParents,
  parseTasklist,
  parseWindowsTime,
  treeSpawnOptions,
  windowsCreationQueries,
  windowsKillCommands,
  windowsLeftoverState,
  windowsProcessListCommands,
  windowsProcessQuery,
  type PidRecord,
} from '../agent-client/src/runner/process-tree.js';

/** 2024-01-15 08:30:12.345678 UTC, as microseconds since 1970. */
const T = Date.UTC(2024, 0, 15, 8, 30, 12) * 1000 + 345678;
/** T + `s` whole seconds as wmic prints a CreationDate: local time (here UTC+1) and its offset in minutes. */
const cim = (s: number) => `${new Date(Math.floor(T / 1000) + s * 1000 + 3600_000).toISOString().replace(/\D/g, '').slice(0, 14)}.345678+060`;

describe('Windows process trees', () => {
  it('asks the tree to close, then forces it, with taskkill /T', () => {
    expect(windowsKillCommands(4242)).toEqual({
      polite: ['taskkill', ['/PID', '4242', '/T']],
      force: ['taskkill', ['/PID', '4242', '/T', '/F']],
    });
    expect(() => windowsKillCommands(0)).toThrow(/not a pid/);
    expect(() => windowsKillCommands(Number.NaN)).toThrow(/not a pid/);
  });

  it('checks which image a pid runs before killing a leftover', () => {
    expect(windowsProcessQuery(77)).toEqual(['tasklist', ['/FI', 'PID eq 77', '/FO', 'CSV', '/NH']]);
    expect(parseTasklist('"resize.exe","77","Services","0","12,345 K"\r\n')).toBe('resize.exe');
    expect(parseTasklist('INFO: No tasks are running which match the specified criteria.\r\n')).toBeUndefined();
  });

  it('spawns without a console window on Windows and as a group leader elsewhere', () => {
    expect(treeSpawnOptions('win32')).toEqual({ detached: false, windowsHide: true });
    expect(treeSpawnOptions('linux')).toEqual({ detached: true });
  });

  it('puts the outbox under %ProgramData% on Windows and ~/.leasehold elsewhere', () => {
    expect(defaultOutboxDir('win32', { ProgramData: 'D:\\ProgramData' }, 'C:\\Users\\me')).toBe('D:\\ProgramData\\leasehold\\outbox');
    expect(defaultOutboxDir('win32', {}, 'C:\\Users\\me')).toBe('C:\\ProgramData\\leasehold\\outbox');
    expect(defaultOutboxDir('linux', {}, '/home/me')).toBe('/home/me/.leasehold/outbox');
  });

  it('finds a tree by parent process ids in what wmic (Windows, Wine) and PowerShell print', () => {
    // Wine 8's wmic, as captured: UTF-16LE with a byte order mark, the column names run together.
    const wine = Buffer.from('\uFEFFParentProcessIDProcessID\r\n0    32   \r\n656  700  \r\n700  716  \r\n700  724  \r\n716  730  \r\n32   732  \r\n', 'utf16le');
    const parents = parseProcessParents(decodeWindowsOutput(wine));
    expect(parents.get(700)).toBe(656);
    expect(descendants(700, parents)).toEqual(new Set([700, 716, 724, 730]));
    // Windows' wmic: aligned columns, in whatever order it prints them.
    const windows = 'ProcessId  ParentProcessId  \r\n4          0                \r\n9000       4                \r\n9100       9000             \r\n';
    expect(descendants(9000, parseProcessParents(decodeWindowsOutput(Buffer.from(windows, 'utf8'))))).toEqual(new Set([9000, 9100]));
    // PowerShell's lines of `parent pid`.
    expect(descendants(5, parseProcessParents('1 5\n5 6\n6 7\n1 8\n'))).toEqual(new Set([5, 6, 7]));
    // Nothing usable: no tree beyond the pid itself.
    expect(parseProcessParents('ERROR: Description = Invalid class\r\n').size).toBe(0);
    expect(descendants(5, new Map())).toEqual(new Set([5]));
  });

  it('records the image a command really runs as: the shell for shell commands, .exe added', () => {
    expect(expectedImage({ file: 'C:\\jobs\\add.cmd', shell: true }, {})).toBe('cmd.exe');
    expect(expectedImage({ file: 'add.cmd', shell: true }, { ComSpec: 'C:\\Windows\\system32\\cmd.exe' })).toBe('cmd.exe');
    expect(expectedImage({ file: 'C:\\Program Files\\Tool\\resize.exe' }, {})).toBe('resize.exe');
    expect(expectedImage({ file: 'ping' }, {})).toBe('ping.exe');
  });

  it('reads creation times as wmic (CIM datetime, local time and offset) and PowerShell (FILETIME) print them, to one value', () => {
    expect(parseWindowsTime('20240115093012.345678+060')).toBe(T);
    expect(parseWindowsTime('20240115033012.345678-300')).toBe(T);
    expect(parseWindowsTime('133497810123456780')).toBe(T);
    expect(parseWindowsTime('4242')).toBeUndefined();
    expect(parseWindowsTime('')).toBeUndefined();
    expect(cim(0)).toBe('20240115093012.345678+060');
  });

  it('asks wmic, else PowerShell, when one process was created, and reads their answers', () => {
    expect(windowsCreationQueries(77)).toEqual([
      ['wmic', ['process', 'where', 'ProcessId=77', 'get', 'CreationDate']],
      ['powershell.exe', ['-NoProfile', '-NonInteractive', '-Command', "(Get-CimInstance Win32_Process -Filter 'ProcessId=77').CreationDate.ToFileTimeUtc()"]],
    ]);
    expect(() => windowsCreationQueries(-1)).toThrow(/not a pid/);
    expect(parseCreationTime('CreationDate               \r\r\n20240115093012.345678+060  \r\r\n\r\r\n')).toBe(T);
    expect(parseCreationTime('133497810123456780\r\n')).toBe(T);
    // wmic for a pid that is gone (its message goes to stderr), Wine's wmic, PowerShell's error.
    expect(parseCreationTime('')).toBeUndefined();
    expect(parseCreationTime('No Instance(s) Available.\r\n')).toBeUndefined();
  });

  it('lists processes with their creation times first, and without them where the tool has none (Wine)', () => {
    expect(windowsProcessListCommands.map(([cmd, args]) => [cmd, args.at(-1)])).toEqual([
      ['wmic', 'CreationDate,ParentProcessId,ProcessId'],
      ['powershell.exe', 'Get-CimInstance Win32_Process | ForEach-Object { "$($_.ParentProcessId) $($_.ProcessId) $(if ($_.CreationDate) { $_.CreationDate.ToFileTimeUtc() })" }'],
      ['wmic', 'ParentProcessId,ProcessId'],
    ]);
    // Windows' wmic prints the columns in alphabetical order; the System processes have no date.
    const windows = [
      'CreationDate               ParentProcessId  ProcessId  ',
      '                           0                0          ',
      '                           0                4          ',
      `${cim(-60)}  4                700        `,
      `${cim(0)}  700              5000       `,
      `${cim(5)}  5000             5100       `,
      '',
    ].join('\r\r\n');
    const list = parseProcessList(decodeWindowsOutput(Buffer.from(`\uFEFF${windows}`, 'utf16le')));
    expect([...list.parents]).toEqual([[4, 0], [700, 4], [5000, 700], [5100, 5000]]);
    expect(list.created.get(5000)).toBe(T);
    expect(list.created.get(5100)).toBe(T + 5_000_000);
    expect(list.created.has(4)).toBe(false);
    expect(parseProcessParents(windows).get(5100)).toBe(5000);
    // PowerShell's lines: `parent pid FILETIME`, the FILETIME missing where there is no date.
    const ps = parseProcessList('0 4 \n4 700 133497810123456780\n700 5000 133497810173456780\n');
    expect([...ps.parents]).toEqual([[4, 0], [700, 4], [5000, 700]]);
    expect([...ps.created]).toEqual([[700, T], [5000, T + 5_000_000]]);
    // Wine's wmic, asked for a CreationDate its Win32_Process does not have: no rows, so the next command.
    expect(parseProcessList('CreationDateParentProcessIDProcessID\r\n').parents.size).toBe(0);
  });

  it('does not take a process for a child of a parent created after it (a stale, reused parent id)', () => {
    // explorer.exe (4321) was started by userinit (5000), which exited; our command got pid 5000.
    const wmic = [
      'CreationDate               ParentProcessId  ProcessId',
      `${cim(-3600)}  5000             4321`,
      `${cim(-10)}  4322             9000`,
      `${cim(0)}  9000             5000`,
      `${cim(1)}  5000             5100`,
      `${cim(2)}  5100             5200`,
      `${cim(3)}  4321             5300`,
    ].join('\r\n');
    const { parents, created } = parseProcessList(wmic);
    expect(descendants(5000, parents, created)).toEqual(new Set([5000, 5100, 5200]));
    // Before the fix, or from a list without dates: the parent id alone takes explorer and its child.
    expect(descendants(5000, parents)).toEqual(new Set([5000, 5100, 5200, 4321, 5300]));
  });

  it('finds what a command that has exited left running, by creation times only, its pid perhaps reused', () => {
    // The command, pid 5000, created at T, has exited. Its child 5100 and grandchild 5200 run on;
    // explorer (4321) has a stale parent id 5000 from before; 5000 is now a new process (created
    // at T + 60 s) whose own child is 7000; 6000 claims parent 5000 with no date known.
    const wmic = [
      'CreationDate               ParentProcessId  ProcessId',
      `${cim(-3600)}  5000             4321`,
      `${cim(1)}  5000             5100`,
      `${cim(2)}  5100             5200`,
      `${cim(60)}  800              5000`,
      `${cim(61)}  5000             7000`,
      '                           5000             6000',
    ].join('\r\n');
    const { parents, created } = parseProcessList(wmic);
    const known = new Map([[5000, T]]);
    const left = descendants(5000, parents, created, { known, strict: true });
    expect([...left].filter((p) => !known.has(p)).sort()).toEqual([5100, 5200]);
    // A later round, 5100 stopped meanwhile: its child 5400, started since, is found by 5100's recorded time.
    const later = parseProcessList(['CreationDate  ParentProcessId  ProcessId', `${cim(3)}  5100  5400`, `${cim(60)}  800  5000`].join('\r\n'));
    const again = descendants(5000, later.parents, later.created, { known: new Map([...known, [5100, T + 1_000_000], [5200, T + 2_000_000]]), strict: true });
    expect(again.has(5400)).toBe(true);
    // Without creation times (Wine), nothing can be told: nothing is found.
    expect([...descendants(5000, parseProcessParents('5000 4321\n5000 5100\n'), new Map(), { known, strict: true })]).toEqual([5000]);
  });

  it('does not take a child of a process that reused the pid of a command that exited for the command\'s, the reuser gone too', () => {
    // The command, pid 100 created at t=10 s, exited by t=15 s; 200 (t=11 s) is its child, 250
    // (t=30 s) 200's. Another process X was given pid 100 at t=20 s, started 300 (t=21 s) and
    // exited: 300 claims parent 100 and was created after the command, as a child of it would be.
    const s = 1_000_000;
    const parents = new Map([[200, 100], [300, 100], [250, 200]]);
    const created = new Map([[200, 11 * s], [300, 21 * s], [250, 30 * s]]);
    const known = new Map([[100, 10 * s]]);
    expect(descendants(100, parents, created, { known, strict: true, exitedBy: 15 * s })).toEqual(new Set([100, 200, 250]));
    // Without the bound, 300 is taken (and killed).
    expect(descendants(100, parents, created, { known, strict: true })).toEqual(new Set([100, 200, 250, 300]));
  });

  it('dates a command gone before wmic could tell from its spawn, as an estimate', async () => {
    // Here no tool answers (no tasklist, wmic or PowerShell): as for a batch file that exits at once.
    const spawnedAt = T;
    expect(await describeProcess(4242, { file: 'job.cmd', shell: true }, 'win32', { spawnedAt })).toEqual({
      pid: 4242,
      platform: 'win32',
      image: 'cmd.exe',
      created: T - CREATED_ESTIMATE_MARGIN_US,
      createdEstimate: true,
    });
    expect(await describeProcess(4242, { file: 'job.cmd', shell: true }, 'win32')).not.toHaveProperty('created');
  });

  it('never takes an estimated creation time for exact when checking a pid at the next start', () => {
    const list = (pid: number, at: number) => ({ parents: new Map([[pid, 4]]), created: new Map([[pid, at]]) });
    const exact: PidRecord = { pid: 5000, platform: 'win32', image: 'cmd.exe', created: T };
    expect(windowsLeftoverState(exact, list(5000, T))).toBe('running');
    expect(windowsLeftoverState(exact, list(5000, T + 60_000_000))).toBe('exited'); // its pid reused
    expect(windowsLeftoverState(exact, list(6000, T))).toBe('exited'); // its pid gone
    // The command, spawned at T, still runs (created 5 ms later than that): the estimate
    // (T − 1 s) differs from its real time, yet it is not "exited" (which would leave it
    // running): the image decides, as without a time.
    const estimate: PidRecord = { ...exact, created: T - CREATED_ESTIMATE_MARGIN_US, createdEstimate: true };
    expect(windowsLeftoverState(estimate, list(5000, T + 5000))).toBe('unknown');
    expect(windowsLeftoverState(estimate, list(5000, T + 60_000_000))).toBe('unknown');
    expect(windowsLeftoverState(estimate, list(5000, T - 2 * CREATED_ESTIMATE_MARGIN_US))).toBe('exited'); // older than the command
    expect(windowsLeftoverState(estimate, list(6000, T))).toBe('exited');
    expect(windowsLeftoverState({ pid: 5000, platform: 'win32', image: 'cmd.exe' }, list(5000, T))).toBe('unknown');
  });
});
