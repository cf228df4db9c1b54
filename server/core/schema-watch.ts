/**
 * The schema watch: tells the coordinator when the database has been migrated past what this
 * release can run beside (store/schema-compat.ts): its `min_reader` is above this release's
 * reader level. The coordinator looks at start (migrate.ts refuses such a database); this looks
 * while it runs: when the migrator's NOTIFY `leasehold_schema` arrives, whenever the listener
 * (re)connects (a NOTIFY sent meanwhile was lost), and every `intervalMs` (30 s) in case both
 * were missed. The first look that finds the level too low emits `schema:incompatible`, once;
 * the coordinator then stops (coordinator.ts). A look that fails (the database away) is logged
 * and changes nothing: the next one decides.
 */
import { EventEmitter } from 'node:events';
import { z } from 'zod';
import type { Logger } from '../log.js';
import { schemaCompatGet, type Queryable } from '../store/index.js';
import { Schedule } from './schedule.js';

export interface SchemaWatchConfig {
  /** This release's reader level: the number of migrations it ships. */
  readerLevel: number;
  /** Time between looks besides the notifications; default 30 s. */
  intervalMs?: number;
  /** Fraction of the interval added or removed at random; default 0.1. */
  jitter?: number;
}

/** One look. */
export interface SchemaWatchRun {
  readerLevel: number;
  /** The database's `min_reader` (undefined: no row). */
  minReader: number | undefined;
  /** Whether this release can keep running on the database. */
  compatible: boolean;
}

export interface SchemaWatchEvents {
  /** The database needs a higher reader level than this release's; emitted once. */
  'schema:incompatible': [SchemaWatchRun];
  'schema:run': [SchemaWatchRun];
}

const configSchema = z.object({
  readerLevel: z.int().min(1),
  intervalMs: z.int().min(10).default(30_000),
  jitter: z.number().min(0).max(0.9).default(0.1),
});

export class SchemaWatch extends EventEmitter<SchemaWatchEvents> {
  readonly config: z.output<typeof configSchema>;
  private readonly schedule: Schedule<SchemaWatchRun>;
  private told = false;
  /** Looks begun so far: whether `look` started one or joined one in progress. */
  private looks = 0;

  constructor(
    private readonly db: Queryable,
    private readonly log: Logger,
    config: SchemaWatchConfig,
  ) {
    super();
    this.config = configSchema.parse(config);
    this.schedule = new Schedule({ ...this.config, onError: (err) => this.log.warn({ err }, 'schema level look failed; looking again later') }, () => this.work());
  }

  /** Starts the schedule (the first look comes after one interval). Calling it twice is harmless. */
  start(): void {
    this.schedule.start();
  }

  /** Stops the schedule and waits for a look in progress. Calling it twice is harmless. */
  stop(): Promise<void> {
    return this.schedule.stop();
  }

  /** Looks now; joins a look in progress. */
  runOnce(): Promise<SchemaWatchRun> {
    return this.schedule.runOnce();
  }

  /**
   * Looks now, for a notification or a reconnection: a failure is logged, not thrown. A look
   * already running may have read the level before the change it is asked for: then one more
   * look follows it.
   */
  look(why: string): void {
    const before = this.looks;
    const looking = this.runOnce();
    const joined = this.looks === before;
    const failed = (err: unknown) => this.log.warn({ err, why }, 'schema level look failed; looking again later');
    looking.then(
      () => (joined ? this.runOnce().catch(failed) : undefined),
      (err: unknown) => (joined ? this.runOnce().catch(failed) : failed(err)),
    );
  }

  /** The database's `min_reader` (undefined: no row). */
  protected read(): Promise<number | undefined> {
    return schemaCompatGet(this.db);
  }

  private async work(): Promise<SchemaWatchRun> {
    this.looks++;
    const minReader = await this.read();
    const { readerLevel } = this.config;
    const run: SchemaWatchRun = { readerLevel, minReader, compatible: minReader === undefined || minReader <= readerLevel };
    this.emit('schema:run', run);
    if (!run.compatible && !this.told) {
      this.told = true;
      this.emit('schema:incompatible', run);
    }
    return run;
  }
}
