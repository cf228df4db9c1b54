/**
 * The agent SDK's outbox on its own, against the real file system: group commit, reopening,
 * torn and corrupt records, compaction (also one cut short by a crash), the import of the
 * one-file-per-entry format, the directory lock, and a writer process SIGKILLed at random
 * moments that loses nothing it was told was durable.
 */
import { spawn } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { appendFile, mkdtemp, readdir, readFile, rm, stat, utimes, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { createInterface } from 'node:readline';
import pino, { type Logger } from 'pino';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { Outbox, readOutbox, type OutboxEntry } from '@leasehold/agent-client';
import { encodeRecord, segmentName } from '../agent-client/src/outbox-log.js';
import { outboxKeeper } from './helpers/outbox.js';
import { ACK_LINGER_MS } from '../agent-client/src/outbox.js';

const root = path.resolve(import.meta.dirname, '..');
const dirs: string[] = [];
const outboxes = outboxKeeper();

async function tmpDir(): Promise<string> {
  const d = await mkdtemp(path.join(os.tmpdir(), 'leasehold-outbox-unit-'));
  dirs.push(d);
  return d;
}
/** A logger that keeps its lines, to check what was warned about. */
function captured(): { log: Logger; lines: Array<{ level: number; msg: string }> } {
  const lines: Array<{ level: number; msg: string }> = [];
  return { log: pino({ level: 'debug' }, { write: (s: string) => lines.push(JSON.parse(s) as { level: number; msg: string }) }), lines };
}
const openOutbox = (dir: string, opts: { log?: Logger; compactBytes?: number } = {}) =>
  outboxes.open(dir, opts.log, opts.compactBytes ? { compactBytes: opts.compactBytes } : {});
const closed = outboxes.closed;
let clock = Date.parse('2030-01-01T00:00:00Z');
function entry(extra: Partial<OutboxEntry> = {}): OutboxEntry {
  const attemptId = randomUUID();
  return { attemptId, jobId: randomUUID(), queue: 'q', attemptNo: 1, kind: 'completed', result: { id: attemptId }, writtenAt: new Date(clock++).toISOString(), ...extra };
}
const ids = (es: OutboxEntry[]) => es.map((e) => e.attemptId).sort();
const segments = async (dir: string) => (await readdir(dir)).filter((n) => /^outbox-\d+\.log$/.test(n)).sort();

afterEach(async () => {
  await outboxes.closeAll();
});
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

describe('Outbox', () => {
  it('coalesces concurrent puts: one write and one fdatasync per flush, each put resolving after its sync', async () => {
    const o = await openOutbox(await tmpDir());
    const before = { ...o.stats };
    const es = Array.from({ length: 100 }, () => entry());
    const order: string[] = [];
    await Promise.all(
      es.map(async (e) => {
        await o.put(e);
        // Resolved only once durable: the sync that covers it has been counted.
        expect(o.stats.fsyncs).toBeGreaterThan(before.fsyncs);
        expect(o.has(e.attemptId)).toBe(true);
        order.push(e.attemptId);
      }),
    );
    const fsyncs = o.stats.fsyncs - before.fsyncs;
    expect(fsyncs).toBeGreaterThanOrEqual(1);
    expect(fsyncs).toBeLessThanOrEqual(5);
    expect(o.stats.writes - before.writes).toBe(fsyncs);
    expect(order).toHaveLength(100);
    // Acks wait for the next flush: no write of their own, and the put after them carries them.
    const writes = o.stats.writes;
    const acked = Promise.all(es.slice(0, 50).map((e) => o.remove(e.attemptId)));
    await new Promise((r) => setImmediate(r));
    expect(o.stats.writes).toBe(writes);
    const next = entry();
    await Promise.all([acked, o.put(next)]);
    expect(o.stats.writes).toBe(writes + 1);
    expect(o.pending()).toHaveLength(51);
  });

  it('writes acknowledgements on their own after ACK_LINGER_MS when no put comes, in one write', async () => {
    const dir = await tmpDir();
    const o = await openOutbox(dir);
    const es = Array.from({ length: 10 }, () => entry());
    await Promise.all(es.map((e) => o.put(e)));
    const writes = o.stats.writes;
    const t0 = performance.now();
    await Promise.all(es.slice(0, 4).map((e) => o.remove(e.attemptId)));
    expect(performance.now() - t0).toBeGreaterThanOrEqual(ACK_LINGER_MS - 1);
    expect(o.stats.writes).toBe(writes + 1);
    // Written (a crash now would not bring them back), before any close.
    expect(ids((await readOutbox(dir)).pending)).toEqual(ids(es.slice(4)));
  });

  it('returns what was put after a reopen, oldest first, and forgets what was removed or superseded', async () => {
    const dir = await tmpDir();
    const o = await openOutbox(dir);
    const [a, b, c, d] = [entry(), entry({ kind: 'failed', error: { message: 'boom', details: { code: 7 } }, retryable: false, result: undefined }), entry(), entry()];
    for (const e of [a!, b!, c!, d!]) await o.put(e);
    await o.remove(a!.attemptId);
    await o.supersede(c!.attemptId, 'STALE');
    expect(ids(o.pending())).toEqual(ids([b!, d!]));
    // Without a close (as after a crash) the records are already in the file.
    expect((await readOutbox(dir)).pending.map((e) => e.attemptId)).toEqual([b!.attemptId, d!.attemptId]);
    await closed(o);

    const again = await openOutbox(dir);
    expect(again.pending()).toEqual([JSON.parse(JSON.stringify(b)), d]);
    expect(again.has(a!.attemptId)).toBe(false);
    const { superseded } = await readOutbox(dir);
    expect(superseded).toEqual([{ ...c, supersededAt: expect.any(String), reason: 'STALE' }]);
    // A put of an attempt already there replaces it (a refused result becomes a failure).
    await again.put({ ...d!, kind: 'failed', result: undefined, error: { message: 'result refused' }, retryable: false });
    await closed(again);
    expect((await readOutbox(dir)).pending.map((e) => [e.attemptId, e.kind])).toEqual([
      [b!.attemptId, 'failed'],
      [d!.attemptId, 'failed'],
    ]);
  });

  it('ignores a torn tail and cuts it off, then appends after the last good record', async () => {
    const dir = await tmpDir();
    const o = await openOutbox(dir);
    const es = [entry(), entry()];
    for (const e of es) await o.put(e);
    await closed(o);
    const [seg] = await segments(dir);
    const file = path.join(dir, seg!);
    const good = (await stat(file)).size;
    for (const tail of [encodeRecord({ t: 'put', e: entry() }).subarray(0, 40), Buffer.alloc(300), Buffer.from('garbage\nmore garbage')]) {
      await appendFile(file, tail);
      const { log, lines } = captured();
      const again = await openOutbox(dir, { log });
      expect(ids(again.pending())).toEqual(ids(es));
      expect(lines.some((l) => l.level === 40 && /torn by a crash/.test(l.msg))).toBe(true);
      expect((await stat(file)).size).toBe(good);
      await closed(again);
    }
    const again = await openOutbox(dir);
    const third = entry();
    await again.put(third);
    await closed(again);
    expect(ids((await readOutbox(dir)).pending)).toEqual(ids([...es, third]));
  });

  it('skips a corrupt record in the middle and keeps the records after it', async () => {
    const dir = await tmpDir();
    const o = await openOutbox(dir);
    const [a, b, c] = [entry(), entry(), entry()];
    for (const e of [a!, b!, c!]) await o.put(e);
    await o.remove(c!.attemptId);
    await closed(o);
    const file = path.join(dir, (await segments(dir))[0]!);
    const text = await readFile(file, 'utf8');
    // One byte of b's record changes: its checksum no longer matches.
    await writeFile(file, text.replace(b!.jobId, b!.jobId.replace(/^./, (ch) => (ch === '0' ? '1' : '0'))));
    const { log, lines } = captured();
    const again = await openOutbox(dir, { log });
    expect(ids(again.pending())).toEqual([a!.attemptId]); // c's ack after the bad line still counts
    expect(lines.some((l) => l.level === 50 && /corrupt records in the middle/.test(l.msg))).toBe(true);
  });

  it('loses the record after a damaged line too when the damage covers the newline between them (as the README says)', async () => {
    const dir = await tmpDir();
    const o = await openOutbox(dir);
    const [a, b, c] = [entry(), entry(), entry()];
    for (const e of [a!, b!, c!]) await o.put(e);
    await closed(o);
    const file = path.join(dir, (await segments(dir))[0]!);
    const buf = await readFile(file);
    buf[buf.indexOf(0x0a)] = 0x78; // a's newline becomes 'x': a's line and b's read as one bad line
    await writeFile(file, buf);
    const again = await openOutbox(dir);
    expect(ids(again.pending())).toEqual([c!.attemptId]);
  });

  it('compacts: a new segment holds exactly the live entries, the old one is gone, a reopen sees the same', async () => {
    const dir = await tmpDir();
    const o = await openOutbox(dir, { compactBytes: 8 * 1024 });
    const es = Array.from({ length: 200 }, () => entry({ result: { pad: 'x'.repeat(100) } }));
    const keep = new Set(es.filter((_, i) => i % 20 === 0).map((e) => e.attemptId));
    const superseded = es.filter((_, i) => i % 20 === 1);
    for (let i = 0; i < es.length; i += 25) {
      const batch = es.slice(i, i + 25);
      await Promise.all(batch.map((e) => o.put(e)));
      await Promise.all(batch.filter((e) => !keep.has(e.attemptId)).map((e) => (superseded.includes(e) ? o.supersede(e.attemptId) : o.remove(e.attemptId))));
    }
    await o.put(entry()).then((): void => undefined); // one more flush after the last acks
    expect(o.stats.compactions).toBeGreaterThanOrEqual(1);
    const segs = await segments(dir);
    expect(segs).toHaveLength(1);
    expect(segs[0]).not.toBe(segmentName(1));
    expect((await stat(path.join(dir, segs[0]!))).size).toBeLessThan(24 * 1024);
    const live = ids(o.pending());
    expect(live).toHaveLength(keep.size + 1);
    await closed(o);
    const again = await openOutbox(dir, { compactBytes: 8 * 1024 });
    expect(ids(again.pending())).toEqual(live);
    expect(ids((await readOutbox(dir)).superseded)).toEqual(ids(superseded));
  });

  it('recovers from a compaction cut short: old and new segments are merged, later records winning', async () => {
    const dir = await tmpDir();
    const [a, b, c, d] = [entry(), entry(), entry(), entry()];
    const line = (r: Parameters<typeof encodeRecord>[0]) => encodeRecord(r);
    // Segment 1: a, b, c put, b acknowledged. Segment 2, being written when the crash came:
    // a copied, c's copy torn halfway.
    await writeFile(path.join(dir, segmentName(1)), Buffer.concat([line({ t: 'put', e: a! }), line({ t: 'put', e: b! }), line({ t: 'put', e: c! }), line({ t: 'ack', id: b!.attemptId })]));
    const cCopy = line({ t: 'put', e: c! });
    await writeFile(path.join(dir, segmentName(2)), Buffer.concat([line({ t: 'put', e: a! }), cCopy.subarray(0, cCopy.length - 10)]));
    const o = await openOutbox(dir);
    expect(ids(o.pending())).toEqual(ids([a!, c!]));
    expect(await segments(dir)).toEqual([segmentName(3)]);
    await o.put(d!);
    await closed(o);
    expect(ids((await readOutbox(dir)).pending)).toEqual(ids([a!, c!, d!]));
  });

  it('imports a directory of the one-file-per-entry format, durably, then removes its files', async () => {
    const dir = await tmpDir();
    const [a, b, s] = [entry(), entry({ kind: 'failed', result: undefined, error: { message: 'x' }, retryable: true }), entry()];
    await writeFile(path.join(dir, `${a!.attemptId}.json`), JSON.stringify(a));
    await writeFile(path.join(dir, `${b!.attemptId}.json`), JSON.stringify(b));
    await writeFile(path.join(dir, `${s!.attemptId}.superseded.json`), JSON.stringify(s));
    const torn = `${randomUUID()}.json.tmp-123-4`;
    await writeFile(path.join(dir, torn), '{"attemptId":"1111');
    const bad = `${randomUUID()}.json`;
    await writeFile(path.join(dir, bad), '{"attemptId":');
    // The read-only view understands the old format too.
    expect(ids((await readOutbox(dir)).pending)).toEqual(ids([a!, b!]));

    const o = await openOutbox(dir);
    expect(ids(o.pending())).toEqual(ids([a!, b!]));
    expect((await readdir(dir)).sort()).toEqual([`${bad}.corrupt`, 'outbox.format', 'outbox.lock', 'outbox.reserve', segmentName(1), 'superseded.jsonl'].sort());
    await o.remove(a!.attemptId);
    await closed(o);
    const view = await readOutbox(dir);
    expect(view.pending).toEqual([b]);
    expect(view.superseded).toEqual([{ ...s, supersededAt: expect.any(String) }]);
    const again = await openOutbox(dir);
    expect(again.pending()).toEqual([b]);
  });

  it('is used by one process at a time: a live holder is refused, a dead or silent one taken over', async () => {
    const dir = await tmpDir();
    const o = await openOutbox(dir);
    await expect(new Outbox(dir, pino({ level: 'silent' })).open()).rejects.toThrow(/already open in this process/);
    await closed(o);
    const lock = path.join(dir, 'outbox.lock');
    // Another live process (our parent) holds it.
    await writeFile(lock, JSON.stringify({ pid: process.ppid }));
    await expect(new Outbox(dir, pino({ level: 'silent' })).open()).rejects.toThrow(new RegExp(`in use by process ${process.ppid}.*delete the lock file`));
    // The same pid, silent for two minutes (a reboot gave its pid to some other program).
    const old = new Date(Date.now() - 120_000);
    await utimes(lock, old, old);
    await closed(await openOutbox(dir));
    // A process that has exited.
    const gone = spawn(process.execPath, ['-e', '0']);
    await new Promise((r) => gone.on('exit', r));
    await writeFile(lock, JSON.stringify({ pid: gone.pid }));
    const taken = await openOutbox(dir);
    expect(JSON.parse(await readFile(lock, 'utf8'))).toMatchObject({ pid: process.pid });
    await closed(taken);
    expect((await readdir(dir)).includes('outbox.lock')).toBe(false);
  });
});

describe('Outbox under SIGKILL', () => {
  it('keeps every entry whose put resolved and forgets every acknowledged one, across 25 kills at random moments', async () => {
    const dir = await tmpDir();
    // What the writer was told: P put resolved (must be there), R/Q ack/supersede asked (either
    // way), A/S acked/superseded (must be gone; superseded ones in superseded.jsonl).
    type State = 'live' | 'acking' | 'superseding' | 'acked' | 'superseded';
    const states: Record<string, State> = { P: 'live', R: 'acking', Q: 'superseding', A: 'acked', S: 'superseded' };
    const state = new Map<string, State>();
    let puts = 0;
    let maxSegment = 0;
    for (let k = 0; k < 25; k++) {
      const child = spawn(process.execPath, ['--import', 'tsx', 'test/fixtures/outbox-writer.ts', dir], { cwd: root, stdio: ['ignore', 'pipe', 'inherit'] });
      // 'close', not 'exit': every line the child printed has been read by then.
      const exited = new Promise((r) => child.on('close', r));
      // Killed at a random moment: every other life from its open (a kill may land in the open's
      // consolidation or the acks of what the last life left), the others after their first 50
      // resolved puts, so that compactions happen (~20 kB a life against compactBytes 16 kB)
      // however slow the machine is.
      const early = k % 2 === 0;
      let warmed!: () => void;
      const ready = new Promise<void>((r) => (warmed = r));
      let mine = 0;
      createInterface({ input: child.stdout! }).on('line', (l) => {
        if (early && l.startsWith('OPEN ')) warmed();
        const m = /^([PRQAS]) ([0-9a-f-]{36})$/.exec(l);
        if (!m) return;
        if (m[1] === 'P') {
          puts++;
          if (++mine === 50 && !early) warmed();
        }
        state.set(m[2]!, states[m[1]!]!);
      });
      await ready;
      await new Promise((r) => setTimeout(r, Math.random() * 300));
      child.kill('SIGKILL');
      await exited;
      for (const n of await segments(dir)) maxSegment = Math.max(maxSegment, Number(/\d+/.exec(n)![0]));

      const o = await openOutbox(dir); // the dead child's lock is taken over
      const pending = o.pending();
      const here = new Set(pending.map((e) => e.attemptId));
      expect(here.size).toBe(pending.length);
      for (const e of pending) expect(e.result).toMatchObject({ id: e.attemptId }); // whole, not mixed up
      await closed(o);
      const sup = (await readOutbox(dir)).superseded.map((e) => e.attemptId);
      expect(new Set(sup).size, 'an entry set aside twice').toBe(sup.length);
      for (const [id, s] of state) {
        if (s === 'live') expect(here.has(id), `put of ${id} resolved, entry lost`).toBe(true);
        if (s === 'acked' || s === 'superseded') expect(here.has(id), `${id} was ${s}, entry back`).toBe(false);
        if (s === 'superseded' || (s === 'superseding' && !here.has(id))) expect(sup, `${id} set aside but not kept`).toContain(id);
      }
      // Settle the in-between states as the next run will see them.
      for (const [id, s] of state) if (s === 'acking' || s === 'superseding') state.set(id, here.has(id) ? 'live' : s === 'acking' ? 'acked' : 'superseded');
      // Put but not yet reported as resolved: may be there (nobody was told); then it stays.
      for (const id of here) if (!state.has(id)) state.set(id, 'live');
    }
    console.log(`outbox SIGKILL test: ${puts} resolved puts over 25 kills, ${[...state.values()].filter((s) => s === 'live').length} live at the end, segments reached ${maxSegment}`);
    expect(puts).toBeGreaterThan(100);
    expect(maxSegment).toBeGreaterThan(50); // compactions happened (not only at opens)
  }, 120_000);
});
