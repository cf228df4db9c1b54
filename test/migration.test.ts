/**
 * Migration 0005 carries a database of the previous release over: its rows (test/fixtures/
 * db-0004.json, made by that release's own store verbs with jobs in every state: queued,
 * claimed, running with a step and a suspect mark, succeeded, failed, retried and waiting, dead
 * by lease and by failure, canceled queued and running, requeued and running again, succeeded
 * after a failure, timed out, a claim that expired and was claimed again, a stale report) are
 * loaded into a database at schema 0004, the new migration runs, and then every job is what it
 * was, its history is whole, the invariants hold, and the store carries on with the live ones.
 */
import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { cp, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { drizzle } from 'drizzle-orm/node-postgres';
import { migrate } from 'drizzle-orm/node-postgres/migrator';
import pg from 'pg';
import { afterAll, beforeAll, expect, inject, it } from 'vitest';
import {
  attemptComplete,
  attemptFail,
  attemptStart,
  jobClaim,
  jobGet,
  jobPurge,
  jobRequeue,
  migrateDatabase,
  type Job,
} from '../server/store/index.js';
import { migrationsFolder, ONLINE_INDEXES } from '../server/store/migrate.js';
import { quietPool } from './helpers/quiet-pool.js';
import { withDatabase } from './helpers/global-setup.js';
import { checkInvariants } from './helpers/invariants.js';

const here = import.meta.dirname;
const name = `${inject('pgPrefix')}mig_${randomBytes(4).toString('hex')}`;
let pool: pg.Pool;
let dir: string;

interface Fixture {
  tables: Record<string, Array<Record<string, unknown>>>;
}

beforeAll(async () => {
  const admin = new pg.Client({ connectionString: inject('pgAdminUrl') });
  await admin.connect();
  await admin.query(`CREATE DATABASE ${name}`);
  await admin.end();
  pool = quietPool({ connectionString: withDatabase(inject('pgAdminUrl'), name), max: 4 });
  // The schema of the previous release: migrations 0000-0004 only.
  dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-migrations-'));
  await cp(migrationsFolder, dir, { recursive: true });
  const journal = JSON.parse(await readFile(path.join(dir, 'meta/_journal.json'), 'utf8')) as { entries: Array<{ tag: string }> };
  journal.entries = journal.entries.slice(0, journal.entries.findIndex((e) => e.tag.startsWith('0005')));
  await writeFile(path.join(dir, 'meta/_journal.json'), JSON.stringify(journal));
  const c = await pool.connect();
  try {
    await migrate(drizzle(c), { migrationsFolder: dir });
  } finally {
    c.release();
  }
  const fixture = JSON.parse(await readFile(path.join(here, 'fixtures/db-0004.json'), 'utf8')) as Fixture;
  // In the order of the foreign keys; identities as they were.
  for (const t of ['signing_secrets', 'subscriptions', 'jobs', 'attempts', 'completions', 'job_events', 'steps', 'stale_reports', 'webhook_events', 'webhook_deliveries']) {
    await pool.query(`INSERT INTO ${t} OVERRIDING SYSTEM VALUE SELECT * FROM json_populate_recordset(NULL::${t}, $1::json)`, [JSON.stringify(fixture.tables[t])]);
  }
  await pool.query(`SELECT setval('job_events_id_seq', (SELECT max(id) FROM job_events))`);
  await pool.query(`SELECT setval('webhook_deliveries_id_seq', (SELECT max(id) FROM webhook_deliveries))`);
});

afterAll(async () => {
  await pool?.end();
  const admin = new pg.Client({ connectionString: inject('pgAdminUrl') });
  await admin.connect();
  await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
  await admin.end();
  if (dir) await rm(dir, { recursive: true, force: true });
});

it('carries every job of a 0004 database over, with its history, and the store goes on from there', async () => {
  const before = (await pool.query(`SELECT payload->>'name' AS name, id, status::text, attempt_no, attempts_started, result, error, run_at,
                                           current_attempt_id, agent_id, suspect_at, finished_at, lease_expires_at
                                    FROM (SELECT j.*, a.suspect_since AS suspect_at FROM jobs j LEFT JOIN attempts a ON a.id = j.current_attempt_id) j`)).rows;
  const old = new Map(before.map((r) => [r.name as string, r]));
  const counts = async () => (await pool.query(`SELECT (SELECT count(*) FROM steps)::int AS steps, (SELECT count(*) FROM stale_reports)::int AS stale,
                                                 (SELECT count(*) FROM webhook_events)::int AS events, (SELECT count(*) FROM webhook_deliveries)::int AS deliveries`)).rows[0];
  const kept = await counts();
  expect(kept).toMatchObject({ steps: 1, stale: 1 });

  // Every migration after 0004 (0005 on: the attempt history, event times in milliseconds, …).
  const journal = JSON.parse(readFileSync(path.join(import.meta.dirname, '../server/store/migrations/meta/_journal.json'), 'utf8')) as { entries: Array<{ tag: string }> };
  expect(await migrateDatabase(pool)).toBe(journal.entries.filter((e) => e.tag > '0004_z').length);

  // 0014: every ended attempt carries its job's creation time; the indexes built after the
  // migrations (CONCURRENTLY) exist and are valid.
  const misdated = await pool.query(`SELECT a.id FROM attempts a JOIN jobs j ON j.id = a.job_id WHERE a.job_created_at IS DISTINCT FROM j.created_at`);
  expect(misdated.rows).toEqual([]);
  expect(Number((await pool.query('SELECT count(*) FROM attempts')).rows[0].count)).toBeGreaterThan(5);
  const built = await pool.query(
    `SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = ANY ($1) ORDER BY c.relname`,
    [ONLINE_INDEXES.map((x) => x.name)],
  );
  expect(built.rows).toEqual(ONLINE_INDEXES.map((x) => ({ relname: x.name, indisvalid: true })).sort((a, b) => a.relname.localeCompare(b.relname)));

  // Every job as it was: state, attempt numbers, result, due time, finish time, its live attempt.
  const after = (await pool.query(`SELECT payload->>'name' AS name, j.*, job_error(j.id, j.status) AS error FROM jobs j`)).rows;
  expect(after).toHaveLength(before.length);
  for (const j of after) {
    const o = old.get(j.name)!;
    expect({ name: j.name, status: j.status, attemptNo: j.attempt_no, started: j.attempts_started, result: j.result, runAt: j.run_at, finishedAt: j.finished_at })
      .toEqual({ name: o.name, status: o.status, attemptNo: o.attempt_no, started: o.attempts_started, result: o.result, runAt: o.run_at, finishedAt: o.finished_at });
    expect({ current: j.current_attempt_id, agent: j.agent_id, lease: j.lease_expires_at, suspect: j.suspect_since }).toEqual({
      current: o.current_attempt_id,
      agent: o.agent_id,
      lease: o.lease_expires_at,
      suspect: o.suspect_at,
    });
    // The error a job shows is the one it had, except that a success shows none.
    expect(j.error, j.name).toEqual(j.status === 'succeeded' ? null : o.error);
    if (j.current_attempt_id) expect(j.claimed_at, j.name).toBeInstanceOf(Date);
  }
  expect(old.get('retried-then-succeeded')!.error).toEqual({ message: 'first try failed' });
  expect(await counts()).toEqual(kept);
  expect((await pool.query(`SELECT to_regclass('completions') AS t`)).rows[0].t).toBeNull();

  // Histories: every transition is still there, in order, now read from the attempts.
  const history = async (n: string) => {
    const d = await jobGet(pool, { jobId: old.get(n)!.id });
    if (d.outcome !== 'ok') throw new Error(n);
    return d.value;
  };
  const kinds = async (n: string) => (await history(n)).events.map((e) => e.kind);
  expect(await kinds('succeeded')).toEqual(['enqueued', 'claimed', 'started', 'completed']);
  expect(await kinds('dead-lease')).toEqual(['enqueued', 'claimed', 'started', 'dead']);
  expect(await kinds('dead-fail')).toEqual(['enqueued', 'claimed', 'started', 'dead']);
  expect(await kinds('retry-pending')).toEqual(['enqueued', 'claimed', 'started', 'retry_scheduled']);
  expect(await kinds('canceled-queued')).toEqual(['enqueued', 'canceled']);
  expect(await kinds('canceled-running')).toEqual(['enqueued', 'claimed', 'started', 'canceled']);
  expect(await kinds('requeued')).toEqual(['enqueued', 'claimed', 'started', 'dead', 'requeued', 'claimed', 'started']);
  expect(await kinds('retried-then-succeeded')).toEqual(['enqueued', 'claimed', 'started', 'retry_scheduled', 'claimed', 'started', 'completed']);
  expect(await kinds('timed-out')).toEqual(['enqueued', 'claimed', 'started', 'timed_out']);
  expect(await kinds('claim-expired')).toEqual(['enqueued', 'claimed', 'claim_expired', 'claimed']);
  const failed = await history('failed');
  expect(failed.attempts).toMatchObject([{ status: 'failed', error: { message: 'bad input' }, retryable: false, jobStatus: 'failed' }]);
  expect((await history('dead-lease')).attempts[0]).toMatchObject({ status: 'lease_expired', error: { reason: 'lease_expired' }, jobStatus: 'dead' });
  const retry = await history('retry-pending');
  expect(retry.attempts[0]!.runAt).toEqual(retry.job.runAt);
  const running = await history('running');
  expect(running.attempts).toMatchObject([{ status: 'running', endedAt: null, suspectSince: old.get('running')!.suspect_at }]);
  expect(running.steps).toMatchObject([{ step: 'charge', status: 'done' }]);
  expect((await history('claim-expired')).staleReports).toHaveLength(1);
  await checkInvariants(pool);

  // The store carries on with what was live, and with what was waiting.
  const live = (n: string) => ({ attemptId: old.get(n)!.current_attempt_id as string, agentId: old.get(n)!.agent_id as string });
  expect((await attemptComplete(pool, { ...live('running'), result: { after: 'migration' } })).outcome).toBe('ok');
  expect((await attemptStart(pool, { ...live('claim-expired'), leaseTtlMs: 30_000 })).outcome).toBe('ok');
  expect((await attemptFail(pool, { ...live('requeued'), error: { message: 'no luck' }, retryable: true })).outcome).toBe('ok');
  expect((await jobRequeue(pool, { jobId: old.get('dead-fail')!.id })).outcome).toBe('ok');
  const claimed = await jobClaim(pool, { agentId: 'agent-c', queues: ['mig-waiting'], limit: 5, claimTtlMs: 30_000, labels: { os: 'windows' } });
  expect(claimed.outcome === 'ok' && claimed.value.map((c) => (c.job as Job).payload)).toEqual([{ name: 'queued' }]);
  await checkInvariants(pool);
  expect(await kinds('running')).toEqual(['enqueued', 'claimed', 'started', 'completed']);
  expect(await kinds('requeued')).toEqual(['enqueued', 'claimed', 'started', 'dead', 'requeued', 'claimed', 'started', 'dead']);

  // No key refers to jobs any more (0009, 0017): the purge deletes what a job owns itself, the
  // migrated history's steps and stale reports included.
  expect((await pool.query(`SELECT conname FROM pg_constraint WHERE contype = 'f' AND confrelid = 'jobs'::regclass`)).rows).toEqual([]);
  // Every finished job here has a notification or an alert: done, as the deliverer would.
  await pool.query(`UPDATE webhook_deliveries SET status = 'delivered', delivered_at = now() WHERE status = 'pending'`);
  await pool.query(`UPDATE webhook_events SET alerted_at = now() WHERE type = 'job.dead' AND alerted_at IS NULL`);
  const finished = Number((await pool.query(`SELECT count(*) FROM jobs WHERE finished_at IS NOT NULL`)).rows[0].count);
  const purge = await jobPurge(pool, { olderThanMs: 1000, now: new Date(Date.now() + 365 * 86_400_000) });
  expect(purge.outcome === 'ok' && purge.value.purged).toBe(finished);
  expect(finished).toBeGreaterThan(5);
  for (const table of ['steps', 'stale_reports', 'webhook_events', 'job_events', 'attempts']) {
    const n = Number((await pool.query(`SELECT count(*) FROM ${table} x WHERE NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = x.job_id)`)).rows[0].count);
    expect([table, n]).toEqual([table, 0]);
  }
  await checkInvariants(pool);
});

it('an index whose concurrent build was cut short is dropped and built again at the next start', async () => {
  // What a crash in the middle of CREATE INDEX CONCURRENTLY leaves: the index, marked invalid.
  await pool.query(`UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'jobs_unsucceeded_idx'::regclass`);
  const before = (await pool.query(`SELECT 'jobs_unsucceeded_idx'::regclass::oid AS oid`)).rows[0].oid;
  expect(await migrateDatabase(pool)).toBe(0);
  const { rows } = await pool.query(`SELECT indexrelid AS oid, indisvalid FROM pg_index WHERE indexrelid = 'jobs_unsucceeded_idx'::regclass`);
  expect(rows).toEqual([{ oid: expect.any(Number), indisvalid: true }]);
  expect(rows[0].oid).not.toBe(before);
});
