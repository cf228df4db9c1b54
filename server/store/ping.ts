/** The database answering: a liveness probe (for `/healthz`) and its clock. */
import { run, statement, type Queryable } from './sql.js';

const pingSql = statement('databasePing', `SELECT current_setting('transaction_read_only') = 'on' AS read_only`);

/**
 * Resolves when the database answers and takes writes; throws otherwise. A server that answers
 * read-only (a standby after a failover, `default_transaction_read_only`) cannot take a single
 * transition, so it is not healthy for a coordinator.
 */
export async function databasePing(db: Queryable): Promise<void> {
  const [r] = await run<{ read_only: boolean }>(db, pingSql, []);
  if (r?.read_only) throw new Error('the database is read-only (a standby, or default_transaction_read_only is on): no transition can be written');
}

const nowSql = statement('dbNow', `SELECT now() AS now`);

/** The database's clock (the one every lease and timestamp is on). */
export async function dbNow(db: Queryable): Promise<Date> {
  const [r] = await run<{ now: Date }>(db, nowSql, []);
  return r!.now;
}
