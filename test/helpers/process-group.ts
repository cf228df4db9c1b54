/**
 * Whether any process of the process group `pgid` is alive, zombies not counted (an orphan the
 * machine's init has not reaped yet is dead all the same). Linux only: it reads /proc.
 */
import { readdirSync, readFileSync } from 'node:fs';

export function groupAlive(pgid: number): boolean {
  return readdirSync('/proc').some((p) => {
    if (!/^\d+$/.test(p)) return false;
    let stat: string;
    try {
      stat = readFileSync(`/proc/${p}/stat`, 'utf8');
    } catch {
      return false; // ended while we looked
    }
    // After the command name (which may hold spaces and parentheses): state, ppid, pgrp.
    const [state, , pgrp] = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return Number(pgrp) === pgid && state !== 'Z';
  });
}
