/**
 * A rolling restart under load: two coordinators on one database, an SDK agent that knows both,
 * jobs running all the while; each coordinator is stopped gracefully and started again (on the
 * same port) in turn. A stopping coordinator tells its streams to go (GoAway, then UNAVAILABLE);
 * the agent moves to the other at once and resumes what it holds. Nothing may be lost, no handler
 * may run twice, and nothing may be revoked because of the restarts.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pino from 'pino';
import { afterAll, expect, it } from 'vitest';
import { createAgent, type Agent } from '@leasehold/agent-client';
import type { Coordinator } from '../server/coordinator.js';
import { agentCreate, jobEnqueue } from '../server/store/index.js';
import { handlerGate, watchAgent } from './helpers/agent-watch.js';
import { waitFor } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { freePort } from './helpers/ports.js';
import { replica } from './helpers/replicas.js';

const t = useTestDb();
const log = pino({ level: process.env.LEASEHOLD_TEST_LOG ?? 'silent' });
const cleanups: Array<() => Promise<unknown>> = [];
afterAll(async () => {
  for (const c of cleanups.reverse()) await c().catch(() => undefined);
});

it('restarts each of two coordinators in turn under load: 0 jobs lost, 0 handlers run twice, 0 attempts revoked', async () => {
  const ports = [await freePort(), await freePort()];
  const live: Array<Coordinator | undefined> = [await replica(t.url, ports[0]!), await replica(t.url, ports[1]!)];
  cleanups.push(async () => {
    for (const c of live) await c?.stop();
  });

  const made = await agentCreate(t.pool, { agentId: 'roller' });
  if (made.outcome !== 'ok') throw new Error(JSON.stringify(made));
  const outboxDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-rolling-'));
  cleanups.push(() => rm(outboxDir, { recursive: true, force: true }));
  const agent: Agent = createAgent({
    url: ports.map((p) => `http://127.0.0.1:${p}`),
    token: made.value.token,
    queues: ['rolling'],
    slots: 4,
    outboxDir,
    handleSignals: false,
    log,
  });
  cleanups.push(() => agent.stop());
  const { runs, aborted, connected, ran } = watchAgent(agent);
  const ends: Array<{ code?: number; details?: string }> = [];
  agent.on('disconnected', (d) => ends.push({ code: (d.error as { code?: number } | undefined)?.code, details: (d.error as { details?: string } | undefined)?.details }));
  // While a coordinator is being stopped its handlers wait, so that the stream it moves holds
  // running jobs whatever the machine's speed.
  const gate = handlerGate();
  agent.handle('rolling', async (job) => {
    ran(job.id);
    await gate.passed();
    await new Promise((r) => setTimeout(r, 150 + (Number((job.payload as { n: number }).n) % 5) * 50));
    return { n: (job.payload as { n: number }).n };
  });
  await agent.start();

  const TOTAL = 80;
  const ids: string[] = [];
  for (let n = 0; n < TOTAL; n++) {
    const o = await jobEnqueue(t.pool, { queue: 'rolling', payload: { n } });
    if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
    ids.push(o.value.id);
  }
  const done = async () =>
    Number((await t.pool.query(`SELECT count(*) FROM jobs WHERE id = ANY($1::uuid[]) AND status = 'succeeded'`, [ids])).rows[0].count);

  // Restart each coordinator in turn while jobs run: the agent is on the first to begin with.
  for (const i of [0, 1]) {
    gate.close();
    const before = await done();
    await waitFor('jobs running', () => agent.runningAttempts.length > 0, 10_000);
    const sessions = connected.length;
    await live[i]!.stop();
    live[i] = undefined;
    // The agent moved to the other coordinator (a new session), with work in hand.
    await waitFor('reconnected elsewhere', () => connected.length > sessions, 10_000);
    live[i] = await replica(t.url, ports[i]!);
    gate.open();
    await waitFor('progress after the restart', async () => (await done()) > before + 5, 20_000);
  }
  await waitFor('every job done', async () => (await done()) === TOTAL, 60_000);

  // Nothing lost, nothing run twice, nothing revoked.
  expect(ids.filter((id) => runs.get(id) !== 1)).toEqual([]);
  expect(aborted).toEqual([]);
  const attempts = (await t.pool.query(`SELECT status::text AS status, count(*)::int AS n FROM attempt_log WHERE job_id = ANY($1::uuid[]) GROUP BY 1`, [ids])).rows;
  expect(attempts).toEqual([{ status: 'succeeded', n: TOTAL }]);
  expect((await t.pool.query(`SELECT max(attempt_no)::int AS m FROM jobs WHERE id = ANY($1::uuid[])`, [ids])).rows[0].m).toBe(1);
  expect(connected.length).toBeGreaterThanOrEqual(3);
  // Each stopping coordinator ended its stream with UNAVAILABLE after GoAway, not with OK.
  expect(ends).toHaveLength(2);
  for (const e of ends) expect(e).toEqual({ code: 14, details: expect.stringMatching(/^this coordinator is stopping: reconnect/) });
}, 120_000);
