/**
 * test/bench/lifecycle.ts at toy size, so the tool cannot rot: it must drive every job through
 * claim, start and completion and report, per statement, the backend's CPU and the WAL it wrote,
 * broken down by record type. The figures are not judged (a shared machine), only that they were
 * measured: each statement writes WAL, the claim updates rows and the completion updates one row
 * per job and inserts none (the job's row keeps its attempt; the kept counts add a few rows per
 * statement).
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
  // The completion updates the job's row (keeping its attempt there) and inserts no row per job:
  // only the kept counts' rows, a few per statement. (An update that starts a new page is logged
  // as Heap/UPDATE+INIT, a row of its own: hence 0.9x.)
  expect(stdout).toMatch(/^\| complete \| Heap\/UPDATE \| (0\.9\d|1\.0\d) \| \d+ \| \d+ \|$/m);
  expect(stdout).toMatch(/^\| complete \| Heap\/INSERT \| 0\.0\d \| \d+ \| \d+ \|$/m);
});

it.runIf(process.platform === 'linux')('test/bench/lifecycle.ts --completion moved: the prototype moves each job and writes no attempt row', async () => {
  const { stdout } = await promisify(execFile)(
    process.execPath,
    ['--import', 'tsx', 'test/bench/lifecycle.ts', '--jobs', '300', '--batch', '64', '--rounds', '1', '--wal-records', '--completion', 'moved'],
    { cwd: root, timeout: 90_000 },
  );
  expect(stdout).toContain('completion: moved');
  // The job's row deleted from jobs (one per job) and inserted into jobs_done: the only heap insert
  // per job, where the store's completion updates the job's row.
  expect(stdout).toMatch(/^\| complete \| Heap\/DELETE \| 1\.00 \| \d+ \| \d+ \|$/m);
  expect(stdout).toMatch(/^\| complete \| Heap\/INSERT \| 1\.0\d \| \d+ \| \d+ \|$/m);
  expect(stdout).not.toMatch(/^\| complete \| Heap\/(HOT_)?UPDATE \|/m);
});
