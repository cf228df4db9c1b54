/**
 * `seed-history`: seeded finished jobs against jobs driven through the real transitions in the
 * same database. The mix matches what was asked for; every seeded job reads back through jobGet
 * with the history a real job of its outcome has (its row's columns, its attempts, its events,
 * its notification); the operator reads (jobList, jobSearch, statsGet) agree with what jobGet
 * shows; idempotency keys are unique and a repeated enqueue finds the seeded job; the
 * invariants hold. The command itself: one run as pasted, and bad input refused in one line.
 */
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import pg from 'pg';
import { beforeAll, describe, expect, it } from 'vitest';
import type { Outcome } from '../server/domain/outcomes.js';
import { DEFAULT_SEED, SEED_LABELS, seedAgentIds, seedHistory, type SeedResult } from '../server/seed-history.js';
import {
  attemptComplete,
  attemptFail,
  attemptStart,
  jobCancel,
  jobClaim,
  jobEnqueue,
  jobGet,
  jobList,
  jobRescueExpired,
  jobSearch,
  statsGet,
  stepRecord,
  stepReserve,
  type JobDetail,
} from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { checkInvariants } from './helpers/invariants.js';
import { root } from './helpers/serve.js';

const exec = promisify(execFile);
const t = useTestDb();
const cli = useTestDb();

const N = 5000;
const DAYS = 0.5;
const TTL = 30_000;

function value<T>(o: Outcome<T>): T {
  if (o.outcome !== 'ok' && o.outcome !== 'duplicate') throw new Error(`expected a value, got ${JSON.stringify(o)}`);
  return o.value;
}

// ───────────── real jobs, through the real transitions, on a clock two hours ago ─────────────

let clock = Date.now() - 2 * 3_600_000;
const tick = (ms = 7) => new Date((clock += ms));

async function enqueue(extra: Partial<Parameters<typeof jobEnqueue>[1]> = {}) {
  return value(await jobEnqueue(t.pool, { queue: 'lifecycle', payload: { n: 1 }, now: tick(), ...extra })).id;
}
async function claimStart(agentId = 'real-agent') {
  const [c] = value(await jobClaim(t.pool, { agentId, queues: ['lifecycle'], limit: 1, claimTtlMs: TTL, labels: SEED_LABELS, now: tick() }));
  if (!c) throw new Error('nothing to claim');
  value(await attemptStart(t.pool, { attemptId: c.attemptId, agentId, leaseTtlMs: TTL, now: tick() }));
  return c.attemptId;
}
const complete = async (attemptId: string) => value(await attemptComplete(t.pool, { attemptId, agentId: 'real-agent', result: { ok: true, ms: 12 }, now: tick() }));
const fail = async (attemptId: string, retryable: boolean) =>
  value(await attemptFail(t.pool, { attemptId, agentId: 'real-agent', error: { message: 'boom', code: 'E_X' }, retryable, backoff: { baseMs: 1, maxMs: 1 }, now: tick() }));
const loseLease = async () => value(await jobRescueExpired(t.pool, { limit: 10, now: tick(TTL + 1000) }));

/** One job of each kind the seeder writes, made by the store's verbs. */
async function realJobs(): Promise<Record<string, string>> {
  const ids: Record<string, string> = {};
  ids.succeeded = await enqueue({ idempotencyKey: 'real-1', labels: SEED_LABELS });
  await complete(await claimStart());

  ids['retried/failed'] = await enqueue();
  await fail(await claimStart(), true);
  tick(10);
  await complete(await claimStart());

  ids['retried/lease_expired'] = await enqueue();
  await claimStart();
  await loseLease();
  await complete(await claimStart());

  ids.failed = await enqueue();
  await fail(await claimStart(), false);

  ids['dead/failed'] = await enqueue();
  for (let i = 0; i < 5; i++) {
    await fail(await claimStart(), true);
    tick(10);
  }

  ids['dead/lease_expired'] = await enqueue();
  for (let i = 0; i < 5; i++) {
    await claimStart();
    await loseLease();
  }

  ids['canceled/queued'] = await enqueue();
  value(await jobCancel(t.pool, { jobId: ids['canceled/queued'], now: tick() }));

  ids['canceled/running'] = await enqueue();
  await claimStart();
  value(await jobCancel(t.pool, { jobId: ids['canceled/running'], now: tick() }));

  ids.notified = await enqueue({ notifyUrl: 'https://n8n.example.com/webhook-waiting/real' });
  await complete(await claimStart());

  ids.stepped = await enqueue();
  const a = await claimStart();
  value(await stepReserve(t.pool, { attemptId: a, agentId: 'real-agent', step: 'fetch', now: tick() }));
  value(await stepRecord(t.pool, { attemptId: a, agentId: 'real-agent', step: 'fetch', output: { ok: true }, now: tick() }));
  await complete(a);
  return ids;
}

// ───────────────────────────── shapes ─────────────────────────────

const kind = (v: unknown) => (v === null || v === undefined ? 'null' : v instanceof Date ? 'date' : Array.isArray(v) ? 'array' : typeof v);
const keysOf = (v: unknown) => (v && typeof v === 'object' ? Object.keys(v).sort().join(',') : kind(v));

/** Which of the real kinds a job is. */
function classOf(d: JobDetail): string {
  const j = d.job;
  const first = d.attempts[0];
  if (j.status === 'succeeded') return j.attemptNo === 1 ? 'succeeded' : `retried/${first!.status}`;
  if (j.status === 'dead') return `dead/${d.attempts.at(-1)!.status}`;
  if (j.status === 'canceled') return j.attemptNo === 0 ? 'canceled/queued' : 'canceled/running';
  return j.status;
}

/**
 * What a job's history looks like, without its values: the kind of value in each column of its
 * row (bar the optional ones a job is enqueued with or not), its attempts with runs of alike ones
 * folded into one, and the kinds of its events.
 */
function shape(d: JobDetail) {
  const { idempotencyKey: _k, notifyUrl: _u, ...row } = d.job;
  const attempts = d.attempts.map((a) =>
    JSON.stringify({
      status: a.status,
      jobStatus: a.jobStatus,
      agent: kind(a.agentId),
      started: kind(a.startedAt),
      error: keysOf(a.error),
      retryable: a.retryable,
      runAt: kind(a.runAt),
      deadline: kind(a.claimDeadline),
    }),
  );
  const kinds = d.events.map((e) => e.kind);
  return {
    row: Object.fromEntries(Object.entries(row).map(([k, v]) => [k, kind(v)])),
    status: d.job.status,
    error: keysOf(d.job.error),
    result: keysOf(d.job.result),
    capReached: d.job.attemptsStarted === d.job.maxAttempts,
    attempts: attempts.filter((a, i) => a !== attempts[i - 1]),
    events: { first: kinds[0], last: kinds.at(-1), all: [...new Set(kinds)].sort() },
    steps: d.steps.map((s) => `${s.status} ${kind(s.output)} ${kind(s.finishedAt)} ${s.reservations} ${kind(s.previousAttemptId)}`),
  };
}

/** The times of a job's history in order: enqueue, then each attempt's claim, start and end, then the end. */
function timesInOrder(d: JobDetail): boolean {
  const times = [d.job.createdAt.getTime()];
  for (const a of d.attempts) times.push(a.claimedAt.getTime(), a.startedAt!.getTime(), a.endedAt!.getTime());
  times.push(d.job.finishedAt!.getTime());
  return times.every((x, i) => i === 0 || x >= times[i - 1]!) && d.attempts.every((a) => a.endedAt!.getTime() <= d.job.finishedAt!.getTime());
}

// ───────────────────────────── the seeded database ─────────────────────────────

let seeded: SeedResult;
let real: Record<string, string>;
const details = new Map<string, JobDetail>();
const realDetails = new Map<string, JobDetail>();

beforeAll(async () => {
  real = await realJobs();
  for (const [k, id] of Object.entries(real)) realDetails.set(k, value(await jobGet(t.pool, { jobId: id })));
  seeded = await seedHistory(t.pool, { ...DEFAULT_SEED, jobs: N, days: DAYS, chunk: 1500 });
  // Every seeded job, through the read operators use for one job.
  const ids = (await t.pool.query<{ id: string }>(`SELECT id FROM jobs WHERE queue <> 'lifecycle'`)).rows.map((r) => r.id);
  for (let i = 0; i < ids.length; i += 10) {
    const batch = await Promise.all(ids.slice(i, i + 10).map(async (id) => [id, value(await jobGet(t.pool, { jobId: id }))] as const));
    for (const [id, d] of batch) details.set(id, d);
  }
}, 120_000);

/** Within 5 standard deviations of a binomial draw of `n` with probability `p` (and one job). */
function near(count: number, n: number, p: number) {
  const sd = Math.sqrt(n * p * (1 - p));
  expect(Math.abs(count - n * p), `${count} of ${n} where ${(n * p).toFixed(0)} ± ${(5 * sd).toFixed(0)} were expected`).toBeLessThanOrEqual(5 * sd + 1);
}

describe('seeded history', () => {
  it('writes the jobs asked for, with the mix of queues and outcomes asked for, over the window asked for', () => {
    expect(seeded.rows.jobs).toBe(N);
    expect(details.size).toBe(N);
    const all = [...details.values()];
    const outcomes = DEFAULT_SEED.outcomes;
    const sum = Object.values(outcomes).reduce((a, b) => a + b, 0);
    const byClass = (f: (c: string) => boolean) => all.filter((d) => f(classOf(d))).length;
    near(byClass((c) => c === 'succeeded'), N, outcomes.succeeded / sum);
    near(byClass((c) => c.startsWith('retried/')), N, outcomes.retried / sum);
    // Retried once or twice, alike; by a reported failure or a lost lease, as asked.
    const retried = all.filter((d) => classOf(d).startsWith('retried/'));
    near(retried.filter((d) => d.attempts.length === 3).length, retried.length, 0.5);
    const retriedOrDead = all.filter((d) => /^(retried|dead)\//.test(classOf(d)));
    near(retriedOrDead.filter((d) => d.attempts[0]!.status === 'lease_expired').length, retriedOrDead.length, DEFAULT_SEED.leaseLostShare);
    const canceled = all.filter((d) => d.job.status === 'canceled');
    near(canceled.filter((d) => d.job.attemptNo === 0).length, canceled.length, DEFAULT_SEED.canceledQueuedShare);
    near(byClass((c) => c === 'failed'), N, outcomes.failed / sum);
    near(byClass((c) => c.startsWith('dead/')), N, outcomes.dead / sum);
    near(byClass((c) => c.startsWith('canceled/')), N, outcomes.canceled / sum);
    // Every kind the seeder writes turns up.
    expect(new Set(all.map(classOf))).toEqual(new Set(Object.keys(real).filter((k) => k !== 'notified' && k !== 'stepped')));
    const qsum = DEFAULT_SEED.queues.reduce((a, q) => a + q.weight, 0);
    for (const q of DEFAULT_SEED.queues) near(all.filter((d) => d.job.queue === q.name).length, N, q.weight / qsum);
    expect(new Set(all.map((d) => d.job.queue))).toEqual(new Set(DEFAULT_SEED.queues.map((q) => q.name)));

    near(all.filter((d) => d.job.idempotencyKey !== null).length, N, DEFAULT_SEED.keyShare);
    near(all.filter((d) => Object.keys(d.job.labels as object).length > 0).length, N, DEFAULT_SEED.labelShare);
    near(all.filter((d) => d.job.notifyUrl !== null).length, N, DEFAULT_SEED.notifyShare);
    near(all.filter((d) => d.steps.length > 0).length, N, DEFAULT_SEED.stepShare * (1 - (outcomes.canceled / sum) * DEFAULT_SEED.canceledQueuedShare));

    // Finished uniformly over the last DAYS days: each quarter of the window holds a quarter.
    const end = seeded.end.getTime();
    const span = DAYS * 86_400_000;
    for (const d of all) {
      expect(d.job.finishedAt!.getTime()).toBeLessThanOrEqual(end);
      expect(d.job.finishedAt!.getTime()).toBeGreaterThanOrEqual(end - span);
    }
    for (let q = 0; q < 4; q++) {
      near(all.filter((d) => Math.floor(((d.job.finishedAt!.getTime() - (end - span)) / span) * 4) === q).length, N, 0.25);
    }
  });

  it('reads back through jobGet with the history a real job of its outcome has', () => {
    const agents = new Set(seedAgentIds(DEFAULT_SEED.agents));
    const labeled = new Set(seedAgentIds(DEFAULT_SEED.agents).slice(0, DEFAULT_SEED.agents / 4));
    for (const [id, d] of details) {
      const c = classOf(d);
      const realOne = realDetails.get(c);
      expect(realOne, `job ${id} is ${c}, which no real job is`).toBeDefined();
      const s = shape(d);
      // Steps and notifications are compared below, on their own.
      expect({ ...s, steps: [] }, `job ${id} (${c})`).toEqual({ ...shape(realOne!), steps: [] });
      expect(timesInOrder(d), `job ${id}: times out of order`).toBe(true);
      for (const a of d.attempts) {
        expect(agents.has(a.agentId)).toBe(true);
        if (Object.keys(d.job.labels as object).length) expect(labeled.has(a.agentId), `job ${id} requires labels its agent lacks`).toBe(true);
        expect(a.claimDeadline.getTime() - a.claimedAt.getTime()).toBe(TTL);
      }
      if (d.job.status === 'dead') expect(d.attempts).toHaveLength(DEFAULT_SEED.maxAttempts);
      if (c.startsWith('retried/')) expect([2, 3]).toContain(d.attempts.length);
      if (d.steps.length) expect(shape(d).steps[0]).toBe(shape(realDetails.get('stepped')!).steps[0]);
    }
    // A retry's due time is its backoff after the failure, and the next claim comes after it.
    for (const d of details.values()) {
      d.attempts.forEach((a, i) => {
        if (!a.runAt) return;
        const delay = a.runAt.getTime() - a.endedAt!.getTime();
        expect(delay).toBeGreaterThanOrEqual(500 * 2 ** i - 1);
        expect(delay).toBeLessThanOrEqual(1000 * 2 ** i + 1);
        expect(d.attempts[i + 1]!.claimedAt.getTime()).toBeGreaterThanOrEqual(a.runAt.getTime());
      });
    }
  });

  it('writes the notifications the real transitions write: a job.dead for every dead letter, an event and a delivery per notify_url', async () => {
    const events = await t.pool.query<{ job_id: string; type: string; body: string; alerted_at: Date | null; created_at: Date; delivery: string | null }>(
      `SELECT e.job_id, e.type::text, e.body, e.alerted_at, e.created_at, d.status::text AS delivery
       FROM webhook_events e LEFT JOIN webhook_deliveries d ON d.event_id = e.id`,
    );
    const byJob = new Map(events.rows.map((e) => [e.job_id, e]));
    const realEvent = (k: string) => JSON.parse(byJob.get(real[k]!)!.body) as Record<string, unknown>;
    const bodyShape = (b: Record<string, unknown>) => ({
      top: keysOf(b),
      job: keysOf(b.job),
      attempt: keysOf(b.attempt),
      error: keysOf(b.error),
      result: keysOf(b.result),
    });
    for (const d of details.values()) {
      const e = byJob.get(d.job.id);
      const expected = d.job.notifyUrl !== null || d.job.status === 'dead';
      expect(Boolean(e), `job ${d.job.id} (${d.job.status}, notify_url ${d.job.notifyUrl})`).toBe(expected);
      if (!e) continue;
      expect(e.type).toBe(`job.${d.job.status}`);
      expect(e.created_at).toEqual(d.job.finishedAt);
      expect(e.alerted_at !== null).toBe(d.job.status === 'dead');
      expect(e.delivery).toBe(d.job.notifyUrl ? 'delivered' : null);
      const body = JSON.parse(e.body) as { job: { id: string; status: string; finishedAt: string }; attempt: { id: string } | null };
      expect(body.job).toMatchObject({ id: d.job.id, status: `JOB_STATUS_${d.job.status.toUpperCase()}` });
      expect(body.attempt?.id ?? null).toBe(d.attempts.at(-1)?.id ?? null);
      const like = { dead: 'dead/failed', succeeded: 'notified' }[d.job.status as string];
      if (like && (d.job.status !== 'dead' || d.attempts.at(-1)!.status === 'failed')) expect(bodyShape(JSON.parse(e.body))).toEqual(bodyShape(realEvent(like)));
    }
    expect(bodyShape(realEvent('dead/lease_expired'))).toEqual(
      bodyShape(JSON.parse([...byJob.values()].find((e) => e.type === 'job.dead' && details.get(e.job_id)?.attempts.at(-1)?.status === 'lease_expired')!.body)),
    );
  });

  it('answers jobList, jobSearch and statsGet as jobGet says', async () => {
    const all = [...details.values()];
    // By queue and status, every page.
    const want = all.filter((d) => d.job.queue === 'default' && d.job.status === 'dead').map((d) => d.job.id);
    const got: string[] = [];
    let token = '';
    do {
      const page = value(await jobList(t.pool, { queue: 'default', status: 'dead', pageSize: 9, ...(token ? { pageToken: token } : {}) }));
      got.push(...page.jobs.map((j) => j.id));
      token = page.nextPageToken;
    } while (token);
    expect(got.sort()).toEqual(want.sort());
    expect(want.length).toBeGreaterThan(0);

    // By agent (any attempt) and a time range.
    const agent = 'seed-agent-03';
    const from = new Date(seeded.end.getTime() - 3 * 3_600_000);
    const to = new Date(seeded.end.getTime() - 3_600_000);
    const wantAgent = all
      .filter((d) => d.attempts.some((a) => a.agentId === agent) && d.job.createdAt >= from && d.job.createdAt < to)
      .map((d) => d.job.id);
    const gotAgent: string[] = [];
    token = '';
    do {
      const page = value(await jobSearch(t.pool, { agentId: agent, createdAfter: from, createdBefore: to, pageSize: 20, ...(token ? { pageToken: token } : {}) }));
      gotAgent.push(...page.jobs.map((j) => j.id));
      token = page.nextPageToken;
    } while (token);
    expect(gotAgent.sort()).toEqual(wantAgent.sort());
    expect(wantAgent.length).toBeGreaterThan(0);

    // Depths per queue and status, and what ended in the last hour.
    const stats = value(await statsGet(t.pool, { windowMinutes: 60 }));
    const depth = new Map(stats.depths.map((x) => [`${x.queue} ${x.status}`, Number(x.count)]));
    for (const q of DEFAULT_SEED.queues) {
      for (const s of ['succeeded', 'failed', 'dead', 'canceled'] as const) {
        expect(depth.get(`${q.name} ${s}`) ?? 0, `${q.name} ${s}`).toBe(all.filter((d) => d.job.queue === q.name && d.job.status === s).length);
      }
    }
    expect(stats.waiting.filter((w) => w.queue !== 'lifecycle')).toEqual([]);
    // The window: the current minute and the 59 before it.
    const since = Math.floor(stats.now.getTime() / 60_000) * 60_000 - 59 * 60_000;
    expect(stats.minutes[0]!.minute.getTime()).toBe(since);
    expect(stats.spanMinutes).toBeCloseTo((stats.now.getTime() - since) / 60_000, 4);
    const ended = all.flatMap((d) => d.attempts).filter((a) => a.endedAt!.getTime() >= since);
    expect(stats.window.succeeded).toBe(ended.filter((a) => a.status === 'succeeded').length);
    expect(stats.window.dead).toBe(ended.filter((a) => a.jobStatus === 'dead').length);
    expect(stats.window.retried).toBe(ended.filter((a) => a.status === 'failed' && a.jobStatus === 'queued').length);
    expect(stats.window.succeeded).toBeGreaterThan(100);
    expect(stats.minutes.reduce((s, m) => s + m.succeeded, 0)).toBe(stats.window.succeeded);
  });

  it('gives unique idempotency keys, and a repeated enqueue finds the seeded job', async () => {
    const keyed = [...details.values()].filter((d) => d.job.idempotencyKey !== null);
    expect(new Set(keyed.map((d) => d.job.idempotencyKey)).size).toBe(keyed.length);
    for (const d of [keyed.find((x) => x.job.status === 'succeeded')!, keyed.find((x) => x.job.status !== 'succeeded')!]) {
      const again = await jobEnqueue(t.pool, { queue: d.job.queue, payload: d.job.payload, idempotencyKey: d.job.idempotencyKey! });
      expect(again.outcome).toBe('duplicate');
      expect(value(again)).toMatchObject({ id: d.job.id, status: d.job.status, attemptNo: d.job.attemptNo, finishedAt: d.job.finishedAt });
      expect(await jobEnqueue(t.pool, { queue: d.job.queue, payload: { other: true }, idempotencyKey: d.job.idempotencyKey! })).toMatchObject({
        outcome: 'conflict',
      });
    }
  });

  it('keeps the invariants, and registers its agents', async () => {
    await checkInvariants(t.pool);
    const { rows } = await t.pool.query<{ id: string }>(`SELECT id FROM agents ORDER BY id`);
    expect(rows.map((r) => r.id)).toEqual(seedAgentIds(DEFAULT_SEED.agents));
  });

  it('fails the invariants when a seeded history is broken (the checker sees seeded rows)', async () => {
    const c = await t.pool.connect();
    try {
      await c.query('BEGIN');
      await c.query(`UPDATE jobs SET attempts_started = attempts_started - 1 WHERE id = (SELECT id FROM jobs WHERE status = 'dead' AND queue <> 'lifecycle' LIMIT 1)`);
      await expect(checkInvariants(c)).rejects.toThrow(/started attempt/);
    } finally {
      await c.query('ROLLBACK');
      c.release();
    }
  });
});

// ───────────────────────────── the command ─────────────────────────────

interface Run {
  code: number;
  stdout: string;
  stderr: string;
}

async function seedCommand(args: string[], env: Record<string, string> = {}): Promise<Run> {
  try {
    const { stdout, stderr } = await exec(process.execPath, ['--import', 'tsx', 'server/cli.ts', 'seed-history', ...args], {
      cwd: root,
      env: { ...process.env, DATABASE_URL: cli.url, LEASEHOLD_DATA_DIR: '/nonexistent/leasehold-seed-test', LEASEHOLD_LOG_LEVEL: 'warn', ...env },
    });
    return { code: 0, stdout, stderr };
  } catch (e) {
    const err = e as { code: number; stdout: string; stderr: string };
    return { code: err.code, stdout: err.stdout, stderr: err.stderr };
  }
}

describe('npm run seed:history', () => {
  it('seeds the database it is given, printing progress and the time, and VACUUMs and ANALYZEs what it filled', async () => {
    const other = new URL(cli.url);
    const r = await seedCommand(
      ['--jobs', '1,200', '--chunk', '500', '--days', '1', '--database-url', cli.url, '--queues', 'solo=1', '--outcomes', 'dead=1', '--max-attempts', '3'],
      { DATABASE_URL: `postgres://nobody:nothing@127.0.0.1:1/${other.pathname.slice(1)}` },
    );
    expect(r.code, r.stderr).toBe(0);
    expect(r.stdout).toMatch(/^seeding 1,200 finished jobs over 1 day\(s\) into postgres:\/\/[^\n]*; 500 per transaction$/m);
    expect(r.stdout).toMatch(/^ {2}500 \/ 1,200 jobs \(42 %\), 1,500 attempts, [\d.]+ s, [\d,]+ jobs\/s$/m);
    expect(r.stdout).toMatch(/^ {2}1,200 \/ 1,200 jobs \(100 %\)/m);
    expect(r.stdout).toMatch(/^done in [\d.]+ s \(inserts [\d.]+ s: [\d,]+ jobs\/s; VACUUM \(ANALYZE\) [\d.]+ s\): 1,200 jobs, 3,600 attempts, .* 1,200 webhook_events/m);
    const pool = new pg.Pool({ connectionString: cli.url, max: 1 });
    try {
      const { rows } = await pool.query(`SELECT queue, status::text, attempt_no, attempts_started, count(*)::int AS n FROM jobs GROUP BY 1, 2, 3, 4`);
      expect(rows).toEqual([{ queue: 'solo', status: 'dead', attempt_no: 3, attempts_started: 3, n: 1200 }]);
      const analyzed = await pool.query(`SELECT relname FROM pg_stat_user_tables WHERE last_analyze IS NOT NULL AND last_vacuum IS NOT NULL ORDER BY relname`);
      expect(analyzed.rows.map((x) => x.relname)).toEqual(expect.arrayContaining(['agents', 'attempts', 'job_events', 'job_keys', 'jobs_live', 'steps', 'webhook_deliveries', 'webhook_events']));
      await checkInvariants(pool);
    } finally {
      await pool.end();
    }
  });

  it('refuses bad input in one line with exit code 2, before touching a database', async () => {
    const cases: Array<[string[], RegExp]> = [
      [['--jobs', '0'], /^error: --jobs must be a whole number from 1 to 1,000,000,000, not "0"$/],
      [['--jobs', 'abc'], /^error: --jobs must be a whole number from 1 to 1,000,000,000, not "abc"$/],
      [['--jobs', '-5'], /^error: --jobs must be a whole number/],
      [['--jobs', '2.5'], /^error: --jobs must be a whole number/],
      [[], /^error: --jobs <n> is required/],
      [['--jobs', '10', '--days', '0'], /^error: --days must be a number from 0.001 to 3650, not "0"$/],
      [['--jobs', '10', '--chunk', 'many'], /^error: --chunk must be a whole number/],
      [['--jobs', '10', '--queues', 'a=x'], /^error: --queues: "a=x" is not name=weight/],
      [['--jobs', '10', '--outcomes', 'won=1'], /^error: --outcomes: "won" is not one of succeeded, retried, failed, dead, canceled$/],
      [['--jobs', '10', '--outcomes', 'dead=0'], /^error: --outcomes must give at least one positive weight/],
      [['--jobs', '10', '--key-share', '1.5'], /^error: --key-share must be a fraction from 0 to 1, not "1.5"$/],
      [['--jobs', '10', '--database-url', 'mysql://x'], /^error: --database-url must start with postgres:\/\//],
    ];
    const runs = await Promise.all(cases.map(([args]) => seedCommand(args, { DATABASE_URL: 'postgres://nobody:nothing@127.0.0.1:1/none' })));
    runs.forEach((r, i) => {
      const [args, message] = cases[i]!;
      expect(r.code, `${args.join(' ')}: ${r.stderr}`).toBe(2);
      expect(r.stderr.trimEnd(), args.join(' ')).toMatch(message);
      expect(r.stderr.trimEnd().split('\n'), args.join(' ')).toHaveLength(1);
      expect(r.stdout).toBe('');
    });
  });
});
