/** The database answering: a liveness probe (for `/healthz`) and its clock. */
import { run, statement, type Queryable } from './sql.js';

const pingSql = statement('databasePing', 'SELECT 1 AS ok');

/** Resolves when the database answers a trivial query; throws otherwise. */
export async function databasePing(db: Queryable): Promise<void> {
  await run(db, pingSql, []);
}

const nowSql = statement('dbNow', `SELECT now() AS now`);

/** The database's clock (the one every lease and timestamp is on). */
export async function dbNow(db: Queryable): Promise<Date> {
  const [r] = await run<{ now: Date }>(db, nowSql, []);
  return r!.now;
}
