/**
 * The default process metrics must not keep an idle coordinator busy: prom-client samples the
 * event loop's delay with a timer of its own (`monitorEventLoopDelay`), every 10 ms unless told
 * otherwise, and on these machines each wake-up of an idle Node process costs about 0.1 ms of CPU
 * (docs/performance.md, "An idle coordinator"). The coordinator asks for a sample every 100 ms.
 */
import { EventEmitter } from 'node:events';
import perfHooks from 'node:perf_hooks';
import pino from 'pino';
import { afterEach, expect, it, vi } from 'vitest';
import { createMetrics } from '../server/transport/metrics.js';

afterEach(() => vi.restoreAllMocks());

it('samples the event loop delay every 100 ms, not every 10 ms', () => {
  const monitor = vi.spyOn(perfHooks, 'monitorEventLoopDelay');
  const metrics = createMetrics({ db: {} as never, hub: new EventEmitter() as never, log: pino({ level: 'silent' }) });
  try {
    expect(monitor).toHaveBeenCalledTimes(1);
    expect(monitor).toHaveBeenCalledWith({ resolution: 100 });
  } finally {
    metrics.close();
  }
});
