/**
 * Prometheus metrics (prom-client), served at GET /metrics on the HTTP listener. Counters and
 * the latency histogram count what this process did, from the events the services already emit
 * (hub, dispatcher, reaper, deliverer, purger, and the unary routes' `Activity`); nothing is
 * counted on a hot path but an increment. Gauges of jobs by state and queue are read from the
 * database when scraped (cached for a second, so several scrapers cost one read): they are the
 * same on every replica (aggregate them with max, not sum). Connected agents and streams are
 * this process's. The default process metrics (CPU, memory, event loop lag, GC) come with them.
 *
 * Queue names come from callers (a key with the enqueue scope names any queue it likes), so the
 * `queue` label is bounded: the first `MAX_QUEUE_LABELS` distinct queues this process meets keep
 * their name in every metric, and the jobs of any later queue are counted under
 * `queue="_other"` (no queue can be named so: names start with a letter or a digit).
 */
import type { EventEmitter } from 'node:events';
import { collectDefaultMetrics, Counter, Gauge, Histogram, Registry } from 'prom-client';
import type { Activity } from '../core/activity.js';
import type { AgentHub, HubEvents } from '../core/agent-hub.js';
import type { CredentialCache } from '../core/credential-cache.js';
import type { Dispatcher } from '../core/dispatcher.js';
import type { Purger } from '../core/purger.js';
import type { Vacuumer } from '../core/vacuumer.js';
import type { Reaper } from '../core/reaper.js';
import type { WebhookDeliverer } from '../core/webhook-deliverer.js';
import type { Logger } from '../log.js';
import { jobDepths, type Queryable } from '../store/index.js';

/** The services whose events are counted. */
export interface MetricsSources {
  db: Queryable;
  hub: AgentHub;
  dispatcher?: Dispatcher | undefined;
  reaper?: Reaper | undefined;
  deliverer?: WebhookDeliverer | undefined;
  purger?: Purger | undefined;
  vacuumer?: Vacuumer | undefined;
  activity?: Activity | undefined;
  /** The credential cache, for its counts. */
  credentials?: Pick<CredentialCache<unknown>, 'stats' | 'size'> | undefined;
  /** Distinct queue names kept as `queue` label values; default `MAX_QUEUE_LABELS`. */
  maxQueueLabels?: number | undefined;
  log: Logger;
}

export interface Metrics {
  readonly registry: Registry;
  /** The exposition text of every metric (reads the database for the job gauges). */
  render(): Promise<{ contentType: string; body: string }>;
  /** Unsubscribes from every service. */
  close(): void;
  /** A key refused on `listener`: checked and refused (`key`), or refused unchecked, its address past its bound (`limited`; key-gate.ts). */
  authRefused(listener: 'http' | 'grpc', reason: 'key' | 'limited'): void;
}

/** Enqueue-to-start latency buckets, in seconds: from a few ms (an idle agent) to an hour (a backlog). */
const LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600];

/** The distinct queues whose names the metrics keep as `queue` labels (per process). */
export const MAX_QUEUE_LABELS = 200;
/** The `queue` label of the queues past those: no queue's name (names start with a letter or digit). */
export const OTHER_QUEUE = '_other';

/**
 * The `queue` label of a queue: its name for the first `max` distinct queues met (in any metric,
 * so a queue is named alike in all of them), `OTHER_QUEUE` for every later one. A Set lookup;
 * the set never holds more than `max` names.
 */
function queueLabels(max: number): (queue: string) => string {
  const named = new Set<string>();
  return (queue) => {
    if (named.has(queue)) return queue;
    if (named.size >= max) return OTHER_QUEUE;
    named.add(queue);
    return queue;
  };
}

/**
 * A labelled metric's child for some label values, made once and kept: given the labels as an
 * object on every call, prom-client checks and hashes them each time (several per job). The
 * children are as many as the series prom-client keeps anyway.
 */
function children<T>(make: (...values: string[]) => T): (...values: string[]) => T {
  const made = new Map<string, T>();
  return (...values) => {
    const key = values.join('\u0000');
    let c = made.get(key);
    if (c === undefined) made.set(key, (c = make(...values)));
    return c;
  };
}

/** Creates a registry fed by `src`'s events. */
export function createMetrics(src: MetricsSources): Metrics {
  const registry = new Registry();
  // The event loop's delay is sampled by a timer of its own: every 100 ms, not prom-client's 10,
  // which woke an idle coordinator a hundred times a second (docs/performance.md, "An idle
  // coordinator"). A percentile of a scrape interval's samples loses nothing that matters.
  collectDefaultMetrics({ register: registry, eventLoopMonitoringPrecision: 100 });
  const r = [registry];
  const queueOf = queueLabels(src.maxQueueLabels ?? MAX_QUEUE_LABELS);
  const offs: Array<() => void> = [];
  /** Subscribes `fn` to `event` of `emitter` (when there is one) until `close()`. */
  const on = (emitter: EventEmitter<any> | undefined, event: string, fn: (...args: any[]) => void) => {
    if (!emitter) return;
    emitter.on(event, fn);
    offs.push(() => emitter.off(event, fn));
  };

  // ── from the database, on scrape ──
  let cached: { at: number; value: Promise<Awaited<ReturnType<typeof jobDepths>> | undefined> } | undefined;
  const collectErrors = new Counter({ name: 'leasehold_metrics_collect_errors_total', help: 'Scrapes whose job gauges could not be read from the database.', registers: r });
  const depths = () => {
    if (!cached || performance.now() - cached.at > 1000) {
      cached = {
        at: performance.now(),
        value: jobDepths(src.db).catch((err: unknown) => {
          collectErrors.inc();
          src.log.warn({ err }, 'metrics: could not read job counts');
          return undefined;
        }),
      };
    }
    return cached.value;
  };
  new Gauge({
    name: 'leasehold_jobs',
    help: 'Jobs by queue and status (from the database; the same on every replica).',
    labelNames: ['queue', 'status'],
    registers: r,
    async collect() {
      const d = await depths();
      this.reset();
      // Queues past the label cap are summed under `_other`.
      const sums = new Map<string, { queue: string; status: string; count: number }>();
      for (const x of d?.depths ?? []) {
        const queue = queueOf(x.queue);
        const k = `${queue}\u0000${x.status}`;
        const e = sums.get(k);
        if (e) e.count += x.count;
        else sums.set(k, { queue, status: x.status, count: x.count });
      }
      for (const e of sums.values()) this.set({ queue: e.queue, status: e.status }, e.count);
    },
  });
  new Gauge({
    name: 'leasehold_queue_due_jobs',
    help: 'Queued jobs that are due (run_at passed) and wait for an agent, by queue.',
    labelNames: ['queue'],
    registers: r,
    async collect() {
      const d = await depths();
      this.reset();
      const due = new Map<string, number>();
      for (const w of d?.waiting ?? []) {
        const queue = queueOf(w.queue);
        due.set(queue, (due.get(queue) ?? 0) + w.due);
      }
      for (const [queue, n] of due) this.set({ queue }, n);
    },
  });
  new Gauge({
    name: 'leasehold_queue_oldest_age_seconds',
    help: 'How long the oldest due queued job of each queue has waited (since its run_at).',
    labelNames: ['queue'],
    registers: r,
    async collect() {
      const d = await depths();
      this.reset();
      const oldest = new Map<string, number>();
      for (const w of d?.waiting ?? []) {
        const queue = queueOf(w.queue);
        oldest.set(queue, Math.max(oldest.get(queue) ?? 0, w.oldestAgeMs));
      }
      for (const [queue, ms] of oldest) this.set({ queue }, ms / 1000);
    },
  });

  // ── this process's agents ──
  new Gauge({
    name: 'leasehold_agent_streams',
    help: 'Agent streams open on this coordinator.',
    registers: r,
    collect() {
      this.set(src.hub.sessions.size);
    },
  });
  new Gauge({
    name: 'leasehold_agents_connected',
    help: 'Distinct agents with a stream open on this coordinator.',
    registers: r,
    collect() {
      this.set(new Set([...src.hub.sessions].map((s) => s.agentId)).size);
    },
  });
  new Gauge({
    name: 'leasehold_agent_slots',
    help: 'Slots of the agent streams on this coordinator, and how many hold an attempt.',
    labelNames: ['state'],
    registers: r,
    collect() {
      let slots = 0;
      let held = 0;
      for (const s of src.hub.sessions) {
        slots += s.slots;
        held += s.held.size;
      }
      this.set({ state: 'total' }, slots);
      this.set({ state: 'held' }, held);
    },
  });
  const sessions = new Counter({ name: 'leasehold_agent_sessions_total', help: 'Agent streams opened and closed (lost: without Bye, or with work held).', labelNames: ['event'], registers: r });
  on(src.hub, 'session:open', () => sessions.inc({ event: 'opened' }));
  on(src.hub, 'session:close', (_s: unknown, why: { lost: boolean }) => sessions.inc({ event: why.lost ? 'lost' : 'closed' }));

  // ── authentication ──
  const creds = src.credentials;
  if (creds) {
    new Counter({
      name: 'leasehold_auth_lookups_total',
      help: 'Unary calls authenticated: hit (from the credential cache), miss (verified in the database, then kept if valid; or not in the cache and refused unchecked, see leasehold_auth_refused_total), bypassed (cache off, or the listener down).',
      labelNames: ['result'],
      registers: r,
      collect() {
        this.reset();
        this.inc({ result: 'hit' }, creds.stats.hits);
        this.inc({ result: 'miss' }, creds.stats.misses);
        this.inc({ result: 'bypassed' }, creds.stats.bypassed);
      },
    });
    new Gauge({
      name: 'leasehold_auth_cache_entries',
      help: 'Verified credentials this coordinator holds in memory.',
      registers: r,
      collect() {
        this.set(creds.size);
      },
    });
  }

  const refusedKeys = new Counter({
    name: 'leasehold_auth_refused_total',
    help: 'Keys refused, by listener (http, grpc) and reason: key (checked in the database: unknown or revoked), limited (not checked: too many refused keys from the address).',
    labelNames: ['listener', 'reason'],
    registers: r,
  });

  // ── claims, starts, reports ──
  const claims = new Counter({ name: 'leasehold_claims_total', help: 'Jobs claimed (stream: by the dispatcher for agent streams; enqueue: by the enqueue itself for a waiting agent; gateway: AttemptService.ClaimJobs).', labelNames: ['via'], registers: r });
  on(src.dispatcher, 'dispatch:round', (x: { claimed: number }) => claims.inc({ via: 'stream' }, x.claimed));
  const handoffs = claims.labels({ via: 'enqueue' });
  on(src.dispatcher, 'dispatch:handoff', () => handoffs.inc());
  on(src.activity, 'attempt:claim', (x: { jobs: unknown[] }) => claims.inc({ via: 'gateway' }, x.jobs.length));
  const rounds = new Counter({ name: 'leasehold_dispatch_rounds_total', help: 'Dispatch rounds that had waiting agents.', registers: r });
  on(src.dispatcher, 'dispatch:round', () => rounds.inc());

  const latency = new Histogram({
    name: 'leasehold_job_start_latency_seconds',
    help: 'From when a job was due (run_at: its enqueue, or its retry time) to the start of the attempt that ran it, by queue.',
    labelNames: ['queue'],
    buckets: LATENCY_BUCKETS,
    registers: r,
  });
  const starts = new Counter({ name: 'leasehold_attempts_started_total', help: 'Attempts started.', labelNames: ['via'], registers: r });
  const stale = new Counter({ name: 'leasehold_stale_reports_total', help: 'Late calls refused because their attempt was no longer current (each is a stale_reports row).', labelNames: ['call'], registers: r });
  const latencyOf = children((queue) => latency.labels({ queue }));
  const onStart = (via: string) => {
    const started = starts.labels({ via });
    return (x: HubEvents['attempt:start'][0]) => {
      const o = x.outcome;
      if (o.outcome === 'stale') stale.inc({ call: 'start' });
      if (o.outcome !== 'ok') return;
      started.inc();
      // Both times are the database's: run_at, and updated_at set by the start.
      latencyOf(queueOf(o.value.queue)).observe(Math.max(0, (o.value.updatedAt.getTime() - o.value.runAt.getTime()) / 1000));
    };
  };
  on(src.hub, 'attempt:start', onStart('stream'));
  on(src.activity, 'attempt:start', onStart('gateway'));

  const reports = new Counter({ name: 'leasehold_reports_total', help: 'Completed and Failed reports by outcome (ok, duplicate, stale, conflict, ...).', labelNames: ['kind', 'outcome'], registers: r });
  const outcomes = new Counter({
    name: 'leasehold_job_outcomes_total',
    help: 'What became of jobs: succeeded, failed, retried (a retryable failure), dead, canceled, requeued (by an operator).',
    labelNames: ['queue', 'outcome'],
    registers: r,
  });
  const reportsOf = children((kind, outcome) => reports.labels({ kind, outcome }));
  const outcomesOf = children((queue, outcome) => outcomes.labels({ queue, outcome }));
  const onReport = (x: HubEvents['attempt:report'][0]) => {
    const o = x.outcome;
    reportsOf(x.kind, o.outcome).inc();
    if (o.outcome === 'stale') stale.inc({ call: x.kind === 'completed' ? 'complete' : 'fail' });
    if (o.outcome !== 'ok') return;
    const s = o.value.status;
    outcomesOf(queueOf(o.value.queue), s === 'queued' ? 'retried' : s).inc();
  };
  on(src.hub, 'attempt:report', onReport);
  on(src.activity, 'attempt:report', onReport);
  on(src.activity, 'job:canceled', (j: { queue: string }) => outcomesOf(queueOf(j.queue), 'canceled').inc());
  on(src.activity, 'job:requeued', (j: { queue: string }) => outcomesOf(queueOf(j.queue), 'requeued').inc());
  const enqueued = new Counter({ name: 'leasehold_jobs_enqueued_total', help: 'Jobs enqueued through JobService (duplicates not counted), by queue.', labelNames: ['queue'], registers: r });
  const enqueuedIn = children((queue) => enqueued.labels({ queue }));
  on(src.activity, 'job:enqueued', (j: { queue: string }) => enqueuedIn(queueOf(j.queue)).inc());

  // ── leases ──
  const expiries = new Counter({ name: 'leasehold_lease_expiries_total', help: 'Attempts ended by the reaper: claim_expired, lease_expired, timed_out.', labelNames: ['reason'], registers: r });
  const reaperRuns = new Counter({ name: 'leasehold_reaper_runs_total', help: 'Reaper runs, and those that failed.', labelNames: ['result'], registers: r });
  on(src.reaper, 'reaper:run', (run: { rescued: Array<{ reason: string; status: string; queue: string }> }) => {
    reaperRuns.inc({ result: 'ok' });
    for (const x of run.rescued) {
      expiries.inc({ reason: x.reason });
      if (x.status === 'dead') outcomesOf(queueOf(x.queue), 'dead').inc();
    }
  });
  on(src.reaper, 'reaper:error', () => reaperRuns.inc({ result: 'error' }));
  const revocations = new Counter({ name: 'leasehold_lease_revocations_total', help: 'Attempts taken away from agent streams (Revoke or Cancel sent), by reason.', labelNames: ['reason'], registers: r });
  on(src.hub, 'lease:revoked', (x: { attemptIds: string[]; reason: string }) => revocations.inc({ reason: x.reason }, x.attemptIds.length));
  const renewals = new Counter({ name: 'leasehold_lease_renewals_total', help: 'Leases renewed by coalesced heartbeats, and heartbeats for attempts no longer held (lost).', labelNames: ['result'], registers: r });
  on(src.hub, 'lease:tick', (x: { renewed: number; lost: number }) => {
    renewals.inc({ result: 'renewed' }, x.renewed);
    renewals.inc({ result: 'lost' }, x.lost);
  });

  // ── webhooks, purges ──
  const sends = new Counter({
    name: 'leasehold_webhook_sends_total',
    help: 'Webhook sends by what became of the delivery: delivered, retried (will be sent again), failed (gave up at the cap), lost (taken back).',
    labelNames: ['result'],
    registers: r,
  });
  on(src.deliverer, 'webhook:sent', (x: { status: string }) => sends.inc({ result: x.status === 'pending' ? 'retried' : x.status }));
  const alerts = new Counter({ name: 'leasehold_dead_letter_alerts_total', help: 'Dead-letter alerts raised.', registers: r });
  on(src.deliverer, 'alert', () => alerts.inc());
  const purged = new Counter({ name: 'leasehold_jobs_purged_total', help: 'Finished jobs deleted by the purger and by operators.', registers: r });
  on(src.purger, 'purger:run', (x: { purged: number }) => purged.inc(x.purged));
  const vacuums = new Counter({ name: 'leasehold_live_vacuums_total', help: 'VACUUMs of jobs_live run by the vacuumer (LEASEHOLD_VACUUM_DEAD_ROWS).', registers: r });
  const vacuumSeconds = new Counter({ name: 'leasehold_live_vacuum_seconds_total', help: 'Time spent in those VACUUMs.', registers: r });
  on(src.vacuumer, 'vacuumer:run', (x: { ms: number }) => {
    vacuums.inc();
    vacuumSeconds.inc(x.ms / 1000);
  });
  on(src.activity, 'jobs:purged', (x: { purged: number }) => purged.inc(x.purged));

  return {
    registry,
    async render() {
      return { contentType: registry.contentType, body: await registry.metrics() };
    },
    close() {
      for (const off of offs.splice(0)) off();
    },
    authRefused(listener, reason) {
      refusedKeys.inc({ listener, reason });
    },
  };
}
