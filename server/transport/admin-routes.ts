/**
 * AdminService: operators see and repair jobs, agents and keys without SQL (grpcurl, buf curl,
 * the `leasehold` CLI, the dashboard). Every method needs the `admin` scope (the auth
 * interceptor checks it: AdminService is not in METHOD_SCOPES). Handlers translate protobuf to
 * store verbs and back; commands for the coordinator holding an agent's stream (cancel, drain,
 * disconnect) go through NOTIFY, like JobService's cancel. Revoking a key or an agent also
 * drops it from this process's credential cache at once (the other coordinators hear it from the
 * revoking statement's NOTIFY). Each change is logged with the key that made it.
 */
import { create } from '@bufbuild/protobuf';
import { durationFromMs, durationMs, timestampDate, timestampFromDate } from '@bufbuild/protobuf/wkt';
import type { ConnectRouter } from '@connectrpc/connect';
import {
  AdminService,
  AgentInfoSchema,
  AgentSessionSchema,
  ApiKeySchema,
  HeldAttemptSchema,
  MinuteCountsSchema,
  QueueDepthSchema,
  QueueWaitSchema,
} from '../../gen/leasehold/v1/admin_service_pb.js';
import type { JobStatus as PbJobStatus } from '../../gen/leasehold/v1/job_pb.js';
import type { Activity } from '../core/activity.js';
import type { CredentialCache } from '../core/credential-cache.js';
import { DEFAULT_PURGE_BATCH, DEFAULT_RETENTION_MS, purgeInBatches } from '../core/purger.js';
import { notFound } from '../domain/outcomes.js';
import type { EgressPolicy } from '../lib/egress.js';
import type { Logger } from '../log.js';
import {
  agentCreate,
  agentOverview,
  agentRevoke,
  controlNotify,
  dbNow,
  jobCancel,
  jobGet,
  jobRequeue,
  jobSearch,
  keyCreate,
  keyList,
  keyRevoke,
  sessionsDrain,
  staleReportList,
  statsGet,
  type Queryable,
} from '../store/index.js';
import type { JobStatus } from '../domain/statuses.js';
import { callerName, credentialOwner, type Principal } from './auth.js';
import { webhookAdminMethods } from './webhook-admin-routes.js';
import { statusFilter, toPbAttemptStatus, toPbDetail, toPbJob, toPbStaleReport, toPbStatus, ts } from './codec.js';
import { unwrap } from './outcome-wire.js';

export interface AdminRoutesDeps {
  db: Queryable;
  log: Logger;
  /** A subscription's URL written with an address webhooks may not reach is refused (`refusedUrl`). */
  egress?: EgressPolicy | undefined;
  leaseTtlMs: number;
  heartbeatIntervalMs: number;
  /** PurgeJobs without older_than uses this; default 7 days. */
  retentionMs?: number | undefined;
  /** Session rows not stamped for this long are a dead coordinator's; default 20 s. */
  sessionStaleAfterMs?: number;
  activity?: Activity | undefined;
  /** This process's verified credentials: a revoke here drops them without waiting for the NOTIFY. */
  credentials?: CredentialCache<Principal> | undefined;
}

const dbStatuses = (s: PbJobStatus[]): JobStatus[] => s.map((x, i) => statusFilter(x, `statuses.${i}`)).filter((x): x is JobStatus => x !== undefined);

export function adminRoutes(deps: AdminRoutesDeps) {
  const { db, log } = deps;
  const staleAfterMs = deps.sessionStaleAfterMs ?? 20_000;
  return (router: ConnectRouter) =>
    router.service(AdminService, {
      ...webhookAdminMethods(deps),
      async listJobs(req) {
        const { value } = unwrap(
          await jobSearch(db, {
            ...(req.statuses.length ? { statuses: dbStatuses(req.statuses) } : {}),
            ...(req.queue ? { queue: req.queue } : {}),
            ...(req.agentId ? { agentId: req.agentId } : {}),
            ...(req.createdAfter ? { createdAfter: timestampDate(req.createdAfter) } : {}),
            ...(req.createdBefore ? { createdBefore: timestampDate(req.createdBefore) } : {}),
            ...(req.pageSize ? { pageSize: req.pageSize } : {}),
            ...(req.pageToken ? { pageToken: req.pageToken } : {}),
          }),
        );
        return { jobs: value.jobs.map(toPbJob), nextPageToken: value.nextPageToken };
      },

      async getJob(req) {
        const { value } = unwrap(await jobGet(db, { jobId: req.jobId }));
        return {
          ...toPbDetail(value),
          heartbeatAt: ts(value.job.heartbeatAt),
          leaseTtl: durationFromMs(deps.leaseTtlMs),
          heartbeatInterval: durationFromMs(deps.heartbeatIntervalMs),
          now: timestampFromDate(await dbNow(db)),
        };
      },

      async requeueJob(req, ctx) {
        const { value } = unwrap(await jobRequeue(db, { jobId: req.jobId }));
        log.info({ jobId: value.id, queue: value.queue, attemptNo: value.attemptNo, by: callerName(ctx) }, 'job requeued by an operator');
        deps.activity?.emit('job:requeued', value);
        return { job: toPbJob(value) };
      },

      async cancelJob(req, ctx) {
        const o = await jobCancel(db, { jobId: req.jobId });
        const { value, outcome } = unwrap(o);
        const held = value.canceledAttempt;
        if (held) await controlNotify(db, { type: 'cancel', agentId: held.agentId, attemptIds: [held.attemptId] });
        if (o.outcome === 'ok') {
          log.info({ jobId: value.job.id, attemptId: held?.attemptId, agentId: held?.agentId, by: callerName(ctx) }, 'job canceled by an operator');
          deps.activity?.emit('job:canceled', value.job);
        }
        return { job: toPbJob(value.job), outcome };
      },

      async purgeJobs(req, ctx) {
        const olderThanMs = req.olderThan ? durationMs(req.olderThan) : (deps.retentionMs ?? DEFAULT_RETENTION_MS);
        const params = {
          olderThanMs,
          ...(req.statuses.length ? { statuses: dbStatuses(req.statuses) } : {}),
          ...(req.queue ? { queue: req.queue } : {}),
          dryRun: req.dryRun,
        };
        const {
          value: { purged, cutoff },
        } = unwrap(await purgeInBatches(db, params, DEFAULT_PURGE_BATCH));
        if (!req.dryRun) {
          log.info({ purged, cutoff, statuses: params.statuses, queue: params.queue, by: callerName(ctx) }, 'finished jobs purged by an operator');
          deps.activity?.emit('jobs:purged', { purged });
        }
        return { purged: BigInt(purged), cutoff: timestampFromDate(cutoff), dryRun: req.dryRun };
      },

      async listAgents(req) {
        const { value } = unwrap(
          await agentOverview(db, { ...(req.agentId ? { agentId: req.agentId } : {}), includeRevoked: req.includeRevoked, staleAfterMs }),
        );
        return {
          agents: value.map((a) =>
            create(AgentInfoSchema, {
              agentId: a.agentId,
              registered: a.registered,
              createdAt: ts(a.createdAt),
              revokedAt: ts(a.revokedAt),
              lastSeenAt: ts(a.lastSeenAt),
              sessions: a.sessions.map((s) =>
                create(AgentSessionSchema, {
                  sessionId: s.id,
                  coordinatorId: s.coordinatorId,
                  queues: s.queues,
                  labels: (s.labels ?? {}) as Record<string, string>,
                  slots: s.slots,
                  connectedAt: ts(s.connectedAt),
                  seenAt: ts(s.seenAt),
                  drainingSince: ts(s.drainingSince),
                }),
              ),
              slots: a.sessions.reduce((n, s) => n + s.slots, 0),
              attempts: a.attempts.map((h) =>
                create(HeldAttemptSchema, {
                  attemptId: h.attemptId,
                  jobId: h.jobId,
                  queue: h.queue,
                  attemptNo: h.attemptNo,
                  status: toPbAttemptStatus(h.status),
                  claimedAt: ts(h.claimedAt),
                  startedAt: ts(h.startedAt),
                  leaseExpiresAt: ts(h.leaseExpiresAt),
                  suspectSince: ts(h.suspectSince),
                }),
              ),
              suspect: a.attempts.filter((h) => h.suspectSince).length,
            }),
          ),
        };
      },

      async drainAgent(req, ctx) {
        const { value: ids } = unwrap(await sessionsDrain(db, { agentId: req.agentId, staleAfterMs }));
        if (!ids.length) {
          const { value: known } = unwrap(await agentOverview(db, { agentId: req.agentId, includeRevoked: true, staleAfterMs }));
          if (!known.length) unwrap(notFound(`agent ${req.agentId} not found`));
        }
        // Sent even when no row is registered yet: a stream that just opened is told too.
        await controlNotify(db, { type: 'drain', agentId: req.agentId });
        log.info({ agentId: req.agentId, sessions: ids.length, by: callerName(ctx) }, 'agent drain requested');
        return { sessions: ids.length };
      },

      async createAgent(req, ctx) {
        const { value } = unwrap(await agentCreate(db, { agentId: req.agentId }));
        log.info({ agentId: value.agentId, by: callerName(ctx) }, 'agent created');
        return { agentId: value.agentId, token: value.token };
      },

      async revokeAgent(req, ctx) {
        const { value } = unwrap(await agentRevoke(db, { agentId: req.agentId }));
        deps.credentials?.drop(credentialOwner('agent', value.agentId));
        await controlNotify(db, { type: 'disconnect', agentId: value.agentId, reason: `agent ${value.agentId} was revoked` });
        log.info({ agentId: value.agentId, by: callerName(ctx) }, 'agent revoked');
        return { agentId: value.agentId, revokedAt: timestampFromDate(value.revokedAt) };
      },

      async createKey(req, ctx) {
        const { value } = unwrap(await keyCreate(db, { name: req.name, scopes: req.scopes }));
        log.info({ key: value.name, scopes: value.scopes, by: callerName(ctx) }, 'API key created');
        return { name: value.name, key: value.key, scopes: value.scopes };
      },

      async listKeys() {
        const keys = await keyList(db);
        return {
          keys: keys.map((k) =>
            create(ApiKeySchema, { name: k.name, scopes: k.scopes, createdAt: ts(k.createdAt), revokedAt: ts(k.revokedAt), lastUsedAt: ts(k.lastUsedAt) }),
          ),
        };
      },

      async revokeKey(req, ctx) {
        const { value } = unwrap(await keyRevoke(db, { name: req.name }));
        deps.credentials?.drop(credentialOwner('key', value.name));
        log.info({ key: value.name, by: callerName(ctx) }, 'API key revoked');
        return { name: value.name };
      },

      async getStats(req) {
        const { value: s } = unwrap(await statsGet(db, req.windowMinutes ? { windowMinutes: req.windowMinutes } : {}));
        // Averages over the window so far: from the start of its first minute to now.
        const w = Math.max(s.spanMinutes, 1 / 60);
        return {
          depths: s.depths.map((d) => create(QueueDepthSchema, { queue: d.queue, status: toPbStatus(d.status), count: BigInt(d.count) })),
          waiting: s.waiting.map((q) =>
            create(QueueWaitSchema, {
              queue: q.queue,
              due: BigInt(q.due),
              oldestJobId: q.oldestJobId,
              oldestDueAt: ts(q.oldestDueAt),
              oldestAge: durationFromMs(q.oldestAgeMs),
            }),
          ),
          minutes: s.minutes.map((m) => create(MinuteCountsSchema, { ...m, minute: ts(m.minute) })),
          windowMinutes: s.windowMinutes,
          completionsPerMinute: s.window.succeeded / w,
          failuresPerMinute: (s.window.failed + s.window.retried) / w,
          expiriesPerMinute: (s.window.claimExpired + s.window.leaseExpired + s.window.timedOut) / w,
          staleReports: BigInt(s.staleReports),
          now: timestampFromDate(s.now),
        };
      },

      async listStaleReports(req) {
        const { value } = unwrap(
          await staleReportList(db, {
            ...(req.jobId ? { jobId: req.jobId } : {}),
            ...(req.agentId ? { agentId: req.agentId } : {}),
            ...(req.pageSize ? { pageSize: req.pageSize } : {}),
            ...(req.pageToken ? { pageToken: req.pageToken } : {}),
          }),
        );
        return { reports: value.reports.map(toPbStaleReport), nextPageToken: value.nextPageToken };
      },
    });
}
