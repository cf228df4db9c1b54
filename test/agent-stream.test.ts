/**
 * The agent stream end to end: a real coordinator (gRPC on a port, real PostgreSQL) and agents
 * written with plain @grpc/grpc-js from the .proto files. Leases are 1.5 s, heartbeats 300 ms
 * and the reaper runs every 100 ms, so recovery happens within a test.
 */
import { afterEach, describe, expect, it } from 'vitest';
import { jobEnqueue } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, until, useCoordinator } from './helpers/coordinator.js';
import { checkInvariants } from './helpers/invariants.js';
import { fromStruct, grpc, rawClient, RawAgent, toStruct, unary, type HelloInit } from './helpers/raw-agent.js';
import { startProxy, type TcpProxy } from './helpers/tcp-proxy.js';

const t = useTestDb();
const lh = useCoordinator(t);
const open: RawAgent[] = [];
const proxies: TcpProxy[] = [];

function agent(hello: HelloInit | null, address = `127.0.0.1:${lh.port}`): RawAgent {
  const a = RawAgent.open(address, hello);
  open.push(a);
  return a;
}
async function enqueue(queue: string, payload: Record<string, unknown> = {}) {
  const o = await jobEnqueue(t.pool, { queue, payload });
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  return o.value;
}
async function row(jobId: string) {
  return (await t.pool.query('SELECT status::text, attempt_no, result, current_attempt_id FROM jobs WHERE id = $1', [jobId])).rows[0];
}
const heartbeat = (a: RawAgent) => a.send({ heartbeat: { progress: [] } });

afterEach(async () => {
  for (const a of open.splice(0)) a.close();
  for (const p of proxies.splice(0)) await p.close();
});

describe('AgentService.Connect', () => {
  it('runs claim → start → heartbeat → complete with a plain grpc-js agent', async () => {
    const token = await lh.agent('basic');
    const a = agent({ agentId: 'basic', token, queues: ['basic'], slots: 2 });
    const welcome = await a.next('welcome');
    expect(welcome.welcome.sessionId).toMatch(/[0-9a-f-]{36}/);
    expect(Number(welcome.welcome.leaseTtl.seconds) * 1000 + welcome.welcome.leaseTtl.nanos / 1e6).toBe(1500);

    const job = await enqueue('basic', { n: 7 });
    const assign = await a.next('assign');
    const claimed = assign.assign.jobs[0];
    expect(claimed.job.id).toBe(job.id);
    expect(claimed.attemptNo).toBe(1);
    expect(fromStruct(claimed.job.payload)).toEqual({ n: 7 });
    expect(claimed.claimDeadline.seconds).toBeDefined();

    a.send({ started: { attemptIds: [claimed.attemptId] } });
    await until(lh, 'running', async () => (await row(job.id)).status === 'running');
    heartbeat(a);
    const before = (await t.pool.query('SELECT lease_expires_at FROM jobs WHERE id = $1', [job.id])).rows[0].lease_expires_at;
    await until(lh, 'lease renewed', async () => {
      heartbeat(a);
      const now = (await t.pool.query('SELECT lease_expires_at FROM jobs WHERE id = $1', [job.id])).rows[0].lease_expires_at;
      return now > before;
    });

    a.send({ completed: { results: [{ attemptId: claimed.attemptId, result: toStruct({ ok: true }) }] } });
    const ack = await a.next('ack');
    expect(ack.ack.items).toMatchObject([{ attemptId: claimed.attemptId, outcome: 'OUTCOME_OK' }]);
    expect(await row(job.id)).toMatchObject({ status: 'succeeded', result: { ok: true } });
    await checkInvariants(t.pool);
  });

  it('writes a start before the report sent right behind it: the attempt is started by its Started, not implicitly', async () => {
    const token = await lh.agent('eager');
    const a = agent({ agentId: 'eager', token, queues: ['eager'], slots: 1 });
    await a.next('welcome');
    const starts: string[] = [];
    const onStart = (x: { attemptId: string; outcome: { outcome: string } }) => starts.push(`${x.attemptId} ${x.outcome.outcome}`);
    lh.c.hub.on('attempt:start', onStart);
    try {
      const ids: string[] = [];
      // Both messages in one write, thirty times: they reach the coordinator together, and their
      // statements would otherwise race (a start written after its report answers `duplicate`).
      for (let i = 0; i < 30; i++) {
        await enqueue('eager', { i });
        const c = (await a.next('assign')).assign.jobs[0];
        ids.push(c.attemptId);
        a.send({ started: { attemptIds: [c.attemptId] } });
        a.send({ completed: { results: [{ attemptId: c.attemptId, result: toStruct({ i }) }], credit: 1 } });
        expect((await a.next('ack')).ack.items[0].outcome).toBe('OUTCOME_OK');
      }
      await until(lh, 'every start answered', async () => starts.length === 30);
      expect(starts).toEqual(ids.map((id) => `${id} ok`));
    } finally {
      lh.c.hub.off('attempt:start', onStart);
    }
    await checkInvariants(t.pool);
  });

  it('revokes an attempt whose agent stopped heartbeating, reassigns it as attempt 2, and refuses the late completion', async () => {
    const [ta, tb] = [await lh.agent('lazy'), await lh.agent('diligent')];
    const a = agent({ agentId: 'lazy', token: ta, queues: ['lease'], slots: 1 });
    await a.next('welcome');
    const job = await enqueue('lease', { x: 1 });
    const first = (await a.next('assign')).assign.jobs[0];
    a.send({ started: { attemptIds: [first.attemptId] } });
    // No heartbeats: the lease (1.5 s) passes, the reaper takes the job back and says so.
    const revoke = await a.next('revoke', 10_000);
    expect(revoke.revoke.attemptIds).toEqual([first.attemptId]);

    const b = agent({ agentId: 'diligent', token: tb, queues: ['lease'], slots: 1 });
    const second = (await b.next('assign')).assign.jobs[0];
    expect(second.job.id).toBe(job.id);
    expect(second.attemptNo).toBe(2);
    b.send({ started: { attemptIds: [second.attemptId] } });

    a.send({ completed: { results: [{ attemptId: first.attemptId, result: toStruct({ by: 'lazy' }) }] } });
    const late = (await a.next('ack')).ack.items[0];
    expect(late).toMatchObject({ attemptId: first.attemptId, outcome: 'OUTCOME_STALE', current: { jobId: job.id, attemptNo: 2 } });
    const reports = (await t.pool.query('SELECT attempt_id, current_attempt_id, call FROM stale_reports WHERE job_id = $1', [job.id])).rows;
    expect(reports).toEqual([{ attempt_id: first.attemptId, current_attempt_id: second.attemptId, call: 'complete' }]);

    await until(lh, 'started', async () => (await row(job.id)).status === 'running');
    b.send({ completed: { results: [{ attemptId: second.attemptId, result: toStruct({ by: 'diligent' }) }] } });
    expect((await b.next('ack')).ack.items[0].outcome).toBe('OUTCOME_OK');
    expect(await row(job.id)).toMatchObject({ status: 'succeeded', attempt_no: 2, result: { by: 'diligent' } });
    await checkInvariants(t.pool);
  });

  it('marks attempts suspect when the connection is cut, and resumes them on a reconnect within the lease', async () => {
    const token = await lh.agent('flaky');
    const proxy = await startProxy(lh.port);
    proxies.push(proxy);
    const via = `127.0.0.1:${proxy.port}`;
    const a = agent({ agentId: 'flaky', token, queues: ['cut'], slots: 1 }, via);
    await a.next('welcome');
    const job = await enqueue('cut');
    const c = (await a.next('assign')).assign.jobs[0];
    a.send({ started: { attemptIds: [c.attemptId] } });
    await until(lh, 'running', async () => (await row(job.id)).status === 'running');
    heartbeat(a);

    const closed = new Promise((r) => lh.c.hub.once('session:close', (_s, why) => r(why)));
    proxy.cutAll();
    expect(await closed).toEqual({ lost: true });
    const suspect = (await t.pool.query('SELECT suspect_since FROM jobs WHERE current_attempt_id = $1', [c.attemptId])).rows[0].suspect_since;
    expect(suspect).toBeInstanceOf(Date);

    const b = agent({ agentId: 'flaky', token, queues: ['cut'], slots: 1, resume: [c.attemptId] }, via);
    await b.next('welcome');
    heartbeat(b);
    await until(lh, 'suspect cleared', async () => (await t.pool.query('SELECT suspect_since FROM jobs WHERE current_attempt_id = $1', [c.attemptId])).rows[0].suspect_since === null);
    expect(b.all('revoke')).toEqual([]);
    b.send({ completed: { results: [{ attemptId: c.attemptId, result: toStruct({ resumed: true }) }] } });
    expect((await b.next('ack')).ack.items[0].outcome).toBe('OUTCOME_OK');
    expect(await row(job.id)).toMatchObject({ status: 'succeeded', attempt_no: 1 });
  });

  it('revokes an attempt on the stream that held it when another stream of the same agent resumes it (SUPERSEDED)', async () => {
    const token = await lh.agent('twin');
    const a = agent({ agentId: 'twin', token, queues: ['twin'], slots: 1 });
    await a.next('welcome');
    const job = await enqueue('twin');
    const c = (await a.next('assign')).assign.jobs[0];
    a.send({ started: { attemptIds: [c.attemptId] } });
    await a.next('renewed');
    // A second stream of the same agent (a restarted process that reconnected before the first
    // stream was noticed gone) resumes it: the first is told at once.
    const b = agent({ agentId: 'twin', token, queues: ['twin'], slots: 1, resume: [c.attemptId] });
    await b.next('welcome');
    expect((await a.next('revoke')).revoke).toMatchObject({ attemptIds: [c.attemptId], reason: 'REVOKE_REASON_SUPERSEDED', detail: 'resumed by another stream of this agent' });
    // The stream that resumed it completes it.
    b.send({ completed: { results: [{ attemptId: c.attemptId, result: toStruct({ by: 'b' }) }] } });
    expect((await b.next('ack')).ack.items[0].outcome).toBe('OUTCOME_OK');
    expect((await row(job.id)).result).toEqual({ by: 'b' });
    expect(b.all('revoke')).toEqual([]);
  });

  it('revokes on reconnect an attempt whose lease passed while disconnected', async () => {
    const token = await lh.agent('late');
    const a = agent({ agentId: 'late', token, queues: ['gone'], slots: 1 });
    await a.next('welcome');
    const job = await enqueue('gone');
    const c = (await a.next('assign')).assign.jobs[0];
    a.send({ started: { attemptIds: [c.attemptId] } });
    await until(lh, 'running', async () => (await row(job.id)).status === 'running');
    a.close();
    // The reaper takes the job back once the lease has passed.
    await until(lh, 'lease expired', async () => (await row(job.id)).current_attempt_id !== c.attemptId);
    const b = agent({ agentId: 'late', token, queues: ['other'], slots: 1, resume: [c.attemptId] });
    await b.next('welcome');
    expect((await b.next('revoke')).revoke).toMatchObject({
      attemptIds: [c.attemptId],
      reason: 'REVOKE_REASON_NOT_RESUMED',
      detail: 'not current: superseded or ended while disconnected',
    });
  });

  it('answers a completion whose ack was lost with duplicate and the stored result on resend', async () => {
    const token = await lh.agent('unlucky');
    const proxy = await startProxy(lh.port);
    proxies.push(proxy);
    const via = `127.0.0.1:${proxy.port}`;
    const a = agent({ agentId: 'unlucky', token, queues: ['ack'], slots: 1 }, via);
    await a.next('welcome');
    const job = await enqueue('ack');
    const c = (await a.next('assign')).assign.jobs[0];
    a.send({ started: { attemptIds: [c.attemptId] } });
    await until(lh, 'running', async () => (await row(job.id)).status === 'running');
    // From here the agent hears nothing: the coordinator commits, and its ack is lost on the way.
    proxy.muteDownstream();
    a.send({ completed: { results: [{ attemptId: c.attemptId, result: toStruct({ answer: 42 }) }] } });
    await until(lh, 'completion committed', async () => (await row(job.id)).status === 'succeeded');
    proxy.cutAll();
    await a.ended;
    expect(a.all('ack')).toEqual([]);

    const b = agent({ agentId: 'unlucky', token, queues: ['ack'], slots: 1, resume: [c.attemptId] }, via);
    await b.next('welcome');
    b.send({ completed: { results: [{ attemptId: c.attemptId, result: toStruct({ answer: 42 }) }] } });
    const item = (await b.next('ack')).ack.items[0];
    expect(item).toMatchObject({ attemptId: c.attemptId, outcome: 'OUTCOME_DUPLICATE' });
    expect(fromStruct(item.storedResult)).toEqual({ answer: 42 });
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM attempt_log WHERE job_id = $1 AND status = 'succeeded'`, [job.id])).rows[0].n).toBe(1);
  });

  it('pushes Cancel to the agent holding a job canceled through JobService', async () => {
    const token = await lh.agent('cancelee');
    const a = agent({ agentId: 'cancelee', token, queues: ['cancel'], slots: 1 });
    await a.next('welcome');
    const job = await enqueue('cancel');
    const c = (await a.next('assign')).assign.jobs[0];
    const jobs = rawClient('JobService', `127.0.0.1:${lh.port}`);
    try {
      const res = await unary(jobs, 'cancelJob', { jobId: job.id }, ADMIN_KEY);
      expect(res.outcome).toBe('OUTCOME_OK');
    } finally {
      jobs.close();
    }
    expect((await a.next('cancel')).cancel.attemptIds).toEqual([c.attemptId]);
  });

  it('stops assigning after Bye{drain}', async () => {
    const token = await lh.agent('leaver');
    const a = agent({ agentId: 'leaver', token, queues: ['drain'], slots: 5 });
    await a.next('welcome');
    a.send({ bye: { drain: true } });
    await until(lh, 'draining', () => [...lh.c.hub.sessions].some((s) => s.agentId === 'leaver' && s.draining));
    const job = await enqueue('drain');
    await lh.c.dispatcher.runOnce();
    expect(a.all('assign')).toEqual([]);
    expect((await row(job.id)).status).toBe('queued');
  });

  it('recovers a claim never started by its deadline without counting it', async () => {
    const token = await lh.agent('idle');
    const a = agent({ agentId: 'idle', token, queues: ['nostart'], slots: 1 });
    await a.next('welcome');
    const job = await enqueue('nostart');
    const c = (await a.next('assign')).assign.jobs[0];
    heartbeat(a);
    expect((await a.next('revoke', 10_000)).revoke).toMatchObject({ attemptIds: [c.attemptId], reason: 'REVOKE_REASON_CLAIM_EXPIRED' });
    const r = (await t.pool.query('SELECT attempts_started, status::text FROM jobs WHERE id = $1', [job.id])).rows[0];
    expect(r.attempts_started).toBe(0);
    const a1 = (await t.pool.query('SELECT status::text FROM attempt_log WHERE id = $1', [c.attemptId])).rows[0];
    expect(a1.status).toBe('claim_expired');
  });
});

describe('bad input on the stream', () => {
  it('ends a stream whose first message is not Hello with INVALID_ARGUMENT', async () => {
    const a = agent(null);
    a.send({ credit: { n: 1 } });
    const end = await a.ended;
    expect(end.code).toBe(grpc.status.INVALID_ARGUMENT);
    expect(end.details).toMatch(/first message on the stream must be Hello/);
  });

  it('clamps a Credit above the slots of Hello (never more held than slots) and ends the stream on Credit{0}', async () => {
    const token = await lh.agent('generous');
    const a = agent({ agentId: 'generous', token, queues: ['generous'], slots: 2 });
    await a.next('welcome');
    a.send({ credit: { n: 1000 } });
    const jobs = [await enqueue('generous'), await enqueue('generous'), await enqueue('generous')];
    const assigned = new Map<string, string>();
    while (assigned.size < 2) for (const j of (await a.next('assign')).assign.jobs) assigned.set(j.attemptId as string, j.job.id as string);
    // Started (and heartbeating), so no claim of 1.5 s runs out while we look.
    a.send({ started: { attemptIds: [...assigned.keys()] } });
    await a.next('renewed');
    heartbeat(a);
    await lh.c.dispatcher.runOnce(); // a round with the credit granted: still only two held
    const s = [...lh.c.hub.sessions].find((x) => x.agentId === 'generous')!;
    expect(s.credit).toBeLessThanOrEqual(s.slots);
    expect(s.held.size).toBe(2);
    const third = jobs.find((j) => ![...assigned.values()].includes(j.id))!;
    expect((await row(third.id)).status).toBe('queued');
    a.send({ credit: { n: 0 } });
    const end = await a.ended;
    expect(end.code).toBe(grpc.status.INVALID_ARGUMENT);
    expect(end.details).toMatch(/Credit\.n must be a positive number/);
  });

  it('grants the credit a report carries (Welcome.credit_with_reports), nothing for a report without, and ends the stream on a negative one', async () => {
    const token = await lh.agent('carrier');
    const a = agent({ agentId: 'carrier', token, queues: ['carrier'], slots: 2 });
    expect((await a.next('welcome')).welcome.creditWithReports).toBe(true);
    const jobs = [await enqueue('carrier'), await enqueue('carrier'), await enqueue('carrier')];
    const assigned: string[] = [];
    while (assigned.length < 2) for (const j of (await a.next('assign')).assign.jobs) assigned.push(j.attemptId as string);
    a.send({ started: { attemptIds: assigned } });
    await a.next('renewed');
    a.send({ completed: { results: [{ attemptId: assigned[0], result: toStruct({}) }] } });
    expect((await a.next('ack')).ack.items).toMatchObject([{ attemptId: assigned[0], outcome: 'OUTCOME_OK' }]);
    await lh.c.dispatcher.runOnce();
    const queued = (await Promise.all(jobs.map(async (j) => (await row(j.id)).status))).filter((x) => x === 'queued');
    expect(queued).toHaveLength(1); // no credit came with that report
    a.send({ completed: { results: [{ attemptId: assigned[1], result: toStruct({}) }], credit: 2 } });
    const third = (await a.next('assign')).assign.jobs[0];
    expect(third.attemptNo).toBe(1);
    a.send({ failed: { failures: [{ attemptId: third.attemptId, error: { message: 'x' }, retryable: true }], credit: -1 } });
    const end = await a.ended;
    expect(end.code).toBe(grpc.status.INVALID_ARGUMENT);
    expect(end.details).toMatch(/Failed\.credit must not be negative/);
  });

  it('refuses an unknown token with UNAUTHENTICATED and a malformed Hello with INVALID_ARGUMENT', async () => {
    const bad = agent({ agentId: 'nobody', token: 'lh_agent_wrong', queues: ['q'], slots: 1 });
    expect((await bad.ended).code).toBe(grpc.status.UNAUTHENTICATED);
    const token = await lh.agent('sloppy');
    const sloppy = agent({ agentId: 'sloppy', token, queues: [], slots: 0 });
    const end = await sloppy.ended;
    expect(end.code).toBe(grpc.status.INVALID_ARGUMENT);
    expect(end.details).toMatch(/hello\.(queues|slots)/);
  });

  it('answers malformed and oversized reports per item, and a second Hello ends only that stream', async () => {
    const [t1, t2] = [await lh.agent('messy'), await lh.agent('bystander')];
    const a = agent({ agentId: 'messy', token: t1, queues: ['messy'], slots: 1 });
    const bystander = agent({ agentId: 'bystander', token: t2, queues: ['bystander'], slots: 1 });
    await a.next('welcome');
    await bystander.next('welcome');
    const job = await enqueue('messy');
    const c = (await a.next('assign')).assign.jobs[0];
    a.send({
      completed: {
        results: [
          { attemptId: 'not-an-id', result: toStruct({}) },
          { attemptId: c.attemptId, result: toStruct({ blob: 'x'.repeat(300 * 1024) }) },
          { attemptId: '00000000-0000-4000-8000-000000000000', result: toStruct({}) },
        ],
      },
    });
    const items = (await a.next('ack')).ack.items;
    expect(items.map((i: { outcome: string }) => i.outcome)).toEqual(['OUTCOME_INVALID', 'OUTCOME_INVALID', 'OUTCOME_NOT_FOUND']);
    expect(items[0].message).toMatch(/attemptId/);
    expect(items[1].message).toMatch(/result is \d+ bytes/);
    expect((await row(job.id)).status).toBe('claimed');

    a.send({ hello: { agentId: 'messy', token: t1, queues: ['messy'], slots: 1 } });
    const end = await a.ended;
    expect(end.code).toBe(grpc.status.INVALID_ARGUMENT);
    expect(end.details).toMatch(/Hello was already received/);

    // The other stream is untouched.
    const other = await enqueue('bystander');
    const oc = (await bystander.next('assign')).assign.jobs[0];
    expect(oc.job.id).toBe(other.id);
  });

  it('is forbidden to complete another agent\'s attempt', async () => {
    const [to, tt] = [await lh.agent('owner'), await lh.agent('thief')];
    const owner = agent({ agentId: 'owner', token: to, queues: ['owned'], slots: 1 });
    const thief = agent({ agentId: 'thief', token: tt, queues: ['nothing'], slots: 1 });
    await owner.next('welcome');
    await thief.next('welcome');
    const job = await enqueue('owned');
    const c = (await owner.next('assign')).assign.jobs[0];
    thief.send({ completed: { results: [{ attemptId: c.attemptId, result: toStruct({ stolen: true }) }] } });
    expect((await thief.next('ack')).ack.items[0].outcome).toBe('OUTCOME_FORBIDDEN');
    expect((await row(job.id)).status).toBe('claimed');
  });
});

describe('AttemptService (stream-less agents)', () => {
  it('claims, starts, heartbeats and completes over unary calls; a late call is ABORTED', async () => {
    const token = await lh.agent('script');
    const job = await enqueue('script', { s: 1 });
    const client = rawClient('AttemptService', `127.0.0.1:${lh.port}`);
    try {
      const claimed = await unary(client, 'claimJobs', { queues: ['script'], maxJobs: 1 }, token);
      const c = claimed.jobs[0];
      expect(c.job.id).toBe(job.id);
      const started = await unary(client, 'startAttempt', { jobId: job.id, attemptId: c.attemptId }, token);
      expect(started.outcome).toBe('OUTCOME_OK');
      const hb = await unary(client, 'heartbeat', { jobId: job.id, attemptId: c.attemptId }, token);
      expect(hb.outcome).toBe('OUTCOME_OK');
      const done = await unary(client, 'completeAttempt', { jobId: job.id, attemptId: c.attemptId, result: toStruct({ r: 1 }) }, token);
      expect(done.outcome).toBe('OUTCOME_OK');
      const again = await unary(client, 'completeAttempt', { jobId: job.id, attemptId: c.attemptId, result: toStruct({ r: 1 }) }, token);
      expect(again.outcome).toBe('OUTCOME_DUPLICATE');
      expect(fromStruct(again.job.result)).toEqual({ r: 1 });
      const err = await unary(client, 'heartbeat', { jobId: job.id, attemptId: c.attemptId }, token).catch((e: grpc.ServiceError) => e);
      expect((err as grpc.ServiceError).code).toBe(grpc.status.ABORTED);
      const admin = await unary(client, 'claimJobs', { queues: ['script'] }, ADMIN_KEY).catch((e: grpc.ServiceError) => e);
      expect((admin as grpc.ServiceError).code).toBe(grpc.status.PERMISSION_DENIED);
    } finally {
      client.close();
    }
  });
});
