/**
 * The agent SDK in-process against a real coordinator: results, the outbox, abort signals,
 * the step ledger. (Crash tests with real agent processes are in sdk-crash.test.ts.)
 */
import { existsSync } from 'node:fs';
import { appendFile, mkdtemp, readdir, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { once } from 'node:events';
import pino from 'pino';
import { afterAll, afterEach, describe, expect, it, vi } from 'vitest';
import { createAgent, JobError, Outbox, readOutbox, type Agent, type AgentEvents, type AgentOptions } from '@leasehold/agent-client';
import { encodeRecord } from '../agent-client/src/outbox-log.js';
import { attemptStart, jobClaim, jobEnqueue } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, until, useCoordinator, waitFor } from './helpers/coordinator.js';
import { deferred } from './helpers/deferred.js';
import { checkInvariants } from './helpers/invariants.js';
import { rawClient, unary } from './helpers/raw-agent.js';
import { startProxy, type TcpProxy } from './helpers/tcp-proxy.js';

const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_LEASE_TTL: '1500ms', LEASEHOLD_HEARTBEAT_INTERVAL: '300ms' });
const HEARTBEAT_MS = 300;
const dirs: string[] = [];
const agents: Agent[] = [];
const proxies: TcpProxy[] = [];

async function newAgent(name: string, queues: string[], extra: Partial<AgentOptions> = {}): Promise<{ agent: Agent; outboxDir: string }> {
  const token = await lh.agent(name);
  const outboxDir = extra.outboxDir ?? (await mkdtemp(path.join(os.tmpdir(), 'leasehold-outbox-')));
  dirs.push(outboxDir);
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
const job = async (id: string) => (await t.pool.query('SELECT status::text, result, job_error(id, status) AS error, attempt_no FROM jobs WHERE id = $1', [id])).rows[0];

afterEach(async () => {
  for (const a of agents.splice(0)) await a.stop();
  for (const p of proxies.splice(0)) await p.close();
});
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

describe('createAgent', () => {
  it('hears its ack no sooner than the coordinator\'s completion linger after the handler finished (20 ms by default)', async () => {
    expect(lh.config.completionLingerMs).toBe(20);
    const { agent } = await newAgent('sdk-linger', ['sdk-linger']);
    agent.handle('sdk-linger', async () => ({ ok: true }));
    let finishedAt = 0;
    agent.on('finished', () => (finishedAt = performance.now()));
    await agent.start();
    const queued = lh.c.hub.batcher.stats.queuedMs;
    const j = await enqueue('sdk-linger');
    await once(agent, 'acked');
    // The completion found no other to share its statement with, so it waited the whole linger
    // (a timer's millisecond rounding aside) before its statement, and the ack came after that.
    expect(performance.now() - finishedAt).toBeGreaterThanOrEqual(19);
    expect(lh.c.hub.batcher.stats.queuedMs - queued).toBeGreaterThanOrEqual(19);
    expect(await job(j.id)).toMatchObject({ status: 'succeeded', result: { ok: true } });
  });

  it('runs a handler, stores its result, and empties the outbox on the ack', async () => {
    const { agent, outboxDir } = await newAgent('sdk-basic', ['sdk-basic']);
    agent.handle('sdk-basic', async (j, ctx) => ({ doubled: (j.payload.n as number) * 2, attempt: ctx.attempt.number, key: ctx.idempotencyKey('mail') }));
    await agent.start();
    const j = await enqueue('sdk-basic', { n: 21 });
    await once(agent, 'acked');
    expect(await job(j.id)).toMatchObject({ status: 'succeeded', result: { doubled: 42, attempt: 1, key: `${j.id}:mail` } });
    expect(await readOutbox(outboxDir)).toEqual({ pending: [], superseded: [] });
  });

  it('reports a thrown error as a retryable failure, and JobError{retryable:false} as final', async () => {
    const { agent } = await newAgent('sdk-fail', ['sdk-fail']);
    agent.handle('sdk-fail', async (j) => {
      if (j.payload.final) throw new JobError('bad input', { retryable: false, details: { field: 'x' } });
      throw new Error('flaky');
    });
    await agent.start();
    const a = await enqueue('sdk-fail', { final: false }, { maxAttempts: 1 });
    const b = await enqueue('sdk-fail', { final: true });
    await until(lh, 'both ended', async () => (await job(a.id)).status === 'dead' && (await job(b.id)).status === 'failed');
    expect((await job(a.id)).error).toEqual({ message: 'flaky' });
    expect((await job(b.id)).error).toEqual({ message: 'bad input', details: { field: 'x' } });
  });

  it('ticks its deadline watchdog only while it holds an attempt: idle, it wakes for heartbeats alone', async () => {
    const { agent } = await newAgent('sdk-idle', ['sdk-idle']);
    let release!: () => void;
    const held = new Promise<void>((r) => (release = r));
    agent.handle('sdk-idle', async () => {
      await held;
      return {};
    });
    const watchdog = () => (agent as unknown as { assignments: { watchdog?: NodeJS.Timeout } }).assignments.watchdog;
    await agent.start();
    expect(watchdog(), 'connected, nothing held').toBeUndefined();
    const assigned = once(agent, 'assigned');
    await enqueue('sdk-idle');
    await assigned;
    expect(watchdog(), 'holding an attempt').toBeDefined();
    const acked = once(agent, 'acked');
    release();
    await acked;
    // Its next tick finds nothing held and stops it.
    // No event marks it: the SDK's own timer clears it, so this polls.
    await waitFor('the watchdog stopped', () => watchdog() === undefined);
  });

  it('refuses to start with a bad token', async () => {
    const outboxDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-outbox-'));
    dirs.push(outboxDir);
    const agent = createAgent({ url: `127.0.0.1:${lh.port}`, token: 'lh_agent_nope', queues: ['x'], outboxDir, handleSignals: false, log: pino({ level: 'silent' }) });
    agents.push(agent);
    await expect(agent.start()).rejects.toThrow(/refused this agent/);
  });
});

describe('ctx.signal', () => {
  it('aborts within one heartbeat interval of a cancel', async () => {
    const { agent } = await newAgent('sdk-cancel', ['sdk-cancel']);
    let abortedAt = 0;
    let reason = '';
    const abortSeen = deferred();
    agent.handle('sdk-cancel', (_j, ctx) => new Promise((resolve) => ctx.signal.addEventListener('abort', () => {
      abortedAt = Date.now();
      reason = String((ctx.signal.reason as Error).message);
      abortSeen.resolve();
      resolve({ stopped: true });
    })));
    await agent.start();
    // Listening before the enqueue: the job can be handed to the agent before the enqueue returns.
    const assigned = once(agent, 'assigned');
    const j = await enqueue('sdk-cancel');
    await assigned;
    await until(lh, 'running', async () => (await job(j.id)).status === 'running');
    const client = rawClient('JobService', `127.0.0.1:${lh.port}`);
    // Listening before the cancel: the ack of the late result can follow the abort within moments.
    const acked = once(agent, 'acked');
    // From the cancel's answer (it is committed then): the client's connection, made by this
    // first call, is not the agent's to wait for (counted from before the call, a run on a loaded
    // machine measured 435 ms).
    await unary(client, 'cancelJob', { jobId: j.id }, ADMIN_KEY).finally(() => client.close());
    const t0 = Date.now();
    await abortSeen.promise;
    expect(abortedAt - t0).toBeLessThanOrEqual(HEARTBEAT_MS);
    expect(reason).toMatch(/canceled/);
    // Its late result is refused as stale and set aside.
    const ack = (await acked)[0] as { outcome: string };
    expect(ack.outcome).toBe('STALE');
  });

  it('aborts within one heartbeat interval when the lease is taken back', async () => {
    const { agent } = await newAgent('sdk-revoke', ['sdk-revoke']);
    const aborted = once(agent, 'aborted');
    let abortedAt = 0;
    const abortSeen = deferred();
    agent.handle('sdk-revoke', (_j, ctx) => new Promise((resolve) => ctx.signal.addEventListener('abort', () => {
      abortedAt = Date.now();
      abortSeen.resolve();
      resolve({});
    })));
    await agent.start();
    const j = await enqueue('sdk-revoke');
    await until(lh, 'running', async () => (await job(j.id)).status === 'running');
    // The reaper finds the lease expired (as if the agent had stopped renewing it) and revokes
    // what it took back. Its schedule is paused so these runs are ours. A heartbeat landing
    // between the expiry and the run renews the lease (an expired lease not yet taken back may
    // be renewed, by design), so the pair is repeated until a run takes the job back.
    await lh.c.reaper.stop();
    let t0 = 0;
    let rescued: string[] = [];
    try {
      for (let i = 0; i < 5 && !rescued.includes(j.id); i++) {
        await t.pool.query(`UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1`, [j.id]);
        rescued = (await lh.c.reaper.runOnce()).rescued.map((r) => r.jobId);
        // From the run's end: its rescue is committed and its revoke handed to the agent's
        // stream by then ('reaper:run'). Counted from before the UPDATE, the bound also held the
        // test's UPDATE and the reaper's commit, which a loaded machine can stretch past an interval.
        t0 = Date.now();
      }
    } finally {
      lh.c.reaper.start();
    }
    expect(rescued).toContain(j.id);
    await abortSeen.promise;
    expect(abortedAt - t0).toBeLessThanOrEqual(HEARTBEAT_MS);
    // The coordinator's reason, for programs and in words.
    expect((await aborted)[0]).toMatchObject({ revoke: 'lease_expired', reason: expect.stringMatching(/^revoked by the coordinator \(lease_expired\): lease expired: /) });
  });

  it('aborts on its own when renewals stop arriving (a silent network), before the lease passes', async () => {
    const proxy = await startProxy(lh.port);
    proxies.push(proxy);
    const { agent } = await newAgent('sdk-local', ['sdk-local'], { url: `http://127.0.0.1:${proxy.port}` });
    let reason = '';
    let abortedAt = 0;
    const began = deferred();
    const abortSeen = deferred();
    agent.handle('sdk-local', (_j, ctx) => {
      began.resolve();
      return new Promise((resolve) => ctx.signal.addEventListener('abort', () => {
        reason = String((ctx.signal.reason as Error).message);
        abortedAt = Date.now();
        abortSeen.resolve();
        resolve({});
      }));
    });
    await agent.start();
    await enqueue('sdk-local');
    // The handler runs (its start confirmed), not only the job's row says so.
    await began.promise;
    // The connection stays up but carries nothing: heartbeats vanish, no renewal comes back.
    proxy.blackhole();
    const silentAt = Date.now();
    await abortSeen.promise;
    expect(reason).toMatch(/local lease deadline passed/);
    // Before the coordinator's lease (1.5 s from the last renewal) could have passed.
    expect(abortedAt - silentAt).toBeLessThan(1500);
  });

  it('keeps a healthy attempt through a wall clock stepped 10 minutes forward, then back', async () => {
    // The wall clock this process sees (a Windows time service or a person stepping it): the SDK's
    // deadlines are on the monotonic clock, so neither step changes anything.
    const realNow = Date.now.bind(Date);
    let offset = 0;
    const wall = vi.spyOn(Date, 'now').mockImplementation(() => realNow() + offset);
    try {
      const { agent } = await newAgent('sdk-wall', ['sdk-wall']);
      const aborted: unknown[] = [];
      agent.on('aborted', (a) => aborted.push(a));
      let runs = 0;
      let stepsDone: () => void = () => undefined;
      const stepped = new Promise<void>((r) => (stepsDone = r));
      agent.handle('sdk-wall', async (_j, ctx) => {
        runs++;
        // Across several renewals (every 300 ms; the local deadline is 1.2 s after each).
        await new Promise((r) => setTimeout(r, 600));
        offset = 10 * 60_000;
        await new Promise((r) => setTimeout(r, 600));
        offset = -10 * 60_000;
        await new Promise((r) => setTimeout(r, 600));
        offset = 0; // (the test's own waits are on the wall clock)
        stepsDone();
        return { aborted: ctx.signal.aborted };
      });
      await agent.start();
      const j = await enqueue('sdk-wall');
      await stepped;
      await until(lh, 'done', async () => (await job(j.id)).status === 'succeeded', 10_000);
      expect((await job(j.id)).result).toEqual({ aborted: false });
      expect(aborted).toEqual([]);
      expect(runs).toBe(1);
    } finally {
      wall.mockRestore();
    }
  });

  it('aborts on time when renewals stop, though the wall clock was stepped 10 minutes back', async () => {
    const proxy = await startProxy(lh.port);
    proxies.push(proxy);
    const { agent } = await newAgent('sdk-wall-back', ['sdk-wall-back'], { url: `http://127.0.0.1:${proxy.port}` });
    let abortedAt = 0;
    const began = deferred();
    const abortSeen = deferred();
    agent.handle('sdk-wall-back', (_j, ctx) => {
      began.resolve();
      return new Promise((resolve) => ctx.signal.addEventListener('abort', () => {
        abortedAt = performance.now();
        abortSeen.resolve();
        resolve({});
      }));
    });
    await agent.start();
    await enqueue('sdk-wall-back');
    // The handler runs (its start confirmed), not only the job's row says so.
    await began.promise;
    const realNow = Date.now.bind(Date);
    const wall = vi.spyOn(Date, 'now').mockImplementation(() => realNow() - 10 * 60_000);
    try {
      proxy.blackhole();
      const silentAt = performance.now();
      await abortSeen.promise;
      // By the monotonic deadline: before the coordinator's lease (1.5 s) could have passed.
      expect(abortedAt - silentAt).toBeLessThan(1500);
    } finally {
      wall.mockRestore();
    }
  });

  it('gives back an attempt whose start was confirmed only after it had given up on it', async () => {
    // The first start of this queue's job commits 2 s late, as if its statement had waited that
    // long for a connection (a PostgreSQL restart): a trigger sleeps, then moves the lease to
    // what a statement starting now would set. That is longer than the agent waits for the
    // confirmation (lease − one heartbeat = 1.2 s): it drops the attempt and frees its slot;
    // then the start commits and heartbeats renew the attempt. Unless the agent gives it back,
    // the coordinator renews it forever and the job never ends.
    await t.pool.query(`CREATE OR REPLACE FUNCTION sdk_slow_start() RETURNS trigger LANGUAGE plpgsql AS $$
      BEGIN
        IF NEW.queue = 'sdk-slow-start' AND OLD.status = 'claimed' AND NEW.status = 'running' AND NEW.attempt_no = 1 THEN
          PERFORM pg_sleep(2);
          NEW.started_at := clock_timestamp();
          NEW.lease_expires_at := NEW.lease_expires_at + (clock_timestamp() - now());
        END IF;
        RETURN NEW;
      END $$`);
    await t.pool.query(`CREATE TRIGGER sdk_slow_start BEFORE UPDATE ON jobs FOR EACH ROW EXECUTE FUNCTION sdk_slow_start()`);
    try {
      const { agent } = await newAgent('sdk-slow-start', ['sdk-slow-start']);
      const ran: number[] = [];
      agent.handle('sdk-slow-start', (j) => {
        ran.push(j.attemptNo);
        return { attemptNo: j.attemptNo };
      });
      const aborted = once(agent, 'aborted');
      await agent.start();
      const j = await enqueue('sdk-slow-start');
      expect(String((await aborted)[0].reason)).toMatch(/local lease deadline passed/);
      await until(lh, 'succeeded', async () => (await job(j.id)).status === 'succeeded', 10_000);
      const row = await job(j.id);
      expect(row.attempt_no).toBe(2);
      expect(row.result).toEqual({ attemptNo: 2 });
      expect(ran).toEqual([2]); // the first attempt's handler never ran
      const first = (await t.pool.query(`SELECT status::text, error, retryable FROM attempt_log WHERE job_id = $1 AND attempt_no = 1`, [j.id])).rows[0];
      expect(first).toMatchObject({ status: 'failed', retryable: true });
      expect(first.error.message).toMatch(/not running this attempt/);
      await checkInvariants(t.pool);
    } finally {
      await t.pool.query(`DROP TRIGGER sdk_slow_start ON jobs; DROP FUNCTION sdk_slow_start()`);
    }
  });
});

describe('ctx.step', () => {
  it('runs a step once: a later attempt gets the recorded output', async () => {
    const { agent } = await newAgent('sdk-step', ['sdk-step']);
    let effects = 0;
    let attempts = 0;
    let firstAttemptId = '';
    let fnAt = 0;
    let stepAt = 0;
    // The `effect` event: once per effect, between the lease check and the step function.
    const order: string[] = [];
    const events: Array<AgentEvents['effect'][0]> = [];
    agent.on('effect', (e) => {
      order.push('effect');
      events.push(e);
    });
    agent.handle('sdk-step', async (_j, ctx) => {
      attempts++;
      if (attempts === 1) firstAttemptId = ctx.attempt.id;
      if (attempts === 1) stepAt = performance.now();
      const out = await ctx.step('charge', async ({ idempotencyKey }) => {
        order.push('fn');
        fnAt = performance.now();
        effects++;
        return { charged: true, idempotencyKey };
      });
      if (attempts === 1) throw new Error('crash after the effect'); // retried as attempt 2
      return { out };
    });
    await agent.start();
    const j = await enqueue('sdk-step', {}, { maxAttempts: 3 });
    await until(lh, 'succeeded', async () => (await job(j.id)).status === 'succeeded', 15_000);
    expect(effects).toBe(1);
    expect(attempts).toBe(2);
    expect((await job(j.id)).result).toEqual({ out: { charged: true, idempotencyKey: `${j.id}:charge` } });
    // Attempt 2 got the recorded output: no effect, no event.
    expect(order).toEqual(['effect', 'fn']);
    expect(events).toEqual([{ attemptId: firstAttemptId, jobId: j.id, step: 'charge', idempotencyKey: `${j.id}:charge`, checkedAt: expect.any(Number), leaseLeftMs: expect.any(Number) }]);
    // The check's own clock reading (performance.now()), taken inside ctx.step, before the step
    // function: by order, not by a bound on the time between (a loaded machine stretches it).
    expect(events[0]!.checkedAt).toBeGreaterThanOrEqual(stepAt);
    expect(events[0]!.checkedAt).toBeLessThanOrEqual(fnAt);
    // Counted from the last renewal's sending time: the lease (1.5 s) less one heartbeat interval at most.
    expect(events[0]!.leaseLeftMs).toBeGreaterThan(0);
    expect(events[0]!.leaseLeftMs).toBeLessThanOrEqual(1500 - HEARTBEAT_MS);
  });

  it('runs the step when an effect listener throws, and logs it', async () => {
    const lines: Array<Record<string, unknown>> = [];
    const log = pino({ level: 'error' }, { write: (l: string) => void lines.push(JSON.parse(l) as Record<string, unknown>) });
    const { agent } = await newAgent('sdk-effect-throw', ['sdk-effect-throw'], { log });
    agent.on('effect', () => {
      throw new Error('the audit log is down');
    });
    let effects = 0;
    agent.handle('sdk-effect-throw', async (_j, ctx) => ({ out: await ctx.step('send', () => ++effects) }));
    await agent.start();
    const j = await enqueue('sdk-effect-throw', {}, { maxAttempts: 1 });
    await until(lh, 'succeeded', async () => (await job(j.id)).status === 'succeeded', 15_000);
    expect(effects).toBe(1);
    expect((await job(j.id)).result).toEqual({ out: 1 });
    expect(lines).toContainEqual(expect.objectContaining({ msg: 'an effect listener threw; the step runs', step: 'send', jobId: j.id, err: expect.objectContaining({ message: 'the audit log is down' }) }));
  });

  it('asks onUnknown when an earlier attempt reserved a step and never recorded it', async () => {
    const { agent } = await newAgent('sdk-unknown', ['sdk-unknown']);
    const seen: unknown[] = [];
    let firstAttemptId = '';
    agent.handle('sdk-unknown', async (_j, ctx) => {
      if (ctx.attempt.number === 1) {
        firstAttemptId = ctx.attempt.id;
        // Reserve, then die before recording: the step's outcome is unknown.
        await ctx.step('send', () => {
          throw new Error('connection reset after the request went out');
        });
      }
      const out = await ctx.step('send', () => ({ sent: 'again' }), {
        onUnknown: async (info) => {
          seen.push(info);
          return { done: true, output: { sent: 'before', confirmedBy: info.idempotencyKey } };
        },
      });
      return { out };
    });
    await agent.start();
    const j = await enqueue('sdk-unknown', {}, { maxAttempts: 3 });
    await until(lh, 'succeeded', async () => (await job(j.id)).status === 'succeeded', 15_000);
    expect(seen).toMatchObject([{ step: 'send', idempotencyKey: `${j.id}:send`, previousAttemptId: firstAttemptId }]);
    expect((await job(j.id)).result).toEqual({ out: { sent: 'before', confirmedBy: `${j.id}:send` } });
    await checkInvariants(t.pool);
  });
});

describe('outbox', () => {
  it('survives a torn write: the torn record is dropped, the complete entry is sent once', async () => {
    // An earlier run of agent sdk-torn finished attempt 1 and wrote its report, then died before
    // sending it, while writing another report (half a record at the end of the log; and a
    // torn temporary file of the one-file-per-entry format, from an older SDK).
    const token = await lh.agent('sdk-torn');
    const j = await enqueue('sdk-torn');
    const claimed = await jobClaim(t.pool, { agentId: 'sdk-torn', queues: ['sdk-torn'], limit: 1, claimTtlMs: 60_000 });
    if (claimed.outcome !== 'ok') throw new Error('claim');
    const attemptId = claimed.value[0]!.attemptId;
    await attemptStart(t.pool, { attemptId, agentId: 'sdk-torn', leaseTtlMs: 60_000 });
    const outboxDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-outbox-'));
    dirs.push(outboxDir);
    const earlier = new Outbox(outboxDir, pino({ level: 'silent' }));
    await earlier.open();
    await earlier.put({ attemptId, jobId: j.id, queue: 'sdk-torn', attemptNo: 1, kind: 'completed', result: { from: 'first run' }, writtenAt: new Date().toISOString() });
    await earlier.close();
    const segment = path.join(outboxDir, (await readdir(outboxDir)).find((f) => f.endsWith('.log'))!);
    const half = encodeRecord({ t: 'put', e: { attemptId: '11111111-2222-3333-4444-555555555555', jobId: j.id, queue: 'sdk-torn', attemptNo: 1, kind: 'completed', writtenAt: '' } });
    await appendFile(segment, half.subarray(0, half.length >> 1));
    const torn = path.join(outboxDir, '11111111-2222-3333-4444-555555555555.json.tmp-1-abcd');
    await writeFile(torn, '{"attemptId":"11111111-2222-3333-4444-5555');

    const again = createAgent({ url: `http://127.0.0.1:${lh.port}`, token, queues: ['sdk-torn'], outboxDir, handleSignals: false, log: pino({ level: 'silent' }) });
    agents.push(again);
    again.handle('sdk-torn', () => ({ from: 'second run' }));
    const acked = once(again, 'acked');
    await again.start();
    expect((await acked)[0]).toEqual({ attemptId, outcome: 'OK' });
    expect(existsSync(torn)).toBe(false);
    expect(await readOutbox(outboxDir)).toEqual({ pending: [], superseded: [] });
    expect(await job(j.id)).toMatchObject({ status: 'succeeded', result: { from: 'first run' }, attempt_no: 1 });
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM attempt_log WHERE job_id = $1 AND status IN ('succeeded', 'failed')`, [j.id])).rows[0].n).toBe(1);
  });

  it('turns a result the coordinator refuses (too large) into a final failure', async () => {
    const { agent } = await newAgent('sdk-big', ['sdk-big']);
    agent.handle('sdk-big', () => ({ blob: 'x'.repeat(300 * 1024) }));
    await agent.start();
    const j = await enqueue('sdk-big');
    await until(lh, 'failed', async () => (await job(j.id)).status === 'failed');
    expect((await job(j.id)).error.message).toMatch(/result refused: result is \d+ bytes/);
  });
});
