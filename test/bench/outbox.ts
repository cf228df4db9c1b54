/**
 * `node --import tsx test/bench/outbox.ts [--entries 20000] [--writers 256] [--reps 3] [--log-only]`: the
 * agent outbox alone, the append-only log against the one-file-per-entry outbox it replaced
 * (read from git at commit 362b590). Each repetition puts N entries from W concurrent writers,
 * then acknowledges them all at once (as an agent does: each ack as it arrives, none waiting
 * for another), in a fresh directory under the system's temporary directory (it must be on a
 * real disk: on tmpfs fsync costs nothing). Prints wall time, CPU time of the process
 * (`process.cpuUsage()`, libuv's threads included) and syncs (the old outbox's counted on
 * FileHandle's sync/datasync; the log's from its own counter, which also counts writes through
 * O_DSYNC) per phase; medians over the repetitions.
 */
import { execFile } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import fs, { mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { Command } from 'commander';
import pino from 'pino';
import { Outbox, type OutboxEntry } from '../../agent-client/src/outbox.js';

const OLD_COMMIT = '362b590';
const root = path.resolve(import.meta.dirname, '../..');

interface Box {
  /** The log outbox counts its own syncs: with O_DSYNC a synced write calls no datasync. */
  stats?: { fsyncs: number };
  open(): Promise<unknown>;
  put(e: OutboxEntry): Promise<void>;
  remove(id: string): Promise<void>;
  close?(): Promise<void>;
}
type Make = (dir: string) => Box;

// Every fsync and fdatasync of any file handle, whichever outbox makes it.
let syncs = 0;
async function countSyncs(): Promise<void> {
  const dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-bench-probe-'));
  const fh = await fs.open(path.join(dir, 'x'), 'w');
  const proto = Object.getPrototypeOf(fh) as { sync: () => Promise<void>; datasync: () => Promise<void> };
  await fh.close();
  await rm(dir, { recursive: true });
  for (const name of ['sync', 'datasync'] as const) {
    const orig = proto[name];
    proto[name] = function (this: unknown) {
      syncs++;
      return orig.call(this);
    };
  }
}

async function oldOutbox(): Promise<Make> {
  const { stdout } = await promisify(execFile)('git', ['show', `${OLD_COMMIT}:agent-client/src/outbox.ts`], { cwd: root, maxBuffer: 1 << 20 });
  const file = path.join(os.tmpdir(), `leasehold-old-outbox-${process.pid}.ts`);
  await writeFile(file, stdout);
  const mod = (await import(file)) as { Outbox: new (dir: string, log: pino.Logger) => Box };
  await rm(file);
  return (dir) => new mod.Outbox(dir, pino({ level: 'silent' }));
}

interface Phase {
  wallMs: number;
  cpuMs: number;
  fsyncs: number;
}

async function measure(box: Box, fn: () => Promise<void>): Promise<Phase> {
  const count = () => box.stats?.fsyncs ?? syncs;
  const s0 = count();
  const c0 = process.cpuUsage();
  const t0 = performance.now();
  await fn();
  const wallMs = performance.now() - t0;
  const c = process.cpuUsage(c0);
  return { wallMs, cpuMs: (c.user + c.system) / 1000, fsyncs: count() - s0 };
}

/** Runs `n` tasks from `w` concurrent loops. */
async function concurrently(n: number, w: number, task: (i: number) => Promise<void>): Promise<void> {
  let next = 0;
  await Promise.all(
    Array.from({ length: w }, async () => {
      while (next < n) await task(next++);
    }),
  );
}

async function once(make: Make, entries: number, writers: number): Promise<{ put: Phase; ack: Phase }> {
  const dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-bench-outbox-'));
  try {
    const box = make(dir);
    await box.open();
    // About what an agent writes for a small job: ids, a short result.
    const es: OutboxEntry[] = Array.from({ length: entries }, (_, i) => ({
      attemptId: randomUUID(),
      jobId: randomUUID(),
      queue: 'bench',
      attemptNo: 1,
      kind: 'completed',
      result: { n: i, doubled: i * 2 },
      writtenAt: new Date().toISOString(),
    }));
    const put = await measure(box, () => concurrently(entries, writers, (i) => box.put(es[i]!)));
    // Acks as an agent makes them: each as its Ack arrives, none waiting for another.
    const ack = await measure(box, () => Promise.all(es.map((e) => box.remove(e.attemptId))).then(() => undefined));
    await box.close?.();
    return { put, ack };
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[xs.length >> 1]!;

const opts = new Command()
  .option('--entries <n>', 'entries per repetition', '20000')
  .option('--writers <n>', 'concurrent writers', '256')
  .option('--reps <n>', 'repetitions of each', '3')
  .option('--log-only', 'the append-only log alone (without the old outbox)')
  .parse()
  .opts<{ entries: string; writers: string; reps: string; logOnly?: boolean }>();
const entries = Number(opts.entries);
const writers = Number(opts.writers);
await countSyncs();
const systems: Array<[string, Make]> = [
  ...(opts.logOnly ? [] : [['one file per entry (362b590)', await oldOutbox()] as [string, Make]]),
  ['append-only log', (dir) => new Outbox(dir, pino({ level: 'silent' }))],
];
console.log(`${entries} entries, ${writers} concurrent writers, ${opts.reps} repetitions (median), in ${os.tmpdir()}\n`);
console.log('| outbox | phase | wall ms | CPU ms | CPU µs/entry | fsyncs |');
console.log('|---|---|---:|---:|---:|---:|');
for (const [name, make] of systems) {
  const runs: Array<{ put: Phase; ack: Phase }> = [];
  for (let r = 0; r < Number(opts.reps); r++) runs.push(await once(make, entries, writers));
  for (const phase of ['put', 'ack'] as const) {
    const m = (k: keyof Phase) => median(runs.map((x) => x[phase][k]));
    console.log(`| ${name} | ${phase} | ${m('wallMs').toFixed(0)} | ${m('cpuMs').toFixed(0)} | ${((m('cpuMs') * 1000) / entries).toFixed(1)} | ${m('fsyncs')} |`);
  }
}
