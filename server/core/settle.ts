/** Waiting on several promises, or on one for a bounded time. */

/** `Promise.all`'s answer, given once every promise has ended (not at the first rejection). */
export async function allEnded<T>(promises: Array<Promise<T>>): Promise<T[]> {
  const settled = await Promise.allSettled(promises);
  const failed = settled.find((r): r is PromiseRejectedResult => r.status === 'rejected');
  if (failed) throw failed.reason;
  return settled.map((r) => (r as PromiseFulfilledResult<T>).value);
}

/** Whether `work` ended (resolved or rejected) within `ms`; it is not stopped when it did not. */
export async function endsWithin(work: Promise<unknown> | undefined, ms: number): Promise<boolean> {
  let bound: NodeJS.Timeout | undefined;
  const ended = (work ?? Promise.resolve()).then(
    () => true,
    () => true,
  );
  const late = new Promise<false>((r) => (bound = setTimeout(() => r(false), ms)));
  try {
    return await Promise.race([ended, late]);
  } finally {
    clearTimeout(bound);
  }
}
