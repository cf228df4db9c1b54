/**
 * A freed slot rides with the report that frees it (Completed.credit) when the coordinator says
 * it reads it there (Welcome.credit_with_reports), and goes as a Credit of its own otherwise:
 * against the real coordinator, and against a fake one that speaks the protocol as it was
 * before the field (grpc-js from the .proto files, Welcome without it).
 */
import { randomUUID } from 'node:crypto';
import { mkdtemp, rm } from 'node:fs/promises';
import { once } from 'node:events';
import os from 'node:os';
import path from 'node:path';
import pino from 'pino';
import { afterAll, afterEach, describe, expect, it, vi } from 'vitest';
import { createAgent, type Agent } from '@leasehold/agent-client';
import { jobEnqueue } from '../server/store/index.js';
import type { AgentInput } from '../server/core/agent-hub.js';
import { useTestDb } from './helpers/db.js';
import { until, useCoordinator } from './helpers/coordinator.js';
import { grpc, services } from './helpers/raw-agent.js';

const t = useTestDb();
const lh = useCoordinator(t);
const dirs: string[] = [];
const agents: Agent[] = [];
const servers: grpc.Server[] = [];

async function start(url: string, token: string, queue: string): Promise<Agent> {
  const outboxDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-credit-'));
  dirs.push(outboxDir);
  const agent = createAgent({ url, token, queues: [queue], slots: 1, outboxDir, handleSignals: false, log: pino({ level: 'silent' }) });
  agents.push(agent);
  return agent;
}

afterEach(async () => {
  vi.restoreAllMocks();
  for (const a of agents.splice(0)) await a.stop();
  for (const s of servers.splice(0)) s.forceShutdown();
});
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

describe('credit with reports', () => {
  it('sends no Credit message to this coordinator: each Completed carries the slot it frees', async () => {
    const seen: AgentInput[] = [];
    const handle = lh.c.hub.handle.bind(lh.c.hub);
    vi.spyOn(lh.c.hub, 'handle').mockImplementation((s, m) => {
      seen.push(m);
      return handle(s, m);
    });
    const agent = await start(`http://127.0.0.1:${lh.port}`, await lh.agent('carrier'), 'carrier');
    agent.handle('carrier', async () => ({}));
    await agent.start();
    // One slot: the second job is assigned only once the first one's credit has arrived.
    const ids: string[] = [];
    for (let i = 0; i < 5; i++) {
      const o = await jobEnqueue(t.pool, { queue: 'carrier', payload: { i } });
      if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
      ids.push(o.value.id);
    }
    await until(lh, 'all five done', async () => (await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE id = ANY($1) AND status = 'succeeded'`, [ids])).rows[0].n === 5);
    expect(seen.filter((m) => m.type === 'credit')).toEqual([]);
    const carried = seen.flatMap((m) => (m.type === 'completed' ? [m.credit ?? 0] : []));
    expect(carried.reduce((a, b) => a + b, 0)).toBe(5);
  });

  it('sends a Credit of its own to a coordinator whose Welcome does not offer it', async () => {
    const received: Array<Record<string, any>> = [];
    let credited!: () => void;
    const credit = new Promise<void>((r) => (credited = r));
    const attemptId = randomUUID();
    const server = new grpc.Server();
    servers.push(server);
    server.addService(services.AgentService!.service, {
      connect(call: grpc.ServerDuplexStream<any, any>) {
        const ttl = { seconds: 30 };
        call.on('data', (m: Record<string, any>) => {
          received.push(m);
          if (m.kind === 'hello') {
            call.write({ welcome: { sessionId: 'old', leaseTtl: ttl, heartbeatInterval: { seconds: 10 } } });
            const job = { id: randomUUID(), queue: 'old', payload: { fields: {} }, attemptNo: 1 };
            call.write({ assign: { jobs: [{ job, attemptId, attemptNo: 1, claimDeadline: { seconds: Math.floor(Date.now() / 1000) + 30 } }] } });
          }
          if (m.kind === 'started') call.write({ renewed: { attemptIds: m.started.attemptIds, leaseTtl: ttl, seq: m.started.seq } });
          if (m.kind === 'completed') call.write({ ack: { items: m.completed.results.map((r: any) => ({ attemptId: r.attemptId, outcome: 'OUTCOME_OK' })) } });
          if (m.kind === 'credit') credited();
        });
        call.on('error', () => undefined);
      },
    });
    const port = await new Promise<number>((resolve, reject) =>
      server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (err, p) => (err ? reject(err) : resolve(p))),
    );
    const agent = await start(`http://127.0.0.1:${port}`, 'any-token', 'old');
    agent.handle('old', async () => ({ done: true }));
    const acked = once(agent, 'acked');
    await agent.start();
    await acked;
    await credit;
    const completed = received.find((m) => m.kind === 'completed')!;
    expect(completed.completed.results.map((r: any) => r.attemptId)).toEqual([attemptId]);
    expect(completed.completed.credit ?? 0).toBe(0);
    expect(received.filter((m) => m.kind === 'credit').map((m) => m.credit.n)).toEqual([1]);
  });
});
