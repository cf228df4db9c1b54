/**
 * The vacuumer: keeps a claim's walk of `jobs_claim_idx` short while a deep backlog drains.
 * Every second it reads from the statistics (no scan) how many rows of `jobs_live` were updated
 * other than HOT or deleted since the last VACUUM it knows of: each left a dead row and index
 * entries. Once `deadRows` have, it runs `VACUUM (SKIP_LOCKED) jobs_live`
 * (server/store/vacuum.ts says why the claim needs it, and what autovacuum misses).
 *
 * It counts changes, not the dead rows left: rows that an old snapshot (a long report, a backup)
 * still sees survive a VACUUM, and counting them again would VACUUM every second for nothing.
 * At its first look the dead rows are the changes it has not seen. A VACUUM by anyone else (a
 * replica's vacuumer, autovacuum) starts the count again. Replicas each run one: one that finds
 * the table held by another VACUUM skips it.
 */
import { EventEmitter } from 'node:events';
import { z } from 'zod';
import type { Logger } from '../log.js';
import { liveChurn, liveVacuum, type LiveChurn, type Queryable } from '../store/index.js';
import { Schedule } from './schedule.js';

export interface VacuumerConfig {
  /** Rows of `jobs_live` updated (not HOT) or deleted since the last VACUUM that make the next; default 50,000. */
  deadRows?: number;
  /** Time between looks; default 1 s. */
  intervalMs?: number;
  /** Fraction of the interval added or removed at random; default 0.1. */
  jitter?: number;
}

/** One look. */
export interface VacuumerRun {
  /** Rows changed (dead rows made) since the last VACUUM. */
  changed: number;
  vacuumed: boolean;
  /** How long the VACUUM took. */
  ms: number;
  /** Dead rows after it (or now, without one). */
  dead: number;
}

export interface VacuumerEvents {
  /** A VACUUM ran. */
  'vacuumer:run': [VacuumerRun];
}

export const DEFAULT_VACUUM_DEAD_ROWS = 50_000;

const configSchema = z.object({
  deadRows: z.int().min(1).default(DEFAULT_VACUUM_DEAD_ROWS),
  intervalMs: z.int().min(10).default(1000),
  jitter: z.number().min(0).max(0.9).default(0.1),
});

export class Vacuumer extends EventEmitter<VacuumerEvents> {
  readonly config: z.output<typeof configSchema>;
  private readonly schedule: Schedule<VacuumerRun>;
  /** The statistics at the last VACUUM (`changed` moved back by the dead rows of the first look). */
  private mark: LiveChurn | undefined;

  constructor(
    /** A pool: VACUUM cannot run inside a transaction. */
    private readonly db: Queryable,
    private readonly log: Logger,
    config: VacuumerConfig = {},
  ) {
    super();
    this.config = configSchema.parse(config);
    this.schedule = new Schedule({ ...this.config, onError: (err) => this.log.warn({ err }, 'vacuumer run failed; retrying next interval') }, () => this.work());
  }

  /** Starts the schedule (the first look comes after one interval). Calling it twice is harmless. */
  start(): void {
    this.schedule.start();
  }

  /** Stops the schedule and waits for a run in progress. Calling it twice is harmless. */
  stop(): Promise<void> {
    return this.schedule.stop();
  }

  /** Looks now (and vacuums if due); joins a run in progress. */
  runOnce(): Promise<VacuumerRun> {
    return this.schedule.runOnce();
  }

  private async work(): Promise<VacuumerRun> {
    const now = await liveChurn(this.db);
    // First look, a VACUUM by someone else, or the statistics reset: count from here (the
    // first look's dead rows are changes not yet vacuumed).
    if (!this.mark || now.vacuums !== this.mark.vacuums || now.changed < this.mark.changed) {
      this.mark = { ...now, changed: now.changed - (this.mark ? 0 : now.dead) };
    }
    const changed = now.changed - this.mark.changed;
    if (changed < this.config.deadRows) return { changed, vacuumed: false, ms: 0, dead: now.dead };
    const t0 = performance.now();
    await liveVacuum(this.db);
    const ms = performance.now() - t0;
    this.mark = await liveChurn(this.db);
    const run: VacuumerRun = { changed, vacuumed: true, ms, dead: this.mark.dead };
    this.log.debug(run, 'vacuumed jobs_live');
    this.emit('vacuumer:run', run);
    return run;
  }
}
