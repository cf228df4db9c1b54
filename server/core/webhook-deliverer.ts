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
 *    exponential backoff with jitter, or `failed` at the attempt cap, on a final answer
 *    (`finalAnswer`) or at once when the egress policy refuses its address; every `failed` is
 *    logged with `alert: 'webhook.failed'` (an operator can retry it: `leasehold deliveries retry`).
 *
 * Sends flow: up to `batchSize` are in flight, at most `perReceiver` of them to one receiver
 * (scheme, host, port), and the run claims again as sends end, and every interval while some are
 * still in flight (asking again for steps 1 and 2 too), so a receiver that keeps silent until
 * the timeout holds only its own sends. A run ends when nothing it can send is due and its
 * sends have ended; it sends a delivery at most once.
 *
 * Delivery is at least once (a send whose answer was lost is sent again); receivers dedupe by
 * the event id. Runs are chained with a jittered `setTimeout`, so two runs never overlap.
 */
import { createHmac, randomUUID } from 'node:crypto';
import { EventEmitter, setMaxListeners } from 'node:events';
import { Agent, fetch } from 'undici';
import { z } from 'zod';
import { DeniedAddressError, EgressPolicy } from '../lib/egress.js';
import { Schedule } from './schedule.js';
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
  /** Sends in flight at once (and the most one statement claims or takes back); default 50. */
  batchSize?: number;
  /** Sends in flight at once to one receiver (scheme, host and port); default 10 (at most `batchSize`). */
  perReceiver?: number;
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
  /** The addresses no send may connect to; default `DEFAULT_DENIED` (link-local, the clouds' metadata services). */
  egress?: EgressPolicy;
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
  /** Deliveries that reached the cap, or got a final answer. */
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
  perReceiver: z.int().min(1).max(1000).default(10),
  jitter: z.number().min(0).max(0.9).default(0.1),
  timeoutMs: z.int().min(100).max(600_000).default(10_000),
  claimMarginMs: z.int().min(0).max(600_000).default(5000),
  maxAttempts: z.int().min(1).max(100).default(12),
  backoff: z.object({ baseMs: z.int().min(0), maxMs: z.int().min(0) }).default({ baseMs: 5000, maxMs: 3_600_000 }),
  alertUrl: z.url({ protocol: /^https?$/ }).optional(),
});

/** The try of a notify_url delivery from which a 409 answer is final (the 4 before are retried). */
export const CONFLICT_FINAL_ATTEMPT = 5;

/** Bytes of a non-2xx answer's body kept in `last_error` (the rest is not read). */
export const ERROR_BODY_BYTES = 200;

/** n8n's resume URLs (a Wait node's `$execution.resumeUrl`, a form's `resumeFormUrl`). */
const WAITING_PATH = /^\/(?:[^?#]*\/)?(?:webhook|form)-waiting\//;

/** Whether `url`'s path is an n8n resume URL (`…/webhook-waiting/<execution id>`, `…/form-waiting/…`). */
export function isWaitingUrl(url: string): boolean {
  try {
    return WAITING_PATH.test(new URL(url).pathname);
  } catch {
    return false;
  }
}

/**
 * Whether an answer ends its delivery at once, as `failed` (with the alert), short of the attempt
 * cap. Only a job's notify_url has final answers; a subscription is an operator's setting and is
 * retried to the cap whatever it answers. (An address the egress policy refuses is not an
 * answer: that send fails at once for any target, `send`.)
 *
 * - 410: the target says it is gone.
 * - 404 from an n8n resume URL (`/webhook-waiting/`, `/form-waiting/`): its execution does not
 *   exist (deleted, or pruned). From any other URL 404 is retried like a 5xx: n8n answers it for
 *   a production webhook whose workflow is inactive or being re-activated.
 * - 409 from the `CONFLICT_FINAL_ATTEMPT`th try on (the tries before span 37–75 s at the default
 *   backoff): n8n's resume URL answers 409 both while the execution "is running already" (it has
 *   not reached its Wait node yet: a job that ends right after its enqueue) and once it "has
 *   finished already". A body that says the execution has finished (n8n's wording) is final at
 *   once; any other 409 is retried until then, so the retry does not depend on the wording.
 */
export function finalAnswer(d: { toNotifyUrl: boolean; url: string; attempt: number }, status: number, body: string): boolean {
  if (!d.toNotifyUrl) return false;
  if (status === 410) return true;
  if (status === 404) return isWaitingUrl(d.url);
  if (status === 409) return d.attempt >= CONFLICT_FINAL_ATTEMPT || /\bhas finished\b/i.test(body);
  return false;
}

/** Control, format and line-separator characters and white space, made one space in an error. */
const controls = /[\p{Cc}\p{Cf}\p{Zl}\p{Zp}\s]+/gu;

/**
 * The start of an answer's body as text: at most ERROR_BODY_BYTES bytes read (the rest is
 * cancelled, never read), a character cut at the end left out, control and format characters
 * and runs of white space made one space. What a read that fails (the timeout, stop) got so far.
 */
async function bodyStart(res: Response): Promise<string> {
  if (!res.body) return '';
  const reader = res.body.getReader();
  const chunks: Uint8Array[] = [];
  let size = 0;
  try {
    while (size < ERROR_BODY_BYTES) {
      const { done, value } = await reader.read();
      if (done) break;
      chunks.push(value);
      size += value.byteLength;
    }
  } catch {
    // The send's timeout or stop() cut the body: keep what came.
  } finally {
    await reader.cancel().catch(() => undefined);
  }
  const bytes = Buffer.concat(chunks).subarray(0, ERROR_BODY_BYTES);
  return new TextDecoder('utf-8').decode(bytes, { stream: true }).replace(controls, ' ').trim();
}

/** The controller stop() aborts: every send in flight listens to it (up to `batchSize`, not Node's 10). */
function stopSignal(): AbortController {
  const c = new AbortController();
  setMaxListeners(0, c.signal);
  return c;
}

/** Sends the outbox on a schedule; `runOnce()` for tests and tools. */
export class WebhookDeliverer extends EventEmitter<DelivererEvents> {
  readonly config: z.output<typeof configSchema>;
  /** Where sends may connect (`LEASEHOLD_WEBHOOK_DENY`). */
  readonly egress: EgressPolicy;
  /** The sends' connections, each looked up through `egress`; made at the first send, closed by stop(). */
  private dispatcher: Agent | undefined;
  private readonly schedule: Schedule<DelivererRun>;
  /** Aborts sends in flight when the deliverer stops. */
  private abort = stopSignal();

  constructor(
    private readonly db: Queryable,
    private readonly log: Logger,
    config: WebhookDelivererConfig = {},
  ) {
    super();
    this.config = configSchema.parse(config);
    this.egress = config.egress ?? EgressPolicy.parse(undefined, 'LEASEHOLD_WEBHOOK_DENY');
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
    this.abort = stopSignal();
    const dispatcher = this.dispatcher;
    this.dispatcher = undefined;
    await dispatcher?.destroy();
  }

  /** Sweeps, raises alerts and sends everything due now; returns the counts; joins a run in progress. */
  runOnce(): Promise<DelivererRun> {
    return this.schedule.runOnce();
  }

  private async drain(): Promise<DelivererRun> {
    const run: DelivererRun = { reclaimed: 0, alerts: 0, sent: 0, delivered: 0, retried: 0, failed: 0 };
    const { batchSize, intervalMs } = this.config;
    const perReceiver = Math.min(this.config.perReceiver, batchSize);
    // Sends in flight, by receiver; deliveries sent since the last look at the work (`again`: each
    // is sent at most once between two looks, however soon its retry is due; emptied at each look,
    // so a retry due goes out within an interval of its time even while the run lasts).
    const inFlight = new Map<string, number>();
    /** Sends in flight by claim: the run's own sweep leaves these claims alone. */
    const claims = new Map<string, number>();
    let sending = 0;
    const again = new Set<number>();
    let failure: { err: unknown } | undefined;
    let notifySecret: string | undefined;
    let wake: (() => void) | undefined;

    // Claim when the last claim filled every free slot, when a send ends after a claim that found
    // work (more may be due; the claim passed a receiver at its cap over, or rows another
    // deliverer held), and after each look at the work (now, then every interval while sends are
    // in flight): deliveries that came due meanwhile go out beside the slow ones.
    let ask = false;
    let found = 0;
    let nextLook = 0;
    // Read again after every await: a stop() during the sweep must not claim (each delivery
    // claimed counts a try, and a send cut by the stop sends nothing).
    const stopping = () => this.abort.signal.aborted || failure !== undefined;
    for (;;) {
      if (!stopping() && performance.now() >= nextLook) {
        nextLook = performance.now() + intervalMs;
        again.clear();
        try {
          ask = (await this.sweep(run, [...claims.keys()])) || ask;
        } catch (err) {
          failure ??= { err };
          continue;
        }
      }
      const room = batchSize - sending;
      if (!stopping() && ask && room > 0) {
        const claimId = randomUUID();
        let batch: ClaimedDelivery[];
        // A send that ends while the claim runs asks again (its room was not seen by the claim).
        ask = false;
        try {
          batch = await deliveryClaim(this.db, {
            limit: room,
            claimId,
            leaseMs: this.config.timeoutMs + this.config.claimMarginMs,
            perReceiver,
            inFlight,
            skip: [...again],
          });
          if (batch.some((d) => d.secret === null)) notifySecret ??= await signingSecretGet(this.db);
        } catch (err) {
          // Claimed rows not sent are taken back by the sweep when their claim ends.
          failure ??= { err };
          continue;
        }
        ask ||= batch.length === room;
        found = batch.length;
        if (batch.length > 0) claims.set(claimId, batch.length);
        for (const d of batch) {
          again.add(d.id);
          sending++;
          inFlight.set(d.receiver, (inFlight.get(d.receiver) ?? 0) + 1);
          this.deliver(d, claimId, d.secret ?? notifySecret!, run)
            .then((status) => {
              if (status === 'delivered' || status === 'failed') again.delete(d.id);
            })
            .catch((err: unknown) => {
              failure ??= { err };
            })
            .finally(() => {
              sending--;
              const left = claims.get(claimId)! - 1;
              if (left > 0) claims.set(claimId, left);
              else claims.delete(claimId);
              const n = inFlight.get(d.receiver)!;
              if (found > 0 || n >= perReceiver) ask = true;
              if (n > 1) inFlight.set(d.receiver, n - 1);
              else inFlight.delete(d.receiver);
              wake?.();
            });
        }
      }
      // Every send ends (and is recorded) before the run ends or fails: stop() waits for the
      // run, so none is still writing when the pool closes. stop() cuts them at once.
      if (sending === 0) break;
      // Until a send ends, or it is time to look at the work again.
      await new Promise<void>((resolve) => {
        const timer = stopping() ? undefined : setTimeout(resolve, Math.max(0, nextLook - performance.now()));
        wake = () => {
          clearTimeout(timer);
          resolve();
        };
      });
      wake = undefined;
    }
    if (failure) throw failure.err;
    this.emit('webhook:run', run);
    return run;
  }

  /**
   * Asks what there is to do, takes back expired claims (not `ours`, the run's claims still
   * sending) and raises the new dead-letter alerts; returns whether deliveries are due.
   */
  private async sweep(run: DelivererRun, ours: string[]): Promise<boolean> {
    const { batchSize, maxAttempts } = this.config;
    // What there is to do, asked once; a step that finds work makes the claim's worth asking
    // (a delivery taken back, an alert's delivery queued: both due now, in this run).
    const work = await deliveryWork(this.db);
    while (work.reclaim) {
      const back = await deliveryReclaimExpired(this.db, { limit: batchSize, maxAttempts, except: ours });
      for (const d of back) {
        run.reclaimed++;
        const ctx = { deliveryId: d.id, eventId: d.eventId, url: d.url, attempts: d.attempts, status: d.status };
        if (d.status === 'failed') {
          run.failed++;
          this.log.error({ ...ctx, alert: 'webhook.failed' }, 'webhook delivery taken back from a deliverer that stopped, at its attempt cap: failed for good (leasehold deliveries retry)');
        } else {
          work.due = true;
          this.log.warn(ctx, 'webhook delivery taken back from a deliverer that stopped');
        }
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
    return work.due;
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

  private async deliver(d: ClaimedDelivery, claimId: string, secret: string, run: DelivererRun): Promise<'delivered' | 'pending' | 'failed' | 'lost'> {
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
        this.log.error(
          { ...ctx, error: result.error, alert: 'webhook.failed', final: result.final === true },
          result.final
            ? result.httpStatus === undefined
              ? 'webhook delivery refused: its address is denied (LEASEHOLD_WEBHOOK_DENY); not retried (leasehold deliveries retry)'
              : `the notify_url answered ${result.httpStatus} for good: delivery failed, not retried (leasehold deliveries retry)`
            : 'webhook delivery failed for good (leasehold deliveries retry)',
        );
        break;
      case 'lost':
        this.log.warn(ctx, 'webhook delivery was taken back before its send was recorded');
        break;
    }
    this.emit('webhook:sent', { delivery, result, status: done.status });
    return done.status;
  }

  /** POSTs the body, signed; never throws. A URL whose address the egress policy denies is a final failure, sent nothing. */
  private async send(d: ClaimedDelivery, secret: string): Promise<SendResult> {
    const refused = this.egress.refusal(d.url);
    if (refused) return { ok: false, error: refused.message, final: true };
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
        dispatcher: (this.dispatcher ??= new Agent({
          // The send's own timer (above) bounds connecting and waiting alike; undici's defaults
          // (10 s to connect, 300 s for the headers) would cut a longer LEASEHOLD_WEBHOOK_TIMEOUT short.
          connect: { lookup: this.egress.lookup, timeout: this.config.timeoutMs },
          headersTimeout: 0,
          bodyTimeout: 0,
        })),
      });
      if (res.status >= 200 && res.status < 300) {
        await res.body?.cancel().catch(() => undefined);
        return { ok: true, httpStatus: res.status };
      }
      // The receiver's reason, for the operator (n8n: `{"code":409,"message":"The execution
      // \"42\" is running already."}`), read within this send's timeout.
      const said = await bodyStart(res);
      const error = `HTTP ${res.status} ${res.statusText}`.trim() + (said ? `: ${said}` : '');
      return { ok: false, httpStatus: res.status, error, ...(finalAnswer(d, res.status, said) ? { final: true } : {}) };
    } catch (err) {
      const e = err as Error & { cause?: { code?: string; message?: string } };
      if (e.cause instanceof DeniedAddressError) return { ok: false, error: e.cause.message, final: true };
      const why = e.name === 'TimeoutError' ? `no answer within ${this.config.timeoutMs} ms` : (e.cause?.code ?? e.cause?.message ?? e.message);
      return { ok: false, error: why };
    } finally {
      clearTimeout(timer);
      stopping.removeEventListener('abort', onStop);
    }
  }
}
