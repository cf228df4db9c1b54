/**
 * Small helpers about processes, for the layers and for the launcher `npm start` runs (which
 * must not load the store to use them). Imports nothing of ours.
 */

/**
 * Whether a process with this pid exists. EPERM means it exists but belongs to someone else: a
 * pid reused by another user's process counts as alive, which only delays a wait, never wrongly
 * ends it.
 */
export function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
}
