/**
 * The purger: deletes finished jobs (succeeded, failed, dead, canceled) older than the retention,
 * with everything that hangs off them, so the tables (and the scans of operators' counts) stay
 * bounded. Each run first makes the partitions of today and the next days that ending jobs move
 * to, and drops the partitions of the days that ended before the cutoff (the retention before
 * the earlier of PostgreSQL's `now()`, the clock every finish time is written by, and this
 * process's: a clock stepped forward on either side drops nothing early), whole (`daysDrop`: a
 * job is so kept for the retention rounded up to the end of its UTC day), then sweeps those days'
 * rows in the other tables at `sweepShare` of its time, a stop cutting the sweep short for the
 * next run to finish. Then it deletes the
 * finished jobs left in `jobs_live` (from before every end moved its job, or kept back by a drop
 * for an undelivered notification) by rows: each statement takes
 * a batch FOR UPDATE SKIP LOCKED (`jobPurge`), so purgers on several replicas take different jobs
 * and never wait for each other or for a transition; a full batch runs again at once. Runs are
 * chained with a jittered `setTimeout`, so two runs never overlap. Jobs with a notification still
 * to deliver are left for a later run.
 */
import { EventEmitter } from 'node:events';
import { Schedule } from './schedule.js';
import { z } from 'zod';
import type { Logger } from '../log.js';
import pg from 'pg';
import { daysDrop, daysEnsure } from '../store/days.js';
import type { Failure, Outcome } from '../domain/outcomes.js';
import { MAX_TIMER_MS } from '../domain/validation.js';
import { jobPurge, type PurgeParams, type Queryable } from '../store/index.js';

export interface PurgerConfig {
  /** Finished jobs older than this are deleted; default 7 days. */
  retentionMs?: number;
  /** Time between runs; default 10 minutes. */
  intervalMs?: number;
  /** Jobs per statement; default 1000. */
  batchSize?: number;
  /** Fraction of the interval added or removed at random; default 0.1. */
  jitter?: number;
  /**
   * The share of its time the sweep of a dropped day spends working (days.ts, `daysDrop`): the
   * rest it waits, leaving the transitions the cores; default 0.1 (`LEASEHOLD_PURGE_SWEEP_SHARE`). 1
   * sweeps without pausing.
   */
  sweepShare?: number;
  /** Awaited before each batch of a sweep (days.ts, `DaysDropOptions.hold`): the benchmark's way to hold it. */
  sweepHold?: () => Promise<void>;
}

/** Counts of one run. */
export interface PurgerRun {
  /** Jobs deleted: by rows, and with the partitions of their days. */
  purged: number;
  /** Days whose partition was dropped. */
  days: string[];
  /** Jobs that finished before this were purged. */
  cutoff: Date | undefined;
  /** Statements run. */
  batches: number;
  /** Milliseconds until the dropped days were gone from every read and count. */
  goneMs: number;
  /** Jobs whose other rows the sweep deleted. */
  swept: number;
  /** Whether a sweep was left for the next run (the purger stopped). */
  unswept: boolean;
}

export interface PurgerEvents {
  'purger:run': [PurgerRun];
  'purger:error': [Error];
}

export const DEFAULT_RETENTION_MS = 7 * 86_400_000;
export const DEFAULT_SWEEP_SHARE = 0.1;
export const DEFAULT_PURGE_BATCH = 1000;

const configSchema = z
  .object({
    retentionMs: z.int().min(1000).default(DEFAULT_RETENTION_MS),
    intervalMs: z.int().min(10).default(600_000),
    batchSize: z.int().min(1).max(100_000).default(DEFAULT_PURGE_BATCH),
    jitter: z.number().min(0).max(0.9).default(0.1),
    sweepShare: z.number().gt(0).max(1).default(DEFAULT_SWEEP_SHARE),
  })
  // The longest wait the schedule may draw (interval plus jitter) must fit a timer: Node runs a
  // longer one after 1 ms, and the purger would run without pause.
  .refine((c) => c.intervalMs * (1 + c.jitter) <= MAX_TIMER_MS, {
    path: ['intervalMs'],
    message: `with its jitter must stay within ${MAX_TIMER_MS} ms, the longest timer`,
  });

/** Purges old finished jobs on a schedule; `runOnce()` for tests and tools. */
export class Purger extends EventEmitter<PurgerEvents> {
  readonly config: z.output<typeof configSchema>;
  private readonly schedule: Schedule<PurgerRun>;
  private stopping = new AbortController();
  private readonly sweepHold: (() => Promise<void>) | undefined;

  constructor(
    private readonly db: Queryable,
    private readonly log: Logger,
    config: PurgerConfig = {},
  ) {
    super();
    this.config = configSchema.parse(config);
    this.sweepHold = config.sweepHold;
    this.schedule = new Schedule(
      {
        ...this.config,
        onError: (err) => {
          this.log.warn({ err }, 'purger run failed; retrying next interval');
          this.emit('purger:error', err);
        },
      },
      () => this.drain(undefined),
    );
  }

  /** Starts the schedule (the first run comes after one interval). Calling it twice is harmless. */
  start(): void {
    if (this.stopping.signal.aborted) this.stopping = new AbortController();
    this.schedule.start();
  }

  /**
   * Stops the schedule and waits for a run in progress, whose sweep stops after its current batch
   * (the next run goes on with it). Calling it twice is harmless.
   */
  stop(): Promise<void> {
    this.stopping.abort();
    return this.schedule.stop();
  }

  /**
   * Purges everything past the retention now (in batches) and returns the counts; joins a run in
   * progress. The retention is reckoned back from the earlier of PostgreSQL's `now()` and this
   * process's clock, or from `now` (tests).
   */
  runOnce(now?: Date): Promise<PurgerRun> {
    return this.schedule.runOnce(() => this.drain(now));
  }

  private async drain(now: Date | undefined): Promise<PurgerRun> {
    const run: PurgerRun = { purged: 0, days: [], cutoff: undefined, batches: 0, goneMs: 0, swept: 0, unswept: false };
    // The retention is reckoned back from the earlier of PostgreSQL's clock (the one every finish
    // time is written by) and this process's: either may have been stepped forward (a host's RTC
    // or NTP gone wrong, a failover to a server with a bad clock), and what is dropped is gone for
    // good, idempotency keys with it.
    now ??= await this.earlierClock();
    if (this.db instanceof pg.Pool) {
      await daysEnsure(this.db);
      const dropped = await daysDrop(this.db, {
        olderThanMs: this.config.retentionMs,
        now,
        share: this.config.sweepShare,
        signal: this.stopping.signal,
        hold: this.sweepHold,
      });
      run.purged += dropped.jobs;
      run.days = dropped.days;
      run.goneMs = dropped.goneMs;
      run.swept = dropped.swept;
      run.unswept = dropped.unswept;
      if (dropped.days.length) this.log.info({ days: dropped.days, jobs: dropped.jobs, kept: dropped.kept, goneMs: Math.round(dropped.goneMs) }, 'days of finished jobs dropped');
      if (dropped.swept) this.log.info({ jobs: dropped.swept, unswept: dropped.unswept, vacuumMs: Math.round(dropped.vacuumMs) }, 'rows of dropped days swept');
    }
    const o = await purgeInBatches(this.db, { olderThanMs: this.config.retentionMs, liveOnly: this.db instanceof pg.Pool, now }, this.config.batchSize);
    if (o.outcome !== 'ok') throw new Error(`jobPurge: ${JSON.stringify(o)}`);
    run.batches = o.value.batches;
    run.purged += o.value.purged;
    run.cutoff = o.value.cutoff;
    if (run.purged) this.log.info({ purged: run.purged, cutoff: run.cutoff, retentionMs: this.config.retentionMs }, 'finished jobs purged');
    this.emit('purger:run', run);
    return run;
  }

  /** The earlier of PostgreSQL's `now()` and this process's clock; a gap over 5 minutes is logged. */
  private async earlierClock(): Promise<Date> {
    const { rows } = await this.db.query<{ now: Date }>('SELECT now() AS now');
    const db = rows[0]!.now;
    const mine = new Date();
    const skewMs = db.getTime() - mine.getTime();
    if (Math.abs(skewMs) > CLOCK_SKEW_WARN_MS) {
      this.log.warn(
        { databaseClock: db.toISOString(), coordinatorClock: mine.toISOString(), skewMs },
        "PostgreSQL's clock and this coordinator's differ by more than 5 minutes: the purger reckons the retention from the earlier of the two; set both right (NTP)",
      );
    }
    return skewMs > 0 ? mine : db;
  }
}

/** A gap between PostgreSQL's clock and the coordinator's worth a warning at every purger run. */
const CLOCK_SKEW_WARN_MS = 5 * 60_000;

/**
 * Purges the finished jobs `p` selects, `batchSize` a statement, until a batch comes back short;
 * each batch starts at the finish time the last one reached (jobPurge's `after`). A dry run
 * counts them in one statement. The purger's runs and an operator's PurgeJobs both go through here.
 */
export async function purgeInBatches(
  db: Queryable,
  p: Omit<PurgeParams, 'limit' | 'after'>,
  batchSize: number,
): Promise<Outcome<{ purged: number; cutoff: Date; batches: number }>> {
  let purged = 0;
  let batches = 0;
  let after: Date | undefined;
  for (;;) {
    const o = await jobPurge(db, { ...p, limit: batchSize, ...(after ? { after } : {}) });
    if (o.outcome !== 'ok') return o as Failure;
    batches++;
    purged += o.value.purged;
    after = o.value.last;
    if (p.dryRun || o.value.purged < batchSize) return { outcome: 'ok', value: { purged, cutoff: o.value.cutoff, batches } };
  }
}
