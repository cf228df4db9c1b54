/** A liveness probe of the database, for `/healthz`. */
import { run, statement, type Queryable } from './sql.js';

const pingSql = statement('databasePing', 'SELECT 1 AS ok');

/** Resolves when the database answers a trivial query; throws otherwise. */
export async function databasePing(db: Queryable): Promise<void> {
  await run(db, pingSql, []);
}
