/**
 * One process per outbox directory: `outbox.lock`, created with `wx` (fails if it exists), holds
 * the owner's pid, host and start time; the owner checks and touches it every 10 s while it runs
 * (the outbox's check timer, `Outbox`) and deletes it when it closes the outbox, if it is still
 * its own.
 *
 * A lock left by a process that is gone is taken over. "Gone" means any of: its pid is not
 * running; its pid is ours (a container restarted, or a reboot handed us the same pid) and this
 * process has not opened the directory; or it has not been touched for 60 s (after a reboot its
 * pid may belong to some unrelated process: waiting a minute is better than refusing for ever;
 * logged as a warning naming the pid when that pid is running). Otherwise `open()` fails with an
 * error naming the pid and the file.
 *
 * The holder reads its lock back at every check (`check`): a lock whose content is not what it
 * wrote (another process took it over: someone deleted it and started a second agent, or the
 * clock jumped past the staleness) means two processes write one outbox, and the outbox stops
 * (`Outbox.onLockLost`); a lock file that is gone (deleted, or its whole directory) is written
 * again (`retake`).
 *
 * What it does not do: two processes that find the same stale lock at the same instant may both
 * take it over (each deletes it and creates its own; the later delete wins the file, the other
 * notices at its next check and stops). It is a guard against a configuration mistake (two
 * agents given one `outboxDir`), not a mutex for processes racing to start. Node has no portable
 * advisory file lock to do better without a native dependency.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import type { Logger } from 'pino';

export const LOCK_FILE = 'outbox.lock';
/** How often the holder checks and touches its lock (the outbox's check timer). */
export const TOUCH_MS = 10_000;
const STALE_MS = 60_000;

/** Directories this process holds, so a second `open()` of one in the same process is refused. */
const held = new Set<string>();

/** What the lock file holds now, for its holder: still its own, deleted, or another process's. */
export type LockState = { state: 'held' } | { state: 'missing' } | { state: 'taken'; holder: string };

/** A held lock. */
export interface OutboxLock {
  readonly file: string;
  /** Reads the lock back: still ours (the same pid, host and start time), gone, or another's. */
  check(): Promise<LockState>;
  /**
   * Writes the lock again after its file (or its directory) was deleted; false if another
   * process created one meanwhile (the lock is then lost).
   */
  retake(): Promise<boolean>;
  /** Keeps the lock fresh for the staleness check of other processes. */
  touch(): Promise<void>;
  /** Deletes the file, if it is still ours; the directory is free for this process again. */
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
      await create(file, mine);
      break;
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== 'EEXIST' || tries >= 3) throw err;
    }
    const holder = await readHolder(file);
    if (holder === 'gone') continue; // released between our attempt and the read: try again
    const age = Date.now() - holder.mtimeMs;
    const alive = holder.pid !== undefined && holder.pid !== process.pid && pidAlive(holder.pid);
    if (alive && age < STALE_MS) {
      const name = await processName(holder.pid!);
      throw new Error(
        `outbox ${dir} is in use by process ${holder.pid} (lock file ${file}, touched ${Math.round(age / 1000)} s ago): ` +
          `one outbox directory per agent process. Stop the other agent first, or give this one another outbox directory; ` +
          `delete the lock file only if no agent process is running with this outbox (process ${holder.pid}${name ? `, ${name},` : ''} holds it now).`,
      );
    }
    if (alive) {
      log.warn(
        { file, pid: holder.pid, ageMs: Math.round(age) },
        'taking over the outbox lock: not touched for a minute, though its process is running (some other program since a reboot, or a frozen agent: an agent that finds its lock taken stops)',
      );
    } else {
      log.warn({ file, pid: holder.pid, ageMs: Math.round(age) }, 'taking over the outbox lock of a process that is gone');
    }
    await fs.rm(file, { force: true });
  }
  let released = false;
  return {
    file,
    async check() {
      let text: string;
      try {
        text = await fs.readFile(file, 'utf8');
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code === 'ENOENT') return { state: 'missing' };
        throw err;
      }
      return text === mine ? { state: 'held' } : { state: 'taken', holder: text.slice(0, 200) };
    },
    async retake() {
      try {
        await create(file, mine);
        return true;
      } catch (err) {
        if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
        return (await fs.readFile(file, 'utf8').catch(() => '')) === mine;
      }
    },
    async touch() {
      const now = new Date();
      await fs.utimes(file, now, now);
    },
    async release() {
      if (released) return;
      released = true;
      held.delete(key);
      // Another process's lock (it took this one over) is not ours to delete.
      const text = await fs.readFile(file, 'utf8').catch(() => undefined);
      if (text === mine) await fs.rm(file, { force: true });
    },
  };
}

/**
 * Creates the lock file with our content, failing if it exists. A write that fails after the
 * file was created (a full disk) leaves no empty lock behind.
 */
async function create(file: string, content: string): Promise<void> {
  // Owner only, as every file of the outbox (outbox.ts says why).
  const fh = await fs.open(file, 'wx', 0o600);
  try {
    await fh.writeFile(content);
  } catch (err) {
    await fh.close().catch(() => undefined);
    await fs.rm(file, { force: true }).catch(() => undefined);
    throw err;
  }
  await fh.close();
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

/** The program a pid runs, where the system says so cheaply (Linux); undefined elsewhere. */
async function processName(pid: number): Promise<string | undefined> {
  if (process.platform !== 'linux') return undefined;
  const comm = await fs.readFile(`/proc/${pid}/comm`, 'utf8').catch(() => undefined);
  return comm?.trim() || undefined;
}
