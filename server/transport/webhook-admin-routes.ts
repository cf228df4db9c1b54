/**
 * AdminService's notification methods: subscriptions (create, list, delete, rotate the secret of
 * their URL), the notify secret, and the delivery outbox (list, retry). The `leasehold
 * subscriptions`, `webhooks` and `deliveries` commands call these with `--url` and `--key`, so
 * notifications are set up against a remote coordinator like everything else. Secrets appear
 * in answers only where the operator asked for them (create, rotate, `with_secrets`,
 * GetNotifySecret) and never in logs.
 */
import { create } from '@bufbuild/protobuf';
import type { ServiceImpl } from '@connectrpc/connect';
import { AdminService, DeliverySchema, SubscriptionSchema } from '../../gen/leasehold/v1/admin_service_pb.js';
import { invalid, type Failure } from '../domain/outcomes.js';
import type { EgressPolicy } from '../lib/egress.js';
import { DELIVERY_STATUSES } from '../domain/statuses.js';
import type { Logger } from '../log.js';
import {
  deliveryList,
  deliveryRetry,
  signingSecretGet,
  subscriptionCreate,
  subscriptionList,
  subscriptionRemove,
  subscriptionRotate,
  type DeliveryView,
  type Queryable,
  type Subscription,
} from '../store/index.js';
import { callerName } from './auth.js';
import { ts } from './codec.js';
import { toConnectError, unwrap } from './outcome-wire.js';

type WebhookMethods = Pick<
  ServiceImpl<typeof AdminService>,
  'createSubscription' | 'listSubscriptions' | 'deleteSubscription' | 'rotateSubscriptionSecret' | 'getNotifySecret' | 'listDeliveries' | 'retryDeliveries'
>;

const toPbSubscription = (s: Subscription) =>
  create(SubscriptionSchema, { id: s.id, queue: s.queue, url: s.url, events: s.events, createdAt: ts(s.createdAt), secret: s.secret ?? '' });
const toPbDelivery = (d: DeliveryView) =>
  create(DeliverySchema, {
    id: BigInt(d.id),
    eventId: d.eventId,
    type: d.type,
    jobId: d.jobId,
    url: d.url,
    subscriptionId: d.subscriptionId ?? '',
    status: d.status,
    attempts: d.attempts,
    nextAttemptAt: ts(d.nextAttemptAt),
    lastStatus: d.lastStatus ?? 0,
    lastError: d.lastError ?? '',
    createdAt: ts(d.createdAt),
    deliveredAt: ts(d.deliveredAt),
  });

/**
 * A webhook URL written with an address the deliverer may not connect to (`LEASEHOLD_WEBHOOK_DENY`),
 * refused as `field`'s bad value where it is given, rather than stored to fail at its first send.
 * A name is not looked up here: its answer is only known when a send connects (and checked then).
 */
export function refusedUrl(egress: EgressPolicy | undefined, field: string, url: string): Failure | undefined {
  const refused = url ? egress?.refusal(url) : undefined;
  return refused && invalid(field, `is refused: ${refused.message}`);
}

/** The notification methods of AdminService, to spread into its implementation. */
export function webhookAdminMethods(deps: { db: Queryable; log: Logger; egress?: EgressPolicy | undefined }): WebhookMethods {
  const { db, log } = deps;
  return {
    async createSubscription(req, ctx) {
      const refused = refusedUrl(deps.egress, 'url', req.url);
      if (refused) throw toConnectError(refused);
      const { value } = unwrap(await subscriptionCreate(db, { queue: req.queue, url: req.url, ...(req.events.length ? { events: req.events } : {}) }));
      log.info({ subscriptionId: value.id, queue: value.queue, url: value.url, events: value.events, by: callerName(ctx) }, 'subscription created');
      return { subscription: toPbSubscription(value) };
    },

    async listSubscriptions(req) {
      return { subscriptions: (await subscriptionList(db, { withSecrets: req.withSecrets })).map(toPbSubscription) };
    },

    async deleteSubscription(req, ctx) {
      const { value } = unwrap(await subscriptionRemove(db, { id: req.id }));
      log.info({ subscriptionId: value.id, by: callerName(ctx) }, 'subscription removed');
      return { id: value.id };
    },

    async rotateSubscriptionSecret(req, ctx) {
      const { value } = unwrap(await subscriptionRotate(db, { id: req.id }));
      log.info({ subscriptionId: value.subscription.id, url: value.subscription.url, alsoRotated: value.alsoRotated, by: callerName(ctx) }, 'subscription secret rotated');
      return { subscription: toPbSubscription(value.subscription), alsoRotated: value.alsoRotated };
    },

    async getNotifySecret(req, ctx) {
      const secret = await signingSecretGet(db, { rotate: req.rotate });
      if (req.rotate) log.info({ by: callerName(ctx) }, 'notify secret rotated');
      return { secret };
    },

    async listDeliveries(req) {
      if (req.status && !(DELIVERY_STATUSES as readonly string[]).includes(req.status)) {
        unwrap(invalid('status', `must be one of ${DELIVERY_STATUSES.join(', ')}`));
      }
      const { value } = unwrap(
        await deliveryList(db, {
          ...(req.status ? { status: req.status as DeliveryView['status'] } : {}),
          ...(req.jobId ? { jobId: req.jobId } : {}),
          ...(req.limit ? { limit: req.limit } : {}),
        }),
      );
      return { deliveries: value.map(toPbDelivery) };
    },

    async retryDeliveries(req, ctx) {
      if (req.id === 0n && !req.allFailed) unwrap(invalid('id', 'is required (or all_failed)'));
      if (req.id !== 0n && req.allFailed) unwrap(invalid('all_failed', 'cannot be set with an id'));
      if (req.id < 0n || req.id > BigInt(Number.MAX_SAFE_INTEGER)) unwrap(invalid('id', 'must be a delivery number'));
      const { value } = unwrap(await deliveryRetry(db, req.id === 0n ? {} : { id: Number(req.id) }));
      log.info({ deliveries: value.ids, by: callerName(ctx) }, 'deliveries queued again');
      return { ids: value.ids.map((id) => BigInt(id)) };
    },
  };
}
