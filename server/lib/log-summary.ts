/**
 * A log line for an event that anyone can cause as often as they like (a refused key, a stream
 * that never says Hello): the first one of a minute is logged whole, the rest are counted and
 * logged as one line when the minute ends. A client without any credential could otherwise write
 * tens of thousands of lines a second (43,035 in 15 s for refused Hellos, measured), burying what
 * an operator needs and filling the disk.
 */

/** The part of pino's logger used here (server/lib imports nothing of ours). */
interface Logger {
  warn(fields: object, msg: string): void;
  info(fields: object, msg: string): void;
}

export class LogSummary {
  private more = 0;
  private sample: Record<string, unknown> | undefined;
  private timer: NodeJS.Timeout | undefined;

  constructor(
    private readonly log: Logger,
    private readonly level: 'warn' | 'info',
    private readonly msg: string,
    private readonly windowMs = 60_000,
  ) {}

  /** One event: logged at once if none was in this window, otherwise counted. */
  note(fields: Record<string, unknown>): void {
    if (!this.timer) {
      this.log[this.level](fields, this.msg);
      this.timer = setTimeout(() => this.flush(), this.windowMs);
      this.timer.unref();
      return;
    }
    this.more++;
    this.sample = fields;
  }

  /** Logs what was counted (if anything) and starts afresh; call on stop to say the rest. */
  flush(): void {
    clearTimeout(this.timer);
    this.timer = undefined;
    if (this.more === 0) return;
    this.log[this.level]({ ...this.sample, more: this.more, windowMs: this.windowMs }, `${this.msg} (${this.more} more like it in the last ${Math.round(this.windowMs / 1000)} s; the last of them shown)`);
    this.more = 0;
    this.sample = undefined;
  }
}
