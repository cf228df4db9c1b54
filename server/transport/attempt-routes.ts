/**
 * AttemptService: the fenced agent calls for callers that cannot hold a stream (a script, a
 * workflow). Same store verbs, same outcomes as the stream; the agent is the caller's token.
 */
import { create } from '@bufbuild/protobuf';
import { durationFromMs, timestampFromDate } from '@bufbuild/protobuf/wkt';
import { Code, ConnectError, type ConnectRouter } from '@connectrpc/connect';
import { AttemptService, ReserveStepResponse_DoneSchema, ReserveStepResponse_ReservedSchema, ReserveStepResponse_UnknownSchema } from '../../gen/leasehold/v1/attempt_service_pb.js';
import { Outcome } from '../../gen/leasehold/v1/job_pb.js';
import type { Activity } from '../core/activity.js';
import { REVOKE_DETAIL } from '../core/session.js';
import type { Outcome as StoreOutcome } from '../domain/outcomes.js';
import type { Logger } from '../log.js';
import {
  attemptComplete,
  attemptFail,
  attemptHeartbeat,
  attemptStart,
  jobClaim,
  stepRecord,
  stepReserve,
  type Job,
  type Queryable,
} from '../store/index.js';
import { principalKey, requireAgent } from './auth.js';
import { fromValue, toPbClaimed, toPbJob, toValue } from './codec.js';
import { toConnectError, unwrap } from './outcome-wire.js';

export interface AttemptRoutesDeps {
  db: Queryable;
  log: Logger;
  leaseTtlMs: number;
  claimTtlMs: number;
  heartbeatIntervalMs: number;
  activity?: Activity | undefined;
}

const ref = (req: { jobId: string; attemptId: string }, agentId: string) => ({
  attemptId: req.attemptId,
  agentId,
  ...(req.jobId ? { jobId: req.jobId } : {}),
});

export function attemptRoutes(deps: AttemptRoutesDeps) {
  const { db, log } = deps;
  /** A CompleteAttempt or FailAttempt answered: counted, a late one logged, the job returned. */
  const answerReport = (kind: 'completed' | 'failed', attemptId: string, agentId: string, o: StoreOutcome<Job>) => {
    deps.activity?.emit('attempt:report', { kind, attemptId, agentId, outcome: o });
    if (o.outcome === 'stale') log.warn({ attemptId, agentId, current: o.current }, kind === 'completed' ? 'late completion rejected' : 'late failure rejected');
    const { value, outcome } = unwrap(o);
    if (o.outcome === 'ok') log.info({ jobId: value.id, attemptId, attemptNo: value.attemptNo, agentId, status: value.status }, kind === 'completed' ? 'attempt completed' : 'attempt failed');
    return { outcome, job: toPbJob(value) };
  };
  return (router: ConnectRouter) =>
    router.service(AttemptService, {
      async claimJobs(req, ctx) {
        const agentId = requireAgent(ctx.values.get(principalKey));
        const { value } = unwrap(
          await jobClaim(db, {
            agentId,
            queues: req.queues,
            limit: req.maxJobs || 1,
            claimTtlMs: deps.claimTtlMs,
            labels: req.labels,
          }),
        );
        for (const c of value) log.info({ jobId: c.job.id, attemptId: c.attemptId, attemptNo: c.attemptNo, agentId }, 'job claimed');
        if (value.length) deps.activity?.emit('attempt:claim', { agentId, jobs: value.map((c) => c.job) });
        return { jobs: value.map(toPbClaimed) };
      },
      async startAttempt(req, ctx) {
        const agentId = requireAgent(ctx.values.get(principalKey));
        const o = await attemptStart(db, { ...ref(req, agentId), leaseTtlMs: deps.leaseTtlMs });
        deps.activity?.emit('attempt:start', { attemptId: req.attemptId, agentId, outcome: o });
        if (o.outcome === 'stale') log.warn({ attemptId: req.attemptId, agentId, current: o.current }, 'late start rejected');
        const { value, outcome } = unwrap(o);
        if (o.outcome === 'ok') log.info({ jobId: value.id, attemptId: req.attemptId, attemptNo: value.attemptNo, agentId }, 'attempt started');
        return {
          outcome,
          job: toPbJob(value),
          leaseTtl: durationFromMs(deps.leaseTtlMs),
          heartbeatInterval: durationFromMs(deps.heartbeatIntervalMs),
        };
      },
      async heartbeat(req, ctx) {
        const agentId = requireAgent(ctx.values.get(principalKey));
        const progress = fromValue(req.progress);
        const o = await attemptHeartbeat(db, {
          items: [{ attemptId: req.attemptId, agentId, ...(progress === undefined ? {} : { progress }) }],
          leaseTtlMs: deps.leaseTtlMs,
        });
        const { value } = unwrap(o);
        const renewed = value.renewed[0];
        if (renewed) return { outcome: Outcome.OK, leaseExpiresAt: timestampFromDate(renewed.leaseExpiresAt), leaseTtl: durationFromMs(deps.leaseTtlMs) };
        if (value.pending.length) {
          throw new ConnectError(`attempt ${req.attemptId} is claimed but not started: call StartAttempt first`, Code.FailedPrecondition);
        }
        const lost = value.lost[0]!;
        switch (lost.reason) {
          case 'not_found':
            throw toConnectError({ outcome: 'not_found', message: `attempt ${req.attemptId} not found` });
          case 'forbidden':
            throw toConnectError({ outcome: 'forbidden', message: `attempt ${req.attemptId} belongs to another agent` });
          case 'timed_out':
            throw toConnectError({ outcome: 'stale', message: `attempt ${req.attemptId} ran past its execution timeout`, current: lost.current! });
          case 'canceled':
            throw toConnectError({ outcome: 'stale', message: `attempt ${req.attemptId} was canceled`, current: lost.current! });
          case 'claim_expired':
          case 'lease_expired':
            throw toConnectError({ outcome: 'stale', message: `attempt ${req.attemptId} was taken back: ${REVOKE_DETAIL[lost.reason]}`, current: lost.current! });
          default:
            throw toConnectError({ outcome: 'stale', message: `attempt ${req.attemptId} is not current`, current: lost.current! });
        }
      },
      async completeAttempt(req, ctx) {
        const agentId = requireAgent(ctx.values.get(principalKey));
        return answerReport('completed', req.attemptId, agentId, await attemptComplete(db, { ...ref(req, agentId), result: req.result ?? {} }));
      },
      async failAttempt(req, ctx) {
        const agentId = requireAgent(ctx.values.get(principalKey));
        const error = { message: req.error?.message ?? '', ...(req.error?.details ? { details: req.error.details } : {}) };
        return answerReport('failed', req.attemptId, agentId, await attemptFail(db, { ...ref(req, agentId), error, retryable: req.retryable }));
      },
      async reserveStep(req, ctx) {
        const agentId = requireAgent(ctx.values.get(principalKey));
        const { value } = unwrap(await stepReserve(db, { ...ref(req, agentId), step: req.step }));
        switch (value.state) {
          case 'reserved':
            return { state: { case: 'reserved', value: create(ReserveStepResponse_ReservedSchema) } };
          case 'done':
            return { state: { case: 'done', value: create(ReserveStepResponse_DoneSchema, { output: toValue(value.output), attemptId: value.attemptId }) } };
          case 'unknown':
            return {
              state: {
                case: 'unknown',
                value: create(ReserveStepResponse_UnknownSchema, { previousAttemptId: value.previousAttemptId, reservations: value.reservations }),
              },
            };
        }
      },
      async recordStep(req, ctx) {
        const agentId = requireAgent(ctx.values.get(principalKey));
        const { value, outcome } = unwrap(await stepRecord(db, { ...ref(req, agentId), step: req.step, output: fromValue(req.output) ?? null }));
        return { outcome, output: toValue(value.output) };
      },
    });
}
