/**
 * Notifications: subscriptions, the signing secret of notify_url deliveries, and the delivery
 * outbox the webhook deliverer drains.
 *
 * The outbox is written by the transition itself: `outboxSql` is a set of CTEs appended to the
 * fenced statements that end a job (complete, fail, cancel, rescue to dead), so an event exists
 * if and only if its transition committed. Each event is one `webhook_events` row (the body,
 * rendered once) and one `webhook_deliveries` row per target URL. Deliverers claim due rows
 * with FOR UPDATE SKIP LOCKED (a claim is fenced by `claim_id`), mark them delivered, back off
 * after a failed send, and move them to `failed` at the attempt cap; a claim whose deliverer
 * died is taken back by `deliveryReclaimExpired`. Delivery is at least once: receivers dedupe
 * by event id.
 */
import { randomBytes } from 'node:crypto';
import { z } from 'zod';
import { conflict, notFound, ok, type Outcome } from '../domain/outcomes.js';
import { check, checkAll, schemas } from '../domain/validation.js';
import { backoffSql, type Backoff } from './backoff.js';
import { WEBHOOK_EVENT_TYPES, type WebhookEventType } from '../domain/statuses.js';
import { run, statement, withTransaction, type Queryable } from './sql.js';

// ───────────────────────────── subscriptions ─────────────────────────────

const queueOrAll = z.union([z.literal('*'), schemas.queue]);
const eventsSchema = z
  .array(z.enum(WEBHOOK_EVENT_TYPES, `must be one of ${WEBHOOK_EVENT_TYPES.join(', ')}`))
  .min(1, 'must name at least one event');

/** A subscription as listed (its secret only when asked for). */
export interface Subscription {
  id: string;
  queue: string;
  url: string;
  events: WebhookEventType[];
  createdAt: Date;
  secret?: string;
}

// A URL has one secret: a new subscription of a URL already subscribed (another queue) takes its
// secret, so the receiver there verifies everything it gets with one.
const subscriptionCreateSql = statement(
  'subscriptionCreate',
  `INSERT INTO subscriptions (queue, url, events, secret)
   VALUES ($1, $2, $3::webhook_event_type[], coalesce((SELECT secret FROM subscriptions WHERE url = $2 ORDER BY created_at, id LIMIT 1), $4))
   ON CONFLICT (queue, url) DO NOTHING
   RETURNING id, queue, url, events::text[] AS events, created_at, secret`,
);

/**
 * Subscribes `url` to `events` (default all four) of jobs of `queue` (`*`: every queue).
 * Returns the subscription with its signing secret (shown once by the CLI): the secret of that
 * URL, new unless the URL is already subscribed to another queue. Everything sent to the URL is
 * signed with it (its subscriptions' events, the notify_url deliveries of jobs that name it, the
 * alert when LEASEHOLD_ALERT_URL is it).
 */
export async function subscriptionCreate(
  db: Queryable,
  p: { queue: string; url: string; events?: string[] },
): Promise<Outcome<Subscription & { secret: string }>> {
  const bad = checkAll(
    check('queue', queueOrAll, p.queue),
    check('url', schemas.url, p.url),
    p.events === undefined ? undefined : check('events', eventsSchema, p.events),
  );
  if (bad) return bad;
  const fresh = `whsec_${randomBytes(32).toString('base64url')}`;
  const events = [...new Set(p.events ?? WEBHOOK_EVENT_TYPES)];
  const [row] = await run<{ id: string; queue: string; url: string; events: WebhookEventType[]; created_at: Date; secret: string }>(
    db,
    subscriptionCreateSql,
    [p.queue, p.url, events, fresh],
  );
  if (!row) return conflict(`${p.url} is already subscribed to queue ${p.queue}`);
  return ok({ id: row.id, queue: row.queue, url: row.url, events: row.events, createdAt: row.created_at, secret: row.secret });
}

const subscriptionListSql = statement(
  'subscriptionList',
  `SELECT id, queue, url, events::text[] AS events, created_at, secret FROM subscriptions ORDER BY created_at, id`,
);

/** Every subscription, oldest first; secrets only with `withSecrets`. */
export async function subscriptionList(db: Queryable, p: { withSecrets?: boolean } = {}): Promise<Subscription[]> {
  const rows = await run<{ id: string; queue: string; url: string; events: WebhookEventType[]; created_at: Date; secret: string }>(
    db,
    subscriptionListSql,
    [],
  );
  return rows.map((r) => ({
    id: r.id,
    queue: r.queue,
    url: r.url,
    events: r.events,
    createdAt: r.created_at,
    ...(p.withSecrets ? { secret: r.secret } : {}),
  }));
}

const subscriptionRemoveSql = statement('subscriptionRemove', `DELETE FROM subscriptions WHERE id = $1 RETURNING id`);

// An event goes to a URL once, on the row of one of the subscriptions that wanted it (outbox.ts):
// before that subscription goes, its deliveries not yet made move to another subscription of the
// URL that wants the event too (its queue or '*', its event types), if there is one.
const subscriptionHandOverSql = statement(
  'subscriptionHandOver',
  `UPDATE webhook_deliveries d SET subscription_id = coalesce((
     SELECT s2.id FROM webhook_events e
     JOIN jobs j ON j.id = e.job_id
     JOIN subscriptions s2 ON s2.url = d.url AND s2.id <> $1 AND s2.queue IN (j.queue, '*') AND e.type = ANY (s2.events)
     WHERE e.id = d.event_id
     ORDER BY s2.created_at, s2.id LIMIT 1), d.subscription_id)
   WHERE d.subscription_id = $1 AND d.status IN ('pending', 'sending')`,
);

/**
 * Removes a subscription; its deliveries not yet made are dropped with it, but for those another
 * subscription of the same URL wants as well (they go on as that one's).
 */
export async function subscriptionRemove(db: Queryable, p: { id: string }): Promise<Outcome<{ id: string }>> {
  const bad = check('id', schemas.id, p.id);
  if (bad) return bad;
  const [row] = await withTransaction(db, async (tx) => {
    await run(tx, subscriptionHandOverSql, [p.id]);
    return run(tx, subscriptionRemoveSql, [p.id]);
  });
  return row ? ok({ id: p.id }) : notFound(`subscription ${p.id} not found`);
}

// Every subscription of the URL gets the new secret: a URL has one.
const subscriptionRotateSql = statement(
  'subscriptionRotate',
  `UPDATE subscriptions s SET secret = $2
   WHERE s.url = (SELECT url FROM subscriptions WHERE id = $1)
   RETURNING s.id, s.queue, s.url, s.events::text[] AS events, s.created_at`,
);

/**
 * Replaces the signing secret of a subscription's URL: every subscription of that URL, and the
 * notify_url and alert deliveries sent there, are signed with the new one from now on. Returns
 * the subscription with it, and the ids of the URL's other subscriptions.
 */
export async function subscriptionRotate(
  db: Queryable,
  p: { id: string },
): Promise<Outcome<{ subscription: Subscription & { secret: string }; alsoRotated: string[] }>> {
  const bad = check('id', schemas.id, p.id);
  if (bad) return bad;
  const secret = `whsec_${randomBytes(32).toString('base64url')}`;
  const rows = await run<{ id: string; queue: string; url: string; events: WebhookEventType[]; created_at: Date }>(db, subscriptionRotateSql, [p.id, secret]);
  const row = rows.find((r) => r.id === p.id.toLowerCase());
  if (!row) return notFound(`subscription ${p.id} not found`);
  return ok({
    subscription: { id: row.id, queue: row.queue, url: row.url, events: row.events, createdAt: row.created_at, secret },
    alsoRotated: rows.filter((r) => r !== row).map((r) => r.id),
  });
}

// ───────────────────────────── the notify secret ─────────────────────────────

/** The `signing_secrets` row that signs notify_url and alert-URL deliveries. */
export const NOTIFY_SECRET = 'notify';

const secretEnsureSql = statement(
  'signingSecretEnsure',
  `WITH i AS (
     INSERT INTO signing_secrets (name, secret) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING RETURNING secret
   )
   SELECT secret FROM i UNION ALL SELECT secret FROM signing_secrets WHERE name = $1`,
);

const secretRotateSql = statement(
  'signingSecretRotate',
  `INSERT INTO signing_secrets (name, secret) VALUES ($1, $2)
   ON CONFLICT (name) DO UPDATE SET secret = EXCLUDED.secret, created_at = now() RETURNING secret`,
);

/** The notify secret, created on first use; `rotate` replaces it (deliveries sent after use the new one). */
export async function signingSecretGet(db: Queryable, p: { rotate?: boolean } = {}): Promise<string> {
  const fresh = `whsec_${randomBytes(32).toString('base64url')}`;
  const [row] = await run<{ secret: string }>(db, p.rotate ? secretRotateSql : secretEnsureSql, [NOTIFY_SECRET, fresh]);
  if (row) return row.secret;
  // Another coordinator inserted it after this statement's snapshot was taken: read it now.
  const [again] = await run<{ secret: string }>(db, secretEnsureSql, [NOTIFY_SECRET, fresh]);
  if (!again) throw new Error('signing secret vanished while being read');
  return again.secret;
}

// ───────────────────────────── the deliverer's verbs ─────────────────────────────

/** A delivery a deliverer holds: what to send, where, and with which secret. */
export interface ClaimedDelivery {
  id: number;
  eventId: string;
  type: WebhookEventType;
  url: string;
  /** Its receiver: the URL's scheme, host and port, lower case (`RECEIVER_SQL`); sends in flight are counted by it. */
  receiver: string;
  /** This send's number, from 1. */
  attempt: number;
  body: string;
  /** The secret of its URL (a subscribed URL's); null means the notify secret. */
  secret: string | null;
  /** It goes to its job's notify_url (not to a subscription, nor the alert URL). */
  toNotifyUrl: boolean;
  /** The header the job's notify_url deliveries carry (given at enqueue), if any. */
  header: { name: string; value: string } | null;
}

/** The receiver of a delivery's URL in SQL: `scheme://host[:port]` (user info included), lower case. */
const receiverSql = (url: string) => `lower(coalesce(substring(${url} from '^[^:/?#]+://[^/?#]+'), ${url}))`;

// Safe with any number of deliverers: due rows are locked FOR UPDATE SKIP LOCKED, so two never
// take the same delivery, and each claim is fenced by claim_id. Served by
// webhook_deliveries_due_idx (next_attempt_at) WHERE status = 'pending'.
//
// A receiver (scheme, host, port) gets at most $7 sends in flight from this deliverer: `busy` is
// what it has in flight per receiver ($5, $6), a receiver at its cap is passed over in the scan
// (so a silent one with a backlog does not hide the others behind it), and of the next due rows
// of each other receiver only as many as it has room for are locked. The scan looks at 4 × $1
// due rows; what it leaves the next claim takes. $8: deliveries this run already sent (a run
// sends each at most once, however soon its retry is due).
const claimSql = statement(
  'deliveryClaim',
  `WITH busy AS (
     SELECT b.receiver, b.n FROM unnest($5::text[], $6::int[]) AS b(receiver, n)
   ), due AS (
     SELECT w.id, w.next_attempt_at, ${receiverSql('w.url')} AS receiver FROM webhook_deliveries w
     WHERE w.status = 'pending' AND w.next_attempt_at <= coalesce($4::timestamptz, now())
       AND w.id <> ALL ($8::bigint[])
       AND NOT EXISTS (SELECT 1 FROM busy WHERE busy.receiver = ${receiverSql('w.url')} AND busy.n >= $7)
     ORDER BY w.next_attempt_at, w.id
     LIMIT $1::int * 4
   ), room AS (
     SELECT due.id, row_number() OVER (PARTITION BY due.receiver ORDER BY due.next_attempt_at, due.id) + coalesce(busy.n, 0) AS n
     FROM due LEFT JOIN busy ON busy.receiver = due.receiver
   ), c AS (
     SELECT w.id, w.event_id, w.url, w.subscription_id FROM webhook_deliveries w
     WHERE w.id IN (SELECT id FROM room WHERE n <= $7)
       AND w.status = 'pending' AND w.next_attempt_at <= coalesce($4::timestamptz, now())
     ORDER BY w.next_attempt_at, w.id
     LIMIT $1::int
     FOR UPDATE SKIP LOCKED
   )
   UPDATE webhook_deliveries d SET status = 'sending', attempts = d.attempts + 1, claim_id = $2,
     claimed_until = coalesce($4::timestamptz, now()) + make_interval(secs => $3::float8 / 1000.0),
     updated_at = coalesce($4::timestamptz, now())
   FROM c
   JOIN webhook_events e ON e.id = c.event_id
   LEFT JOIN jobs j ON j.id = e.job_id
   LEFT JOIN notify_headers h ON h.job_id = e.job_id
   LEFT JOIN subscriptions s ON s.id = c.subscription_id
   WHERE d.id = c.id
   RETURNING d.id, d.event_id, d.url, ${receiverSql('d.url')} AS receiver, d.attempts, e.type::text AS type, e.body,
     c.subscription_id IS NULL AND c.url = j.notify_url AS to_notify_url,
     CASE WHEN c.subscription_id IS NULL AND c.url = j.notify_url AND h.job_id IS NOT NULL
          THEN jsonb_build_object('name', h.name, 'value', h.value) END AS header,
     coalesce(s.secret, (SELECT s2.secret FROM subscriptions s2 WHERE s2.url = c.url ORDER BY s2.created_at, s2.id LIMIT 1)) AS secret`,
);

/**
 * Claims up to `limit` due deliveries for `leaseMs` (the send timeout and a margin). With
 * `perReceiver`, a receiver (`ClaimedDelivery.receiver`) gets no more than that in flight,
 * counting the claimer's own sends in flight (`inFlight`, by receiver); `skip` are deliveries
 * not to take again (those the claimer's run already sent).
 */
export async function deliveryClaim(
  db: Queryable,
  p: { limit: number; claimId: string; leaseMs: number; now?: Date; perReceiver?: number; inFlight?: ReadonlyMap<string, number>; skip?: readonly number[] },
): Promise<ClaimedDelivery[]> {
  const busy = [...(p.inFlight ?? new Map<string, number>())];
  const rows = await run<{
    id: number;
    event_id: string;
    url: string;
    receiver: string;
    attempts: number;
    type: WebhookEventType;
    body: string;
    secret: string | null;
    to_notify_url: boolean | null;
    header: { name: string; value: string } | null;
  }>(db, claimSql, [
    p.limit,
    p.claimId,
    p.leaseMs,
    p.now ?? null,
    busy.map(([r]) => r),
    busy.map(([, n]) => n),
    p.perReceiver ?? p.limit,
    p.skip ?? [],
  ]);
  return rows.map((r) => ({
    id: r.id,
    eventId: r.event_id,
    type: r.type,
    url: r.url,
    receiver: r.receiver,
    attempt: r.attempts,
    body: r.body,
    secret: r.secret,
    toNotifyUrl: r.to_notify_url === true,
    header: r.header,
  }));
}

// The fence: the delivery is still held by this claim. A send that failed is retried after
// min(base·2^(n−1), max) × [0.5, 1), or is `failed` once it has been tried max times, or at
// once when the answer was final ($10).
const finishSql = statement(
  'deliveryFinish',
  `UPDATE webhook_deliveries d SET
     status = (CASE WHEN $3::boolean THEN 'delivered' WHEN d.attempts >= $6 OR $10::boolean THEN 'failed' ELSE 'pending' END)::delivery_status,
     delivered_at = CASE WHEN $3::boolean THEN coalesce($9::timestamptz, now()) END,
     next_attempt_at = CASE WHEN $3::boolean OR d.attempts >= $6 OR $10::boolean THEN d.next_attempt_at
                            ELSE coalesce($9::timestamptz, now()) + ${backoffSql('d.attempts', '$7', '$8')} END,
     last_status = $4, last_error = $5, claim_id = NULL, claimed_until = NULL, updated_at = coalesce($9::timestamptz, now())
   WHERE d.id = $1 AND d.claim_id = $2 AND d.status = 'sending'
   RETURNING d.status::text AS status, d.attempts, d.next_attempt_at`,
);

/** How a send ended: `ok` for a 2xx answer. */
export interface SendResult {
  ok: boolean;
  /** The HTTP status, when an answer came. */
  httpStatus?: number;
  /** Why it failed (status line and the start of the answer's body, timeout, connection error), at most 500 characters. */
  error?: string;
  /** The answer is final: not retried (the deliverer's `finalAnswer` decides). */
  final?: boolean;
}

/**
 * Records a send: `delivered`, `pending` again after a backoff, or `failed` at `maxAttempts`.
 * `lost` when the claim is no longer this deliverer's (the sweep took it back meanwhile).
 */
export async function deliveryFinish(
  db: Queryable,
  p: { id: number; claimId: string; result: SendResult; maxAttempts: number; backoff: Backoff; now?: Date },
): Promise<{ status: 'delivered' | 'pending' | 'failed'; attempts: number; nextAttemptAt: Date } | { status: 'lost' }> {
  const [row] = await run<{ status: 'delivered' | 'pending' | 'failed'; attempts: number; next_attempt_at: Date }>(db, finishSql, [
    p.id,
    p.claimId,
    p.result.ok,
    p.result.httpStatus ?? null,
    p.result.error?.slice(0, 500) ?? null,
    p.maxAttempts,
    p.backoff.baseMs,
    p.backoff.maxMs,
    p.now ?? null,
    p.result.final === true,
  ]);
  return row ? { status: row.status, attempts: row.attempts, nextAttemptAt: row.next_attempt_at } : { status: 'lost' };
}

// What a deliverer's run has to do, in one round trip: each test is the condition of one of its
// statements, served by that statement's partial index. An idle deliverer runs this alone,
// twice a second, instead of the sweep, a transaction around the alert scan and a claim (five
// round trips each run: 10 of the 18 statements a second of an idle coordinator in the
// benchmark's setup, its reaper every 250 ms).
const workSql = statement(
  'deliveryWork',
  `SELECT
     EXISTS (SELECT 1 FROM webhook_deliveries WHERE status = 'sending' AND claimed_until < now()) AS reclaim,
     EXISTS (SELECT 1 FROM webhook_events WHERE type = 'job.dead' AND alerted_at IS NULL) AS alerts,
     EXISTS (SELECT 1 FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at <= now()) AS due`,
);

/** Whether there are expired claims to take back, dead letters to alert, deliveries due now. */
export async function deliveryWork(db: Queryable): Promise<{ reclaim: boolean; alerts: boolean; due: boolean }> {
  const [row] = await run<{ reclaim: boolean; alerts: boolean; due: boolean }>(db, workSql, []);
  return row!;
}

// The reconciliation sweep: a delivery still `sending` past its claim was held by a deliverer
// that died (or stalled) between claiming and recording the send. Whether the receiver got it
// is unknown, so it is sent again (receivers dedupe by event id), or `failed` at the cap.
// Served by webhook_deliveries_sending_idx; SKIP LOCKED so sweeps of replicas never collide.
const reclaimSql = statement(
  'deliveryReclaimExpired',
  `WITH c AS (
     SELECT id FROM webhook_deliveries
     WHERE status = 'sending' AND claimed_until < coalesce($3::timestamptz, now())
       AND claim_id <> ALL ($4::uuid[])
     ORDER BY claimed_until
     LIMIT $1
     FOR UPDATE SKIP LOCKED
   )
   UPDATE webhook_deliveries d SET
     status = (CASE WHEN d.attempts >= $2 THEN 'failed' ELSE 'pending' END)::delivery_status,
     next_attempt_at = coalesce($3::timestamptz, now()), claim_id = NULL, claimed_until = NULL,
     last_error = coalesce(d.last_error, 'the deliverer holding it stopped before recording the send'),
     updated_at = coalesce($3::timestamptz, now())
   FROM c WHERE d.id = c.id
   RETURNING d.id, d.event_id, d.url, d.attempts, d.status::text AS status`,
);

/**
 * Takes back up to `limit` deliveries whose claim outlived its deliverer; `except`: claims the
 * caller still holds and is sending (its own sweep leaves them to it).
 */
export async function deliveryReclaimExpired(
  db: Queryable,
  p: { limit: number; maxAttempts: number; now?: Date; except?: readonly string[] },
): Promise<Array<{ id: number; eventId: string; url: string; attempts: number; status: 'pending' | 'failed' }>> {
  const rows = await run<{ id: number; event_id: string; url: string; attempts: number; status: 'pending' | 'failed' }>(db, reclaimSql, [
    p.limit,
    p.maxAttempts,
    p.now ?? null,
    p.except ?? [],
  ]);
  return rows.map((r) => ({ id: r.id, eventId: r.event_id, url: r.url, attempts: r.attempts, status: r.status }));
}

// Dead-letter events whose alert was not raised yet, oldest first, locked SKIP LOCKED so one
// deliverer raises each. With an alert URL, its delivery is added in the same statement.
// Served by webhook_events_unalerted_idx.
const alertsSql = statement(
  'eventAlertsClaim',
  `WITH c AS (
     SELECT id FROM webhook_events WHERE type = 'job.dead' AND alerted_at IS NULL
     ORDER BY created_at LIMIT $1 FOR UPDATE SKIP LOCKED
   ), u AS (
     UPDATE webhook_events e SET alerted_at = now() FROM c WHERE e.id = c.id RETURNING e.id, e.job_id, e.body
   ), d AS (
     INSERT INTO webhook_deliveries (event_id, url) SELECT u.id, $2 FROM u WHERE $2::text IS NOT NULL
   )
   SELECT id, job_id, body FROM u`,
);

/**
 * Marks up to `limit` dead-letter events as alerted and returns them; with `alertUrl`, queues a
 * delivery of each there. Run it inside a transaction and raise the alerts before committing,
 * so an alert is raised at least once.
 */
export async function eventAlertsClaim(
  db: Queryable,
  p: { limit: number; alertUrl?: string | undefined },
): Promise<Array<{ eventId: string; jobId: string; body: string }>> {
  const rows = await run<{ id: string; job_id: string; body: string }>(db, alertsSql, [p.limit, p.alertUrl ?? null]);
  return rows.map((r) => ({ eventId: r.id, jobId: r.job_id, body: r.body }));
}

// ───────────────────────────── operators ─────────────────────────────

/** A delivery as operators see it. */
export interface DeliveryView {
  id: number;
  eventId: string;
  type: WebhookEventType;
  jobId: string;
  url: string;
  subscriptionId: string | null;
  status: 'pending' | 'sending' | 'delivered' | 'failed';
  attempts: number;
  nextAttemptAt: Date;
  lastStatus: number | null;
  lastError: string | null;
  createdAt: Date;
  deliveredAt: Date | null;
}

const listSql = statement(
  'deliveryList',
  `SELECT d.id, d.event_id, e.type::text AS type, e.job_id, d.url, d.subscription_id, d.status::text AS status, d.attempts,
          d.next_attempt_at, d.last_status, d.last_error, d.created_at, d.delivered_at
   FROM webhook_deliveries d JOIN webhook_events e ON e.id = d.event_id
   WHERE ($1::delivery_status IS NULL OR d.status = $1) AND ($2::uuid IS NULL OR e.job_id = $2)
   ORDER BY d.id DESC LIMIT $3`,
);

/** The newest deliveries, optionally of one status or one job. */
export async function deliveryList(
  db: Queryable,
  p: { status?: DeliveryView['status']; jobId?: string; limit?: number } = {},
): Promise<Outcome<DeliveryView[]>> {
  const bad = checkAll(
    p.status === undefined ? undefined : check('status', z.enum(['pending', 'sending', 'delivered', 'failed']), p.status),
    p.jobId === undefined ? undefined : check('jobId', schemas.id, p.jobId),
    p.limit === undefined ? undefined : check('limit', z.int('must be an integer').min(1, 'must be at least 1').max(1000, 'must be at most 1000'), p.limit),
  );
  if (bad) return bad;
  const rows = await run<Record<string, unknown>>(db, listSql, [p.status ?? null, p.jobId ?? null, p.limit ?? 100]);
  return ok(
    rows.map((r) => ({
      id: r.id as number,
      eventId: r.event_id as string,
      type: r.type as WebhookEventType,
      jobId: r.job_id as string,
      url: r.url as string,
      subscriptionId: (r.subscription_id as string | null) ?? null,
      status: r.status as DeliveryView['status'],
      attempts: r.attempts as number,
      nextAttemptAt: r.next_attempt_at as Date,
      lastStatus: (r.last_status as number | null) ?? null,
      lastError: (r.last_error as string | null) ?? null,
      createdAt: r.created_at as Date,
      deliveredAt: (r.delivered_at as Date | null) ?? null,
    })),
  );
}

const retrySql = statement(
  'deliveryRetry',
  `UPDATE webhook_deliveries SET status = 'pending', attempts = 0, next_attempt_at = now(), updated_at = now()
   WHERE status = 'failed' AND ($1::bigint IS NULL OR id = $1)
   RETURNING id`,
);

/** Puts failed deliveries (one, or all with `id` undefined) back in line with a fresh attempt count. */
export async function deliveryRetry(db: Queryable, p: { id?: number }): Promise<Outcome<{ ids: number[] }>> {
  const bad = p.id === undefined ? undefined : check('id', z.int().min(1), p.id);
  if (bad) return bad;
  const rows = await run<{ id: number }>(db, retrySql, [p.id ?? null]);
  if (p.id !== undefined && rows.length === 0) return notFound(`no failed delivery ${p.id}`);
  return ok({ ids: rows.map((r) => r.id) });
}
