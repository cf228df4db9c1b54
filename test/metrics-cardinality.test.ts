/**
 * The `queue` label is bounded: a caller that enqueues into ever new queue names (any key with
 * the enqueue scope can) must not grow /metrics without end. The first 200 distinct queues a
 * coordinator meets keep their names in every metric; later ones are counted under
 * `queue="_other"`, so nothing is lost from the totals. Checked on the counters and the latency
 * histogram (fed by the services' events, as the coordinator feeds them) and on the job gauges
 * read from the database. Before the fix, 2,000 queue names made 2,000 series in each (3 MB).
 */
import { EventEmitter } from 'node:events';
import pino from 'pino';
import { afterEach, describe, expect, it } from 'vitest';
import { jobEnqueue } from '../server/store/index.js';
import { createMetrics, type Metrics } from '../server/transport/metrics.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();
const open: Metrics[] = [];
afterEach(() => {
  for (const m of open.splice(0)) m.close();
});

const log = pino({ level: 'silent' });
/** What the metrics read of the hub: its events and its (no) open streams. */
const fakeHub = () => Object.assign(new EventEmitter(), { sessions: new Set() });
const MAX = 200;

/** The samples of `name` in the exposition text: labels and value. */
function samples(text: string, name: string): Array<{ labels: Record<string, string>; value: number }> {
  const out: Array<{ labels: Record<string, string>; value: number }> = [];
  for (const line of text.split('\n')) {
    const m = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$/.exec(line);
    if (!m || m[1] !== name) continue;
    const labels: Record<string, string> = {};
    for (const l of (m[2] ?? '').matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]!] = l[2]!;
    out.push({ labels, value: Number(m[3]) });
  }
  return out;
}
const queues = (s: ReturnType<typeof samples>) => new Set(s.map((x) => x.labels.queue));
const total = (s: ReturnType<typeof samples>) => s.reduce((a, x) => a + x.value, 0);
const summary = (queue: string, status = 'succeeded') => ({
  outcome: 'ok' as const,
  value: { id: 'x', queue, status, attemptNo: 1, runAt: new Date(Date.now() - 50), updatedAt: new Date() },
});

describe('queue label cap', () => {
  it('counts the jobs of queues past the first 200 under queue="_other" in the counters and the latency histogram', async () => {
    const hub = fakeHub();
    const activity = new EventEmitter();
    const reaper = new EventEmitter();
    const metrics = createMetrics({ db: t.pool, hub: hub as never, activity: activity as never, reaper: reaper as never, log });
    open.push(metrics);
    const N = 2000;
    const names = Array.from({ length: N }, (_, i) => `card-${i}`);
    for (const q of names) {
      activity.emit('job:enqueued', { queue: q });
      hub.emit('attempt:start', { attemptId: 'a', agentId: 'g', outcome: summary(q, 'running') });
      activity.emit('attempt:report', { kind: 'completed', attemptId: 'a', agentId: 'g', outcome: summary(q) });
      activity.emit('job:canceled', { queue: q });
      activity.emit('job:requeued', { queue: q });
      reaper.emit('reaper:run', { rescued: [{ reason: 'lease_expired', status: 'dead', queue: q }] });
    }
    // A queue named before the cap filled keeps its name afterwards.
    activity.emit('job:enqueued', { queue: 'card-0' });

    const { body } = await metrics.render();
    const enq = samples(body, 'leasehold_jobs_enqueued_total');
    expect(queues(enq).size).toBe(MAX + 1);
    expect(enq.find((x) => x.labels.queue === '_other')?.value).toBe(N - MAX);
    expect(enq.find((x) => x.labels.queue === 'card-0')?.value).toBe(2);
    expect(enq.find((x) => x.labels.queue === `card-${MAX - 1}`)?.value).toBe(1);
    expect(enq.find((x) => x.labels.queue === `card-${MAX}`)).toBeUndefined();
    expect(total(enq)).toBe(N + 1);

    const outcomes = samples(body, 'leasehold_job_outcomes_total');
    expect(queues(outcomes).size).toBe(MAX + 1);
    for (const outcome of ['succeeded', 'canceled', 'requeued', 'dead']) {
      const of = outcomes.filter((x) => x.labels.outcome === outcome);
      expect(of.find((x) => x.labels.queue === '_other')?.value, outcome).toBe(N - MAX);
      expect(total(of), outcome).toBe(N);
    }

    const latency = samples(body, 'leasehold_job_start_latency_seconds_count');
    expect(queues(latency).size).toBe(MAX + 1);
    expect(latency.find((x) => x.labels.queue === '_other')?.value).toBe(N - MAX);
    expect(queues(samples(body, 'leasehold_job_start_latency_seconds_bucket')).size).toBe(MAX + 1);
    // 2,000 queues made 3 MB of text before; now about 0.3 MB however many queues there are.
    expect(body.length).toBeLessThan(400_000);
  });

  it('sums the job gauges read from the database of queues past the first 200 under queue="_other"', async () => {
    const N = 230;
    for (let i = 0; i < N; i++) {
      const o = await jobEnqueue(t.pool, { queue: `gauge-${String(i).padStart(3, '0')}`, payload: {} });
      if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
    }
    const metrics = createMetrics({ db: t.pool, hub: fakeHub() as never, log });
    open.push(metrics);
    const { body } = await metrics.render();
    const jobs = samples(body, 'leasehold_jobs').filter((x) => x.labels.queue?.startsWith('gauge-') || x.labels.queue === '_other');
    expect(queues(jobs).size).toBe(MAX + 1);
    expect(total(jobs.filter((x) => x.labels.status === 'queued'))).toBe(N);
    expect(jobs.find((x) => x.labels.queue === '_other' && x.labels.status === 'queued')?.value).toBe(N - MAX);
    const due = samples(body, 'leasehold_queue_due_jobs');
    expect(queues(due).size).toBe(MAX + 1);
    expect(total(due)).toBe(N);
    const oldest = samples(body, 'leasehold_queue_oldest_age_seconds');
    expect(queues(oldest).size).toBe(MAX + 1);
    expect(oldest.find((x) => x.labels.queue === '_other')).toBeDefined();
  });
});
