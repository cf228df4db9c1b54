/**
 * The jobs of an `Assign`, encoded by hand. An `Assign` carries every job the dispatcher hands
 * out, so it is the message the coordinator writes most; protobuf-es encodes it by reflection,
 * field by field (about 20 µs per job measured here, the largest part of what a job costs the
 * coordinator), and its BinaryWriter's fork/join per nested message is nearly as slow. This
 * sizes each message first and writes the same bytes straight into one buffer; `assignMessage`
 * hands them to the transport as the `Assign`'s unknown fields, which protobuf-es writes as they
 * are. On the wire it is an ordinary `Assign` (test/assign-codec.test.ts compares the bytes with
 * protobuf-es's, on random jobs).
 */
import { create, toBinary, type JsonValue } from '@bufbuild/protobuf';
import { WireType } from '@bufbuild/protobuf/wire';
import { ServerMessageSchema, ServerMessage_AssignSchema, type ServerMessage } from '../../gen/leasehold/v1/agent_service_pb.js';
import { ClaimedJobSchema } from '../../gen/leasehold/v1/job_pb.js';
import type { Claimed } from '../store/index.js';
import { toPbClaimed, toPbStatus } from './codec.js';

const LEN = WireType.LengthDelimited;

type Obj = { [k: string]: JsonValue };
const isObject = (v: unknown): v is Obj => typeof v === 'object' && v !== null && !Array.isArray(v);

// ───────────────────────────── sizes ─────────────────────────────

/** Bytes of a varint of a non-negative integer below 2^53. */
function varintSize(n: number): number {
  let size = 1;
  while (n >= 128) {
    n = Math.floor(n / 128);
    size++;
  }
  return size;
}
/** Bytes of an int32 field's value: negative numbers take ten. */
const int32Size = (n: number) => (n < 0 ? 10 : varintSize(n));
/** Bytes of a length-delimited field with a one-byte tag (field numbers below 16) and `len` bytes. */
const lenField = (len: number) => 1 + varintSize(len) + len;
/** Bytes of a length-delimited field with a two-byte tag (fields 16 to 2047). */
const lenField2 = (len: number) => 2 + varintSize(len) + len;

function timeSize(ms: number): number {
  const seconds = Math.floor(ms / 1000);
  const nanos = Math.round((ms - seconds * 1000) * 1e6);
  return (seconds !== 0 ? 1 + varintSize(seconds) : 0) + (nanos !== 0 ? 1 + varintSize(nanos) : 0);
}

function valueSize(v: JsonValue): number {
  if (v === null) return 2;
  if (typeof v === 'number') return 9;
  if (typeof v === 'string') return lenField(Buffer.byteLength(v));
  if (typeof v === 'boolean') return 2;
  if (Array.isArray(v)) return lenField(listSize(v));
  return lenField(structSize(v));
}

function listSize(a: JsonValue[]): number {
  let size = 0;
  for (const x of a) size += lenField(valueSize(x));
  return size;
}

function entrySize(k: string, v: JsonValue): number {
  return lenField(Buffer.byteLength(k)) + lenField(valueSize(v));
}

function structSize(o: Obj): number {
  let size = 0;
  for (const k in o) size += lenField(entrySize(k, o[k]!));
  return size;
}

// ───────────────────────────── writing ─────────────────────────────

class Out {
  pos = 0;
  constructor(readonly buf: Buffer) {}

  byte(b: number): void {
    this.buf[this.pos++] = b;
  }

  varint(n: number): void {
    while (n >= 128) {
      this.buf[this.pos++] = (n % 128) | 128;
      n = Math.floor(n / 128);
    }
    this.buf[this.pos++] = n;
  }

  int32(n: number): void {
    if (n >= 0) return this.varint(n);
    // Negative int32: the 64-bit two's complement, ten bytes.
    let lo = n >>> 0;
    for (let i = 0; i < 4; i++) {
      this.buf[this.pos++] = (lo & 127) | 128;
      lo >>>= 7;
    }
    this.buf[this.pos++] = (lo & 15) | 0x70 | 128;
    for (let i = 0; i < 4; i++) this.buf[this.pos++] = 0xff;
    this.buf[this.pos++] = 1;
  }

  tag(no: number, type: number): void {
    this.varint(no * 8 + type);
  }

  string(no: number, s: string): void {
    const len = Buffer.byteLength(s);
    this.tag(no, LEN);
    this.varint(len);
    this.pos += this.buf.write(s, this.pos, len, 'utf8');
  }

  double(v: number): void {
    this.buf.writeDoubleLE(v, this.pos);
    this.pos += 8;
  }
}

function writeTime(o: Out, no: number, ms: number): void {
  const seconds = Math.floor(ms / 1000);
  const nanos = Math.round((ms - seconds * 1000) * 1e6);
  o.tag(no, LEN);
  o.varint(timeSize(ms));
  if (seconds !== 0) {
    o.tag(1, WireType.Varint);
    o.varint(seconds);
  }
  if (nanos !== 0) {
    o.tag(2, WireType.Varint);
    o.varint(nanos);
  }
}

function writeValue(o: Out, v: JsonValue): void {
  if (v === null) {
    o.tag(1, WireType.Varint);
    o.byte(0);
  } else if (typeof v === 'number') {
    o.tag(2, WireType.Bit64);
    o.double(v);
  } else if (typeof v === 'string') {
    o.string(3, v);
  } else if (typeof v === 'boolean') {
    o.tag(4, WireType.Varint);
    o.byte(v ? 1 : 0);
  } else if (Array.isArray(v)) {
    o.tag(6, LEN);
    o.varint(listSize(v));
    for (const x of v) {
      o.tag(1, LEN);
      o.varint(valueSize(x));
      writeValue(o, x);
    }
  } else {
    o.tag(5, LEN);
    o.varint(structSize(v));
    writeStruct(o, v);
  }
}

function writeStruct(o: Out, s: Obj): void {
  for (const k in s) {
    const v = s[k]!;
    o.tag(1, LEN);
    o.varint(entrySize(k, v));
    o.string(1, k);
    o.tag(2, LEN);
    o.varint(valueSize(v));
    writeValue(o, v);
  }
}

/** The job of `c` as `toPbJob` shows it: each field and its size, written in field order. */
function jobSize(c: Claimed): number {
  const j = c.job;
  let size = 0;
  if (j.id) size += lenField(Buffer.byteLength(j.id));
  if (j.queue) size += lenField(Buffer.byteLength(j.queue));
  if (isObject(j.payload)) size += lenField(structSize(j.payload));
  if (j.priority !== 0) size += 1 + int32Size(j.priority);
  if (toPbStatus(j.status)) size += 2;
  size += lenField(timeSize(j.runAt.getTime()));
  if (j.maxAttempts !== 0) size += 1 + int32Size(j.maxAttempts);
  if (j.attemptNo !== 0) size += 1 + int32Size(j.attemptNo);
  if (j.attemptsStarted !== 0) size += 1 + int32Size(j.attemptsStarted);
  if (j.currentAttemptId) size += lenField(Buffer.byteLength(j.currentAttemptId));
  if (j.agentId) size += lenField(Buffer.byteLength(j.agentId));
  if (j.leaseExpiresAt) size += lenField(timeSize(j.leaseExpiresAt.getTime()));
  if (j.executionTimeoutMs) size += lenField(timeSize(j.executionTimeoutMs));
  if (j.idempotencyKey) size += lenField(Buffer.byteLength(j.idempotencyKey));
  if (isObject(j.result)) size += lenField(structSize(j.result));
  if (isObject(j.error)) size += lenField2(structSize(j.error));
  size += lenField2(timeSize(j.createdAt.getTime()));
  size += lenField2(timeSize(j.updatedAt.getTime()));
  if (j.finishedAt) size += lenField2(timeSize(j.finishedAt.getTime()));
  if (j.notifyUrl) size += lenField2(Buffer.byteLength(j.notifyUrl));
  if (isObject(j.labels)) {
    for (const k in j.labels) size += lenField2(lenField(Buffer.byteLength(k)) + lenField(Buffer.byteLength(String(j.labels[k]))));
  }
  if (j.progress !== null && j.progress !== undefined) size += lenField2(valueSize(j.progress as JsonValue));
  return size;
}

function writeJob(o: Out, c: Claimed, size: number): void {
  const j = c.job;
  o.tag(1, LEN);
  o.varint(size);
  if (j.id) o.string(1, j.id);
  if (j.queue) o.string(2, j.queue);
  if (isObject(j.payload)) {
    o.tag(3, LEN);
    o.varint(structSize(j.payload));
    writeStruct(o, j.payload);
  }
  if (j.priority !== 0) {
    o.tag(4, WireType.Varint);
    o.int32(j.priority);
  }
  const status = toPbStatus(j.status);
  if (status) {
    o.tag(5, WireType.Varint);
    o.varint(status);
  }
  writeTime(o, 6, j.runAt.getTime());
  for (const [no, n] of [
    [7, j.maxAttempts],
    [8, j.attemptNo],
    [9, j.attemptsStarted],
  ] as const) {
    if (n !== 0) {
      o.tag(no, WireType.Varint);
      o.int32(n);
    }
  }
  if (j.currentAttemptId) o.string(10, j.currentAttemptId);
  if (j.agentId) o.string(11, j.agentId);
  if (j.leaseExpiresAt) writeTime(o, 12, j.leaseExpiresAt.getTime());
  if (j.executionTimeoutMs) writeTime(o, 13, j.executionTimeoutMs);
  if (j.idempotencyKey) o.string(14, j.idempotencyKey);
  if (isObject(j.result)) {
    o.tag(15, LEN);
    o.varint(structSize(j.result));
    writeStruct(o, j.result);
  }
  if (isObject(j.error)) {
    o.tag(16, LEN);
    o.varint(structSize(j.error));
    writeStruct(o, j.error);
  }
  writeTime(o, 17, j.createdAt.getTime());
  writeTime(o, 18, j.updatedAt.getTime());
  if (j.finishedAt) writeTime(o, 19, j.finishedAt.getTime());
  if (j.notifyUrl) o.string(20, j.notifyUrl);
  if (isObject(j.labels)) {
    for (const k in j.labels) {
      const v = String(j.labels[k]);
      o.tag(21, LEN);
      o.varint(lenField(Buffer.byteLength(k)) + lenField(Buffer.byteLength(v)));
      o.string(1, k);
      o.string(2, v);
    }
  }
  if (j.progress !== null && j.progress !== undefined) {
    o.tag(22, LEN);
    o.varint(valueSize(j.progress as JsonValue));
    writeValue(o, j.progress as JsonValue);
  }
}

/**
 * One `ClaimedJob` of `c` as its unknown-field data: its length, then job (1), attempt_id (2),
 * attempt_no (3) and claim_deadline (4), as `toPbClaimed` would have them.
 */
export function encodeClaimedJob(c: Claimed): Uint8Array {
  // Times before 1970 are negative seconds (ten-byte varints): left to protobuf-es.
  const j = c.job;
  if (Math.min(j.runAt.getTime(), j.createdAt.getTime(), j.updatedAt.getTime(), c.claimDeadline.getTime(), j.leaseExpiresAt?.getTime() ?? 0, j.finishedAt?.getTime() ?? 0) < 0) {
    const bytes = toBinary(ClaimedJobSchema, toPbClaimed(c));
    const o = new Out(Buffer.allocUnsafe(varintSize(bytes.length) + bytes.length));
    o.varint(bytes.length);
    o.buf.set(bytes, o.pos);
    return o.buf;
  }
  const job = jobSize(c);
  const body =
    lenField(job) +
    (c.attemptId ? lenField(Buffer.byteLength(c.attemptId)) : 0) +
    (c.attemptNo !== 0 ? 1 + int32Size(c.attemptNo) : 0) +
    lenField(timeSize(c.claimDeadline.getTime()));
  const o = new Out(Buffer.allocUnsafe(varintSize(body) + body));
  o.varint(body);
  writeJob(o, c, job);
  if (c.attemptId) o.string(2, c.attemptId);
  if (c.attemptNo !== 0) {
    o.tag(3, WireType.Varint);
    o.int32(c.attemptNo);
  }
  writeTime(o, 4, c.claimDeadline.getTime());
  return o.buf;
}

/**
 * A `ServerMessage` with an `Assign` of `jobs`, the jobs encoded by hand and attached as the
 * `Assign`'s unknown fields (field 1, one per job), which the transport writes unchanged.
 */
export function assignMessage(jobs: Claimed[]): ServerMessage {
  const assign = create(ServerMessage_AssignSchema);
  assign.$unknown = jobs.map((c) => ({ no: 1, wireType: LEN, data: encodeClaimedJob(c) }));
  return create(ServerMessageSchema, { kind: { case: 'assign', value: assign } });
}
