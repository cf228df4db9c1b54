/**
 * Every `npm run leasehold -- …` line of the README, run as pasted (block by block, variables
 * carried from line to line as in a terminal) against a coordinator started with
 * `LEASEHOLD_ADMIN_KEY=dev-admin-key`. What differs from a user's terminal is only where things
 * are: the coordinator's HTTP listener is on a free port (`LEASEHOLD_URL`), and the commands that
 * work on the database get this file's (`DATABASE_URL`).
 */
import { execFile } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { expect, it } from 'vitest';
import { jobEnqueue } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { useCoordinator } from './helpers/coordinator.js';

const run = promisify(execFile);
const root = path.resolve(import.meta.dirname, '..');
const readme = readFileSync(path.join(root, 'README.md'), 'utf8');
const blocks = [...readme.matchAll(/```sh\n([\s\S]*?)```/g)].map((m) => m[1]!.split('\n').filter((l) => l.trim()));
const cliBlocks = blocks.filter((b) => b.some((l) => /npm run (-s )?leasehold -- /.test(l)));
// `backup` and `restore` work on the embedded PostgreSQL (README, "Backups"): run on their own.
const embeddedBlocks = cliBlocks.filter((b) => b.some((l) => /leasehold -- (backup|restore) /.test(l)));
const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_ADMIN_KEY: 'dev-admin-key' });

/** The terminal's environment before the first line. */
function terminal(): Record<string, string> {
  const env: Record<string, string> = {
    ...(process.env as Record<string, string>),
    LEASEHOLD_URL: lh.httpUrl,
    DATABASE_URL: t.url,
    LEASEHOLD_LOG_LEVEL: 'warn',
    LEASEHOLD_LOG_FORMAT: 'json',
    PATH: `${path.join(root, 'node_modules/.bin')}:${process.env.PATH}`,
  };
  delete env.LEASEHOLD_KEY;
  delete env.LEASEHOLD_ADMIN_KEY;
  return env;
}

/**
 * Runs a block line by line in `env` (each line must exit 0); `NAME=…` and `export NAME=…`
 * set NAME in `env` for the lines after them.
 */
async function runBlock(lines: string[], env: Record<string, string>): Promise<Array<{ line: string; stdout: string }>> {
  const outs: Array<{ line: string; stdout: string }> = [];
  for (const line of lines) {
    const assign = /^(?:export )?([A-Z_]+)=(\S*)/.exec(line);
    const cmd = assign ? `${line.replace(/\s+#.*$/, '')}; printf %s "$${assign[1]}"` : line;
    const { stdout } = await run('bash', ['-o', 'pipefail', '-c', cmd], { cwd: root, env }).catch((e: { code: number; stderr: string }) => {
      throw new Error(`\`${line}\` exited ${e.code}: ${e.stderr}`);
    });
    if (assign) {
      expect(stdout, line).not.toBe('');
      env[assign[1]!] = stdout;
    } else outs.push({ line, stdout });
  }
  return outs;
}

it('every `npm run leasehold` line of the README works as pasted', async () => {
  expect(cliBlocks.length).toBeGreaterThanOrEqual(4);
  // The Operating block follows the AdminService lines, which left a job on the queue `demo`.
  const demo = await jobEnqueue(t.pool, { queue: 'demo', payload: { n: 1 } });
  if (demo.outcome !== 'ok') throw new Error('enqueue');
  const agents = cliBlocks.find((b) => b.some((l) => l.includes('agents add printer-1')))!;
  const operating = cliBlocks.find((b) => b.some((l) => l.includes('jobs show')))!;
  const rest = cliBlocks.filter((b) => b !== agents && b !== operating && !embeddedBlocks.includes(b));
  // The Agents block comes first in the README (it exports LEASEHOLD_KEY); the blocks after it
  // do not depend on each other, so they run side by side, each in a copy of that terminal.
  const env = terminal();
  const first = await runBlock(agents, env);
  const others = await Promise.all([operating, ...rest].map((b) => runBlock(b, { ...env })));
  const out = (needle: string) => [first, ...others].flat().find((o) => o.line.includes(needle))?.stdout ?? '';
  // (`npm run` without -s prints its own header lines first.)
  expect(out('agents add printer-1')).toMatch(/agent printer-1 created; its token .*\nlh_agent_/);
  expect(out('agents revoke printer-1')).toContain('agent printer-1 revoked\n');
  expect(out('keys add n8n-enqueue')).toMatch(/lh_key_/);
  expect(out('jobs show $JOB')).toContain(`job ${demo.value.id}`);
  expect(out('jobs cancel $JOB')).toContain(`job ${demo.value.id} canceled\n`);
  expect(out('jobs requeue $JOB')).toMatch(/job .* requeued on demo/);
  expect(out('leasehold -- stats')).toMatch(/^QUEUE\s+QUEUED/m);
  expect(out('agents drain printer-1')).toContain('agent printer-1 is not connected: nothing to drain\n');
  expect(out('subscriptions add reports')).toMatch(/whsec_/);
  const status = (await t.pool.query(`SELECT status::text FROM jobs WHERE id = $1`, [demo.value.id])).rows[0].status;
  expect(status).toBe('queued');
}, 300_000);

it('the Backups lines of the README back up and restore an embedded PostgreSQL as pasted', async () => {
  expect(embeddedBlocks.length).toBe(2);
  // A terminal without DATABASE_URL, its data directory a new one (enterable by the postgres user
  // when tests run as root); the backup lands in the checkout's backups/ as the README says.
  const dataDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-readme-backup-'));
  await chmod(dataDir, 0o755);
  const env = terminal();
  delete env.DATABASE_URL;
  env.LEASEHOLD_DATA_DIR = dataDir;
  try {
    const out = [...(await runBlock(embeddedBlocks[0]!, env)), ...(await runBlock(embeddedBlocks[1]!, env))];
    expect(env.BACKUP).toMatch(/^backups\/\d{8}-\d{6}$/);
    expect(out[0]!.stdout).toMatch(/backup of \d+ files \([\d.]+ MiB, PostgreSQL 17\.\d+\) in backups\//);
    expect(out[1]!.stdout).toMatch(/restored the backup of .* \(0 jobs\); the cluster that was there is in .*pg\.before-restore-/);
  } finally {
    await rm(dataDir, { recursive: true, force: true });
    if (env.BACKUP) await rm(path.join(root, env.BACKUP), { recursive: true, force: true });
  }
}, 120_000);
