/**
 * JobService: enqueue, read, list and cancel jobs (gateway callers and operators; the auth
 * interceptor checks the `enqueue` / `read` scopes). A cancel is pushed to whichever
 * coordinator holds the agent's stream through NOTIFY.
 */
import { durationMs, timestampDate } from '@bufbuild/protobuf/wkt';
import type { ConnectRouter } from '@connectrpc/connect';
import type { Outcome } from '../../gen/leasehold/v1/job_pb.js';
import { JobService, type EnqueueJobRequest } from '../../gen/leasehold/v1/job_service_pb.js';
import type { Activity } from '../core/activity.js';
import type { EgressPolicy } from '../lib/egress.js';
import type { Logger } from '../log.js';
import type { Dispatcher } from '../core/dispatcher.js';
import type { QueueWaker } from '../core/queue-waker.js';
import { controlNotify, jobCancel, jobEnqueue, jobGet, jobList, type Claimed, type Job, type Queryable } from '../store/index.js';
import { statusFilter, toPbDetail, toPbJob } from './codec.js';
import { unwrap } from './outcome-wire.js';
import { refusedUrl } from './webhook-admin-routes.js';

export interface JobRoutesDeps {
  db: Queryable;
  log: Logger;
  /** A notifyUrl written with an address webhooks may not reach is refused at enqueue (`refusedUrl`). */
  egress?: EgressPolicy | undefined;
  activity?: Activity | undefined;
  dispatcher?: Dispatcher | undefined;
  waker?: QueueWaker | undefined;
}

/** What EnqueueJob answers, before it is written as protobuf or JSON. */
export interface EnqueueResult {
  job: Job;
  outcome: Outcome;
}

/**
 * JobService's EnqueueJob, for the router and for the HTTP gateway's direct path
 * (gateway-enqueue.ts).
 */
export function enqueueJobCall(deps: JobRoutesDeps): (req: EnqueueJobRequest) => Promise<EnqueueResult> {
  const { db, log } = deps;
  return async (req) => {
    // A notifyUrl webhooks may not reach: no new job (a keyed repeat still learns its job).
    const refused = refusedUrl(deps.egress, 'notifyUrl', req.notifyUrl);
    const labels = Object.keys(req.labels).length ? req.labels : undefined;
    // A waiting agent here can have the job at once, claimed by the enqueue itself.
    const h = refused ? undefined : deps.dispatcher?.reserve(req.queue, labels);
    const o = await jobEnqueue(db, {
      queue: req.queue,
      payload: req.payload ?? {},
      priority: req.priority,
      ...(req.maxAttempts ? { maxAttempts: req.maxAttempts } : {}),
      ...(req.runAt ? { runAt: timestampDate(req.runAt) } : {}),
      ...(req.executionTimeout ? { executionTimeoutMs: durationMs(req.executionTimeout) } : {}),
      ...(req.idempotencyKey ? { idempotencyKey: req.idempotencyKey } : {}),
      ...(labels ? { labels } : {}),
      ...(req.notifyUrl ? { notifyUrl: req.notifyUrl } : {}),
      ...(req.notifyHeader ? { notifyHeader: { name: req.notifyHeader.name, value: req.notifyHeader.value } } : {}),
      ...(h ? { handOff: h } : {}),
      ...(refused ? { refused } : {}),
      // With a waker, the dispatchers are woken after the commit (see QueueWaker).
      notify: !deps.waker,
    }).catch((err: unknown) => {
      if (h) deps.dispatcher!.settle(h, undefined);
      throw err;
    });
    if (h) deps.dispatcher!.settle(h, o.outcome === 'ok' && o.value.currentAttemptId === h.attemptId ? claimedOf(o.value, h.attemptId) : undefined);
    const { value, outcome } = unwrap(o);
    if (o.outcome === 'ok') {
      // Due by PostgreSQL's clock, which the claim reads run_at by (this process's may be behind it).
      if (value.status === 'queued' && o.due) deps.waker?.wake(value.queue);
      log.info({ jobId: value.id, queue: value.queue }, 'job enqueued');
      deps.activity?.emit('job:enqueued', value);
    }
    return { job: value, outcome };
  };
}

export function jobRoutes(deps: JobRoutesDeps) {
  const { db, log } = deps;
  const enqueueJob = enqueueJobCall(deps);
  return (router: ConnectRouter) =>
    router.service(JobService, {
      async enqueueJob(req) {
        const { job, outcome } = await enqueueJob(req);
        return { job: toPbJob(job), outcome };
      },
      async getJob(req) {
        return toPbDetail(unwrap(await jobGet(db, { jobId: req.jobId })).value);
      },
      async listJobs(req) {
        const status = statusFilter(req.status, 'status');
        const { value } = unwrap(
          await jobList(db, {
            ...(req.queue ? { queue: req.queue } : {}),
            ...(status ? { status } : {}),
            ...(req.pageSize ? { pageSize: req.pageSize } : {}),
            ...(req.pageToken ? { pageToken: req.pageToken } : {}),
          }),
        );
        return { jobs: value.jobs.map(toPbJob), nextPageToken: value.nextPageToken };
      },
      async cancelJob(req) {
        const o = await jobCancel(db, { jobId: req.jobId });
        const { value, outcome } = unwrap(o);
        const held = value.canceledAttempt;
        if (held) await controlNotify(db, { type: 'cancel', agentId: held.agentId, attemptIds: [held.attemptId] });
        if (o.outcome === 'ok') {
          log.info({ jobId: value.job.id, attemptId: held?.attemptId, agentId: held?.agentId }, 'job canceled');
          deps.activity?.emit('job:canceled', value.job);
        }
        return { job: toPbJob(value.job), outcome };
      },
    });
}

/** The job an enqueue claimed for a waiting agent, as the dispatcher hands jobs out. */
function claimedOf(job: Job, attemptId: string): Claimed {
  return { job, slot: 0, agentId: job.agentId!, attemptId, attemptNo: job.attemptNo, claimDeadline: job.claimDeadline! };
}
