/**
 * A step whose ledger call loses its answer (the connection drops after the coordinator acted)
 * is finished by the same attempt: the SDK sends the call again once it can, and both calls are
 * idempotent for their attempt. Before, the handler got UNAVAILABLE and the attempt failed; a lost
 * reservation then left the step unknown, and without `onUnknown` the next attempt failed the job
 * for good, though the effect had never run.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pino from 'pino';
import { afterAll, expect, it } from 'vitest';
import { createAgent, type JobContext } from '@leasehold/agent-client';
import { jobEnqueue } from '../server/store/index.js';
import { useCoordinator, waitFor } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { startProxy, type TcpProxy } from './helpers/tcp-proxy.js';

const t = useTestDb();
// A lease far longer than the cut takes, so that only the ledger call is at stake.
const lh = useCoordinator(t, { LEASEHOLD_LEASE_TTL: '6s', LEASEHOLD_HEARTBEAT_INTERVAL: '500ms' });
const dirs: string[] = [];
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

const stepRow = async (jobId: string) =>
  (await t.pool.query(`SELECT status::text, attempt_id::text, output FROM steps WHERE job_id = $1 AND step = 'charge'`, [jobId])).rows[0] as
    | { status: string; attempt_id: string; output: unknown }
    | undefined;

/**
 * Runs one job whose handler makes the step `charge` through a proxy: `lose` mutes the answers
 * (before the reservation, or inside the effect, before its record), and once the ledger shows
 * the call was done the connection is cut.
 */
async function lostAnswer(queue: string, lose: 'reserve' | 'record') {
  const proxy: TcpProxy = await startProxy(lh.port);
  const outboxDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-step-retry-'));
  dirs.push(outboxDir);
  const agent = createAgent({
    url: `http://127.0.0.1:${proxy.port}`,
    token: await lh.agent(`${queue}-agent`),
    queues: [queue],
    outboxDir,
    handleSignals: false,
    reconnect: { baseMs: 50, maxMs: 200 },
    log: pino({ level: process.env.LEASEHOLD_TEST_LOG ?? 'silent' }),
  });
  let effects = 0;
  const attempts: string[] = [];
  agent.handle(queue, async (job, ctx: JobContext) => {
    attempts.push(ctx.attempt.id);
    if (attempts.length > 1) return ctx.step('charge', () => ({ charged: 'again' }));
    if (lose === 'reserve') proxy.muteDownstream();
    const step = ctx.step('charge', () => {
      effects++;
      if (lose === 'record') proxy.muteDownstream();
      return { charged: job.payload.amount };
    });
    step.catch(() => undefined); // awaited below
    const done = lose === 'reserve' ? (r?: { status: string }) => r !== undefined : (r?: { status: string }) => r?.status === 'done';
    await waitFor(`the ${lose} done in the ledger`, async () => done(await stepRow(job.id)));
    proxy.cutAll();
    return step;
  });
  try {
    await agent.start();
    const enq = await jobEnqueue(t.pool, { queue, payload: { amount: 7 } });
    if (enq.outcome !== 'ok') throw new Error(JSON.stringify(enq));
    const job = await waitFor('the job finished', async () => {
      const r = (await t.pool.query(`SELECT status::text, attempt_no, result FROM jobs WHERE id = $1`, [enq.value.id])).rows[0];
      return r.status === 'queued' || r.status === 'claimed' || r.status === 'running' ? undefined : r;
    }, 20_000);
    return { job, effects, attempts, step: await stepRow(enq.value.id) };
  } finally {
    await agent.stop();
    await proxy.close();
  }
}

it.each([
  ['reservation', 'reserve'],
  ['record', 'record'],
] as const)('finishes a step in the same attempt when the answer to its %s is lost', async (_, lose) => {
  const r = await lostAnswer(`step-${lose}-lost`, lose);
  expect(r.job).toMatchObject({ status: 'succeeded', attempt_no: 1, result: { charged: 7 } });
  expect(r.attempts).toHaveLength(1);
  expect(r.effects).toBe(1);
  expect(r.step).toEqual({ status: 'done', attempt_id: r.attempts[0], output: { charged: 7 } });
});
