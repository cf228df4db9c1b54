/**
 * What the agent does with the coordinator's acks of its reports: forgets the outbox entry (ok,
 * duplicate), sets it aside as superseded (stale, or refused otherwise), or, for a report the
 * coordinator refused as invalid, reports one it can store in its place: a final failure for a
 * result (too large, not JSON it takes), a shortened copy for a failure (too large, a NUL
 * character), with the same `retryable`. Set aside, a failure would be lost, and the coordinator's
 * next renewal of its attempt would have it given back as a retryable one (`Reporter.release`): a
 * failure for good would become reruns. Nothing set aside is sent again. An ack for an attempt
 * given back only ends that.
 *
 * Only refusals this SDK knows to be final set a report aside (`FINAL_REFUSALS`). An outcome it
 * does not know (a number a later coordinator added, a "try again later", say; or `UNSPECIFIED`,
 * which no coordinator sends) keeps the report in the outbox: it is sent again at the next
 * session (`Reporter.resend`), and the outcome is logged once per value. Setting it aside would
 * lose a report the coordinator may have meant to take later.
 */
import type { Logger } from 'pino';
import { monotonic } from './clock.js';
import type { AgentEmitter } from './events.js';
import type { ServerMessage_Ack_Item } from './gen/leasehold/v1/agent_service_pb.js';
import { Outcome } from './gen/leasehold/v1/job_pb.js';
import type { Outbox, OutboxEntry } from './outbox.js';
import { shortenedFailure, type Reporter } from './reporter.js';

export interface AcksOptions {
  log: Logger;
  events: AgentEmitter;
  outbox: Pick<Outbox, 'dir' | 'has' | 'pending' | 'put' | 'remove' | 'supersede'>;
  reporter: Pick<Reporter, 'report' | 'ackRelease'>;
}

/**
 * The refusals after which sending a report again can never be accepted (job.proto's `Outcome`):
 * set aside. `INVALID` is first replaced by a report the coordinator can store, where there is one.
 */
export const FINAL_REFUSALS: ReadonlySet<Outcome> = new Set([Outcome.STALE, Outcome.CONFLICT, Outcome.NOT_FOUND, Outcome.FORBIDDEN, Outcome.INVALID]);

export class Acks {
  private waiters: Array<() => void> = [];
  /** Outcomes this SDK does not know, already logged (once per value). */
  private readonly unknownOutcomes = new Set<number>();

  constructor(private readonly o: AcksOptions) {}

  /** Applies one ack item to the outbox; emits `acked` once it is applied. */
  async onAck(item: ServerMessage_Ack_Item): Promise<void> {
    const { log, outbox } = this.o;
    const id = item.attemptId;
    const outcome = Outcome[item.outcome] ?? String(item.outcome);
    if (this.o.reporter.ackRelease(id) && !outbox.has(id)) {
      log.info({ attemptId: id, outcome, message: item.message }, 'attempt given back');
      return;
    }
    try {
      switch (item.outcome) {
        case Outcome.OK:
        case Outcome.DUPLICATE:
          await outbox.remove(id);
          if (log.isLevelEnabled('info')) log.info({ event: 'report.acknowledged', attemptId: id, outcome }, 'report acknowledged');
          break;
        case Outcome.STALE: {
          const setAside = await outbox.supersede(id, outcome);
          log.warn(
            {
              attemptId: id,
              outcome,
              ...(setAside ? { setAside: 'superseded' } : {}),
              current: item.current && { attemptNo: item.current.attemptNo, currentAttemptId: item.current.currentAttemptId },
              message: item.message,
            },
            setAside ? 'report refused as stale: the attempt was superseded; kept aside as superseded' : 'report refused as stale: the attempt was superseded (already set aside)',
          );
          break;
        }
        case Outcome.INVALID: {
          const e = outbox.pending().find((x) => x.attemptId === id);
          if (e?.kind === 'completed') {
            // The result itself was refused (too large, not JSON): report a final failure instead.
            const failed: OutboxEntry = { ...e, kind: 'failed', result: undefined, error: { message: `result refused: ${item.message}` }, retryable: false, writtenAt: new Date().toISOString() };
            delete failed.result;
            await outbox.put(failed);
            log.error({ attemptId: id, message: item.message }, 'result refused by the coordinator; reporting a failure instead');
            this.o.reporter.report(failed);
            return;
          }
          const short = e?.kind === 'failed' ? shortenedFailure(e) : undefined;
          if (short) {
            // The failure itself was refused (too large, a NUL character): a shortened copy, the
            // same retryable, so that a final failure stays final.
            await outbox.put(short);
            log.error({ attemptId: id, message: item.message, retryable: short.retryable ?? true }, 'failure report refused by the coordinator; reporting it shortened instead');
            this.o.reporter.report(short);
            return;
          }
          const aside = await outbox.supersede(id, outcome);
          log.error({ attemptId: id, message: item.message }, `report refused as invalid; ${keptAside(aside)}`);
          break;
        }
        default: {
          if (!FINAL_REFUSALS.has(item.outcome)) {
            this.keepUnknown(item, id);
            break;
          }
          const aside = await outbox.supersede(id, outcome);
          log.error({ attemptId: id, outcome, message: item.message }, `report refused; ${keptAside(aside)}`);
        }
      }
    } catch (err) {
      log.error({ err, attemptId: id }, 'outbox update after an ack failed');
    }
    this.o.events.emit('acked', { attemptId: id, outcome });
    const w = this.waiters;
    this.waiters = [];
    for (const f of w) f();
  }

  /**
   * An outcome this SDK does not know: the report stays in the outbox and is sent again at the
   * next session. Logged at warn once per outcome value, at debug after that.
   */
  private keepUnknown(item: ServerMessage_Ack_Item, id: string): void {
    const fields = { attemptId: id, outcome: item.outcome, message: item.message };
    if (this.unknownOutcomes.has(item.outcome)) {
      this.o.log.debug(fields, 'report answered with an outcome this agent does not know; kept, sent again at the next session');
      return;
    }
    this.unknownOutcomes.add(item.outcome);
    this.o.log.warn(
      fields,
      `report answered with outcome ${item.outcome}, which this agent does not know (the coordinator is newer?): the report is kept and sent again at the next session, not set aside (logged once for this outcome)`,
    );
  }

  /** Waits until the outbox is empty (every report acknowledged) or `ms` passes. */
  async flush(ms: number): Promise<void> {
    const { outbox } = this.o;
    const until = monotonic() + ms;
    while (outbox.pending().length && monotonic() < until) {
      await new Promise<void>((resolve) => {
        const t = setTimeout(resolve, Math.min(until - monotonic(), 1000));
        this.waiters.push(() => {
          clearTimeout(t);
          resolve();
        });
      });
    }
    const left = outbox.pending().length;
    if (left) this.o.log.warn({ entries: left, dir: outbox.dir }, 'stopping with unacknowledged reports: they are sent at the next start');
  }
}

/**
 * What a refusal did with the report, in its log line: `supersede` answers false when the outbox
 * no longer holds it, because an earlier ack of the same report (sent again at a new session)
 * set it aside (the stale case says so in its own words, with `setAside` when it did).
 */
function keptAside(setAside: boolean): string {
  return setAside ? 'kept aside' : 'already set aside';
}
