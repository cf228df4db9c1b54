/**
 * What PostgreSQL spends on each statement of a job's fenced life, in batches as the
 * coordinator's drain sends them: the claim (jobClaimSlots), the start (attemptStartMany) and the
 * completion (attemptCompleteMany), each over `--batch` jobs. For each kind, per job: the CPU
 * time of the one backend that runs them (from /proc, so parse, bind, execution, commit and WAL
 * insertion all count), the wall time of the call, and the WAL it wrote (the insert position
 * before and after, nothing else writing). With `--wal-records`, that WAL by record type
 * (pg_walinspect): heap inserts and updates, HOT or not, B-tree entries, row locks, full-page
 * images. No coordinator, no agent: the store's functions on one connection of the coordinator's
 * hot pool (generic plans, as the coordinator runs them) to an embedded PostgreSQL 17, so a
 * statement's own cost is seen apart from the machine's other processes.
 * Medians over rounds of `--jobs` jobs each, after one round that warms the caches and plans.
 * Linux only (/proc).
 *
 * `--completion moved` measures, instead of the store's completion, a prototype of the design in
 * docs/decisions.md ("Finished jobs in a table of days"): the job's row deleted from `jobs` and
 * inserted into `jobs_done`, partitioned by finish day, carrying its final attempt (no `attempts`
 * row). The script creates that table itself; the schema has none.
 *
 *   node --import tsx test/bench/lifecycle.ts [--jobs 20000] [--batch 128] [--rounds 5] [--wal-records] [--completion store|moved]
 */
import { readFileSync } from 'node:fs';
import { mkdtemp } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Command } from 'commander';
import pg from 'pg';
import pino from 'pino';
import { startEmbedded } from '../../server/store/embedded.js';
import { attemptCompleteMany, attemptStartMany, createPool, jobClaimSlots, migrateDatabase, succeededNotificationSql } from '../../server/store/index.js';
import { countChangeSql, endedCountSql } from '../../server/store/counts.js';

const o = new Command()
  .option('--jobs <n>', 'jobs per round', (v) => Number(v), 20_000)
  .option('--batch <n>', 'jobs per statement', (v) => Number(v), 128)
  .option('--rounds <n>', 'measured rounds', (v) => Number(v), 5)
  .option('--wal-records', 'break the WAL down by record type (pg_walinspect)')
  .option('--completion <kind>', "the store's completion, or the prototype that moves the row to jobs_done (moved)", 'store')
  .parse()
  .opts<{ jobs: number; batch: number; rounds: number; walRecords?: boolean; completion: 'store' | 'moved' }>();
if (o.completion !== 'store' && o.completion !== 'moved') throw new Error(`--completion: store or moved, not ${o.completion}`);

/**
 * The finished jobs' table of the prototype: the columns of `jobs`, partitioned by finish day,
 * with the indexes its readers would need (GetJob by id, a late report by its attempt, the lists
 * by queue, by agent, by creation time). A job's final attempt stays on its row.
 */
const MOVED_SETUP = `
  CREATE TABLE jobs_done (LIKE jobs) PARTITION BY RANGE (finished_at);
  CREATE TABLE jobs_done_now PARTITION OF jobs_done FOR VALUES FROM (date_trunc('day', now())) TO (date_trunc('day', now()) + interval '2 days');
  CREATE INDEX ON jobs_done (id);
  CREATE INDEX ON jobs_done (current_attempt_id);
  CREATE INDEX ON jobs_done (queue, created_at DESC, id DESC);
  CREATE INDEX ON jobs_done (agent_id, created_at DESC, id DESC);
  CREATE INDEX ON jobs_done (created_at DESC, id DESC);`;

/**
 * The prototype's completion: the store's (attempts.ts, completeSql, shape 'summary') with the
 * job's row moved to jobs_done instead of updated, and no attempts row. Same fence, same locking
 * order, same counts and notifications, same answer.
 */
const movedCompleteSql = (columns: string[]) => {
  const set: Record<string, string> = {
    status: `'succeeded'::job_status`,
    result: '$4::jsonb -> d.current_attempt_id::text',
    attempts_started: "d.attempts_started + (d.status = 'claimed')::int",
    started_at: 'coalesce(d.started_at, coalesce($5::timestamptz, now()))',
    lease_expires_at: 'NULL',
    execution_deadline: 'NULL',
    finished_at: 'coalesce($5::timestamptz, now())',
    updated_at: 'coalesce($5::timestamptz, now())',
  };
  return `WITH o AS MATERIALIZED (
       SELECT j.id, j.queue, j.status, j.current_attempt_id, j.agent_id, j.attempt_no, j.run_at, j.claimed_at, j.claim_deadline,
         j.started_at, j.suspect_since, j.created_at
       FROM jobs j
       WHERE j.current_attempt_id = ANY($1::uuid[]) AND j.agent_id = ($2::jsonb ->> j.current_attempt_id::text)
         AND coalesce(($3::jsonb ->> j.current_attempt_id::text)::uuid = j.id, true) AND j.status IN ('claimed', 'running')
       FOR UPDATE
     ), d AS (
       DELETE FROM jobs j WHERE j.id = ANY (ARRAY(SELECT id FROM o)) RETURNING j.*
     ), u AS (
       INSERT INTO jobs_done (${columns.join(', ')})
       SELECT ${columns.map((c) => set[c] ?? `d.${c}`).join(', ')} FROM d
       RETURNING *
     ), k AS (
       ${countChangeSql('SELECT u.queue, u.status, 1 FROM u')}
     ), ec AS (
       ${endedCountSql(`SELECT u.finished_at, 'completed' FROM u`)}
     ), ${succeededNotificationSql}
     SELECT o.current_attempt_id AS reported_by, o.id, o.queue, 'succeeded' AS status, o.attempt_no, NULL AS current_attempt_id,
       date_part('epoch', o.run_at) * 1000 AS run_at_ms, date_part('epoch', coalesce($5::timestamptz, now())) * 1000 AS updated_at_ms,
       NULL AS lease_ms
     FROM o`;
};

const log = pino({ level: 'warn' });
const embedded = await startEmbedded({ dataDir: await mkdtemp(path.join(os.tmpdir(), 'leasehold-lifecycle-')), log, ephemeral: true });
const setup = new pg.Pool({ connectionString: embedded.url, max: 1 });
// The coordinator's pool of the hot transitions: its connections plan generically (HOT_SETTINGS).
const hot = createPool(embedded.url, 1, log, { hot: true });

type Kind = 'claim' | 'start' | 'complete';
const kinds: Kind[] = ['claim', 'start', 'complete'];
interface Acc {
  cpu: number;
  wall: number;
  wal: number;
  /** WAL ranges [from, to) the statements of this kind wrote. */
  ranges: Array<[string, string]>;
}

try {
  await migrateDatabase(setup);
  if (o.walRecords) await setup.query('CREATE EXTENSION IF NOT EXISTS pg_walinspect');
  let moved: pg.QueryConfig | undefined;
  if (o.completion === 'moved') {
    await setup.query(MOVED_SETUP);
    const { rows } = await setup.query<{ c: string }>(`SELECT attname AS c FROM pg_attribute WHERE attrelid = 'jobs'::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum`);
    moved = { name: 'prototypeCompleteMoved', text: movedCompleteSql(rows.map((r) => r.c)) };
  }
  const db = await hot.connect();
  const backend = Number((await db.query('SELECT pg_backend_pid() AS pid')).rows[0].pid);

  /** CPU seconds of the backend so far (user + system), from /proc. */
  const backendCpu = (): number => {
    const text = readFileSync(`/proc/${backend}/stat`, 'utf8');
    const f = text.slice(text.lastIndexOf(')') + 2).split(' ');
    return (Number(f[11]) + Number(f[12])) / 100; // utime, stime in USER_HZ (100)
  };
  const walLsn = async (): Promise<string> => (await db.query('SELECT pg_current_wal_insert_lsn() AS l')).rows[0].l as string;
  const walBytes = async (from: string, to: string): Promise<number> => Number((await db.query('SELECT $2::pg_lsn - $1::pg_lsn AS b', [from, to])).rows[0].b);

  const timed = async <T>(acc: Acc, f: () => Promise<T>): Promise<T> => {
    const w0 = await walLsn();
    const c0 = backendCpu();
    const t0 = performance.now();
    const r = await f();
    acc.wall += performance.now() - t0;
    acc.cpu += backendCpu() - c0;
    const w1 = await walLsn();
    acc.wal += await walBytes(w0, w1);
    acc.ranges.push([w0, w1]);
    return r;
  };

  const perRound: Record<Kind, Array<{ cpuUs: number; wallUs: number; walB: number }>> = { claim: [], start: [], complete: [] };
  const records: Record<Kind, Map<string, { n: number; rec: number; fpi: number }>> = { claim: new Map(), start: new Map(), complete: new Map() };
  let measuredJobs = 0;
  for (let round = 0; round <= o.rounds; round++) {
    await setup.query(`INSERT INTO jobs (queue, payload) SELECT 'bench', '{}'::jsonb FROM generate_series(1, $1)`, [o.jobs]);
    await setup.query('VACUUM ANALYZE jobs');
    const fresh = (): Acc => ({ cpu: 0, wall: 0, wal: 0, ranges: [] });
    const acc: Record<Kind, Acc> = { claim: fresh(), start: fresh(), complete: fresh() };
    let done = 0;
    while (done < o.jobs) {
      const claimed = await timed(acc.claim, () => jobClaimSlots(db, { slots: Array<string>(o.batch).fill('agent-1'), queues: ['bench'], claimTtlMs: 30_000 }));
      if (claimed.outcome !== 'ok') throw new Error(`claim: ${JSON.stringify(claimed)}`);
      if (!claimed.value.length) break;
      const refs = claimed.value.map((c) => ({ attemptId: c.attemptId, agentId: c.agentId }));
      const started = await timed(acc.start, () => attemptStartMany(db, { items: refs, leaseTtlMs: 30_000 }));
      const badStart = started.find((s) => s.outcome !== 'ok');
      if (badStart) throw new Error(`start: ${JSON.stringify(badStart)}`);
      if (moved) {
        const ids = refs.map((r) => r.attemptId);
        const byId = (v: (k: number) => string) => `{${ids.map((id, k) => `"${id}":${v(k)}`).join(',')}}`;
        const params = [ids, byId((k) => JSON.stringify(refs[k]!.agentId)), null, byId(() => '{"ok":true}'), null];
        const r = await timed(acc.complete, () => db.query({ ...moved, values: params }));
        if (r.rowCount !== refs.length) throw new Error(`moved completion: ${r.rowCount} of ${refs.length} rows`);
      } else {
        const completed = await timed(acc.complete, () => attemptCompleteMany(db, { items: refs.map((r) => ({ ...r, result: { ok: true } })) }));
        const badComplete = completed.find((s) => s.outcome !== 'ok');
        if (badComplete) throw new Error(`complete: ${JSON.stringify(badComplete)}`);
      }
      done += claimed.value.length;
    }
    if (done !== o.jobs) throw new Error(`round ${round}: ${done} of ${o.jobs} jobs went through`);
    if (round > 0) {
      measuredJobs += done;
      for (const k of kinds) {
        perRound[k].push({ cpuUs: (acc[k].cpu * 1e6) / done, wallUs: (acc[k].wall * 1e3) / done, walB: acc[k].wal / done });
        if (!o.walRecords) continue;
        for (const [from, to] of acc[k].ranges) {
          const { rows } = await setup.query<{ t: string; count: string; record_size: string; fpi_size: string }>(
            `SELECT "resource_manager/record_type" AS t, count, record_size, fpi_size FROM pg_get_wal_stats($1, $2, true) WHERE count > 0`,
            [from, to],
          );
          for (const x of rows) {
            const e = records[k].get(x.t) ?? { n: 0, rec: 0, fpi: 0 };
            e.n += Number(x.count);
            e.rec += Number(x.record_size);
            e.fpi += Number(x.fpi_size);
            records[k].set(x.t, e);
          }
        }
      }
    }
    await setup.query(`TRUNCATE jobs, attempts, job_counts, ended_counts${moved ? ', jobs_done' : ''}`);
  }

  const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
  const fmt = (xs: number[]) => `${median(xs).toFixed(1)} [${Math.min(...xs).toFixed(1)} – ${Math.max(...xs).toFixed(1)}]`;
  console.log(`${o.rounds} rounds of ${o.jobs} jobs, ${o.batch} a statement, completion: ${o.completion}; per job, median [min – max] over rounds:\n`);
  console.log('| statement | backend CPU µs | wall µs | WAL bytes |');
  console.log('|---|---:|---:|---:|');
  let cpuTotal = 0;
  let walTotal = 0;
  for (const k of kinds) {
    const cpu = perRound[k].map((r) => r.cpuUs);
    const wal = perRound[k].map((r) => r.walB);
    cpuTotal += median(cpu);
    walTotal += median(wal);
    console.log(`| ${k} | ${fmt(cpu)} | ${fmt(perRound[k].map((r) => r.wallUs))} | ${fmt(wal)} |`);
  }
  console.log(`| all three | ${cpuTotal.toFixed(1)} | | ${walTotal.toFixed(0)} |`);
  if (o.walRecords) {
    console.log(`\nWAL by record type, per job (all measured rounds):\n`);
    console.log('| statement | record | records | bytes | of which full-page images |');
    console.log('|---|---|---:|---:|---:|');
    for (const k of kinds) {
      const sorted = [...records[k]].sort((a, b) => b[1].rec + b[1].fpi - (a[1].rec + a[1].fpi));
      for (const [t, e] of sorted) {
        const bytes = (e.rec + e.fpi) / measuredJobs;
        if (bytes < 1) continue;
        console.log(`| ${k} | ${t} | ${(e.n / measuredJobs).toFixed(2)} | ${bytes.toFixed(0)} | ${(e.fpi / measuredJobs).toFixed(0)} |`);
      }
    }
  }
  db.release();
} finally {
  await hot.end();
  await setup.end();
  await embedded.stop();
}
