/**
 * Times and durations at their limits, and the coordinator's clock against PostgreSQL's:
 * - the purger reckons the cutoff of the days it drops by the earlier of PostgreSQL's clock and the
 *   coordinator's (whichever was ahead dropped days of history still retained, freeing their
 *   idempotency keys);
 * - a job's runAt is refused outside 0001-01-01 to 9999-12-31 (stored, it broke every answer that
 *   carried the job) and is written to PostgreSQL in UTC whatever the process's time zone;
 * - a runAt naming a date or time that does not exist is refused, not rolled over to another day;
 * - TTLs above what claims and starts take, and durations no timer can wait, stop the start;
 * - an enqueue wakes the dispatchers when its job is due by PostgreSQL's clock, not the process's.
 */
import { Writable } from 'node:stream';
import { create, toBinary } from '@bufbuild/protobuf';
import { timestampFromDate } from '@bufbuild/protobuf/wkt';
import { ConnectError } from '@connectrpc/connect';
import pino from 'pino';
import { afterAll, afterEach, beforeAll, describe, expect, it, vi } from 'vitest';
import { EnqueueJobRequestSchema } from '../gen/leasehold/v1/job_service_pb.js';
import { ConfigError, loadConfig, MAX_SCHEDULE_INTERVAL_MS } from '../server/config.js';
import { AgentHub } from '../server/core/agent-hub.js';
import { Purger } from '../server/core/purger.js';
import { daysEnsure } from '../server/store/days.js';
import { MAX_TIMER_MS } from '../server/domain/validation.js';
import { attemptComplete, jobEnqueue, keyCreate } from '../server/store/index.js';
import { readEnqueueRequest } from '../server/transport/enqueue-request.js';
import { listenHttp, type HttpServer } from '../server/transport/http.js';
import { enqueueJobCall } from '../server/transport/job-routes.js';
import { useTestDb } from './helpers/db.js';
import { makeJob } from './helpers/factories.js';

const t = useTestDb();
const log = pino({ level: 'silent' });
const DAY = 86_400_000;
const ENQUEUE = '/leasehold.v1.JobService/EnqueueJob';

afterEach(() => {
  vi.useRealTimers();
});

/** Runs `fn` with `Date` (only) telling a time `skewMs` away from the real one, as a coordinator whose clock is off. */
async function withClockSkew<T>(skewMs: number, fn: () => Promise<T>): Promise<T> {
  vi.useFakeTimers({ now: Date.now() + skewMs, toFake: ['Date'] });
  try {
    return await fn();
  } finally {
    vi.useRealTimers();
  }
}

const jobsIn = async (queue: string) => (await t.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM jobs WHERE queue = $1`, [queue])).rows[0]!.n;

describe('the purger reckons its cutoff by the earlier of PostgreSQL’s clock and its own', () => {
  it('a coordinator whose clock is 3 days ahead keeps a job that finished just now, with a retention of 2 days', async () => {
    const j = await makeJob(t.pool, { status: 'running', queue: 'purge-skew' });
    const done = await attemptComplete(t.pool, { jobId: j.id, attemptId: j.currentAttemptId!, agentId: j.agentId!, result: { ok: 1 } });
    expect(done.outcome).toBe('ok');
    const key = await jobEnqueue(t.pool, { queue: 'purge-skew', payload: {}, idempotencyKey: 'skew-key' });
    expect(key.outcome).toBe('ok');

    const purger = new Purger(t.pool, log, { retentionMs: 2 * DAY });
    const run = await withClockSkew(3 * DAY, () => purger.runOnce());
    expect(run).toMatchObject({ days: [], purged: 0 });
    expect(await jobsIn('purge-skew')).toBe(2);
    // The key still holds its job: a retry of the same enqueue is a duplicate, not a second run.
    expect((await jobEnqueue(t.pool, { queue: 'purge-skew', payload: {}, idempotencyKey: 'skew-key' })).outcome).toBe('duplicate');
  });

  it('a database whose clock is 3 days ahead of the coordinator\'s drops nothing early either, and the gap is logged', async () => {
    // A job that finished three days ago by PostgreSQL's clock, which is yesterday by a coordinator
    // whose clock is three days behind it (as after PostgreSQL's clock was stepped forward).
    const j = await makeJob(t.pool, { status: 'running', queue: 'purge-db-ahead' });
    expect((await attemptComplete(t.pool, { jobId: j.id, attemptId: j.currentAttemptId!, agentId: j.agentId!, result: {} })).outcome).toBe('ok');
    const dbNow = (await t.pool.query<{ now: Date }>('SELECT now()')).rows[0]!.now;
    const threeDaysAgo = new Date(dbNow.getTime() - 3 * DAY).toISOString().slice(0, 10);
    await daysEnsure(t.pool, [threeDaysAgo]);
    await t.pool.query(`UPDATE jobs SET done_day = done_day - 3, finished_at = finished_at - interval '3 days' WHERE id = $1`, [j.id]);
    await t.pool.query(`UPDATE attempts SET ended_at = ended_at - interval '3 days' WHERE job_id = $1`, [j.id]);

    const lines: Array<Record<string, unknown>> = [];
    const sink = new Writable({
      write(chunk: Buffer, _enc, done) {
        lines.push(JSON.parse(chunk.toString()) as Record<string, unknown>);
        done();
      },
    });
    const purger = new Purger(t.pool, pino({ level: 'warn' }, sink), { retentionMs: 2 * DAY });
    const run = await withClockSkew(-3 * DAY, () => purger.runOnce());
    expect(run.days).not.toContain(threeDaysAgo);
    expect(await jobsIn('purge-db-ahead')).toBe(1);
    expect(lines.find((l) => String(l.msg).startsWith("PostgreSQL's clock and this coordinator's differ"))).toMatchObject({ level: 40 });
    // With the clocks agreeing, the day is past the retention and goes.
    expect((await purger.runOnce()).days).toContain(threeDaysAgo);
    expect(await jobsIn('purge-db-ahead')).toBe(0);
  });

  it('an explicit `now` still pins the cutoff (the test override): 3 days on, today is dropped', async () => {
    const j = await makeJob(t.pool, { status: 'running', queue: 'purge-pinned' });
    expect((await attemptComplete(t.pool, { jobId: j.id, attemptId: j.currentAttemptId!, agentId: j.agentId!, result: {} })).outcome).toBe('ok');
    const dbNow = (await t.pool.query<{ now: Date }>('SELECT now()')).rows[0]!.now;
    const run = await new Purger(t.pool, log, { retentionMs: 2 * DAY }).runOnce(new Date(dbNow.getTime() + 3 * DAY));
    expect(run.days).toEqual([dbNow.toISOString().slice(0, 10)]);
    expect(await jobsIn('purge-pinned')).toBe(0);
  });
});

describe('runAt: from 0001 to 9999, written in UTC', () => {
  it('refuses a runAt before 0001-01-01T00:00:00Z or after 9999-12-31T23:59:59.999Z, naming runAt; takes both ends', async () => {
    for (const runAt of [new Date('+010000-01-01T00:00:00Z'), new Date('9999-12-31T23:59:59.999Z').getTime() + 1, new Date('0000-12-31T23:59:59.999Z'), new Date(-8.64e15)]) {
      const o = await jobEnqueue(t.pool, { queue: 'range', payload: {}, runAt: new Date(runAt) });
      expect(o, String(runAt)).toMatchObject({ outcome: 'invalid', field: 'runAt' });
    }
    expect(await jobsIn('range')).toBe(0);
    for (const at of ['0001-01-01T00:00:00.000Z', '9999-12-31T23:59:59.999Z']) {
      const o = await jobEnqueue(t.pool, { queue: 'range', payload: {}, runAt: new Date(at) });
      expect(o.outcome).toBe('ok');
      const row = (await t.pool.query<{ exact: boolean }>(`SELECT run_at = $2::text::timestamptz AS exact FROM jobs WHERE id = $1`, [o.outcome === 'ok' && o.value.id, at])).rows[0]!;
      expect(row.exact, at).toBe(true);
    }
  });

  it('writes a runAt in UTC when the process’s time zone had a local mean time then (not 30 s off in Europe/Amsterdam in 1800)', async () => {
    const tz = process.env.TZ;
    process.env.TZ = 'Europe/Amsterdam';
    try {
      const at = '1800-01-01T00:00:00.000Z';
      expect(new Date(at).getSeconds()).not.toBe(0); // the zone's offset then was +00:17:30
      const o = await jobEnqueue(t.pool, { queue: 'lmt', payload: {}, runAt: new Date(at) });
      if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
      const row = (await t.pool.query<{ utc: string }>(`SELECT to_char(run_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS utc FROM jobs WHERE id = $1`, [o.value.id])).rows[0]!;
      expect(row.utc).toBe(at);
    } finally {
      if (tz === undefined) delete process.env.TZ;
      else process.env.TZ = tz;
    }
  });
});

describe('over HTTP', () => {
  let server: HttpServer;
  let key: string;
  beforeAll(async () => {
    const hub = new AgentHub(t.pool, log, { leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 });
    server = await listenHttp({ db: t.pool, hub, log, leaseTtlMs: 5000, claimTtlMs: 5000, heartbeatIntervalMs: 1000 }, '127.0.0.1:0');
    const made = await keyCreate(t.pool, { name: 'time-limits', scopes: ['enqueue', 'read'] });
    if (made.outcome !== 'ok') throw new Error(JSON.stringify(made));
    key = made.value.key;
  });
  afterAll(async () => {
    await server?.close();
  });
  const url = () => `http://127.0.0.1:${server.address.port}${ENQUEUE}`;
  const post = async (body: unknown, headers: Record<string, string> = {}) => {
    const res = await fetch(url(), {
      method: 'POST',
      headers: { 'content-type': 'application/json', authorization: `Bearer ${key}`, ...headers },
      body: JSON.stringify(body),
    });
    return { status: res.status, json: (await res.json()) as Record<string, any> };
  };

  it('a binary EnqueueJob with a runAt in the year 10000 is refused with 400 naming runAt, and nothing is stored', async () => {
    for (const at of [new Date('+010000-01-01T00:00:00Z'), new Date('-000001-01-01T00:00:00Z')]) {
      const body = toBinary(EnqueueJobRequestSchema, create(EnqueueJobRequestSchema, { queue: 'range-http', payload: {}, runAt: timestampFromDate(at) }));
      const res = await fetch(url(), { method: 'POST', headers: { 'content-type': 'application/proto', authorization: `Bearer ${key}` }, body });
      expect(res.status, at.toISOString()).toBe(400);
      expect(await res.json()).toMatchObject({ code: 'invalid_argument', outcome: 'invalid', field: 'runAt' });
    }
    expect(await jobsIn('range-http')).toBe(0);
  });

  it('refuses a runAt naming a day past its month’s end, hour 24, minute or second 60, naming runAt; nothing is stored', async () => {
    const impossible = [
      '2027-02-29T10:00:00Z', // 2027 is no leap year: was read as 2027-03-01
      '2026-02-31T10:00:00Z', // was 2026-03-03
      '2026-04-31T10:00:00Z',
      '2026-01-01T24:00:00Z', // was the next day
      '2026-01-01T10:60:00Z',
      '2026-01-01T10:00:60Z',
      '2026-01-01T10:00:60.5+01:00',
      '2026-00-10T10:00:00Z',
      '2026-01-00T10:00:00Z',
      '2100-02-29T00:00:00Z', // no leap year either (divisible by 100, not by 400)
    ];
    for (const runAt of impossible) {
      for (const body of [
        { queue: 'impossible', payload: {}, runAt },
        { queue: 'impossible', payload: {}, run_at: runAt },
        // Fields the direct path leaves to protobuf-es first: still refused.
        { labels: { os: 'linux' }, queue: 'impossible', payload: {}, runAt },
      ]) {
        // Through the direct path, and through Connect's (a `connect-timeout-ms` takes it there).
        for (const headers of [{}, { 'connect-timeout-ms': '10000' }] as Array<Record<string, string>>) {
          const a = await post(body, headers);
          expect({ status: a.status, json: a.json }, JSON.stringify([body, headers])).toMatchObject({
            status: 400,
            json: { code: 'invalid_argument', outcome: 'invalid', status: 400, field: 'runAt' },
          });
        }
      }
    }
    expect(await jobsIn('impossible')).toBe(0);
  });

  it('takes the dates that exist, as written: a leap day, the last second of a day, an offset', async () => {
    for (const [runAt, stored] of [
      ['2028-02-29T10:00:00Z', '2028-02-29T10:00:00.000Z'],
      ['2000-02-29T23:59:59.999Z', '2000-02-29T23:59:59.999Z'],
      ['2026-12-31T23:59:59+01:00', '2026-12-31T22:59:59.000Z'],
    ] as const) {
      const a = await post({ queue: 'possible', payload: {}, runAt });
      expect(a.status, runAt).toBe(200);
      expect(new Date(a.json.job.runAt).toISOString()).toBe(stored);
    }
  });
});

describe('readEnqueueRequest', () => {
  const read = (o: unknown) => readEnqueueRequest(new TextEncoder().encode(typeof o === 'string' ? o : JSON.stringify(o)));
  it('throws INVALID_ARGUMENT naming runAt for a time that does not exist, whatever else the body holds', () => {
    for (const body of [
      { queue: 'q', runAt: '2027-02-29T10:00:00Z' },
      { queue: 'q', labels: { a: 'b' }, run_at: '2026-01-01T24:00:00Z' },
      `\uFEFF${JSON.stringify({ queue: 'q', runAt: '2026-02-31T00:00:00Z' })}`,
    ]) {
      let err: unknown;
      try {
        read(body);
      } catch (e) {
        err = e;
      }
      expect(err, JSON.stringify(body)).toBeInstanceOf(ConnectError);
      expect((err as ConnectError).rawMessage).toMatch(/^cannot decode field leasehold\.v1\.EnqueueJobRequest\.runAt from JSON: .* is no time: /);
    }
    // A runAt that exists, or is not of the form at all, is left to protobuf-es as before.
    expect(read({ queue: 'q', runAt: '2028-02-29T10:00:00Z' })).toBeUndefined();
    expect(read({ queue: 'q', runAt: 'tomorrow' })).toBeUndefined();
    expect(read({ queue: 'q', payload: {} })).toMatchObject({ queue: 'q', payload: {} });
  });
});

describe('settings a timer or a claim cannot take stop the start', () => {
  it('refuses a lease or claim TTL above a day, naming the setting and the maximum; takes a day', () => {
    for (const name of ['LEASEHOLD_LEASE_TTL', 'LEASEHOLD_CLAIM_TTL'] as const) {
      expect(() => loadConfig({}, { [name]: '2d' })).toThrow(ConfigError);
      expect(() => loadConfig({}, { [name]: '86400001' })).toThrow(new RegExp(`^${name}=86400001 is above the maximum of 1d \\(86400000 ms\\)`));
    }
    expect(loadConfig({}, { LEASEHOLD_LEASE_TTL: '1d', LEASEHOLD_CLAIM_TTL: '24h' })).toMatchObject({ leaseTtlMs: DAY, claimTtlMs: DAY });
  });

  it('refuses a duration no timer can wait (2^31 − 1 ms), naming the setting and the maximum', () => {
    expect(() => loadConfig({}, { LEASEHOLD_AGENT_KEEPALIVE: '30d' })).toThrow(
      /^LEASEHOLD_AGENT_KEEPALIVE=30d is above the maximum of 2147483647 ms: the longest a timer can wait/,
    );
    expect(() => loadConfig({}, { LEASEHOLD_HELLO_TIMEOUT: '25d' })).toThrow(/^LEASEHOLD_HELLO_TIMEOUT=25d is above the maximum of 2147483647 ms/);
    expect(() => loadConfig({}, { LEASEHOLD_HEARTBEAT_INTERVAL: '30d', LEASEHOLD_LEASE_TTL: '1d' })).toThrow(ConfigError);
    expect(loadConfig({}, { LEASEHOLD_AGENT_KEEPALIVE: String(MAX_TIMER_MS), LEASEHOLD_HELLO_TIMEOUT: '24d' })).toMatchObject({
      agentKeepaliveMs: MAX_TIMER_MS,
      helloTimeoutMs: 24 * DAY,
    });
  });

  it('refuses a schedule’s interval whose jitter (+10 %) could take it past a timer’s maximum', () => {
    expect(MAX_SCHEDULE_INTERVAL_MS * 1.1).toBeLessThanOrEqual(MAX_TIMER_MS);
    for (const name of ['LEASEHOLD_PURGE_INTERVAL', 'LEASEHOLD_REAPER_INTERVAL', 'LEASEHOLD_WEBHOOK_INTERVAL'] as const) {
      expect(() => loadConfig({}, { [name]: '30d' })).toThrow(new RegExp(`^${name}=30d is above the maximum of ${MAX_SCHEDULE_INTERVAL_MS} ms: with the schedule's jitter`));
      expect(() => loadConfig({}, { [name]: String(MAX_SCHEDULE_INTERVAL_MS + 1) })).toThrow(ConfigError);
      expect(() => loadConfig({}, { [name]: String(MAX_SCHEDULE_INTERVAL_MS) })).not.toThrow();
    }
  });

  it('refuses a webhook timeout above the deliverer’s own bound of 10 minutes as a setting, not a stack trace', () => {
    expect(() => loadConfig({}, { LEASEHOLD_WEBHOOK_TIMEOUT: '11m' })).toThrow(/^LEASEHOLD_WEBHOOK_TIMEOUT=11m is above the maximum of 10m \(600000 ms\)/);
    expect(loadConfig({}, { LEASEHOLD_WEBHOOK_TIMEOUT: '10m' }).webhook.timeoutMs).toBe(600_000);
  });

  it('a purger refuses an interval that, with its jitter, no timer can wait; one at the longest does not run at once', async () => {
    expect(() => new Purger(t.pool, log, { intervalMs: 30 * DAY })).toThrow(/intervalMs/);
    expect(() => new Purger(t.pool, log, { intervalMs: MAX_TIMER_MS, jitter: 0 })).not.toThrow();
    expect(() => new Purger(t.pool, log, { intervalMs: MAX_TIMER_MS, jitter: 0.1 })).toThrow(/intervalMs/);
    const purger = new Purger(t.pool, log, { intervalMs: MAX_SCHEDULE_INTERVAL_MS });
    let runs = 0;
    purger.on('purger:run', () => runs++);
    purger.start();
    await new Promise((r) => setTimeout(r, 200));
    await purger.stop();
    expect(runs).toBe(0);
  });
});

describe('an enqueue wakes the dispatchers when its job is due by PostgreSQL’s clock', () => {
  const call = (woken: string[]) => enqueueJobCall({ db: t.pool, log, waker: { wake: (q: string) => woken.push(q) } as never });
  const request = (queue: string, runAt?: Date) =>
    create(EnqueueJobRequestSchema, { queue, payload: {}, ...(runAt ? { runAt: timestampFromDate(runAt) } : {}) });

  it('a job due now wakes them though the coordinator’s clock is 20 s behind', async () => {
    const woken: string[] = [];
    const r = await withClockSkew(-20_000, () => call(woken)(request('wake-behind')));
    expect(r.job.status).toBe('queued');
    expect(woken).toEqual(['wake-behind']);
  });

  it('a job due in 10 s does not, though the coordinator’s clock is a minute ahead', async () => {
    const dbNow = (await t.pool.query<{ now: Date }>('SELECT now()')).rows[0]!.now;
    const woken: string[] = [];
    await withClockSkew(60_000, () => call(woken)(request('wake-ahead', new Date(dbNow.getTime() + 10_000))));
    expect(woken).toEqual([]);
    // With the key's statement too.
    await withClockSkew(60_000, () =>
      call(woken)(create(EnqueueJobRequestSchema, { queue: 'wake-ahead', payload: {}, idempotencyKey: 'ahead-1', runAt: timestampFromDate(new Date(dbNow.getTime() + 10_000)) })),
    );
    expect(woken).toEqual([]);
    await withClockSkew(-20_000, () => call(woken)(create(EnqueueJobRequestSchema, { queue: 'wake-keyed', payload: {}, idempotencyKey: 'behind-1' })));
    expect(woken).toEqual(['wake-keyed']);
  });

  it('jobEnqueue says whether the job was due by the database’s clock (or the `now` given)', async () => {
    const dbNow = (await t.pool.query<{ now: Date }>('SELECT now()')).rows[0]!.now;
    expect(await jobEnqueue(t.pool, { queue: 'due', payload: {} })).toMatchObject({ outcome: 'ok', due: true });
    expect(await jobEnqueue(t.pool, { queue: 'due', payload: {}, runAt: new Date(dbNow.getTime() + 60_000) })).toMatchObject({ outcome: 'ok', due: false });
    expect(await jobEnqueue(t.pool, { queue: 'due', payload: {}, runAt: new Date(dbNow.getTime() + 60_000), now: new Date(dbNow.getTime() + 120_000) })).toMatchObject({
      outcome: 'ok',
      due: true,
    });
    expect(await jobEnqueue(t.pool, { queue: 'due', payload: {}, idempotencyKey: 'due-1', notify: false })).toMatchObject({ outcome: 'ok', due: true });
  });
});
