/**
 * The Windows branches of the runner, tested on any platform through what they build: the
 * taskkill and tasklist command lines, the parse of tasklist's answer, the spawn options and
 * the default outbox location, the process lists the tree is found in where taskkill /T is
 * refused, and the image name recorded for a crash cleanup. (Run under Wine for real:
 * test/agent-wine.test.ts.)
 */
import { describe, expect, it } from 'vitest';
import { defaultOutboxDir } from '../agent-client/src/runner/config.js';
import {
  decodeWindowsOutput,
  descendants,
  expectedImage,
  parseProcessParents,
  parseTasklist,
  treeSpawnOptions,
  windowsKillCommands,
  windowsProcessQuery,
} from '../agent-client/src/runner/process-tree.js';

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
});
