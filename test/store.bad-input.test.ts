/**
 * Bad input gets its named outcome and writes nothing: every table keeps its row count.
 */
import { randomUUID } from 'node:crypto';
import { beforeAll, describe, expect, it } from 'vitest';
import {
  attemptComplete,
  attemptFail,
  attemptHeartbeat,
  attemptStart,
  jobCancel,
  jobClaim,
  jobEnqueue,
  jobGet,
  sessionRegister,
  stepRecord,
  stepReserve,
} from '../server/store/index.js';
import { limits } from '../server/domain/validation.js';
import { useTestDb } from './helpers/db.js';
import { makeJob } from './helpers/factories.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();
const TABLES = ['jobs', 'attempts', 'job_events', 'steps', 'stale_reports'];
let running: { attemptId: string; jobId: string };

async function counts() {
  const out: Record<string, number> = {};
  for (const tb of TABLES) out[tb] = (await t.pool.query(`SELECT count(*)::int AS n FROM ${tb}`)).rows[0].n;
  return out;
}

/** Runs `fn`, checks its outcome and that no table changed. */
async function expectNothingWritten(fn: () => Promise<unknown>, expected: Record<string, unknown>) {
  const before = await counts();
  const out = await fn();
  expect(out).toMatchObject(expected);
  expect(await counts()).toEqual(before);
}

beforeAll(async () => {
  const j = await makeJob(t.pool, { status: 'running', agentId: 'a1' });
  running = { attemptId: j.currentAttemptId!, jobId: j.id };
});

describe('enqueue', () => {
  it('refuses an oversized payload with too_large', async () => {
    const payload = { blob: 'x'.repeat(limits.payloadBytes) };
    await expectNothingWritten(() => jobEnqueue(t.pool, { queue: 'q', payload }), {
      outcome: 'too_large',
      field: 'payload',
      limitBytes: limits.payloadBytes,
    });
  });

  it.each([
    ['an array', [1, 2]],
    ['a string', 'hello'],
    ['null', null],
    ['a number', 42],
  ])('refuses a payload that is %s', async (_, payload) => {
    await expectNothingWritten(() => jobEnqueue(t.pool, { queue: 'q', payload }), { outcome: 'invalid', field: 'payload' });
  });

  it('refuses what jsonb cannot hold, naming the path inside the payload', async () => {
    await expectNothingWritten(() => jobEnqueue(t.pool, { queue: 'q', payload: { a: { b: 'nul\u0000' } } }), {
      outcome: 'invalid',
      field: 'payload.a.b',
    });
    await expectNothingWritten(() => jobEnqueue(t.pool, { queue: 'q', payload: { s: '\ud800' } }), {
      outcome: 'invalid',
      field: 'payload.s',
    });
    let deep: Record<string, unknown> = {};
    for (let i = 0; i < 100; i++) deep = { d: deep };
    await expectNothingWritten(() => jobEnqueue(t.pool, { queue: 'q', payload: deep }), { outcome: 'invalid' });
    const cyclic: Record<string, unknown> = {};
    cyclic.self = cyclic;
    await expectNothingWritten(() => jobEnqueue(t.pool, { queue: 'q', payload: cyclic }), { outcome: 'invalid', field: 'payload' });
  });

  it.each([
    ['negative max_attempts', { maxAttempts: -1 }, 'maxAttempts'],
    ['zero max_attempts', { maxAttempts: 0 }, 'maxAttempts'],
    ['fractional priority', { priority: 1.5 }, 'priority'],
    ['an empty queue', { queue: '' }, 'queue'],
    ['a queue with spaces', { queue: 'a b' }, 'queue'],
    ['an invalid run_at', { runAt: new Date('nope') }, 'runAt'],
    ['an idempotency key with a control character', { idempotencyKey: 'a\nb' }, 'idempotencyKey'],
    ['a zero execution timeout', { executionTimeoutMs: 0 }, 'executionTimeoutMs'],
    // jsonb refuses a NUL: it was a StoreError (500) once past the checks.
    ['a label value with a NUL', { labels: { a: '\u0000' } }, 'labels.a'],
    ['a label value with a control character', { labels: { a: 'x\u007f' } }, 'labels.a'],
    ['a label value with a lone surrogate', { labels: { a: '\ud800' } }, 'labels.a'],
    ['a label name with a control character', { labels: { 'a\nb': 'x' } }, 'labels.a\nb'],
  ])('refuses %s', async (_, extra, field) => {
    await expectNothingWritten(() => jobEnqueue(t.pool, { queue: 'q', payload: {}, ...extra }), { outcome: 'invalid', field });
  });
});

describe('ids', () => {
  const malformed = ['', 'not-an-id', '123', "'; DROP TABLE jobs; --", '00000000-0000-0000-0000-00000000000g'];

  it.each(malformed)('refuses the malformed attempt id %j everywhere', async (attemptId) => {
    const ref = { attemptId, agentId: 'a1' };
    await expectNothingWritten(() => attemptStart(t.pool, { ...ref, leaseTtlMs: 1000 }), { outcome: 'invalid', field: 'attemptId' });
    await expectNothingWritten(() => attemptComplete(t.pool, { ...ref, result: {} }), { outcome: 'invalid', field: 'attemptId' });
    await expectNothingWritten(() => attemptFail(t.pool, { ...ref, error: { message: 'x' }, retryable: true }), {
      outcome: 'invalid',
      field: 'attemptId',
    });
    await expectNothingWritten(() => stepReserve(t.pool, { ...ref, step: 's' }), { outcome: 'invalid', field: 'attemptId' });
    await expectNothingWritten(() => attemptHeartbeat(t.pool, { items: [ref], leaseTtlMs: 1000 }), {
      outcome: 'invalid',
      field: 'items.0.attemptId',
    });
  });

  it('gives not_found for an unknown job id and a well-formed unknown attempt id', async () => {
    const unknown = '9b2c6d1e-0000-4000-8000-000000000000';
    await expectNothingWritten(() => jobGet(t.pool, { jobId: unknown }), { outcome: 'not_found' });
    await expectNothingWritten(() => jobCancel(t.pool, { jobId: unknown }), { outcome: 'not_found' });
    await expectNothingWritten(() => attemptComplete(t.pool, { attemptId: unknown, agentId: 'a1', result: {} }), {
      outcome: 'not_found',
    });
    // A real attempt named with the wrong job is not found either.
    await expectNothingWritten(
      () => attemptComplete(t.pool, { attemptId: running.attemptId, jobId: unknown, agentId: 'a1', result: {} }),
      { outcome: 'not_found' },
    );
    await expectNothingWritten(() => jobCancel(t.pool, { jobId: 'nope' }), { outcome: 'invalid', field: 'jobId' });
  });
});

describe('attempt calls', () => {
  it('refuses an oversized or non-object result', async () => {
    const ref = { attemptId: running.attemptId, agentId: 'a1' };
    await expectNothingWritten(() => attemptComplete(t.pool, { ...ref, result: { r: 'x'.repeat(limits.resultBytes) } }), {
      outcome: 'too_large',
      field: 'result',
    });
    await expectNothingWritten(() => attemptComplete(t.pool, { ...ref, result: [1] }), { outcome: 'invalid', field: 'result' });
  });

  it('refuses a failure without a message, and an oversized error', async () => {
    const ref = { attemptId: running.attemptId, agentId: 'a1', retryable: true };
    await expectNothingWritten(() => attemptFail(t.pool, { ...ref, error: { message: '' } }), { outcome: 'invalid', field: 'error.message' });
    await expectNothingWritten(() => attemptFail(t.pool, { ...ref, error: {} as { message: string } }), {
      outcome: 'invalid',
      field: 'error.message',
    });
    await expectNothingWritten(() => attemptFail(t.pool, { ...ref, error: { message: 'x'.repeat(limits.errorBytes) } }), {
      outcome: 'too_large',
      field: 'error',
    });
  });

  it('refuses bad claims: no queues, a zero or huge limit, a bad agent id, a NUL in a label', async () => {
    const base = { agentId: 'a1', queues: ['q'], limit: 1, claimTtlMs: 1000 };
    await expectNothingWritten(() => jobClaim(t.pool, { ...base, queues: [] }), { outcome: 'invalid', field: 'queues' });
    await expectNothingWritten(() => jobClaim(t.pool, { ...base, limit: 0 }), { outcome: 'invalid', field: 'limit' });
    await expectNothingWritten(() => jobClaim(t.pool, { ...base, limit: 1e6 }), { outcome: 'invalid', field: 'limit' });
    await expectNothingWritten(() => jobClaim(t.pool, { ...base, agentId: ' ' }), { outcome: 'invalid', field: 'agentId' });
    await expectNothingWritten(() => jobClaim(t.pool, { ...base, claimTtlMs: 5 }), { outcome: 'invalid', field: 'claimTtlMs' });
    await expectNothingWritten(() => jobClaim(t.pool, { ...base, labels: { a: '\u0000' } }), { outcome: 'invalid', field: 'labels.a' });
  });

  it("refuses an agent session whose labels hold a NUL or a control character (a Hello's labels)", async () => {
    const s = { id: randomUUID(), agentId: 'a1', coordinatorId: randomUUID(), queues: ['q'], slots: 1, connectedAt: new Date() };
    expect(await sessionRegister(t.pool, { ...s, labels: { a: '\u0000' } })).toMatchObject({ outcome: 'invalid', field: 'labels.a', message: 'label values must not contain control characters' });
    expect(await sessionRegister(t.pool, { ...s, labels: { '\u0000': 'x' } })).toMatchObject({ outcome: 'invalid', field: 'labels.\u0000', message: 'label names must not contain control characters' });
    expect((await t.pool.query('SELECT count(*)::int AS n FROM agent_sessions WHERE id = $1', [s.id])).rows[0].n).toBe(0);
  });

  it('refuses a step name that is empty or too long, and an oversized step output', async () => {
    const ref = { attemptId: running.attemptId, agentId: 'a1' };
    await expectNothingWritten(() => stepReserve(t.pool, { ...ref, step: '' }), { outcome: 'invalid', field: 'step' });
    await expectNothingWritten(() => stepReserve(t.pool, { ...ref, step: 's'.repeat(limits.stepNameLength + 1) }), {
      outcome: 'invalid',
      field: 'step',
    });
    await expectNothingWritten(() => stepRecord(t.pool, { ...ref, step: 's', output: 'x'.repeat(limits.stepOutputBytes) }), {
      outcome: 'too_large',
      field: 'output',
    });
  });

  it('leaves the state intact', async () => {
    await checkInvariants(t.pool);
    const row = (await t.pool.query('SELECT status::text, current_attempt_id FROM jobs WHERE id = $1', [running.jobId])).rows[0];
    expect(row).toEqual({ status: 'running', current_attempt_id: running.attemptId });
  });
});
