/**
 * The agent SDK against the coordinator's limits on reports, with a real coordinator:
 * - the SDK's copies of the limits agree with the coordinator's;
 * - a handler's result of 9 MB (over the 8 MiB a message may take, and the 256 KiB a result may)
 *   fails its job for good at once, and the agent goes on working (it used to end every stream
 *   it opened, for ever);
 * - 40 reports of 240 KiB waiting together (about 9.6 MB) are sent again after a reconnect in
 *   several messages, and all go through;
 * - a 9 MB result left in the outbox by an older SDK fails its job for good instead of being sent;
 * - a final failure whose message the coordinator refuses (40 KiB of CJK, a NUL character) is
 *   reported again shortened, still final: one attempt, the job failed, never rerun.
 */
import { once } from 'node:events';
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pino from 'pino';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { createAgent, JobError, Outbox, type Agent, type AgentOptions } from '@leasehold/agent-client';
import { ERROR_MAX_BYTES, FRAME_MAX_BYTES, RESULT_MAX_BYTES, SHORT_MESSAGE_BYTES } from '../agent-client/src/reporter.js';
import { limits } from '../server/domain/validation.js';
import { jobEnqueue } from '../server/store/index.js';
import { READ_MAX_BYTES } from '../server/transport/server.js';
import { useTestDb } from './helpers/db.js';
import { until, useCoordinator } from './helpers/coordinator.js';
import { deferred } from './helpers/deferred.js';
import { makeJob } from './helpers/factories.js';
import { startProxy, type TcpProxy } from './helpers/tcp-proxy.js';

const t = useTestDb();
// Leases long enough for a network cut of a few seconds; a claim that expires fast, should the
// agent hold jobs it does not start.
const lh = useCoordinator(t, { LEASEHOLD_LEASE_TTL: '15s', LEASEHOLD_CLAIM_TTL: '2s', LEASEHOLD_HEARTBEAT_INTERVAL: '500ms' });
const dirs: string[] = [];
const agents: Agent[] = [];
const proxies: TcpProxy[] = [];

async function tmpDir(): Promise<string> {
  const d = await mkdtemp(path.join(os.tmpdir(), 'leasehold-report-limits-'));
  dirs.push(d);
  return d;
}
async function newAgent(token: string, queues: string[], extra: Partial<AgentOptions> = {}): Promise<{ agent: Agent; outboxDir: string }> {
  const outboxDir = extra.outboxDir ?? (await tmpDir());
  const agent = createAgent({
    url: `http://127.0.0.1:${lh.port}`,
    token,
    queues,
    outboxDir,
    handleSignals: false,
    log: pino({ level: process.env.LEASEHOLD_TEST_LOG ?? 'silent' }),
    ...extra,
  });
  agents.push(agent);
  return { agent, outboxDir };
}
async function enqueue(queue: string, payload: Record<string, unknown> = {}, extra: Record<string, unknown> = {}) {
  const o = await jobEnqueue(t.pool, { queue, payload, ...extra });
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  return o.value;
}
const job = async (id: string) =>
  (await t.pool.query('SELECT status::text, result, job_error(id, status) AS error, attempt_no, attempts_started FROM jobs WHERE id = $1', [id])).rows[0];
const ended = async (id: string) => ['succeeded', 'failed', 'dead', 'canceled'].includes((await job(id)).status);

afterEach(async () => {
  for (const a of agents.splice(0)) await a.stop();
  for (const p of proxies.splice(0)) await p.close();
});
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

describe("the SDK's limits", () => {
  it("are the coordinator's: a result and an error as large as it takes, messages well under what it reads", () => {
    expect(RESULT_MAX_BYTES).toBe(limits.resultBytes);
    expect(ERROR_MAX_BYTES).toBe(limits.errorBytes);
    expect(FRAME_MAX_BYTES).toBeLessThanOrEqual(READ_MAX_BYTES / 2);
    // A valid result as protobuf (a Struct of small numbers: 11 bytes for 2 of JSON) fits in one message.
    expect(FRAME_MAX_BYTES).toBeGreaterThan((RESULT_MAX_BYTES / 2) * 11);
  });
});

describe('a result too large', () => {
  it('of 9 MB from a handler fails its job for good at once, and the agent runs the next job', async () => {
    const { agent } = await newAgent(await lh.agent('big-result'), ['big', 'small'], { slots: 2 });
    agent.handle('big', () => ({ data: 'z'.repeat(9_000_000) }));
    agent.handle('small', () => ({ ok: true }));
    const kinds: string[] = [];
    agent.on('finished', ({ kind }) => kinds.push(kind));
    await agent.start();
    const big = await enqueue('big', {}, { maxAttempts: 3 });
    await until(lh, 'the big job ended', () => ended(big.id), 20_000);
    const small = await enqueue('small');
    await until(lh, 'the small job ended', () => ended(small.id), 20_000);
    expect(await job(big.id)).toMatchObject({
      status: 'failed',
      attempt_no: 1,
      attempts_started: 1,
      error: { message: `result refused: result is 9000011 bytes of JSON, over the limit of ${RESULT_MAX_BYTES} (the coordinator's limit, checked by the agent: not sent)` },
    });
    expect(await job(small.id)).toMatchObject({ status: 'succeeded', attempt_no: 1, result: { ok: true } });
    // Failed by the agent as the handler returned: never written to the outbox as a result.
    expect(kinds).toEqual(['failed', 'completed']);
  });

  it('left in the outbox by an older SDK (9 MB) is never sent: its job fails for good, the other reports go through', async () => {
    const token = await lh.agent('legacy-outbox');
    const [big, fine] = [
      await makeJob(t.pool, { status: 'running', agentId: 'legacy-outbox', queue: 'legacy' }),
      await makeJob(t.pool, { status: 'running', agentId: 'legacy-outbox', queue: 'legacy' }),
    ];
    const outboxDir = await tmpDir();
    const old = new Outbox(outboxDir, pino({ level: 'silent' }));
    await old.open();
    const at = new Date().toISOString();
    await old.put({ attemptId: big.currentAttemptId!, jobId: big.id, queue: 'legacy', attemptNo: 1, kind: 'completed', result: { data: 'z'.repeat(9_000_000) }, writtenAt: at });
    await old.put({ attemptId: fine.currentAttemptId!, jobId: fine.id, queue: 'legacy', attemptNo: 1, kind: 'completed', result: { ok: 1 }, writtenAt: at });
    await old.close();

    const { agent } = await newAgent(token, ['legacy'], { outboxDir });
    agent.handle('legacy', () => ({ ok: 2 }));
    await agent.start();
    await until(lh, 'both reports stored', async () => (await ended(big.id)) && (await ended(fine.id)), 20_000);
    expect(await job(big.id)).toMatchObject({ status: 'failed', attempt_no: 1, error: { message: expect.stringMatching(/^result refused: result is 9000011 bytes of JSON, over the limit of 262144/) } });
    expect(await job(fine.id)).toMatchObject({ status: 'succeeded', result: { ok: 1 } });
    // And the agent works.
    const next = await enqueue('legacy');
    await until(lh, 'the next job ended', () => ended(next.id), 20_000);
    expect(await job(next.id)).toMatchObject({ status: 'succeeded', result: { ok: 2 } });
  });
});

describe('many reports waiting together', () => {
  it('40 of 240 KiB (9.6 MB) are sent again after a reconnect in several messages, and all go through', async () => {
    const proxy = await startProxy(lh.port);
    proxies.push(proxy);
    const n = 40;
    const { agent } = await newAgent(await lh.agent('resender'), ['resend'], { slots: n, url: `http://127.0.0.1:${proxy.port}` });
    const gate = deferred();
    const allRunning = deferred();
    let running = 0;
    let finished = 0;
    const allFinished = deferred();
    agent.on('finished', () => ++finished === n && allFinished.resolve());
    agent.handle('resend', async (j) => {
      if (++running === n) allRunning.resolve();
      await gate.promise;
      return { n: j.payload.n, pad: 'p'.repeat(240 * 1024) };
    });
    await agent.start();
    const jobs = [];
    for (let i = 0; i < n; i++) jobs.push(await enqueue('resend', { n: i }));
    await allRunning.promise;
    // The network goes silent: the reports reach the outbox, never the coordinator.
    proxy.blackhole();
    gate.resolve();
    await allFinished.promise;
    // Connections cut: the agent reconnects and sends every report in its outbox again.
    const reconnected = once(agent, 'connected');
    proxy.cutAll();
    await reconnected;
    const ids = jobs.map((j) => j.id);
    const count = async () => (await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE id = ANY($1) AND status = 'succeeded' AND attempt_no = 1`, [ids])).rows[0].n as number;
    await until(lh, 'every job succeeded at its first attempt', async () => (await count()) === n, 30_000);
    expect((await job(ids[7]!)).result).toMatchObject({ n: 7 });
  });
});

describe('a final failure the coordinator refuses', () => {
  it.each([
    ['40 KiB of CJK (over the 16 KiB an error may take)', 'cjk'],
    ['a NUL character (which PostgreSQL refuses)', 'nul'],
  ] as const)('is reported again shortened, still final: one attempt, the job failed (%s)', async (_, kind) => {
    const queue = `final-${kind}`;
    const { agent } = await newAgent(await lh.agent(`final-${kind}`), [queue]);
    const cjk = '系统找不到指定的文件。'.repeat(1250); // 41 250 bytes of UTF-8
    agent.handle(queue, () => {
      throw new JobError(kind === 'cjk' ? cjk : 'E\u0000r\u0000r\u0000o\u0000r', { retryable: false, details: { exitCode: 3, stderr: kind === 'nul' ? 'x\u0000y' : 'short' } });
    });
    await agent.start();
    const j = await enqueue(queue, {}, { maxAttempts: 3 });
    await until(lh, 'the job ended', () => ended(j.id), 20_000);
    const row = await job(j.id);
    expect(row).toMatchObject({ status: 'failed', attempt_no: 1, attempts_started: 1 });
    const message = row.error.message as string;
    if (kind === 'cjk') {
      expect(message.startsWith(cjk.slice(0, 100))).toBe(true);
      expect(message).toMatch(/… \(shortened by the agent: the message was 41252 bytes of JSON\)$/);
      expect(Buffer.byteLength(JSON.stringify(message))).toBeLessThanOrEqual(SHORT_MESSAGE_BYTES);
      expect(row.error.details).toEqual({ exitCode: 3, stderr: 'short' });
    } else {
      expect(message).toBe('E\uFFFDr\uFFFDr\uFFFDo\uFFFDr');
      expect(row.error.details).toEqual({ exitCode: 3, stderr: 'x\uFFFDy' });
    }
  });
});
