/**
 * A prototype's purge (docs/decisions.md, "Next: finished jobs in a table of days"): a day of
 * finished jobs in its own partition of a `jobs_done` table (created here; the schema has none),
 * detached CONCURRENTLY and dropped while another connection inserts into `jobs_done` one row a
 * transaction, as fast as it can. Reports how long the purge took and the inserter's rate before
 * and during it.
 *
 *   node --import tsx test/bench/partition-drop.ts [--jobs 1680000]
 */
import { mkdtemp } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Command } from 'commander';
import pg from 'pg';
import pino from 'pino';
import { startEmbedded } from '../../server/store/embedded.js';
import { migrateDatabase } from '../../server/store/index.js';

const N = new Command()
  .option('--jobs <n>', 'finished jobs in the partition dropped', (v) => Number(v), 1_680_000)
  .parse()
  .opts<{ jobs: number }>().jobs;
const log = pino({ level: 'warn' });
const embedded = await startEmbedded({ dataDir: await mkdtemp(path.join(os.tmpdir(), 'leasehold-partition-drop-')), log, ephemeral: true });
const setup = new pg.Pool({ connectionString: embedded.url, max: 1 });
// pg-pool's end() resolves before its sockets close: the server stopped right after may end them
// first, and that error on a pool with no listener would be thrown (as lifecycle.ts says).
setup.on('error', (err) => console.error(`setup connection lost: ${err.message}`));
const a = new pg.Client(embedded.url);
const b = new pg.Client(embedded.url);
try {
  await migrateDatabase(setup);
  await a.connect();
  await b.connect();
  // The prototype's table: the columns of jobs, partitioned by finish day, with the indexes its readers would need.
  await a.query(`CREATE TABLE jobs_done (LIKE jobs INCLUDING DEFAULTS) PARTITION BY RANGE (finished_at);
    CREATE TABLE jobs_done_old PARTITION OF jobs_done FOR VALUES FROM ('2026-01-01') TO ('2026-01-02');
    CREATE TABLE jobs_done_now PARTITION OF jobs_done FOR VALUES FROM (date_trunc('day', now())) TO (date_trunc('day', now()) + interval '2 days');
    CREATE INDEX ON jobs_done (id);
    CREATE INDEX ON jobs_done (current_attempt_id);
    CREATE INDEX ON jobs_done (queue, created_at DESC, id DESC);
    CREATE INDEX ON jobs_done (agent_id, created_at DESC, id DESC);
    CREATE INDEX ON jobs_done (created_at DESC, id DESC);`);
  let t = performance.now();
  await a.query(
    `INSERT INTO jobs_done (id, queue, payload, priority, status, run_at, max_attempts, attempt_no, attempts_started, current_attempt_id, agent_id,
                            labels, result, created_at, updated_at, finished_at)
     SELECT job_id_v7(), 'q' || (i % 5), '{}'::jsonb, 0, 'succeeded', '2026-01-01', 5, 1, 1, gen_random_uuid(), 'agent-' || (i % 20), '{}'::jsonb,
       '{"ok":true}'::jsonb, '2026-01-01'::timestamptz + i * interval '50 ms', '2026-01-01'::timestamptz + i * interval '50 ms',
       '2026-01-01'::timestamptz + i * interval '50 ms'
     FROM generate_series(1, $1) i`,
    [N],
  );
  await a.query('CHECKPOINT');
  const size = (await a.query(`SELECT pg_size_pretty(pg_total_relation_size('jobs_done_old')) AS s`)).rows[0].s as string;
  console.log(`seeded ${N} jobs into jobs_done_old in ${((performance.now() - t) / 1000).toFixed(1)} s; ${size} with its indexes`);

  // The inserter: one row a transaction into jobs_done, as fast as it goes.
  let stop = false;
  let n = 0;
  const times: number[] = [];
  const inserter = (async () => {
    while (!stop) {
      await b.query(`INSERT INTO jobs_done (id, queue, payload, status, current_attempt_id, agent_id, labels, result, created_at, updated_at, finished_at)
        VALUES (job_id_v7(), 'q', '{}', 'succeeded', gen_random_uuid(), 'a', '{}', '{}', now(), now(), now())`);
      n++;
      times.push(performance.now());
    }
  })();
  const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
  await sleep(2000); // warm
  const n0 = n;
  const t0 = performance.now();
  await sleep(2000);
  const before = ((n - n0) / (performance.now() - t0)) * 1000;
  const n1 = n;
  t = performance.now();
  await a.query('ALTER TABLE jobs_done DETACH PARTITION jobs_done_old CONCURRENTLY');
  const detached = performance.now() - t;
  await a.query('DROP TABLE jobs_done_old');
  const purge = performance.now() - t;
  const during = ((n - n1) / purge) * 1000;
  stop = true;
  await inserter;
  let gap = 0;
  for (let i = 1; i < times.length; i++) gap = Math.max(gap, times[i]! - times[i - 1]!);
  console.log(`detach ${detached.toFixed(0)} ms, detach + drop ${purge.toFixed(0)} ms; inserter ${before.toFixed(0)} inserts/s before, ${during.toFixed(0)}/s during the purge`);
  console.log(`longest gap between two inserts: ${gap.toFixed(1)} ms`);
} finally {
  await a.end().catch(() => undefined);
  await b.end().catch(() => undefined);
  await setup.end();
  await embedded.stop();
}
