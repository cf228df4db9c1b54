/**
 * The reaper: recovers held jobs whose start deadline, lease or execution timeout has passed
 * (`jobRescueExpired`), so that no job is lost when an agent vanishes. Runs are chained with a
 * jittered `setTimeout`, so two runs of one reaper never overlap; several coordinators can each
 * run one on the same database, as the statement skips rows another holds.
 *
 * After runs that failed (the database refused the statement or could not be reached), lease
 * expiries are held back for `outageGraceMs` from the first run that works again: while writes
 * were refused no lease could be renewed and no result stored, so every running job's lease has
 * passed when the outage ends, and its agent is reconnecting with the results its outbox holds.
 * Start deadlines and execution timeouts are rescued as ever. Each reaper decides for itself.
 */
import { EventEmitter } from 'node:events';
import { Schedule } from './schedule.js';
import { z } from 'zod';
import type { Logger } from '../log.js';
import { jobRescueExpired, type Backoff, type Queryable, type Rescued } from '../store/index.js';

export interface ReaperConfig {
  /** Time between runs; default 1 s. */
  intervalMs?: number;
  /** Jobs per statement; a full batch runs again at once. Default 1000. */
  batchSize?: number;
  /** Fraction of the interval added or removed at random; default 0.1. */
  jitter?: number;
  /** Backoff before retrying a job that ran past its execution timeout. */
  backoff?: Backoff;
  /**
   * After a run that failed, how long from the first run that works again the reaper leaves
   * expired leases alone (`lease_expired`), so agents can reconnect and deliver or renew what
   * they held. The coordinator gives its lease TTL; default 30 s (the default lease TTL).
   */
  outageGraceMs?: number;
}

/** Counts of one run. */
export interface ReaperRun {
  claimExpired: number;
  leaseExpired: number;
  timedOut: number;
  /** Of those, how many went to `dead` (attempt cap reached). */
  dead: number;
  /** Every job rescued, in order. */
  rescued: Rescued[];
  /** Lease expiries were held back (the grace after runs that failed): `leaseExpired` is 0. */
  leaseExpiriesHeld: boolean;
}

export interface ReaperEvents {
  'reaper:run': [ReaperRun];
  'reaper:error': [Error];
  /** A job reached its attempt cap: an alert. */
  'job:dead': [Rescued];
}

const configSchema = z.object({
  intervalMs: z.int().min(10).default(1000),
  batchSize: z.int().min(1).max(10_000).default(1000),
  jitter: z.number().min(0).max(0.9).default(0.1),
  backoff: z.object({ baseMs: z.int().min(0), maxMs: z.int().min(0) }).optional(),
  outageGraceMs: z.int().min(0).default(30_000),
});

/** Recovers expired attempts on a schedule; `runOnce()` for tests and tools. */
export class Reaper extends EventEmitter<ReaperEvents> {
  readonly config: z.output<typeof configSchema>;
  private readonly schedule: Schedule<ReaperRun>;
  /** The last run failed: the next holds lease expiries back, and starts the grace if it works. */
  private failing = false;
  /** The grace after the last failures, from its first working run (ms, on the runs' clock: `now` or `Date.now()`). */
  private grace: { from: number; until: number } | undefined;

  constructor(
    private readonly db: Queryable,
    private readonly log: Logger,
    config: ReaperConfig = {},
  ) {
    super();
    this.config = configSchema.parse(config);
    this.schedule = new Schedule({ ...this.config, onError: (err) => {
      this.log.warn({ err }, 'reaper run failed; retrying next interval');
      this.emit('reaper:error', err);
    } }, () => this.drain(undefined));
  }

  /** Whether a next run is scheduled (false before `start()` and after `stop()`). */
  get scheduled(): boolean {
    return this.schedule.scheduled;
  }

  /** Starts the schedule (the first run comes after one interval). Calling it twice is harmless. */
  start(): void {
    this.schedule.start();
  }

  /** Stops the schedule and waits for a run in progress. Calling it twice is harmless. */
  stop(): Promise<void> {
    return this.schedule.stop();
  }

  /** Rescues every expired attempt now (in batches) and returns the counts; joins a run in progress. */
  runOnce(now?: Date): Promise<ReaperRun> {
    return this.schedule.runOnce(() => this.drain(now));
  }

  private async drain(now: Date | undefined): Promise<ReaperRun> {
    // The grace is a duration on this process's clock (or the runs' `now` in tests), never
    // compared with the database's time; a clock stepped back ends it (as one stepped forward
    // does), so a step never holds rescues longer than the grace. It holds from the first run
    // after a failure on, not only once a run is known to work: that run is the one that would
    // take every lease.
    const at = now?.getTime() ?? Date.now();
    if (this.grace && (at >= this.grace.until || at < this.grace.from)) this.grace = undefined;
    const held = (this.failing && this.config.outageGraceMs > 0) || this.grace !== undefined;
    const run: ReaperRun = { claimExpired: 0, leaseExpired: 0, timedOut: 0, dead: 0, rescued: [], leaseExpiriesHeld: held };
    try {
      await this.rescue(run, now, held);
    } catch (err) {
      this.failing = true;
      this.grace = undefined;
      throw err;
    }
    if (this.failing) {
      this.failing = false;
      if (this.config.outageGraceMs > 0) {
        this.grace = { from: at, until: at + this.config.outageGraceMs };
        this.log.info({ graceMs: this.config.outageGraceMs }, 'reaper runs work again: expired leases are left to their agents for the grace, to reconnect and report');
      }
    }
    this.emit('reaper:run', run);
    return run;
  }

  /** Rescues in batches into `run` until a batch comes back short. */
  private async rescue(run: ReaperRun, now: Date | undefined, holdLeaseExpired: boolean): Promise<void> {
    for (;;) {
      const o = await jobRescueExpired(this.db, {
        limit: this.config.batchSize,
        ...(this.config.backoff ? { backoff: this.config.backoff } : {}),
        ...(now ? { now } : {}),
        ...(holdLeaseExpired ? { holdLeaseExpired } : {}),
      });
      if (o.outcome !== 'ok') throw new Error(`jobRescueExpired: ${o.outcome}`);
      for (const r of o.value) {
        run.rescued.push(r);
        if (r.reason === 'claim_expired') run.claimExpired++;
        else if (r.reason === 'lease_expired') run.leaseExpired++;
        else run.timedOut++;
        if (r.status === 'dead') {
          run.dead++;
          // The alert itself is raised by the webhook deliverer from the job.dead event this
          // statement stored, whichever transition dead-lettered the job.
          this.log.warn({ jobId: r.jobId, queue: r.queue, attemptId: r.attemptId, attemptNo: r.attemptNo, agentId: r.agentId, reason: r.reason }, 'job dead-lettered: attempt cap reached');
          this.emit('job:dead', r);
        } else {
          this.log.info({ jobId: r.jobId, attemptId: r.attemptId, attemptNo: r.attemptNo, agentId: r.agentId, reason: r.reason }, 'attempt expired, job requeued');
        }
      }
      if (o.value.length < this.config.batchSize) break;
    }
  }
}
