/**
 * The chaos run's effect sink, fencing by attempt number: an apply from an attempt older than one
 * that asked about or applied the key is refused and kept with how long it took to arrive.
 */
import { afterEach, expect, it } from 'vitest';
import { mono, startSink, type Sink } from './helpers/sink.js';

let sink: Sink | undefined;
afterEach(async () => {
  await sink?.close();
});
const apply = async (s: Sink, body: Record<string, unknown>) => {
  const res = await fetch(`${s.url}/apply`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
  return res.status;
};

it('refuses an apply from an attempt older than one that asked or applied, and says how late it was', async () => {
  sink = await startSink(undefined, { fence: true });
  const s = sink;
  expect(await apply(s, { key: 'j:a', value: 1, attemptNo: 1, mono: mono() })).toBe(200);
  // Attempt 2 asks (the step's outcome is unknown to it): it was applied.
  expect(await (await fetch(`${s.url}/status?key=j:a&attemptNo=2`)).json()).toMatchObject({ applied: true });
  // Attempt 1's request, begun 1.5 s ago (frozen on its way), is refused.
  expect(await apply(s, { key: 'j:a', value: 1, attemptNo: 1, mono: mono() - 1500, leaseLeftMs: 1200 })).toBe(409);
  expect(s.applies.get('j:a')).toBe(1);
  expect(s.late).toEqual([{ key: 'j:a', attemptId: undefined, attemptNo: 1, newest: 2, delayMs: expect.any(Number), leaseLeftMs: 1200, at: expect.any(Number), wall: expect.any(Number) }]);
  expect(s.late[0]!.delayMs).toBeGreaterThanOrEqual(1500);
  // The newest attempt, and a later one, still apply (a second apply is the caller's duplicate to count).
  expect(await apply(s, { key: 'j:b', value: 2, attemptNo: 3, mono: mono() })).toBe(200);
  expect(await apply(s, { key: 'j:b', value: 2, attemptNo: 3, mono: mono() })).toBe(200);
  expect(s.applies.get('j:b')).toBe(2);
});

it('without fence, counts every apply whatever its attempt', async () => {
  sink = await startSink();
  const s = sink;
  await fetch(`${s.url}/status?key=j:c&attemptNo=5`);
  expect(await apply(s, { key: 'j:c', value: 1, attemptNo: 1, mono: mono() })).toBe(200);
  expect(s.applies.get('j:c')).toBe(1);
  expect(s.late).toEqual([]);
});
