/**
 * The agent counts a lease from when it sent the heartbeat the coordinator renewed it for, not
 * from when the renewal arrived. On a slow way back (or in the socket of a process that was
 * frozen) a renewal can arrive long after it was made: counted from its arrival, the agent's
 * deadline would outlive the coordinator's lease, and its work could go on after the job was
 * given to another agent.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pino from 'pino';
import { afterAll, expect, it } from 'vitest';
import { createAgent } from '@leasehold/agent-client';
import { jobEnqueue } from '../server/store/index.js';
import { useCoordinator, waitFor } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { startProxy } from './helpers/tcp-proxy.js';

const t = useTestDb();
// A lease long enough that renewals coming back 1 s late still keep it (4 s − one 500 ms
// interval after each heartbeat is sent). Late by 1 s, not more: the agent hears nothing for up
// to the delay plus one interval when the delay begins, and past 2 s (its silence floor) it would
// leave for another address; at 1.5 s a busy machine crossed that now and then, and 1.2 s left
// it 300 ms. At 1 s both sides have 500 ms: the silence floor, and the lease against a deadline
// counted from arrival (1 s + 3.5 s after the heartbeat, past the 4 s lease).
const lh = useCoordinator(t, { LEASEHOLD_LEASE_TTL: '4s', LEASEHOLD_HEARTBEAT_INTERVAL: '500ms' });
const dirs: string[] = [];
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

it('renewals that come back late do not stretch the local deadline past the coordinator’s lease', async () => {
  const proxy = await startProxy(lh.port);
  const outboxDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-slow-'));
  dirs.push(outboxDir);
  const agent = createAgent({
    url: `http://127.0.0.1:${proxy.port}`,
    token: await lh.agent('slow-way-back'),
    queues: ['slow'],
    outboxDir,
    handleSignals: false,
    log: pino({ level: process.env.LEASEHOLD_TEST_LOG ?? 'silent' }),
  });
  try {
    let began = false;
    let reason = '';
    let abortedAt = 0;
    agent.handle('slow', (_j, ctx) => {
      began = true;
      return new Promise((resolve) =>
        ctx.signal.addEventListener('abort', () => {
          reason = String((ctx.signal.reason as Error).message);
          abortedAt = Date.now();
          resolve({});
        }),
      );
    });
    await agent.start();
    const enq = await jobEnqueue(t.pool, { queue: 'slow', payload: {} });
    if (enq.outcome !== 'ok') throw new Error(JSON.stringify(enq));
    await waitFor('handler running', () => began);
    // Renewals now come back 1 s after they were made; the heartbeats still arrive at once.
    proxy.delayDownstream(1000);
    await waitFor('several late renewals arrived, the attempt still alive', () => proxy.delayed >= 4 && reason === '', 10_000);
    // Then the network goes silent: no heartbeat reaches the coordinator, whose lease runs out
    // 4 s after the last one it got; the renewals already on their way still arrive.
    proxy.blackhole();
    let lease = 0; // the coordinator's lease, as last renewed (the row forgets it once the job is requeued)
    await waitFor('aborted locally', async () => {
      const { expires } = (await t.pool.query(`SELECT lease_expires_at AS expires FROM jobs WHERE id = $1`, [enq.value.id])).rows[0];
      if (expires) lease = Math.max(lease, (expires as Date).getTime());
      return reason !== '';
    }, 10_000);
    expect(reason).toMatch(/local lease deadline passed/);
    // Before the coordinator's lease ran out (counted from arrival, it was after it).
    console.log(`aborted ${lease - abortedAt} ms before the coordinator's lease ran out`);
    expect(lease).toBeGreaterThan(0);
    expect(abortedAt).toBeLessThan(lease);
  } finally {
    await agent.stop();
    await proxy.close();
  }
});
