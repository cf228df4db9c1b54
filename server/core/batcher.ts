/**
 * Groups the starts, completions and failures reported by every stream of this coordinator:
 * whatever arrived since the last flush goes to the database as one statement per kind, each
 * kind in a lane of its own with up to `MAX_IN_FLIGHT` statements at once, so a slow statement
 * does not hold up the next batch, nor the other kinds.
 * Order between them does not matter for correctness: a completion of a claimed attempt starts
 * it implicitly, and a start that arrives after its attempt's report is answered `duplicate`.
 * Under load, batches grow by themselves; alone, an item waits only for the next turn of the
 * event loop, except a completion when the coordinator lingers (`completionLingerMs`): a
 * completion that finds no statement of its kind running waits up to that long for others to
 * share its statement (and its commit), as jobs that come one at a time otherwise never do.
 */
import type { Logger } from '../log.js';
import {
  attemptCompleteMany,
  attemptFail,
  attemptStartMany,
  type CompleteParams,
  type FailParams,
  type JobSummary,
  type Queryable,
} from '../store/index.js';
import type { Outcome } from '../domain/outcomes.js';
import { limits } from '../domain/validation.js';
import { allEnded } from './settle.js';

/** Statements of one kind allowed at once (each holds a pool connection while it runs). */
const MAX_IN_FLIGHT = 2;

type Pending<P> = { p: P; at: number; resolve: (o: Outcome<JobSummary>) => void; reject: (e: unknown) => void };
type StartItem = { attemptId: string; agentId: string };

export interface BatcherStats {
  /** Statements run, and items they carried. */
  statements: number;
  items: number;
  /** Total ms items waited in the queue before their statement started, and ms spent in statements. */
  queuedMs: number;
  statementMs: number;
}

/**
 * One kind of item (starts, completions, failures): whatever arrived since its last flush goes
 * out as one batch, with up to `MAX_IN_FLIGHT` batches of this kind running at once. Kinds do not
 * wait for each other: a batch of completions is not held up behind a batch of starts.
 */
class Lane<P> {
  private queue: Array<Pending<P>> = [];
  private readonly inFlight = new Set<Promise<void>>();
  private scheduled = false;
  /** The linger's timer while a batch waits for company (only when nothing of this kind runs). */
  private lingering: NodeJS.Timeout | undefined;

  constructor(
    private readonly run: (items: P[]) => Promise<Array<Outcome<JobSummary>>>,
    private readonly stats: BatcherStats,
    private readonly log: Logger,
    /** How long a batch that finds its lane idle waits for more items; 0: the next turn. */
    private readonly lingerMs = 0,
  ) {}

  add(p: P): Promise<Outcome<JobSummary>> {
    return new Promise((resolve, reject) => {
      this.queue.push({ p, at: performance.now(), resolve, reject });
      this.schedule();
    });
  }

  get busy(): boolean {
    return this.scheduled || this.inFlight.size > 0;
  }

  /** Waits until everything queued is written; a lingering batch goes at once. */
  async idle(): Promise<void> {
    while (this.busy) {
      this.hurry();
      if (this.inFlight.size) await Promise.all(this.inFlight);
      else await new Promise((r) => setImmediate(r));
    }
  }

  private schedule(): void {
    // A full batch has nothing to wait for.
    if (this.lingering && this.queue.length >= limits.claimBatch) this.hurry();
    if (this.scheduled || this.inFlight.size >= MAX_IN_FLIGHT) return;
    this.scheduled = true;
    // Only a lane with nothing running lingers: under load, batches fill while statements run.
    if (this.lingerMs > 0 && this.inFlight.size === 0) this.lingering = setTimeout(() => this.flush(), this.lingerMs);
    else setImmediate(() => this.flush());
  }

  /** Ends a linger: its batch goes out on the next turn. */
  private hurry(): void {
    if (!this.lingering) return;
    clearTimeout(this.lingering);
    this.lingering = undefined;
    setImmediate(() => this.flush());
  }

  private flush(): void {
    this.lingering = undefined;
    this.scheduled = false;
    if (!this.queue.length) return;
    const batch = this.queue.splice(0, limits.claimBatch);
    const f: Promise<void> = this.settle(batch).finally(() => {
      this.inFlight.delete(f);
      if (this.queue.length) this.schedule();
    });
    this.inFlight.add(f);
    // Another batch may start now if more is waiting and there is room.
    if (this.queue.length) this.schedule();
  }

  private async settle(chunk: Array<Pending<P>>): Promise<void> {
    try {
      const t0 = performance.now();
      for (const c of chunk) this.stats.queuedMs += t0 - c.at;
      const outcomes = await this.run(chunk.map((c) => c.p));
      this.stats.statementMs += performance.now() - t0;
      this.stats.statements++;
      this.stats.items += chunk.length;
      chunk.forEach((c, k) => c.resolve(outcomes[k]!));
    } catch (err) {
      this.log.warn({ err, items: chunk.length }, 'a batch of reports failed');
      for (const c of chunk) c.reject(err);
    }
  }
}

export class ReportBatcher {
  readonly stats: BatcherStats = { statements: 0, items: 0, queuedMs: 0, statementMs: 0 };
  private readonly starts: Lane<StartItem>;
  private readonly completes: Lane<CompleteParams>;
  private readonly fails: Lane<FailParams>;

  constructor(db: Queryable, log: Logger, leaseTtlMs: number, opts: { completionLingerMs?: number } = {}) {
    this.starts = new Lane((items) => attemptStartMany(db, { items, leaseTtlMs }), this.stats, log);
    this.completes = new Lane((items) => attemptCompleteMany(db, { items }), this.stats, log, opts.completionLingerMs ?? 0);
    // Each failure is its own statement; the lane's slot is held until every one has ended (a
    // first error no longer frees it while the others still run), then the first error is thrown.
    this.fails = new Lane((items) => allEnded(items.map((f) => attemptFail(db, f))), this.stats, log);
  }

  start(p: StartItem): Promise<Outcome<JobSummary>> {
    return this.starts.add(p);
  }

  complete(p: CompleteParams): Promise<Outcome<JobSummary>> {
    return this.completes.add(p);
  }

  fail(p: FailParams): Promise<Outcome<JobSummary>> {
    return this.fails.add(p);
  }

  /** Waits until everything queued so far is written. */
  async idle(): Promise<void> {
    while (this.starts.busy || this.completes.busy || this.fails.busy) {
      await Promise.all([this.starts.idle(), this.completes.idle(), this.fails.idle()]);
    }
  }
}
