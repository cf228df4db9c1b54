/**
 * GET /metrics on the HTTP listener: it needs a key with the read scope, answers the Prometheus
 * text format (parsed here line by line), and its numbers move when work happens: a job run by a
 * stream agent (claims, starts, enqueue-to-start latency, outcomes, jobs by state and queue,
 * streams), one run by a stream-less agent, a lease that expires (expiries, revocations, reaper
 * runs) and a webhook delivered; the vacuumer's VACUUMs.
 */
import { describe, expect, it } from 'vitest';
import { jobEnqueue, keyCreate, signingSecretGet } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, until, useCoordinator } from './helpers/coordinator.js';
import { rpc, startReceiver } from './helpers/http.js';
import { RawAgent, toStruct } from './helpers/raw-agent.js';

const t = useTestDb();
// Claims wait 30 s for their start: on a loaded machine (CI runs the benchmark smoke beside this
// file) a start can take longer than the usual 1.5 s, and this test is about counting, not that.
// Leases stay 1.5 s so one expires within the test.
const lh = useCoordinator(t, { LEASEHOLD_CLAIM_TTL: '30s', LEASEHOLD_VACUUM_DEAD_ROWS: '500' });

/** One sample: `name{labels} value`. */
interface Sample {
  name: string;
  labels: Record<string, string>;
  value: number;
}

/** Parses the Prometheus text exposition format (the subset prom-client writes). */
function parse(text: string): { samples: Sample[]; types: Map<string, string> } {
  const samples: Sample[] = [];
  const types = new Map<string, string>();
  for (const line of text.split('\n')) {
    if (!line.trim()) continue;
    const type = /^# TYPE (\S+) (\S+)$/.exec(line);
    if (type) types.set(type[1]!, type[2]!);
    if (line.startsWith('#')) continue;
    const m = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$/.exec(line);
    if (!m) throw new Error(`not an exposition line: ${line}`);
    const labels: Record<string, string> = {};
    for (const l of (m[2] ?? '').matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]!] = l[2]!.replace(/\\(.)/g, '$1');
    samples.push({ name: m[1]!, labels, value: Number(m[3]) });
  }
  return { samples, types };
}

async function scrape(key = ADMIN_KEY) {
  const res = await fetch(`${lh.httpUrl}/metrics`, { headers: { authorization: `Bearer ${key}` } });
  expect(res.status).toBe(200);
  expect(res.headers.get('content-type')).toMatch(/^text\/plain; version=0\.0\.4/);
  const m = parse(await res.text());
  /** The value of the sample with `name` whose labels include `labels` (0 when absent). */
  const get = (name: string, labels: Record<string, string> = {}) =>
    m.samples.find((s) => s.name === name && Object.entries(labels).every(([k, v]) => s.labels[k] === v))?.value ?? 0;
  return { ...m, get };
}

describe('/metrics', () => {
  it('needs a key with the read scope', async () => {
    expect((await fetch(`${lh.httpUrl}/metrics`)).status).toBe(401);
    expect((await fetch(`${lh.httpUrl}/metrics`, { headers: { authorization: 'Bearer nope' } })).status).toBe(401);
    const enq = await keyCreate(t.pool, { name: 'metrics-enqueue', scopes: ['enqueue'] });
    const read = await keyCreate(t.pool, { name: 'metrics-read', scopes: ['read'] });
    if (enq.outcome !== 'ok' || read.outcome !== 'ok') throw new Error('keys');
    expect((await fetch(`${lh.httpUrl}/metrics`, { headers: { authorization: `Bearer ${enq.value.key}` } })).status).toBe(403);
    const m = await scrape(read.value.key);
    // The default process metrics come with ours.
    expect(m.types.get('process_cpu_user_seconds_total')).toBe('counter');
    expect(m.types.get('nodejs_eventloop_lag_seconds')).toBe('gauge');
    expect(m.types.get('leasehold_job_start_latency_seconds')).toBe('histogram');
  });

  it("counts the vacuumer's VACUUMs of jobs_live and the time they took", async () => {
    const before = await scrape();
    expect(before.types.get('leasehold_live_vacuums_total')).toBe('counter');
    const vacuumer = lh.c.vacuumer!;
    // Autovacuum kept off this table here: on a loaded machine it could VACUUM these rows before
    // the vacuumer's next look, which then counts from that VACUUM and runs none of its own.
    await t.pool.query('ALTER TABLE jobs_live SET (autovacuum_enabled = false)');
    // Changes past its threshold (rows deleted from jobs_live), the statistics flushed at once.
    await t.pool.query(`INSERT INTO jobs (queue, payload) SELECT 'metrics-vacuum', '{}'::jsonb FROM generate_series(1, $1)`, [vacuumer.config.deadRows]);
    const c = await t.pool.connect();
    try {
      await c.query(`DELETE FROM jobs_live WHERE queue = 'metrics-vacuum'`);
      await c.query('SELECT pg_stat_force_next_flush()');
    } finally {
      c.release();
    }
    // Its next look (every second) sees them.
    const after = await until(lh, 'a VACUUM counted', async () => {
      const m = await scrape();
      return m.get('leasehold_live_vacuums_total') > before.get('leasehold_live_vacuums_total') ? m : undefined;
    });
    expect(after.get('leasehold_live_vacuum_seconds_total')).toBeGreaterThan(before.get('leasehold_live_vacuum_seconds_total'));
    await t.pool.query('ALTER TABLE jobs_live RESET (autovacuum_enabled)');
  });

  it('moves when a stream agent runs a job, a stream-less agent runs one, a lease expires and a webhook is delivered', async () => {
    const receiver = await startReceiver();
    try {
      receiver.secret('/hook', await signingSecretGet(t.pool));
      const before = await scrape();
      const token = await lh.agent('metrics-agent');
      const a = RawAgent.open(`127.0.0.1:${lh.port}`, { agentId: 'metrics-agent', token, queues: ['metrics'], slots: 1 });
      try {
        await a.next('welcome');
        const o = await jobEnqueue(t.pool, { queue: 'metrics', payload: {}, notifyUrl: `${receiver.url}/hook` });
        if (o.outcome !== 'ok') throw new Error('enqueue');
        const c = (await a.next('assign')).assign.jobs[0];
        a.send({ started: { attemptIds: [c.attemptId] } });
        a.send({ completed: { results: [{ attemptId: c.attemptId, result: toStruct({ ok: 1 }) }] } });
        expect((await a.next('ack')).ack.items[0].outcome).toBe('OUTCOME_OK');
        const during = await scrape();
        expect(during.get('leasehold_agent_streams')).toBeGreaterThanOrEqual(1);
        expect(during.get('leasehold_agents_connected')).toBeGreaterThanOrEqual(1);
        expect(during.get('leasehold_agent_slots', { state: 'total' })).toBeGreaterThanOrEqual(1);

        // A second job: started and left without heartbeats, so the lease (1.5 s) runs out.
        a.send({ credit: { n: 1 } });
        await jobEnqueue(t.pool, { queue: 'metrics', payload: { lazy: true } });
        const lazy = (await a.next('assign')).assign.jobs[0];
        a.send({ started: { attemptIds: [lazy.attemptId] } });
        // Its start confirmed (a Renewed naming it), then nothing more from the agent.
        for (;;) if ((await a.next('renewed')).renewed.attemptIds.includes(lazy.attemptId)) break;
        const revoke = (await a.next('revoke', 10_000)).revoke;
        expect(revoke).toMatchObject({ attemptIds: [lazy.attemptId], reason: 'REVOKE_REASON_LEASE_EXPIRED', detail: expect.stringMatching(/^lease expired: /) });
      } finally {
        a.close();
      }

      // A stream-less agent: claim, start and fail it for good over the gateway.
      const key = await keyCreate(t.pool, { name: 'metrics-script', scopes: ['agent'] });
      if (key.outcome !== 'ok') throw new Error('key');
      await jobEnqueue(t.pool, { queue: 'metrics-script', payload: {} });
      const claimed = (await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/ClaimJobs', { queues: ['metrics-script'] }, key.value.key)).json.jobs[0];
      expect((await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/StartAttempt', { attemptId: claimed.attemptId }, key.value.key)).status).toBe(200);
      const failed = await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/FailAttempt', { attemptId: claimed.attemptId, error: { message: 'no' }, retryable: false }, key.value.key);
      expect(failed.status).toBe(200);

      await receiver.waitFor('the notification', (r) => r.events.size >= 1);
      const after = await until(lh, 'the delivery counted', async () => {
        const m = await scrape();
        return m.get('leasehold_webhook_sends_total', { result: 'delivered' }) > before.get('leasehold_webhook_sends_total', { result: 'delivered' }) ? m : undefined;
      });
      const moved = (name: string, labels: Record<string, string> = {}) => after.get(name, labels) - before.get(name, labels);
      expect(moved('leasehold_claims_total', { via: 'stream' })).toBe(2);
      expect(moved('leasehold_claims_total', { via: 'gateway' })).toBe(1);
      expect(moved('leasehold_attempts_started_total', { via: 'stream' })).toBe(2);
      expect(moved('leasehold_attempts_started_total', { via: 'gateway' })).toBe(1);
      expect(moved('leasehold_job_start_latency_seconds_count', { queue: 'metrics' })).toBe(2);
      expect(moved('leasehold_job_start_latency_seconds_bucket', { queue: 'metrics', le: '+Inf' })).toBe(2);
      expect(after.get('leasehold_job_start_latency_seconds_sum', { queue: 'metrics' })).toBeGreaterThan(0);
      expect(moved('leasehold_reports_total', { kind: 'completed', outcome: 'ok' })).toBe(1);
      expect(moved('leasehold_reports_total', { kind: 'failed', outcome: 'ok' })).toBe(1);
      expect(moved('leasehold_job_outcomes_total', { queue: 'metrics', outcome: 'succeeded' })).toBe(1);
      expect(moved('leasehold_job_outcomes_total', { queue: 'metrics-script', outcome: 'failed' })).toBe(1);
      expect(moved('leasehold_lease_expiries_total', { reason: 'lease_expired' })).toBe(1);
      expect(moved('leasehold_lease_revocations_total', { reason: 'lease_expired' })).toBe(1);
      expect(moved('leasehold_reaper_runs_total', { result: 'ok' })).toBeGreaterThan(0);
      expect(moved('leasehold_agent_sessions_total', { event: 'opened' })).toBe(1);
      // Jobs by state and queue, from the database: the succeeded one, and the expired one back in line.
      expect(after.get('leasehold_jobs', { queue: 'metrics', status: 'succeeded' })).toBe(1);
      expect(after.get('leasehold_jobs', { queue: 'metrics', status: 'queued' })).toBe(1);
      expect(after.get('leasehold_jobs', { queue: 'metrics-script', status: 'failed' })).toBe(1);
      expect(after.get('leasehold_queue_due_jobs', { queue: 'metrics' })).toBe(1);
      expect(after.get('leasehold_queue_oldest_age_seconds', { queue: 'metrics' })).toBeGreaterThanOrEqual(0);
    } finally {
      await receiver.close();
    }
  });
});
