import pg from 'pg';

/**
 * A pool whose connections PostgreSQL may end without its error being thrown: a test that kills
 * backends on purpose, a `DROP DATABASE … WITH (FORCE)` or a stopped server. Also right after its
 * own `end()`, which resolves before the sockets close (pg-pool's): an idle connection's 57P01 then
 * goes to the pool, and with no listener Node throws it and the test file's worker dies.
 */
export function quietPool(config: pg.PoolConfig): pg.Pool {
  const p = new pg.Pool(config);
  p.on('error', () => undefined);
  return p;
}
