/**
 * Access, as an attacker with some credentials would try it, over the real listeners: one
 * agent's token cannot touch another agent's attempt (stream or unary); a `read` key cannot
 * enqueue; a revoked key fails at its next call; a revoked agent token fails at once, and its
 * open stream is ended. Nothing the refused calls carried is written.
 */
import { afterEach, describe, expect, it } from 'vitest';
import { jobEnqueue } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, until, useCoordinator } from './helpers/coordinator.js';
import { rpc } from './helpers/http.js';
import { grpc, RawAgent, rawClient, toStruct, unary } from './helpers/raw-agent.js';

const t = useTestDb();
const lh = useCoordinator(t);
const open: RawAgent[] = [];
afterEach(() => {
  for (const a of open.splice(0)) a.close();
});
const agent = (...args: Parameters<typeof RawAgent.open>) => {
  const a = RawAgent.open(...args);
  open.push(a);
  return a;
};
const admin = (method: string, body: unknown) => rpc(lh.httpUrl, `leasehold.v1.AdminService/${method}`, body, ADMIN_KEY);

describe('access', () => {
  it("agent B's token cannot start, complete or fail agent A's attempt, on the stream or by unary calls", async () => {
    const [ta, tb] = [await lh.agent('acc-a'), await lh.agent('acc-b')];
    const a = agent(`127.0.0.1:${lh.port}`, { agentId: 'acc-a', token: ta, queues: ['acc'], slots: 1 });
    const b = agent(`127.0.0.1:${lh.port}`, { agentId: 'acc-b', token: tb, queues: ['nothing'], slots: 1 });
    await a.next('welcome');
    await b.next('welcome');
    const enq = await jobEnqueue(t.pool, { queue: 'acc', payload: {} });
    if (enq.outcome !== 'ok') throw new Error('enqueue');
    const c = (await a.next('assign')).assign.jobs[0];

    b.send({ completed: { results: [{ attemptId: c.attemptId, result: toStruct({ stolen: true }) }] } });
    expect((await b.next('ack')).ack.items[0].outcome).toBe('OUTCOME_FORBIDDEN');
    b.send({ started: { attemptIds: [c.attemptId] } });
    expect((await b.next('revoke')).revoke).toMatchObject({ attemptIds: [c.attemptId], reason: 'REVOKE_REASON_NOT_STARTED' });

    const client = rawClient('AttemptService', `127.0.0.1:${lh.port}`);
    try {
      for (const [method, req] of [
        ['startAttempt', { jobId: enq.value.id, attemptId: c.attemptId }],
        ['completeAttempt', { jobId: enq.value.id, attemptId: c.attemptId, result: toStruct({ stolen: true }) }],
        ['failAttempt', { jobId: enq.value.id, attemptId: c.attemptId, error: { message: 'x' }, retryable: false }],
      ] as const) {
        const err = (await unary(client, method, req, tb).catch((e: grpc.ServiceError) => e)) as grpc.ServiceError;
        expect(err.code, method).toBe(grpc.status.PERMISSION_DENIED);
      }
    } finally {
      client.close();
    }
    const row = (await t.pool.query(`SELECT status::text, current_attempt_id, result FROM jobs WHERE id = $1`, [enq.value.id])).rows[0];
    expect(row).toEqual({ status: 'claimed', current_attempt_id: c.attemptId, result: null });
  });

  it('a read key cannot enqueue; a revoked key fails at its next call', async () => {
    const made = await admin('CreateKey', { name: 'acc-reader', scopes: ['read'] });
    expect(made.status).toBe(200);
    const key = made.json.key as string;
    expect((await rpc(lh.httpUrl, 'leasehold.v1.JobService/ListJobs', {}, key)).status).toBe(200);
    const enq = await rpc(lh.httpUrl, 'leasehold.v1.JobService/EnqueueJob', { queue: 'acc', payload: {} }, key);
    expect(enq.status).toBe(403);
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE queue = 'acc' AND payload = '{}' AND created_at > now() - interval '1 minute'`)).rows[0].n).toBeLessThanOrEqual(1);

    expect((await admin('RevokeKey', { name: 'acc-reader' })).status).toBe(200);
    const after = await rpc(lh.httpUrl, 'leasehold.v1.JobService/ListJobs', {}, key);
    expect(after.status).toBe(401);
  });

  it("a revoked agent's open stream is ended at once and its token refused from then on", async () => {
    const token = await lh.agent('acc-revoked');
    const a = agent(`127.0.0.1:${lh.port}`, { agentId: 'acc-revoked', token, queues: ['acc-r'], slots: 1 });
    await a.next('welcome');
    const t0 = Date.now();
    expect((await admin('RevokeAgent', { agentId: 'acc-revoked' })).status).toBe(200);
    const end = await a.ended;
    expect(end.code).toBe(grpc.status.UNAUTHENTICATED);
    expect(Date.now() - t0).toBeLessThan(2000);
    await until(lh, 'session gone', () => ![...lh.c.hub.sessions].some((s) => s.agentId === 'acc-revoked'));

    const again = agent(`127.0.0.1:${lh.port}`, { agentId: 'acc-revoked', token, queues: ['acc-r'], slots: 1 });
    expect((await again.ended).code).toBe(grpc.status.UNAUTHENTICATED);
    const client = rawClient('AttemptService', `127.0.0.1:${lh.port}`);
    try {
      const err = (await unary(client, 'claimJobs', { queues: ['acc-r'] }, token).catch((e: grpc.ServiceError) => e)) as grpc.ServiceError;
      expect(err.code).toBe(grpc.status.UNAUTHENTICATED);
    } finally {
      client.close();
    }
  });
});
