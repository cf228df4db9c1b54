/**
 * The count keeper: keeps the counts that GetStats and `/metrics` read small to sum. The
 * transitions append their change to `job_counts` and what they ended to `ended_counts`
 * (server/store/counts.ts); every run folds those rows into one per queue and status, and one
 * per minute and kind (dropping minutes older than a day), so a read sums a few rows whatever
 * the history and the rate. At its first run and then every `reconcileEveryMs` it recounts
 * instead (the finished jobs, and the last day's attempts) and logs any drift it corrected: a
 * change made outside the transitions (hand-written SQL, an older coordinator during a rolling
 * upgrade). Replicas take turns: a run that finds another one's fold in progress does nothing.
 */
import { EventEmitter } from 'node:events';
import { z } from 'zod';
import type { Logger } from '../log.js';
import { endedCountsReconcile, jobCountsCompact, jobCountsReconcile, type CountDrift, type Queryable } from '../store/index.js';
import { Schedule } from './schedule.js';

export interface CountKeeperConfig {
  /** Time between folds; default 5 seconds. */
  intervalMs?: number;
  /** Time between recounts; default 1 hour. */
  reconcileEveryMs?: number;
  /** Fraction of the interval added or removed at random; default 0.1. */
  jitter?: number;
}

/** What one run did. */
export interface CountKeeperRun {
  kind: 'fold' | 'recount' | 'skipped';
  /** For a recount: where the kept counts had drifted from the jobs. */
  drift: CountDrift[];
  /** For a recount: how many minutes and kinds of the per-minute counts had drifted. */
  minutesDrifted: number;
}

export interface CountKeeperEvents {
  'counts:run': [CountKeeperRun];
}

const configSchema = z.object({
  intervalMs: z.int().min(10).default(5000),
  reconcileEveryMs: z.int().min(1000).default(3_600_000),
  jitter: z.number().min(0).max(0.9).default(0.1),
});

export class CountKeeper extends EventEmitter<CountKeeperEvents> {
  readonly config: z.output<typeof configSchema>;
  private readonly schedule: Schedule<CountKeeperRun>;
  /** When the last recount ran (0: not yet, so the first run recounts). */
  private recountedAt = 0;

  constructor(
    private readonly db: Queryable,
    private readonly log: Logger,
    config: CountKeeperConfig = {},
  ) {
    super();
    this.config = configSchema.parse(config);
    this.schedule = new Schedule(
      { ...this.config, onError: (err) => this.log.warn({ err }, 'count keeper run failed; retrying next interval') },
      () => this.work(false),
    );
  }

  /** Starts the schedule (the first run comes after one interval). Calling it twice is harmless. */
  start(): void {
    this.schedule.start();
  }

  /** Stops the schedule and waits for a run in progress. Calling it twice is harmless. */
  stop(): Promise<void> {
    return this.schedule.stop();
  }

  /** Runs now (a recount when `recount` or when one is due); joins a run in progress. */
  runOnce(recount = false): Promise<CountKeeperRun> {
    return this.schedule.runOnce(() => this.work(recount));
  }

  private async work(recount: boolean): Promise<CountKeeperRun> {
    let run: CountKeeperRun;
    if (recount || Date.now() - this.recountedAt >= this.config.reconcileEveryMs) {
      const drift = await jobCountsReconcile(this.db);
      const minutesDrifted = drift ? await endedCountsReconcile(this.db) : null;
      if (drift) this.recountedAt = Date.now();
      if (drift?.length) this.log.warn({ drift }, 'job counts had drifted from the jobs (changed outside the transitions); recounted');
      if (minutesDrifted) {
        this.log.warn({ minutesDrifted }, 'per-minute counts had drifted from the attempts (changed outside the transitions); recounted');
      }
      run = { kind: drift ? 'recount' : 'skipped', drift: drift ?? [], minutesDrifted: minutesDrifted ?? 0 };
    } else {
      run = { kind: (await jobCountsCompact(this.db)) ? 'fold' : 'skipped', drift: [], minutesDrifted: 0 };
    }
    this.emit('counts:run', run);
    return run;
  }
}
