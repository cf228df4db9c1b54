/**
 * The reaper: recovers held jobs whose start deadline, lease or execution timeout has passed
 * (`jobRescueExpired`), so that no job is lost when an agent vanishes. Runs are chained with a
 * jittered `setTimeout`, so two runs of one reaper never overlap; several coordinators can each
 * run one on the same database, as the statement skips rows another holds.
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
});

/** Recovers expired attempts on a schedule; `runOnce()` for tests and tools. */
export class Reaper extends EventEmitter<ReaperEvents> {
  readonly config: z.output<typeof configSchema>;
  private readonly schedule: Schedule<ReaperRun>;

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
    const run: ReaperRun = { claimExpired: 0, leaseExpired: 0, timedOut: 0, dead: 0, rescued: [] };
    for (;;) {
      const o = await jobRescueExpired(this.db, {
        limit: this.config.batchSize,
        ...(this.config.backoff ? { backoff: this.config.backoff } : {}),
        ...(now ? { now } : {}),
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
    this.emit('reaper:run', run);
    return run;
  }
}
