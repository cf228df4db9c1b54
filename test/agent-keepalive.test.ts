/**
 * The gRPC listener PINGs each connection (`LEASEHOLD_AGENT_KEEPALIVE`) and closes one whose ack
 * does not come: an agent whose PC slept or lost its network (here a proxy that drops every byte
 * both ways, the connection left open) had its stream kept open, its held attempts not suspect
 * and its free slots still filled, until the kernel gave its socket up (about 15 minutes). Now its
 * stream ends as lost within two keepalive periods: its attempts suspect, its session gone, and
 * it resumes them when it comes back. A connection that answers its PINGs stays, however quiet.
 */
import { expect, it } from 'vitest';
import { jobEnqueue } from '../server/store/index.js';
import { until, useCoordinator } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { RawAgent } from './helpers/raw-agent.js';
import { startProxy } from './helpers/tcp-proxy.js';

const t = useTestDb();
// Leases and claims far longer than the test: what ends the stream here is the keepalive alone.
// A PING every second, its ack awaited a second: the test's agents live in the coordinator's own
// process, where a stall of 300 ms on a loaded machine could leave an ack unread in time.
const lh = useCoordinator(t, { LEASEHOLD_AGENT_KEEPALIVE: '1s', LEASEHOLD_LEASE_TTL: '120s', LEASEHOLD_CLAIM_TTL: '120s', LEASEHOLD_HEARTBEAT_INTERVAL: '20s' });

it('closes the connection of an agent that stopped answering, ending its stream as lost; a quiet one that answers stays', async () => {
  const proxy = await startProxy(lh.port);
  const quiet = RawAgent.open(`127.0.0.1:${lh.port}`, { agentId: 'ka-quiet', token: await lh.agent('ka-quiet'), queues: ['ka-none'], slots: 1 });
  const gone = RawAgent.open(`127.0.0.1:${proxy.port}`, { agentId: 'ka-gone', token: await lh.agent('ka-gone'), queues: ['ka'], slots: 2 });
  try {
    await quiet.next('welcome');
    await gone.next('welcome');
    const o = await jobEnqueue(t.pool, { queue: 'ka', payload: {} });
    if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
    const attemptId = (await gone.next('assign')).assign.jobs[0].attemptId as string;
    gone.send({ started: { attemptIds: [attemptId] } });
    await until(lh, 'started', async () => (await t.pool.query(`SELECT status::text FROM jobs WHERE id = $1`, [o.value.id])).rows[0].status === 'running');

    proxy.blackhole();
    const suspect = await until(
      lh,
      'the attempt suspect and the session gone',
      async () => {
        const r = (await t.pool.query(`SELECT suspect_since, current_attempt_id FROM jobs WHERE id = $1`, [o.value.id])).rows[0];
        return r.suspect_since !== null && ![...lh.c.hub.sessions].some((s) => s.agentId === 'ka-gone') && r;
      },
      10_000,
    );
    // Still its attempt: it resumes it when it reconnects (the lease has long to run).
    expect(suspect.current_attempt_id).toBe(attemptId);
    // The agent that answers PINGs, and says nothing else, stays through three more periods.
    await new Promise((r) => setTimeout(r, 3000));
    expect([...lh.c.hub.sessions].some((s) => s.agentId === 'ka-quiet')).toBe(true);
    expect(quiet.all('goAway')).toHaveLength(0);
  } finally {
    quiet.close();
    gone.close();
    await proxy.close();
  }
});
