/**
 * Groups the starts, completions and failures reported by every stream of this coordinator:
 * whatever arrived since the last flush goes to the database as one statement per kind. Up to
 * `MAX_IN_FLIGHT` flushes run at once, so a slow statement does not hold up the next batch.
 * Order between them does not matter for correctness: a completion of a claimed attempt starts
 * it implicitly, and a start that arrives after its attempt's report is answered `duplicate`.
 * Under load, batches grow by themselves; alone, an item waits only for the next turn of the
 * event loop.
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
import type { Outcome } from './outcomes.js';
import { limits } from './validation.js';

/** Flushes allowed at once (each holds a pool connection for its statements). */
const MAX_IN_FLIGHT = 3;

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

export class ReportBatcher {
  private starts: Array<Pending<StartItem>> = [];
  private completes: Array<Pending<CompleteParams>> = [];
  private fails: Array<Pending<FailParams>> = [];
  private inFlight = new Set<Promise<void>>();
  private scheduled = false;
  readonly stats: BatcherStats = { statements: 0, items: 0, queuedMs: 0, statementMs: 0 };

  constructor(
    private readonly db: Queryable,
    private readonly log: Logger,
    private readonly leaseTtlMs: number,
  ) {}

  start(p: StartItem): Promise<Outcome<JobSummary>> {
    return this.add(this.starts, p);
  }

  complete(p: CompleteParams): Promise<Outcome<JobSummary>> {
    return this.add(this.completes, p);
  }

  fail(p: FailParams): Promise<Outcome<JobSummary>> {
    return this.add(this.fails, p);
  }

  /** Waits until everything queued so far is written. */
  async idle(): Promise<void> {
    while (this.inFlight.size || this.scheduled) {
      if (this.inFlight.size) await Promise.all(this.inFlight);
      else await new Promise((r) => setImmediate(r));
    }
  }

  private add<P>(queue: Array<Pending<P>>, p: P): Promise<Outcome<JobSummary>> {
    return new Promise((resolve, reject) => {
      queue.push({ p, at: performance.now(), resolve, reject });
      this.schedule();
    });
  }

  private schedule(): void {
    if (this.scheduled || this.inFlight.size >= MAX_IN_FLIGHT) return;
    this.scheduled = true;
    setImmediate(() => {
      this.scheduled = false;
      if (!this.starts.length && !this.completes.length && !this.fails.length) return;
      const f: Promise<void> = this.flush().finally(() => {
        this.inFlight.delete(f);
        if (this.starts.length || this.completes.length || this.fails.length) this.schedule();
      });
      this.inFlight.add(f);
    });
  }

  private async flush(): Promise<void> {
    const starts = this.starts.splice(0);
    const completes = this.completes.splice(0);
    const fails = this.fails.splice(0);
    for (let i = 0; i < starts.length; i += limits.claimBatch) {
      const chunk = starts.slice(i, i + limits.claimBatch);
      await this.settle(chunk, () => attemptStartMany(this.db, { items: chunk.map((c) => c.p), leaseTtlMs: this.leaseTtlMs }));
    }
    for (let i = 0; i < completes.length; i += limits.claimBatch) {
      const chunk = completes.slice(i, i + limits.claimBatch);
      await this.settle(chunk, () => attemptCompleteMany(this.db, { items: chunk.map((c) => c.p) }));
    }
    if (fails.length) await this.settle(fails, () => Promise.all(fails.map((f) => attemptFail(this.db, f.p))));
  }

  private async settle<P>(chunk: Array<Pending<P>>, run: () => Promise<Array<Outcome<JobSummary>>>): Promise<void> {
    try {
      const t0 = performance.now();
      for (const c of chunk) this.stats.queuedMs += t0 - c.at;
      const outcomes = await run();
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
