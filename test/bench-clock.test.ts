/**
 * The benchmark's latency clock (test/bench/clock.ts) compares across processes: a time read in
 * a child process falls between the parent's reads before the child started and after it ended.
 */
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { expect, it } from 'vitest';
import { clockMs } from './bench/clock.js';

it('clockMs: one clock for every process of the machine, finer than a millisecond', async () => {
  const reads: number[] = [];
  for (let i = 0; i < 3; i++) {
    const before = clockMs();
    const { stdout } = await promisify(execFile)(process.execPath, [
      '--import',
      'tsx',
      '--input-type=module',
      '-e',
      `const { clockMs } = await import(${JSON.stringify(new URL('./bench/clock.ts', import.meta.url).href)}); console.log(clockMs());`,
    ]);
    const after = clockMs();
    const child = Number(stdout.trim());
    expect(child).toBeGreaterThan(before);
    expect(child).toBeLessThan(after);
    reads.push(before, child, after);
  }
  // Date.now() would give whole milliseconds only.
  expect(reads.some((t) => !Number.isInteger(t))).toBe(true);
});
