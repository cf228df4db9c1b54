/**
 * The agent SDK facing what a newer release wrote or sent (review of version skew, findings 2 and
 * 4): an outbox whose `outbox.format` is above the one it knows is refused, with the directory and
 * both formats named (the runner exits 1 with that line), and one without the file is format 2
 * and gets it; a checksummed log record of an unknown type is kept, never cut off as a torn tail,
 * skipped with one warning, and the outbox is not compacted while it is there; an Ack outcome it does not know keeps the
 * report for the next session instead of setting it aside; a server message kind it does not know
 * is logged once per kind per stream. No coordinator.
 */
import { execFile } from 'node:child_process';
import { EventEmitter } from 'node:events';
import { existsSync } from 'node:fs';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { create, fromBinary } from '@bufbuild/protobuf';
import pino from 'pino';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { createAgent, Outbox, readOutbox, type OutboxEntry } from '@leasehold/agent-client';
import { Acks } from '../agent-client/src/acks.js';
import type { AgentEvents } from '../agent-client/src/events.js';
import { ServerMessage_Ack_ItemSchema, ServerMessageSchema, type ServerMessage } from '../agent-client/src/gen/leasehold/v1/agent_service_pb.js';
import { Outcome } from '../agent-client/src/gen/leasehold/v1/job_pb.js';
import { crc32, encodeRecord, scanSegment, segmentName } from '../agent-client/src/outbox-log.js';

/** Spelled out: the test must read the same without the fix. */
const FORMAT_FILE = 'outbox.format';

const root = path.resolve(import.meta.dirname, '..');
const ID = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;
const completed = (n: number): OutboxEntry => ({ attemptId: ID(n), jobId: `j${n}`, queue: 'q', attemptNo: 1, kind: 'completed', result: { n }, writtenAt: new Date(Date.UTC(2026, 11, 6, 0, 0, n)).toISOString() });
type Line = Record<string, unknown>;
const logTo = (lines: Line[]) => pino({ level: 'debug' }, { write: (l: string) => void lines.push(JSON.parse(l) as Line) });

const dirs: string[] = [];
const opened: Outbox[] = [];
async function tmp(): Promise<string> {
  const dir = await fs.mkdtemp(path.join(os.tmpdir(), 'leasehold-skew-'));
  dirs.push(dir);
  return dir;
}
async function openOutbox(dir: string, lines: Line[] = [], compactBytes?: number): Promise<Outbox> {
  const o = new Outbox(dir, logTo(lines), { reserveBytes: 0, ...(compactBytes ? { compactBytes } : {}) });
  await o.open();
  opened.push(o);
  return o;
}
/** A line as a later SDK would write it: any JSON, with its checksum and length. */
function futureLine(record: unknown): Buffer {
  const json = Buffer.from(JSON.stringify(record), 'utf8');
  return Buffer.concat([Buffer.from(`${crc32(json).toString(16).padStart(8, '0')} ${json.length} `, 'latin1'), json, Buffer.from('\n')]);
}

afterEach(async () => {
  for (const o of opened.splice(0)) await o.close();
});
afterAll(async () => {
  for (const d of dirs) await fs.rm(d, { recursive: true, force: true });
});

describe('outbox format', () => {
  it('a new outbox gets outbox.format (format 2); a log-era outbox without it is format 2, opened and given it', async () => {
    const fresh = await tmp();
    await (await openOutbox(fresh)).close();
    expect(JSON.parse(await fs.readFile(path.join(fresh, FORMAT_FILE), 'utf8'))).toEqual({ format: 2, minReader: 2 });

    const old = await tmp();
    await fs.writeFile(path.join(old, segmentName(1)), encodeRecord({ t: 'put', e: completed(1) }));
    const o = await openOutbox(old);
    expect(o.pending().map((e) => e.attemptId)).toEqual([ID(1)]);
    expect(JSON.parse(await fs.readFile(path.join(old, FORMAT_FILE), 'utf8'))).toMatchObject({ format: 2 });
  });

  it('refuses an outbox of a newer format, naming the directory and both formats, without changing it; the runner exits 1 with that line', async () => {
    const dir = await tmp();
    const seg = Buffer.concat([encodeRecord({ t: 'put', e: completed(1) }), futureLine({ t: 'put3', x: 1 }), Buffer.from('torn')]);
    await fs.writeFile(path.join(dir, segmentName(1)), seg);
    await fs.writeFile(path.join(dir, FORMAT_FILE), '{"format":3}\n');
    const before = (await fs.readdir(dir)).sort();

    const refusal = new Outbox(dir, pino({ level: 'silent' })).open();
    await expect(refusal).rejects.toThrow(`outbox ${dir} was written by a newer agent: it holds outbox format 3`);
    await expect(refusal).rejects.toThrow(/knows formats up to 2.*Start the newer agent to flush it.*or move the directory away/);
    expect((await fs.readdir(dir)).sort(), 'no lock, no reserve, no new segment left behind').toEqual(before);
    expect(await fs.readFile(path.join(dir, segmentName(1)))).toEqual(seg);
    await expect(readOutbox(dir), '--check reads the outbox with readOutbox').rejects.toThrow('written by a newer agent');

    // Readable by this SDK by the newer one's own word: opened, the file left as it is.
    await fs.writeFile(path.join(dir, FORMAT_FILE), '{"format":3,"minReader":2}\n');
    const o = await openOutbox(dir);
    expect(o.pending().map((e) => e.attemptId)).toEqual([ID(1)]);
    await o.close();
    expect(await fs.readFile(path.join(dir, FORMAT_FILE), 'utf8')).toBe('{"format":3,"minReader":2}\n');

    // The runner: `leasehold-agent` turns the open error into one line and exit code 1.
    await fs.writeFile(path.join(dir, FORMAT_FILE), '{"format":3}\n');
    const config = path.join(dir, '..', `${path.basename(dir)}.json`);
    dirs.push(config);
    await fs.writeFile(config, JSON.stringify({ url: 'http://127.0.0.1:9', token: 't', outboxDir: dir, queues: { q: { command: ['true'] } } }));
    const run = await promisify(execFile)(process.execPath, [path.join(root, 'agent-client/bin/leasehold-agent.mjs'), '--config', config], { cwd: root }).then(
      () => ({ code: 0, stderr: '' }),
      (err: { code: number; stderr: string }) => err,
    );
    expect(run.code).toBe(1);
    expect(run.stderr.trimEnd().split('\n')).toEqual([expect.stringMatching(/^leasehold-agent: outbox .* was written by a newer agent: it holds outbox format 3 .* move the directory away/)]);
  });

  it('refuses an outbox.format that says no format', async () => {
    const dir = await tmp();
    await fs.writeFile(path.join(dir, FORMAT_FILE), 'LHOB3\u0000');
    await expect(new Outbox(dir, pino({ level: 'silent' })).open()).rejects.toThrow(`outbox ${dir}: outbox.format does not say which format`);
  });
});

describe('log records of a later SDK', () => {
  it('keeps a checksummed record of an unknown type at the end of the last segment, skips it with one warning, and never compacts it away', async () => {
    const dir = await tmp();
    const future = futureLine({ t: 'lease', id: ID(9), until: 1 });
    const seg1 = Buffer.concat([encodeRecord({ t: 'put', e: completed(1) }), future, encodeRecord({ t: 'put', e: completed(5) })]);
    const seg2 = Buffer.concat([encodeRecord({ t: 'put', e: completed(2) }), encodeRecord({ t: 'ack', id: ID(5) }), future]);
    await fs.writeFile(path.join(dir, segmentName(1)), seg1);
    await fs.writeFile(path.join(dir, segmentName(2)), seg2);
    const lines: Line[] = [];
    // compactBytes 1: any segment mostly acknowledged would be compacted.
    const o = await openOutbox(dir, lines, 1);
    expect(o.pending().map((e) => e.attemptId)).toEqual([ID(1), ID(2)]);
    expect(await fs.readFile(path.join(dir, segmentName(2))), 'not cut off as a torn tail').toEqual(seg2);
    const warned = lines.filter((l) => l.type === 't=lease');
    expect(warned).toHaveLength(1);
    expect(warned[0]).toMatchObject({ level: 40, records: 2, segments: [segmentName(1), segmentName(2)], msg: expect.stringContaining('does not compact') });
    expect(lines.filter((l) => l.level === 50 || /torn/.test(String(l.msg)))).toEqual([]);

    await o.remove(ID(1));
    for (let n = 10; n < 20; n++) {
      await o.put(completed(n));
      await o.remove(ID(n));
    }
    await o.put(completed(3));
    await o.close();
    // Both segments as written, nothing deleted; past compactBytes (1 here) this SDK starts new
    // segments holding only what it writes (no copy of the live set): read in order, the records
    // are exactly those of one segment appended to.
    expect(await fs.readFile(path.join(dir, segmentName(1)))).toEqual(seg1);
    expect(await fs.readFile(path.join(dir, segmentName(2)))).toEqual(seg2);
    const names = (await fs.readdir(dir)).filter((n) => n.endsWith('.log')).sort();
    expect(names).toEqual(names.map((_, i) => segmentName(i + 1)));
    const records = [];
    for (const n of names.slice(2)) records.push(...(await scanSegment(path.join(dir, n))).records);
    const written = [{ t: 'ack', id: ID(1) }, ...Array.from({ length: 10 }, (_, i) => [{ t: 'put', e: completed(10 + i) }, { t: 'ack', id: ID(10 + i) }]).flat(), { t: 'put', e: completed(3) }];
    expect(records).toEqual(written);
    expect((await readOutbox(dir)).pending.map((e) => e.attemptId)).toEqual([ID(2), ID(3)]);

    // Opened again: the segments are not consolidated either.
    const before = await Promise.all(names.map((n) => fs.readFile(path.join(dir, n))));
    const again = await openOutbox(dir);
    expect(again.pending().map((e) => e.attemptId)).toEqual([ID(2), ID(3)]);
    await again.close();
    expect(await Promise.all(names.map((n) => fs.readFile(path.join(dir, n))))).toEqual(before);
  });

  it('while a record of a later SDK is there, starts a new segment (deleting nothing) each time the current one passes compactBytes: no file grows without bound', async () => {
    const dir = await tmp();
    const seg1 = Buffer.concat([encodeRecord({ t: 'put', e: completed(1) }), futureLine({ t: 'lease', id: ID(9), until: 1 })]);
    await fs.writeFile(path.join(dir, segmentName(1)), seg1);
    const lines: Line[] = [];
    const compactBytes = 16 * 1024;
    const o = await openOutbox(dir, lines, compactBytes);
    expect(lines.find((l) => l.type === 't=lease')).toMatchObject({ msg: expect.stringContaining(`it grows, in new segments of about ${compactBytes} bytes, until a newer agent opens it`) });
    // ~200 KB of reports, one in four kept.
    const pad = 'p'.repeat(2000);
    const kept: string[] = [ID(1)];
    const acks: Promise<void>[] = [];
    for (let n = 100; n < 200; n++) {
      const e = { ...completed(n), result: { n, pad } };
      await o.put(e);
      if (n % 4) acks.push(o.remove(e.attemptId));
      else kept.push(e.attemptId);
    }
    await Promise.all(acks);
    await o.close();
    const names = (await fs.readdir(dir)).filter((n) => n.endsWith('.log')).sort();
    expect(names.length).toBeGreaterThanOrEqual(8);
    expect(names).toEqual(names.map((_, i) => segmentName(i + 1)));
    expect((await fs.readFile(path.join(dir, segmentName(1)))).subarray(0, seg1.length)).toEqual(seg1);
    // A segment ends past compactBytes by at most one flush (one report and an ack here).
    for (const n of names) expect((await fs.stat(path.join(dir, n))).size).toBeLessThan(compactBytes + 3000);
    expect((await readOutbox(dir)).pending.map((e) => e.attemptId)).toEqual(kept);
    expect(lines.filter((l) => Number(l.level) >= 50)).toEqual([]);

    const again = await openOutbox(dir, [], compactBytes);
    expect(again.pending().map((e) => e.attemptId)).toEqual(kept);
    const more = completed(300);
    await again.put(more);
    await again.close();
    expect((await readOutbox(dir)).pending.map((e) => e.attemptId)).toEqual([...kept, more.attemptId]);
  });

  it('compacts again once its directory, and the records of the later SDK with it, was deleted and made again', async () => {
    const dir = await tmp();
    await fs.writeFile(path.join(dir, segmentName(1)), Buffer.concat([encodeRecord({ t: 'put', e: completed(1) }), futureLine({ t: 'lease', id: ID(9), until: 1 })]));
    const o = new Outbox(dir, pino({ level: 'silent' }), { reserveBytes: 0, compactBytes: 4096, checkMs: 50 });
    await o.open();
    opened.push(o);
    await fs.rm(dir, { recursive: true, force: true });
    const start = Date.now();
    while (!(await readOutbox(dir)).pending.length) {
      if (Date.now() - start > 5000) throw new Error('not made again');
      await new Promise((r) => setTimeout(r, 20));
    }
    const acks: Promise<void>[] = [];
    for (let n = 100; n < 140; n++) {
      await o.put({ ...completed(n), result: { pad: 'p'.repeat(500) } });
      acks.push(o.remove(ID(n)));
    }
    await Promise.all(acks);
    await o.put(completed(2));
    // Mostly acknowledged and past compactBytes: compacted, the old segments deleted.
    const logs = (await fs.readdir(dir)).filter((n) => n.endsWith('.log'));
    expect(logs).toHaveLength(1);
    expect((await fs.stat(path.join(dir, logs[0]!))).size).toBeLessThan(4096 + 1500);
    expect((await readOutbox(dir)).pending.map((e) => e.attemptId)).toEqual([ID(1), ID(2)]);
  });

  it('does not cut off an unknown record at the end of the only segment as a torn tail', async () => {
    const dir = await tmp();
    const seg = Buffer.concat([encodeRecord({ t: 'put', e: completed(1) }), futureLine({ t: 'hold', id: ID(1) })]);
    await fs.writeFile(path.join(dir, segmentName(1)), seg);
    const o = await openOutbox(dir);
    expect(await fs.readFile(path.join(dir, segmentName(1)))).toEqual(seg);
    await o.put(completed(2));
    await o.close();
    const after = await fs.readFile(path.join(dir, segmentName(1)));
    expect(after.subarray(0, seg.length), 'appended after it').toEqual(seg);
    expect((await readOutbox(dir)).pending.map((e) => e.attemptId)).toEqual([ID(1), ID(2)]);
  });

  it('a put of an unknown kind replaces its attempt’s entry (not sent by this SDK) and is kept; damage is still cut off', async () => {
    const dir = await tmp();
    const later = futureLine({ t: 'put', e: { ...completed(1), kind: 'deferred' } });
    const seg = Buffer.concat([encodeRecord({ t: 'put', e: completed(1) }), encodeRecord({ t: 'put', e: completed(2) }), later]);
    await fs.writeFile(path.join(dir, segmentName(1)), Buffer.concat([seg, Buffer.from('0badc0de 5 {"t":\n')]));
    const lines: Line[] = [];
    const o = await openOutbox(dir, lines);
    expect(o.pending().map((e) => e.attemptId)).toEqual([ID(2)]);
    expect(lines.filter((l) => l.type === 't=put kind="deferred"')).toHaveLength(1);
    await o.close();
    expect(await fs.readFile(path.join(dir, segmentName(1))), 'the damaged line after it is cut, the record kept').toEqual(seg);
  });
});

describe('acks of an outcome this SDK does not know', () => {
  it('keeps the report for the next session, warning once per outcome; known final refusals still set aside', async () => {
    const dir = await tmp();
    const outbox = await openOutbox(dir);
    for (const n of [1, 2, 3, 4]) await outbox.put(completed(n));
    const lines: Line[] = [];
    const events = new EventEmitter<AgentEvents>();
    const acks = new Acks({ log: logTo(lines), events, outbox, reporter: { report: () => undefined, ackRelease: () => false } });
    const ack = (n: number, outcome: number) => create(ServerMessage_Ack_ItemSchema, { attemptId: ID(n), outcome, message: 'later' });

    await acks.onAck(ack(1, 42));
    await acks.onAck(ack(2, 42));
    await acks.onAck(ack(1, 42));
    await acks.onAck(ack(2, Outcome.UNSPECIFIED));
    await acks.onAck(ack(3, Outcome.CONFLICT));
    await acks.onAck(ack(4, Outcome.NOT_FOUND));
    expect(outbox.pending().map((e) => e.attemptId)).toEqual([ID(1), ID(2)]);
    expect(lines.filter((l) => l.level === 40).map((l) => l.outcome)).toEqual([42, 0]);
    expect(lines.filter((l) => /report refused/.test(String(l.msg))).map((l) => l.attemptId)).toEqual([ID(3), ID(4)]);
    await outbox.close();
    const after = await readOutbox(dir);
    expect(after.pending.map((e) => e.attemptId)).toEqual([ID(1), ID(2)]);
    expect(after.superseded.map((s) => [s.attemptId, s.reason])).toEqual([
      [ID(3), 'CONFLICT'],
      [ID(4), 'NOT_FOUND'],
    ]);
  });
});

describe('server messages of a kind this SDK does not know', () => {
  it('are ignored with one warning per kind per stream, naming the field', async () => {
    const lines: Line[] = [];
    const agent = createAgent({ url: 'http://127.0.0.1:9', token: 't', outboxDir: await tmp(), log: logTo(lines), handleSignals: false });
    // As protobuf-es decodes a newer coordinator's message: field 40 (a message), field 41 (a varint).
    const f40 = fromBinary(ServerMessageSchema, new Uint8Array([0xc2, 0x02, 0x00]));
    const f41 = fromBinary(ServerMessageSchema, new Uint8Array([0xc8, 0x02, 0x07]));
    expect(f40.kind.case).toBeUndefined();
    // Through the session's dispatch, as a message from the stream arrives.
    const session = (agent as unknown as { session: { onMessage(m: ServerMessage): void; hooks: { disconnected(e?: Error): void } } }).session;
    session.onMessage(f40);
    session.onMessage(f40);
    session.onMessage(f41);
    const warned = () => lines.filter((l) => l.event === 'message.unknown').map((l) => l.kind);
    expect(warned()).toEqual(['field 40', 'field 41']);
    expect(lines.find((l) => l.kind === 'field 40')).toMatchObject({ level: 40, fields: [40], msg: expect.stringContaining('field 40 of ServerMessage') });
    session.hooks.disconnected();
    session.onMessage(f40);
    expect(warned(), 'again on the next stream').toEqual(['field 40', 'field 41', 'field 40']);
    expect(existsSync(path.join(agent.options.outboxDir, FORMAT_FILE)), 'never opened').toBe(false);
  });
});
