/**
 * An unbounded async queue with one reader: `push` never blocks, the reader iterates with
 * `for await`, `close()` ends the iteration after what was pushed (`close(err)`: then throws
 * `err`), `fail(err)` ends it with `err` at once. What a session's outgoing messages flow through.
 */
export class Channel<T> implements AsyncIterable<T> {
  private readonly items: T[] = [];
  private waiter: (() => void) | undefined;
  private ended = false;
  private error: unknown;
  /** Thrown to the reader after the queued values (`close(err)`). */
  private last: unknown;

  /** Queues a value; ignored once the channel is closed. */
  push(value: T): void {
    if (this.ended) return;
    this.items.push(value);
    this.wake();
  }

  /** Ends the iteration once the queued values are read, then throws `err` if given. Safe to call twice. */
  close(err?: unknown): void {
    if (!this.ended && err !== undefined) this.last = err;
    this.ended = true;
    this.wake();
  }

  /** Ends the iteration at once, throwing `err` to the reader. */
  fail(err: unknown): void {
    if (this.ended && this.error !== undefined) return;
    this.error = err;
    this.ended = true;
    this.items.length = 0;
    this.wake();
  }

  get closed(): boolean {
    return this.ended;
  }

  private wake() {
    const w = this.waiter;
    this.waiter = undefined;
    w?.();
  }

  async *[Symbol.asyncIterator](): AsyncIterator<T> {
    for (;;) {
      if (this.error !== undefined) throw this.error;
      const next = this.items.shift();
      if (next !== undefined) {
        yield next;
        continue;
      }
      if (this.ended) {
        if (this.last !== undefined) throw this.last;
        return;
      }
      await new Promise<void>((resolve) => (this.waiter = resolve));
    }
  }
}
