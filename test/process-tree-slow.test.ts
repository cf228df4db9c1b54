/**
 * The Windows tree stop's process lists, run on Linux through the Windows branch: no taskkill here
 * (it "fails", as Wine's refuses /T), and a `wmic` of the test's own on PATH.
 *
 * - A stop that takes long is logged with where the time went (the process lists), so a stop that
 *   hangs (a tool slow under load, say) says why: a `wmic` that answers after 3 s with no list,
 *   so each list costs about 6 s (wmic, PowerShell missing, wmic again).
 * - A tool that reads its stdin to the end before it answers, as PowerShell does with its input
 *   redirected, answers at once: the tools get their stdin closed (they waited out the 10 s).
 */
import { execFileSync, spawn } from 'node:child_process';
import { chmod, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, expect, it } from 'vitest';
import { killTree } from '../agent-client/src/runner/process-tree.js';
import { waitFor } from './helpers/coordinator.js';

const dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-slow-wmic-'));
afterAll(() => rm(dir, { recursive: true, force: true }));

/** The pid of `pid`'s child once it has one (pgrep exits 1 until then); fails after 10 s. */
const childOf = (pid: number) =>
  waitFor(`a child of ${pid}`, () => {
    try {
      return Number(execFileSync('pgrep', ['-P', String(pid)]).toString().trim());
    } catch {
      return undefined;
    }
  });

it('closes the tools\' stdin: a process list that reads it to the end answers at once, and finds the tree', async () => {
  await writeFile(path.join(dir, 'wmic'), '#!/bin/sh\ncat >/dev/null\necho "ParentProcessId  ProcessId"\nps -eo ppid=,pid=\n');
  await chmod(path.join(dir, 'wmic'), 0o755);
  const oldPath = process.env.PATH;
  process.env.PATH = `${dir}:${oldPath}`;
  const warned: string[] = [];
  const log = { warn: (_: unknown, msg: string) => warned.push(msg) };
  // A command with a child of its own: the list must show the child for the stop to end it.
  const child = spawn('sh', ['-c', 'sleep 60 & wait']);
  const grandchild = await childOf(child.pid!);
  const started = performance.now();
  try {
    await killTree(child, 100, { platform: 'win32', log: log as never });
  } finally {
    process.env.PATH = oldPath;
    child.kill('SIGKILL');
  }
  expect(performance.now() - started).toBeLessThan(5_000);
  expect(warned).not.toContain('stopping the tree took long');
  // The grandchild was found in the list and terminated (gone, or a zombie no one has reaped yet):
  // its state read until it is either, for up to 5 s (a kill takes moments; one never sent, forever).
  const stateOf = () => readFile(`/proc/${grandchild}/stat`, 'utf8').then((st) => st.slice(st.lastIndexOf(')') + 2, st.lastIndexOf(')') + 3), () => 'gone');
  let state = await stateOf();
  for (const until = Date.now() + 5_000; !['gone', 'Z'].includes(state) && Date.now() < until; state = await stateOf()) await new Promise((r) => setTimeout(r, 20));
  expect(['gone', 'Z']).toContain(state);
}, 30_000);

it('logs a Windows tree stop that took long, with the time of each process list', async () => {
  await writeFile(path.join(dir, 'wmic'), '#!/bin/sh\nsleep 3\n');
  await chmod(path.join(dir, 'wmic'), 0o755);
  const oldPath = process.env.PATH;
  process.env.PATH = `${dir}:${oldPath}`;
  const warned: Array<{ obj: Record<string, unknown>; msg: string }> = [];
  const log = { warn: (obj: Record<string, unknown>, msg: string) => warned.push({ obj, msg }) };
  const child = spawn('sleep', ['60']);
  let ended: NodeJS.Signals | null = null;
  try {
    await killTree(child, 100, { platform: 'win32', log: log as never });
    ended = child.signalCode;
  } finally {
    process.env.PATH = oldPath;
    child.kill('SIGKILL');
  }
  // Terminated by killTree itself (on Windows, TerminateProcess), the lists notwithstanding.
  expect(ended).toBe('SIGKILL');
  expect(warned.map((w) => w.msg)).toContain('taskkill failed: stopping the tree by parent process ids');
  const slow = warned.find((w) => w.msg === 'stopping the tree took long');
  expect(slow?.obj).toMatchObject({ pid: child.pid, graceMs: 100 });
  const lists = slow!.obj.processListsMs as number[];
  expect(lists).toHaveLength(2);
  for (const ms of lists) expect(ms).toBeGreaterThanOrEqual(5_900);
  expect(slow!.obj.ms as number).toBeGreaterThanOrEqual(lists[0]! + lists[1]!);
}, 30_000);
