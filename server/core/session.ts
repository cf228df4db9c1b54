/**
 * One agent stream in the coordinator's terms: the messages each way (domain values; the
 * transport translates them from and to protobuf), the `Session` that holds what the stream has
 * been given, and the events the hub announces about sessions. Every part of the hub
 * (`agent-hub.ts`, `lease-ticker.ts`, `attempt-reports.ts`, `revoker.ts`) speaks these.
 */
import { randomUUID } from 'node:crypto';
import type { Claimed, JobSummary } from '../store/index.js';
import { Channel } from './channel.js';
import type { CurrentState, Outcome } from '../domain/outcomes.js';

export interface Hello {
  /** Empty: the agent the token belongs to. Set: must be that agent. */
  agentId: string;
  token: string;
  queues: string[];
  labels: Record<string, string>;
  slots: number;
  resume: string[];
  /** The agent's number for this message (0: none); see `Session.seq`. */
  seq: bigint;
  /**
   * What the agent says it is (`Hello.agent_version`), for people: logged, never branched on.
   * Empty or absent: an agent from before the field.
   */
  agentVersion?: string;
}

/** What an agent sends after `Hello`. */
export type AgentInput =
  | { type: 'credit'; n: number }
  | { type: 'started'; attemptIds: string[]; seq: bigint }
  | { type: 'heartbeat'; progress: Array<{ attemptId: string; progress: unknown }>; seq: bigint }
  | { type: 'completed'; results: Array<{ attemptId: string; result: unknown }>; credit?: number }
  | { type: 'failed'; failures: Array<{ attemptId: string; error: { message: string; details?: unknown }; retryable: boolean }>; credit?: number }
  | { type: 'bye'; drain: boolean }
  | { type: 'hello' };

export interface AckItem {
  attemptId: string;
  outcome: Outcome<unknown>['outcome'];
  /** On `duplicate` of a completion: the result stored the first time. */
  storedResult?: unknown;
  current?: CurrentState;
  message: string;
}

/** What the coordinator sends an agent. */
export type AgentOutput =
  | { type: 'welcome'; sessionId: string; leaseTtlMs: number; heartbeatIntervalMs: number }
  | { type: 'assign'; jobs: Claimed[] }
  | { type: 'ack'; items: AckItem[] }
  | { type: 'revoke'; attemptIds: string[]; reason: RevokeReason; detail: string }
  | { type: 'cancel'; attemptIds: string[] }
  | { type: 'renewed'; attemptIds: string[]; leaseTtlMs: number; seq: bigint }
  | { type: 'drain' }
  | { type: 'goAway'; detail: string };

/** Why the coordinator takes attempts away (`RevokeReason` in the proto, lower case). */
export type RevokeReason =
  | 'claim_expired'
  | 'lease_expired'
  | 'timed_out'
  | 'not_current'
  | 'not_resumed'
  | 'not_started'
  | 'forbidden'
  | 'not_found'
  | 'superseded';

/** `Revoke.detail`: each reason in words. */
export const REVOKE_DETAIL: Record<RevokeReason, string> = {
  claim_expired: 'claim expired: not started before its claim deadline',
  lease_expired: 'lease expired: no heartbeat renewed it in time',
  timed_out: 'execution timeout passed',
  not_current: 'lease lost: the attempt is no longer current',
  not_resumed: 'not current: superseded or ended while disconnected',
  not_started: 'cannot start: not current, not found or not this agent',
  forbidden: 'the attempt belongs to another agent',
  not_found: 'unknown attempt',
  superseded: 'resumed by another stream of this agent',
};

/** A protocol violation: ends that stream (INVALID_ARGUMENT), never another. */
export class ProtocolError extends Error {
  override readonly name = 'ProtocolError';
}

/** One agent stream. */
export class Session {
  readonly id = randomUUID();
  readonly out = new Channel<AgentOutput>();
  /** Attempts this stream holds: claimed (assigned, not started yet) or running. */
  readonly held = new Map<string, { jobId: string; status: 'claimed' | 'running' }>();
  /** Attempts whose report arrived and is being written: never held again by a late start answer. */
  readonly reporting = new Set<string>();
  /** Attempts whose start is being written, and that write (a report of the attempt waits for it). */
  readonly starting = new Map<string, Promise<unknown>>();
  /**
   * Attempts reported while their start was being written. Starts and reports are written by
   * separate statements that may finish in either order: a start answered after its attempt's
   * report (even one already written) must not make the session hold the attempt again.
   */
  readonly reportedWhileStarting = new Set<string>();
  credit: number;
  /**
   * Slots taken by claims in flight (a dispatcher round, an enqueue hand-off): neither free nor
   * held yet. A `Credit` that arrives meanwhile must not free them again.
   */
  reserved = 0;
  draining = false;
  closed = false;
  heartbeatPending = false;
  /**
   * The largest number the agent gave a message on this stream (Hello, Started, Heartbeat), 0
   * if none: a `Renewed` echoes the one it answers, and the agent counts the lease from when it
   * sent that message, not from when the answer arrived.
   */
  seq = 0n;
  readonly progress = new Map<string, unknown>();
  readonly connectedAt = new Date();
  /** What the agent said it is in its Hello, for log lines (`AgentHub.open`); '' until then. */
  agentVersion = '';
  /** The dispatcher's key for sessions that are claimed for together (same queues and labels). */
  groupKey: string | undefined;

  constructor(
    readonly agentId: string,
    readonly queues: string[],
    readonly labels: Record<string, string>,
    readonly slots: number,
    /** True while the coordinator is waking from a pause: nothing is assigned then. */
    private readonly paused: () => boolean = () => false,
  ) {
    this.credit = slots;
  }

  /** Free slots the dispatcher may fill now. */
  get available(): number {
    // `out.closed`: the stream is ending (its queue drains, then `hub.close`): nothing more goes out on it.
    if (this.closed || this.out.closed || this.draining || this.paused()) return 0;
    return Math.max(0, Math.min(this.credit, this.slots - this.held.size - this.reserved));
  }

  /** Takes a free slot for a claim about to run (`available` must be positive). */
  reserve(): void {
    this.credit--;
    this.reserved++;
  }

  /** The claim for a reserved slot ended: `filled` (then `assign` holds its job) or not (the slot is free again). */
  unreserve(filled: boolean): void {
    this.reserved--;
    if (!filled) this.credit++;
  }

  send(msg: AgentOutput): void {
    this.out.push(msg);
  }
}

export interface HubEvents {
  /** A session has free slots (new, more credit, a slot freed): the dispatcher should look. */
  credit: [Session];
  /** One coalesced heartbeat UPDATE ran. */
  'lease:tick': [{ renewed: number; lost: number }];
  'lease:revoked': [{ agentId: string; attemptIds: string[]; reason: RevokeReason | 'canceled' }];
  'session:open': [Session];
  'session:close': [Session, { lost: boolean }];
  /** A `Started` item was answered (metrics: starts, enqueue-to-start latency, stale reports). */
  'attempt:start': [{ attemptId: string; agentId: string; outcome: Outcome<JobSummary> }];
  /** A `Completed` / `Failed` item was answered (metrics: outcomes, stale reports). */
  'attempt:report': [{ kind: 'completed' | 'failed'; attemptId: string; agentId: string; outcome: Outcome<JobSummary> }];
}
