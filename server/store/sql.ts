/**
 * How store verbs talk to PostgreSQL: a `Queryable` (a pool, or a client inside a transaction),
 * named prepared statements for the hot path, and `withTransaction`.
 */
import pg from 'pg';
import { queryShaped } from './shaped-query.js';

/** A pool or a checked-out client: every store verb takes one as its first argument. */
export type Queryable = pg.Pool | pg.PoolClient | pg.Client;

/** A statement with a stable name: PostgreSQL parses and plans it once per connection. */
export interface Statement {
  readonly name: string;
  readonly text: string;
}

/** Declares a named statement. Names are unique across the store (checked at module load). */
export function statement(name: string, text: string): Statement {
  if (statementNames.has(name)) throw new Error(`duplicate statement name ${name}`);
  statementNames.add(name);
  return { name, text };
}
const statementNames = new Set<string>();

/**
 * Runs a named statement and returns its rows. After its first execution on a connection it is
 * sent without a Describe, its rows read as that one described them (shaped-query.ts).
 */
export async function run<R extends pg.QueryResultRow>(
  db: Queryable,
  stmt: Statement,
  values: unknown[],
): Promise<R[]> {
  try {
    return await queryShaped<R>(db, stmt.name, stmt.text, values);
  } catch (err) {
    // On the pool a statement is a transaction of its own, rolled back whole when PostgreSQL ends
    // it as the victim of a deadlock: it runs once more, as if for the first time. Seen once in a
    // benchmark drain: a lease renewal against a transition locking some of the same jobs_live
    // rows in another order (batch.ts, `batchFence`; the renewal now skips rows others hold, so it
    // no longer waits for any). Inside a transaction the caller decides.
    if (db instanceof pg.Pool && isDeadlock(err)) {
      try {
        return await queryShaped<R>(db, stmt.name, stmt.text, values);
      } catch (again) {
        err = again;
      }
    }
    throw new StoreError(`${stmt.name} failed: ${(err as Error).message}`, { cause: err });
  }
}

/** Whether pg gave up waiting for an answer (its `query_timeout`), here or as a StoreError's cause. */
function isReadTimeout(err: unknown): boolean {
  for (let e = err as { message?: unknown; cause?: unknown } | undefined; e; e = e.cause as typeof e) {
    if (e.message === 'Query read timeout') return true;
  }
  return false;
}

/** Whether pg's error is PostgreSQL's deadlock (SQLSTATE 40P01): its transaction was rolled back whole. */
function isDeadlock(err: unknown): boolean {
  return (err as { code?: unknown } | undefined)?.code === '40P01';
}

/** An infrastructure failure inside a store verb (connection lost, constraint broken): never an outcome. */
export class StoreError extends Error {
  override readonly name = 'StoreError';
}

/**
 * Runs `fn` in one transaction, committing on return and rolling back on throw. Given a pool it
 * checks out a client; given a client already inside `withTransaction` it joins that
 * transaction, so verbs compose.
 */
export async function withTransaction<T>(
  db: Queryable,
  fn: (tx: pg.PoolClient | pg.Client) => Promise<T>,
  opts: {
    mode?: 'REPEATABLE READ, READ ONLY';
    /**
     * `SET LOCAL` statements sent with the `BEGIN`, in its round trip (a transaction joined, not
     * begun, runs without them).
     */
    local?: 'SET LOCAL plan_cache_mode = force_generic_plan';
  } = {},
): Promise<T> {
  if (!(db instanceof pg.Pool) && inTransaction.has(db)) return fn(db);
  const client = db instanceof pg.Pool ? await db.connect() : db;
  inTransaction.add(client);
  // A statement whose answer never came (pg's query_timeout, the hot pool's) leaves the connection
  // waiting for it: such a client goes back to the pool as broken, to be closed, not reused.
  let broken: Error | undefined;
  try {
    await client.query(`${opts.mode ? `BEGIN ISOLATION LEVEL ${opts.mode}` : 'BEGIN'}${opts.local ? `; ${opts.local}` : ''}`);
    const out = await fn(client);
    await client.query('COMMIT');
    return out;
  } catch (err) {
    if (isReadTimeout(err)) broken = err as Error;
    else await client.query('ROLLBACK').catch(() => undefined);
    throw err;
  } finally {
    inTransaction.delete(client);
    if (db instanceof pg.Pool) (client as pg.PoolClient).release(broken);
  }
}
const inTransaction = new WeakSet<pg.PoolClient | pg.Client>();
