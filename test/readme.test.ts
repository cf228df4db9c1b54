/**
 * The README's command lines, run as pasted against a coordinator (only the port differs: the
 * test's coordinator listens on a free one). `buf curl` lines always run; grpcurl lines run
 * when grpcurl is installed, and are skipped with the reason printed otherwise. A block whose
 * lines share shell variables (`JOB=$(…)`, `AGENT=…`) runs line by line with the variables
 * carried from one line to the next, as in the terminal it is pasted into.
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
const blocks = [...readme.matchAll(/```sh\n([\s\S]*?)```/g)].map((m) => m[1]!.split('\n').filter((l) => l.trim()));
const lines = (prefix: string) => readme.split('\n').filter((l) => l.startsWith(prefix));
/** The first sh block with a line starting with `prefix` (and containing `has`, when given). */
const block = (prefix: string, has = '') => blocks.find((b) => b.some((l) => l.startsWith(prefix)) && b.some((l) => l.includes(has)))!;
const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_ADMIN_KEY: 'dev-admin-key' });

const grpcurl = await run('grpcurl', ['-version']).then(
  () => true,
  () => false,
);

async function sh(line: string, env: Record<string, string> = {}) {
  const cmd = line.replaceAll('127.0.0.1:50051', `127.0.0.1:${lh.port}`);
  return run('bash', ['-c', cmd], { cwd: root, env: { ...process.env, ...env, PATH: `${path.join(root, 'node_modules/.bin')}:${process.env.PATH}` } });
}

/**
 * Runs a block line by line; `NAME=…` lines set NAME for the lines after them. Returns each
 * command line's stdout, by the method it calls (`AdminService/GetJob`).
 */
async function runBlock(lines: string[]): Promise<Map<string, string>> {
  const env: Record<string, string> = {};
  const outs = new Map<string, string>();
  for (const line of lines) {
    const assign = /^([A-Z_]+)=(.*)$/.exec(line);
    if (assign) {
      const { stdout } = await sh(`${line}; printf %s "$${assign[1]}"`, env);
      expect(stdout, line).not.toBe('');
      env[assign[1]!] = stdout;
      continue;
    }
    const { stdout } = await sh(line, env);
    outs.set(/leasehold\.v1\.(\w+\/\w+)/.exec(line)?.[1] ?? line, stdout);
  }
  return outs;
}

describe('README command lines', () => {
  it('has buf curl and grpcurl lines to check, one of each for every AdminService method', () => {
    expect(lines('npx buf curl').length).toBeGreaterThanOrEqual(4);
    expect(lines('grpcurl ').length).toBeGreaterThanOrEqual(5);
    const methods = [...readFileSync(path.join(root, 'proto/leasehold/v1/admin_service.proto'), 'utf8').matchAll(/^\s*rpc (\w+)\(/gm)].map((m) => m[1]);
    expect(methods.length).toBe(21);
    for (const m of methods) {
      expect(block('npx buf curl', 'AdminService').filter((l) => l.includes(`/leasehold.v1.AdminService/${m} `) || l.endsWith(`/leasehold.v1.AdminService/${m}`)), m).toHaveLength(1);
      expect(block('grpcurl ', 'AdminService').filter((l) => l.includes(` leasehold.v1.AdminService/${m} `) || l.endsWith(` leasehold.v1.AdminService/${m}`)), m).toHaveLength(1);
    }
  });

  it('every `npx buf curl` line of "Try it" works as pasted', async () => {
    const outs: string[] = [];
    for (const l of block('npx buf curl')) {
      const { stdout } = await sh(l);
      outs.push(stdout);
    }
    expect(outs[0]).toMatch(/leasehold\.v1\.AgentService\/Connect/);
    expect(outs[0]).toMatch(/leasehold\.v1\.AdminService\/GetStats/);
    expect(JSON.parse(outs[1]!)).toEqual({ status: 'SERVING' });
    expect(JSON.parse(outs[2]!)).toMatchObject({ job: { queue: 'demo', payload: { hello: 'world' } }, outcome: 'OUTCOME_OK' });
    expect(JSON.parse(outs[3]!).jobs.length).toBe(1);
    // The enqueue line again: the idempotency key returns the same job.
    const again = JSON.parse((await sh(block('npx buf curl')[2]!)).stdout);
    expect(again).toMatchObject({ outcome: 'OUTCOME_DUPLICATE', job: { id: JSON.parse(outs[2]!).job.id } });
  }, 120_000);

  it('the AdminService `buf curl` lines work as pasted, in order', async () => {
    const outs = await runBlock(block('npx buf curl', 'AdminService'));
    const json = (m: string) => JSON.parse(outs.get(m) || '{}');
    expect(json('AdminService/ListJobs').jobs.map((j: { queue: string }) => j.queue)).toContain('demo');
    const job = json('AdminService/GetJob').job;
    expect(job).toMatchObject({ queue: 'demo', payload: { n: 1 }, status: 'JOB_STATUS_QUEUED' });
    expect(json('AdminService/CancelJob')).toMatchObject({ job: { id: job.id, status: 'JOB_STATUS_CANCELED' }, outcome: 'OUTCOME_OK' });
    expect(json('AdminService/RequeueJob')).toMatchObject({ job: { id: job.id, status: 'JOB_STATUS_QUEUED' } });
    expect(json('AdminService/PurgeJobs')).toMatchObject({ dryRun: true });
    expect(json('AdminService/GetStats')).toMatchObject({ windowMinutes: 15 });
    expect(json('AdminService/GetStats').depths).toEqual(expect.arrayContaining([expect.objectContaining({ queue: 'demo', status: 'JOB_STATUS_QUEUED' })]));
    expect(json('AdminService/ListStaleReports')).toEqual({});
    const agent = json('AdminService/CreateAgent');
    expect(agent.token).toMatch(/^lh_agent_/);
    expect(json('AdminService/ListAgents').agents.map((a: { agentId: string }) => a.agentId)).toContain(agent.agentId);
    expect(json('AdminService/DrainAgent')).toEqual({});
    expect(json('AdminService/RevokeAgent')).toMatchObject({ agentId: agent.agentId });
    const key = json('AdminService/CreateKey');
    expect(key).toMatchObject({ scopes: ['enqueue', 'read'], key: expect.stringMatching(/^lh_key_/) });
    expect(json('AdminService/ListKeys').keys.map((k: { name: string }) => k.name)).toContain(key.name);
    expect(json('AdminService/RevokeKey')).toEqual({ name: key.name });
    const subs = json('AdminService/ListSubscriptions').subscriptions as Array<{ id: string; url: string; secret?: string }>;
    const sub = subs.find((x) => x.url.startsWith('https://n8n.example.com/webhook/leasehold-'))!;
    expect(sub).toMatchObject({ queue: 'demo', events: ['job.dead'] });
    expect(sub.secret).toBeUndefined(); // not asked for
    expect(json('AdminService/RotateSubscriptionSecret')).toMatchObject({ subscription: { id: sub.id, secret: expect.stringMatching(/^whsec_/) } });
    expect(json('AdminService/GetNotifySecret').secret).toMatch(/^whsec_/);
    expect(json('AdminService/ListDeliveries')).toEqual({});
    expect(json('AdminService/RetryDeliveries')).toEqual({});
    expect(json('AdminService/DeleteSubscription')).toEqual({ id: sub.id });
  }, 180_000);

  it("the retention section's two `node -e` lines list the day partitions and the dropped days still being swept", async () => {
    const [partitions, gone] = blocks.filter((b) => b.length === 1 && b[0]!.startsWith("node -e 'const pg=require(\"pg\")")).map((b) => b[0]!);
    expect(partitions).toContain('jobs_about');
    expect(gone).toContain('jobs_gone_');
    const day = (await t.pool.query<{ d: string }>(`SELECT to_char((now() AT TIME ZONE 'UTC')::date, 'YYYYMMDD') AS d`)).rows[0]!.d;
    expect((await sh(partitions!, { DATABASE_URL: t.url })).stdout).toContain(`jobs_done_${day}`);
    // A dropped day whose sweep has not run: a gone table, as the purger leaves it when stopped.
    await t.pool.query(`CREATE TABLE "jobs_gone_20000101" (LIKE jobs)`);
    try {
      expect((await sh(gone!, { DATABASE_URL: t.url })).stdout).toContain('jobs_gone_20000101');
    } finally {
      await t.pool.query(`DROP TABLE "jobs_gone_20000101"`);
    }
  });

  it.skipIf(!grpcurl)('every grpcurl line works as pasted', async () => {
    for (const l of block('grpcurl ')) await sh(l);
    await runBlock(block('grpcurl ', 'AdminService'));
  }, 180_000);
  if (!grpcurl) console.log('grpcurl lines not run: grpcurl is not installed on this machine (no Debian or npm package provides it)');
});
