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
 * With `--history N`, N jobs go through the same life first and stay, as do every round's (the
 * day's partition grows as it does in production), and each round starts from a CHECKPOINT, so
 * the first write to each page after it is a full-page image, as after every checkpoint.
 * Linux only (/proc).
 *
 *   node --import tsx test/bench/lifecycle.ts [--jobs 20000] [--batch 128] [--rounds 5] [--wal-records] [--history 200000]
 */
import { readFileSync } from 'node:fs';
import { mkdtemp } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Command } from 'commander';
import pg from 'pg';
import pino from 'pino';
import { startEmbedded } from '../../server/store/embedded.js';
import { attemptCompleteMany, attemptStartMany, createPool, jobClaimSlots, migrateDatabase } from '../../server/store/index.js';

const o = new Command()
  .option('--jobs <n>', 'jobs per round', (v) => Number(v), 20_000)
  .option('--batch <n>', 'jobs per statement', (v) => Number(v), 128)
  .option('--rounds <n>', 'measured rounds', (v) => Number(v), 5)
  .option('--wal-records', 'break the WAL down by record type (pg_walinspect)')
  .option('--history <n>', 'jobs taken through their life first and kept, with every round\'s; a CHECKPOINT before each round', (v) => Number(v), 0)
  .parse()
  .opts<{ jobs: number; batch: number; rounds: number; walRecords?: boolean; history: number }>();

const log = pino({ level: 'warn' });
const embedded = await startEmbedded({ dataDir: await mkdtemp(path.join(os.tmpdir(), 'leasehold-lifecycle-')), log, ephemeral: true });
const setup = new pg.Pool({ connectionString: embedded.url, max: 1 });
// An idle connection lost (the server stopped under us, say) is said, not thrown from the pool's
// event: that would end the process before the error of the statement that failed is printed.
setup.on('error', (err) => console.error(`setup connection lost: ${err.message}`));
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
  for (let round = o.history > 0 ? -1 : 0; round <= o.rounds; round++) {
    // Round -1: the history (--history), not measured.
    const jobs = round < 0 ? o.history : o.jobs;
    await setup.query(`INSERT INTO jobs (queue, payload) SELECT 'bench', '{}'::jsonb FROM generate_series(1, $1)`, [jobs]);
    await setup.query('VACUUM ANALYZE jobs');
    if (o.history > 0) await setup.query('CHECKPOINT');
    const fresh = (): Acc => ({ cpu: 0, wall: 0, wal: 0, ranges: [] });
    const acc: Record<Kind, Acc> = { claim: fresh(), start: fresh(), complete: fresh() };
    let done = 0;
    while (done < jobs) {
      const claimed = await timed(acc.claim, () => jobClaimSlots(db, { slots: Array<string>(o.batch).fill('agent-1'), queues: ['bench'], claimTtlMs: 30_000 }));
      if (claimed.outcome !== 'ok') throw new Error(`claim: ${JSON.stringify(claimed)}`);
      if (!claimed.value.length) break;
      const refs = claimed.value.map((c) => ({ attemptId: c.attemptId, agentId: c.agentId }));
      const started = await timed(acc.start, () => attemptStartMany(db, { items: refs, leaseTtlMs: 30_000 }));
      const badStart = started.find((s) => s.outcome !== 'ok');
      if (badStart) throw new Error(`start: ${JSON.stringify(badStart)}`);
      const completed = await timed(acc.complete, () => attemptCompleteMany(db, { items: refs.map((r) => ({ ...r, result: { ok: true } })) }));
      const badComplete = completed.find((s) => s.outcome !== 'ok');
      if (badComplete) throw new Error(`complete: ${JSON.stringify(badComplete)}`);
      done += claimed.value.length;
    }
    if (done !== jobs) throw new Error(`round ${round}: ${done} of ${jobs} jobs went through`);
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
    if (o.history === 0) await setup.query('TRUNCATE jobs, job_keys, attempts, job_counts, ended_counts');
  }

  const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
  const fmt = (xs: number[]) => `${median(xs).toFixed(1)} [${Math.min(...xs).toFixed(1)} – ${Math.max(...xs).toFixed(1)}]`;
  const beside = o.history > 0 ? `, beside ${o.history} jobs of history and the rounds before, each from a CHECKPOINT` : '';
  console.log(`${o.rounds} rounds of ${o.jobs} jobs${beside}, ${o.batch} a statement, per job, median [min – max] over rounds:\n`);
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
