/**
 * AdminService over the HTTP listener (Connect JSON, as the dashboard and the CLI call it), each
 * method against a real coordinator: listing and filtering jobs, one job's history, requeue,
 * cancel reaching the agent's stream, purge (and the purger, and two purgers at once), agents
 * with their streams, slots and suspect attempts, drain and revoke reaching the stream through
 * NOTIFY, keys, stats, stale reports, and the admin scope. The gRPC side of the same router is
 * exercised by the README's `buf curl` lines (readme.test).
 */
import pino from 'pino';
import { afterEach, describe, expect, it } from 'vitest';
import { Purger } from '../server/core/purger.js';
import { jobEnqueue, keyCreate } from '../server/store/index.js';
import { JOB_REFERENCES } from '../server/store/schema.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, until, useCoordinator } from './helpers/coordinator.js';
import { makeJob } from './helpers/factories.js';
import { rpc } from './helpers/http.js';
import { checkInvariants } from './helpers/invariants.js';
import { RawAgent, toStruct } from './helpers/raw-agent.js';

const t = useTestDb();
const lh = useCoordinator(t);
const open: RawAgent[] = [];
afterEach(() => {
  for (const a of open.splice(0)) a.close();
});

const admin = <T = any>(method: string, body: unknown = {}, key = ADMIN_KEY) => rpc<T>(lh.httpUrl, `leasehold.v1.AdminService/${method}`, body, key);
async function ok<T = any>(method: string, body: unknown = {}): Promise<T> {
  const r = await admin<T>(method, body);
  if (r.status !== 200) throw new Error(`${method} answered ${r.status}: ${JSON.stringify(r.json)}`);
  return r.json;
}
async function stream(agentId: string, queues: string[], slots = 2) {
  const token = await lh.agent(agentId);
  const a = RawAgent.open(`127.0.0.1:${lh.port}`, { agentId, token, queues, slots });
  open.push(a);
  await a.next('welcome');
  return a;
}
async function enqueue(queue: string, payload: Record<string, unknown> = {}) {
  const o = await jobEnqueue(t.pool, { queue, payload });
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  return o.value;
}

describe('jobs', () => {
  it('ListJobs filters by statuses, queue, agent and creation time, and pages newest first', async () => {
    const before = new Date(Date.now() - 1000);
    const q = [await enqueue('adm-list', { i: 1 }), await enqueue('adm-list', { i: 2 }), await enqueue('adm-list', { i: 3 })];
    const dead = await makeJob(t.pool, { queue: 'adm-list', status: 'dead' });
    const held = await makeJob(t.pool, { queue: 'adm-list-2', status: 'running', agentId: 'lister-agent' });

    const all = await ok('ListJobs', { queue: 'adm-list' });
    expect(all.jobs.map((j: any) => j.id)).toEqual([dead.id, ...q.map((j) => j.id).reverse()]);
    expect((await ok('ListJobs', { queue: 'adm-list', statuses: ['JOB_STATUS_DEAD', 'JOB_STATUS_FAILED'] })).jobs.map((j: any) => j.id)).toEqual([dead.id]);
    expect((await ok('ListJobs', { agentId: 'lister-agent' })).jobs.map((j: any) => j.id)).toEqual([held.id]);
    expect((await ok('ListJobs', { queue: 'adm-list', createdAfter: new Date(Date.now() + 60_000).toISOString() })).jobs).toEqual([]);
    expect((await ok('ListJobs', { queue: 'adm-list', createdAfter: before.toISOString(), createdBefore: new Date(Date.now() + 1000).toISOString() })).jobs).toHaveLength(4);

    const pages: string[][] = [];
    let token = '';
    do {
      const p = await ok('ListJobs', { queue: 'adm-list', pageSize: 3, pageToken: token });
      pages.push(p.jobs.map((j: any) => j.id));
      token = p.nextPageToken;
    } while (token);
    expect(pages.map((p) => p.length)).toEqual([3, 1]);
    expect(pages.flat()).toEqual(all.jobs.map((j: any) => j.id));

    const bad = await admin('ListJobs', { pageToken: 'nope' });
    expect(bad).toMatchObject({ status: 400, json: { outcome: 'invalid', field: 'pageToken' } });
  });

  it('GetJob returns the history and what the timeline is drawn from; RequeueJob and CancelJob follow the rules', async () => {
    const a = await stream('adm-runner', ['adm-run'], 1);
    const job = await enqueue('adm-run', { n: 1 });
    const c = (await a.next('assign')).assign.jobs[0];
    a.send({ started: { attemptIds: [c.attemptId] } });
    await until(lh, 'running', async () => (await ok('GetJob', { jobId: job.id })).job.status === 'JOB_STATUS_RUNNING');
    a.send({ heartbeat: { progress: [] } });
    const d = await until(lh, 'a heartbeat', async () => {
      const g = await ok('GetJob', { jobId: job.id });
      return g.heartbeatAt ? g : undefined;
    });
    expect(d).toMatchObject({
      job: { id: job.id, agentId: 'adm-runner', attemptNo: 1 },
      attempts: [{ id: c.attemptId, status: 'ATTEMPT_STATUS_RUNNING', agentId: 'adm-runner' }],
      leaseTtl: '1.500s',
      heartbeatInterval: '0.300s',
    });
    expect(d.events.map((e: any) => e.kind)).toEqual(['enqueued', 'claimed', 'started']);
    expect(Date.parse(d.now)).toBeGreaterThanOrEqual(Date.parse(d.heartbeatAt));

    // Not finished: requeue refuses with the job's state.
    expect(await admin('RequeueJob', { jobId: job.id })).toMatchObject({ status: 409, json: { outcome: 'conflict', current: { status: 'JOB_STATUS_RUNNING' } } });
    // Cancel reaches the stream that holds it.
    const canceled = await ok('CancelJob', { jobId: job.id });
    expect(canceled).toMatchObject({ outcome: 'OUTCOME_OK', job: { status: 'JOB_STATUS_CANCELED' } });
    expect((await a.next('cancel')).cancel.attemptIds).toEqual([c.attemptId]);
    expect((await ok('CancelJob', { jobId: job.id })).outcome).toBe('OUTCOME_DUPLICATE');
    // Requeued, it runs again as attempt 2 on the same stream once the slot is free.
    a.send({ credit: { n: 1 } });
    expect((await ok('RequeueJob', { jobId: job.id })).job).toMatchObject({ status: 'JOB_STATUS_QUEUED', attemptNo: 1 });
    const again = (await a.next('assign')).assign.jobs[0];
    expect(again).toMatchObject({ attemptNo: 2, job: { id: job.id } });
    a.send({ started: { attemptIds: [again.attemptId] } });
    a.send({ completed: { results: [{ attemptId: again.attemptId, result: toStruct({ ok: true }) }] } });
    expect((await a.next('ack')).ack.items[0].outcome).toBe('OUTCOME_OK');
    expect(await admin('RequeueJob', { jobId: job.id })).toMatchObject({ status: 409, json: { outcome: 'conflict' } });
    expect(await admin('GetJob', { jobId: '00000000-0000-4000-8000-000000000000' })).toMatchObject({ status: 404, json: { outcome: 'not_found' } });
    const history = await ok('GetJob', { jobId: job.id });
    expect(history.events.map((e: any) => e.kind)).toEqual(['enqueued', 'claimed', 'started', 'canceled', 'requeued', 'claimed', 'started', 'completed']);
    await checkInvariants(t.pool);
  });

  it('PurgeJobs deletes finished jobs past the cutoff with their history, keeps undelivered ones, and counts on a dry run; purgers share the work', async () => {
    const old = new Date(Date.now() - 3 * 86_400_000);
    const ids: string[] = [];
    for (const status of ['succeeded', 'failed', 'dead', 'canceled'] as const) ids.push((await makeJob(t.pool, { queue: 'adm-purge', status })).id);
    await t.pool.query(`UPDATE jobs SET finished_at = $2 WHERE id = ANY($1::uuid[])`, [ids, old]);
    // Rows of every table that belongs to a job, for one of them: the purge takes them too.
    await t.pool.query(
      `WITH e AS (INSERT INTO webhook_events (id, job_id, type, body, created_at) VALUES (gen_random_uuid(), $1, 'job.succeeded', '{}', now()) RETURNING id),
            d AS (INSERT INTO webhook_deliveries (event_id, url, status, delivered_at) SELECT e.id, 'http://127.0.0.1:1/purged', 'delivered', now() FROM e),
            s AS (INSERT INTO steps (job_id, step, status, attempt_id, started_at) VALUES ($1, 'charge', 'started', gen_random_uuid(), now())),
            r AS (INSERT INTO stale_reports (job_id, attempt_id, call, current_attempt_no, current_status, at) VALUES ($1, gen_random_uuid(), 'complete', 1, 'succeeded', now()))
       INSERT INTO notify_headers (job_id, name, value) VALUES ($1, 'X-Token', 'secret')`,
      [ids[0]],
    );
    const fresh = await makeJob(t.pool, { queue: 'adm-purge', status: 'succeeded' });
    const live = await enqueue('adm-purge');
    // A finished job whose notification is still waiting for the deliverer is kept.
    const waiting = await makeJob(t.pool, { queue: 'adm-purge', status: 'failed' });
    await t.pool.query(`UPDATE jobs SET finished_at = $2 WHERE id = $1`, [waiting.id, old]);
    await t.pool.query(
      `WITH e AS (INSERT INTO webhook_events (id, job_id, type, body, created_at) VALUES (gen_random_uuid(), $1, 'job.failed', '{}', now()) RETURNING id)
       INSERT INTO webhook_deliveries (event_id, url, next_attempt_at) SELECT e.id, 'http://127.0.0.1:1/x', now() + interval '1 hour' FROM e`,
      [waiting.id],
    );

    const dry = await ok('PurgeJobs', { olderThan: '86400s', queue: 'adm-purge', dryRun: true });
    expect(dry).toMatchObject({ purged: '4', dryRun: true });
    expect(Date.parse(dry.cutoff)).toBeLessThan(Date.now() - 86_000_000);
    expect(await admin('PurgeJobs', { olderThan: '86400s', statuses: ['JOB_STATUS_QUEUED'] })).toMatchObject({ status: 400, json: { field: 'statuses.0' } });
    expect((await ok('PurgeJobs', { olderThan: '86400s', queue: 'adm-purge', statuses: ['JOB_STATUS_DEAD'] })).purged).toBe('1');
    expect((await ok('PurgeJobs', { olderThan: '86400s', queue: 'adm-purge' })).purged).toBe('3');
    const left = (await t.pool.query(`SELECT id FROM jobs WHERE queue = 'adm-purge' ORDER BY id`)).rows.map((r) => r.id);
    expect(left.sort()).toEqual([fresh.id, live.id, waiting.id].sort());
    for (const table of ['attempts', ...JOB_REFERENCES]) {
      const n = (await t.pool.query(`SELECT count(*)::int AS n FROM ${table} WHERE job_id = ANY($1::uuid[])`, [ids])).rows[0].n;
      expect([table, n]).toEqual([table, 0]);
    }
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM webhook_deliveries WHERE url = 'http://127.0.0.1:1/purged'`)).rows[0].n).toBe(0);

    // The maintenance service: two purgers on one database take different batches.
    const many = await t.pool.query(
      `INSERT INTO jobs (queue, payload, status, result, finished_at)
       SELECT 'adm-purge-many', '{}', 'succeeded', '{}', now() - interval '10 days' FROM generate_series(1, 250) RETURNING id`,
    );
    expect(many.rowCount).toBe(250);
    const log = pino({ level: 'silent' });
    const [p1, p2] = [new Purger(t.pool, log, { retentionMs: 86_400_000, batchSize: 20 }), new Purger(t.pool, log, { retentionMs: 86_400_000, batchSize: 20 })];
    const [r1, r2] = await Promise.all([p1.runOnce(), p2.runOnce()]);
    expect(r1.purged + r2.purged).toBe(250);
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE queue = 'adm-purge-many'`)).rows[0].n).toBe(0);
    // (No invariant check here: the 250 rows above have no history.)
    for (const table of ['attempts', ...JOB_REFERENCES]) await t.pool.query(`DELETE FROM ${table} WHERE job_id IN (SELECT id FROM jobs WHERE queue = 'adm-purge')`);
    await t.pool.query(`DELETE FROM jobs WHERE queue = 'adm-purge'`);
  });

  it('PurgeJobs refuses an older_than over 1000 years, naming the field and the maximum; takes the maximum', async () => {
    // 3000 years: a cutoff PostgreSQL holds (about 1000 BC) but the answer's Timestamp cannot write
    // (a 500). 10000 years: one before PostgreSQL's first day (a 500, "timestamp out of range").
    for (const olderThan of ['94672800000s', '315576000000s', '31557600001s']) {
      expect(await admin('PurgeJobs', { olderThan, dryRun: true }), olderThan).toMatchObject({
        status: 400,
        json: { code: 'invalid_argument', outcome: 'invalid', field: 'olderThanMs', message: 'olderThanMs must be at most 1000 years (31557600000s)' },
      });
    }
    const most = await ok('PurgeJobs', { olderThan: '31557600000s', dryRun: true });
    expect(most.dryRun).toBe(true);
    expect(Math.abs(Date.parse(most.cutoff) - (Date.now() - 31_557_600_000_000))).toBeLessThan(60_000);
  });
});

describe('agents and keys', () => {
  it('ListAgents shows streams with slots and held attempts, suspect ones after the stream is lost', async () => {
    const a = await stream('adm-lister', ['adm-agents'], 3);
    const job = await enqueue('adm-agents');
    const c = (await a.next('assign')).assign.jobs[0];
    a.send({ started: { attemptIds: [c.attemptId] } });
    const online = await until(lh, 'the stream registered with its attempt running', async () => {
      const r = (await ok('ListAgents', { agentId: 'adm-lister' })).agents[0];
      return r?.sessions.length === 1 && r.attempts[0]?.status === 'ATTEMPT_STATUS_RUNNING' ? r : undefined;
    });
    expect(online).toMatchObject({
      agentId: 'adm-lister',
      registered: true,
      slots: 3,
      suspect: 0,
      sessions: [{ queues: ['adm-agents'], slots: 3, coordinatorId: lh.c.registry.coordinatorId }],
      attempts: [{ attemptId: c.attemptId, jobId: job.id, queue: 'adm-agents', attemptNo: 1 }],
    });

    const closed = new Promise((r) => lh.c.hub.once('session:close', r));
    a.close();
    await closed;
    const lost = await until(lh, 'the stream gone and the attempt suspect', async () => {
      const r = (await ok('ListAgents', { agentId: 'adm-lister' })).agents[0];
      return r?.sessions.length === 0 && r.suspect === 1 ? r : undefined;
    });
    expect(lost.attempts[0].suspectSince).toBeDefined();
    expect(await admin('ListAgents', { agentId: 'bad id!' })).toMatchObject({ status: 400, json: { field: 'agentId' } });
  });

  it('DrainAgent reaches the stream through NOTIFY; RevokeAgent ends it; CreateAgent makes a token that connects', async () => {
    const made = await ok('CreateAgent', { agentId: 'adm-drained' });
    expect(made.token).toMatch(/^lh_agent_/);
    expect(await admin('CreateAgent', { agentId: 'adm-drained' })).toMatchObject({ status: 409, json: { outcome: 'conflict' } });
    const a = RawAgent.open(`127.0.0.1:${lh.port}`, { agentId: 'adm-drained', token: made.token, queues: ['adm-drain'], slots: 1 });
    open.push(a);
    await a.next('welcome');
    await until(lh, 'registered', async () => (await ok('ListAgents', { agentId: 'adm-drained' })).agents[0]?.sessions.length === 1);

    expect(await ok('DrainAgent', { agentId: 'adm-drained' })).toEqual({ sessions: 1 });
    await a.next('drain');
    const drained = (await ok('ListAgents', { agentId: 'adm-drained' })).agents[0];
    expect(drained.sessions[0].drainingSince).toBeDefined();
    // A draining stream is given nothing.
    await enqueue('adm-drain');
    await lh.c.dispatcher.runOnce();
    expect(a.all('assign')).toEqual([]);
    expect(await admin('DrainAgent', { agentId: 'nobody-here' })).toMatchObject({ status: 404 });

    const revoked = await ok('RevokeAgent', { agentId: 'adm-drained' });
    expect(revoked.revokedAt).toBeDefined();
    expect((await a.ended).code).toBe(16); // UNAUTHENTICATED
    // Listed while its session row is there (the stream's end is written after it is sent); then
    // only with includeRevoked.
    await until(lh, 'its session row gone', async () => (await t.pool.query(`SELECT 1 FROM agent_sessions WHERE agent_id = 'adm-drained'`)).rowCount === 0);
    expect((await ok('ListAgents', {})).agents.map((x: any) => x.agentId)).not.toContain('adm-drained');
    expect((await ok('ListAgents', { includeRevoked: true })).agents.map((x: any) => x.agentId)).toContain('adm-drained');
  });

  it('sweeps the sessions of a coordinator that stopped stamping them', async () => {
    await t.pool.query(
      `INSERT INTO agent_sessions (id, agent_id, coordinator_id, queues, slots, connected_at, seen_at)
       VALUES (gen_random_uuid(), 'ghost', gen_random_uuid(), '{q}', 1, now() - interval '1 hour', now() - interval '1 hour')`,
    );
    expect((await ok('ListAgents', {})).agents.map((x: any) => x.agentId)).not.toContain('ghost');
    const run = await lh.c.registry.runOnce();
    expect(run.swept).toBeGreaterThanOrEqual(1);
    expect((await t.pool.query(`SELECT 1 FROM agent_sessions WHERE agent_id = 'ghost'`)).rowCount).toBe(0);
  });

  it('CreateKey, ListKeys, RevokeKey; every AdminService method needs the admin scope', async () => {
    const k = await ok('CreateKey', { name: 'adm-reader', scopes: ['read'] });
    expect(k).toMatchObject({ name: 'adm-reader', scopes: ['read'] });
    const listed = (await ok('ListKeys')).keys;
    expect(listed.map((x: any) => x.name)).toEqual(expect.arrayContaining(['admin', 'adm-reader']));
    expect(JSON.stringify(listed)).not.toContain(k.key);
    for (const m of ['ListJobs', 'GetStats', 'ListAgents', 'PurgeJobs', 'CreateKey']) {
      expect(await admin(m, {}, k.key), m).toMatchObject({ status: 403, json: { outcome: 'forbidden' } });
    }
    expect(await admin('CreateKey', { name: 'admin', scopes: ['admin'] })).toMatchObject({ status: 400, json: { field: 'name' } });
    expect(await ok('RevokeKey', { name: 'adm-reader' })).toEqual({ name: 'adm-reader' });
    expect((await admin('GetStats', {}, k.key)).status).toBe(401);
    const enq = await keyCreate(t.pool, { name: 'adm-enqueuer', scopes: ['enqueue', 'read'] });
    if (enq.outcome !== 'ok') throw new Error('key');
    expect((await admin('RequeueJob', { jobId: '00000000-0000-4000-8000-000000000000' }, enq.value.key)).status).toBe(403);
  });
});

describe('numbers', () => {
  it('GetStats counts depths per queue and status, the oldest due job, and transitions per minute', async () => {
    const oldest = await makeJob(t.pool, { queue: 'adm-stats', runAt: new Date(Date.now() - 90_000) });
    await enqueue('adm-stats');
    await makeJob(t.pool, { queue: 'adm-stats', runAt: new Date(Date.now() + 3_600_000) }); // not due
    await makeJob(t.pool, { queue: 'adm-stats', status: 'dead' });
    const a = await stream('adm-stats-agent', ['adm-stats-run'], 1);
    await enqueue('adm-stats-run');
    const c = (await a.next('assign')).assign.jobs[0];
    a.send({ started: { attemptIds: [c.attemptId] } });
    a.send({ completed: { results: [{ attemptId: c.attemptId, result: toStruct({}) }] } });
    await a.next('ack');

    const s = await ok('GetStats', { windowMinutes: 5 });
    const depth = (queue: string, status: string) => s.depths.find((d: any) => d.queue === queue && d.status === status)?.count;
    expect(depth('adm-stats', 'JOB_STATUS_QUEUED')).toBe('3');
    expect(depth('adm-stats', 'JOB_STATUS_DEAD')).toBe('1');
    expect(depth('adm-stats-run', 'JOB_STATUS_SUCCEEDED')).toBe('1');
    const w = s.waiting.find((x: any) => x.queue === 'adm-stats');
    expect(w).toMatchObject({ due: '2', oldestJobId: oldest.id });
    expect(Number.parseFloat(w.oldestAge)).toBeGreaterThanOrEqual(89);
    expect(s.windowMinutes).toBe(5);
    expect(s.minutes).toHaveLength(5);
    expect(s.minutes.reduce((n: number, m: any) => n + m.succeeded, 0)).toBeGreaterThanOrEqual(1);
    expect(s.completionsPerMinute).toBeGreaterThanOrEqual(0.2);
    expect(await admin('GetStats', { windowMinutes: 5000 })).toMatchObject({ status: 400, json: { field: 'windowMinutes' } });
  });

  it('ListStaleReports lists late calls newest first, by job and agent, paged', async () => {
    const job = await makeJob(t.pool, { queue: 'adm-stale', status: 'running', agentId: 'adm-late' });
    for (let i = 0; i < 3; i++) {
      await t.pool.query(
        `INSERT INTO stale_reports (job_id, attempt_id, agent_id, call, current_attempt_no, current_status, at)
         VALUES ($1, gen_random_uuid(), 'adm-late', 'complete', 2, 'running', now())`,
        [job.id],
      );
    }
    const first = await ok('ListStaleReports', { jobId: job.id, pageSize: 2 });
    expect(first.reports).toHaveLength(2);
    expect(first.reports[0]).toMatchObject({ jobId: job.id, agentId: 'adm-late', call: 'complete', currentAttemptNo: 2, currentStatus: 'JOB_STATUS_RUNNING' });
    expect(Number(first.reports[0].id)).toBeGreaterThan(Number(first.reports[1].id));
    const second = await ok('ListStaleReports', { jobId: job.id, pageSize: 2, pageToken: first.nextPageToken });
    expect(second.reports).toHaveLength(1);
    expect(second.nextPageToken).toBe('');
    expect((await ok('ListStaleReports', { agentId: 'adm-late' })).reports).toHaveLength(3);
  });
});
