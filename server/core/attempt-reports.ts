/**
 * What agents report about their attempts, and the answers: `Started`, `Completed` and `Failed`
 * go to the fenced store verbs through the report batcher (`batcher.ts`); a start is answered
 * with `Renewed` (or `Revoke` if it cannot start), completions and failures with one `Ack` per
 * message, an item per attempt (the stored result on duplicate). Starts and reports of one
 * attempt are written by separate statements that may finish in either order; the session's
 * `starting` / `reporting` sets keep what it holds right whichever finishes first.
 */
import type { EventEmitter } from 'node:events';
import type { Logger } from '../log.js';
import type { JobSummary } from '../store/index.js';
import type { ReportBatcher } from './batcher.js';
import type { Outcome } from '../domain/outcomes.js';
import { REVOKE_DETAIL, type AckItem, type AgentInput, type HubEvents, type Session } from './session.js';

/** The reports of one message: completions or failures. */
export type Report = Extract<AgentInput, { type: 'completed' | 'failed' }>;

export class AttemptReports {
  constructor(
    private readonly batcher: Pick<ReportBatcher, 'start' | 'complete' | 'fail'>,
    private readonly log: Logger,
    /** Where `attempt:start`, `attempt:report` and `credit` are announced (the hub). */
    private readonly events: EventEmitter<HubEvents>,
    private readonly leaseTtlMs: number,
  ) {}

  /**
   * Writes the starts of a `Started` message (numbered `seq`) and answers them: `Renewed` for the
   * attempts the session now holds running, `Revoke` (not_started) for those that cannot start.
   */
  async started(s: Session, attemptIds: string[], seq: bigint): Promise<void> {
    const gone: string[] = [];
    const running: string[] = [];
    await Promise.all(
      attemptIds.map(async (attemptId) => {
        const write = this.batcher.start({ attemptId, agentId: s.agentId });
        s.starting.set(attemptId, write);
        const o = await write.finally(() => s.starting.delete(attemptId));
        const reported = s.reportedWhileStarting.delete(attemptId);
        this.events.emit('attempt:start', { attemptId, agentId: s.agentId, outcome: o });
        if (o.outcome === 'ok' || o.outcome === 'duplicate') {
          // Hold it only while it is still this attempt's and running, and not reported: the
          // start can be answered after the attempt's report was received, or even written.
          if (o.value.currentAttemptId === attemptId && o.value.status === 'running' && !s.closed && !reported && !s.reporting.has(attemptId)) {
            s.held.set(attemptId, { jobId: o.value.id, status: 'running' });
            running.push(attemptId);
          }
          if (this.log.isLevelEnabled('info')) this.log.info({ jobId: o.value.id, attemptId, attemptNo: o.value.attemptNo, agentId: s.agentId }, 'attempt started');
        } else {
          if (o.outcome === 'stale') this.log.warn({ attemptId, agentId: s.agentId, current: o.current }, 'late start rejected');
          gone.push(attemptId);
        }
      }),
    );
    if (running.length) s.send({ type: 'renewed', attemptIds: running, leaseTtlMs: this.leaseTtlMs, seq });
    if (gone.length) {
      for (const id of gone) s.held.delete(id);
      s.send({ type: 'revoke', attemptIds: gone, reason: 'not_started', detail: REVOKE_DETAIL.not_started });
      this.events.emit('credit', s);
    }
  }

  /** Writes the completions or failures of one message and answers them with one `Ack`. */
  async report(s: Session, m: Report): Promise<void> {
    const calls =
      m.type === 'completed'
        ? m.results.map((r) => ({
            attemptId: r.attemptId,
            run: () => this.batcher.complete({ attemptId: r.attemptId, agentId: s.agentId, result: r.result }),
          }))
        : m.failures.map((f) => ({
            attemptId: f.attemptId,
            run: () =>
              this.batcher.fail({
                attemptId: f.attemptId,
                agentId: s.agentId,
                error: f.error.details === undefined ? { message: f.error.message } : { message: f.error.message, details: f.error.details },
                retryable: f.retryable,
              }),
          }));
    // A reported attempt stops occupying the agent now, not when its report is written: the
    // next claim for this slot overlaps the write, and heartbeats no longer include it.
    const was = new Map(calls.map((c) => [c.attemptId, s.held.get(c.attemptId)]));
    for (const c of calls) {
      s.held.delete(c.attemptId);
      s.reporting.add(c.attemptId);
      if (s.starting.has(c.attemptId)) s.reportedWhileStarting.add(c.attemptId);
    }
    this.events.emit('credit', s);
    const items = await Promise.all(
      calls.map(async ({ attemptId, run }): Promise<AckItem> => {
        // An agent that reports an attempt before its start was answered (the SDK waits for
        // Renewed; a hand-written agent may send both at once) has the start written first, so
        // the attempt is started by its Started, not implicitly by the report: the same outcome
        // and counts whichever statement PostgreSQL would have finished first.
        await s.starting.get(attemptId)?.catch(() => undefined);
        const o: Outcome<JobSummary> = await run().finally(() => s.reporting.delete(attemptId));
        this.events.emit('attempt:report', { kind: m.type, attemptId, agentId: s.agentId, outcome: o });
        // A refused report (a result too large, say) leaves the attempt running: hold it again.
        const h = was.get(attemptId);
        if ((o.outcome === 'invalid' || o.outcome === 'too_large') && h && !s.closed) s.held.set(attemptId, h);
        return ackItem(attemptId, o, m.type, s.agentId, this.log);
      }),
    );
    s.send({ type: 'ack', items });
  }
}

function ackItem(attemptId: string, o: Outcome<JobSummary>, kind: 'completed' | 'failed', agentId: string, log: Logger): AckItem {
  switch (o.outcome) {
    case 'ok':
      if (log.isLevelEnabled('info')) log.info({ jobId: o.value.id, attemptId, agentId, status: o.value.status }, kind === 'completed' ? 'attempt completed' : 'attempt failed');
      // No message: Ack.Item.message says why, for anything but OK (and it is on every job).
      return { attemptId, outcome: 'ok', message: '' };
    case 'duplicate':
      return { attemptId, outcome: 'duplicate', storedResult: o.value.result ?? undefined, message: 'already recorded: the stored outcome stands' };
    case 'stale':
      log.warn({ attemptId, agentId, current: o.current }, `late ${kind === 'completed' ? 'completion' : 'failure'} rejected: ${o.message}`);
      return { attemptId, outcome: 'stale', current: o.current, message: o.message };
    case 'conflict':
      return { attemptId, outcome: 'conflict', ...(o.current ? { current: o.current } : {}), message: o.message };
    case 'invalid':
    case 'too_large':
      return { attemptId, outcome: o.outcome, message: `${o.field} ${o.message}` };
    default:
      return { attemptId, outcome: o.outcome, message: o.message };
  }
}
