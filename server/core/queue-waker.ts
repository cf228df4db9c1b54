/**
 * Wakes the dispatchers after an enqueue has committed: this coordinator's at once, in
 * process, and every coordinator's through one `jobsNotify` per batch of queues.
 *
 * Why not NOTIFY in the enqueue's own transaction: PostgreSQL queues notifications in commit
 * order by holding a database-wide lock from the start of a notifying transaction's commit to
 * its end, WAL flush included. Enqueues that NOTIFY therefore commit one at a time, each
 * waiting for its own flush, instead of sharing flushes; once one enqueue finds jobs waiting
 * ahead of it (no hand-off), every enqueue after it NOTIFYs, and a single slow flush became a
 * queue of enqueues half a second long (measured: docs/performance-history.md, "The NOTIFY lock").
 * Here the notifications go out afterwards, batched, in a transaction that commits
 * asynchronously, so the lock is held for microseconds.
 *
 * What this gives up: if this process dies between the enqueue's commit and the NOTIFY, the
 * other coordinators learn of the job from their poll (`Dispatcher`, 1 s) instead.
 */
import type { Logger } from '../log.js';
import { jobsNotify, type Queryable } from '../store/index.js';

export class QueueWaker {
  private readonly pending = new Set<string>();
  private flushing: Promise<void> | undefined;
  private stopped = false;

  constructor(
    private readonly db: Queryable,
    private readonly log: Logger,
    /** This coordinator's dispatcher (woken at once, without the round trip). */
    private readonly local: (queue: string) => void,
  ) {}

  /** `queue` got a due job (committed): wake every dispatcher that serves it. */
  wake(queue: string): void {
    this.local(queue);
    if (this.stopped) return;
    this.pending.add(queue);
    this.flushing ??= this.flush().finally(() => (this.flushing = undefined));
  }

  /** Resolves once every wake so far has been sent (the gateway answers before it is). */
  async idle(): Promise<void> {
    while (this.flushing) await this.flushing;
  }

  /** Sends what is pending and stops; safe to call twice. */
  async stop(): Promise<void> {
    this.stopped = true;
    await this.flushing;
  }

  /** One statement at a time: wakes that arrive while one runs go out together in the next. */
  private async flush(): Promise<void> {
    await new Promise<void>((resolve) => setImmediate(resolve)); // the wakes of this tick, together
    while (this.pending.size) {
      const queues = [...this.pending];
      this.pending.clear();
      try {
        await jobsNotify(this.db, queues);
      } catch (err) {
        // The jobs are committed; the dispatchers' poll finds them.
        this.log.warn({ err, queues }, 'could not notify the other coordinators of new jobs; their poll will find them');
      }
    }
  }
}
