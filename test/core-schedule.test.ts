/**
 * `Schedule`, the timer every maintenance service runs on, alone and on fake timers: the first
 * run one interval after `start()`, runs chained (never two at once), the jitter's bounds, a
 * failed run reported and followed by the next, `runOnce()` joining the run in progress, and
 * `stop()` waiting for it.
 */
import { afterEach, beforeEach, expect, it, vi } from 'vitest';
import { Schedule } from '../server/core/schedule.js';
import { deferred } from './helpers/deferred.js';


beforeEach(() => {
  vi.useFakeTimers();
});

afterEach(() => {
  vi.useRealTimers();
  vi.restoreAllMocks();
});

it('runs one interval after start, and the next one interval after the previous run ended, never overlapping', async () => {
  const runs: Array<ReturnType<typeof deferred<number>>> = [];
  const s = new Schedule({ intervalMs: 1000, jitter: 0, onError: () => undefined }, () => {
    const d = deferred<number>();
    runs.push(d);
    return d.promise;
  });
  expect(s.scheduled).toBe(false);
  s.start();
  expect(s.scheduled).toBe(true);
  await vi.advanceTimersByTimeAsync(999);
  expect(runs).toHaveLength(0);
  await vi.advanceTimersByTimeAsync(1);
  expect(runs).toHaveLength(1);
  // The run takes ten intervals: no second run starts meanwhile.
  await vi.advanceTimersByTimeAsync(10_000);
  expect(runs).toHaveLength(1);
  runs[0]!.resolve(1);
  await vi.advanceTimersByTimeAsync(999);
  expect(runs).toHaveLength(1);
  await vi.advanceTimersByTimeAsync(1);
  expect(runs).toHaveLength(2);
  runs[1]!.resolve(2);
  await s.stop();
});

it('start twice schedules one run; stop ends the schedule and waits for the run in progress; stop twice is harmless', async () => {
  let calls = 0;
  const d = deferred<string>();
  const s = new Schedule({ intervalMs: 100, jitter: 0, onError: () => undefined }, () => {
    calls++;
    return d.promise;
  });
  s.start();
  s.start();
  await vi.advanceTimersByTimeAsync(100);
  expect(calls).toBe(1);
  let stopped = false;
  const stopping = s.stop().then(() => (stopped = true));
  await vi.advanceTimersByTimeAsync(0);
  expect(stopped).toBe(false);
  expect(s.scheduled).toBe(false);
  d.resolve('done');
  await stopping;
  expect(stopped).toBe(true);
  await vi.advanceTimersByTimeAsync(1000);
  expect(calls).toBe(1);
  expect(s.scheduled).toBe(false);
  await s.stop();
});

it('reports a failed run to onError and still schedules the next', async () => {
  const errors: Error[] = [];
  let calls = 0;
  const s = new Schedule({ intervalMs: 50, jitter: 0, onError: (e) => errors.push(e) }, async () => {
    calls++;
    if (calls === 1) throw new Error('first run broke');
    return calls;
  });
  s.start();
  await vi.advanceTimersByTimeAsync(50);
  expect(errors.map((e) => e.message)).toEqual(['first run broke']);
  await vi.advanceTimersByTimeAsync(50);
  expect(calls).toBe(2);
  expect(errors).toHaveLength(1);
  await s.stop();
});

it('runOnce joins the run in progress (scheduled or asked for) instead of starting another', async () => {
  let calls = 0;
  const d = deferred<number>();
  const s = new Schedule({ intervalMs: 100, jitter: 0, onError: () => undefined }, () => {
    calls++;
    return d.promise;
  });
  s.start();
  await vi.advanceTimersByTimeAsync(100);
  const joined = s.runOnce();
  const other = s.runOnce(async () => -1);
  expect(calls).toBe(1);
  d.resolve(7);
  expect(await joined).toBe(7);
  expect(await other).toBe(7);
  // Nothing in progress: runOnce runs now, with the work it is given.
  expect(await s.runOnce(async () => 42)).toBe(42);
  expect(calls).toBe(1);
  await s.stop();
});

it('waits between (1 − jitter) and (1 + jitter) intervals', async () => {
  let calls = 0;
  const work = async () => ++calls;
  // The smallest draw: 800 ms for 1000 ± 20 %.
  vi.spyOn(Math, 'random').mockReturnValue(0);
  const early = new Schedule({ intervalMs: 1000, jitter: 0.2, onError: () => undefined }, work);
  early.start();
  await vi.advanceTimersByTimeAsync(799);
  expect(calls).toBe(0);
  await vi.advanceTimersByTimeAsync(1);
  expect(calls).toBe(1);
  await early.stop();
  // A draw of 0.75 of the way: 1100 ms (the largest draw comes just short of 1200).
  vi.spyOn(Math, 'random').mockReturnValue(0.75);
  const late = new Schedule({ intervalMs: 1000, jitter: 0.2, onError: () => undefined }, work);
  late.start();
  await vi.advanceTimersByTimeAsync(1099);
  expect(calls).toBe(1);
  await vi.advanceTimersByTimeAsync(1);
  expect(calls).toBe(2);
  await late.stop();
});
