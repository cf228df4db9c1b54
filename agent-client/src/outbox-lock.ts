/**
 * One process per outbox directory: `outbox.lock`, created with `wx` (fails if it exists), holds
 * the owner's pid and host; the owner touches it every 10 s while it runs and deletes it when
 * it closes the outbox.
 *
 * A lock left by a process that is gone is taken over. "Gone" means any of: its pid is not
 * running; its pid is ours (a container restarted, or a reboot handed us the same pid) and this
 * process has not opened the directory; or it has not been touched for 60 s (after a reboot its
 * pid may belong to some unrelated process: waiting a minute is better than refusing for ever).
 * Otherwise `open()` fails with an error naming the pid and the file.
 *
 * What it does not do: two processes that find the same stale lock at the same instant may both
 * take it over (each deletes it and creates its own; the later delete wins the file, both
 * continue). It is a guard against a configuration mistake (two agents given one `outboxDir`),
 * not a mutex for processes racing to start. Node has no portable advisory file lock to do
 * better without a native dependency.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import type { Logger } from 'pino';

export const LOCK_FILE = 'outbox.lock';
const TOUCH_MS = 10_000;
const STALE_MS = 60_000;

/** Directories this process holds, so a second `open()` of one in the same process is refused. */
const held = new Set<string>();

/** A held lock: `release()` deletes the file. */
export interface OutboxLock {
  release(): Promise<void>;
}

/** Takes the lock of `dir` or throws a clear error if another live process holds it. */
export async function lockOutbox(dir: string, log: Logger): Promise<OutboxLock> {
  const key = path.resolve(dir);
  if (held.has(key)) throw new Error(`outbox ${dir} is already open in this process (one Outbox per directory)`);
  held.add(key); // before the first await: a concurrent open() in this process sees it
  try {
    return await take(dir, key, log);
  } catch (err) {
    held.delete(key);
    throw err;
  }
}

async function take(dir: string, key: string, log: Logger): Promise<OutboxLock> {
  const file = path.join(dir, LOCK_FILE);
  const mine = JSON.stringify({ pid: process.pid, host: os.hostname(), since: new Date().toISOString() });
  for (let tries = 0; ; tries++) {
    try {
      await fs.writeFile(file, mine, { flag: 'wx' });
      break;
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== 'EEXIST' || tries >= 3) throw err;
    }
    const holder = await readHolder(file);
    if (holder === 'gone') continue; // released between our attempt and the read: try again
    const age = Date.now() - holder.mtimeMs;
    const alive = holder.pid !== undefined && holder.pid !== process.pid && pidAlive(holder.pid);
    if (alive && age < STALE_MS) {
      throw new Error(
        `outbox ${dir} is in use by process ${holder.pid} (lock file ${file}, touched ${Math.round(age / 1000)} s ago): ` +
          `one outbox directory per agent process. If no agent uses it, delete the lock file.`,
      );
    }
    log.warn({ file, pid: holder.pid, ageMs: Math.round(age) }, 'taking over the outbox lock of a process that is gone');
    await fs.rm(file, { force: true });
  }
  // Touching keeps the lock fresh for the staleness check; unref'd so it never keeps the
  // process alive. A failed touch is only logged: the lock file is advisory.
  const timer = setInterval(() => {
    const now = new Date();
    fs.utimes(file, now, now).catch((err: unknown) => log.warn({ err, file }, 'could not touch the outbox lock'));
  }, TOUCH_MS);
  timer.unref();
  let released = false;
  return {
    async release() {
      if (released) return;
      released = true;
      clearInterval(timer);
      held.delete(key);
      await fs.rm(file, { force: true });
    },
  };
}

async function readHolder(file: string): Promise<{ pid?: number; mtimeMs: number } | 'gone'> {
  try {
    const [text, st] = await Promise.all([fs.readFile(file, 'utf8'), fs.stat(file)]);
    let pid: number | undefined;
    try {
      const p = (JSON.parse(text) as { pid?: unknown }).pid;
      if (typeof p === 'number' && Number.isInteger(p) && p > 0) pid = p;
    } catch {
      // torn by a crash while it was being written: no owner
    }
    return { pid, mtimeMs: st.mtimeMs };
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return 'gone';
    throw err;
  }
}

/** Signal 0 tests for existence; EPERM means it exists under another user. */
function pidAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
}
