/**
 * The backoff between retries, in SQL: a failed attempt's retry (fail.ts), a timed-out attempt's
 * (rescue.ts) and a webhook delivery's (deliveries.ts).
 */

/** Exponential backoff with jitter for retries: `min(base·2^(n−1), max) × [0.5, 1)`. */
export interface Backoff {
  baseMs: number;
  maxMs: number;
}
export const DEFAULT_BACKOFF: Backoff = { baseMs: 1000, maxMs: 3_600_000 };

/** The SQL of the backoff delay after `started` started attempts, with params for base and max. */
export const backoffSql = (started: string, base: string, max: string) =>
  `make_interval(secs => least(${base}::float8 * power(2, greatest(${started}, 1) - 1), ${max}::float8)
     * (0.5 + random() * 0.5) / 1000.0)`;
