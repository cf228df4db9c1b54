/**
 * test/bench/cold.ts at toy size, so the tool cannot rot: each way of running prints a median for
 * each operation, and the sleeping way the process's CPU a round. The figures are not judged (a
 * shared machine), only that they were measured; a bad option is one line and exit code 1.
 */
import { execFile } from 'node:child_process';
import path from 'node:path';
import { promisify } from 'node:util';
import { expect, it } from 'vitest';

const root = path.resolve(import.meta.dirname, '..');
const run = (args: string[]) => promisify(execFile)(process.execPath, ['--import', 'tsx', 'test/bench/cold.ts', ...args], { cwd: root, timeout: 60_000 });

it('test/bench/cold.ts: the same operations back to back, asleep between rounds and computing between them', async () => {
  const { stdout } = await run(['--rounds', '30', '--gap', '1']);
  const lines = stdout.trim().split('\n');
  expect(lines.map((l) => l.split(' ')[0]), stdout).toEqual(['loop', 'sleep', 'busy', 'loop']);
  for (const l of lines) expect(l, stdout).toMatch(/ sum \d+ ns, toISOString \d+ ns, spread \d+ ns/);
  expect(lines[1], stdout).toMatch(/; the process's CPU \d+\.\d µs a round$/);
});

it('test/bench/cold.ts: says what is wrong with an option, in one line', async () => {
  const failed = await run(['--rounds', 'x']).then(() => undefined, (err: { code: number; stderr: string }) => err);
  expect(failed?.code).toBe(1);
  expect(failed?.stderr.trim()).toBe('--rounds: an integer, at least 10');
});
