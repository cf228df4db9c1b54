/**
 * The workflow templates of examples/n8n/ on real n8n (1.123.81, its default settings: Code nodes
 * in-process, no task runners) against a real coordinator. Each template gets a fresh n8n user
 * folder; workflows and credentials go in through n8n's own CLI (`import:credentials`,
 * `import:workflow`), `n8n execute` runs the manual-trigger path and prints the execution, and
 * `n8n start` serves the webhook templates and the Wait node's resume URLs. What the templates
 * did is read back from the coordinator's database and from n8n's execution output (for
 * executions that wait and resume, from n8n's own database).
 *
 * Skipped unless LEASEHOLD_N8N_DIR names a folder where `npm i n8n@1.123.81` was run;
 * LEASEHOLD_REQUIRE_N8N=1 turns the skip into a failure (CI installs n8n).
 */
import { createHmac, randomBytes } from 'node:crypto';
import { writeFile } from 'node:fs/promises';
import http from 'node:http';
import { createRequire } from 'node:module';
import type { AddressInfo } from 'node:net';
import path from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { keyCreate, subscriptionCreate } from '../server/store/index.js';
import { ADMIN_KEY, useCoordinator, waitFor } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { rpc } from './helpers/http.js';
import { N8N_DIR, n8nHome, n8nMissing, prepare, readTemplate, type Execution, type N8nHome, type NodeRun } from './helpers/n8n.js';
import { freePort } from './helpers/ports.js';

if (n8nMissing && process.env.LEASEHOLD_REQUIRE_N8N === '1') throw new Error(`LEASEHOLD_REQUIRE_N8N=1 but ${n8nMissing}`);

const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_WEBHOOK_INTERVAL: '50ms' });
/** Each n8n command takes seconds (a dozen on a busy 2-core machine). */
const N8N_TIMEOUT = 240_000;
const homes: N8nHome[] = [];
const servers: http.Server[] = [];

/** A scoped API key made with the store, as `leasehold keys add` makes it. */
async function apiKey(name: string, scopes: string[]) {
  const k = await keyCreate(t.pool, { name, scopes });
  if (k.outcome !== 'ok') throw new Error(JSON.stringify(k));
  return k.value.key;
}

/** A fresh n8n user folder, removed after the test. */
async function home() {
  const h = await n8nHome();
  homes.push(h);
  return h;
}

/** A local HTTP server; `handle` answers each request (body read). Closed after the test. */
async function listen(handle: (req: http.IncomingMessage, body: string, res: http.ServerResponse) => void | Promise<void>) {
  const s = http.createServer((req, res) => {
    let body = '';
    req.on('data', (c: Buffer) => (body += c.toString('utf8')));
    req.on('end', () => {
      Promise.resolve(handle(req, body, res)).catch((e: unknown) => res.writeHead(500).end(String(e)));
    });
  });
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', () => r()));
  servers.push(s);
  return `http://127.0.0.1:${(s.address() as AddressInfo).port}`;
}

const API_CRED = { id: 'lhApiKey00000001', name: 'Leasehold API key' };
const AGENT_CRED = { id: 'lhAgentKey000001', name: 'Leasehold agent key' };
const RESUME_CRED = { id: 'lhResumeTok00001', name: 'Leasehold resume token' };
const credentialIds = { [API_CRED.name]: API_CRED.id, [AGENT_CRED.name]: AGENT_CRED.id, [RESUME_CRED.name]: RESUME_CRED.id };

/** Imports `httpHeaderAuth` credentials with any header (`importCredentials` makes `Authorization: Bearer` ones). */
async function importHeaderCredentials(h: N8nHome, creds: Array<{ id: string; name: string; header: string; value: string }>) {
  const file = path.join(h.dir, 'header-credentials.json');
  await writeFile(file, JSON.stringify(creds.map((c) => ({ id: c.id, name: c.name, type: 'httpHeaderAuth', data: { name: c.header, value: c.value } }))));
  await h.cli(['import:credentials', `--input=${file}`]);
}

/** Runs `fn` with n8n's SQLite database (read-only), opened with n8n's own sqlite3. */
async function withN8nDb<T>(h: N8nHome, fn: (get: (sql: string, params: unknown[]) => Promise<any>) => Promise<T>): Promise<T> {
  const sqlite3 = createRequire(path.join(N8N_DIR!, 'package.json'))('sqlite3') as any;
  const db = await new Promise<any>((resolve, reject) => {
    const d = new sqlite3.Database(path.join(h.dir, '.n8n', 'database.sqlite'), sqlite3.OPEN_READONLY, (e: Error | null) => (e ? reject(e) : resolve(d)));
  });
  try {
    db.configure('busyTimeout', 5000);
    return await fn((sql, params) => new Promise((resolve, reject) => db.get(sql, params, (e: Error | null, r: unknown) => (e ? reject(e) : resolve(r)))));
  } finally {
    await new Promise((r) => db.close(r));
  }
}

/** An execution as n8n stored it (its status: waiting, running, success, error …). */
async function storedExecution(h: N8nHome, id: string): Promise<Execution & { status: string }> {
  const { parse } = createRequire(path.join(N8N_DIR!, 'package.json'))('flatted') as { parse(text: string): any };
  const row = (await withN8nDb(h, (get) =>
    get('SELECT e.status, d.data FROM execution_entity e JOIN execution_data d ON d.executionId = e.id WHERE e.id = ?', [id]),
  )) as { status: string; data: string } | undefined;
  if (!row) throw new Error(`n8n has no execution ${id}`);
  const result = parse(row.data).resultData ?? {};
  const runData = (result.runData ?? {}) as Record<string, Array<{ data?: { main: NodeRun['main'] }; error?: unknown }>>;
  const runs: Record<string, NodeRun[]> = {};
  for (const [k, v] of Object.entries(runData)) runs[k] = v.map((r) => ({ main: r.data?.main ?? [], error: r.error }));
  return {
    status: row.status,
    ok: !result.error,
    lastNodeExecuted: result.lastNodeExecuted,
    error: result.error,
    runs,
    out: (node, output = 0) => (runs[node]?.[0]?.main[output] ?? []).map((i) => i.json),
    ran: (node) => node in runs,
  };
}

/**
 * `n8n execute --id`, and what it ran. On 1.123.81 the command now and then dies of SIGSEGV on
 * its way out, after it stored and printed the execution (a thread of isolated-vm, n8n's
 * expression engine, collects garbage while the process exits; most often beside a running
 * `n8n start`, and after a Wait node); the helper reports that as "killed". The execution it
 * stored is then read from n8n's database, the same run data it printed.
 */
async function execute(h: N8nHome, id: string): Promise<Execution> {
  const newest = () =>
    withN8nDb(h, (get) => get(`SELECT max(id) AS id FROM execution_entity WHERE workflowId = ? AND mode = 'cli'`, [id])).then((r) => (r?.id ?? 0) as number);
  const before = await newest();
  try {
    return await h.execute(id);
  } catch (e) {
    if (!/^n8n execute .*: killed after/.test((e as Error).message)) throw e;
    const after = await newest();
    const stored = after > before ? await storedExecution(h, String(after)) : undefined;
    if (!stored || !['success', 'error', 'waiting'].includes(stored.status)) throw e;
    return stored;
  }
}

describe.skipIf(n8nMissing)(`the n8n templates on real n8n${n8nMissing ? ` (skipped: ${n8nMissing})` : ''}`, () => {
  afterEach(async () => {
    for (const h of homes.splice(0)) await h.close();
    for (const s of servers.splice(0)) {
      s.closeAllConnections();
      await new Promise((r) => s.close(r));
    }
  });

  it('a: enqueues once; a re-run is a duplicate; another payload under the key takes the 409 branch; bad input stops with the 400', { timeout: N8N_TIMEOUT }, async () => {
    const h = await home();
    await h.importCredentials([{ ...API_CRED, key: await apiKey('n8n-enqueue', ['enqueue', 'read']) }]);
    const a = await readTemplate('a-enqueue-job.json');
    const base = { baseUrl: lh.httpUrl, credentialIds };
    await h.importWorkflows([
      prepare(a, { ...base, id: 'tplA000000000001' }),
      prepare(a, { ...base, id: 'tplA000000000002', replace: [["format: 'pdf'", "format: 'csv'"]] }),
      prepare(a, { ...base, id: 'tplA000000000003', replace: [["queue: 'reports'", "queue: 'has space'"]] }),
    ]);

    const first = await execute(h, 'tplA000000000001');
    expect(first.ok, JSON.stringify(first.error)).toBe(true);
    const [enqueued] = first.out('Job enqueued');
    expect(enqueued).toMatchObject({ outcome: 'OUTCOME_OK', status: 'JOB_STATUS_QUEUED' });
    const { rows } = await t.pool.query('SELECT id, queue, payload, status FROM jobs WHERE idempotency_key = $1', ['report-R-1001']);
    expect(rows).toEqual([{ id: enqueued.jobId, queue: 'reports', payload: { reportId: 'R-1001', format: 'pdf' }, status: 'queued' }]);

    const again = await execute(h, 'tplA000000000001');
    expect(again.ok).toBe(true);
    expect(again.out('Job enqueued')).toEqual([{ jobId: enqueued.jobId, status: 'JOB_STATUS_QUEUED', outcome: 'OUTCOME_DUPLICATE' }]);

    const other = await execute(h, 'tplA000000000002');
    expect(other.ok).toBe(true);
    expect(other.ran('Job enqueued')).toBe(false);
    const [conflict] = other.out('Key already used with another payload');
    expect(conflict).toMatchObject({ statusCode: 409, body: { outcome: 'conflict', current: { jobId: enqueued.jobId } } });

    const bad = await execute(h, 'tplA000000000003');
    expect(bad.ok).toBe(false);
    expect(bad.lastNodeExecuted).toBe('Leasehold refused the job');
    expect(bad.error?.message).toMatch(/^400 invalid: .*\(field queue\)$/);
    expect((await t.pool.query('SELECT count(*)::int AS n FROM jobs')).rows[0].n).toBe(1);
    // Out of the way of template d (same queue).
    expect((await rpc(lh.httpUrl, 'leasehold.v1.JobService/CancelJob', { jobId: enqueued.jobId }, ADMIN_KEY)).status).toBe(200);
  });

  it('d: claims, starts, heartbeats and completes a job the test enqueued; a completion after the lease was lost takes the 409 branch', { timeout: N8N_TIMEOUT }, async () => {
    const h = await home();
    await h.importCredentials([{ ...AGENT_CRED, key: await apiKey('n8n-worker', ['agent']) }]);
    // The late run: its work (part 2) waits at a gate while the test takes the lease away.
    let gateJob = '';
    const gate = await listen(async (_req, _body, res) => {
      await t.pool.query(`UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1`, [gateJob]);
      await waitFor('the reaper to requeue the job', async () => (await t.pool.query(`SELECT status FROM jobs WHERE id = $1`, [gateJob])).rows[0]?.status === 'queued');
      res.writeHead(200, { 'content-type': 'application/json' }).end('{}');
    });
    const d = await readTemplate('d-agent-loop.json');
    const part2 = (d.nodes as Array<{ name: string; parameters: { jsCode: string } }>).find((n) => n.name === 'Do the work (part 2)')!.parameters.jsCode;
    await h.importWorkflows([
      prepare(d, { baseUrl: lh.httpUrl, credentialIds, id: 'tplD000000000001' }),
      prepare(d, {
        baseUrl: lh.httpUrl,
        credentialIds,
        id: 'tplD000000000002',
        replace: [[part2, `await this.helpers.httpRequest({ method: 'POST', url: '${gate}/slow-work', json: true, body: {} });\n${part2}`]],
      }),
    ]);

    const enq = await rpc(lh.httpUrl, 'leasehold.v1.JobService/EnqueueJob', { queue: 'reports', payload: { reportId: 'R-2' } }, ADMIN_KEY);
    expect(enq.status).toBe(200);
    const jobId = enq.json.job.id as string;
    const run = await execute(h, 'tplD000000000001');
    expect(run.ok, JSON.stringify(run.error)).toBe(true);
    expect(run.out('Start (StartAttempt)')[0]).toMatchObject({ statusCode: 200 });
    expect(run.out('Heartbeat')[0]).toMatchObject({ statusCode: 200 });
    expect(run.out('Complete (CompleteAttempt)')[0]).toMatchObject({ statusCode: 200, body: { outcome: 'OUTCOME_OK' } });
    expect(run.ran('Done')).toBe(true);
    const job = (await t.pool.query('SELECT status, result, progress, heartbeat_at, agent_id FROM jobs WHERE id = $1', [jobId])).rows[0];
    expect(job).toMatchObject({ status: 'succeeded', result: { part1: 'done', part2: 'done', input: { reportId: 'R-2' } } });
    const attempts = (await t.pool.query('SELECT attempt_no, agent_id, status, started_at FROM attempt_log WHERE job_id = $1', [jobId])).rows;
    expect(attempts).toEqual([{ attempt_no: 1, agent_id: 'n8n-worker', status: 'succeeded', started_at: expect.any(Date) }]);
    expect(job.heartbeat_at).not.toBeNull();
    expect(job.progress).toEqual({ step: 1 });

    const late = await rpc(lh.httpUrl, 'leasehold.v1.JobService/EnqueueJob', { queue: 'reports', payload: { reportId: 'R-3' } }, ADMIN_KEY);
    gateJob = late.json.job.id as string;
    const lateRun = await execute(h, 'tplD000000000002');
    expect(lateRun.ok, JSON.stringify(lateRun.error)).toBe(true);
    expect(lateRun.out('Heartbeat')[0]).toMatchObject({ statusCode: 200 });
    expect(lateRun.ran('Done')).toBe(false);
    const [stale] = lateRun.out('Not current any more (409 stale)');
    expect(stale).toMatchObject({ statusCode: 409, body: { outcome: 'stale', current: { jobId: gateJob, status: 'JOB_STATUS_QUEUED', attemptNo: 1 } } });
    expect((await t.pool.query('SELECT status, result FROM jobs WHERE id = $1', [gateJob])).rows[0]).toEqual({ status: 'queued', result: null });
    expect((await t.pool.query(`SELECT call FROM stale_reports WHERE job_id = $1`, [gateJob])).rows).toEqual([{ call: expect.stringMatching(/complete/i) }]);
  });
  it('b and c on a running n8n: signed deliveries verified, a tampered body or an old timestamp refused (401), one alert per dead job across push and poll', { timeout: N8N_TIMEOUT }, async () => {
    const h = await home();
    await h.importCredentials([{ ...API_CRED, key: await apiKey('n8n-reader', ['read']) }]);
    const port = await freePort();
    const hooks = `http://127.0.0.1:${port}/webhook`;
    const subB = await subscriptionCreate(t.pool, { queue: 'notified', url: `${hooks}/leasehold-events`, events: ['job.succeeded'] });
    const subC = await subscriptionCreate(t.pool, { queue: '*', url: `${hooks}/leasehold-dead-letters`, events: ['job.dead'] });
    if (subB.outcome !== 'ok' || subC.outcome !== 'ok') throw new Error('subscriptions');
    const alerts: Array<{ text: string }> = [];
    const chat = await listen((_req, body, res) => {
      alerts.push(JSON.parse(body) as { text: string });
      res.writeHead(200, { 'content-type': 'application/json' }).end('{}');
    });
    const secret = 'REPLACE_WITH_SIGNING_SECRET';
    await h.importWorkflows([
      prepare(await readTemplate('b-receive-notifications.json'), { baseUrl: lh.httpUrl, credentialIds, id: 'tplB000000000001', replace: [[secret, subB.value.secret]] }),
      prepare(await readTemplate('c-dead-letter-alert.json'), {
        baseUrl: lh.httpUrl,
        credentialIds,
        id: 'tplC000000000001',
        replace: [[secret, subC.value.secret], ['https://hooks.example.com/REPLACE_WITH_YOUR_CHAT_WEBHOOK', `${chat}/chat`]],
      }),
    ]);
    await h.activate('tplB000000000001');
    await h.activate('tplC000000000001');
    await h.start(port);

    const worker = await apiKey('doomed-worker', ['agent']);
    const finish = async (queue: string, how: 'complete' | 'die') => {
      const enq = await rpc(lh.httpUrl, 'leasehold.v1.JobService/EnqueueJob', { queue, payload: { n: 1 }, maxAttempts: 1 }, ADMIN_KEY);
      const c = (await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/ClaimJobs', { queues: [queue] }, worker)).json.jobs[0];
      await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/StartAttempt', { attemptId: c.attemptId }, worker);
      const r =
        how === 'complete'
          ? await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/CompleteAttempt', { attemptId: c.attemptId, result: { ok: true } }, worker)
          : await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/FailAttempt', { attemptId: c.attemptId, error: { message: 'no disk' }, retryable: true }, worker);
      expect(r.status).toBe(200);
      return enq.json.job.id as string;
    };
    const delivered = (jobId: string) =>
      waitFor(`the delivery of ${jobId}'s event`, async () => {
        const { rows } = await t.pool.query(
          `SELECT d.status, d.last_status, e.id, e.body FROM webhook_deliveries d JOIN webhook_events e ON e.id = d.event_id WHERE e.job_id = $1`,
          [jobId],
        );
        return rows[0]?.status === 'delivered' ? (rows[0] as { last_status: number; id: string; body: string }) : undefined;
      }, 30_000);
    const post = (path: string, body: string, ts: string, key: string, sig?: string) =>
      fetch(`${hooks}/${path}`, {
        method: 'POST',
        headers: {
          'content-type': 'application/json',
          'leasehold-timestamp': ts,
          'leasehold-signature': sig ?? `sha256=${createHmac('sha256', key).update(`${ts}.${body}`).digest('hex')}`,
        },
        body,
      });
    const now = () => String(Math.floor(Date.now() / 1000));

    // b: the coordinator's own signed delivery is taken (200); sent again it is a duplicate.
    const okJob = await finish('notified', 'complete');
    const b = await delivered(okJob);
    expect(b.last_status).toBe(200);
    const replay = await post('leasehold-events', b.body, now(), subB.value.secret);
    expect(replay.status).toBe(200);
    expect(await replay.json()).toEqual({ received: b.id, duplicate: true });

    // c: pushed first, then polled: one alert.
    const deadJob = await finish('doomed', 'die');
    const c = await delivered(deadJob);
    expect(c.last_status).toBe(200);
    await waitFor('the pushed alert', () => alerts.length >= 1);
    const poll = await execute(h, 'tplC000000000001');
    expect(poll.ok, JSON.stringify(poll.error)).toBe(true);
    expect(poll.out('List dead jobs')[0].body.jobs.map((j: { id: string }) => j.id)).toEqual([deadJob]);
    expect(poll.out('Dead jobs not alerted yet')).toEqual([]);
    expect(alerts).toEqual([{ text: expect.stringContaining(`job ${deadJob} on queue doomed is dead after 1 attempts: no disk`) }]);
    // A second dead job the poll finds first: the later push does not alert again.
    await t.pool.query(`DELETE FROM subscriptions WHERE id = $1`, [subC.value.id]);
    const deadJob2 = await finish('doomed', 'die');
    const poll2 = await execute(h, 'tplC000000000001');
    expect(poll2.out('Dead jobs not alerted yet').map((i: { job: { id: string } }) => i.job.id)).toEqual([deadJob2]);
    await waitFor('the polled alert', () => alerts.length >= 2);
    const body2 = (await t.pool.query(`SELECT body FROM webhook_events WHERE job_id = $1 AND type = 'job.dead'`, [deadJob2])).rows[0].body as string;
    const late = await post('leasehold-dead-letters', body2, now(), subC.value.secret);
    expect(late.status).toBe(200);
    expect(alerts.map((a) => a.text.match(/job (\S+)/)![1])).toEqual([deadJob, deadJob2]);

    // Both refuse a tampered body and a stale timestamp.
    for (const [path, body, key] of [['leasehold-events', b.body, subB.value.secret], ['leasehold-dead-letters', c.body, subC.value.secret]] as const) {
      const ts = now();
      const sig = `sha256=${createHmac('sha256', key).update(`${ts}.${body}`).digest('hex')}`;
      const tampered = body.replace(/"n": ?1/, '"n": 2');
      expect(tampered).not.toBe(body);
      expect((await post(path, tampered, ts, key, sig)).status, path).toBe(401);
      expect((await post(path, body, String(Number(ts) - 3600), key)).status, path).toBe(401);
      expect((await post(path, body, ts, key, sig)).status, path).toBe(200);
    }
    expect(alerts).toHaveLength(2);
  });

  it('e: the execution waits for its job; the notification resumes it (Header Auth) on the branch of the outcome; a wrong header is refused (403); a redelivery to the finished execution is final (409)', { timeout: N8N_TIMEOUT }, async () => {
    const h = await home();
    const token = `rt_${randomBytes(24).toString('base64url')}`;
    await importHeaderCredentials(h, [
      { ...API_CRED, header: 'Authorization', value: `Bearer ${await apiKey('n8n-waiting', ['enqueue', 'read'])}` },
      { ...RESUME_CRED, header: 'X-Resume-Token', value: token },
    ]);
    const e = prepare(await readTemplate('e-wait-for-job.json'), {
      baseUrl: lh.httpUrl,
      credentialIds,
      id: 'tplE000000000001',
      replace: [['REPLACE_WITH_RESUME_TOKEN', token]],
    });
    // Its own queue: template d's late job is still queued on 'reports'.
    const queueField = (e.nodes as Array<{ name: string; parameters: any }>)
      .find((n) => n.name === 'Build the job')!
      .parameters.assignments.assignments.find((a: { name: string }) => a.name === 'queue');
    queueField.value = 'waited';
    await h.importWorkflows([e]);

    // `n8n execute` runs the workflow up to the Wait node, where n8n stores the execution as
    // waiting and the command ends; `n8n start` then serves its resume URL. The URL is made by the
    // process that ran the node, from WEBHOOK_URL (n8n's public URL; a real instance sets it too).
    // Twice: two executions wait, each with its own job and resume URL.
    const port = await freePort();
    process.env.WEBHOOK_URL = `http://127.0.0.1:${port}/`;
    try {
      for (let i = 0; i < 2; i++) {
        const run = await execute(h, 'tplE000000000001');
        expect(run.ok, JSON.stringify(run.error)).toBe(true);
        expect(run.lastNodeExecuted).toBe('Wait for the job');
      }
    } finally {
      delete process.env.WEBHOOK_URL;
    }
    const n8n = await h.start(port);
    const jobs = (await t.pool.query(`SELECT id, notify_url FROM jobs WHERE queue = 'waited' ORDER BY created_at, id`)).rows as Array<{ id: string; notify_url: string }>;
    expect(jobs).toHaveLength(2);
    const waiting: Array<{ jobId: string; url: string; executionId: string }> = [];
    for (const job of jobs) {
      const [, executionId] = /^http:\/\/127\.0\.0\.1:\d+\/webhook-waiting\/(\d+)$/.exec(job.notify_url) ?? [];
      expect(executionId, job.notify_url).toBeDefined();
      expect(job.notify_url.startsWith(`${n8n.url}/`)).toBe(true);
      const stored = await storedExecution(h, executionId!);
      expect(stored).toMatchObject({ status: 'waiting', lastNodeExecuted: 'Wait for the job' });
      expect(stored.ran('Succeeded?')).toBe(false);
      const [enqueued] = stored.out('Enqueue job');
      expect(enqueued).toMatchObject({ statusCode: 200, body: { outcome: 'OUTCOME_OK', job: { id: job.id, queue: 'waited', payload: { reportId: 'R-3001', format: 'pdf' } } } });
      expect(JSON.stringify(enqueued), 'the answer does not echo the header').not.toContain(token);
      waiting.push({ jobId: job.id, url: job.notify_url, executionId: executionId! });
    }
    const [ok, doomed] = waiting as [(typeof waiting)[number], (typeof waiting)[number]];
    expect(ok.executionId).not.toBe(doomed.executionId);

    // Without the header, or with another value, n8n refuses to resume, and the execution waits on.
    const resume = (headers: Record<string, string>) =>
      fetch(ok.url, { method: 'POST', headers: { 'content-type': 'application/json', ...headers }, body: JSON.stringify({ type: 'job.succeeded', job: { id: ok.jobId }, result: { forged: true } }) });
    expect((await resume({})).status).toBe(403);
    expect((await resume({ 'x-resume-token': `${token}x` })).status).toBe(403);
    expect((await storedExecution(h, ok.executionId)).status).toBe('waiting');

    // An agent does the two jobs: one succeeds, one fails for good.
    const worker = await apiKey('waited-worker', ['agent']);
    const claimed = (await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/ClaimJobs', { queues: ['waited'], maxJobs: 2 }, worker)).json.jobs as Array<{ attemptId: string; job: { id: string } }>;
    expect(claimed.map((c) => c.job.id).sort()).toEqual([ok.jobId, doomed.jobId].sort());
    for (const c of claimed) {
      expect((await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/StartAttempt', { attemptId: c.attemptId }, worker)).status).toBe(200);
      const r =
        c.job.id === ok.jobId
          ? await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/CompleteAttempt', { attemptId: c.attemptId, result: { pages: 3, url: 's3://reports/R-3001.pdf' } }, worker)
          : await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/FailAttempt', { attemptId: c.attemptId, error: { message: 'printer on fire' }, retryable: false }, worker);
      expect(r.status).toBe(200);
    }

    // The coordinator's deliveries resume them (n8n answers 200 on receipt).
    const deliveries = async (jobId: string) =>
      (await rpc(lh.httpUrl, 'leasehold.v1.AdminService/ListDeliveries', { jobId }, ADMIN_KEY)).json.deliveries as Array<Record<string, any>>;
    for (const w of waiting) {
      const [d] = await waitFor(`the delivery of job ${w.jobId}`, async () => {
        const ds = await deliveries(w.jobId);
        return ds[0]?.status === 'delivered' ? ds : undefined;
      }, 30_000);
      expect(d).toMatchObject({ url: w.url, subscriptionId: '', attempts: 1, lastStatus: 200 });
    }
    // n8n (SQLite, no pool) writes an execution's status, then its data: done when both are.
    const finished = (id: string) =>
      waitFor(`n8n to finish execution ${id}`, async () => {
        const x = await storedExecution(h, id);
        return (x.status === 'success' || x.status === 'error') && x.lastNodeExecuted !== 'Wait for the job' ? x : undefined;
      }, 60_000);
    const done = await finished(ok.executionId);
    expect(done.status).toBe('success');
    expect(done.out('Job succeeded')).toEqual([{ jobId: ok.jobId, result: { pages: 3, url: 's3://reports/R-3001.pdf' } }]);
    expect(done.ran('The job did not succeed')).toBe(false);
    const failed = await finished(doomed.executionId);
    expect(failed.status).toBe('error');
    expect(failed.lastNodeExecuted).toBe('The job did not succeed');
    expect(failed.error?.message).toBe(`job ${doomed.jobId} ended with job.failed: printer on fire`);
    expect(failed.ran('Job succeeded')).toBe(false);

    // The deliverer dies between sending and recording the send: the sweep sends it again, n8n
    // answers 409 (the execution is over), and the delivery is failed after that one try.
    const [first] = await deliveries(ok.jobId);
    await t.pool.query(
      `UPDATE webhook_deliveries SET status = 'sending', claim_id = gen_random_uuid(), claimed_until = now() - interval '1 second', delivered_at = NULL WHERE id = $1`,
      [first!.id],
    );
    const [again] = await waitFor('the redelivery', async () => {
      const ds = await deliveries(ok.jobId);
      return ds[0]?.status === 'failed' ? ds : undefined;
    }, 30_000);
    // Failed after 2 of its 12 tries: final, so no backoff and no further send (only an operator's
    // `deliveries retry` sends a failed delivery again).
    expect(again).toMatchObject({ id: first!.id, attempts: 2, lastStatus: 409, lastError: expect.stringContaining('409') });
    expect((await storedExecution(h, ok.executionId)).out('Job succeeded')).toHaveLength(1);
  });
});
