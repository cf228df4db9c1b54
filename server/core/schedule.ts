/**
 * The schedule every maintenance service shares (reaper, purger, webhook deliverer): runs chained
 * with a jittered `setTimeout`, so two runs of one service never overlap; `start()` and `stop()`
 * safe to call twice; a `runOnce()` asked while a run is in progress joins that run.
 */
export interface ScheduleOptions {
  intervalMs: number;
  /** Fraction of the interval added or removed at random. */
  jitter: number;
  /** Called with a scheduled run's failure (the next run still comes). */
  onError: (err: Error) => void;
}

export class Schedule<R> {
  private timer: NodeJS.Timeout | undefined;
  private running: Promise<R> | undefined;
  private started = false;

  constructor(
    private readonly opts: ScheduleOptions,
    /** The scheduled run. */
    private readonly work: () => Promise<R>,
  ) {}

  /** Whether a next run is scheduled (false before `start()` and after `stop()`). */
  get scheduled(): boolean {
    return this.timer !== undefined;
  }

  /** Starts the schedule (the first run comes after one interval). */
  start(): void {
    if (this.started) return;
    this.started = true;
    this.next();
  }

  /** Stops the schedule and waits for a run in progress. */
  async stop(): Promise<void> {
    this.started = false;
    clearTimeout(this.timer);
    this.timer = undefined;
    await this.running?.catch(() => undefined);
  }

  /** Runs `work` (default: the scheduled run) now, or joins the run in progress. */
  runOnce(work: () => Promise<R> = this.work): Promise<R> {
    this.running ??= work().finally(() => {
      this.running = undefined;
    });
    return this.running;
  }

  private next(): void {
    if (!this.started) {
      this.timer = undefined;
      return;
    }
    const { intervalMs, jitter } = this.opts;
    this.timer = setTimeout(() => {
      this.runOnce()
        .catch((err: Error) => this.opts.onError(err))
        .finally(() => this.next());
    }, intervalMs * (1 - jitter + Math.random() * 2 * jitter));
  }
}
