/**
 * The durable outbox: every result or failure is on disk before it is sent, and stays there
 * until the coordinator acknowledges it, across `kill -9` at any instruction, power cuts and
 * restarts.
 *
 * An append-only log with group commit, as a database WAL: `put` appends a `put` record, and
 * everything appended while a flush runs goes out in the next one, as ONE write and ONE
 * fdatasync; each `put` resolves only after the fdatasync that covers it. Where the platform
 * has `O_DSYNC` (not Windows), segments are opened with it and the write is the sync: one call
 * on the thread pool instead of two, the same guarantee. Acknowledgements (`remove`) and refusals
 * (`supersede`) are records too, not synced for their own sake; an acknowledgement waits for the
 * next flush (the next report's, usually) or `ACK_LINGER_MS`, whichever comes first, so that one
 * job costs one write, not two. Records are self-checking lines (`outbox-log.ts`); a segment
 * (`outbox-000001.log`) is replaced by a smaller one when most of it is acknowledged.
 *
 * Why nothing reported is lost, and nothing acknowledged comes back except harmlessly:
 * 1. A report is sent only after `put` resolved, i.e. after the fdatasync covering its record,
 *    and only if the segment's name was made durable (directory fsync) before that segment got
 *    its first record. A crash before that leaves at most a record nobody was told about: it is
 *    sent at the next start (the coordinator then decides, like any late report), or is torn and
 *    dropped (the job is redone: nothing was reported).
 * 2. A crash tears at most the unsynced end of a segment; records are checked line by line, so
 *    a torn tail is cut off at open and garbage in the middle is skipped, never believed.
 * 3. An ack record lost in a crash only brings the entry back: it is resent and the coordinator
 *    answers `duplicate` (or `stale`, and it is set aside again). So acks need no fsync.
 * 4. A superseded entry is appended to `superseded.jsonl` and synced BEFORE its `sup` record is
 *    written, so an entry leaves the log only once the operator's copy is durable.
 * 5. Compaction writes the live set (plus entries whose `sup` record is still queued) to segment
 *    n+1, syncs it and the directory, and only then deletes the older segments. Open reads every
 *    segment in number order, later records winning: a crash before the deletion leaves old and
 *    new both readable, and the new one only repeats what the old one says is live (a torn new
 *    segment repeats a prefix of it). Open then consolidates several segments into one.
 * 6. A failed write or fsync (disk full, I/O error) rejects the puts of that flush, but only
 *    after the segment is cut back (truncated and synced) to where that write began: records it
 *    did get onto the disk (a disk full after the first few lines, a write that reached the page
 *    cache before its sync failed) must not come back at the next open as reports, since their
 *    puts were refused and the agent gives those attempts back as failed. A crash before the
 *    cut leaves records nobody was told about (point 1). If the cut fails too, the rejected
 *    attempts are `voided`: the next segment written carries an `ack` record for each (unless a
 *    later put made it live), until no older segment is left, so they cannot come back once a
 *    write works again; a restart before that can still bring them back (logged when it may).
 *    The next flush first rewrites the live set to a new segment: after a failed fsync the
 *    kernel's copy of the old file cannot be trusted.
 * 7. From the first failed write until a write works again, the outbox is failing (`failure`,
 *    `watch`): it retries every `retryMs` (default `RETRY_MS`) on its own, as well as at every
 *    put, by starting that new segment. The agent takes no new work meanwhile (reporter.ts).
 * 8. A full disk: the directory keeps a reserve file (`outbox.reserve`, `reserveBytes`, made at
 *    open), so that a report still lands when the disk fills up: a write that fails with ENOSPC is
 *    cut back, the reserve deleted and the write tried once more. The outbox is failing from then
 *    on (no new work), and writes are said to work again only once the reserve is made again:
 *    a write that frees space (a new segment, which drops what was acknowledged) proves nothing
 *    on a full disk. So a job that ran keeps its result, and the agent pauses, rather than
 *    running jobs whose results it then loses. A step of `open()` that writes (the lock, the format
 *    file, a new segment) and fails for want of space deletes the reserve once and is tried
 *    again: an agent restarted on a full disk still opens and sends the reports it holds. The
 *    reserve is at most `reserveBytesFor(RESERVE_SLOTS_MAX)`, written in chunks, and only when
 *    `statfs` shows room for it and `reserveMargin`: never by filling the disk.
 * 9. Every `checkMs` (the lock's touch interval) the outbox reads its lock back and looks at its
 *    files. Another process's lock in the file: two agents write this directory, and the outbox
 *    stops writing at once, rejecting puts, and tells `onLockLost` (the agent stops). Its
 *    directory, lock or segment deleted (on Linux the open segment still takes writes, which
 *    then vanish at the next crash): it makes the directory again, takes its lock again and
 *    writes the pending reports to a new segment, logging an error. A write that fails with
 *    ENOENT looks again at once.
 *
 * 10. Versions (outbox-log.ts): `open()` reads `outbox.format` under the lock, refuses a directory a
 *    newer agent wrote in a format this SDK cannot read (the error names both formats and what to
 *    do), and writes the file, durably, before anything else when it is missing (a new directory,
 *    or one of a log-era SDK from before the file). A record of a newer agent that this SDK does
 *    not know is never cut off nor rewritten: while a segment holds one, this SDK deletes no
 *    segment and does not compact (a record's meaning may depend on records around it, in that
 *    segment and the others: only the agent that knows it may drop any of them). It appends to the
 *    last segment; past `compactBytes` it starts a new, empty one (its records, read in segment
 *    order, are then exactly those of one long segment), so that no file grows past what `open()`
 *    can read (2 GiB); after a failed write, a new one with the live set. The newer agent, started
 *    again, compacts. The directory made again (point 9), this holds only while a segment left
 *    holds such a record.
 *
 * Windows: names use only letters, digits, `-` and `.`; a file is closed before it is deleted;
 * directories cannot be fsynced there (skipped, as before: a new segment's name then rests on
 * NTFS's metadata journal). The pre-log format (`<attemptId>.json` per entry) is imported at
 * open, durably, then removed. One process per directory: `outbox-lock.ts`.
 *
 * Reports hold whatever handlers return, secrets often: the directory is made 0700 and every file
 * in it 0600, and a directory found open to other users is tightened (logged). On Windows mode
 * bits mean little: the directory's ACL decides there (docs/agent.md), and nothing is checked.
 */
import { randomBytes } from 'node:crypto';
import { constants as fsConstants } from 'node:fs';
import fs, { type FileHandle } from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from 'pino';
import {
  applyRecords,
  ATTEMPT_ID,
  checkFormat,
  encodeRecord,
  isEntry,
  LEGACY_ENTRY,
  LEGACY_SUPERSEDED,
  LEGACY_TMP,
  OUTBOX_FORMAT,
  readJsonFile,
  readSupersededFile,
  scanSegment,
  segmentName,
  segmentNumbers,
  sortEntries,
  SUPERSEDED_FILE,
  writeFormat,
  type OutboxEntry,
  type SupersededEntry,
} from './outbox-log.js';
import { lockOutbox, TOUCH_MS, type OutboxLock } from './outbox-lock.js';
import { monotonic } from './clock.js';

export { readOutbox, type OutboxEntry, type SupersededEntry } from './outbox-log.js';

/**
 * Segment files are opened with O_DSYNC where Node has it (Linux, macOS; not Windows): each
 * write returns once its data is durable, as a write followed by fdatasync would.
 */
const DSYNC: number = process.platform === 'win32' ? 0 : (fsConstants.O_DSYNC ?? 0);
/** Modes of the directory and of the files in it: this user's only (header). */
const DIR_MODE = 0o700;
const FILE_MODE = 0o600;

/** How long an acknowledgement record waits for a flush to ride with before it is written alone. */
export const ACK_LINGER_MS = 50;
/** How often a failing outbox tries again to write (a new segment with the pending reports). */
export const RETRY_MS = 2000;
/** The reserve file kept in the directory, deleted to make room for a report when the disk is full. */
export const RESERVE_FILE = 'outbox.reserve';
/**
 * The most slots a reserve counts (`reserveBytesFor`): 32, about 9.1 MiB. Room for 32 full-size
 * reports (most are far smaller: thousands of them) is enough for the jobs that end as the disk
 * fills; past it a report that does not fit is refused, and its job redone, never lost unsaid.
 */
export const RESERVE_SLOTS_MAX = 32;
/**
 * The reserve an agent keeps: room for a full-size report (256 KiB of result, plus its record) of
 * every slot, up to `RESERVE_SLOTS_MAX` slots, and 1 MiB for the rest (a new segment,
 * acknowledgements). About 1.25 MiB for one slot, at most about 9.1 MiB.
 */
export function reserveBytesFor(slots: number): number {
  return 1024 * 1024 + Math.min(Math.max(1, slots), RESERVE_SLOTS_MAX) * 260 * 1024;
}
/**
 * The free space a reserve file of `bytes` must leave when it is made: 64 KiB and a quarter of
 * it. Made only when the disk has room for both (`statfs`), so that making it never fills the
 * disk (and every try while it is full would otherwise fill it to the last byte).
 */
export function reserveMargin(bytes: number): number {
  return 64 * 1024 + Math.ceil(bytes / 4);
}
/** The reserve file is written in chunks of this size, from one buffer. */
export const RESERVE_CHUNK = 1024 * 1024;
/** Shared by the outboxes of the process: its content does not matter, only the blocks it takes. */
let reserveChunk: Buffer | undefined;

export interface OutboxOptions {
  /**
   * A segment is compacted once it is at least this large and its live entries take at most a
   * quarter of it; default 4 MiB. The log is then at most about 4 × the live entries, or this.
   */
  compactBytes?: number;
  /** While writes fail, how often to try again without waiting for a put; default `RETRY_MS`. */
  retryMs?: number;
  /** Size of the reserve file (header, point 8); default `reserveBytesFor(1)`. 0: none. */
  reserveBytes?: number;
  /** How often the lock and the files are checked, and the lock touched (point 9); default 10 s. */
  checkMs?: number;
}

/** Counters, for tests and benchmarks. */
export interface OutboxStats {
  /** Flushes: one `write` each. */
  writes: number;
  /** Syncs of every kind (log, `superseded.jsonl`, directory): fsync/fdatasync calls, and writes
   * of a segment opened with O_DSYNC (each of those is durable when it returns). */
  fsyncs: number;
  compactions: number;
}

interface Waiter {
  resolve(): void;
  reject(err: Error): void;
  /** The attempt of a `put`. */
  put?: string;
}

/** Told when writes start failing (the error) and when they work again (`undefined`). */
export type OutboxWatcher = (failure: Error | undefined) => void;

/** What `open()` was doing, for its error (`openError`). */
type OpenStep = 'creating the directory' | 'taking the lock' | 'checking its format' | 'reading the log' | 'writing a new segment' | 'making the reserve file';

export class Outbox {
  readonly stats: OutboxStats = { writes: 0, fsyncs: 0, compactions: 0 };
  private readonly live = new Map<string, OutboxEntry>();
  /** Size of each live entry's `put` line, for the compaction rule. */
  private readonly sizes = new Map<string, number>();
  private liveBytes = 0;
  private readonly compactBytes: number;
  private readonly retryMs: number;
  private readonly reserveBytes: number;
  private readonly checkMs: number;
  private state: 'new' | 'opening' | 'open' | 'closing' | 'closed' = 'new';
  private lock: OutboxLock | undefined;
  private fh: FileHandle | undefined;
  /** Number of the segment written to; older ones still on disk. */
  private segNo = 0;
  private older: number[] = [];
  /**
   * A segment holds records this SDK does not know (header, point 10): no segment is deleted, nor
   * the log compacted, while it is open.
   */
  private foreign = false;
  /** Bytes of the current segment (the next write goes there). */
  private size = 0;
  /** Written since the last fdatasync. */
  private dirty = false;
  /**
   * Writes fail, or the disk is full (the reserve was used): the outbox is failing (watchers,
   * no new work) until a new segment is written (if `mustRotate`) and the reserve made again.
   */
  private failed: Error | undefined;
  /** Set by a failed write or fsync: the next flush starts a new segment first. */
  private mustRotate = false;
  /** The reserve file was used (or never made): it is made again before writes are said to work. */
  private reserveMissing = false;
  /** When `failed` was set (`monotonic()`). */
  private failedAt = 0;
  /** Why the directory must be made again (it, the lock or the segment was deleted): done by the next flush. */
  private relocate: string | undefined;
  /** Another process took the lock over: nothing is written any more. */
  private lost: Error | undefined;
  private readonly lostListeners = new Set<(error: Error) => void>();
  private checkTimer: NodeJS.Timeout | undefined;
  private checking = false;
  private openStep: OpenStep = 'creating the directory';
  private retryTimer: NodeJS.Timeout | undefined;
  private readonly watchers = new Set<OutboxWatcher>();
  /**
   * Attempts whose put was rejected but whose record may still be in a segment (cutting the
   * failed write off failed too): each new segment says `ack` for them until no older one is left.
   */
  private readonly voided = new Set<string>();
  // The queue of the next flush.
  private qLines: Buffer[] = [];
  private qWaiters: Waiter[] = [];
  private qSync = false;
  private qSup: SupersededEntry[] = [];
  // Acknowledgement records waiting for the next flush (or the linger timer).
  private aLines: Buffer[] = [];
  private aWaiters: Waiter[] = [];
  private linger: NodeJS.Timeout | undefined;
  private kickPending = false;
  private flushing: Promise<void> | undefined;

  constructor(
    readonly dir: string,
    private readonly log: Logger,
    options: OutboxOptions = {},
  ) {
    this.compactBytes = options.compactBytes ?? 4 * 1024 * 1024;
    this.retryMs = options.retryMs ?? RETRY_MS;
    this.reserveBytes = options.reserveBytes ?? reserveBytesFor(1);
    this.checkMs = options.checkMs ?? TOUCH_MS;
  }

  /**
   * The error of the write that failed, while writes fail (disk full, I/O error): a `put` now is
   * likely to be rejected. `undefined` when writes work.
   */
  get failure(): Error | undefined {
    return this.lost ?? this.failed;
  }

  /**
   * Calls `watcher` when writes start failing (with the error), before the puts of that write are
   * rejected, and when a write works again (`undefined`). Returns the way to stop watching.
   */
  watch(watcher: OutboxWatcher): () => void {
    this.watchers.add(watcher);
    return () => this.watchers.delete(watcher);
  }

  /**
   * Calls `listener` once if another process takes this directory's lock over while it is open
   * (header, point 9): the outbox has stopped writing (puts are rejected), and the agent must stop.
   */
  onLockLost(listener: (error: Error) => void): () => void {
    this.lostListeners.add(listener);
    return () => this.lostListeners.delete(listener);
  }

  /**
   * Takes the directory's lock, creates it if needed, reads the log (cutting off a torn tail),
   * imports entries of the pre-log format, and returns the pending entries, oldest first.
   */
  async open(): Promise<OutboxEntry[]> {
    if (this.state !== 'new') throw new Error('outbox already opened');
    this.state = 'opening';
    try {
      this.openStep = 'creating the directory';
      await this.makeDir();
      this.openStep = 'taking the lock';
      // ENOSPC here means the name was free (a lock held by another agent is EEXIST): the
      // reserve deleted is this directory's own, left by its last run.
      this.lock = await this.withRoom(() => lockOutbox(this.dir, this.log));
    } catch (err) {
      this.state = 'closed';
      throw this.openError(err);
    }
    try {
      this.openStep = 'checking its format';
      await this.withRoom(() => this.format());
      this.openStep = 'reading the log';
      await this.load();
      this.state = 'open';
    } catch (err) {
      await this.fh?.close().catch(() => undefined);
      await this.lock.release().catch(() => undefined);
      this.state = 'closed';
      throw this.openError(err);
    }
    this.checkTimer = setInterval(() => void this.check(), this.checkMs);
    this.checkTimer.unref();
    // Without its reserve the outbox opens failing (no new work), not at all: the reports it
    // holds from an earlier run must still be sent.
    this.openStep = 'making the reserve file';
    await this.makeReserve().catch((err: unknown) => {
      this.reserveMissing = true;
      this.fail(err as Error, 'outbox: cannot make its reserve file (the disk is full?): this agent takes no new work until it can (free some disk space); the reports it holds are sent', {
        reserveBytes: this.reserveBytes,
      });
    });
    if (this.failed) this.scheduleRetry();
    return this.pending();
  }

  /**
   * An error of the file system while opening, as one a user can act on: the directory, the step,
   * a hint. The lock's refusal (another agent uses the directory) says so itself: as it is.
   */
  private openError(err: unknown): unknown {
    const code = (err as NodeJS.ErrnoException | undefined)?.code;
    if (!code) return err;
    const hint =
      code === 'ENOSPC' || code === 'EDQUOT'
        ? 'the disk is full: free some space'
        : code === 'EACCES' || code === 'EPERM'
          ? "permissions: the agent's user must be able to create and write files there"
          : code === 'EROFS'
            ? 'the file system is read-only'
            : (code === 'ENOTDIR' || code === 'EEXIST') && this.openStep === 'creating the directory'
              ? 'a file is in the way: the outbox must be a directory'
              : 'disk full? permissions?';
    return new Error(`cannot open the outbox ${this.dir}: ${(err as Error).message}, while ${this.openStep} (${hint})`, { cause: err });
  }

  /** Entries not yet acknowledged, oldest first. */
  pending(): OutboxEntry[] {
    return sortEntries([...this.live.values()]);
  }

  has(attemptId: string): boolean {
    return this.live.has(attemptId);
  }

  /**
   * Makes `e` durable: resolves once the fdatasync covering its record is done (an entry of the
   * same attempt is replaced). Only then may it be sent.
   */
  put(e: OutboxEntry): Promise<void> {
    if (this.lost) return Promise.reject(this.lost);
    if (this.state !== 'open') return Promise.reject(new Error(`outbox ${this.dir} is not open`));
    if (!ATTEMPT_ID.test(e.attemptId)) return Promise.reject(new Error(`not an attempt id: ${e.attemptId}`));
    const line = encodeRecord({ t: 'put', e });
    return new Promise((resolve, reject) => {
      const done = () => {
        this.setLive(e, line.length);
        resolve();
      };
      this.enqueue(line, { resolve: done, reject, put: e.attemptId }, true);
    });
  }

  /**
   * The coordinator has it (`ok` or `duplicate`): forget it. Resolves once the ack record is
   * written, not synced: if a crash loses it, the entry is resent and answered `duplicate`. The
   * record goes out with the next flush, or alone after `ACK_LINGER_MS`.
   */
  remove(attemptId: string): Promise<void> {
    if (this.state !== 'open' || !this.live.has(attemptId)) return Promise.resolve();
    this.dropLive(attemptId);
    return new Promise((resolve) => {
      this.aLines.push(encodeRecord({ t: 'ack', id: attemptId }));
      // A failed write is logged by the flush; the entry just comes back at the next start.
      this.aWaiters.push({ resolve, reject: () => resolve() });
      this.linger ??= setTimeout(() => {
        this.linger = undefined;
        this.takeAcks();
        this.kick();
      }, ACK_LINGER_MS);
    });
  }

  /**
   * The coordinator refused it (`reason`: stale, invalid…): never send it again, keep it for
   * the operator in `superseded.jsonl`. Resolves once that copy is synced and the log says so:
   * true, or false at once if the outbox holds no report of that attempt.
   */
  supersede(attemptId: string, reason?: string): Promise<boolean> {
    const e = this.live.get(attemptId);
    if (this.state !== 'open' || !e || this.lost) return Promise.resolve(false);
    this.dropLive(attemptId);
    const s: SupersededEntry = { ...e, supersededAt: new Date().toISOString(), ...(reason ? { reason } : {}) };
    return new Promise((resolve, reject) => this.enqueue(encodeRecord({ t: 'sup', id: attemptId }), { resolve: () => resolve(true), reject }, false, s));
  }

  /**
   * Writes what is queued, syncs, releases the file and the lock. `put` fails afterwards;
   * entries still pending stay on disk for the next `open()`.
   */
  async close(): Promise<void> {
    if (this.state !== 'open') return;
    this.state = 'closing';
    clearTimeout(this.retryTimer);
    this.retryTimer = undefined;
    clearInterval(this.checkTimer);
    this.checkTimer = undefined;
    if (this.lost) {
      // Another process writes here now: nothing more of ours, and its lock is not ours to delete.
      await this.flushing;
      await this.fh?.close().catch(() => undefined);
      this.fh = undefined;
      await this.lock?.release().catch(() => undefined);
      this.state = 'closed';
      return;
    }
    this.takeAcks();
    // Failing: one more try, so that the next open finds a clean segment if the disk allows.
    if (this.failed) await this.drainQueue();
    while (this.flushing || this.qLines.length) await this.drainQueue();
    try {
      // Not needed for safety (see remove), but a clean stop should not resend.
      if (this.dirty && this.fh) await this.sync(this.fh);
    } catch (err) {
      this.log.warn({ err, dir: this.dir }, 'outbox: final sync failed');
    }
    await this.fh?.close();
    this.fh = undefined;
    await this.lock?.release();
    this.state = 'closed';
  }

  // ─────────────────────────────── flushing ───────────────────────────────

  private enqueue(line: Buffer, w: Waiter, sync: boolean, sup?: SupersededEntry): void {
    if (this.lost) return w.reject(this.lost);
    this.takeAcks(); // before this line: the log keeps the order of the calls
    this.qLines.push(line);
    this.qWaiters.push(w);
    if (sync) this.qSync = true;
    if (sup) this.qSup.push(sup);
    this.kick();
  }

  /** Moves the waiting acknowledgement records into the queue of the next flush. */
  private takeAcks(): void {
    if (this.linger) clearTimeout(this.linger);
    this.linger = undefined;
    if (!this.aLines.length) return;
    this.qLines.push(...this.aLines);
    this.qWaiters.push(...this.aWaiters);
    this.aLines = [];
    this.aWaiters = [];
  }

  private kick(): void {
    if (!this.qLines.length || this.flushing || this.kickPending) return; // the running flush takes it next
    // One turn of the event loop first, so that everything issued at once shares the flush.
    this.kickPending = true;
    setImmediate(() => {
      this.kickPending = false;
      void this.drainQueue();
    });
  }

  /** Flushes what is queued; while failing, tries to recover even with nothing queued. */
  private drainQueue(): Promise<void> {
    if (this.lost) return this.flushing ?? Promise.resolve();
    if (!this.flushing && (this.qLines.length || this.failed || this.relocate)) this.flushing = this.runFlushes();
    return this.flushing ?? Promise.resolve();
  }

  private async runFlushes(): Promise<void> {
    await null; // `flushing` is assigned before the finally below can clear it
    try {
      if (this.relocate) await this.remake();
      if (this.failed && !this.qLines.length) await this.recover();
      while (this.qLines.length && !this.lost) {
        if (this.mustRotate) await this.recover();
        else if (this.shouldCompact()) await this.compact();
        await this.flushOnce();
      }
      if (this.lost) this.rejectQueued(this.lost);
    } finally {
      this.flushing = undefined;
      if ((this.failed || this.relocate) && !this.lost) this.scheduleRetry();
    }
  }

  /** While failing, tries again in `retryMs` even if no put comes (a put tries at once). */
  private scheduleRetry(): void {
    if (this.state !== 'open' || this.retryTimer) return;
    this.retryTimer = setTimeout(() => {
      this.retryTimer = undefined;
      void this.drainQueue();
    }, this.retryMs);
    this.retryTimer.unref();
  }

  /** A new segment when the current one is mostly acknowledged; a failure leaves the current one in use. */
  private async compact(): Promise<void> {
    try {
      await this.rotate(!this.foreign);
    } catch (err) {
      // The current segment is still good: go on with it. While failing (the disk is full), the
      // episode was logged when it began.
      if (this.failed) this.log.debug({ err, dir: this.dir }, 'outbox: compaction failed (the outbox is failing)');
      else this.log.error({ err, dir: this.dir }, 'outbox: compaction failed');
    }
  }

  /**
   * While failing: a new segment if a write failed (`mustRotate`), then the reserve made again
   * (`reserveMissing`); once both are done, writes work again. A new segment written while the
   * reserve cannot be made serves the puts (a report may still fit), but the outbox stays failing.
   */
  private async recover(): Promise<void> {
    try {
      if (this.mustRotate) {
        await this.rotate(true);
        this.mustRotate = false;
      }
      if (this.reserveMissing) await this.makeReserve();
    } catch (err) {
      if (this.failed) this.log.debug({ err, dir: this.dir }, 'outbox: still cannot write (a new segment, or the reserve)');
      else this.fail(err as Error, 'outbox: cannot write a new segment: the pending reports are not durable; trying again until a write works');
      return;
    }
    if (!this.failed) return;
    this.failed = undefined;
    clearTimeout(this.retryTimer);
    this.retryTimer = undefined;
    this.log.info({ dir: this.dir, failedMs: Math.round(monotonic() - this.failedAt) }, 'outbox: writes work again (a new segment holds the pending reports, and the reserve is made)');
    this.tell(undefined);
  }

  /** Writes start failing: logged once per episode (`msg`), watchers told. */
  private fail(err: Error, msg: string, fields: Record<string, unknown> = {}): void {
    if (this.failed) return;
    this.failed = err;
    this.failedAt = monotonic();
    this.log.error({ err, dir: this.dir, retryMs: this.retryMs, ...fields }, msg);
    this.tell(err);
  }

  /** The reserve file, made if it is not there at its size; a partial one is deleted (it would take the room reports need). */
  private async makeReserve(): Promise<void> {
    const file = path.join(this.dir, RESERVE_FILE);
    if (this.reserveBytes <= 0) {
      this.reserveMissing = false;
      return;
    }
    const st = await fs.stat(file).catch(() => undefined);
    if (st?.size !== this.reserveBytes) {
      await this.roomForReserve(st?.size ?? 0);
      try {
        const fh = await fs.open(file, 'w', FILE_MODE);
        try {
          await writeReserve(fh, this.reserveBytes);
        } finally {
          await fh.close();
        }
      } catch (err) {
        await fs.rm(file, { force: true }).catch(() => undefined);
        throw err;
      }
    }
    this.reserveMissing = false;
  }

  /**
   * Throws ENOSPC if the file system has not room for the reserve and its margin
   * (`reserveMargin`); `existing`: the bytes of a reserve file of another size, freed as it is
   * rewritten. Where free space cannot be read, the write is tried.
   */
  private async roomForReserve(existing: number): Promise<void> {
    let free: number;
    try {
      const s = await fs.statfs(this.dir);
      free = s.bavail * s.bsize + existing;
    } catch {
      return;
    }
    const need = this.reserveBytes + reserveMargin(this.reserveBytes);
    if (free < need) {
      throw Object.assign(new Error(`ENOSPC: not enough free space for the reserve file: ${free} bytes free, ${need} needed (the reserve and a margin)`), { code: 'ENOSPC' });
    }
  }

  /** Deletes the reserve file to make room (header, point 8); false if there was none to delete. */
  private async useReserve(): Promise<boolean> {
    if (this.reserveMissing || this.reserveBytes <= 0) return false;
    this.reserveMissing = true;
    try {
      await fs.rm(path.join(this.dir, RESERVE_FILE));
      return true;
    } catch {
      return false;
    }
  }

  // ───────────────────────── the directory and the lock ─────────────────────────

  /**
   * Makes the directory 0700 (header). One that exists and that other users may enter is made
   * 0700, with a warning; if that fails (another user owns it), a warning says so and the
   * outbox opens all the same.
   */
  private async makeDir(): Promise<void> {
    await fs.mkdir(this.dir, { recursive: true, mode: DIR_MODE });
    if (process.platform === 'win32') return;
    const mode = (await fs.stat(this.dir)).mode & 0o777;
    if (!(mode & 0o077)) return;
    const was = mode.toString(8).padStart(4, '0');
    try {
      await fs.chmod(this.dir, DIR_MODE);
      this.log.warn({ dir: this.dir, mode: was }, 'outbox: its directory was open to other users: made it 0700 (the reports in it hold job results)');
    } catch (err) {
      this.log.warn({ err, dir: this.dir, mode: was }, 'outbox: its directory is open to other users, who may read the job results in it, and could not be made 0700: make it readable by the agent\'s user only');
    }
  }

  /**
   * Every `checkMs`: reads the lock back and looks for the directory, the lock and the segment
   * (header, point 9); touches the lock when all is well.
   */
  private async check(): Promise<void> {
    if (this.state !== 'open' || this.checking || this.lost) return;
    this.checking = true;
    try {
      const lock = await this.lock!.check();
      if (lock.state === 'taken') return this.loseLock(lock.holder);
      let gone: string | undefined = lock.state === 'missing' ? 'its lock file (or the whole directory) was deleted' : undefined;
      if (!gone && this.fh && !this.flushing) {
        const st = await this.fh.stat().catch(() => undefined);
        if (st && st.nlink === 0) gone = `its segment ${segmentName(this.segNo)} was deleted`;
      }
      if (gone) this.remakeSoon(gone);
      else await this.lock!.touch();
    } catch (err) {
      this.log.warn({ err, dir: this.dir }, 'outbox: could not check its lock and files');
    } finally {
      this.checking = false;
    }
  }

  /** The directory must be made again (by the next flush, now or after the running one). */
  private remakeSoon(why: string): void {
    this.relocate ??= why;
    if (this.flushing) void this.flushing.then(() => this.drainQueue());
    else void this.drainQueue();
  }

  /**
   * The directory, its lock or its segment was deleted while open: makes the directory again,
   * takes the lock again, and has the next step write the live set to a new segment.
   */
  private async remake(): Promise<void> {
    const why = this.relocate!;
    try {
      await this.makeDir();
      if (!(await this.lock!.retake())) {
        const holder = await fs.readFile(this.lock!.file, 'utf8').catch(() => '?');
        return this.loseLock(holder.slice(0, 200));
      }
      // Before the new segment (header, point 10).
      await this.format();
      // A deleted directory took the newer agent's records with it; a deleted lock or segment
      // may have left some: whether any segment on disk still holds one.
      this.foreign = await this.holdsForeign();
    } catch (err) {
      this.fail(err as Error, 'outbox: its directory was deleted and cannot be made again: the pending reports are not durable; trying again', { why });
      this.mustRotate = true;
      return;
    }
    this.relocate = undefined;
    this.mustRotate = true;
    this.reserveMissing = true;
    this.log.error(
      { dir: this.dir, why, entries: this.live.size },
      'outbox: deleted while the agent runs: made the directory and its lock again, and the pending reports are written again (delete an outbox only when its agent is stopped)',
    );
    await this.recover();
  }

  /** Whether a segment in the directory holds a record this SDK does not know. */
  private async holdsForeign(): Promise<boolean> {
    for (const n of segmentNumbers(await fs.readdir(this.dir))) {
      const s = await scanSegment(path.join(this.dir, segmentName(n))).catch(() => undefined);
      if (s?.unknown.size) return true;
    }
    return false;
  }

  /** Another process holds the lock: stop writing at once, reject what waits, tell the agent. */
  private loseLock(holder: string): void {
    if (this.lost) return;
    this.lost = new Error(
      `outbox ${this.dir}: another process took its lock over (the lock file now says ${holder}): two agents must never share an outbox directory; this agent stops`,
    );
    clearInterval(this.checkTimer);
    this.checkTimer = undefined;
    clearTimeout(this.retryTimer);
    this.retryTimer = undefined;
    this.log.error({ dir: this.dir, holder }, 'outbox: another process took its lock over: two agents write this directory; this one stops writing it and stops (stop the other one, or give each its own outboxDir)');
    this.takeAcks();
    if (!this.flushing) this.rejectQueued(this.lost);
    for (const l of this.lostListeners) {
      try {
        l(this.lost);
      } catch (err) {
        this.log.error({ err }, 'outbox: a lock listener threw');
      }
    }
  }

  private rejectQueued(err: Error): void {
    const waiters = [...this.qWaiters, ...this.aWaiters];
    this.qLines = [];
    this.qWaiters = [];
    this.qSup = [];
    this.aLines = [];
    this.aWaiters = [];
    for (const w of waiters) w.reject(err);
  }

  private tell(failure: Error | undefined): void {
    for (const w of this.watchers) {
      try {
        w(failure);
      } catch (err) {
        this.log.error({ err }, 'outbox: a watcher threw');
      }
    }
  }

  /** One write and, if a put is in it, one fdatasync for everything queued. */
  private async flushOnce(): Promise<void> {
    const lines = this.qLines;
    const waiters = this.qWaiters;
    const sync = this.qSync;
    const sups = this.qSup;
    this.qLines = [];
    this.qWaiters = [];
    this.qSync = false;
    this.qSup = [];
    const at = this.size;
    let wrote = false;
    const puts = waiters.flatMap((w) => (w.put ? [w.put] : []));
    const buf = lines.length === 1 ? lines[0]! : Buffer.concat(lines);
    const write = async () => {
      const fh = this.fh!;
      this.dirty = true;
      wrote = true;
      await writeAll(fh, buf, at);
      this.size += buf.length;
      this.stats.writes++;
      if (DSYNC) {
        this.stats.fsyncs++;
        this.dirty = false;
      } else if (sync) await this.sync(fh);
    };
    try {
      if (this.mustRotate) throw this.failed ?? new Error('outbox: a new segment could not be written');
      // The operator's copy first: the `sup` record must never be on disk without it.
      if (sups.length) await this.appendSuperseded(sups);
      await write();
    } catch (e) {
      let err = e as Error;
      // Before anyone hears of the rejection (header, point 6).
      let cut = wrote ? await this.cutBack(at, puts) : true;
      // A full disk: the reserve makes room for this write, once (header, point 8).
      if (wrote && cut && isNoSpace(err) && (await this.useReserve())) {
        try {
          await write();
          this.fail(err, 'outbox: the disk is full: the reports were written in the room of the reserve file; this agent takes no new work until the reserve can be made again (free some disk space)', {
            reserveBytes: this.reserveBytes,
            reports: puts.length,
          });
          for (const w of waiters) w.resolve();
          return;
        } catch (again) {
          err = again as Error;
          cut = await this.cutBack(at, puts);
        }
      }
      const first = !this.failed;
      this.mustRotate = true;
      if (first) {
        this.fail(err, 'outbox write failed (disk full? I/O error?): the reports in it are not durable (their puts are rejected); trying again until a write works', {
          records: lines.length,
          reports: puts.length,
        });
      } else if (puts.length) {
        this.log.debug({ dir: this.dir, reports: puts.length }, 'outbox: still failing; reports rejected');
      }
      // A deleted directory: look at once rather than at the next check.
      if ((err as NodeJS.ErrnoException).code === 'ENOENT') this.relocate ??= 'a write found its directory gone';
      // Still live: they are resent at the next start and set aside again.
      for (const s of sups) {
        const e = stripSuperseded(s);
        this.setLive(e, encodeRecord({ t: 'put', e }).length);
      }
      for (const w of waiters) w.reject(err);
      return;
    }
    for (const w of waiters) w.resolve();
  }

  /**
   * Cuts the segment back to `at`, where the failed write began, and syncs, so that no record of
   * it comes back at the next open. If that fails too, the puts of that write are voided in the
   * next segment (header, point 6).
   */
  private async cutBack(at: number, puts: string[]): Promise<boolean> {
    try {
      await this.fh!.truncate(at);
      await this.fh!.datasync();
      this.stats.fsyncs++;
      this.size = at;
      this.dirty = false;
      return true;
    } catch (err) {
      for (const id of puts) this.voided.add(id);
      if (puts.length) {
        this.log.error(
          { err, dir: this.dir, attemptIds: puts },
          'outbox: could not cut off a failed write; if the agent restarts before a write works again, these reports may be sent anyway (accepted if their attempt is still current, else refused by the coordinator and set aside)',
        );
      }
      return false;
    }
  }

  private async sync(fh: FileHandle): Promise<void> {
    await fh.datasync();
    this.stats.fsyncs++;
    this.dirty = false;
  }

  /**
   * The current segment is at least `compactBytes` and mostly acknowledged; or, while a segment
   * holds records this SDK does not know, just at least `compactBytes`: a new segment is then
   * started, deleting nothing (header, point 10), so that no file grows without bound.
   */
  private shouldCompact(): boolean {
    return this.size >= this.compactBytes && (this.foreign || this.liveBytes * 4 <= this.size);
  }

  /**
   * Starts segment n+1 holding the live entries (and those whose `sup` record is still queued:
   * until it is written they must stay in the log), syncs it and the directory, then deletes
   * the older segments. A crash anywhere leaves a readable state (header, point 5).
   *
   * While a segment holds records this SDK does not know (`foreign`), no segment is deleted, and
   * a compaction (`copyLive` false) starts an empty segment: the records, read in segment order,
   * are then exactly what one long segment would hold, nothing repeated, nothing moved past a
   * record of the newer agent. After a failed write (`copyLive`), the live set is written anew.
   */
  private async rotate(copyLive: boolean): Promise<void> {
    const next = this.segNo + 1;
    const file = path.join(this.dir, segmentName(next));
    const snapshot = [...this.live.values(), ...this.qSup.map(stripSuperseded)];
    const kept = new Set(snapshot.map((e) => e.attemptId));
    // Rejected puts that an older segment may still hold: void them after it (header, point 6).
    const voids = [...this.voided].filter((id) => !kept.has(id)).map((id) => encodeRecord({ t: 'ack', id }));
    const buf = Buffer.concat([...(copyLive ? snapshot.map((e) => encodeRecord({ t: 'put', e })) : []), ...voids]);
    const fh = await fs.open(file, fsConstants.O_WRONLY | fsConstants.O_CREAT | fsConstants.O_EXCL | DSYNC, FILE_MODE);
    try {
      await writeAll(fh, buf, 0);
      if (!DSYNC) await fh.datasync();
      this.stats.fsyncs++;
      await this.syncDir(); // the new name is durable before anything depends on it
    } catch (err) {
      // Nothing depends on the new segment yet; left behind, it would block the next try (O_EXCL).
      await fh.close().catch(() => undefined);
      await fs.rm(file, { force: true }).catch(() => undefined);
      throw err;
    }
    const old = this.fh;
    const older = [...this.older, ...(old ? [this.segNo] : [])];
    this.fh = fh;
    this.segNo = next;
    this.older = older;
    this.size = buf.length;
    this.dirty = false;
    this.stats.compactions++;
    // Windows: close before deleting. A failed close or delete leaves an old segment that the
    // next open reads and consolidates; it is not an error for the new one.
    await old?.close().catch((err: unknown) => this.log.warn({ err }, 'outbox: closing the old segment failed'));
    for (const n of this.foreign ? [] : older) {
      await fs.rm(path.join(this.dir, segmentName(n)), { force: true }).then(
        () => (this.older = this.older.filter((x) => x !== n)),
        (err: unknown) => this.log.warn({ err, segment: segmentName(n) }, 'outbox: could not delete an old segment'),
      );
    }
    await this.syncDir();
    if (!this.older.length) this.voided.clear(); // no segment left that holds them, durably
  }

  // ─────────────────────────────── opening ───────────────────────────────

  /**
   * Refuses a directory in a format this SDK cannot read; writes `outbox.format` where there is
   * none (or an older one), durably, before anything else is written (header, point 10).
   */
  private async format(): Promise<void> {
    const f = await checkFormat(this.dir);
    if (!f || f.format < OUTBOX_FORMAT) {
      await writeFormat(this.dir);
    } else if (f.format > OUTBOX_FORMAT) {
      this.log.warn({ dir: this.dir, format: f.format, minReader: f.minReader, known: OUTBOX_FORMAT }, 'outbox: written by a newer agent in a format this one can still read: opened');
    }
  }

  private async load(): Promise<void> {
    const names = await fs.readdir(this.dir);
    const segs = segmentNumbers(names);
    const live = new Map<string, OutboxEntry>();
    const unknown = new Map<string, { records: number; segments: string[] }>();
    let tail = { validEnd: 0, size: 0 };
    for (const n of segs) {
      const file = path.join(this.dir, segmentName(n));
      const s = await scanSegment(file);
      if (s.corrupt) this.log.error({ file, lines: s.corrupt }, 'outbox: corrupt records in the middle of a segment skipped (a damaged line holds one record, two if the damage joined it with the next); the records after them are kept');
      if (s.validEnd < s.size) this.log.warn({ file, bytes: s.size - s.validEnd }, 'outbox: a write torn by a crash at the end of a segment is ignored');
      if (s.unknown.size) this.foreign = true;
      for (const [type, count] of s.unknown) {
        const u = unknown.get(type) ?? { records: 0, segments: [] };
        u.records += count;
        u.segments.push(segmentName(n));
        unknown.set(type, u);
      }
      applyRecords(live, s.records);
      tail = s;
    }
    for (const [type, u] of unknown) {
      this.log.warn(
        { dir: this.dir, type, ...u },
        `outbox: records of a type this agent does not know (${type}), written by a newer agent: skipped, and kept for it: this agent does not compact the outbox nor delete any of it (it grows, in new segments of about ${this.compactBytes} bytes, until a newer agent opens it); a report among them is not sent by this agent, and its job may run again`,
      );
    }

    // The pre-log format: import pending entries and set-aside ones, delete the files after.
    const legacy: string[] = [];
    const legacySup: SupersededEntry[] = [];
    for (const name of names) {
      const file = path.join(this.dir, name);
      if (LEGACY_TMP.test(name)) {
        // Never renamed, so never sent: the coordinator will have this attempt redone.
        this.log.warn({ file }, 'outbox: removing a torn write of the old format left by a crash');
        await fs.rm(file, { force: true });
        continue;
      }
      const m = LEGACY_ENTRY.exec(name) ?? LEGACY_SUPERSEDED.exec(name);
      if (!m) continue;
      const e = await readJsonFile(file);
      if (!isEntry(e) || e.attemptId !== m[1]) {
        this.log.error({ file }, 'outbox: unreadable entry of the old format: moved aside as .corrupt');
        await fs.rename(file, `${file}.corrupt`).catch(() => undefined);
        continue;
      }
      if (LEGACY_ENTRY.test(name)) live.set(e.attemptId, e);
      else legacySup.push({ ...e, supersededAt: (await fs.stat(file)).mtime.toISOString() });
      legacy.push(file);
    }
    for (const e of live.values()) this.setLive(e, encodeRecord({ t: 'put', e }).length);

    await this.repairSuperseded();
    if (legacySup.length) {
      // Imported twice if a crash comes before the files are deleted: skip those already in.
      const have = new Set((await readSupersededFile(this.dir)).map((s) => s.attemptId));
      const fresh = legacySup.filter((s) => !have.has(s.attemptId));
      if (fresh.length) await this.appendSuperseded(fresh);
    }

    if (segs.length && (segs.length === 1 || this.foreign) && !legacy.length) {
      // One segment, or several holding records of a newer agent (never consolidated then,
      // header, point 10): the last one is appended to.
      this.older = segs.slice(0, -1);
      this.segNo = segs.at(-1)!;
      this.fh = await fs.open(path.join(this.dir, segmentName(this.segNo)), fsConstants.O_RDWR | DSYNC);
      if (tail.validEnd < tail.size) {
        await this.fh.truncate(tail.validEnd);
        await this.sync(this.fh);
      }
      this.size = tail.validEnd;
      this.openStep = 'writing a new segment';
      if (this.shouldCompact()) {
        // Optional: the segment is good as it is. Failing (the reserve used, or an I/O error),
        // the outbox opens failing: no new work, the reports it holds are sent (header, point 8).
        await this.withRoom(() => this.rotate(!this.foreign)).catch((err: unknown) =>
          this.fail(err as Error, 'outbox: compaction at open failed: the current segment is used; this agent takes no new work until writes work again (disk full? I/O error?); the reports it holds are sent'),
        );
      }
    } else {
      // No log yet, several segments (a compaction was cut short), or an import: one new
      // segment with the live set, synced, before the old files go.
      this.segNo = segs.at(-1) ?? 0;
      this.older = segs;
      this.openStep = 'writing a new segment';
      await this.withRoom(() => this.rotate(true));
      for (const file of legacy) await fs.rm(file, { force: true });
      if (legacy.length) {
        await this.syncDir();
        this.log.info({ dir: this.dir, entries: legacy.length }, 'outbox: imported the files of the old format into the log');
      }
    }
  }

  /**
   * Runs a step of `open()` that writes; if it fails for want of space, deletes the reserve file
   * (once per open: `useReserve`) and runs it again. Started on a full disk, the agent must still
   * open and send the reports it holds; it then opens failing, as the reserve cannot be made.
   */
  private async withRoom<T>(step: () => Promise<T>): Promise<T> {
    try {
      return await step();
    } catch (err) {
      if (!isNoSpace(err as Error) || !(await this.useReserve())) throw err;
      this.log.warn({ err, dir: this.dir, step: this.openStep, reserveBytes: this.reserveBytes }, 'outbox: the disk is full at open: deleted the reserve file to make room');
      return await step();
    }
  }

  /** A torn last line of `superseded.jsonl` would swallow the next one: cut it off. */
  private async repairSuperseded(): Promise<void> {
    const file = path.join(this.dir, SUPERSEDED_FILE);
    let buf: Buffer;
    try {
      buf = await fs.readFile(file);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === 'ENOENT') return;
      throw err;
    }
    if (!buf.length || buf[buf.length - 1] === 0x0a) return;
    // Its `sup` record was never written (it follows the sync of this line): still live.
    this.log.warn({ file }, 'outbox: cutting off a torn last line of superseded.jsonl');
    await fs.truncate(file, buf.lastIndexOf(0x0a) + 1);
  }

  private async appendSuperseded(items: SupersededEntry[]): Promise<void> {
    const fh = await fs.open(path.join(this.dir, SUPERSEDED_FILE), 'a', FILE_MODE);
    try {
      await fh.write(items.map((s) => `${JSON.stringify(s)}\n`).join(''));
      await fh.datasync();
      this.stats.fsyncs++;
    } finally {
      await fh.close();
    }
    await this.syncDir(); // in case this created it; rare enough not to track
  }

  // ─────────────────────────────── helpers ───────────────────────────────

  private setLive(e: OutboxEntry, bytes: number): void {
    this.live.set(e.attemptId, e);
    this.liveBytes += bytes - (this.sizes.get(e.attemptId) ?? 0);
    this.sizes.set(e.attemptId, bytes);
  }

  private dropLive(attemptId: string): void {
    this.live.delete(attemptId);
    this.liveBytes -= this.sizes.get(attemptId) ?? 0;
    this.sizes.delete(attemptId);
  }

  /** fsync the directory so a created or deleted name survives a power cut (not possible on Windows). */
  private async syncDir(): Promise<void> {
    if (process.platform === 'win32') return;
    const dh = await fs.open(this.dir, 'r');
    try {
      await dh.sync();
      this.stats.fsyncs++;
    } finally {
      await dh.close();
    }
  }
}

/** A write refused for want of space (a quota counts too). */
function isNoSpace(err: Error): boolean {
  const code = (err as NodeJS.ErrnoException).code;
  return code === 'ENOSPC' || code === 'EDQUOT';
}

function stripSuperseded(s: SupersededEntry): OutboxEntry {
  const { supersededAt: _at, reason: _why, ...e } = s;
  return e;
}

/**
 * Writes `bytes` of the reserve in chunks of `RESERVE_CHUNK` from one buffer, made once per
 * process. Random bytes: a compressing file system would store zeros in no space at all; each
 * 4 KiB page of a chunk starts with the chunk's number, so that no two chunks are the same (a
 * deduplicating one would store a repeated chunk once).
 */
async function writeReserve(fh: FileHandle, bytes: number): Promise<void> {
  const chunk = (reserveChunk ??= randomBytes(RESERVE_CHUNK));
  for (let off = 0, i = 0; off < bytes; off += RESERVE_CHUNK, i++) {
    const n = Math.min(RESERVE_CHUNK, bytes - off);
    for (let p = 0; p < n; p += 4096) chunk.writeUInt32LE(i, p);
    await writeAll(fh, n === RESERVE_CHUNK ? chunk : chunk.subarray(0, n), off);
  }
}

/** `write` may write less than asked; positions are explicit so a retry overwrites a torn end. */
async function writeAll(fh: FileHandle, buf: Buffer, position: number): Promise<void> {
  let off = 0;
  while (off < buf.length) {
    const { bytesWritten } = await fh.write(buf, off, buf.length - off, position + off);
    off += bytesWritten;
  }
}
