/**
 * The dispatcher does not claim for a group whose queues it just found empty because a slot was
 * freed; it claims again when jobs can have come (a NOTIFY for the queue, the poll). One job at a
 * time, every completion used to cost a claim that found nothing.
 */
import { once } from 'node:events';
import { expect, it } from 'vitest';
import { jobEnqueue } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { useCoordinator } from './helpers/coordinator.js';
import { RawAgent, toStruct } from './helpers/raw-agent.js';

const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_LEASE_TTL: '30s', LEASEHOLD_CLAIM_TTL: '30s', LEASEHOLD_HEARTBEAT_INTERVAL: '5s' });

it('claims after a NOTIFY, not after every freed slot of a group it found empty', async () => {
  const token = await lh.agent('solo');
  const a = RawAgent.open(`127.0.0.1:${lh.port}`, { agentId: 'solo', token, queues: ['one'], slots: 2 });
  try {
    await a.next('welcome');
    await lh.c.dispatcher.idle(); // the round of the new session's slots: the queue is empty
    const rounds: Array<{ claimed: number }> = [];
    lh.c.dispatcher.on('dispatch:round', (r) => rounds.push(r));
    for (let i = 0; i < 3; i++) {
      const enqueued = await jobEnqueue(t.pool, { queue: 'one', payload: { i } });
      expect(enqueued.outcome).toBe('ok');
      // The enqueue's NOTIFY makes the round that claims it (one job for two free slots: short).
      const assign = (await a.next('assign')).assign;
      expect(assign.jobs).toHaveLength(1);
      const attemptId = assign.jobs[0].attemptId as string;
      a.send({ started: { attemptIds: [attemptId] } });
      await a.next('renewed');
      const credit = once(lh.c.hub, 'credit');
      a.send({ completed: { results: [{ attemptId, result: toStruct({ i }) }] } });
      await a.next('ack');
      await credit;
      a.send({ credit: { n: 1 } });
      await once(lh.c.hub, 'credit');
      // Both freed slots came back: no round ran for them (the group's queue was found empty).
      await lh.c.dispatcher.idle();
      expect(rounds.map((r) => r.claimed)).toEqual(Array.from({ length: i + 1 }, () => 1));
    }
    // The poll (or a reconnected listener) looks again whatever it found before.
    lh.c.dispatcher.wake();
    await lh.c.dispatcher.idle();
    expect(rounds.at(-1)).toMatchObject({ claimed: 0 });
  } finally {
    a.close();
  }
});
