/**
 * The Windows branches of the runner, tested on any platform through what they build: the
 * taskkill and tasklist command lines, the parse of tasklist's answer, the spawn options and
 * the default outbox location.
 */
import { describe, expect, it } from 'vitest';
import { defaultOutboxDir } from '../agent-client/src/runner/config.js';
import { parseTasklist, treeSpawnOptions, windowsKillCommands, windowsProcessQuery } from '../agent-client/src/runner/process-tree.js';

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
});
