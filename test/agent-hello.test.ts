/**
 * A stream that never says Hello is not held open: it is closed with DEADLINE_EXCEEDED after
 * `LEASEHOLD_HELLO_TIMEOUT`, and at most `LEASEHOLD_HELLO_PENDING_MAX` streams may wait for their
 * Hello at once (one more ends the one that waited longest, with RESOURCE_EXHAUSTED), while agents
 * that do say Hello are served throughout, also while a client keeps the bound full.
 */
import { afterEach, expect, it } from 'vitest';
import { useCoordinator } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { grpc, RawAgent, type HelloInit } from './helpers/raw-agent.js';

const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_HELLO_TIMEOUT: '1500ms', LEASEHOLD_HELLO_PENDING_MAX: '2' });
const open: RawAgent[] = [];
const agent = (hello: HelloInit | null) => {
  const a = RawAgent.open(`127.0.0.1:${lh.port}`, hello);
  open.push(a);
  return a;
};
afterEach(() => {
  for (const a of open.splice(0)) a.close();
});

it('closes a silent stream after the Hello timeout and refuses silent streams beyond the bound', async () => {
  const opened = Date.now();
  const silent = [agent(null), agent(null), agent(null)];
  // Two may wait; the third to arrive ends the first at once.
  const ends = await Promise.all(silent.map((s) => s.ended.then((e) => ({ ...e, afterMs: Date.now() - opened }))));
  const refused = ends.filter((e) => e.code === grpc.status.RESOURCE_EXHAUSTED);
  const timedOut = ends.filter((e) => e.code === grpc.status.DEADLINE_EXCEEDED);
  expect(refused).toHaveLength(1);
  expect(refused[0]!.details).toMatch(/too many streams waiting to say Hello \(2\): this one, which waited longest, was ended/);
  expect(refused[0]!.afterMs).toBeLessThan(1500);
  expect(timedOut).toHaveLength(2);
  for (const e of timedOut) {
    expect(e.details).toMatch(/no Hello within 1500 ms of opening the stream/);
    expect(e.afterMs).toBeGreaterThanOrEqual(1400);
  }

  // They no longer count: an agent that says Hello is answered, and its error reads as sent
  // (grpc-js decodes only what the gRPC spec encodes: no "%3A" for the colon).
  const stranger = agent({ agentId: 'stranger', token: 'lh_agent_wrong', queues: ['hello'], slots: 1 });
  const no = await stranger.ended;
  expect(no.code).toBe(grpc.status.UNAUTHENTICATED);
  expect(no.details).toMatch(/^Hello refused: /);
  const token = await lh.agent('polite');
  const polite = agent({ agentId: 'polite', token, queues: ['hello'], slots: 1 });
  await polite.next('welcome');
});

it('lets an agent in while a client without a credential keeps the streams waiting for Hello at the bound', async () => {
  // The client holds two silent streams (the bound) and opens another whenever one is ended,
  // as one that meant to shut agents out would. Before, every agent was refused while it did.
  let holding = true;
  const hold = async () => {
    while (holding) await agent(null).ended;
  };
  const holders = [hold(), hold()];
  await new Promise((r) => setTimeout(r, 100));
  const token = await lh.agent('through');
  for (let i = 0; i < 5; i++) {
    const a = agent({ agentId: 'through', token, queues: ['hello'], slots: 1 });
    await a.next('welcome');
    a.close();
    await a.ended;
  }
  holding = false;
  for (const a of open) a.close();
  await Promise.all(holders);
});
