/**
 * What the agent tells the coordinator about its attempts: `Started` for those assigned, each
 * handler's result or failure (written to the durable outbox before it is sent, and sent again at
 * every new session until acknowledged), and the slots handlers free. Reports and freed slots go
 * out once per turn of the event loop, in as few messages as can be; a freed slot rides with the
 * reports (`Completed.credit`, `Failed.credit`) when the coordinator reads it there, and goes as a
 * `Credit` of its own otherwise.
 *
 * While the outbox cannot be written (a full disk, an I/O error: `Outbox.watch`), a handler's
 * result could not be kept, so the agent takes no new work: the slots freed meanwhile are
 * withheld, and jobs assigned anyway (the credit was already given, or a new session's Hello
 * granted its slots) are declined, never started: their claims expire and they go back to the
 * queue without counting as attempts. The withheld slots are given back when a write works again.
 */
import type { JsonObject } from '@bufbuild/protobuf';
import type { Logger } from 'pino';
import type { Outbox, OutboxEntry } from './outbox.js';
import type { Session } from './session.js';

export interface ReporterOptions {
  log: Logger;
  outbox: Pick<Outbox, 'put' | 'has' | 'pending' | 'watch'>;
  session: Pick<Session, 'send' | 'connected' | 'nextSeq'>;
  /** The agent is draining: the slots handlers free are not given back. */
  draining(): boolean;
}

export class Reporter {
  private pendingSend: OutboxEntry[] = [];
  private creditPending = 0;
  private sendScheduled = false;
  /** The coordinator reads credit carried by Completed/Failed (its Welcome said so). */
  private creditWithReports = false;
  /** Attempts given back with `release` and not yet acknowledged. */
  private readonly released = new Set<string>();
  /** The outbox cannot be written: no new work (`freeSlot` withholds, `decline`). */
  private outboxFailing = false;
  /** Slots freed (or assignments declined) while the outbox failed, given back when it works. */
  private withheld = 0;

  constructor(private readonly o: ReporterOptions) {
    o.outbox.watch((failure) => (failure ? this.pause(failure) : this.resume()));
  }

  /** The outbox cannot be written now: new work is declined (`decline`). */
  get paused(): boolean {
    return this.outboxFailing;
  }

  /** A new session (its Welcome): whether it reads credit with reports. */
  welcomed(creditWithReports: boolean): void {
    this.creditWithReports = creditWithReports;
    this.released.clear(); // a new session holds only what Hello resumed
    // Hello offered every slot not running: those withheld before are in it (and, while the
    // outbox still fails, declined again one by one as they are assigned).
    this.withheld = 0;
  }

  /** Asks the coordinator to start these attempts (each `Renewed` for them confirms). */
  started(attemptIds: string[]): void {
    this.o.session.send({ kind: { case: 'started', value: { attemptIds, seq: this.o.session.nextSeq() } } });
  }

  /**
   * Makes a handler's report durable. A failure to write it is logged: the report is lost, the
   * attempt is given back as a retryable failure when the coordinator renews it (`release`), and
   * the job is redone.
   */
  async write(entry: OutboxEntry): Promise<void> {
    try {
      await this.o.outbox.put(entry);
    } catch (err) {
      this.o.log.warn({ err, attemptId: entry.attemptId, jobId: entry.jobId, kind: entry.kind }, 'could not write the outbox: the report is lost and the job will be redone');
    }
  }

  /** A handler's attempt is let go: its report is sent if the outbox holds it, its slot freed. */
  finished(entry: OutboxEntry): void {
    if (this.o.outbox.has(entry.attemptId)) this.report(entry);
    this.freeSlot();
  }

  /** Sends a report from the outbox (at the end of this turn of the event loop). */
  report(e: OutboxEntry): void {
    this.pendingSend.push(e);
    this.scheduleSend();
  }

  /**
   * Gives a freed slot back: the sum of a turn of the event loop, with that turn's reports if
   * the coordinator reads credit there, else as a `Credit` of its own. None while draining.
   */
  freeSlot(): void {
    if (this.o.draining()) return;
    if (this.outboxFailing) {
      this.withheld++;
      return;
    }
    this.creditPending++;
    this.scheduleSend();
  }

  /**
   * Jobs assigned while the outbox cannot be written: never started (no `Started`), so their
   * claims expire and they go back to the queue without counting as attempts; their slots are
   * withheld with the others.
   */
  decline(attemptIds: string[]): void {
    this.o.log.warn({ attemptIds }, 'the outbox cannot be written: not starting jobs assigned meanwhile (they go back to the queue when their claims expire)');
    if (!this.o.draining()) this.withheld += attemptIds.length;
  }

  private pause(failure: Error): void {
    if (this.outboxFailing) return;
    this.outboxFailing = true;
    // The outbox logged the failure itself (error); this is what it means for the agent.
    this.o.log.warn(
      { err: failure },
      'the outbox cannot be written: this agent takes no new work until it can (it is tried again every few seconds); running jobs whose reports cannot be kept are redone',
    );
  }

  private resume(): void {
    if (!this.outboxFailing) return;
    this.outboxFailing = false;
    const n = this.withheld;
    this.withheld = 0;
    this.o.log.info({ slots: n }, 'the outbox can be written again: taking work again');
    if (n && !this.o.draining()) {
      this.creditPending += n;
      this.scheduleSend();
    }
  }

  /**
   * Sends every report not yet acknowledged (at a new session). The reports waiting for this
   * turn's send are among them: they go once, not again at the end of the turn.
   */
  resend(): void {
    this.pendingSend = [];
    const pending = this.o.outbox.pending();
    if (pending.length) this.sendReports(pending);
  }

  /**
   * Gives back attempts the coordinator renews but this agent does not run: a retryable
   * `Failed`, so the job is retried (by this agent or another) instead of held. Not durable: if
   * it is lost, the next `Renewed` asks again.
   */
  release(attemptIds: string[]): void {
    // Neither running nor reported: this agent gave the attempt up (its start came back after
    // the local deadline) or lost its report. Heartbeats would renew it forever.
    const ids = attemptIds.filter((id) => !this.o.outbox.has(id) && !this.released.has(id));
    if (!ids.length) return;
    for (const id of ids) this.released.add(id);
    this.o.log.warn({ attemptIds: ids }, 'the coordinator renewed attempts this agent is not running: giving them back');
    this.o.session.send({
      kind: {
        case: 'failed',
        value: {
          failures: ids.map((attemptId) => ({
            attemptId,
            error: { message: 'the agent is not running this attempt (it gave it up before the start was confirmed, or lost its report)' },
            retryable: true,
          })),
        },
      },
    });
  }

  /** An ack for `attemptId` came: true if it was given back with `release` (now forgotten). */
  ackRelease(attemptId: string): boolean {
    return this.released.delete(attemptId);
  }

  /** Reports and freed slots go out once per turn of the event loop, in as few messages as can be. */
  private scheduleSend(): void {
    if (this.sendScheduled) return;
    this.sendScheduled = true;
    setImmediate(() => {
      this.sendScheduled = false;
      const batch = this.pendingSend.splice(0);
      const credit = this.o.draining() ? 0 : this.creditPending;
      this.creditPending = 0;
      this.sendReports(batch, credit);
    });
  }

  /** Sends reports; `credit` rides with the first of them if the coordinator reads it there. */
  private sendReports(entries: OutboxEntry[], credit = 0): void {
    if (!this.o.session.connected) return; // reports: sent again at the next Welcome; credit: Hello's slots
    const completed = entries.filter((e) => e.kind === 'completed');
    const failed = entries.filter((e) => e.kind === 'failed');
    const rides = this.creditWithReports && entries.length > 0;
    let carry = rides ? credit : 0;
    if (completed.length) {
      this.o.session.send({ kind: { case: 'completed', value: { results: completed.map((e) => ({ attemptId: e.attemptId, result: e.result as JsonObject })), credit: carry } } });
      carry = 0;
    }
    if (failed.length) {
      this.o.session.send({
        kind: {
          case: 'failed',
          value: {
            failures: failed.map((e) => ({
              attemptId: e.attemptId,
              error: { message: e.error!.message, ...(e.error!.details ? { details: e.error!.details as JsonObject } : {}) },
              retryable: e.retryable ?? true,
            })),
            credit: carry,
          },
        },
      });
    }
    if (credit > 0 && !rides) this.o.session.send({ kind: { case: 'credit', value: { n: credit } } });
  }
}
