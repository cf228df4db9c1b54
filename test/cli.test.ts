/**
 * The `leasehold` CLI against a running coordinator, as an operator runs it (a child process,
 * the package's bin, `--url`/`--key` from the environment): `--json` answers parsed and checked
 * against the database, the human tables, and the errors (server down, bad key, bad input,
 * unknown job) with their exit codes. `keys` and `agents add|revoke` are also run by
 * gateway-cli and agent-routing.
 */
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';
import { jobEnqueue } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, useCoordinator } from './helpers/coordinator.js';
import { makeJob } from './helpers/factories.js';
import { root } from './helpers/serve.js';

const exec = promisify(execFile);
const t = useTestDb();
const lh = useCoordinator(t);

interface Run {
  code: number;
  stdout: string;
  stderr: string;
}

/** Runs the package's bin (`server/leasehold.mjs`) with the coordinator's URL and key in the environment. */
async function leasehold(args: string[], env: Record<string, string> = {}): Promise<Run> {
  const base = { ...process.env, LEASEHOLD_URL: lh.httpUrl, LEASEHOLD_KEY: ADMIN_KEY, ...env };
  try {
    const { stdout, stderr } = await exec(process.execPath, ['server/leasehold.mjs', ...args], { cwd: root, env: base });
    return { code: 0, stdout, stderr };
  } catch (e) {
    const err = e as { code: number; stdout: string; stderr: string };
    return { code: err.code, stdout: err.stdout, stderr: err.stderr };
  }
}
const json = (r: Run) => {
  expect(r.code, r.stderr).toBe(0);
  return JSON.parse(r.stdout);
};

describe('leasehold jobs, stats and agents against a running coordinator', () => {
  it('lists, shows, requeues, cancels and purges jobs, prints stats, and manages agents; --json is the API JSON', async () => {
    const dead = await makeJob(t.pool, { queue: 'cli-ops', status: 'dead' });
    const queued = await jobEnqueue(t.pool, { queue: 'cli-ops', payload: { n: 1 } });
    if (queued.outcome !== 'ok') throw new Error('enqueue');

    const [ls, show, stats, table, agentAdd] = await Promise.all([
      leasehold(['jobs', 'ls', '--status', 'dead', '--queue', 'cli-ops', '--json']),
      leasehold(['jobs', 'show', queued.value.id, '--json']),
      leasehold(['stats', '--window', '5', '--json']),
      leasehold(['jobs', 'ls', '--queue', 'cli-ops']),
      leasehold(['agents', 'add', 'cli-ops-agent', '--json']),
    ]);
    expect(json(ls).jobs.map((j: { id: string }) => j.id)).toEqual([dead.id]);
    expect(json(show)).toMatchObject({ job: { id: queued.value.id, status: 'JOB_STATUS_QUEUED', payload: { n: 1 } }, events: [{ kind: 'enqueued' }] });
    const s = json(stats);
    expect(s.windowMinutes).toBe(5);
    expect(s.depths).toEqual(expect.arrayContaining([{ queue: 'cli-ops', status: 'JOB_STATUS_DEAD', count: '1' }]));
    // The human table: a header, then one aligned row per job.
    const lines = table.stdout.trim().split('\n');
    expect(lines[0]).toMatch(/^JOB\s+QUEUE\s+STATUS\s+ATTEMPT\s+AGENT\s+CREATED\s+FINISHED\s+ERROR$/);
    expect(lines.slice(1).map((l) => l.split(/\s+/)[0]).sort()).toEqual([dead.id, queued.value.id].sort());
    expect(json(agentAdd)).toMatchObject({ agentId: 'cli-ops-agent', token: expect.stringMatching(/^lh_agent_/) });

    const [requeue, cancel, purge, agents] = await Promise.all([
      leasehold(['jobs', 'requeue', dead.id, '--json']),
      leasehold(['jobs', 'cancel', queued.value.id]),
      leasehold(['jobs', 'purge', '--older-than', '1d', '--dry-run', '--json']),
      leasehold(['agents', 'list', '--json']),
    ]);
    expect(json(requeue).job).toMatchObject({ id: dead.id, status: 'JOB_STATUS_QUEUED' });
    expect(cancel.stdout).toBe(`job ${queued.value.id} canceled\n`);
    expect(json(purge)).toMatchObject({ purged: '0', dryRun: true });
    expect(json(agents)).toEqual(expect.arrayContaining([expect.objectContaining({ agentId: 'cli-ops-agent', registered: true })]));
    const statsTable = await leasehold(['stats']);
    expect(statsTable.stdout).toMatch(/^QUEUE\s+QUEUED\s+CLAIMED\s+RUNNING\s+SUCCEEDED\s+FAILED\s+DEAD\s+CANCELED\s+DUE\s+OLDEST WAIT$/m);
    expect(statsTable.stdout).toMatch(/^cli-ops\s+1\s+0\s+0\s+0\s+0\s+0\s+1\s+1\s+\d+s$/m);
    expect(statsTable.stdout).toMatch(/last 15 min: [\d.]+ completions\/min/);

    const rows = (await t.pool.query(`SELECT id, status::text FROM jobs WHERE queue = 'cli-ops' ORDER BY id`)).rows;
    expect(Object.fromEntries(rows.map((r) => [r.id, r.status]))).toEqual({ [dead.id]: 'queued', [queued.value.id]: 'canceled' });

    const [drain, revoke] = [await leasehold(['agents', 'drain', 'cli-ops-agent']), await leasehold(['agents', 'revoke', 'cli-ops-agent'])];
    expect(drain.stdout).toBe('agent cli-ops-agent is not connected: nothing to drain\n');
    expect(revoke.stdout).toBe('agent cli-ops-agent revoked\n');
  }, 120_000);

  it('fails clearly with a non-zero exit: server down 3, bad or missing key 4, bad input 2, refused 1', async () => {
    const [down, badKey, noKey, badStatus, unknown, conflict] = await Promise.all([
      leasehold(['stats'], { LEASEHOLD_URL: 'http://127.0.0.1:1' }),
      leasehold(['jobs', 'ls'], { LEASEHOLD_KEY: 'lh_key_wrong' }),
      leasehold(['stats', '--json'], { LEASEHOLD_KEY: '', LEASEHOLD_ADMIN_KEY: '' }),
      leasehold(['jobs', 'ls', '--status', 'lost']),
      leasehold(['jobs', 'show', '00000000-0000-4000-8000-000000000000']),
      leasehold(['jobs', 'requeue', 'not-an-id']),
    ]);
    expect(down).toMatchObject({ code: 3, stdout: '' });
    expect(down.stderr).toMatch(/^error: cannot reach the coordinator at http:\/\/127\.0\.0\.1:1: .*ECONNREFUSED.*LEASEHOLD_URL/);
    expect(badKey).toMatchObject({ code: 4, stdout: '' });
    expect(badKey.stderr).toMatch(/refused the key: unknown key or token/);
    expect(noKey).toMatchObject({ code: 4 });
    expect(noKey.stderr).toMatch(/no key: pass --key/);
    expect(badStatus).toMatchObject({ code: 2 });
    expect(badStatus.stderr).toMatch(/--status "lost" is not a job status: use queued, claimed/);
    expect(unknown).toMatchObject({ code: 1 });
    expect(unknown.stderr).toMatch(/job 00000000-0000-4000-8000-000000000000 not found/);
    expect(conflict).toMatchObject({ code: 2 });
    expect(conflict.stderr).toMatch(/jobId must be a UUID-shaped id/);
  }, 120_000);
});
