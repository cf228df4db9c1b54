/**
 * AgentService.Connect: one bidirectional stream per agent process. This adapter only
 * translates protobuf to the hub's domain messages (`core/session.ts`) and back; the rules live
 * in `core/agent-hub.ts` and the parts it composes. A protocol violation ends this stream with
 * INVALID_ARGUMENT; it never touches another stream.
 */
import { create } from '@bufbuild/protobuf';
import { durationFromMs } from '@bufbuild/protobuf/wkt';
import { Code, ConnectError, type ConnectRouter, type HandlerContext } from '@connectrpc/connect';
import {
  AgentService,
  RevokeReason,
  ServerMessageSchema,
  type AgentMessage,
  type ServerMessage,
} from '../../gen/leasehold/v1/agent_service_pb.js';
import { ProtocolError, type AgentHub, type AgentInput, type AgentOutput, type RevokeReason as Reason, type Session } from '../core/agent-hub.js';
import type { Failure } from '../domain/outcomes.js';
import type { Logger } from '../log.js';
import type { AgentStreamHandler } from './agent-lane.js';
import { ackMessage, assignMessage, renewedMessage } from './assign-codec.js';
import { fromValue } from './codec.js';
import { LogSummary } from '../lib/log-summary.js';
import { toConnectError } from './outcome-wire.js';
import serverPackage from '../../package.json' with { type: 'json' };

/**
 * What this coordinator is, for people, sent in every Welcome (`coordinator_version`) and logged
 * by the agent: the release (package.json's version), Node's version and the OS, e.g.
 * `leasehold/0.1.0 (node v20.11.1; linux)`.
 */
export const COORDINATOR_VERSION = `${serverPackage.name}/${serverPackage.version} (node ${process.version}; ${process.platform})`;

export interface AgentRoutesDeps {
  hub: AgentHub;
  log: Logger;
  /** A new stream must say Hello within this; default 10 s. */
  helloTimeoutMs?: number | undefined;
  /** At most this many streams wait for their Hello at once; default 256. */
  helloPendingMax?: number | undefined;
}

/**
 * The streams still waiting for their Hello, oldest first, each with the means to end it. Those
 * streams carry no credential yet, so whoever can reach the listener can open them; when they
 * are too many, the oldest is ended to make room (an agent sends its Hello with the stream's
 * first bytes, so the oldest is the one least likely to be an agent). Refusing the newest
 * instead let one client that kept 256 of them open shut every agent out: 0 of 59 tries of a
 * real agent got in over 30 s (.scratch/review-security.md, 1).
 */
interface Waiting {
  streams: Set<(err: ConnectError) => void>;
  /** One line a minute for the streams ended so, and for the Hellos refused: anyone can cause them. */
  ended: LogSummary;
  refused: LogSummary;
}

/**
 * The agent stream's handler, for Connect's router (`routes`) and for the gRPC listener's own
 * lane (`handler`, agent-lane.ts): one count of the streams still waiting for their Hello.
 */
export function agentStreams(deps: AgentRoutesDeps): { routes: (router: ConnectRouter) => void; handler: AgentStreamHandler } {
  // Streams that have not said Hello yet hold memory and a connection without any credential:
  // they are few and short-lived, or refused.
  const waiting: Waiting = {
    streams: new Set(),
    ended: new LogSummary(deps.log, 'warn', 'agent stream ended: too many streams waiting for their Hello, this one the longest'),
    refused: new LogSummary(deps.log, 'warn', 'agent refused'),
  };
  const handler: AgentStreamHandler = (requests, signal) => connect(deps, waiting, requests, signal);
  return {
    handler,
    routes: (router: ConnectRouter) =>
      router.service(AgentService, {
        connect: (requests: AsyncIterable<AgentMessage>, ctx: HandlerContext) => connect(deps, waiting, requests, ctx.signal),
      }),
  };
}

async function* connect(
  deps: AgentRoutesDeps,
  waiting: Waiting,
  requests: AsyncIterable<AgentMessage>,
  signal: AbortSignal,
): AsyncGenerator<ServerMessage> {
  const { hub, log } = deps;
  const raw = requests[Symbol.asyncIterator]();
  // A frame that does not decode is the agent's mistake: INVALID_ARGUMENT, not INTERNAL.
  const it: AsyncIterator<AgentMessage> = {
    next: () => raw.next().catch((err: unknown) => Promise.reject(asReadError(err))),
  };
  const first = await firstMessage(deps, waiting, it);
  if (first.done) return;
  if (first.value.kind.case !== 'hello') {
    throw new ConnectError(
      `the first message on the stream must be Hello{agent_id, token, queues, slots}, got ${first.value.kind.case ?? 'an empty message'}`,
      Code.InvalidArgument,
    );
  }
  const h = first.value.kind.value;
  const opened = await hub.open({
    agentId: h.agentId,
    token: h.token,
    queues: h.queues,
    labels: h.labels,
    slots: h.slots,
    resume: h.resume,
    seq: h.seq,
    agentVersion: h.agentVersion,
  });
  if (opened.outcome !== 'ok') {
    if (opened.outcome === 'not_found' || opened.outcome === 'forbidden') {
      waiting.refused.note({ agentId: h.agentId, why: opened.message });
      throw new ConnectError(`Hello refused: ${opened.message}`, Code.Unauthenticated);
    }
    throw toConnectError(opened as Failure);
  }
  const session = opened.value;

  // Read the agent's messages in order while this generator writes the session's output.
  let readingDone = false;
  const reading = (async () => {
    try {
      for (;;) {
        const r = await it.next();
        if (r.done) break;
        await hub.handle(session, toInput(r.value));
      }
      // The agent half-closed: after Bye this is a goodbye, otherwise the stream was lost.
      session.out.close();
    } catch (err) {
      if (err instanceof ProtocolError) {
        log.warn({ agentId: session.agentId, agentVersion: session.agentVersion, err: err.message }, 'agent stream ended: protocol violation');
        session.out.fail(new ConnectError(err.message, Code.InvalidArgument));
      } else {
        // A frame over the size limit is refused before it is read: the agent reconnects and,
        // were it its outbox's resend, would send it again. Say which agent and how large.
        if (err instanceof ConnectError && err.code === Code.ResourceExhausted) {
          log.warn({ agentId: session.agentId, err: err.rawMessage }, 'agent stream ended: a message over the size limit');
        }
        session.out.fail(err);
      }
    } finally {
      readingDone = true;
    }
  })();

  let lost = true;
  try {
    for await (const out of session.out) yield toServerMessage(out);
    lost = !session.draining;
  } finally {
    await hub.close(session, { lost, error: signal.aborted ? signal.reason : undefined });
    // When the server ended the stream (a revoked agent, a shutdown) the agent may still be
    // sending: returning ends the call, which ends the reading; waiting for it would wait for
    // the agent.
    if (readingDone) await reading;
  }
}

/**
 * The stream's first message, within the Hello timeout; when too many streams already wait for
 * theirs, the one that has waited longest is ended to make room (see `Waiting`).
 */
async function firstMessage(deps: AgentRoutesDeps, waiting: Waiting, it: AsyncIterator<AgentMessage>): Promise<IteratorResult<AgentMessage>> {
  const max = deps.helloPendingMax ?? 256;
  const ms = deps.helloTimeoutMs ?? 10_000;
  let timer: NodeJS.Timeout | undefined;
  let end!: (err: ConnectError) => void;
  const ended = new Promise<never>((_, reject) => {
    end = reject;
    timer = setTimeout(() => reject(new ConnectError(`no Hello within ${ms} ms of opening the stream`, Code.DeadlineExceeded)), ms);
  });
  while (waiting.streams.size >= max) {
    const [oldest] = waiting.streams;
    waiting.streams.delete(oldest!);
    waiting.ended.note({ waiting: max });
    oldest!(new ConnectError(`too many streams waiting to say Hello (${max}): this one, which waited longest, was ended`, Code.ResourceExhausted));
  }
  waiting.streams.add(end);
  try {
    return await Promise.race([it.next(), ended]);
  } finally {
    clearTimeout(timer);
    waiting.streams.delete(end);
  }
}

const REVOKE_REASON: Record<Reason, RevokeReason> = {
  claim_expired: RevokeReason.CLAIM_EXPIRED,
  lease_expired: RevokeReason.LEASE_EXPIRED,
  timed_out: RevokeReason.TIMED_OUT,
  not_current: RevokeReason.NOT_CURRENT,
  not_resumed: RevokeReason.NOT_RESUMED,
  not_started: RevokeReason.NOT_STARTED,
  forbidden: RevokeReason.FORBIDDEN,
  not_found: RevokeReason.NOT_FOUND,
  superseded: RevokeReason.SUPERSEDED,
};

/** Errors from decoding the agent's messages become INVALID_ARGUMENT; others pass through. */
function asReadError(err: unknown): unknown {
  const e = ConnectError.from(err);
  if (e.code === Code.Internal && /parse|decode|illegal|wire|premature|invalid/i.test(e.rawMessage)) {
    return new ConnectError(`malformed AgentMessage: ${e.rawMessage}`, Code.InvalidArgument);
  }
  return err;
}

function toInput(m: AgentMessage): AgentInput {
  const k = m.kind;
  switch (k.case) {
    case 'hello':
      return { type: 'hello' };
    case 'credit':
      return { type: 'credit', n: k.value.n };
    case 'started':
      return { type: 'started', attemptIds: k.value.attemptIds, seq: k.value.seq };
    case 'heartbeat':
      return { type: 'heartbeat', progress: k.value.progress.map((p) => ({ attemptId: p.attemptId, progress: fromValue(p.progress) })), seq: k.value.seq };
    case 'completed':
      return { type: 'completed', results: k.value.results.map((r) => ({ attemptId: r.attemptId, result: r.result ?? {} })), credit: k.value.credit };
    case 'failed':
      return {
        type: 'failed',
        failures: k.value.failures.map((f) => ({
          attemptId: f.attemptId,
          error: { message: f.error?.message ?? '', ...(f.error?.details ? { details: f.error.details } : {}) },
          retryable: f.retryable,
        })),
        credit: k.value.credit,
      };
    case 'bye':
      return { type: 'bye', drain: k.value.drain };
    default: {
      // A message kind added to the proto after this release arrives as an unknown field.
      const unknown = m.$unknown?.map((f) => f.no) ?? [];
      if (unknown.length > 0) {
        throw new ProtocolError(
          `AgentMessage of a kind this coordinator does not know (field ${unknown.join(', ')}): the agent is newer than this coordinator; update the coordinator, or run an agent of its release`,
        );
      }
      throw new ProtocolError('empty AgentMessage: set one of hello, credit, started, heartbeat, completed, failed, bye');
    }
  }
}

function toServerMessage(o: AgentOutput): ServerMessage {
  switch (o.type) {
    case 'welcome':
      return create(ServerMessageSchema, {
        kind: {
          case: 'welcome',
          value: {
            sessionId: o.sessionId,
            leaseTtl: durationFromMs(o.leaseTtlMs),
            heartbeatInterval: durationFromMs(o.heartbeatIntervalMs),
            creditWithReports: true,
            coordinatorVersion: COORDINATOR_VERSION,
          },
        },
      });
    case 'assign':
      return assignMessage(o.jobs);
    case 'ack':
      return ackMessage(o.items);
    case 'revoke':
      return create(ServerMessageSchema, { kind: { case: 'revoke', value: { attemptIds: o.attemptIds, reason: REVOKE_REASON[o.reason], detail: o.detail } } });
    case 'cancel':
      return create(ServerMessageSchema, { kind: { case: 'cancel', value: { attemptIds: o.attemptIds } } });
    case 'drain':
      return create(ServerMessageSchema, { kind: { case: 'drain', value: {} } });
    case 'goAway':
      return create(ServerMessageSchema, { kind: { case: 'goAway', value: { detail: o.detail } } });
    case 'renewed':
      return renewedMessage(o.attemptIds, o.leaseTtlMs, o.seq);
  }
}

export type { Session };
