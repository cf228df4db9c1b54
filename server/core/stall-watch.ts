/**
 * Notices that this process did not run for a while: frozen (SIGSTOP, a debugger), its VM paused
 * or migrated, its machine asleep, or its event loop blocked. A coordinator that wakes from such a
 * pause knows only what its streams told it before: its agents may have given it up as silent
 * and resumed their attempts on another replica, and what is still buffered in its sockets
 * (heartbeats, a stream's end) is old news. The agent hub asks `stalled()` before acting on what
 * its sessions say and ends its streams on `stall`.
 *
 * It beats on a monotonic clock (`performance.now()`): a wall clock stepped by hand or by a time
 * service is not a pause, and a pause is seen whatever the wall clock did meanwhile.
 */
import { EventEmitter } from 'node:events';

export interface StallWatchEvents {
  /** The process ran again after `ms` without running. */
  stall: [{ ms: number }];
}

export class StallWatch extends EventEmitter<StallWatchEvents> {
  private last = performance.now();
  private timer: NodeJS.Timeout | undefined;

  /**
   * @param thresholdMs a gap longer than this is a pause
   * @param intervalMs how often it beats (a pause shorter than the threshold plus this can go unseen)
   */
  constructor(
    readonly thresholdMs: number,
    private readonly intervalMs = 100,
  ) {
    super();
    if (!(thresholdMs > intervalMs)) throw new Error(`StallWatch: thresholdMs (${thresholdMs}) must exceed intervalMs (${intervalMs})`);
  }

  start(): void {
    if (this.timer) return;
    this.last = performance.now();
    this.timer = setInterval(() => this.beat(), this.intervalMs);
    this.timer.unref();
  }

  stop(): void {
    clearInterval(this.timer);
    this.timer = undefined;
  }

  /**
   * True from the moment the process wakes from a pause until the watch's next beat (which emits
   * `stall`): a callback that runs before that beat must not trust what it knew before the pause.
   */
  stalled(): boolean {
    return this.timer !== undefined && performance.now() - this.last > this.thresholdMs;
  }

  private beat(): void {
    const now = performance.now();
    const gap = now - this.last;
    this.last = now;
    if (gap > this.thresholdMs) this.emit('stall', { ms: Math.round(gap) });
  }
}
