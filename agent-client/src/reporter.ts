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
 *
 * The coordinator's limits on reports are kept here (it cannot be imported: the SDK installs
 * alone; test/sdk-report-limits.test.ts checks the numbers agree): a result of more than
 * `RESULT_MAX_BYTES` of JSON fails its attempt for good before it is written (assignments.ts), and
 * no message sent is larger than `FRAME_MAX_BYTES`, half of what the coordinator reads: reports are
 * split into as many messages as they need, and a report that cannot fit in one alone (written by
 * an older SDK) is replaced, durably, by a final failure saying why (a failure by a shortened copy
 * of itself), never sent whole. A message over the coordinator's limit ends the stream, and the
 * same report sent again at every reconnect would end every stream for ever.
 */
import type { JsonObject } from '@bufbuild/protobuf';
import type { Logger } from 'pino';
import { reportSize } from './codec.js';
import type { Outbox, OutboxEntry } from './outbox.js';
import type { Session } from './session.js';

/**
 * The coordinator's limit on a result: 256 KiB of JSON (`limits.resultBytes` in
 * server/domain/validation.ts). A handler's result over it fails the attempt for good, here.
 */
export const RESULT_MAX_BYTES = 256 * 1024;
/** The coordinator's limit on a failure's `error` (`{message, details}`): 16 KiB of JSON (`limits.errorBytes`). */
export const ERROR_MAX_BYTES = 16 * 1024;
/**
 * The largest message the reporter sends: half the 8 MiB the coordinator reads in one message
 * (`READ_MAX_BYTES`, server/transport/server.ts). A valid result (256 KiB of JSON) takes at most
 * about 1.4 MiB as protobuf (a `Struct` of small numbers: 11 bytes for each 2 of JSON).
 */
export const FRAME_MAX_BYTES = 4 * 1024 * 1024;
/** A failure the coordinator refused, shortened: its message keeps this much (JSON bytes). */
export const SHORT_MESSAGE_BYTES = 4 * 1024;
/** …and its details are kept only if they are at most this large (JSON bytes), else dropped. */
export const SHORT_DETAILS_BYTES = 8 * 1024;

/** A result's size, as the coordinator measures it: bytes of UTF-8 of its JSON. */
export function jsonBytes(v: unknown): number {
  return Buffer.byteLength(JSON.stringify(v) ?? '', 'utf8');
}

/** The message of a result too large to be sent: its size and the limit, in the words of the coordinator's refusal. */
export function resultTooLargeMessage(bytes: number): string {
  return `result refused: result is ${bytes} bytes of JSON, over the limit of ${RESULT_MAX_BYTES} (the coordinator's limit, checked by the agent: not sent)`;
}

/** The final failure that replaces a report of a result too large to be sent. */
export function resultTooLarge(e: OutboxEntry, bytes: number): OutboxEntry {
  const failed: OutboxEntry = {
    ...e,
    kind: 'failed',
    error: { message: resultTooLargeMessage(bytes), details: { resultBytes: bytes, limitBytes: RESULT_MAX_BYTES } },
    retryable: false,
    writtenAt: new Date().toISOString(),
  };
  delete failed.result;
  return failed;
}

/**
 * A failure the coordinator can store, in place of one it refused or that is too large to send:
 * the message cut to `SHORT_MESSAGE_BYTES` (saying so), NUL characters and lone surrogates (which
 * PostgreSQL refuses) replaced by U+FFFD, the details cleaned the same way and kept only when
 * small (`SHORT_DETAILS_BYTES`), dropped when already kept. The same `retryable`: a final failure
 * stays final. Undefined when it is as short as this makes it (refused again: set aside).
 */
export function shortenedFailure(e: OutboxEntry): OutboxEntry | undefined {
  const error = e.error ?? { message: 'failed' };
  const message = cutMessage(clean(error.message || 'failed'));
  const details = error.details === undefined ? undefined : (cleanJson(error.details) as NonNullable<typeof error.details>);
  const detailsBytes = details === undefined ? 0 : jsonBytes(details);
  const keep = details !== undefined && detailsBytes <= SHORT_DETAILS_BYTES;
  let short: NonNullable<OutboxEntry['error']> = {
    message: details !== undefined && !keep ? `${message} (details dropped: ${detailsBytes} bytes of JSON)` : message,
    ...(keep ? { details } : {}),
  };
  if (JSON.stringify(short) === JSON.stringify(error)) {
    // Refused as it is: without its details, if it has any.
    if (!short.details) return undefined;
    short = { message: `${message} (details dropped)` };
  }
  return { ...e, error: short, writtenAt: new Date().toISOString() };
}

/** NUL and lone surrogates (refused by the coordinator's database) as U+FFFD. */
function clean(s: string): string {
  return s.replaceAll('\u0000', '\uFFFD').toWellFormed();
}

function cleanJson(v: unknown): unknown {
  if (typeof v === 'string') return clean(v);
  if (Array.isArray(v)) return v.map(cleanJson);
  if (v && typeof v === 'object') return Object.fromEntries(Object.entries(v).map(([k, x]) => [clean(k), cleanJson(x)]));
  return v;
}

/** `s` cut so that its JSON takes at most `SHORT_MESSAGE_BYTES`, with a note when it was. */
function cutMessage(s: string): string {
  const bytes = jsonBytes(s);
  if (bytes <= SHORT_MESSAGE_BYTES) return s;
  const note = ` … (shortened by the agent: the message was ${bytes} bytes of JSON)`;
  const room = SHORT_MESSAGE_BYTES - jsonBytes(note);
  // Every character takes at least one byte: the answer is within the first `room` characters.
  let lo = 0;
  let hi = Math.min(s.length, room);
  while (lo < hi) {
    const mid = Math.ceil((lo + hi) / 2);
    if (jsonBytes(s.slice(0, mid)) <= room) lo = mid;
    else hi = mid - 1;
  }
  let n = lo;
  // Never half of a surrogate pair.
  if (n > 0 && /[\uD800-\uDBFF]/.test(s[n - 1]!)) n--;
  return s.slice(0, n) + note;
}

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
  /** Reports too large to send whose replacement is being written (`replaceOversized`). */
  private readonly replacing = new Set<string>();

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

  /**
   * Sends reports, in messages of at most `FRAME_MAX_BYTES` each; `credit` rides with the first
   * of them if the coordinator reads it there. A report too large to fit in one alone is
   * replaced (`replaceOversized`), never sent.
   */
  private sendReports(entries: OutboxEntry[], credit = 0): void {
    if (!this.o.session.connected) return; // reports: sent again at the next Welcome; credit: Hello's slots
    const completed: Array<[OutboxEntry, number]> = [];
    const failed: Array<[OutboxEntry, number]> = [];
    for (const e of entries) {
      const size = reportSize(e);
      if (size > FRAME_MAX_BYTES - FRAME_SLACK) this.replaceOversized(e, size);
      else (e.kind === 'completed' ? completed : failed).push([e, size]);
    }
    const rides = this.creditWithReports && completed.length + failed.length > 0;
    let carry = rides ? credit : 0;
    for (const batch of frames(completed)) {
      this.o.session.send({ kind: { case: 'completed', value: { results: batch.map((e) => ({ attemptId: e.attemptId, result: e.result as JsonObject })), credit: carry } } });
      carry = 0;
    }
    for (const batch of frames(failed)) {
      this.o.session.send({
        kind: {
          case: 'failed',
          value: {
            failures: batch.map((e) => ({
              attemptId: e.attemptId,
              error: { message: e.error!.message, ...(e.error!.details ? { details: e.error!.details as JsonObject } : {}) },
              retryable: e.retryable ?? true,
            })),
            credit: carry,
          },
        },
      });
      carry = 0;
    }
    if (credit > 0 && !rides) this.o.session.send({ kind: { case: 'credit', value: { n: credit } } });
  }

  /**
   * A report that no message can carry (an outbox written by an older SDK, or a handler's failure
   * of megabytes): replaced in the outbox by a final failure saying the result was too large, or
   * by a shortened copy of the failure (the same `retryable`), which is then sent. Sent whole, it
   * would end the stream, and again at every reconnect.
   */
  private replaceOversized(e: OutboxEntry, size: number): void {
    if (this.replacing.has(e.attemptId)) return;
    const replacement = e.kind === 'completed' ? resultTooLarge(e, jsonBytes(e.result ?? {})) : shortenedFailure(e);
    if (!replacement) return;
    this.replacing.add(e.attemptId);
    this.o.log.error(
      { attemptId: e.attemptId, jobId: e.jobId, kind: e.kind, bytes: size, limitBytes: FRAME_MAX_BYTES },
      e.kind === 'completed'
        ? 'a report in the outbox is too large to send: reporting the attempt as failed for good (result too large) instead'
        : 'a failure report in the outbox is too large to send: reporting it shortened instead',
    );
    this.o.outbox
      .put(replacement)
      .then(
        () => this.report(replacement),
        (err: unknown) => this.o.log.warn({ err, attemptId: e.attemptId }, 'could not write the outbox: the report too large to send is tried again at the next session'),
      )
      .finally(() => this.replacing.delete(e.attemptId));
  }
}

/** Room left in a message for what is not a report: its kind's tag and length, the credit. */
const FRAME_SLACK = 64;

/** Reports in groups whose messages stay under `FRAME_MAX_BYTES`, in order. */
function frames(items: Array<[OutboxEntry, number]>): OutboxEntry[][] {
  const out: OutboxEntry[][] = [];
  let batch: OutboxEntry[] = [];
  let bytes = 0;
  for (const [e, size] of items) {
    if (batch.length && bytes + size > FRAME_MAX_BYTES - FRAME_SLACK) {
      out.push(batch);
      batch = [];
      bytes = 0;
    }
    batch.push(e);
    bytes += size;
  }
  if (batch.length) out.push(batch);
  return out;
}
