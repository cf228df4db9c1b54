/**
 * `leasehold subscriptions add|list|remove|rotate`, `webhooks secret` and `deliveries
 * list|retry`: notifications, set up through a running coordinator's AdminService like every
 * other remote command (`--url`, `--key`; see cli-remote.ts), so they work against a coordinator
 * on another machine. Secrets are printed only by the commands that exist to show them.
 */
import type { Command } from 'commander';
import {
  CreateSubscriptionResponseSchema,
  DeliverySchema,
  GetNotifySecretResponseSchema,
  RetryDeliveriesResponseSchema,
  RotateSubscriptionSecretResponseSchema,
  SubscriptionSchema,
  DeleteSubscriptionResponseSchema,
} from '../gen/leasehold/v1/admin_service_pb.js';
import { action, list, out, printJson, printJsonArray, remote, table, time, UsageError, type ApiFlags } from './cli-remote.js';
import { WEBHOOK_EVENT_TYPES } from './domain/statuses.js';

/** Adds the notification commands to `program`. */
export function registerWebhookCommands(program: Command): void {
  const subs = program.command('subscriptions').description('per-queue notifications: signed POSTs when jobs end');

  remote(subs.command('add <queue> <url>').description("subscribe url to a queue's job events ('*': every queue); prints the URL's signing secret"))
    .option('--events <events>', `comma-separated, default all: ${WEBHOOK_EVENT_TYPES.join(', ')}`)
    .action(
      action(async (api, queue: string, url: string, f: ApiFlags & { events?: string }) => {
        const r = await api.admin.createSubscription({ queue, url, events: f.events ? list(f.events) : [] });
        if (f.json) return printJson(CreateSubscriptionResponseSchema, r);
        const s = r.subscription!;
        out(
          `subscription ${s.id} created: ${s.events.join(',')} of queue ${s.queue} to ${s.url}\n` +
            `the signing secret of that URL (verify the leasehold-signature header with it):\n${s.secret}`,
        );
      }),
    );

  remote(subs.command('list').description('list subscriptions'))
    .option('--show-secrets', 'include the signing secrets')
    .action(
      action(async (api, f: ApiFlags & { showSecrets?: boolean }) => {
        const r = await api.admin.listSubscriptions({ withSecrets: Boolean(f.showSecrets) });
        if (f.json) return printJsonArray(SubscriptionSchema, r.subscriptions);
        table([
          ['ID', 'QUEUE', 'EVENTS', 'URL', ...(f.showSecrets ? ['SECRET'] : [])],
          ...r.subscriptions.map((s) => [s.id, s.queue, s.events.join(','), s.url, ...(f.showSecrets ? [s.secret] : [])]),
        ]);
      }),
    );

  remote(subs.command('remove <id>').description('remove a subscription (its undelivered notifications are dropped)')).action(
    action(async (api, id: string, f: ApiFlags) => {
      const r = await api.admin.deleteSubscription({ id });
      if (f.json) return printJson(DeleteSubscriptionResponseSchema, r);
      out(`subscription ${r.id} removed`);
    }),
  );

  remote(subs.command('rotate <id>').description("give the subscription's URL a new signing secret (every subscription of that URL shares it)")).action(
    action(async (api, id: string, f: ApiFlags) => {
      const r = await api.admin.rotateSubscriptionSecret({ id });
      if (f.json) return printJson(RotateSubscriptionSecretResponseSchema, r);
      const s = r.subscription!;
      const also = r.alsoRotated.length ? ` (and of subscriptions ${r.alsoRotated.join(', ')}, same URL)` : '';
      out(`the new signing secret of ${s.url}${also}; deliveries sent from now on use it:\n${s.secret}`);
    }),
  );

  const webhooks = program.command('webhooks').description('the notify secret: it signs deliveries to URLs no subscription names');

  remote(webhooks.command('secret').description('print the secret of notify_url and LEASEHOLD_ALERT_URL deliveries to URLs no subscription names'))
    .option('--rotate', 'replace it (deliveries sent from now on use the new one)')
    .action(
      action(async (api, f: ApiFlags & { rotate?: boolean }) => {
        const r = await api.admin.getNotifySecret({ rotate: Boolean(f.rotate) });
        if (f.json) return printJson(GetNotifySecretResponseSchema, r);
        out(r.secret);
      }),
    );

  const deliveries = program.command('deliveries').description('the notification outbox: what was sent, what is waiting, what failed');

  remote(deliveries.command('list').description('the newest deliveries'))
    .option('--status <status>', 'pending, sending, delivered or failed')
    .option('--job <jobId>', 'only those of one job')
    .option('--limit <n>', 'at most this many (default 100, at most 1000)')
    .action(
      action(async (api, f: ApiFlags & { status?: string; job?: string; limit?: string }) => {
        if (f.limit !== undefined && !/^\d{1,4}$/.test(f.limit)) throw new UsageError(`--limit ${JSON.stringify(f.limit)} must be a number from 1 to 1000`);
        const r = await api.admin.listDeliveries({ status: f.status ?? '', jobId: f.job ?? '', limit: f.limit ? Number(f.limit) : 0 });
        if (f.json) return printJsonArray(DeliverySchema, r.deliveries);
        table([
          ['ID', 'STATUS', 'ATTEMPTS', 'EVENT', 'JOB', 'URL', 'CREATED', 'LAST ERROR'],
          ...r.deliveries.map((d) => [String(d.id), d.status, String(d.attempts), d.type, d.jobId, d.url, time(d.createdAt), d.lastError || '-']),
        ]);
      }),
    );

  remote(deliveries.command('retry [id]').description('send failed deliveries again (one, or all with --all-failed)'))
    .option('--all-failed', 'every failed delivery')
    .action(
      action(async (api, id: string | undefined, f: ApiFlags & { allFailed?: boolean }) => {
        if (id === undefined && !f.allFailed) throw new UsageError('id is required (or --all-failed)');
        if (id !== undefined && !/^\d{1,15}$/.test(id)) throw new UsageError('id must be a delivery number (leasehold deliveries list --status failed)');
        const r = await api.admin.retryDeliveries(id === undefined ? { allFailed: true } : { id: BigInt(id) });
        if (f.json) return printJson(RetryDeliveriesResponseSchema, r);
        out(`${r.ids.length} deliver${r.ids.length === 1 ? 'y' : 'ies'} queued again${r.ids.length ? `: ${r.ids.join(', ')}` : ''}`);
      }),
    );
}
