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
 *
 * Versions. `outbox.format` (`{"format":2,"minReader":2}`) says which format the directory holds:
 * 1 was one `<attemptId>.json` file per entry (before the log, 2026-11-30), imported at open; 2 is
 * this log. A log without the file (written before it existed) is format 2. An SDK opens a
 * directory only if `minReader` (default: `format`) is at most the format it knows
 * (`OUTBOX_FORMAT`), and refuses it otherwise (`checkFormat`): a newer agent must flush it first.
 * A later format that older readers can still use (a new record type they may skip) keeps
 * `minReader` at 2. A line whose checksum holds but whose record this SDK does not know (a type
 * `t`, or a `kind` of entry, of a later SDK) is no damage: it is never cut off, and is skipped
 * (`UnknownRecord`), except that a `put` of an unknown kind still replaces the earlier entry of its
 * attempt (this SDK cannot send what the attempt's report now is). While a segment holds one,
 * this SDK deletes no segment and does not compact (outbox.ts; past the compaction size it starts a
 * new, empty segment): the newer agent finds its records as it wrote them, with those around them.
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

/**
 * A line whose checksum holds but whose record this SDK does not know (a later SDK's): `type`
 * names it (`t`, and the `kind` of an entry); `replaces`: the attempt of a `put`, whose earlier
 * entry it replaces.
 */
export interface UnknownRecord {
  unknown: string;
  replaces?: string;
}

/** What a segment's line holds: a record, or one this SDK does not know. */
export type ScannedRecord = LogRecord | UnknownRecord;

/** The outbox format this SDK writes and reads (1, the pre-log files, it imports). */
export const OUTBOX_FORMAT = 2;
/** The file naming the format of an outbox directory. */
export const FORMAT_FILE = 'outbox.format';

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

/**
 * The record in `line` (without its newline), or undefined if it is not a whole line whose
 * checksum holds (damage). A checksummed line this SDK does not understand is an `UnknownRecord`.
 */
export function decodeRecord(line: Buffer): ScannedRecord | undefined {
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
    // The checksum holds: written so on purpose, by something newer.
    return { unknown: 'not JSON' };
  }
  return isRecord(r) ? r : unknownRecord(r);
}

/** What a checksummed record this SDK does not know is, in words, and the attempt a `put` of it replaces. */
function unknownRecord(r: unknown): UnknownRecord {
  if (!r || typeof r !== 'object' || Array.isArray(r)) return { unknown: `not a record (${JSON.stringify(r)?.slice(0, 40)})` };
  const x = r as { t?: unknown; e?: { attemptId?: unknown; kind?: unknown } };
  const t = typeof x.t === 'string' ? x.t.slice(0, 40) : JSON.stringify(x.t ?? null).slice(0, 40);
  if (x.t !== 'put') return { unknown: `t=${t}` };
  const kind = x.e && typeof x.e === 'object' ? JSON.stringify(x.e.kind ?? null).slice(0, 40) : 'none';
  const id = x.e && typeof x.e === 'object' ? x.e.attemptId : undefined;
  return typeof id === 'string' && ATTEMPT_ID.test(id) ? { unknown: `t=put kind=${kind}`, replaces: id } : { unknown: `t=put kind=${kind}` };
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
  /** In file order, those this SDK does not know included (`UnknownRecord`). */
  records: ScannedRecord[];
  /** Bytes up to the end of the last line whose checksum holds: what follows is a torn tail. */
  validEnd: number;
  size: number;
  /** Invalid lines followed by valid records (skipped). */
  corrupt: number;
  /** How many records of each type this SDK does not know (kept, skipped). */
  unknown: Map<string, number>;
}

/** Splits a segment into records; never throws on content, only on I/O. */
export async function scanSegment(file: string): Promise<SegmentScan> {
  const buf = await fs.readFile(file);
  const records: ScannedRecord[] = [];
  const unknown = new Map<string, number>();
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
      if ('unknown' in r) unknown.set(r.unknown, (unknown.get(r.unknown) ?? 0) + 1);
      corrupt += invalidSinceValid;
      invalidSinceValid = 0;
      validEnd = end + 1;
    } else {
      invalidSinceValid++;
    }
    start = end + 1;
  }
  return { records, validEnd, size: buf.length, corrupt, unknown };
}

/**
 * Applies records in order: the last one of each attempt decides. One this SDK does not know is
 * skipped, but a `put` of it still replaces its attempt's entry (this SDK holds none for it then).
 */
export function applyRecords(live: Map<string, OutboxEntry>, records: ScannedRecord[]): void {
  for (const r of records) {
    if ('unknown' in r) {
      if (r.replaces) live.delete(r.replaces);
    } else if (r.t === 'put') live.set(r.e.attemptId, r.e);
    else live.delete(r.id);
  }
}

/** What `outbox.format` says, or undefined where there is none (or an empty one, torn by a crash). */
export interface OutboxFormat {
  format: number;
  /** The oldest format a reader may know and still open the directory; default `format`. */
  minReader?: number;
}

/** Reads `outbox.format`; throws on one that does not say a format (its error names the file). */
export async function readFormat(dir: string): Promise<OutboxFormat | undefined> {
  const file = path.join(dir, FORMAT_FILE);
  let text: string;
  try {
    text = await fs.readFile(file, 'utf8');
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return undefined;
    throw err;
  }
  if (!text.trim()) return undefined;
  let f: { format?: unknown; minReader?: unknown } | undefined;
  try {
    f = JSON.parse(text) as typeof f;
  } catch {
    f = undefined;
  }
  const ok = (n: unknown): n is number => typeof n === 'number' && Number.isInteger(n) && n > 0;
  if (!f || typeof f !== 'object' || !ok(f.format) || (f.minReader !== undefined && !ok(f.minReader))) {
    throw new Error(
      `outbox ${dir}: ${FORMAT_FILE} does not say which format the directory holds (${JSON.stringify(text.slice(0, 80))}): written by a newer agent, or damaged; this agent knows formats 1 and ${OUTBOX_FORMAT}. Start the agent that wrote it to flush it, or move the directory away`,
    );
  }
  return { format: f.format, ...(f.minReader === undefined ? {} : { minReader: f.minReader }) };
}

/**
 * The directory's format, if this SDK can read it (none, or one whose `minReader` it knows);
 * otherwise an error naming the directory and both formats, saying what to do. Never writes.
 */
export async function checkFormat(dir: string): Promise<OutboxFormat | undefined> {
  const f = await readFormat(dir);
  if (f && (f.minReader ?? f.format) > OUTBOX_FORMAT) {
    throw new Error(
      `outbox ${dir} was written by a newer agent: it holds outbox format ${f.format} (${FORMAT_FILE}), this agent knows formats up to ${OUTBOX_FORMAT}; it is not opened, so that the reports in it are neither lost nor sent twice. Start the newer agent to flush it (until its \`leasehold-agent --check\` no longer says the outbox holds reports), or move the directory away (a newer agent given it later still sends its reports)`,
    );
  }
  return f;
}

/**
 * Writes `outbox.format` saying this SDK's format, durably (a temporary file synced, renamed, the
 * directory synced): before anything else is written to a new directory.
 */
export async function writeFormat(dir: string): Promise<void> {
  const file = path.join(dir, FORMAT_FILE);
  const tmp = `${file}.tmp`;
  // Owner only, as every file of the outbox (outbox.ts says why).
  const fh = await fs.open(tmp, 'w', 0o600);
  try {
    await fh.writeFile(`${JSON.stringify({ format: OUTBOX_FORMAT, minReader: OUTBOX_FORMAT })}\n`);
    await fh.sync();
  } finally {
    await fh.close();
  }
  await fs.rename(tmp, file);
  if (process.platform === 'win32') return; // directories cannot be synced there
  const dh = await fs.open(dir, 'r');
  try {
    await dh.sync();
  } finally {
    await dh.close();
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
 * reports are still waiting, which were set aside. Reads the pre-log format as well; throws, as
 * `open()` does, on a directory a newer agent wrote in a format this SDK cannot read.
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
  await checkFormat(dir);
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
