/**
 * The agent SDK's outbox when the machine around it misbehaves:
 * - a full disk (a real one: a 256 KiB tmpfs, when this process may mount one): the reserve file
 *   makes room for a report, the outbox then fails (no new work) and says writes work again only
 *   once the reserve is made again, not while the disk is still full;
 * - its directory, or its open segment, deleted while it runs: made again, with the pending
 *   reports written again;
 * - its lock taken over by another process while an agent runs (a real coordinator): the agent
 *   notices within one check interval, stops, and leaves the other process's lock alone;
 * - an outbox that cannot be opened says which directory, what it was doing, and a hint.
 */
import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { once } from 'node:events';
import { existsSync, watch } from 'node:fs';
import { mkdir, mkdtemp, open, readFile, rm, stat, truncate, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { createInterface } from 'node:readline';
import pino, { type Logger } from 'pino';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { createAgent, Outbox, readOutbox, type Agent, type OutboxEntry } from '@leasehold/agent-client';
import { segmentName } from '../agent-client/src/outbox-log.js';
import { RESERVE_FILE, reserveBytesFor } from '../agent-client/src/outbox.js';
import { jobEnqueue } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { useCoordinator, waitFor } from './helpers/coordinator.js';
import { makeJob } from './helpers/factories.js';
import { outboxKeeper } from './helpers/outbox.js';
import { root } from './helpers/serve.js';

const t = useTestDb();
const lh = useCoordinator(t);
const dirs: string[] = [];
const mounts: string[] = [];
const outboxes = outboxKeeper();
const agents: Agent[] = [];
const children: ChildProcess[] = [];

afterEach(async () => {
  for (const a of agents.splice(0)) await a.stop();
  for (const c of children.splice(0)) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL');
  await outboxes.closeAll();
  for (const m of mounts.splice(0)) execFileSync('umount', [m]);
});
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

async function tmpDir(): Promise<string> {
  const d = await mkdtemp(path.join(os.tmpdir(), 'leasehold-outbox-guard-'));
  dirs.push(d);
  return d;
}
type Line = { level: number; msg: string; [k: string]: unknown };
function captured(): { log: Logger; lines: Line[] } {
  const lines: Line[] = [];
  return { log: pino({ level: 'debug' }, { write: (s: string) => lines.push(JSON.parse(s) as Line) }), lines };
}
function entry(extra: Partial<OutboxEntry> = {}): OutboxEntry {
  const attemptId = randomUUID();
  return { attemptId, jobId: randomUUID(), queue: 'q', attemptNo: 1, kind: 'completed', result: { id: attemptId }, writtenAt: new Date().toISOString(), ...extra };
}
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** A 256 KiB tmpfs, or why there is none (not root, no mount in this container, not Linux). */
async function smallDisk(): Promise<string | { skip: string }> {
  if (process.platform !== 'linux') return { skip: 'tmpfs is Linux only' };
  const dir = await tmpDir();
  try {
    execFileSync('mount', ['-t', 'tmpfs', '-o', 'size=256k', 'tmpfs', dir], { stdio: 'pipe' });
  } catch (err) {
    return { skip: `cannot mount a tmpfs here: ${String((err as { stderr?: Buffer }).stderr ?? err).trim()}` };
  }
  mounts.push(dir);
  return dir;
}
/** Fills the file system of `dir` to the last byte. */
async function fill(dir: string): Promise<string> {
  const file = path.join(dir, 'filler');
  const fh = await open(file, 'w');
  const chunk = Buffer.alloc(4096, 1);
  try {
    for (;;) await fh.write(chunk);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ENOSPC') throw err;
  } finally {
    await fh.close();
  }
  return file;
}

describe('a full disk', () => {
  it('keeps the report it fills up with (from the reserve), then fails until the reserve is made again, not while the disk is still full', async (ctx) => {
    const disk = await smallDisk();
    if (typeof disk !== 'string') return ctx.skip(disk.skip);
    const dir = path.join(disk, 'outbox');
    const { log, lines } = captured();
    const o = new Outbox(dir, log, { reserveBytes: 64 * 1024, retryMs: 50 });
    const events: string[] = [];
    o.watch((failure) => events.push(failure ? `failing: ${(failure as NodeJS.ErrnoException).code}` : 'recovered'));
    await o.open();
    try {
      expect((await stat(path.join(dir, RESERVE_FILE))).size).toBe(64 * 1024);
      const filler = await fill(disk);
      // A job's result, ~9 KB, finished on the full disk: kept.
      const e = entry({ result: { pad: 'r'.repeat(9000) } });
      await o.put(e);
      expect(events).toEqual(['failing: ENOSPC']);
      expect(o.failure).toBeDefined();
      expect((await readOutbox(dir)).pending.map((x) => x.attemptId)).toEqual([e.attemptId]);
      expect(existsSync(path.join(dir, RESERVE_FILE))).toBe(false);
      expect(lines.filter((l) => l.level >= 50).map((l) => l.msg)).toEqual([expect.stringMatching(/^outbox: the disk is full: the reports were written in the room of the reserve file/)]);
      // Many tries later, the disk still full: still failing (a new segment would fit; that proves nothing).
      await sleep(500);
      expect(events).toEqual(['failing: ENOSPC']);
      // Space freed: writes work again once the reserve is back.
      await rm(filler);
      await waitFor('writes work again', () => events.includes('recovered'), 5000);
      expect(events).toEqual(['failing: ENOSPC', 'recovered']);
      expect((await stat(path.join(dir, RESERVE_FILE))).size).toBe(64 * 1024);
      expect((await readOutbox(dir)).pending.map((x) => x.attemptId)).toEqual([e.attemptId]);
    } finally {
      await o.close();
    }
  });

  it('at open: says which outbox, what it was doing and why, and leaves no empty lock behind', async (ctx) => {
    const disk = await smallDisk();
    if (typeof disk !== 'string') return ctx.skip(disk.skip);
    await fill(disk);
    const dir = path.join(disk, 'outbox');
    await expect(new Outbox(dir, pino({ level: 'silent' })).open()).rejects.toThrow(
      new RegExp(`^cannot open the outbox ${dir}: ENOSPC: no space left on device, write, while taking the lock \\(the disk is full: free some space\\)$`),
    );
    expect(existsSync(path.join(dir, 'outbox.lock'))).toBe(false);
  });
});

describe('the reserve file', () => {
  it('counts at most 32 slots (about 9.1 MiB)', () => {
    const MiB = 1024 * 1024;
    expect(reserveBytesFor(1)).toBe(MiB + 260 * 1024);
    expect(reserveBytesFor(32)).toBe(MiB + 32 * 260 * 1024);
    expect(reserveBytesFor(1000)).toBe(reserveBytesFor(32));
    expect(reserveBytesFor(1000)).toBeLessThan(9.2 * MiB);
  });

  it('is written in chunks that differ (a deduplicating file system cannot store it once)', async () => {
    const dir = path.join(await tmpDir(), 'outbox');
    const bytes = 2.5 * 1024 * 1024;
    await outboxes.open(dir, undefined, { reserveBytes: bytes });
    const buf = await readFile(path.join(dir, RESERVE_FILE));
    expect(buf.length).toBe(bytes);
    const chunk = 1024 * 1024;
    expect(buf.subarray(0, 4096).equals(buf.subarray(chunk, chunk + 4096))).toBe(false);
    expect(buf.subarray(4, chunk).equals(buf.subarray(chunk + 4, 2 * chunk))).toBe(false);
  });

  it.for([
    [100, 'fits, but not with its margin'],
    [50, 'does not fit'],
  ] as const)('is not tried while the disk has not room for it and a margin, never filling the disk to the last byte: 64 KiB in %s KiB free (%s)', async ([freeKiB], ctx) => {
    const disk = await smallDisk();
    if (typeof disk !== 'string') return ctx.skip(disk.skip);
    const dir = path.join(disk, 'outbox');
    await mkdir(dir);
    const filler = await fill(disk);
    await truncate(filler, (await stat(filler)).size - freeKiB * 1024);
    const touched: string[] = [];
    const watcher = watch(dir, (_event, name) => name === RESERVE_FILE && touched.push(name));
    try {
      const events: string[] = [];
      const o = new Outbox(dir, pino({ level: 'silent' }), { reserveBytes: 64 * 1024, retryMs: 20 });
      o.watch((failure) => events.push(failure ? 'failing' : 'recovered'));
      await o.open();
      try {
        await sleep(300); // ~15 retries
        expect(touched, 'the reserve file never created').toEqual([]);
        expect((o.failure as NodeJS.ErrnoException | undefined)?.code).toBe('ENOSPC');
        // Room again: made, and writes work.
        await rm(filler);
        await waitFor('writes work again', () => events.includes('recovered'), 5000);
        expect((await stat(path.join(dir, RESERVE_FILE))).size).toBe(64 * 1024);
      } finally {
        await o.close();
      }
    } finally {
      watcher.close();
    }
  });
});

describe('a full disk at open', () => {
  it('an agent holding reports opens (the lock takes the room of the reserve file), sends them to the coordinator, and takes no new work', async (ctx) => {
    const disk = await smallDisk();
    if (typeof disk !== 'string') return ctx.skip(disk.skip);
    const outboxDir = path.join(disk, 'outbox');
    const queue = 'full-at-open';
    const token = await lh.agent(queue);
    const jobs = [await makeJob(t.pool, { status: 'running', agentId: queue, queue }), await makeJob(t.pool, { status: 'running', agentId: queue, queue })];
    const reserveBytes = 64 * 1024;
    // The last run: two results written, then the agent stopped before they were sent.
    const last = new Outbox(outboxDir, pino({ level: 'silent' }), { reserveBytes });
    await last.open();
    for (const j of jobs) {
      await last.put({ attemptId: j.currentAttemptId!, jobId: j.id, queue, attemptNo: 1, kind: 'completed', result: { held: j.id }, writtenAt: new Date().toISOString() });
    }
    await last.close();
    expect((await stat(path.join(outboxDir, RESERVE_FILE))).size).toBe(reserveBytes);
    await fill(disk);

    const { log, lines } = captured();
    const agent = createAgent({ url: lh.url, token, queues: [queue], outboxDir, handleSignals: false, log, outboxOptions: { reserveBytes, retryMs: 50 } });
    agents.push(agent);
    let ran = 0;
    agent.handle(queue, () => ({ ran: ++ran }));
    await agent.start();
    const status = async (id: string) => (await t.pool.query('SELECT status::text, result FROM jobs WHERE id = $1', [id])).rows[0] as { status: string; result: unknown };
    await waitFor('both held reports stored', async () => (await Promise.all(jobs.map((j) => status(j.id)))).every((r) => r.status === 'succeeded'), 10_000);
    for (const j of jobs) expect(await status(j.id)).toEqual({ status: 'succeeded', result: { held: j.id } });
    expect(existsSync(path.join(outboxDir, RESERVE_FILE))).toBe(false);
    expect(lines.some((l) => l.level === 40 && /^outbox: the disk is full at open: deleted the reserve file/.test(l.msg) && l.step === 'taking the lock')).toBe(true);
    // Failing (the reserve cannot be made): no new work (one assigned is declined, never started).
    const o = await jobEnqueue(t.pool, { queue, payload: {} });
    if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
    await sleep(500);
    expect(['queued', 'claimed']).toContain((await status(o.value.id)).status);
    expect(ran).toBe(0);
  });

  it('a compaction at open that fails for want of space is not fatal: the outbox opens failing, with its reports', async (ctx) => {
    const disk = await smallDisk();
    if (typeof disk !== 'string') return ctx.skip(disk.skip);
    const dir = path.join(disk, 'outbox');
    const compactBytes = 32 * 1024;
    const first = new Outbox(dir, pino({ level: 'silent' }), { reserveBytes: 0, compactBytes: 1024 * 1024 });
    await first.open();
    const keep = [entry({ result: { pad: 'k'.repeat(5000) } }), entry({ result: { pad: 'k'.repeat(5000) } })];
    for (const e of keep) await first.put(e);
    // Mostly acknowledged, over compactBytes: the next open compacts.
    for (let i = 0; i < 8; i++) {
      const e = entry({ result: { pad: 'x'.repeat(5000) } });
      await first.put(e);
      await first.remove(e.attemptId);
    }
    await first.close();
    // One page left: room for the lock, not for a new segment of ~10 KB.
    const filler = await fill(disk);
    await truncate(filler, (await stat(filler)).size - 4096);
    const { log, lines } = captured();
    const o = await outboxes.open(dir, log, { reserveBytes: 0, compactBytes, retryMs: 60_000 });
    expect(o.pending().map((e) => e.attemptId).sort()).toEqual(keep.map((e) => e.attemptId).sort());
    expect((o.failure as NodeJS.ErrnoException | undefined)?.code).toBe('ENOSPC');
    expect(lines.filter((l) => l.level >= 50).map((l) => l.msg)).toEqual([expect.stringMatching(/^outbox: compaction at open failed/)]);
  });
});

describe('an outbox that cannot be opened', () => {
  it('names the directory, the step and a hint', async () => {
    const file = path.join(await tmpDir(), 'not-a-directory');
    await writeFile(file, '');
    const dir = path.join(file, 'outbox');
    await expect(new Outbox(dir, pino({ level: 'silent' })).open()).rejects.toThrow(
      new RegExp(`^cannot open the outbox ${dir}: ENOTDIR: .*, while creating the directory \\(a file is in the way: the outbox must be a directory\\)$`),
    );
  });
});

describe('an outbox deleted while it runs', () => {
  it.each([
    ['the whole directory', 'dir'],
    ['its open segment', 'segment'],
  ] as const)('is made again with the pending reports: %s', async (_, what) => {
    const dir = path.join(await tmpDir(), 'outbox');
    const { log, lines } = captured();
    const o = await outboxes.open(dir, log, { checkMs: 100, reserveBytes: 4096 });
    const [a, b] = [entry(), entry()];
    await o.put(a);
    await o.put(b);
    await o.remove(a.attemptId);
    if (what === 'dir') await rm(dir, { recursive: true, force: true });
    else await rm(path.join(dir, segmentName(1)));
    expect((await readOutbox(dir)).pending).toEqual([]);
    await waitFor('the pending report on disk again', async () => (await readOutbox(dir)).pending.some((x) => x.attemptId === b.attemptId), 5000);
    expect((await readOutbox(dir)).pending.map((x) => x.attemptId)).toEqual([b.attemptId]);
    expect(JSON.parse(await readFile(path.join(dir, 'outbox.lock'), 'utf8'))).toMatchObject({ pid: process.pid });
    await waitFor('the reserve made again', () => existsSync(path.join(dir, RESERVE_FILE)), 5000);
    expect(lines.filter((l) => l.level >= 50).map((l) => l.msg)).toEqual([expect.stringMatching(/^outbox: deleted while the agent runs/)]);
    // Later reports land there too.
    const c = entry();
    await o.put(c);
    expect((await readOutbox(dir)).pending.map((x) => x.attemptId).sort()).toEqual([b.attemptId, c.attemptId].sort());
  });
});

describe('an outbox lock taken over by another process', () => {
  it('stops the agent within one check interval; the other process keeps its lock', async () => {
    const outboxDir = await tmpDir();
    const { log, lines } = captured();
    const checkMs = 200;
    const agent = createAgent({ url: lh.url, token: await lh.agent('lock-lost'), queues: ['lock-lost'], outboxDir, handleSignals: false, log, outboxOptions: { checkMs } });
    agents.push(agent);
    agent.handle('lock-lost', () => ({ ok: true }));
    await agent.start();
    const lost = once(agent, 'outboxLockLost');
    // Someone deletes the lock (as the old refusal message advised) and a second agent takes it.
    const lock = path.join(outboxDir, 'outbox.lock');
    const theirs = JSON.stringify({ pid: process.ppid, host: os.hostname(), since: new Date().toISOString() });
    await rm(lock);
    await writeFile(lock, theirs);
    const t0 = performance.now();
    const [{ error }] = (await lost) as [{ error: Error }];
    expect(performance.now() - t0).toBeLessThan(checkMs + 1000);
    expect(error.message).toMatch(new RegExp(`^outbox ${outboxDir}: another process took its lock over .*"pid":${process.ppid}.*this agent stops$`));
    expect(lines.some((l) => l.level === 50 && /another process took its lock over/.test(l.msg))).toBe(true);
    expect(agent.isStopping).toBe(false); // it stopped itself
    // It takes no work any more, and leaves the other process's lock as it is.
    const o = await jobEnqueue(t.pool, { queue: 'lock-lost', payload: {} });
    if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
    await sleep(1000);
    expect((await t.pool.query('SELECT status::text FROM jobs WHERE id = $1', [o.value.id])).rows[0].status).toBe('queued');
    expect(await readFile(lock, 'utf8')).toBe(theirs);
  });

  it('ends leasehold-agent with exit code 1 and one line saying so', async () => {
    const dir = await tmpDir();
    const outboxDir = path.join(dir, 'outbox');
    const config = path.join(dir, 'agent.json');
    await writeFile(config, JSON.stringify({ url: lh.url, token: await lh.agent('lock-lost-runner'), outboxDir, queues: { 'lock-lost-runner': { command: ['true'] } } }));
    const child = spawn(process.execPath, ['agent-client/bin/leasehold-agent.mjs', '--config', config], { cwd: root, env: { ...process.env, LEASEHOLD_LOG_LEVEL: 'info' }, stdio: ['ignore', 'pipe', 'pipe'] });
    children.push(child);
    const stdout: string[] = [];
    const stderr: string[] = [];
    createInterface({ input: child.stdout }).on('line', (l) => stdout.push(l));
    createInterface({ input: child.stderr }).on('line', (l) => stderr.push(l));
    const exited = once(child, 'close').then(([code]) => code as number | null);
    // A start compiles the runner's TypeScript (tsx): 20 s, as agent-runner.test.ts waits for it.
    await waitFor('the runner serving', () => {
      if (child.exitCode !== null) throw new Error(`the runner exited: ${stderr.join('\n')}`);
      return stdout.some((l) => l.includes('"event":"serving"'));
    }, 20_000);
    const lock = path.join(outboxDir, 'outbox.lock');
    const theirs = JSON.stringify({ pid: process.pid, host: os.hostname(), since: new Date().toISOString() });
    await rm(lock);
    await writeFile(lock, theirs);
    // The runner's check interval is the SDK's default, 10 s.
    expect(await Promise.race([exited, sleep(20_000).then(() => 'still running')])).toBe(1);
    expect(stderr).toEqual([expect.stringMatching(/^leasehold-agent: outbox .*: another process took its lock over .*: stopped \(another process writes this outbox now: run one agent per outbox directory\)$/)]);
    expect(await readFile(lock, 'utf8')).toBe(theirs);
  }, 60_000);

  it('refuses a second open with a hint that does not tell to delete the lock of a running agent', async () => {
    const dir = await tmpDir();
    await mkdir(dir, { recursive: true });
    await writeFile(path.join(dir, 'outbox.lock'), JSON.stringify({ pid: process.ppid }));
    await expect(new Outbox(dir, pino({ level: 'silent' })).open()).rejects.toThrow(
      /in use by process \d+ \(lock file .*\): one outbox directory per agent process\. Stop the other agent first, or give this one another outbox directory; delete the lock file only if no agent process is running with this outbox/,
    );
  });
});
