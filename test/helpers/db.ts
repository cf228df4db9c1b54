/**
 * Per-file databases: `useTestDb()` clones the migrated template into a database of the file's
 * own before its tests and drops it after; `afterEach` fails a test that left a client checked
 * out of any pool it made.
 */
import { randomBytes } from 'node:crypto';
import pg from 'pg';
import { afterAll, afterEach, beforeAll, expect, inject } from 'vitest';
import { withDatabase } from './global-setup.js';
import { quietPool } from './quiet-pool.js';

// int8 as numbers, as the server sets it.
pg.types.setTypeParser(pg.types.builtins.INT8, (v) => Number(v));

export interface TestDb {
  /** The file's main pool (10 connections). */
  readonly pool: pg.Pool;
  readonly url: string;
  /** Another pool on the same database, closed with the rest after the file. */
  newPool(max: number): pg.Pool;
  /** Empties every table (between tests that need a clean slate). */
  truncate(): Promise<void>;
}

/** Gives the calling test file a database of its own, cloned from the migrated template. */
export function useTestDb(): TestDb {
  const name = `${inject('pgPrefix')}${randomBytes(6).toString('hex')}`;
  const url = withDatabase(inject('pgAdminUrl'), name);
  const pools: pg.Pool[] = [];
  let main: pg.Pool | undefined;

  const newPool = (max: number) => {
    const p = quietPool({ connectionString: url, max });
    pools.push(p);
    return p;
  };

  beforeAll(async () => {
    const admin = new pg.Client({ connectionString: inject('pgAdminUrl') });
    await admin.connect();
    await admin.query(`CREATE DATABASE ${name} TEMPLATE ${inject('pgTemplate')}`);
    await admin.end();
    main = newPool(10);
  });

  afterEach(() => {
    for (const p of pools) {
      const busy = p.totalCount - p.idleCount;
      expect(busy, 'a test left a database client checked out (missing release or unawaited query)').toBe(0);
    }
  });

  afterAll(async () => {
    await Promise.all(pools.map((p) => p.end()));
    const admin = new pg.Client({ connectionString: inject('pgAdminUrl') });
    await admin.connect();
    await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
    await admin.end();
  });

  return {
    get pool() {
      if (!main) throw new Error('useTestDb: the pool exists only inside tests (after beforeAll)');
      return main;
    },
    url,
    newPool,
    truncate: async () => {
      await main!.query('TRUNCATE jobs, job_keys, attempts, job_events, steps, stale_reports, webhook_events, webhook_deliveries, notify_headers, job_counts, ended_counts');
    },
  };
}
