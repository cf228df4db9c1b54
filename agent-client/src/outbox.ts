/**
 * The durable outbox: every result or failure is on disk before it is sent, and stays there
 * until the coordinator acknowledges it, across crashes and restarts.
 *
 * One file per attempt, `<attemptId>.json`, written as: a temporary file in the same directory
 * (`<attemptId>.json.tmp-<pid>-<n>`), write, fsync, close, then rename to the final name
 * and fsync the directory. A crash at any instruction leaves either no entry (the temporary
 * file, removed at the next start: the report was never sent, so the coordinator will have the
 * job redone) or a complete one (sent again at the next connection). Nothing is renamed over a
 * file that is open: entries are closed before their rename, and final names are per attempt.
 * Names hold only hex digits, `-` and `.`, valid on Windows.
 *
 * Acknowledged `ok` or `duplicate`: the entry is deleted. `stale`: renamed to
 * `<attemptId>.superseded.json` and never sent again (kept for the operator).
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from 'pino';

type Json = null | boolean | number | string | Json[] | { [k: string]: Json };

/** One report waiting for its acknowledgement. */
export interface OutboxEntry {
  attemptId: string;
  jobId: string;
  queue: string;
  attemptNo: number;
  kind: 'completed' | 'failed';
  result?: { [k: string]: Json };
  error?: { message: string; details?: { [k: string]: Json } };
  retryable?: boolean;
  /** ISO time the entry was written. */
  writtenAt: string;
}

const ID = /^[0-9a-f-]{36}$/;
const FINAL = /^([0-9a-f-]{36})\.json$/;
const TMP = /^[0-9a-f-]{36}\.json\.tmp-/;

export class Outbox {
  private readonly entries = new Map<string, OutboxEntry>();
  /** Temporary names are unique per process: its pid and a counter. */
  private seq = 0;

  constructor(
    readonly dir: string,
    private readonly log: Logger,
  ) {}

  /** Creates the directory if needed, removes torn temporary files, loads the pending entries. */
  async open(): Promise<OutboxEntry[]> {
    await fs.mkdir(this.dir, { recursive: true });
    for (const name of await fs.readdir(this.dir)) {
      const file = path.join(this.dir, name);
      if (TMP.test(name)) {
        // Never renamed, so never sent: the coordinator will have this attempt redone.
        this.log.warn({ file }, 'removing a torn outbox write left by a crash');
        await fs.rm(file, { force: true });
        continue;
      }
      const m = FINAL.exec(name);
      if (!m) continue;
      try {
        const e = JSON.parse(await fs.readFile(file, 'utf8')) as OutboxEntry;
        if (e.attemptId !== m[1] || (e.kind !== 'completed' && e.kind !== 'failed')) throw new Error('not an outbox entry');
        this.entries.set(e.attemptId, e);
      } catch (err) {
        this.log.error({ file, err }, 'unreadable outbox entry: moved aside as .corrupt');
        await fs.rename(file, `${file}.corrupt`).catch(() => undefined);
      }
    }
    return this.pending();
  }

  /** Entries not yet acknowledged, oldest first. */
  pending(): OutboxEntry[] {
    return [...this.entries.values()].sort((a, b) => a.writtenAt.localeCompare(b.writtenAt));
  }

  has(attemptId: string): boolean {
    return this.entries.has(attemptId);
  }

  /** Makes `e` durable (returns once it is on disk under its final name). */
  async put(e: OutboxEntry): Promise<void> {
    if (!ID.test(e.attemptId)) throw new Error(`not an attempt id: ${e.attemptId}`);
    const final = this.file(e.attemptId);
    const tmp = `${final}.tmp-${process.pid}-${++this.seq}`;
    const fh = await fs.open(tmp, 'wx');
    try {
      await fh.writeFile(JSON.stringify(e), 'utf8');
      await fh.sync();
    } finally {
      await fh.close();
    }
    await fs.rename(tmp, final);
    await this.syncDir();
    this.entries.set(e.attemptId, e);
  }

  /** The coordinator has it (`ok` or `duplicate`): forget it. */
  async remove(attemptId: string): Promise<void> {
    this.entries.delete(attemptId);
    await fs.unlink(this.file(attemptId)).catch((err: NodeJS.ErrnoException) => {
      if (err.code !== 'ENOENT') throw err;
    });
  }

  /** The coordinator refused it as stale: keep it aside, never send it again. */
  async supersede(attemptId: string): Promise<void> {
    this.entries.delete(attemptId);
    await fs.rename(this.file(attemptId), path.join(this.dir, `${attemptId}.superseded.json`)).catch((err: NodeJS.ErrnoException) => {
      if (err.code !== 'ENOENT') throw err;
    });
    await this.syncDir();
  }

  private file(attemptId: string) {
    return path.join(this.dir, `${attemptId}.json`);
  }

  /** fsync the directory so the rename itself survives a power cut (not possible on Windows). */
  private async syncDir(): Promise<void> {
    if (process.platform === 'win32') return;
    const dh = await fs.open(this.dir, 'r');
    try {
      await dh.sync();
    } finally {
      await dh.close();
    }
  }
}
