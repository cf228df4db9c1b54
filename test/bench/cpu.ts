/**
 * CPU time by process, from /proc (Linux): what a benchmark repetition cost the benchmark
 * process (for Leasehold, the coordinator), the worker process and PostgreSQL. PostgreSQL's
 * share is the postmaster's own time, its reaped children's (cutime, cstime) and its live
 * children's, so backends that exit during the repetition still count.
 */
import { readdirSync, readFileSync } from 'node:fs';
import type pg from 'pg';

const TICKS_PER_SEC = 100; // USER_HZ: 100 on every Linux architecture Node runs on

/** utime, stime, cutime, cstime and ppid of a process, or undefined if it is gone (or no /proc). */
function stat(pid: number): { ppid: number; own: number; children: number } | undefined {
  try {
    const text = readFileSync(`/proc/${pid}/stat`, 'utf8');
    // Fields after "(comm)", which may itself hold spaces: state is field 3.
    const f = text.slice(text.lastIndexOf(')') + 2).split(' ');
    const n = (i: number) => Number(f[i - 3]);
    return { ppid: n(4), own: (n(14) + n(15)) / TICKS_PER_SEC, children: (n(16) + n(17)) / TICKS_PER_SEC };
  } catch {
    return undefined;
  }
}

/** CPU seconds of one process (its own, not its children's); undefined without /proc. */
export function processCpu(pid: number): number | undefined {
  return stat(pid)?.own;
}

/** The postmaster's pid: the parent of a backend of `pool`. Undefined without /proc. */
export async function postmasterPid(pool: pg.Pool): Promise<number | undefined> {
  const backend = Number((await pool.query('SELECT pg_backend_pid() AS pid')).rows[0].pid);
  return stat(backend)?.ppid;
}

/** CPU seconds of the whole PostgreSQL server so far: postmaster, reaped and live children. */
export function postgresCpu(postmaster: number): number | undefined {
  const pm = stat(postmaster);
  if (!pm) return undefined;
  let total = pm.own + pm.children;
  for (const name of readdirSync('/proc')) {
    if (!/^\d+$/.test(name)) continue;
    const s = stat(Number(name));
    if (s?.ppid === postmaster) total += s.own;
  }
  return total;
}
