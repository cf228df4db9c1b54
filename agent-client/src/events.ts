/**
 * The agent's events, in a module of their own: the parts that emit them (assignments.ts,
 * acks.ts) and the agent that composes them all name the same map.
 */
import type { EventEmitter } from 'node:events';

export interface AgentEvents {
  connected: [{ sessionId: string }];
  disconnected: [{ error?: Error }];
  assigned: [{ attemptId: string; jobId: string; attemptNo: number }];
  /**
   * A handler returned or threw (its report is on disk and being sent, unless the outbox could
   * not write it: then the job is redone).
   */
  finished: [{ attemptId: string; kind: 'completed' | 'failed' }];
  acked: [{ attemptId: string; outcome: string }];
  /**
   * A running attempt was stopped: `reason` in words; `revoke` is the coordinator's reason when it
   * took the attempt away (`lease_expired`, `claim_expired`, `timed_out`, `not_current`,
   * `not_resumed`, `not_started`, `forbidden`, `not_found`, `superseded`: `RevokeReason` in the
   * proto), `canceled` when the job was canceled, absent when this agent stopped it itself.
   */
  aborted: [{ attemptId: string; reason: string; revoke?: string }];
  zombie: [{ attemptId: string }];
  /**
   * A step's effect runs next: the ledger reserved the step to this attempt, the local lease
   * deadline was checked at `checkedAt` (`performance.now()`) and holds (`leaseLeftMs` of it
   * left), and `fn` is called as soon as the listeners return (they run synchronously; one that
   * throws is logged, and the step runs). For an audit trail of effects, or to see how long one
   * took from the check to the system it acts on (a freeze after the check counts in that time).
   * A step already done, or reconciled as done by `onUnknown`, has no effect and no event.
   */
  effect: [{ attemptId: string; jobId: string; step: string; idempotencyKey: string; checkedAt: number; leaseLeftMs: number }];
  /**
   * The outbox cannot be written (a full disk, an I/O error): the agent takes no new work (freed
   * slots are withheld, jobs assigned meanwhile are not started) until a write works again; it
   * tries every few seconds. Reports that could not be written are lost: those jobs are redone.
   */
  outboxFailing: [{ error: Error }];
  /** The outbox can be written again: the agent takes work again. */
  outboxRecovered: [Record<string, never>];
}

/** Where the parts emit the agent's events: the agent itself (a test gives a plain emitter). */
export type AgentEmitter = EventEmitter<AgentEvents>;
