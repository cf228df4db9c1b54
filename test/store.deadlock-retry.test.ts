/**
 * A statement run on the pool is a transaction of its own; when PostgreSQL ends it as the victim
 * of a deadlock (40P01) it was rolled back whole, and `run` (server/store/sql.ts) sends it once
 * more. Inside a transaction it does not: the caller's transaction is gone and the caller decides.
 *
 * The deadlock is real: another transaction holds row 2 and asks for row 1 while the statement
 * holds row 1 and asks for row 2. The statement's backend checks for deadlocks first (its
 * deadlock_timeout 100 ms against the other's 30 s), so it is the victim.
 */
import pg from 'pg';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { run, statement, StoreError, withTransaction } from '../server/store/sql.js';
import { useTestDb } from './helpers/db.js';
import { quietPool } from './helpers/quiet-pool.js';

const t = useTestDb();
let pool: pg.Pool;

// Locks row 1, then (after 1.5 s, by then the other transaction holds row 2) row 2. The pause
// is the test's window to take row 2 once it has seen the statement in it: at 300 ms a loaded
// machine could miss it, and the statement would take both rows with no deadlock. Counts its
// runs in dl_runs, a sequence: nextval is not rolled back with the victim's transaction.
const crossing = statement(
  'testDeadlockCrossing',
  `WITH first AS (UPDATE dl_rows SET v = v + 1 WHERE id = 1 RETURNING nextval('dl_runs') AS run),
        pause AS (SELECT pg_sleep(1.5), first.run FROM first),
        second AS (UPDATE dl_rows SET v = v + 1 WHERE id = 2 AND EXISTS (SELECT 1 FROM pause) RETURNING id)
   SELECT (SELECT run FROM pause) AS run, (SELECT count(*) FROM second)::int AS second`,
);

beforeAll(async () => {
  await t.pool.query('CREATE TABLE dl_rows (id int PRIMARY KEY, v int NOT NULL)');
  await t.pool.query('CREATE SEQUENCE dl_runs');
  pool = quietPool({ connectionString: t.url, max: 2, options: '-c deadlock_timeout=100ms' });
});
afterAll(async () => {
  await pool.end();
});

/** Starts `stmt` on `db`, and meanwhile a transaction that takes row 2 and then row 1. */
async function cross(db: pg.Pool | pg.PoolClient) {
  await t.pool.query('TRUNCATE dl_rows; INSERT INTO dl_rows VALUES (1, 0), (2, 0)');
  const other = await t.pool.connect();
  try {
    await other.query(`BEGIN; SET LOCAL deadlock_timeout = '30s'`);
    const statementRun = run<{ run: number; second: number }>(db, crossing, []).then(
      (rows) => ({ rows }),
      (err: unknown) => ({ err }),
    );
    // Row 1 is the statement's once it is in its pause; then this takes row 2 and waits for row 1.
    await waitFor(async () => (await t.pool.query(`SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event = 'PgSleep'`)).rowCount === 1);
    await other.query('UPDATE dl_rows SET v = v + 10 WHERE id = 2');
    await other.query('UPDATE dl_rows SET v = v + 10 WHERE id = 1');
    await other.query('COMMIT');
    return await statementRun;
  } finally {
    other.release();
  }
}

async function waitFor(cond: () => Promise<boolean>) {
  for (let i = 0; i < 200; i++) {
    if (await cond()) return;
    await new Promise((r) => setTimeout(r, 10));
  }
  throw new Error('the statement never reached its pause');
}

const deadlocks = async () => Number((await t.pool.query(`SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()`)).rows[0].deadlocks);

it('on the pool, a deadlock victim runs once more and its caller gets the rows', async () => {
  const before = await deadlocks();
  const out = await cross(pool);
  expect(out).toEqual({ rows: [{ run: 2, second: 1 }] });
  // The statement's second run and the other transaction's both updated both rows.
  const rows = (await t.pool.query('SELECT id, v FROM dl_rows ORDER BY id')).rows;
  expect(rows).toEqual([{ id: 1, v: 11 }, { id: 2, v: 11 }]);
  // pg_stat_database is updated by the stats collector after the victim's backend reports: poll.
  await waitFor(async () => (await deadlocks()) === before + 1);
});

it('inside a transaction, a deadlock is the caller\'s: a StoreError with 40P01 as its cause, run once', async () => {
  await t.pool.query(`SELECT setval('dl_runs', 1, false)`);
  const out = await withTransaction(pool, async (tx) => cross(tx as pg.PoolClient)).catch((err: unknown) => ({ thrown: err }));
  // cross() hands back the statement's error; COMMIT then ends the aborted transaction (PostgreSQL
  // answers it with ROLLBACK).
  expect('err' in out ? out.err : undefined).toBeInstanceOf(StoreError);
  const err = (out as { err: StoreError }).err;
  expect((err.cause as { code?: string }).code).toBe('40P01');
  expect(Number((await t.pool.query(`SELECT last_value FROM dl_runs`)).rows[0].last_value)).toBe(1);
  expect((await t.pool.query('SELECT id, v FROM dl_rows ORDER BY id')).rows).toEqual([{ id: 1, v: 10 }, { id: 2, v: 10 }]);
});
