/**
 * The agent README's example, run as pasted: the JavaScript block saved as a file in the
 * checkout, started with the README's command, fed a job with the README's enqueue line; it
 * completes the job, and SIGINT drains it to a clean exit.
 */
import { execFile, spawn } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { expect, it } from 'vitest';
import { useTestDb } from './helpers/db.js';
import { useCoordinator, waitFor } from './helpers/coordinator.js';

const run = promisify(execFile);
const root = path.resolve(import.meta.dirname, '..');
const readme = readFileSync(path.join(root, 'agent-client/README.md'), 'utf8');
const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_ADMIN_KEY: 'dev-admin-key' });

it('the example agent in agent-client/README.md runs as pasted', async () => {
  const code = /```js\n([\s\S]*?)```/.exec(readme)![1]!;
  expect(code.trim().split('\n').length).toBeLessThan(20);
  const file = path.join(root, `.readme-agent-${process.pid}.mjs`);
  const outbox = await mkdtemp(path.join(os.tmpdir(), 'leasehold-readme-'));
  await writeFile(file, code);
  const token = await lh.agent('my-agent');
  const child = spawn(process.execPath, ['--import', 'tsx', file], {
    cwd: root,
    env: { ...process.env, LEASEHOLD_URL: lh.url, LEASEHOLD_TOKEN: token, LEASEHOLD_OUTBOX: outbox },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  const exited = new Promise<number | null>((r) => child.on('exit', (c) => r(c)));
  let out = '';
  child.stdout.on('data', (d) => (out += d));
  child.stderr.on('data', (d) => (out += d));
  try {
    await waitFor('connected', () => out.includes('connected to the coordinator'), 20_000);
    const enqueueLine = readme.split('\n').find((l) => l.startsWith('npx buf curl'))!;
    const { stdout } = await run('bash', ['-c', enqueueLine.replaceAll('127.0.0.1:50051', `127.0.0.1:${lh.port}`)], {
      cwd: root,
      env: { ...process.env, PATH: `${path.join(root, 'node_modules/.bin')}:${process.env.PATH}` },
    });
    const jobId = JSON.parse(stdout).job.id as string;
    const row = await waitFor('job done', async () => {
      const r = (await t.pool.query(`SELECT status::text, result, progress FROM jobs WHERE id = $1`, [jobId])).rows[0];
      return r.status === 'succeeded' ? r : undefined;
    });
    expect(row.result).toEqual({ width: 640, key: `${jobId}:upload`, bytes: 1024 });
    const step = (await t.pool.query(`SELECT status::text, output FROM steps WHERE job_id = $1`, [jobId])).rows[0];
    expect(step).toEqual({ status: 'done', output: { bytes: 1024, url: 'https://example.com/a.png' } });
    child.kill('SIGINT');
    expect(await exited).toBe(0);
    expect(out).toMatch(/shutting down: draining/);
  } finally {
    child.kill('SIGKILL');
    await rm(file, { force: true });
    await rm(outbox, { recursive: true, force: true });
  }
});
