/**
 * An agent revoked while it runs stops for good, against a real coordinator: the revocation ends
 * its stream, its next Hello is refused (`agent … was revoked`), and as at a first start the SDK
 * lets go (handlers aborted, outbox closed and unlocked) and tells it with `refused` instead of
 * reconnecting every few seconds for ever (a revoked name never works again). `leasehold-agent`
 * ends with exit code 1 and one line saying so, also when the token is refused at its start.
 * That a transient failure (a restart, the database down) still reconnects is sdk-session's.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { createInterface } from 'node:readline';
import pino from 'pino';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { createAgent, Outbox, type Agent } from '@leasehold/agent-client';
import { jobEnqueue } from '../server/store/index.js';
import { createApiClients } from '../server/transport/admin-client.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, useCoordinator, waitFor } from './helpers/coordinator.js';
import { root } from './helpers/serve.js';

const t = useTestDb();
const lh = useCoordinator(t);
const dirs: string[] = [];
const agents: Agent[] = [];
const children: ChildProcess[] = [];
afterEach(async () => {
  for (const a of agents.splice(0)) await a.stop();
  for (const c of children.splice(0)) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL');
});
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

const revoke = (agentId: string) => createApiClients({ url: lh.httpUrl, key: ADMIN_KEY }).admin.revokeAgent({ agentId });
async function tempDir(): Promise<string> {
  const d = await mkdtemp(path.join(os.tmpdir(), 'leasehold-revoked-'));
  dirs.push(d);
  return d;
}

describe('an SDK agent revoked while connected', () => {
  it('stops: refused with the reason, handlers aborted, no reconnect, the outbox unlocked', async () => {
    const token = await lh.agent('rev-sdk');
    const outboxDir = await tempDir();
    const agent = createAgent({
      url: lh.url,
      token,
      outboxDir,
      handleSignals: false,
      log: pino({ level: process.env.LEASEHOLD_TEST_LOG ?? 'silent' }),
      reconnect: { baseMs: 20, maxMs: 50 },
    });
    agents.push(agent);
    let running: AbortSignal | undefined;
    let handlerRuns = () => undefined as void;
    const handlerRan = new Promise<void>((r) => (handlerRuns = r));
    agent.handle('rev-q', (_job, ctx) => {
      running = ctx.signal;
      handlerRuns();
      return new Promise((resolve) => ctx.signal.addEventListener('abort', () => resolve({})));
    });
    const disconnects: Array<Error | undefined> = [];
    agent.on('disconnected', ({ error }) => disconnects.push(error));
    await agent.start();
    expect((await jobEnqueue(t.pool, { queue: 'rev-q', payload: {} })).outcome).toBe('ok');
    // Its handler running (an Assign's handler starts only once its start is confirmed: a
    // revocation between the two left no handler to abort, and this test failed once so).
    await handlerRan;

    const refused = once(agent, 'refused');
    await revoke('rev-sdk');
    const [{ error }] = (await refused) as [{ error: Error }];
    expect(error.message).toBe('the coordinator refused this agent: Hello refused: agent rev-sdk was revoked');
    // The revocation ended the welcomed stream; the Hello after it was refused, and that was the last.
    expect(disconnects.map((e) => (e as { details?: string } | undefined)?.details)).toEqual(['agent rev-sdk was revoked', 'Hello refused: agent rev-sdk was revoked']);
    expect(running?.aborted).toBe(true);
    expect(agent.isStopping, 'it stopped itself: nobody called stop()').toBe(false);
    // Its outbox is closed: another process may open it at once.
    const next = new Outbox(outboxDir, pino({ level: 'silent' }));
    await next.open();
    await next.close();
    // Several backoffs (at most 50 ms each) later, still no new stream.
    await new Promise((r) => setTimeout(r, 300));
    expect(disconnects).toHaveLength(2);
  }, 20_000);
});

describe('leasehold-agent with a revoked token', () => {
  /** The runner on a configuration with `token`: its stdout and stderr lines, and its exit code. */
  async function runner(token: string) {
    const dir = await tempDir();
    const config = path.join(dir, 'agent.json');
    await writeFile(config, JSON.stringify({ url: lh.url, token, outboxDir: path.join(dir, 'outbox'), queues: { 'rev-runner': { command: ['true'] } } }));
    const child = spawn(process.execPath, ['agent-client/bin/leasehold-agent.mjs', '--config', config], { cwd: root, env: { ...process.env, LEASEHOLD_LOG_LEVEL: 'info' }, stdio: ['ignore', 'pipe', 'pipe'] });
    children.push(child);
    const stdout: string[] = [];
    const stderr: string[] = [];
    createInterface({ input: child.stdout }).on('line', (l) => stdout.push(l));
    createInterface({ input: child.stderr }).on('line', (l) => stderr.push(l));
    const exited = once(child, 'close').then(([code]) => code as number | null);
    return { child, stdout, stderr, exited };
  }

  it('exits 1 with one line when revoked while serving', async () => {
    const r = await runner(await lh.agent('rev-runner'));
    // A start compiles the runner's TypeScript (tsx): 20 s, as agent-runner.test.ts waits for it.
    await waitFor('the runner serving', () => {
      if (r.child.exitCode !== null) throw new Error(`the runner exited: ${r.stderr.join('\n')}`);
      return r.stdout.some((l) => l.includes('"event":"serving"'));
    }, 20_000);
    await revoke('rev-runner');
    expect(await r.exited).toBe(1);
    expect(r.stderr).toEqual([
      'leasehold-agent: the coordinator refused this agent: Hello refused: agent rev-runner was revoked: stopped (its token no longer works: make a new agent with `leasehold agents add NAME` and put its token in the configuration)',
    ]);
  }, 60_000);

  it('exits 1 with one line when its token is refused at start', async () => {
    const token = await lh.agent('rev-runner-start');
    await revoke('rev-runner-start');
    const r = await runner(token);
    expect(await r.exited).toBe(1);
    expect(r.stderr).toEqual(['leasehold-agent: the coordinator refused this agent: Hello refused: agent rev-runner-start was revoked']);
  }, 30_000);
});
