/**
 * The README's command lines, run as pasted against a coordinator (only the port differs: the
 * test's coordinator listens on a free one). `buf curl` lines always run; grpcurl lines run
 * when grpcurl is installed, and are skipped with the reason printed otherwise.
 */
import { execFile } from 'node:child_process';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';
import { useTestDb } from './helpers/db.js';
import { useCoordinator } from './helpers/coordinator.js';

const run = promisify(execFile);
const root = path.resolve(import.meta.dirname, '..');
const readme = readFileSync(path.join(root, 'README.md'), 'utf8');
const lines = (prefix: string) => readme.split('\n').filter((l) => l.startsWith(prefix));
const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_ADMIN_KEY: 'dev-admin-key' });

const grpcurl = await run('grpcurl', ['-version']).then(
  () => true,
  () => false,
);

async function sh(line: string) {
  const cmd = line.replaceAll('127.0.0.1:50051', `127.0.0.1:${lh.port}`);
  return run('bash', ['-c', cmd], { cwd: root, env: { ...process.env, PATH: `${path.join(root, 'node_modules/.bin')}:${process.env.PATH}` } });
}

describe('README command lines', () => {
  it('has buf curl and grpcurl lines to check', () => {
    expect(lines('npx buf curl').length).toBeGreaterThanOrEqual(4);
    expect(lines('grpcurl ').length).toBeGreaterThanOrEqual(5);
  });

  it('every `npx buf curl` line works as pasted', async () => {
    const outs: string[] = [];
    for (const l of lines('npx buf curl')) {
      const { stdout } = await sh(l);
      outs.push(stdout);
    }
    expect(outs[0]).toMatch(/leasehold\.v1\.AgentService\/Connect/);
    expect(JSON.parse(outs[1]!)).toEqual({ status: 'SERVING' });
    expect(JSON.parse(outs[2]!)).toMatchObject({ job: { queue: 'demo', payload: { hello: 'world' } }, outcome: 'OUTCOME_OK' });
    expect(JSON.parse(outs[3]!).jobs.length).toBe(1);
    // The enqueue line again: the idempotency key returns the same job.
    const again = JSON.parse((await sh(lines('npx buf curl')[2]!)).stdout);
    expect(again).toMatchObject({ outcome: 'OUTCOME_DUPLICATE', job: { id: JSON.parse(outs[2]!).job.id } });
  });

  it.skipIf(!grpcurl)('every grpcurl line works as pasted', async () => {
    for (const l of lines('grpcurl ')) await sh(l);
  });
  if (!grpcurl) console.log('grpcurl lines not run: grpcurl is not installed on this machine (no Debian or npm package provides it)');
});
