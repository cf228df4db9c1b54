/**
 * Protobuf's wire format by hand, for the few messages written and read once per job: what
 * protobuf-es does by reflection (field by field, through descriptors) costs more than the rest
 * of a message's handling. `Writer` writes into a buffer sized first (the sizes below), `Reader`
 * reads straight into the shapes protobuf-es gives. Both follow protobuf-es byte for byte and
 * shape for shape (test/wire-codec.test.ts and test/assign-codec.test.ts compare them on random
 * messages); anything they do not expect is left to protobuf-es (see codec.ts).
 *
 * Also used by the coordinator for `Assign` (server/transport/assign-codec.ts).
 */
import { isUtf8 } from 'node:buffer';
import type { JsonObject, JsonValue } from '@bufbuild/protobuf';
import { WireType } from '@bufbuild/protobuf/wire';

export const LEN = WireType.LengthDelimited;

/** A plain JSON object (not null, not an array): what protobuf-es writes as a `Struct`. */
export const isObject = (v: unknown): v is JsonObject => typeof v === 'object' && v !== null && !Array.isArray(v);

// ───────────────────────────── sizes ─────────────────────────────

/** Bytes of a varint of a non-negative integer below 2^53. */
export function varintSize(n: number): number {
  let size = 1;
  while (n >= 128) {
    n = Math.floor(n / 128);
    size++;
  }
  return size;
}
/** Bytes of an int32 field's value: negative numbers take ten. */
export const int32Size = (n: number) => (n < 0 ? 10 : varintSize(n));
/** Bytes of a length-delimited field with a one-byte tag (field numbers below 16) and `len` bytes. */
export const lenField = (len: number) => 1 + varintSize(len) + len;
/** Bytes of a length-delimited field with a two-byte tag (fields 16 to 2047). */
export const lenField2 = (len: number) => 2 + varintSize(len) + len;

/** Bytes of a `Timestamp` or `Duration` body of `ms` milliseconds (not before 1970). */
export function timeSize(ms: number): number {
  const seconds = Math.floor(ms / 1000);
  const nanos = Math.round((ms - seconds * 1000) * 1e6);
  return (seconds !== 0 ? 1 + varintSize(seconds) : 0) + (nanos !== 0 ? 1 + varintSize(nanos) : 0);
}

/**
 * Bytes of a `Value` body holding `v`. What is not JSON (undefined, a function, a bigint) is an
 * empty `Value`, as protobuf-es makes it.
 */
export function valueSize(v: unknown): number {
  if (v === null) return 2;
  switch (typeof v) {
    case 'number':
      return 9;
    case 'string':
      return lenField(Buffer.byteLength(v));
    case 'boolean':
      return 2;
    case 'object':
      return Array.isArray(v) ? lenField(listSize(v)) : lenField(structSize(v as JsonObject));
    default:
      return 0;
  }
}

export function listSize(a: readonly unknown[]): number {
  let size = 0;
  for (const x of a) size += lenField(valueSize(x));
  return size;
}

function entrySize(k: string, v: unknown): number {
  return lenField(Buffer.byteLength(k)) + lenField(valueSize(v));
}

/** Bytes of a `Struct` body holding `o`'s own enumerable keys (as `Object.entries` lists them). */
export function structSize(o: JsonObject): number {
  let size = 0;
  for (const k of Object.keys(o)) size += lenField(entrySize(k, o[k]));
  return size;
}

/** Bytes of a uint64 varint. */
export const uint64Size = (n: bigint) => (n <= 0x1fffffffffffffn ? varintSize(Number(n)) : Math.ceil(n.toString(2).length / 7));

// ───────────────────────────── writing ─────────────────────────────

/** A gRPC message frame: uncompressed (flag 0), the length as 4 bytes big-endian, the bytes. */
export function grpcFrame(bytes: Uint8Array): Buffer {
  const f = Buffer.allocUnsafe(5 + bytes.length);
  f[0] = 0;
  f.writeUInt32BE(bytes.length, 1);
  f.set(bytes, 5);
  return f;
}

export class Writer {
  pos = 0;
  constructor(readonly buf: Buffer) {}

  static sized(n: number): Writer {
    return new Writer(Buffer.allocUnsafe(n));
  }

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

  uint64(n: bigint): void {
    if (n <= 0x1fffffffffffffn) return this.varint(Number(n));
    while (n >= 128n) {
      this.buf[this.pos++] = Number(n & 127n) | 128;
      n >>= 7n;
    }
    this.buf[this.pos++] = Number(n);
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
    this.tag(no, LEN);
    this.stringBody(s);
  }

  /** A string's length, then its UTF-8 bytes. */
  stringBody(s: string): void {
    const n = s.length;
    if (n < 128) {
      // Short and ASCII (ids, queue names, keys), byte by byte: no call into Node's encoder,
      // which costs more than the copy for strings this short. Anything else as UTF-8 below.
      const buf = this.buf;
      const at = this.pos + 1;
      let i = 0;
      for (; i < n; i++) {
        const c = s.charCodeAt(i);
        if (c > 0x7f) break;
        buf[at + i] = c;
      }
      if (i === n) {
        buf[this.pos] = n;
        this.pos = at + n;
        return;
      }
    }
    const len = Buffer.byteLength(s);
    this.varint(len);
    this.pos += this.buf.write(s, this.pos, len, 'utf8');
  }

  double(v: number): void {
    this.buf.writeDoubleLE(v, this.pos);
    this.pos += 8;
  }

  /** Field `no`, a `Timestamp` or `Duration` of `ms` milliseconds (not before 1970). */
  time(no: number, ms: number): void {
    this.tag(no, LEN);
    this.timeBody(ms);
  }

  /** A `Timestamp` or `Duration` of `ms` milliseconds, its length first. */
  timeBody(ms: number): void {
    const seconds = Math.floor(ms / 1000);
    const nanos = Math.round((ms - seconds * 1000) * 1e6);
    this.varint(timeSize(ms));
    if (seconds !== 0) {
      this.tag(1, WireType.Varint);
      this.varint(seconds);
    }
    if (nanos !== 0) {
      this.tag(2, WireType.Varint);
      this.varint(nanos);
    }
  }

  /** Field `no`, a `Struct` holding `o`. */
  struct(no: number, o: JsonObject): void {
    this.tag(no, LEN);
    this.varint(structSize(o));
    this.structBody(o);
  }

  structBody(s: JsonObject): void {
    for (const k of Object.keys(s)) {
      const v = s[k];
      this.tag(1, LEN);
      this.varint(entrySize(k, v));
      this.string(1, k);
      this.tag(2, LEN);
      this.varint(valueSize(v));
      this.valueBody(v);
    }
  }

  valueBody(v: unknown): void {
    if (v === null) {
      this.tag(1, WireType.Varint);
      this.byte(0);
      return;
    }
    switch (typeof v) {
      case 'number':
        this.tag(2, WireType.Bit64);
        this.double(v);
        return;
      case 'string':
        this.string(3, v);
        return;
      case 'boolean':
        this.tag(4, WireType.Varint);
        this.byte(v ? 1 : 0);
        return;
      case 'object':
        if (Array.isArray(v)) {
          this.tag(6, LEN);
          this.varint(listSize(v));
          for (const x of v) {
            this.tag(1, LEN);
            this.varint(valueSize(x));
            this.valueBody(x);
          }
        } else {
          this.struct(5, v as JsonObject);
        }
        return;
      default:
      // not JSON: an empty Value
    }
  }
}

// ───────────────────────────── reading ─────────────────────────────

/** Thrown where the hand reader meets what it does not expect: the caller asks protobuf-es. */
export const UNEXPECTED = new Error('not a message the hand reader decodes');

/** What `read` makes of `buf`, or undefined where it throws: the caller then asks protobuf-es. */
export function readByHand<T>(buf: Buffer, read: (r: Reader) => T): T | undefined {
  try {
    return read(new Reader(buf));
  } catch {
    return undefined;
  }
}

/**
 * Reads fields from `buf`. Every read checks its bounds and throws on anything out of them or
 * unexpected (`UNEXPECTED`); callers then decode the same bytes with protobuf-es, which either
 * decodes what this one did not expect or says precisely what is wrong.
 */
export class Reader {
  pos = 0;
  readonly end: number;
  /** The upper 32 bits of the last varint read by `varint`. */
  private hi = 0;

  constructor(readonly buf: Buffer) {
    this.end = buf.length;
  }

  /** The low 32 bits of a varint, unsigned; the high ones are kept in `hi`. */
  varint(): number {
    const { buf } = this;
    let lo = 0;
    this.hi = 0;
    for (let shift = 0; shift < 28; shift += 7) {
      if (this.pos >= this.end) throw UNEXPECTED;
      const b = buf[this.pos++]!;
      lo |= (b & 127) << shift;
      if (b < 128) return lo >>> 0;
    }
    if (this.pos >= this.end) throw UNEXPECTED;
    let b = buf[this.pos++]!;
    lo |= (b & 15) << 28;
    let hi = (b & 127) >> 4;
    if (b >= 128) {
      for (let shift = 3; ; shift += 7) {
        if (shift > 31 || this.pos >= this.end) throw UNEXPECTED;
        b = buf[this.pos++]!;
        hi |= (b & 127) << shift;
        if (b < 128) break;
      }
    }
    this.hi = hi >>> 0;
    return lo >>> 0;
  }

  int32(): number {
    return this.varint() | 0;
  }

  uint64(): bigint {
    const lo = this.varint();
    return this.hi === 0 ? BigInt(lo) : (BigInt(this.hi) << 32n) | BigInt(lo);
  }

  int64(): bigint {
    const lo = this.varint();
    return this.hi === 0 ? BigInt(lo) : BigInt.asIntN(64, (BigInt(this.hi) << 32n) | BigInt(lo));
  }

  bool(): boolean {
    return this.varint() !== 0 || this.hi !== 0;
  }

  double(): number {
    if (this.pos + 8 > this.end) throw UNEXPECTED;
    const v = this.buf.readDoubleLE(this.pos);
    this.pos += 8;
    return v;
  }

  /** The end of the length-delimited field that starts here. */
  len(): number {
    const n = this.varint();
    if (this.hi !== 0 || this.pos + n > this.end) throw UNEXPECTED;
    return this.pos + n;
  }

  string(): string {
    const end = this.len();
    const s = this.buf.toString('utf8', this.pos, end);
    // protobuf-es refuses invalid UTF-8, which decodes to replacement characters here.
    if (s.includes('\uFFFD') && !isUtf8(this.buf.subarray(this.pos, end))) throw UNEXPECTED;
    this.pos = end;
    return s;
  }

  /** A `Timestamp` or `Duration` body ending at `end`. */
  time<T extends 'google.protobuf.Timestamp' | 'google.protobuf.Duration'>(typeName: T, end: number): { $typeName: T; seconds: bigint; nanos: number } {
    const t = { $typeName: typeName, seconds: 0n, nanos: 0 };
    while (this.pos < end) {
      const tag = this.varint();
      if (tag === 8) t.seconds = this.int64();
      else if (tag === 16) t.nanos = this.int32();
      else throw UNEXPECTED;
    }
    if (this.pos !== end) throw UNEXPECTED;
    return t;
  }

  /** A `Struct` body ending at `end`, as the JSON object protobuf-es makes of it. */
  struct(end: number): JsonObject {
    const o: JsonObject = {};
    while (this.pos < end) {
      if (this.varint() !== 10) throw UNEXPECTED;
      this.entry(o, () => this.value(this.len()), null);
    }
    if (this.pos !== end) throw UNEXPECTED;
    return o;
  }

  /**
   * A map entry (its length first) into `into`: the key (field 1) and the value (field 2, read
   * by `value`, `empty` when absent), each at most once.
   */
  entry<V>(into: Record<string, V>, value: () => V, empty: V): void {
    const end = this.len();
    let key = '';
    let v = empty;
    let seen = 0;
    while (this.pos < end) {
      const tag = this.varint();
      if (tag === 10 && !(seen & 1)) {
        key = this.string();
        seen |= 1;
      } else if (tag === 18 && !(seen & 2)) {
        v = value();
        seen |= 2;
      } else throw UNEXPECTED;
    }
    // A key of __proto__ would set the object's prototype: protobuf-es's to decide.
    if (this.pos !== end || key === '__proto__') throw UNEXPECTED;
    into[key] = v;
  }

  /** A `Value` body ending at `end`, as the JSON value protobuf-es makes of it inside a `Struct`. */
  value(end: number): JsonValue {
    if (this.pos === end) return null;
    const tag = this.varint();
    let v: JsonValue;
    switch (tag) {
      case 8:
        this.varint();
        v = null;
        break;
      case 17:
        v = this.double();
        break;
      case 26:
        v = this.string();
        break;
      case 32:
        v = this.bool();
        break;
      case 42:
        v = this.struct(this.len());
        break;
      case 50: {
        const listEnd = this.len();
        const a: JsonValue[] = [];
        while (this.pos < listEnd) {
          if (this.varint() !== 10) throw UNEXPECTED;
          a.push(this.value(this.len()));
        }
        v = a;
        break;
      }
      default:
        throw UNEXPECTED;
    }
    // One kind per Value: a second is protobuf-es's to resolve.
    if (this.pos !== end) throw UNEXPECTED;
    return v;
  }
}
