/**
 * Two coordinators on one database: when a second stream of an agent, on the other
 * coordinator, resumes an attempt, the stream that held it is told (Revoke, SUPERSEDED) through
 * NOTIFY, and stops renewing it; the resuming stream completes it.
 */
import { afterEach, expect, it } from 'vitest';
import { jobEnqueue } from '../server/store/index.js';
import { useCoordinator } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { RawAgent, toStruct, type HelloInit } from './helpers/raw-agent.js';

const t = useTestDb();
const env = { LEASEHOLD_LEASE_TTL: '30s', LEASEHOLD_CLAIM_TTL: '30s', LEASEHOLD_HEARTBEAT_INTERVAL: '5s' };
const one = useCoordinator(t, env);
const two = useCoordinator(t, env);
const open: RawAgent[] = [];
const agent = (port: number, hello: HelloInit) => {
  const a = RawAgent.open(`127.0.0.1:${port}`, hello);
  open.push(a);
  return a;
};
afterEach(() => {
  for (const a of open.splice(0)) a.close();
});

it('revokes the attempt on the first stream (another coordinator) when a second stream of the agent resumes it', async () => {
  const token = await one.agent('roamer');
  const a = agent(one.port, { agentId: 'roamer', token, queues: ['roam'], slots: 1 });
  await a.next('welcome');
  const job = await jobEnqueue(t.pool, { queue: 'roam', payload: {} });
  if (job.outcome !== 'ok') throw new Error(JSON.stringify(job));
  const c = (await a.next('assign')).assign.jobs[0];
  a.send({ started: { attemptIds: [c.attemptId] } });
  await a.next('renewed');

  const b = agent(two.port, { agentId: 'roamer', token, queues: ['roam'], slots: 1, resume: [c.attemptId] });
  await b.next('welcome');
  expect((await a.next('revoke', 5000)).revoke).toMatchObject({ attemptIds: [c.attemptId], reason: 'REVOKE_REASON_SUPERSEDED' });
  // The first coordinator no longer counts it as held there.
  expect([...one.c.hub.sessions].some((s) => s.held.has(c.attemptId))).toBe(false);

  b.send({ completed: { results: [{ attemptId: c.attemptId, result: toStruct({ by: 'two' }) }] } });
  expect((await b.next('ack')).ack.items[0].outcome).toBe('OUTCOME_OK');
  expect((await t.pool.query('SELECT result FROM jobs WHERE id = $1', [job.value.id])).rows[0].result).toEqual({ by: 'two' });
});
