/**
 * The webhook deliverer: drains the delivery outbox that terminal transitions write
 * (`store/outbox.ts`). Each run asks, in one statement, which of these there is work for
 * (`deliveryWork`: idle, that is all it does), then
 *
 * 1. takes back deliveries whose claim outlived its deliverer (the reconciliation sweep: a
 *    coordinator killed between claiming and recording a send);
 * 2. raises an alert for every new dead-letter event (an error log line with `alert:
 *    'job.dead'`, an `alert` event, and a delivery to the alert URL when one is configured),
 *    inside the transaction that marks it, so each is raised at least once;
 * 3. claims due deliveries (FOR UPDATE SKIP LOCKED: replicas never send one twice at once),
 *    signs and POSTs each, and records the answer: delivered (2xx), retried after an
 *    exponential backoff with jitter, or `failed` at the attempt cap (an operator can retry it:
 *    `leasehold deliveries retry`).
 *
 * Delivery is at least once (a send whose answer was lost is sent again); receivers dedupe by
 * the event id. Runs are chained with a jittered `setTimeout`, so two runs never overlap.
 */
import { createHmac, randomUUID } from 'node:crypto';
import { EventEmitter } from 'node:events';
import { allEnded } from './settle.js';
import { Schedule } from './schedule.js';
import { z } from 'zod';
import type { Logger } from '../log.js';
import {
  deliveryClaim,
  deliveryFinish,
  deliveryReclaimExpired,
  deliveryWork,
  eventAlertsClaim,
  signingSecretGet,
  withTransaction,
  type ClaimedDelivery,
  type Queryable,
  type SendResult,
} from '../store/index.js';

/** Header names of a delivery (lower case, as Node and n8n show them). */
export const WEBHOOK_HEADERS = {
  /** The event id: the same on every retry and every target; dedupe on it. */
  eventId: 'leasehold-event-id',
  eventType: 'leasehold-event-type',
  /** Unix seconds when this send was signed. */
  timestamp: 'leasehold-timestamp',
  /** `sha256=` + hex HMAC-SHA256 of `<timestamp>.<body>` with the target's secret. */
  signature: 'leasehold-signature',
  /** This send's number for this target, from 1. */
  attempt: 'leasehold-delivery-attempt',
} as const;

/** `sha256=<hex>`: HMAC-SHA256 with `secret` over `<timestamp>.<body>`. */
export function signDelivery(secret: string, timestamp: number, body: string): string {
  return `sha256=${createHmac('sha256', secret).update(`${timestamp}.${body}`, 'utf8').digest('hex')}`;
}

export interface WebhookDelivererConfig {
  /** Time between runs; default 500 ms. */
  intervalMs?: number;
  /** Deliveries claimed (and sent concurrently) per statement; default 50. */
  batchSize?: number;
  /** Fraction of the interval added or removed at random; default 0.1. */
  jitter?: number;
  /** A send with no answer by then fails (and is retried); default 10 s. */
  timeoutMs?: number;
  /** A claim lasts `timeoutMs` plus this; past it the sweep takes it back. Default 5 s. */
  claimMarginMs?: number;
  /** Sends per delivery before it is `failed`; default 12. */
  maxAttempts?: number;
  /** Retry delay `min(base·2^(n−1), max) × [0.5, 1)`; default base 5 s, max 1 h. */
  backoff?: { baseMs: number; maxMs: number };
  /** Where every dead-letter alert is also POSTed (signed with the notify secret). */
  alertUrl?: string | undefined;
}

/** Counts of one run. */
export interface DelivererRun {
  /** Claims taken back from a deliverer that stopped (they are sent again). */
  reclaimed: number;
  /** Dead-letter alerts raised. */
  alerts: number;
  /** Sends tried. */
  sent: number;
  delivered: number;
  /** Sends that failed and will be retried. */
  retried: number;
  /** Deliveries that reached the cap. */
  failed: number;
}

/** A dead-letter alert: the `job.dead` event as it is delivered. */
export interface DeadLetterAlert {
  eventId: string;
  jobId: string;
  event: Record<string, unknown>;
}

export interface DelivererEvents {
  'webhook:run': [DelivererRun];
  'webhook:error': [Error];
  /** One send and what became of it. */
  'webhook:sent': [{ delivery: Omit<ClaimedDelivery, 'secret' | 'body' | 'header'>; result: SendResult; status: 'delivered' | 'pending' | 'failed' | 'lost' }];
  alert: [DeadLetterAlert];
}

const configSchema = z.object({
  intervalMs: z.int().min(10).default(500),
  batchSize: z.int().min(1).max(1000).default(50),
  jitter: z.number().min(0).max(0.9).default(0.1),
  timeoutMs: z.int().min(100).max(600_000).default(10_000),
  claimMarginMs: z.int().min(0).max(600_000).default(5000),
  maxAttempts: z.int().min(1).max(100).default(12),
  backoff: z.object({ baseMs: z.int().min(0), maxMs: z.int().min(0) }).default({ baseMs: 5000, maxMs: 3_600_000 }),
  alertUrl: z.url({ protocol: /^https?$/ }).optional(),
});

/** Answers of a notify_url that end its delivery at once (the target is gone or took it already). */
const FINAL_NOTIFY_STATUSES = new Set([404, 409, 410]);

/** Sends the outbox on a schedule; `runOnce()` for tests and tools. */
export class WebhookDeliverer extends EventEmitter<DelivererEvents> {
  readonly config: z.output<typeof configSchema>;
  private readonly schedule: Schedule<DelivererRun>;
  /** Aborts sends in flight when the deliverer stops. */
  private abort = new AbortController();

  constructor(
    private readonly db: Queryable,
    private readonly log: Logger,
    config: WebhookDelivererConfig = {},
  ) {
    super();
    this.config = configSchema.parse(config);
    this.schedule = new Schedule(
      {
        ...this.config,
        onError: (err) => {
          this.log.warn({ err }, 'webhook deliverer run failed; retrying next interval');
          this.emit('webhook:error', err);
        },
      },
      () => this.drain(),
    );
  }

  /** Starts the schedule (the first run comes after one interval). Calling it twice is harmless. */
  start(): void {
    this.schedule.start();
  }

  /** Stops the schedule, cuts sends in flight (they are retried later) and waits for the run. Safe twice. */
  async stop(): Promise<void> {
    const stopping = this.schedule.stop();
    this.abort.abort(new Error('the deliverer stopped'));
    await stopping;
    this.abort = new AbortController();
  }

  /** Sweeps, raises alerts and sends everything due now; returns the counts; joins a run in progress. */
  runOnce(): Promise<DelivererRun> {
    return this.schedule.runOnce();
  }

  private async drain(): Promise<DelivererRun> {
    const run: DelivererRun = { reclaimed: 0, alerts: 0, sent: 0, delivered: 0, retried: 0, failed: 0 };
    const { batchSize, maxAttempts } = this.config;
    // What there is to do, asked once; a step that finds work makes the claim's worth asking
    // (a delivery taken back, an alert's delivery queued: both due now, in this run).
    const work = await deliveryWork(this.db);
    while (work.reclaim) {
      const back = await deliveryReclaimExpired(this.db, { limit: batchSize, maxAttempts });
      for (const d of back) {
        run.reclaimed++;
        if (d.status === 'failed') run.failed++;
        else work.due = true;
        this.log.warn({ deliveryId: d.id, eventId: d.eventId, url: d.url, attempts: d.attempts, status: d.status }, 'webhook delivery taken back from a deliverer that stopped');
      }
      if (back.length < batchSize) break;
    }
    while (work.alerts) {
      const n = await withTransaction(this.db, async (tx) => {
        const alerts = await eventAlertsClaim(tx, { limit: batchSize, alertUrl: this.config.alertUrl });
        for (const a of alerts) this.raise(a);
        return alerts.length;
      });
      run.alerts += n;
      if (n > 0 && this.config.alertUrl) work.due = true;
      if (n < batchSize) break;
    }
    let notifySecret: string | undefined;
    while (work.due) {
      if (this.abort.signal.aborted) break;
      const claimId = randomUUID();
      const batch = await deliveryClaim(this.db, { limit: batchSize, claimId, leaseMs: this.config.timeoutMs + this.config.claimMarginMs });
      if (batch.length === 0) break;
      if (batch.some((d) => d.secret === null)) notifySecret ??= await signingSecretGet(this.db);
      // Every send of the batch ends (and is recorded) before the run goes on or fails: stop()
      // waits for the run, so none is still writing when the pool closes.
      await allEnded(batch.map((d) => this.deliver(d, claimId, d.secret ?? notifySecret!, run)));
      if (batch.length < batchSize) break;
    }
    this.emit('webhook:run', run);
    return run;
  }

  private raise(a: { eventId: string; jobId: string; body: string }) {
    let event: Record<string, unknown> = {};
    try {
      event = JSON.parse(a.body) as Record<string, unknown>;
    } catch {
      event = {};
    }
    const job = (event.job ?? {}) as Record<string, unknown>;
    this.log.error(
      { alert: 'job.dead', eventId: a.eventId, jobId: a.jobId, queue: job.queue, attemptNo: job.attemptNo, error: job.error },
      'job dead-lettered',
    );
    this.emit('alert', { eventId: a.eventId, jobId: a.jobId, event });
  }

  private async deliver(d: ClaimedDelivery, claimId: string, secret: string, run: DelivererRun): Promise<void> {
    run.sent++;
    const result = await this.send(d, secret);
    const done = await deliveryFinish(this.db, {
      id: d.id,
      claimId,
      result,
      maxAttempts: this.config.maxAttempts,
      backoff: this.config.backoff,
    });
    const { secret: _s, body: _b, header: _h, ...delivery } = d;
    const ctx = { deliveryId: d.id, eventId: d.eventId, type: d.type, url: d.url, attempt: d.attempt, httpStatus: result.httpStatus };
    switch (done.status) {
      case 'delivered':
        run.delivered++;
        this.log.debug(ctx, 'webhook delivered');
        break;
      case 'pending':
        run.retried++;
        this.log.warn({ ...ctx, error: result.error, nextAttemptAt: done.nextAttemptAt }, 'webhook delivery failed; will retry');
        break;
      case 'failed':
        run.failed++;
        if (result.final) this.log.warn({ ...ctx, error: result.error }, 'the notify_url refused the delivery for good (404, 409 or 410): not retried');
        else this.log.error({ ...ctx, error: result.error, alert: 'webhook.failed' }, 'webhook delivery failed for good (leasehold deliveries retry)');
        break;
      case 'lost':
        this.log.warn(ctx, 'webhook delivery was taken back before its send was recorded');
        break;
    }
    this.emit('webhook:sent', { delivery, result, status: done.status });
  }

  /** POSTs the body, signed; never throws. */
  private async send(d: ClaimedDelivery, secret: string): Promise<SendResult> {
    const timestamp = Math.floor(Date.now() / 1000);
    // One controller per send, aborted by a timer of our own or by stop(). Not
    // `AbortSignal.any([AbortSignal.timeout(ms), …])`: Node 20 holds a timeout signal only
    // weakly, so a garbage collection while the receiver kept silent took the timeout with it
    // and the send, and the run, waited for ever (test/webhooks.test.ts, "a collection").
    const sending = new AbortController();
    const stopping = this.abort.signal;
    const onStop = () => sending.abort(stopping.reason);
    if (stopping.aborted) onStop();
    else stopping.addEventListener('abort', onStop, { once: true });
    const timer = setTimeout(() => sending.abort(new DOMException(`no answer within ${this.config.timeoutMs} ms`, 'TimeoutError')), this.config.timeoutMs);
    try {
      const res = await fetch(d.url, {
        method: 'POST',
        body: d.body,
        redirect: 'manual',
        headers: {
          'content-type': 'application/json',
          'user-agent': 'leasehold-webhooks/1',
          [WEBHOOK_HEADERS.eventId]: d.eventId,
          [WEBHOOK_HEADERS.eventType]: d.type,
          [WEBHOOK_HEADERS.timestamp]: String(timestamp),
          [WEBHOOK_HEADERS.signature]: signDelivery(secret, timestamp, d.body),
          [WEBHOOK_HEADERS.attempt]: String(d.attempt),
          ...(d.header ? { [d.header.name]: d.header.value } : {}),
        },
        signal: sending.signal,
      });
      await res.body?.cancel().catch(() => undefined);
      if (res.status >= 200 && res.status < 300) return { ok: true, httpStatus: res.status };
      // A notify_url that says the target is gone (n8n: a Wait node's execution already resumed
      // or ended, 409; a workflow deactivated, 404) will not take it later: not retried.
      const final = d.toNotifyUrl && FINAL_NOTIFY_STATUSES.has(res.status);
      return { ok: false, httpStatus: res.status, error: `HTTP ${res.status} ${res.statusText}`.trim(), ...(final ? { final } : {}) };
    } catch (err) {
      const e = err as Error & { cause?: { code?: string; message?: string } };
      const why = e.name === 'TimeoutError' ? `no answer within ${this.config.timeoutMs} ms` : (e.cause?.code ?? e.cause?.message ?? e.message);
      return { ok: false, error: why };
    } finally {
      clearTimeout(timer);
      stopping.removeEventListener('abort', onStop);
    }
  }
}
