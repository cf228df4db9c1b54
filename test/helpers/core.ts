/**
 * For tests that run a part of `server/core/` alone: a pool whose statements the test can see,
 * hold or break (store statements carry their name), and what a session was sent.
 */
import type pg from 'pg';
import type { AgentOutput, Session } from '../../server/core/session.js';

/**
 * `pool` seen through a proxy whose `query(q)` is `around(q, () => pool.query(q))`; everything
 * else is the pool's own (so `instanceof pg.Pool` still holds, as the store's retry needs).
 */
export function interceptPool(pool: pg.Pool, around: (q: pg.QueryConfig, run: () => Promise<pg.QueryResult>) => Promise<pg.QueryResult>): pg.Pool {
  return new Proxy(pool, {
    get(target, prop) {
      if (prop !== 'query') {
        const v: unknown = Reflect.get(target, prop, target);
        return typeof v === 'function' ? v.bind(target) : v;
      }
      return (q: pg.QueryConfig) => around(q, () => target.query(q));
    },
  });
}

/** Everything sent to `s` so far, in order; ends its channel (call it once the part is done). */
export async function sentTo(s: Session): Promise<AgentOutput[]> {
  s.out.close();
  const out: AgentOutput[] = [];
  for await (const m of s.out) out.push(m);
  return out;
}
