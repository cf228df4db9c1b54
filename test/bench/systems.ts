/**
 * The systems under benchmark, each on its own database of one PostgreSQL server: Leasehold (an
 * in-process coordinator, agents over gRPC streams in a worker process), graphile-worker 0.17
 * with batching off and on, and pg-boss 10. Each can bulk-enqueue, enqueue one job the way a
 * client would (for Leasehold: n8n's way, a JSON POST to the HTTP gateway), count what is done (as the database sees it), and be reset between repetitions.
 */
import http from 'node:http';
import pg from 'pg';
import pino from 'pino';
import { loadConfig } from '../../server/config.js';
import { startCoordinator, type Coordinator } from '../../server/coordinator.js';
import { agentCreate, createPool } from '../../server/store/index.js';
import { quietPool } from '../helpers/quiet-pool.js';
import type { SystemKey } from './report.js';
import type { WorkerConfig } from './worker.js';

export type SystemName = WorkerConfig['system'];

export interface System {
  name: SystemName;
  /** The name in `results.json`. */
  key: SystemKey;
  label: string;
  /** The database this system uses (for commit counts). */
  database: string;
  pool: pg.Pool;
  /** Every pool of this process on that database (the statistics of their idle connections are flushed before they are read). */
  pools: pg.Pool[];
  bulkEnqueue(n: number, payload?: (i: number) => Record<string, unknown>): Promise<void>;
  enqueueOne(payload: Record<string, unknown>): Promise<void>;
  /**
   * Whether every job is completed, as the database sees it (committed completions only). An
   * EXISTS, so the poll costs each system next to nothing however many jobs there are.
   */
  drained(): Promise<boolean>;
  reset(): Promise<void>;
  worker(mode: WorkerConfig['mode'], concurrency: number): Promise<WorkerConfig>;
  /** Lease (or expiry) that governs recovery of a dead worker's jobs, in ms, if the system has one. */
  leaseMs?: number;
  close(): Promise<void>;
}

export const QUEUE = 'noop';
const ADMIN = 'bench-admin-key';

function withDb(url: string, db: string) {
  const u = new URL(url);
  u.pathname = `/${db}`;
  return u.toString();
}

/** A new database `name` (dropped first if it exists) on the server of `adminUrl`; its URL. */
export async function createDb(adminUrl: string, name: string) {
  const c = new pg.Client({ connectionString: adminUrl });
  await c.connect();
  await c.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
  await c.query(`CREATE DATABASE ${name}`);
  await c.end();
  return withDb(adminUrl, name);
}

/** Leasehold: coordinator in this process (gRPC on a free port), agents in the worker process. */
export async function leasehold(
  adminUrl: string,
  opts: {
    leaseMs: number;
    agents: number;
    /** Its own database (default bench_leasehold). */
    database?: string;
    /** Reset removes nothing: every job stays, the seeded history and the drains' own (see `reset`). */
    keepHistory?: boolean;
  },
): Promise<System> {
  const database = opts.database ?? 'bench_leasehold';
  const url = await createDb(adminUrl, database);
  const config = loadConfig(
    { grpcAddr: '127.0.0.1:0', httpAddr: '127.0.0.1:0' },
    {
      DATABASE_URL: url,
      LEASEHOLD_ADMIN_KEY: ADMIN,
      LEASEHOLD_LEASE_TTL: `${opts.leaseMs}ms`,
      LEASEHOLD_CLAIM_TTL: `${opts.leaseMs}ms`,
      LEASEHOLD_HEARTBEAT_INTERVAL: `${Math.round(opts.leaseMs / 5)}ms`,
      LEASEHOLD_REAPER_INTERVAL: '250ms',
      LEASEHOLD_LOG_LEVEL: 'warn',
      // To compare the vacuumer off (`off`) or at another threshold: passed through.
      ...(process.env.LEASEHOLD_VACUUM_DEAD_ROWS ? { LEASEHOLD_VACUUM_DEAD_ROWS: process.env.LEASEHOLD_VACUUM_DEAD_ROWS } : {}),
      // To compare the completion linger off (`0`) or at another length: passed through.
      ...(process.env.LEASEHOLD_COMPLETION_LINGER ? { LEASEHOLD_COMPLETION_LINGER: process.env.LEASEHOLD_COMPLETION_LINGER } : {}),
    },
  );
  const c: Coordinator = await startCoordinator(config, pino({ level: "warn" }));
  (globalThis as { coordinator?: Coordinator }).coordinator = c;
  const pool = createPool(url, 4);
  const grpcUrl = `http://127.0.0.1:${c.grpc.address.port}`;
  // What n8n's HTTP Request node does: JSON over HTTP/1.1 with keep-alive.
  const agent = new http.Agent({ keepAlive: true, maxSockets: 64 });
  const enqueue = (body: string, retried = false): Promise<void> =>
    new Promise<void>((resolve, reject) => {
      const req = http.request(
        {
          host: '127.0.0.1',
          port: c.http.address.port,
          method: 'POST',
          path: '/leasehold.v1.JobService/EnqueueJob',
          agent,
          headers: { 'content-type': 'application/json', authorization: `Bearer ${ADMIN}`, 'content-length': Buffer.byteLength(body) },
        },
        (res) => {
          const chunks: Buffer[] = [];
          res.on('data', (b: Buffer) => chunks.push(b));
          res.on('end', () => (res.statusCode === 200 ? resolve() : reject(new Error(`EnqueueJob: HTTP ${res.statusCode} ${Buffer.concat(chunks).toString()}`))));
          // An answer cut off before its end never ends: failed, not waited for.
          res.on('close', () => res.complete || reject(new Error('EnqueueJob: the answer was cut off')));
        },
      );
      req.on('error', (err: NodeJS.ErrnoException) => {
        // A kept-alive socket the server closed (idle) as this request went out: the retry Node's
        // docs show for it (the server had stopped reading that socket).
        if (req.reusedSocket && err.code === 'ECONNRESET' && !retried) enqueue(body, true).then(resolve, reject);
        else reject(err);
      });
      req.end(body);
    });
  let n = 0;
  return {
    name: 'leasehold',
    key: 'leasehold',
    label: 'Leasehold',
    database,
    pool,
    pools: [pool, c.db.pool, c.db.hot],
    leaseMs: opts.leaseMs,
    async bulkEnqueue(count, payload = () => ({})) {
      const payloads = Array.from({ length: count }, (_, i) => JSON.stringify(payload(i)));
      for (let i = 0; i < payloads.length; i += 5000) {
        // What jobEnqueue writes for each job (its row, nothing else), 5,000 jobs a statement,
        // and its NOTIFY with them (as graphile-worker's addJobs and pg-boss's insert do): the
        // coordinator claims the first 5,000 while the next are written.
        await pool.query(
          `WITH n AS (INSERT INTO jobs (queue, payload) SELECT $1, p::jsonb FROM unnest($2::text[]) p RETURNING 1)
           SELECT pg_notify('leasehold_jobs', $1) FROM (SELECT count(*) FROM n) c`,
          [QUEUE, payloads.slice(i, i + 5000)],
        );
      }
    },
    async enqueueOne(payload) {
      await enqueue(JSON.stringify({ queue: QUEUE, payload }));
    },
    async drained() {
      // Served by the partial indexes of the queued and of the held jobs, which jobs_live has
      // (on jobs, every partition of finished jobs would be read whole).
      const q = `SELECT NOT EXISTS (SELECT 1 FROM jobs_live WHERE current_attempt_id IS NULL AND finished_at IS NULL)
                    AND NOT EXISTS (SELECT 1 FROM jobs_live WHERE current_attempt_id IS NOT NULL) AS done`;
      return (await pool.query(q)).rows[0].done as boolean;
    },
    async reset() {
      // With a history, nothing is removed: the drains' finished jobs stay in the history, as a
      // real day's jobs do (docs/performance-history.md, "The hot path's 0.9 ×"). Deleting them after
      // each drain reopened their room in the pages of today's partition that the seeded jobs,
      // larger than these no-op ones, had left part empty; the next drain's rows then went into
      // those pages, each already on disk: on the ten-million database, 6,609 full-page images
      // for a drain of 20,000 (4,935 B of WAL a job against 2,300 on the twin), which a
      // database whose finished jobs are only ever dropped a day at a time writes once at most.
      if (opts.keepHistory) return;
      // The coordinator's background work (reaper, purger, webhook deliverer) may hold one of
      // these tables while it waits for another: PostgreSQL breaks such a deadlock by failing one
      // side, and a failed TRUNCATE is simply tried again (seen once in a latency run).
      for (let attempt = 1; ; attempt++) {
        try {
          await pool.query('TRUNCATE jobs, job_keys, attempts, job_events, steps, stale_reports, notify_headers, webhook_events, job_counts, ended_counts CASCADE');
          return;
        } catch (err) {
          if ((err as { code?: string }).code !== '40P01' || attempt >= 5) throw err;
        }
      }
    },
    async worker(mode, concurrency) {
      const tokens: string[] = [];
      for (let i = 0; i < opts.agents; i++) {
        const o = await agentCreate(pool, { agentId: `bench-${mode}-${++n}` });
        if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
        tokens.push(o.value.token);
      }
      return { system: 'leasehold', mode, concurrency, url: grpcUrl, tokens, queue: QUEUE };
    },
    async close() {
      agent.destroy();
      await pool.end();
      await c.stop();
    },
  };
}

/** graphile-worker 0.17, batching off or on (the worker process runs `run()`). */
export async function graphile(adminUrl: string, batching: boolean, name = batching ? 'bench_graphile_on' : 'bench_graphile_off'): Promise<System> {
  const url = await createDb(adminUrl, name);
  const { runMigrations, makeWorkerUtils, Logger } = await import('graphile-worker');
  const logger = new Logger(() => () => undefined);
  // graphile-worker's client gets a pool of ours, as many connections as its own would have. The
  // pool it makes itself loses its 'error' listeners at `release()` and is then ended as pg-pool
  // ends one, resolving before the sockets close: the database stopped right after killed them,
  // and the 57P01 error on a pool with no listener ended the benchmark after its results. These
  // listeners do what graphile-worker's own do with its silent logger (it adds none of its own
  // to a pool that has them).
  const utilsPool = quietPool({ connectionString: url, max: 10 });
  utilsPool.on('connect', (client) => client.on('error', () => undefined));
  await runMigrations({ pgPool: utilsPool, logger });
  const utils = await makeWorkerUtils({ pgPool: utilsPool, logger });
  const pool = createPool(url, 4);
  return {
    name: batching ? 'graphile-on' : 'graphile-off',
    key: batching ? 'graphile-on' : 'graphile-off',
    label: `graphile-worker (batching ${batching ? 'on' : 'off'})`,
    database: name,
    pool,
    // The enqueues' pool too: its idle connections are told to flush their statistics.
    pools: [pool, utilsPool],
    async bulkEnqueue(count, payload = () => ({})) {
      for (let i = 0; i < count; i += 5000) {
        const specs = Array.from({ length: Math.min(5000, count - i) }, (_, k) => ({ identifier: QUEUE, payload: payload(i + k) }));
        await utils.addJobs(specs);
      }
    },
    async enqueueOne(payload) {
      await utils.addJob(QUEUE, payload);
    },
    async drained() {
      // graphile-worker deletes a job when it completes.
      return (await pool.query(`SELECT NOT EXISTS (SELECT 1 FROM graphile_worker._private_jobs) AS done`)).rows[0].done as boolean;
    },
    async reset() {
      await pool.query('DELETE FROM graphile_worker._private_jobs');
    },
    async worker(mode, concurrency) {
      return { system: batching ? 'graphile-on' : 'graphile-off', mode, concurrency, url, queue: QUEUE };
    },
    async close() {
      await utils.release();
      await utilsPool.end();
      await pool.end();
    },
  };
}

/** pg-boss 10 (the worker process runs `boss.work()`; it polls no faster than every 0.5 s). */
export async function pgboss(adminUrl: string, opts: { expireMs: number }): Promise<System> {
  const url = await createDb(adminUrl, 'bench_pgboss');
  const { default: PgBoss } = await import('pg-boss');
  const boss = new PgBoss({ connectionString: url, schema: 'pgboss', supervise: false, schedule: false, max: 4 });
  boss.on('error', () => undefined);
  await boss.start();
  await boss.createQueue(QUEUE, { name: QUEUE, expireInSeconds: Math.max(1, Math.round(opts.expireMs / 1000)), retryLimit: 5, retryDelay: 0 });
  const pool = createPool(url, 4);
  // pg-boss's own pool (it sends the enqueues), opened by start().
  const bossPool = (boss.getDb() as unknown as { pool: pg.Pool }).pool;
  return {
    name: 'pgboss',
    key: 'pg-boss',
    label: 'pg-boss',
    database: 'bench_pgboss',
    pool,
    // The enqueues' pool too: its idle connections are told to flush their statistics.
    pools: [pool, bossPool],
    leaseMs: opts.expireMs,
    async bulkEnqueue(count, payload = () => ({})) {
      for (let i = 0; i < count; i += 5000) {
        await boss.insert(Array.from({ length: Math.min(5000, count - i) }, (_, k) => ({ name: QUEUE, data: payload(i + k) })));
      }
    },
    async enqueueOne(payload) {
      await boss.send(QUEUE, payload);
    },
    async drained() {
      const q = `SELECT NOT EXISTS (SELECT 1 FROM pgboss.job WHERE name = $1 AND state IN ('created', 'retry', 'active')) AS done`;
      return (await pool.query(q, [QUEUE])).rows[0].done as boolean;
    },
    async reset() {
      await pool.query(`DELETE FROM pgboss.job WHERE name = $1`, [QUEUE]);
    },
    async worker(mode, concurrency) {
      return { system: 'pgboss', mode, concurrency, url, queue: QUEUE };
    },
    async close() {
      await boss.stop({ graceful: false, wait: true });
      await pool.end();
    },
  };
}
