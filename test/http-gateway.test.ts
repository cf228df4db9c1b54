/**
 * The HTTP gateway over real HTTP/1.1 (fetch against the coordinator's HTTP listener): every
 * error code with its JSON body, the scopes of API keys, and the whole seed scenario — claim,
 * start, let the lease pass, reclaim as attempt 2, the old attempt's completion refused with 409
 * and the current attempt in plain JSON, the new one accepted, its repeat answered with the
 * stored result — using nothing but HTTP calls.
 */
import { execFile } from 'node:child_process';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import http from 'node:http';
import https from 'node:https';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import pg from 'pg';
import pino from 'pino';
import { describe, expect, it } from 'vitest';
import { AgentHub } from '../server/core/agent-hub.js';
import { keyCreate } from '../server/store/index.js';
import { HEALTHZ_PING_MS, listenHttp } from '../server/transport/http.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, useCoordinator, waitFor } from './helpers/coordinator.js';
import { rpc } from './helpers/http.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();
const lh = useCoordinator(t);

const JOBS = 'leasehold.v1.JobService';
const ATTEMPTS = 'leasehold.v1.AttemptService';

async function key(name: string, scopes: string[]): Promise<string> {
  const o = await keyCreate(t.pool, { name, scopes });
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  return o.value.key;
}

describe('connections', () => {
  it('keeps an idle kept-alive connection past the 5 s of Node\'s default (clients keep theirs that long)', async () => {
    // With Node's default (5 s) the server closed idle connections as clients reused them: an
    // enqueue sent at that moment got ECONNRESET (seen in the benchmark's one-by-one load).
    const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
    const get = () =>
      new Promise<{ status: number; reused: boolean; keepAlive: string | undefined }>((resolve, reject) => {
        const req = http.get(`${lh.httpUrl}/healthz`, { agent }, (res) => {
          res.resume();
          res.on('end', () => resolve({ status: res.statusCode ?? 0, reused: req.reusedSocket, keepAlive: res.headers['keep-alive']?.toString() }));
        });
        req.on('error', reject);
      });
    try {
      expect(await get()).toEqual({ status: 200, reused: false, keepAlive: 'timeout=65' });
      // Node closes an idle connection some time after its keepAliveTimeout: 5 s gave 5.5–7 s.
      await new Promise((r) => setTimeout(r, 7_500));
      expect(await get()).toEqual({ status: 200, reused: true, keepAlive: 'timeout=65' });
    } finally {
      agent.destroy();
    }
  }, 20_000);
});

describe('errors over HTTP', () => {
  it('answers /healthz, and 404 JSON for unknown paths and methods', async () => {
    const h = await fetch(`${lh.httpUrl}/healthz`);
    expect(h.status).toBe(200);
    expect(await h.json()).toEqual({ status: 'ok' });

    const unknownPath = await fetch(`${lh.httpUrl}/nothing/here`);
    expect(unknownPath.status).toBe(404);
    expect(await unknownPath.json()).toMatchObject({ code: 'not_found', status: 404, outcome: 'not_found' });

    const unknownMethod = await rpc(lh.httpUrl, `${JOBS}/FlyJob`, {}, ADMIN_KEY);
    expect(unknownMethod).toMatchObject({ status: 404, json: { code: 'unimplemented', outcome: 'not_found' } });

    const unknownJob = await rpc(lh.httpUrl, `${JOBS}/GetJob`, { jobId: '00000000-0000-4000-8000-000000000000' }, ADMIN_KEY);
    expect(unknownJob).toMatchObject({ status: 404, json: { code: 'not_found', outcome: 'not_found', status: 404 } });

    const get = await fetch(`${lh.httpUrl}/${JOBS}/ListJobs`);
    expect(get.status).toBe(405);
    expect(await get.json()).toMatchObject({ status: 405 });
  });

  it('answers 401 without a key, with an unknown key, and at once after a revoke', async () => {
    const none = await rpc(lh.httpUrl, `${JOBS}/ListJobs`, {});
    expect(none).toMatchObject({ status: 401, json: { code: 'unauthenticated', outcome: 'unauthenticated', status: 401 } });
    const bad = await rpc(lh.httpUrl, `${JOBS}/ListJobs`, {}, 'lh_key_not-a-real-key');
    expect(bad).toMatchObject({ status: 401, json: { outcome: 'unauthenticated' } });

    const k = await key('short-lived', ['read']);
    expect((await rpc(lh.httpUrl, `${JOBS}/ListJobs`, {}, k)).status).toBe(200);
    // Revoked through this coordinator, it is refused at once: the revoke drops it from this
    // process's credential cache (other replicas hear the NOTIFY: test/auth-cache.test.ts).
    expect((await rpc(lh.httpUrl, 'leasehold.v1.AdminService/RevokeKey', { name: 'short-lived' }, ADMIN_KEY)).status).toBe(200);
    const revoked = await rpc(lh.httpUrl, `${JOBS}/ListJobs`, {}, k);
    expect(revoked).toMatchObject({ status: 401, json: { message: 'key short-lived was revoked' } });
  });

  it('answers 403 naming the scope a key lacks, per the scope table', async () => {
    const [enq, read, agent, agentToken] = [
      await key('enqueuer', ['enqueue']),
      await key('reader', ['read']),
      await key('script-agent', ['agent']),
      await lh.agent('stream-agent'),
    ];
    const job = { queue: 'scopes', payload: { n: 1 } };
    const enqueued = await rpc(lh.httpUrl, `${JOBS}/EnqueueJob`, job, enq);
    expect(enqueued.status).toBe(200);
    const jobId = enqueued.json.job.id as string;

    const cases: Array<[string, string, unknown, number]> = [
      [enq, `${JOBS}/GetJob`, { jobId }, 403],
      [enq, `${JOBS}/ListJobs`, {}, 403],
      [read, `${JOBS}/GetJob`, { jobId }, 200],
      [read, `${JOBS}/ListJobs`, {}, 200],
      [read, `${JOBS}/EnqueueJob`, job, 403],
      [read, `${JOBS}/CancelJob`, { jobId }, 403],
      [agent, `${JOBS}/ListJobs`, {}, 403],
      [agentToken, `${JOBS}/ListJobs`, {}, 403],
      [ADMIN_KEY, `${ATTEMPTS}/ClaimJobs`, { queues: ['nothing'] }, 403],
      [enq, `${ATTEMPTS}/ClaimJobs`, { queues: ['nothing'] }, 403],
      [agent, `${ATTEMPTS}/ClaimJobs`, { queues: ['nothing'] }, 200],
      [agentToken, `${ATTEMPTS}/ClaimJobs`, { queues: ['nothing'] }, 200],
      [ADMIN_KEY, `${JOBS}/GetJob`, { jobId }, 200],
      [enq, `${JOBS}/CancelJob`, { jobId }, 200],
    ];
    for (const [k, path, body, want] of cases) {
      const a = await rpc(lh.httpUrl, path, body, k);
      expect({ path, status: a.status }).toEqual({ path, status: want });
      if (want === 403) {
        expect(a.json).toMatchObject({ code: 'permission_denied', outcome: 'forbidden', status: 403 });
        expect(a.json.message).toMatch(/needs the (enqueue|read|agent) scope/);
      }
    }
  });

  it('names the field whose value does not decode as its message type (payload, runAt, executionTimeout, notifyHeader), on both paths', async () => {
    // protobuf-es says "cannot decode message google.protobuf.Struct from JSON …", naming no field.
    const cases: Array<[Record<string, unknown>, string]> = [
      [{ queue: 'field-named', payload: '{"a":1}' }, 'payload'],
      [{ queue: 'field-named', payload: {}, runAt: 'tomorrow' }, 'runAt'],
      [{ queue: 'field-named', payload: {}, run_at: 'tomorrow' }, 'runAt'],
      [{ queue: 'field-named', payload: {}, executionTimeout: '30' }, 'executionTimeout'],
      [{ queue: 'field-named', payload: {}, notifyUrl: 'https://example.com/x', notifyHeader: 'X: a' }, 'notifyHeader'],
    ];
    for (const [body, field] of cases) {
      // The direct path (plain JSON), and Connect's (a connect-timeout-ms header sends it there).
      for (const extra of [{}, { 'connect-timeout-ms': '10000' }] as Array<Record<string, string>>) {
        const res = await fetch(`${lh.httpUrl}/${JOBS}/EnqueueJob`, {
          method: 'POST',
          headers: { 'content-type': 'application/json', authorization: `Bearer ${ADMIN_KEY}`, ...extra },
          body: JSON.stringify(body),
        });
        expect({ status: res.status, json: await res.json() }, JSON.stringify([body, extra])).toMatchObject({
          status: 400,
          json: { code: 'invalid_argument', outcome: 'invalid', status: 400, field },
        });
      }
    }
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE queue = 'field-named'`)).rows[0].n).toBe(0);
  });

  it('answers 400 naming the field, for store validation, proto decoding and unknown fields', async () => {
    const cases: Array<[unknown, string]> = [
      [{ queue: 'has space', payload: {} }, 'queue'],
      [{ queue: 'q', payload: {}, notifyUrl: 'ftp://example.com/x' }, 'notifyUrl'],
      [{ queue: 'q', payload: {}, notify_url: `https://example.com/${'x'.repeat(2100)}` }, 'notifyUrl'],
      [{ queue: 'q', payload: {}, priority: 'high' }, 'priority'],
      [{ queue: 'q', payload: {}, queue_name: 'typo' }, 'queue_name'],
      [{ queue: 'q', payload: {}, maxAttempts: 5000 }, 'maxAttempts'],
      // jsonb refuses a NUL: it was a 500 (a StoreError with its stack in the log) once past the checks.
      [{ queue: 'q', payload: {}, labels: { a: '\u0000' } }, 'labels.a'],
      [{ queue: 'q', payload: {}, labels: { 'a\u0001': 'x' } }, 'labels.a\u0001'],
    ];
    for (const [body, field] of cases) {
      const a = await rpc(lh.httpUrl, `${JOBS}/EnqueueJob`, body, ADMIN_KEY);
      expect(a.status).toBe(400);
      expect(a.json).toMatchObject({ code: 'invalid_argument', outcome: 'invalid', status: 400, field });
    }
    // An empty body is the empty message.
    expect(await rpc(lh.httpUrl, `${JOBS}/ListJobs`, '', ADMIN_KEY)).toMatchObject({ status: 200 });
    expect(await rpc(lh.httpUrl, `${JOBS}/EnqueueJob`, '', ADMIN_KEY)).toMatchObject({ status: 400, json: { field: 'queue' } });
    const notJson = await rpc(lh.httpUrl, `${JOBS}/EnqueueJob`, '{"queue":', ADMIN_KEY);
    expect(notJson).toMatchObject({ status: 400, json: { code: 'invalid_argument', outcome: 'invalid' } });
    const wrongType = await fetch(`${lh.httpUrl}/${JOBS}/ListJobs`, {
      method: 'POST',
      headers: { 'content-type': 'text/plain', authorization: `Bearer ${ADMIN_KEY}` },
      body: '{}',
    });
    expect(wrongType.status).toBe(415);
    expect(await wrongType.json()).toMatchObject({ outcome: 'invalid', status: 415 });
  });

  it('answers 413 for a body over the gateway limit and for a payload over its bound', async () => {
    const huge = await rpc(lh.httpUrl, `${JOBS}/EnqueueJob`, { queue: 'q', payload: { blob: 'x'.repeat(1_200_000) } }, ADMIN_KEY);
    expect(huge).toMatchObject({ status: 413, json: { outcome: 'too_large', status: 413, limitBytes: 1024 * 1024 } });
    const big = await rpc(lh.httpUrl, `${JOBS}/EnqueueJob`, { queue: 'q', payload: { blob: 'x'.repeat(300_000) } }, ADMIN_KEY);
    expect(big).toMatchObject({ status: 413, json: { outcome: 'too_large', field: 'payload', limitBytes: 256 * 1024 } });
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE queue = 'q'`)).rows[0].n).toBe(0);
  });

  it('answers 409 conflict for a reused idempotency key, 200 duplicate for a repeat, and 409 for cancelling a finished job', async () => {
    const body = { queue: 'keys', payload: { order: 7 }, idempotencyKey: 'order-7' };
    const first = await rpc(lh.httpUrl, `${JOBS}/EnqueueJob`, body, ADMIN_KEY);
    expect(first).toMatchObject({ status: 200, json: { outcome: 'OUTCOME_OK', job: { attemptNo: 0, priority: 0, status: 'JOB_STATUS_QUEUED' } } });
    const again = await rpc(lh.httpUrl, `${JOBS}/EnqueueJob`, { ...body, payload: { order: 7 } }, ADMIN_KEY);
    expect(again).toMatchObject({ status: 200, json: { outcome: 'OUTCOME_DUPLICATE', job: { id: first.json.job.id } } });
    const other = await rpc(lh.httpUrl, `${JOBS}/EnqueueJob`, { ...body, payload: { order: 8 } }, ADMIN_KEY);
    expect(other).toMatchObject({
      status: 409,
      json: { code: 'already_exists', outcome: 'conflict', status: 409, current: { jobId: first.json.job.id, status: 'JOB_STATUS_QUEUED', attemptNo: 0 } },
    });

    const jobId = first.json.job.id as string;
    expect((await rpc(lh.httpUrl, `${JOBS}/CancelJob`, { jobId }, ADMIN_KEY)).json.outcome).toBe('OUTCOME_OK');
    expect((await rpc(lh.httpUrl, `${JOBS}/CancelJob`, { jobId }, ADMIN_KEY)).json.outcome).toBe('OUTCOME_DUPLICATE');
    await checkInvariants(t.pool);
  });
});

describe('a header for the notify_url', () => {
  it('is taken at enqueue (snake or camel case), never shown by GetJob or ListJobs, and refused with the field named when bad', async () => {
    const body = { queue: 'resume', payload: {}, notify_url: 'http://127.0.0.1:9/resume', notify_header: { name: 'X-Resume-Token', value: 'gateway-secret-91' } };
    const ok = await rpc(lh.httpUrl, `${JOBS}/EnqueueJob`, body, ADMIN_KEY);
    expect(ok).toMatchObject({ status: 200, json: { outcome: 'OUTCOME_OK' } });
    expect(JSON.stringify(ok.json)).not.toContain('gateway-secret-91');
    const got = await rpc(lh.httpUrl, `${JOBS}/GetJob`, { jobId: ok.json.job.id }, ADMIN_KEY);
    const list = await rpc(lh.httpUrl, `${JOBS}/ListJobs`, { queue: 'resume' }, ADMIN_KEY);
    for (const r of [got, list]) {
      expect(r.status).toBe(200);
      expect(JSON.stringify(r.json)).not.toContain('gateway-secret-91');
    }
    const bad = await rpc(lh.httpUrl, `${JOBS}/EnqueueJob`, { ...body, notifyHeader: { name: 'Content-Type', value: 'x' }, notify_header: undefined }, ADMIN_KEY);
    expect(bad).toMatchObject({ status: 400, json: { outcome: 'invalid', field: 'notifyHeader.name' } });
    const alone = await rpc(lh.httpUrl, `${JOBS}/EnqueueJob`, { queue: 'resume', payload: {}, notifyHeader: { name: 'X-Token', value: 'x' } }, ADMIN_KEY);
    expect(alone).toMatchObject({ status: 400, json: { outcome: 'invalid', field: 'notifyHeader' } });
  });
});

describe('the seed scenario over HTTP alone', () => {
  it('claim, start, lease passes, reclaim as attempt 2; the late completion is 409 with the current attempt; the new one 200; its repeat 200 with the stored result', async () => {
    const [slow, fast] = [await key('slow-script', ['agent']), await key('fast-script', ['agent'])];
    const enq = await rpc(lh.httpUrl, `${JOBS}/EnqueueJob`, { queue: 'seed', payload: { file: 'a.pdf' }, idempotencyKey: 'seed-1' }, ADMIN_KEY);
    expect(enq.status).toBe(200);
    const jobId = enq.json.job.id as string;

    const first = await rpc(lh.httpUrl, `${ATTEMPTS}/ClaimJobs`, { queues: ['seed'], maxJobs: 1 }, slow);
    expect(first.status).toBe(200);
    const a1 = first.json.jobs[0];
    expect(a1).toMatchObject({ attemptNo: 1, job: { id: jobId, agentId: 'slow-script', status: 'JOB_STATUS_CLAIMED' } });
    const started = await rpc(lh.httpUrl, `${ATTEMPTS}/StartAttempt`, { jobId, attemptId: a1.attemptId }, slow);
    expect(started).toMatchObject({ status: 200, json: { outcome: 'OUTCOME_OK', job: { status: 'JOB_STATUS_RUNNING' }, leaseTtl: '1.500s' } });
    const hb = await rpc(lh.httpUrl, `${ATTEMPTS}/Heartbeat`, { jobId, attemptId: a1.attemptId }, slow);
    expect(hb).toMatchObject({ status: 200, json: { outcome: 'OUTCOME_OK' } });

    // The slow script stops heartbeating; after the lease (1.5 s) the reaper requeues the job and
    // the fast script claims it as attempt 2.
    const a2 = await waitFor('the job claimed again', async () => {
      const c = await rpc(lh.httpUrl, `${ATTEMPTS}/ClaimJobs`, { queues: ['seed'] }, fast);
      expect(c.status).toBe(200);
      return c.json.jobs[0] as { attemptId: string; attemptNo: number } | undefined;
    });
    expect(a2.attemptNo).toBe(2);
    expect((await rpc(lh.httpUrl, `${ATTEMPTS}/StartAttempt`, { jobId, attemptId: a2.attemptId }, fast)).status).toBe(200);

    const late = await rpc(lh.httpUrl, `${ATTEMPTS}/CompleteAttempt`, { jobId, attemptId: a1.attemptId, result: { by: 'slow' } }, slow);
    expect(late.status).toBe(409);
    expect(late.json).toMatchObject({
      code: 'aborted',
      outcome: 'stale',
      status: 409,
      current: { jobId, status: 'JOB_STATUS_RUNNING', attemptNo: 2, currentAttemptId: a2.attemptId },
    });
    const lateHb = await rpc(lh.httpUrl, `${ATTEMPTS}/Heartbeat`, { jobId, attemptId: a1.attemptId }, slow);
    expect(lateHb).toMatchObject({
      status: 409,
      json: { outcome: 'stale', message: `attempt ${a1.attemptId} was taken back: lease expired: no heartbeat renewed it in time`, current: { attemptNo: 2 } },
    });

    const done = await rpc(lh.httpUrl, `${ATTEMPTS}/CompleteAttempt`, { jobId, attemptId: a2.attemptId, result: { by: 'fast', pages: 3 } }, fast);
    expect(done).toMatchObject({ status: 200, json: { outcome: 'OUTCOME_OK', job: { status: 'JOB_STATUS_SUCCEEDED', result: { by: 'fast', pages: 3 } } } });
    // The ack was lost: the script sends the same report again and gets the stored result.
    const repeat = await rpc(lh.httpUrl, `${ATTEMPTS}/CompleteAttempt`, { jobId, attemptId: a2.attemptId, result: { by: 'fast', pages: 3 } }, fast);
    expect(repeat).toMatchObject({ status: 200, json: { outcome: 'OUTCOME_DUPLICATE', job: { result: { by: 'fast', pages: 3 } } } });
    const differently = await rpc(lh.httpUrl, `${ATTEMPTS}/CompleteAttempt`, { jobId, attemptId: a2.attemptId, result: { by: 'fast', pages: 4 } }, fast);
    expect(differently).toMatchObject({ status: 409, json: { outcome: 'conflict', code: 'already_exists', current: { jobId, status: 'JOB_STATUS_SUCCEEDED', attemptNo: 2 } } });
    // Another agent cannot act on an attempt it does not hold.
    const notYours = await rpc(lh.httpUrl, `${ATTEMPTS}/CompleteAttempt`, { jobId, attemptId: a2.attemptId, result: {} }, slow);
    expect(notYours).toMatchObject({ status: 403, json: { outcome: 'forbidden' } });

    const detail = await rpc(lh.httpUrl, `${JOBS}/GetJob`, { jobId }, ADMIN_KEY);
    expect(detail.json.job).toMatchObject({ status: 'JOB_STATUS_SUCCEEDED', attemptNo: 2, result: { by: 'fast', pages: 3 } });
    expect(detail.json.attempts.map((a: { status: string }) => a.status)).toEqual(['ATTEMPT_STATUS_LEASE_EXPIRED', 'ATTEMPT_STATUS_SUCCEEDED']);
    expect(detail.json.staleReports.map((r: { call: string; currentAttemptNo: number }) => [r.call, r.currentAttemptNo])).toEqual([
      ['heartbeat', 2],
      ['complete', 2],
    ]);
    await checkInvariants(t.pool);
  });
});

describe('a heartbeat after a cancel', () => {
  it('is 409 stale, says the attempt was canceled, and is logged', async () => {
    const agent = await key('cancel-hb', ['agent']);
    const enq = await rpc(lh.httpUrl, `${JOBS}/EnqueueJob`, { queue: 'cancel-hb', payload: {} }, ADMIN_KEY);
    const jobId = enq.json.job.id as string;
    const claimed = await rpc(lh.httpUrl, `${ATTEMPTS}/ClaimJobs`, { queues: ['cancel-hb'], maxJobs: 1 }, agent);
    const attemptId = claimed.json.jobs[0].attemptId as string;
    expect((await rpc(lh.httpUrl, `${ATTEMPTS}/StartAttempt`, { jobId, attemptId }, agent)).status).toBe(200);
    expect((await rpc(lh.httpUrl, `${JOBS}/CancelJob`, { jobId }, ADMIN_KEY)).json.outcome).toBe('OUTCOME_OK');
    const hb = await rpc(lh.httpUrl, `${ATTEMPTS}/Heartbeat`, { jobId, attemptId }, agent);
    expect(hb).toMatchObject({
      status: 409,
      json: { code: 'aborted', outcome: 'stale', message: `attempt ${attemptId} was canceled`, current: { jobId, status: 'JOB_STATUS_CANCELED' } },
    });
    const detail = await rpc(lh.httpUrl, `${JOBS}/GetJob`, { jobId }, ADMIN_KEY);
    expect(detail.json.staleReports.map((r: { call: string }) => r.call)).toEqual(['heartbeat']);
  });
});

describe('what a stranger learns', () => {
  it('/healthz says up or unavailable and nothing more: not why (stopping, the database unreachable)', async () => {
    const log = pino({ level: 'silent' });
    const hub = new AgentHub(t.pool, log, { leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 });
    // A database that answers nothing: a port closed right after it was bound.
    const closed = await new Promise<number>((resolve) => {
      const srv = http.createServer().listen(0, '127.0.0.1', () => {
        const port = (srv.address() as { port: number }).port;
        srv.close(() => resolve(port));
      });
    });
    const deadDb = new pg.Pool({ connectionString: `postgres://nobody:x@127.0.0.1:${closed}/none`, connectionTimeoutMillis: 2000 });
    const deps = { hub, log, leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 };
    const up = await listenHttp({ ...deps, db: t.pool }, '127.0.0.1:0');
    const noDb = await listenHttp({ ...deps, db: deadDb }, '127.0.0.1:0');
    try {
      const ok = await fetch(`http://127.0.0.1:${up.address.port}/healthz`);
      expect([ok.status, await ok.json(), ok.headers.get('cache-control')]).toEqual([200, { status: 'ok' }, 'no-store']);
      const dbDown = await fetch(`http://127.0.0.1:${noDb.address.port}/healthz`);
      expect([dbDown.status, await dbDown.json()]).toEqual([503, { status: 'unavailable' }]);
      up.health.shutdown();
      const stopping = await fetch(`http://127.0.0.1:${up.address.port}/healthz`);
      expect([stopping.status, await stopping.json()]).toEqual([503, { status: 'unavailable' }]);
    } finally {
      await up.close();
      await noDb.close();
      await deadDb.end();
      await hub.stop();
    }
  });

  it('/healthz is 503 within its bound when the database takes no writes or does not answer at all; calls then are 503 to retry', async () => {
    const lines: Array<Record<string, unknown>> = [];
    const log = pino({ level: 'warn' }, { write: (l: string) => void lines.push(JSON.parse(l) as Record<string, unknown>) });
    const hub = new AgentHub(t.pool, log, { leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 });
    // A standby after a failover looks like this: it answers, and refuses every write.
    const readOnly = new pg.Pool({ connectionString: t.url, options: '-c default_transaction_read_only=on' });
    // A server that accepts the connection and never says a word (a lock, a silent network).
    const accepted: net.Socket[] = [];
    const mute = net.createServer((sock) => void accepted.push(sock));
    await new Promise<void>((r) => mute.listen(0, '127.0.0.1', () => r()));
    const muteDb = new pg.Pool({ connectionString: `postgres://u:p@127.0.0.1:${(mute.address() as net.AddressInfo).port}/db` });
    const deps = { hub, log, leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 };
    const ro = await listenHttp({ ...deps, db: readOnly }, '127.0.0.1:0');
    const silent = await listenHttp({ ...deps, db: muteDb }, '127.0.0.1:0');
    try {
      const r1 = await fetch(`http://127.0.0.1:${ro.address.port}/healthz`);
      expect([r1.status, await r1.json()]).toEqual([503, { status: 'unavailable' }]);
      // A call that needs a write there: 503 `unavailable`, to retry (it was 500 "internal error"),
      // and logged (it was not), through the direct enqueue and through Connect alike.
      const k = await keyCreate(t.pool, { name: 'ro-enqueuer', scopes: ['enqueue', 'read'] });
      if (k.outcome !== 'ok') throw new Error(k.outcome);
      for (const headers of [{}, { 'connect-timeout-ms': '5000' }] as Array<Record<string, string>>) {
        const e = await fetch(`http://127.0.0.1:${ro.address.port}/${JOBS}/EnqueueJob`, {
          method: 'POST',
          headers: { 'content-type': 'application/json', authorization: `Bearer ${k.value.key}`, ...headers },
          body: JSON.stringify({ queue: 'ro', payload: {} }),
        });
        expect([e.status, e.headers.get('retry-after'), await e.json()]).toEqual([503, '1', expect.objectContaining({ code: 'unavailable' })]);
      }
      // Logged (it was not): the first whole, the second within 10 s counted into one line later.
      expect(lines.filter((l) => l.msg === 'call failed: the database is unavailable')).toHaveLength(1);
      const t0 = performance.now();
      const r2 = await fetch(`http://127.0.0.1:${silent.address.port}/healthz`);
      expect([r2.status, await r2.json()]).toEqual([503, { status: 'unavailable' }]);
      expect(performance.now() - t0).toBeLessThan(HEALTHZ_PING_MS + 1_500);
    } finally {
      await ro.close();
      await silent.close();
      for (const sock of accepted) sock.destroy();
      await readOnly.end();
      await muteDb.end().catch(() => undefined);
      await new Promise((r) => mute.close(r));
      await hub.stop();
    }
  });

  it('never takes a key from the URL: a credential in the query string is refused before anything else', async () => {
    const cases: Array<[string, string, string]> = [
      ['POST', `/${JOBS}/ListJobs?key=${ADMIN_KEY}`, 'key'],
      ['POST', `/${JOBS}/EnqueueJob?access_token=${ADMIN_KEY}`, 'access_token'],
      ['GET', `/metrics?Token=${ADMIN_KEY}`, 'Token'],
      ['GET', `/healthz?api_key=x`, 'api_key'],
      ['GET', `/?key=${ADMIN_KEY}`, 'key'],
    ];
    for (const [method, url, field] of cases) {
      // With a valid key in the header too: the one in the URL is still refused, not ignored.
      const r = await fetch(`${lh.httpUrl}${url}`, {
        method,
        headers: { authorization: `Bearer ${ADMIN_KEY}`, 'content-type': 'application/json' },
        ...(method === 'POST' ? { body: '{"queue":"q"}' } : {}),
      });
      expect(r.status, url).toBe(400);
      const body = (await r.json()) as { outcome: string; field: string; message: string };
      expect(body, url).toMatchObject({ code: 'invalid_argument', status: 400, outcome: 'invalid', field });
      expect(body.message).toContain('Authorization: Bearer');
      expect(body.message).not.toContain(ADMIN_KEY);
    }
    // No job was enqueued by the refused call.
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE queue = 'q'`)).rows[0].n).toBe(0);
    // Other query parameters are no concern of this rule.
    expect((await fetch(`${lh.httpUrl}/healthz?probe=1`)).status).toBe(200);
  });
});

describe('TLS', () => {
  it('serves the gateway over HTTPS when a certificate and key are configured', async () => {
    const dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-https-'));
    try {
      const [cert, keyFile] = [path.join(dir, 'cert.pem'), path.join(dir, 'key.pem')];
      await promisify(execFile)('openssl', ['req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes', '-keyout', keyFile, '-out', cert, '-days', '1', '-subj', '/CN=localhost', '-addext', 'subjectAltName=IP:127.0.0.1']);
      const log = pino({ level: 'silent' });
      const hub = new AgentHub(t.pool, log, { leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 });
      const server = await listenHttp({ db: t.pool, hub, log, leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 }, '127.0.0.1:0', { certFile: cert, keyFile });
      try {
        const ca = await readFile(cert);
        const answer = await new Promise<{ status: number; body: string }>((resolve, reject) => {
          const req = https.request(
            { host: '127.0.0.1', port: server.address.port, path: '/leasehold.v1.JobService/ListJobs', method: 'POST', ca, headers: { 'content-type': 'application/json', authorization: `Bearer ${ADMIN_KEY}` } },
            (res) => {
              let body = '';
              res.on('data', (c: Buffer) => (body += c.toString()));
              res.on('end', () => resolve({ status: res.statusCode ?? 0, body }));
            },
          );
          req.on('error', reject);
          req.end('{"pageSize":1}');
        });
        expect(answer.status).toBe(200);
        expect(JSON.parse(answer.body)).toHaveProperty('jobs');
      } finally {
        await server.close();
        await hub.stop();
      }
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });
});

