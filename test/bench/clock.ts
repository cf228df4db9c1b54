/**
 * The clock of latency figures: CLOCK_MONOTONIC in milliseconds with sub-microsecond digits.
 * Linux keeps one such clock for the whole machine, so a time read in the benchmark process and
 * one read in a worker process subtract directly, as `Date.now()` does; but `Date.now()` counts
 * whole milliseconds, too coarse for latencies of 1–5 ms (until 2e52ce0 a job of 1.0 and one of
 * 1.9 ms both read as 1 ms, and a ratio of two p95 could be off by half), and it jumps when the
 * wall clock is set. `performance.now()` has the resolution but starts at each process's own
 * origin.
 */
export const clockMs = (): number => Number(process.hrtime.bigint()) / 1e6;
