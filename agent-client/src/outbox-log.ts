/**
 * The outbox's on-disk record format, and reading a directory of segments without changing it.
 *
 * A segment (`outbox-000001.log`, numbered, the highest is the one written to) is a sequence
 * of lines, one record each:
 *
 *     <crc32 of the JSON, 8 hex digits> <byte length of the JSON> <JSON>\n
 *
 * `JSON.stringify` never emits a raw newline, so a line is a record and a record is a line. A
 * line whose length or checksum does not match its JSON (a write torn by a crash, blocks a
 * power cut left as zeros or garbage) is not a record: at the end of a segment it is the torn
 * tail of the last write, in the middle it is skipped and the records after it are kept. Damage
 * that covers a line's newline joins it with the next line into one bad line: both records are
 * lost. Never a wrong outcome: a lost `put` means that report is never sent and the job is
 * redone (or, if it replaced an earlier put, the earlier report is sent); a lost `ack` or `sup`
 * means the report is sent once more and answered `duplicate` or refused again.
 *
 * Records: `{"t":"put","e":entry}` (an entry is live, replacing any earlier one of its attempt),
 * `{"t":"ack","id":…}` (acknowledged: forget it), `{"t":"sup","id":…}` (superseded: the entry
 * was copied to `superseded.jsonl` first). Reading applies the segments in number order and
 * the records in file order; the last record of an attempt decides.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import zlib from 'node:zlib';

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

/** A report the coordinator refused (stale, invalid): kept in `superseded.jsonl`, never resent. */
export interface SupersededEntry extends OutboxEntry {
  /** ISO time it was set aside. */
  supersededAt: string;
  /** Why, as the coordinator answered (`STALE`, `INVALID`, …), when known. */
  reason?: string;
}

export type LogRecord = { t: 'put'; e: OutboxEntry } | { t: 'ack'; id: string } | { t: 'sup'; id: string };

export const ATTEMPT_ID = /^[0-9a-f-]{36}$/;
/** Segment names: `outbox-` and at least six digits (more once past 999999), valid on Windows. */
export const SEGMENT = /^outbox-(\d{6,})\.log$/;
export const SUPERSEDED_FILE = 'superseded.jsonl';
/** The pre-log format: one `<attemptId>.json` per entry, torn temporaries, `.superseded.json`. */
export const LEGACY_ENTRY = /^([0-9a-f-]{36})\.json$/;
export const LEGACY_TMP = /^[0-9a-f-]{36}\.json\.tmp-/;
export const LEGACY_SUPERSEDED = /^([0-9a-f-]{36})\.superseded\.json$/;

export const segmentName = (n: number): string => `outbox-${String(n).padStart(6, '0')}.log`;

/** zlib.crc32 arrived in Node 20.15; engines allows 20.11, so a table-driven fallback. */
const nativeCrc32 = (zlib as { crc32?: (data: string | Uint8Array) => number }).crc32;
let table: Uint32Array | undefined;
function tableCrc32(buf: Uint8Array): number {
  if (!table) {
    table = new Uint32Array(256);
    for (let n = 0; n < 256; n++) {
      let c = n;
      for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
      table[n] = c >>> 0;
    }
  }
  let c = 0xffffffff;
  for (let i = 0; i < buf.length; i++) c = table[(c ^ buf[i]!) & 0xff]! ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}
/** CRC-32 (IEEE, as zlib and PNG) of UTF-8 bytes. */
export function crc32(data: Uint8Array): number {
  return nativeCrc32 ? nativeCrc32(data) : tableCrc32(data);
}

/** One record as a line of the log. */
export function encodeRecord(r: LogRecord): Buffer {
  const json = Buffer.from(JSON.stringify(r), 'utf8');
  const head = `${crc32(json).toString(16).padStart(8, '0')} ${json.length} `;
  const line = Buffer.allocUnsafe(head.length + json.length + 1);
  line.write(head, 0, 'latin1');
  json.copy(line, head.length);
  line[line.length - 1] = 0x0a;
  return line;
}

/** The record in `line` (without its newline), or undefined if it is not a whole, valid one. */
export function decodeRecord(line: Buffer): LogRecord | undefined {
  if (line.length < 12 || line[8] !== 0x20) return undefined;
  const sp = line.indexOf(0x20, 9);
  if (sp < 0 || sp > 20) return undefined;
  const crcText = line.toString('latin1', 0, 8);
  const lenText = line.toString('latin1', 9, sp);
  if (!/^[0-9a-f]{8}$/.test(crcText) || !/^\d+$/.test(lenText)) return undefined;
  const json = line.subarray(sp + 1);
  if (json.length !== Number(lenText) || crc32(json) !== parseInt(crcText, 16)) return undefined;
  let r: unknown;
  try {
    r = JSON.parse(json.toString('utf8'));
  } catch {
    return undefined;
  }
  return isRecord(r) ? r : undefined;
}

function isRecord(r: unknown): r is LogRecord {
  if (!r || typeof r !== 'object') return false;
  const x = r as { t?: unknown; id?: unknown; e?: unknown };
  if (x.t === 'put') return isEntry(x.e);
  return (x.t === 'ack' || x.t === 'sup') && typeof x.id === 'string' && ATTEMPT_ID.test(x.id);
}

/** Whether `e` has the shape of an outbox entry (for the log and for the legacy files). */
export function isEntry(e: unknown): e is OutboxEntry {
  if (!e || typeof e !== 'object') return false;
  const x = e as Partial<OutboxEntry>;
  return typeof x.attemptId === 'string' && ATTEMPT_ID.test(x.attemptId) && (x.kind === 'completed' || x.kind === 'failed');
}

/** What one segment holds. */
export interface SegmentScan {
  records: LogRecord[];
  /** Bytes up to the end of the last valid record: what follows is a torn tail. */
  validEnd: number;
  size: number;
  /** Invalid lines followed by valid records (skipped). */
  corrupt: number;
}

/** Splits a segment into records; never throws on content, only on I/O. */
export async function scanSegment(file: string): Promise<SegmentScan> {
  const buf = await fs.readFile(file);
  const records: LogRecord[] = [];
  let validEnd = 0;
  let invalidSinceValid = 0;
  let corrupt = 0;
  let start = 0;
  while (start < buf.length) {
    const nl = buf.indexOf(0x0a, start);
    const end = nl < 0 ? buf.length : nl;
    const r = nl < 0 ? undefined : decodeRecord(buf.subarray(start, end));
    if (r) {
      records.push(r);
      corrupt += invalidSinceValid;
      invalidSinceValid = 0;
      validEnd = end + 1;
    } else {
      invalidSinceValid++;
    }
    start = end + 1;
  }
  return { records, validEnd, size: buf.length, corrupt };
}

/** Applies records in order: the last one of each attempt decides. */
export function applyRecords(live: Map<string, OutboxEntry>, records: LogRecord[]): void {
  for (const r of records) {
    if (r.t === 'put') live.set(r.e.attemptId, r.e);
    else live.delete(r.id);
  }
}

/** Segment numbers present in `names`, ascending. */
export function segmentNumbers(names: string[]): number[] {
  const out: number[] = [];
  for (const name of names) {
    const m = SEGMENT.exec(name);
    if (m) out.push(Number(m[1]));
  }
  return out.sort((a, b) => a - b);
}

/** Lines of `superseded.jsonl` that parse (a torn last line does not). */
export async function readSupersededFile(dir: string): Promise<SupersededEntry[]> {
  let text: string;
  try {
    text = await fs.readFile(path.join(dir, SUPERSEDED_FILE), 'utf8');
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return [];
    throw err;
  }
  const out: SupersededEntry[] = [];
  for (const line of text.split('\n')) {
    if (!line) continue;
    try {
      const e = JSON.parse(line) as unknown;
      if (isEntry(e)) out.push(e as SupersededEntry);
    } catch {
      // a torn last line: its entry is still live in the log and is set aside again
    }
  }
  return out;
}

/**
 * What an outbox directory holds, read without changing anything and without its lock (it may
 * be in use; a record being written at that moment is not counted). For tools and tests: which
 * reports are still waiting, which were set aside. Reads the pre-log format as well.
 */
export async function readOutbox(dir: string): Promise<{ pending: OutboxEntry[]; superseded: SupersededEntry[] }> {
  for (let tries = 0; ; tries++) {
    try {
      return await readOnce(dir);
    } catch (err) {
      // A compaction deleted a segment between the listing and its read: list again.
      if ((err as NodeJS.ErrnoException).code !== 'ENOENT' || tries >= 5) throw err;
    }
  }
}

async function readOnce(dir: string): Promise<{ pending: OutboxEntry[]; superseded: SupersededEntry[] }> {
  let names: string[];
  try {
    names = await fs.readdir(dir);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return { pending: [], superseded: [] };
    throw err;
  }
  const live = new Map<string, OutboxEntry>();
  for (const n of segmentNumbers(names)) applyRecords(live, (await scanSegment(path.join(dir, segmentName(n)))).records);
  const superseded = await readSupersededFile(dir);
  for (const name of names) {
    const legacy = LEGACY_ENTRY.test(name) ? 'entry' : LEGACY_SUPERSEDED.test(name) ? 'superseded' : undefined;
    if (!legacy) continue;
    const e = await readJsonFile(path.join(dir, name));
    if (!isEntry(e)) continue;
    if (legacy === 'entry') live.set(e.attemptId, e);
    else superseded.push({ ...e, supersededAt: '' });
  }
  return { pending: sortEntries([...live.values()]), superseded };
}

/** A JSON file's content, or undefined if it is gone or does not parse. */
export async function readJsonFile(file: string): Promise<unknown> {
  try {
    return JSON.parse(await fs.readFile(file, 'utf8')) as unknown;
  } catch {
    return undefined;
  }
}

/** Oldest first. */
export function sortEntries(es: OutboxEntry[]): OutboxEntry[] {
  // ISO times compare as strings; localeCompare would cost ~1 µs per comparison.
  return es.sort((a, b) => (a.writtenAt < b.writtenAt ? -1 : a.writtenAt > b.writtenAt ? 1 : 0));
}
