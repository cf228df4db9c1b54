/**
 * The agent SDK when its outbox cannot be written (a full disk, an I/O error), on a file system
 * whose faults the test injects: `fs.open` of the outbox's directory hands out file handles whose
 * writes fail with ENOSPC after a given number of bytes (a disk filling up part-way through a
 * write), or reach the file and then fail with EIO (a sync that failed after the page cache took
 * the data), and whose truncation can fail.
 *
 * - A put reported as failed never comes back as pending, at a restart or after recovery, even
 *   when its record reached the file, and even when cutting it off failed too and the segment
 *   that holds it cannot be deleted.
 * - A failing outbox tries again on its own and tells its watchers once when writes start
 *   failing and once when they work again; one error line per episode.
 * - The agent takes no new work meanwhile (no slot given back, assigned jobs not started), gives
 *   the attempt whose report was lost back as a retryable failure, and takes work again once a
 *   write works, against a fake coordinator speaking the protocol.
 */
import { randomUUID } from 'node:crypto';
import { once } from 'node:events';
import fs, { type FileHandle } from 'node:fs/promises';
import { mkdtemp, readdir, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pino, { type Logger } from 'pino';
import { afterAll, afterEach, describe, expect, it, vi } from 'vitest';
import { createAgent, readOutbox, type Agent, type OutboxEntry } from '@leasehold/agent-client';
import { encodeRecord, segmentName } from '../agent-client/src/outbox-log.js';
import { outboxKeeper } from './helpers/outbox.js';
import { grpc, services } from './helpers/raw-agent.js';

const dirs: string[] = [];
const outboxes = outboxKeeper();
const agents: Agent[] = [];
const servers: grpc.Server[] = [];

afterEach(async () => {
  vi.restoreAllMocks();
  for (const a of agents.splice(0)) await a.stop();
  await outboxes.closeAll();
  for (const s of servers.splice(0)) s.forceShutdown();
});
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

async function tmpDir(): Promise<string> {
  const d = await mkdtemp(path.join(os.tmpdir(), 'leasehold-outbox-failing-'));
  dirs.push(d);
  return d;
}
type Line = { level: number; msg: string };
function captured(): { log: Logger; lines: Line[] } {
  const lines: Line[] = [];
  return { log: pino({ level: 'debug' }, { write: (s: string) => lines.push(JSON.parse(s) as Line) }), lines };
}
let clock = Date.parse('2030-01-01T00:00:00Z');
function entry(): OutboxEntry {
  const attemptId = randomUUID();
  return { attemptId, jobId: randomUUID(), queue: 'q', attemptNo: 1, kind: 'completed', result: { id: attemptId }, writtenAt: new Date(clock++).toISOString() };
}
const ids = (es: OutboxEntry[]) => es.map((e) => e.attemptId).sort();
const fault = (code: string, syscall: string) => Object.assign(new Error(`${code}: injected, ${syscall}`), { code, syscall });

/** The faults of the outbox directory's file system, changed by the test as it goes. */
interface Disk {
  /** Writes fail with ENOSPC once `room` more bytes have been written. */
  full: boolean;
  room: number;
  /** Writes reach the file, then fail with EIO. */
  eio: boolean;
  truncateFails: boolean;
  /** The directory's fsync fails. */
  dirSyncFails: boolean;
}

/** Injects `Disk`'s faults into every file opened under `dir` (through `fs.open`, as the outbox opens them). */
function faultyDisk(dir: string): Disk {
  const disk: Disk = { full: false, room: 0, eio: false, truncateFails: false, dirSyncFails: false };
  const realOpen = fs.open.bind(fs);
  vi.spyOn(fs, 'open').mockImplementation(async (file, flags, mode) => {
    const fh = await realOpen(file, flags, mode);
    if (!path.resolve(String(file)).startsWith(dir)) return fh;
    const isDir = path.resolve(String(file)) === dir;
    const write = async (...args: unknown[]) => {
      const real = () => (fh.write as (...a: unknown[]) => Promise<unknown>)(...args);
      if (disk.eio) {
        await real();
        throw fault('EIO', 'write');
      }
      if (!disk.full) return real();
      if (typeof args[0] === 'string' || disk.room <= 0) throw fault('ENOSPC', 'write');
      const [buf, off, len, pos] = args as [Buffer, number, number, number];
      const n = Math.min(len, disk.room);
      disk.room -= n;
      return fh.write(buf, off, n, pos);
    };
    return new Proxy(fh, {
      get(target, prop) {
        if (prop === 'write') return write;
        if (prop === 'truncate' && disk.truncateFails) return () => Promise.reject(fault('EIO', 'ftruncate'));
        if (prop === 'sync' && isDir && disk.dirSyncFails) return () => Promise.reject(fault('EIO', 'fsync'));
        const v = Reflect.get(target, prop, target) as unknown;
        return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
      },
    }) as FileHandle;
  });
  return disk;
}

const openOutbox = (dir: string, opts: { log?: Logger; retryMs?: number } = {}) => outboxes.open(dir, opts.log, { retryMs: opts.retryMs ?? 60_000 });
const closed = outboxes.closed;
const segments = async (dir: string) => (await readdir(dir)).filter((n) => /^outbox-\d+\.log$/.test(n)).sort();

describe('a put reported as failed', () => {
  it.each([
    ['the disk fills up part-way through a write (the first report of it whole on disk)', 'enospc'],
    ['a write reaches the file, then fails with EIO', 'eio'],
  ] as const)('never comes back after a restart: %s', async (_, kind) => {
    const dir = await tmpDir();
    const disk = faultyDisk(dir);
    const o = await openOutbox(dir);
    const a = entry();
    await o.put(a);
    const [b, c, d] = [entry(), entry(), entry()];
    if (kind === 'enospc') {
      disk.full = true;
      disk.room = encodeRecord({ t: 'put', e: b }).length + 10; // b whole, c torn, then ENOSPC
    } else disk.eio = true;
    const results = await Promise.allSettled([b, c, d].map((e) => o.put(e)));
    const code = kind === 'enospc' ? 'ENOSPC' : 'EIO';
    expect(results).toEqual(Array(3).fill({ status: 'rejected', reason: expect.objectContaining({ code }) }));
    expect(o.pending()).toEqual([a]);
    // What a restart would read now (a crash: nothing closed).
    expect(ids((await readOutbox(dir)).pending), 'rejected reports on disk').toEqual([a.attemptId]);
    // A clean stop and a restart, the disk still failing.
    await closed(o);
    const again = await openOutbox(dir);
    expect(again.pending()).toEqual([a]);
  });

  it('never comes back once writes work again, even when cutting it off failed and its segment cannot be deleted', async () => {
    const dir = await tmpDir();
    const disk = faultyDisk(dir);
    const { log, lines } = captured();
    const o = await openOutbox(dir, { log });
    const [a, b, c] = [entry(), entry(), entry()];
    await o.put(a);
    const [seg] = await segments(dir);
    disk.eio = true;
    disk.truncateFails = true;
    await expect(o.put(b)).rejects.toMatchObject({ code: 'EIO' });
    // The residual case, logged: a restart now would send b (the coordinator refuses it).
    expect(ids((await readOutbox(dir)).pending)).toEqual(ids([a, b]));
    // The disk works again, but the old segment cannot be deleted (on Windows: someone has it open).
    disk.eio = false;
    disk.truncateFails = false;
    const realRm = fs.rm.bind(fs);
    vi.spyOn(fs, 'rm').mockImplementation((p, opts) => (path.basename(String(p)) === seg ? Promise.reject(fault('EPERM', 'unlink')) : realRm(p, opts)));
    await o.put(c); // recovers first: a new segment
    expect((await segments(dir)).length, 'the old segment is still there').toBe(2);
    expect(ids((await readOutbox(dir)).pending)).toEqual(ids([a, c]));
    await closed(o);
    vi.mocked(fs.rm).mockRestore();
    const again = await openOutbox(dir);
    expect(ids(again.pending())).toEqual(ids([a, c]));
    expect(lines.some((l) => l.level === 50 && /could not cut off a failed write/.test(l.msg)), 'the residual case is logged').toBe(true);
  });
});

describe('a failing outbox', () => {
  it('tries again on its own and tells its watchers once when writes fail and once when they work; one error line', async () => {
    const dir = await tmpDir();
    const disk = faultyDisk(dir);
    const { log, lines } = captured();
    const o = await openOutbox(dir, { log, retryMs: 20 });
    const a = entry();
    await o.put(a);
    disk.full = true;
    const heard: string[] = [];
    let working!: () => void;
    const works = new Promise<void>((r) => (working = r));
    o.watch((failure) => {
      heard.push(failure ? `failing: ${(failure as NodeJS.ErrnoException).code}` : 'working');
      if (!failure) working();
    });
    const rejected = (p: Promise<void>) => p.catch((err: NodeJS.ErrnoException) => void heard.push(`rejected: ${err.code}`));
    await Promise.all([rejected(o.put(entry())), rejected(o.put(entry()))]);
    expect(heard, 'told before the puts are rejected').toEqual(['failing: ENOSPC', 'rejected: ENOSPC', 'rejected: ENOSPC']);
    expect(o.failure).toMatchObject({ code: 'ENOSPC' });
    await rejected(o.put(entry())); // while failing: tried again first, then rejected
    expect(heard, 'told once').toHaveLength(4);
    disk.full = false;
    await works; // no put: the outbox's own retry
    expect(heard.slice(4)).toEqual(['working']);
    expect(o.failure).toBeUndefined();
    const b = entry();
    await o.put(b);
    expect(ids(o.pending())).toEqual(ids([a, b]));
    expect(lines.filter((l) => l.level >= 50).map((l) => l.msg)).toEqual([expect.stringMatching(/^outbox write failed/)]);
    expect(lines.filter((l) => l.level === 30 && /writes work again/.test(l.msg))).toHaveLength(1);
    await closed(o);
    expect(ids((await readOutbox(dir)).pending)).toEqual(ids([a, b]));
  });

  it('recovers after a try whose directory sync failed: that try leaves no segment behind', async () => {
    const dir = await tmpDir();
    const disk = faultyDisk(dir);
    const o = await openOutbox(dir);
    const a = entry();
    await o.put(a);
    disk.full = true;
    await expect(o.put(entry())).rejects.toMatchObject({ code: 'ENOSPC' });
    disk.full = false;
    disk.dirSyncFails = true;
    await expect(o.put(entry())).rejects.toMatchObject({ code: 'ENOSPC' });
    expect(await segments(dir)).toEqual([segmentName(1)]);
    disk.dirSyncFails = false;
    const b = entry();
    await o.put(b);
    expect(ids((await readOutbox(dir)).pending)).toEqual(ids([a, b]));
  });
});

describe('an agent whose outbox cannot be written', () => {
  it('takes no work until a write works again, gives the lost attempt back, and its report never comes back', async () => {
    const dir = await tmpDir();
    const disk = faultyDisk(dir);
    // A fake coordinator: renews what is started, records what the agent sends.
    const received: Array<Record<string, any>> = [];
    const waiting: Array<{ test: (m: Record<string, any>) => boolean; resolve: () => void }> = [];
    const receivedOne = (test: (m: Record<string, any>) => boolean) => new Promise<void>((resolve) => waiting.push({ test, resolve }));
    let call!: grpc.ServerDuplexStream<any, any>;
    const ttl = { seconds: 30 };
    const assign = (attemptId: string, n: number) => ({
      assign: { jobs: [{ job: { id: randomUUID(), queue: 'q', payload: { fields: { n: { numberValue: n } } }, attemptNo: 1 }, attemptId, attemptNo: 1, claimDeadline: { seconds: Math.floor(Date.now() / 1000) + 30 } }] },
    });
    const [a1, a2] = [randomUUID(), randomUUID()];
    const server = new grpc.Server();
    servers.push(server);
    server.addService(services.AgentService!.service, {
      connect(c: grpc.ServerDuplexStream<any, any>) {
        call = c;
        c.on('data', (m: Record<string, any>) => {
          received.push(m);
          if (m.kind === 'hello') {
            c.write({ welcome: { sessionId: 's', leaseTtl: ttl, heartbeatInterval: { seconds: 10 }, creditWithReports: true } });
            c.write(assign(a1, 1));
          }
          if (m.kind === 'started') c.write({ renewed: { attemptIds: m.started.attemptIds, leaseTtl: ttl, seq: m.started.seq } });
          for (const w of waiting.filter((x) => x.test(m))) {
            waiting.splice(waiting.indexOf(w), 1);
            w.resolve();
          }
        });
        c.on('error', () => undefined);
      },
    });
    const port = await new Promise<number>((resolve, reject) =>
      server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (err, p) => (err ? reject(err) : resolve(p))),
    );
    const { log, lines } = captured();
    const agent = createAgent({ url: `http://127.0.0.1:${port}`, token: 't', queues: ['q'], slots: 1, outboxDir: dir, handleSignals: false, log });
    agents.push(agent);
    agent.handle('q', (job) => ({ n: job.payload.n }));
    const events: string[] = [];
    agent.on('outboxFailing', ({ error }) => events.push(`failing: ${(error as NodeJS.ErrnoException).code}`));
    agent.on('outboxRecovered', () => events.push('recovered'));
    await agent.open();
    disk.eio = true; // the report reaches the file, and its write fails
    const finished = once(agent, 'finished');
    await agent.start();
    await finished;
    // The coordinator assigns another job (credit given before, or a new session's Hello), and
    // renews a1, which the agent no longer holds: it is given back as a retryable failure. What
    // the agent sent before that answer is all in when it comes (one ordered stream).
    const givenBack = receivedOne((m) => m.kind === 'failed' && m.failed.failures.some((f: any) => f.attemptId === a1));
    call.write(assign(a2, 2));
    call.write({ renewed: { attemptIds: [a1], leaseTtl: ttl } });
    await givenBack;
    const failed = received.find((m) => m.kind === 'failed')!;
    expect(failed.failed.failures).toEqual([expect.objectContaining({ attemptId: a1, retryable: true })]);
    expect(received.filter((m) => m.kind === 'completed'), 'the lost report').toEqual([]);
    expect(received.filter((m) => m.kind === 'credit'), 'slots given back while the outbox fails').toEqual([]);
    expect(received.filter((m) => m.kind === 'started').flatMap((m) => m.started.attemptIds), 'jobs started while the outbox fails').toEqual([a1]);
    expect(events).toEqual(['failing: EIO']);

    // Writes work again: found by the outbox's own retry, the withheld slots are given back.
    const credit = receivedOne((m) => m.kind === 'credit');
    disk.eio = false;
    await credit;
    expect(events).toEqual(['failing: EIO', 'recovered']);
    expect(received.filter((m) => m.kind === 'credit').map((m) => m.credit.n)).toEqual([2]); // a1's slot, a2 declined
    expect(lines.filter((l) => l.level >= 50).map((l) => l.msg), 'one error line for the episode').toEqual([expect.stringMatching(/^outbox write failed/)]);
    expect(lines.some((l) => l.level === 30 && /taking work again/.test(l.msg))).toBe(true);

    await agent.stop();
    expect((await readOutbox(dir)).pending, "a1's result, reported as lost and given back").toEqual([]);
  });
});
