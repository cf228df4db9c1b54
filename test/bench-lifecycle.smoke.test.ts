/**
 * test/bench/lifecycle.ts at toy size, so the tool cannot rot: it must drive every job through
 * claim, start and completion and report, per statement, the backend's CPU and the WAL it wrote,
 * broken down by record type. The figures are not judged (a shared machine), only that they were
 * measured: each statement writes WAL, the claim updates rows and the completion moves each job's
 * row (a delete and an insert; its attempt stays on the row).
 */
import { execFile } from 'node:child_process';
import path from 'node:path';
import { promisify } from 'node:util';
import { expect, it } from 'vitest';

const root = path.resolve(import.meta.dirname, '..');

it.runIf(process.platform === 'linux')('test/bench/lifecycle.ts: per statement CPU and WAL, by record type', async () => {
  const { stdout } = await promisify(execFile)(process.execPath, ['--import', 'tsx', 'test/bench/lifecycle.ts', '--jobs', '300', '--batch', '64', '--rounds', '1', '--wal-records'], {
    cwd: root,
    timeout: 90_000,
  });
  const row = (label: string) => stdout.split('\n').find((l) => l.startsWith(`| ${label} |`));
  for (const kind of ['claim', 'start', 'complete']) {
    const cells = row(kind)?.split('|').map((c) => c.trim());
    expect(cells, stdout).toBeDefined();
    // | kind | cpu | wall | WAL |: the WAL median (first number of the last cell) is above zero.
    expect(Number(cells![4]!.split(' ')[0]), stdout).toBeGreaterThan(0);
  }
  expect(stdout).toMatch(/^\| claim \| Heap\/(HOT_)?UPDATE \| [\d.]+ \| \d+ \| \d+ \|$/m);
  // The completion moves the job's row to its day's partition (its attempt kept on the row): one
  // delete and one insert per job (the kept counts add a few rows per statement; an insert that
  // starts a new page is logged as Heap/INSERT+INIT, a row of its own: hence 0.9x), no update.
  expect(stdout).toMatch(/^\| complete \| Heap\/DELETE \| 1\.00 \| \d+ \| \d+ \|$/m);
  expect(stdout).toMatch(/^\| complete \| Heap\/INSERT \| (0\.9\d|1\.0\d) \| \d+ \| \d+ \|$/m);
  expect(stdout).not.toMatch(/^\| complete \| Heap\/(HOT_)?UPDATE \|/m);
});
