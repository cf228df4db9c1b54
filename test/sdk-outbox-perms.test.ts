/**
 * The agent SDK's outbox is readable by the agent's user only: reports hold whatever handlers
 * return. Its directory is 0700 and every file in it 0600 under the usual umask (022), one found
 * open to other users is tightened with a warning, and one that cannot be tightened still opens.
 * Mode bits mean little on Windows: not checked there.
 */
import { randomUUID } from 'node:crypto';
import fs, { chmod, mkdir, mkdtemp, readdir, rm, stat } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pino, { type Logger } from 'pino';
import { afterAll, afterEach, beforeAll, describe, expect, it, vi } from 'vitest';
import { readOutbox, type OutboxEntry } from '@leasehold/agent-client';
import { outboxKeeper } from './helpers/outbox.js';

const dirs: string[] = [];
const outboxes = outboxKeeper();
let umask = 0;

beforeAll(() => {
  // The usual umask, whatever this machine's is: the outbox must not rely on a strict one.
  umask = process.umask(0o022);
});
afterEach(async () => {
  vi.restoreAllMocks();
  await outboxes.closeAll();
});
afterAll(async () => {
  process.umask(umask);
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

async function tmpDir(): Promise<string> {
  const d = await mkdtemp(path.join(os.tmpdir(), 'leasehold-outbox-perms-'));
  dirs.push(d);
  return d;
}
type Line = { level: number; msg: string; dir?: string; mode?: string };
function captured(): { log: Logger; lines: Line[] } {
  const lines: Line[] = [];
  return { log: pino({ level: 'debug' }, { write: (s: string) => lines.push(JSON.parse(s) as Line) }), lines };
}
function entry(): OutboxEntry {
  const attemptId = randomUUID();
  return { attemptId, jobId: randomUUID(), queue: 'q', attemptNo: 1, kind: 'completed', result: { apiPassword: 'hunter2' }, writtenAt: new Date().toISOString() };
}
const mode = async (file: string) => ((await stat(file)).mode & 0o777).toString(8);
/** Every name in `dir` with its mode, e.g. `{ 'outbox.lock': '600' }`. */
async function modes(dir: string): Promise<Record<string, string>> {
  const out: Record<string, string> = {};
  for (const name of (await readdir(dir)).sort()) out[name] = await mode(path.join(dir, name));
  return out;
}
const warnings = (lines: Line[]) => lines.filter((l) => l.level === 40);
const SEGMENT = /^outbox-\d+\.log$/;

describe.skipIf(process.platform === 'win32')('outbox permissions', () => {
  it('makes its directory 0700 and every file in it 0600', async () => {
    const dir = path.join(await tmpDir(), 'agent', 'outbox');
    const { log, lines } = captured();
    const o = await outboxes.open(dir, log, { reserveBytes: 4096, compactBytes: 1024 });
    const es = Array.from({ length: 8 }, entry);
    for (const e of es) await o.put(e);
    for (const e of es.slice(0, 6)) await o.remove(e.attemptId);
    await o.supersede(es[6]!.attemptId, 'stale');
    // A put after the acks: its flush carries them, and the compaction they allow starts a segment.
    await o.put(entry());
    expect(o.stats.compactions).toBeGreaterThan(1);

    expect(await mode(dir)).toBe('700');
    const m = await modes(dir);
    expect(Object.keys(m).filter((n) => !SEGMENT.test(n))).toEqual(['outbox.format', 'outbox.lock', 'outbox.reserve', 'superseded.jsonl']);
    expect(Object.keys(m).some((n) => SEGMENT.test(n))).toBe(true);
    expect(new Set(Object.values(m))).toEqual(new Set(['600']));
    // A new directory is no news.
    expect(warnings(lines)).toEqual([]);
  });

  it('makes an existing directory open to others 0700, with one warning naming it', async () => {
    const dir = path.join(await tmpDir(), 'outbox');
    await mkdir(dir);
    await chmod(dir, 0o755);
    const { log, lines } = captured();
    const o = await outboxes.open(dir, log, { reserveBytes: 4096 });
    await o.put(entry());

    expect(await mode(dir)).toBe('700');
    expect(warnings(lines)).toEqual([expect.objectContaining({ dir, mode: '0755', msg: expect.stringMatching(/^outbox: its directory was open to other users: made it 0700/) })]);
    expect(Object.values(await modes(dir))).toEqual(['600', '600', '600', '600']);

    // Opened again: nothing to say.
    await outboxes.closed(o);
    const again = captured();
    await outboxes.open(dir, again.log, { reserveBytes: 4096 });
    expect(warnings(again.lines)).toEqual([]);
  });

  it('opens a directory it cannot tighten (another user owns it), and warns that it could not', async () => {
    const dir = path.join(await tmpDir(), 'outbox');
    await mkdir(dir);
    await chmod(dir, 0o750);
    vi.spyOn(fs, 'chmod').mockRejectedValueOnce(Object.assign(new Error(`EPERM: operation not permitted, chmod '${dir}'`), { code: 'EPERM' }));
    const { log, lines } = captured();
    const o = await outboxes.open(dir, log, { reserveBytes: 4096 });
    const e = entry();
    await o.put(e);

    expect(await mode(dir)).toBe('750');
    expect(warnings(lines)).toEqual([expect.objectContaining({ dir, mode: '0750', msg: expect.stringMatching(/could not be made 0700/) })]);
    expect((await readOutbox(dir)).pending.map((x) => x.attemptId)).toEqual([e.attemptId]);
  });

  it('makes a directory deleted while it runs 0700 again, its files 0600', async () => {
    const dir = path.join(await tmpDir(), 'outbox');
    const o = await outboxes.open(dir, pino({ level: 'silent' }), { checkMs: 100, reserveBytes: 4096 });
    const e = entry();
    await o.put(e);
    await rm(dir, { recursive: true, force: true });
    // Made again by the next check: the lock, the format, a segment with the report, the reserve.
    await vi.waitFor(async () => expect((await readdir(dir).catch(() => [])).filter((n) => !SEGMENT.test(n)).sort()).toEqual(['outbox.format', 'outbox.lock', 'outbox.reserve']), { timeout: 5000, interval: 50 });

    expect(await mode(dir)).toBe('700');
    expect(Object.values(await modes(dir))).toEqual(['600', '600', '600', '600']);
    expect((await readOutbox(dir)).pending.map((x) => x.attemptId)).toEqual([e.attemptId]);
  });
});
