/** LogSummary (server/lib/log-summary.ts): the first event of a window whole, the rest one line with a count. */
import pino from 'pino';
import { afterEach, expect, it, vi } from 'vitest';
import { LogSummary } from '../server/lib/log-summary.js';

afterEach(() => {
  vi.useRealTimers();
});

it('logs the first event at once, counts the rest into one line when the window ends, then starts afresh', () => {
  vi.useFakeTimers();
  const lines: Array<Record<string, unknown>> = [];
  const log = pino({ level: 'info' }, { write: (l: string) => void lines.push(JSON.parse(l) as Record<string, unknown>) });
  const s = new LogSummary(log, 'warn', 'agent refused', 60_000);
  for (let i = 0; i < 1000; i++) s.note({ agentId: `a${i}` });
  expect(lines.map((l) => [l.msg, l.agentId])).toEqual([['agent refused', 'a0']]);
  vi.advanceTimersByTime(60_000);
  expect(lines.slice(1).map((l) => [l.level, l.msg, l.agentId, l.more])).toEqual([
    [40, 'agent refused (999 more like it in the last 60 s; the last of them shown)', 'a999', 999],
  ]);
  // A quiet window says nothing; the next event is logged whole again.
  vi.advanceTimersByTime(120_000);
  s.note({ agentId: 'b' });
  expect(lines.slice(2).map((l) => [l.msg, l.agentId])).toEqual([['agent refused', 'b']]);
});
