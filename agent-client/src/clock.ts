/**
 * Milliseconds on a clock that only moves forward at the pace of real time: every deadline and
 * elapsed time of the agent is on it. The wall clock (`Date.now()`) is stepped by time services
 * and by hand; a lease deadline on it would outlive the lease when the clock goes back, and cut
 * healthy work when it goes forward. (It keeps counting while the process is frozen: a process
 * that wakes after its lease is past finds its deadline passed.)
 */
export function monotonic(): number {
  return performance.now();
}
