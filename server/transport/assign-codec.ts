/**
 * The jobs of an `Assign`, and `Ack` and `Renewed`, encoded by hand. An `Assign` carries every job the dispatcher hands
 * out, so it is the message the coordinator writes most; protobuf-es encodes it by reflection,
 * field by field (about 20 µs per job measured here, the largest part of what a job costs the
 * coordinator), and its BinaryWriter's fork/join per nested message is nearly as slow. This
 * sizes each message first and writes the same bytes straight into one buffer; `assignMessage`
 * hands them to the transport as the `Assign`'s unknown fields, which protobuf-es writes as they
 * are. On the wire it is an ordinary `Assign` (test/assign-codec.test.ts compares the bytes with
 * protobuf-es's, on random jobs). `Ack` and `Renewed`, sent once per job too, are written the
 * same way (the writer is the agent's, agent-client/src/wire.ts). Each is also kept whole as
 * bytes (`handEncoded`), which the agent stream's lane writes as they are.
 */
import { create, toBinary, type UnknownField } from '@bufbuild/protobuf';
import { WireType } from '@bufbuild/protobuf/wire';
import { LEN, Writer, int32Size, isObject, lenField, lenField2, structSize, timeSize, uint64Size, valueSize, varintSize } from '../../agent-client/src/wire.js';
import { durationFromMs } from '@bufbuild/protobuf/wkt';
import {
  ServerMessageSchema,
  type ServerMessage,
  type ServerMessage_Ack,
  type ServerMessage_Assign,
  type ServerMessage_Renewed,
} from '../../gen/leasehold/v1/agent_service_pb.js';
import { ClaimedJobSchema, CurrentStateSchema } from '../../gen/leasehold/v1/job_pb.js';
import type { AckItem } from '../core/agent-hub.js';
import type { Claimed } from '../store/index.js';
import { toPbClaimed, toPbCurrent, toPbStatus } from './codec.js';
import { toPbOutcome } from './outcome-wire.js';

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
  if (j.progress !== null && j.progress !== undefined) size += lenField2(valueSize(j.progress));
  return size;
}

function writeJob(o: Writer, c: Claimed, size: number): void {
  const j = c.job;
  o.tag(1, LEN);
  o.varint(size);
  if (j.id) o.string(1, j.id);
  if (j.queue) o.string(2, j.queue);
  if (isObject(j.payload)) {
    o.struct(3, j.payload);
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
  o.time(6, j.runAt.getTime());
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
  if (j.leaseExpiresAt) o.time(12, j.leaseExpiresAt.getTime());
  if (j.executionTimeoutMs) o.time(13, j.executionTimeoutMs);
  if (j.idempotencyKey) o.string(14, j.idempotencyKey);
  if (isObject(j.result)) {
    o.struct(15, j.result);
  }
  if (isObject(j.error)) {
    o.struct(16, j.error);
  }
  o.time(17, j.createdAt.getTime());
  o.time(18, j.updatedAt.getTime());
  if (j.finishedAt) o.time(19, j.finishedAt.getTime());
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
    o.varint(valueSize(j.progress));
    o.valueBody(j.progress);
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
    const o = new Writer(Buffer.allocUnsafe(varintSize(bytes.length) + bytes.length));
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
  const o = new Writer(Buffer.allocUnsafe(varintSize(body) + body));
  o.varint(body);
  writeJob(o, c, job);
  if (c.attemptId) o.string(2, c.attemptId);
  if (c.attemptNo !== 0) {
    o.tag(3, WireType.Varint);
    o.int32(c.attemptNo);
  }
  o.time(4, c.claimDeadline.getTime());
  return o.buf;
}

/** The whole `ServerMessage` of each message made here, as protobuf-es would encode it. */
const encoded = new WeakMap<ServerMessage, Uint8Array>();

/**
 * The bytes of `m` when it was made here (an `Assign`, `Ack` or `Renewed` encoded by hand), so
 * that a transport that writes bytes (agent-lane.ts) need not walk it with protobuf-es; otherwise
 * undefined.
 */
export function handEncoded(m: ServerMessage): Uint8Array | undefined {
  return encoded.get(m);
}

/**
 * A `ServerMessage` whose oneof `kind` is field `no`, a message of `fields` only (its unknown
 * fields), remembered with its bytes: the tag of `no`, the length, each field's tag and data.
 */
function withBytes(no: number, fields: UnknownField[], m: ServerMessage): ServerMessage {
  let body = 0;
  for (const f of fields) body += varintSize((f.no << 3) | f.wireType) + f.data.length;
  const o = Writer.sized(varintSize((no << 3) | LEN) + varintSize(body) + body);
  o.tag(no, LEN);
  o.varint(body);
  for (const f of fields) {
    o.tag(f.no, f.wireType);
    o.buf.set(f.data, o.pos);
    o.pos += f.data.length;
  }
  encoded.set(m, o.buf);
  return m;
}

/**
 * The messages made here, as `create()` makes them (proto3: the type name and each field's zero
 * value; a message field absent) but as object literals: `create()` walks the schema's fields on
 * every call, six times a job (test/assign-codec.test.ts holds them equal).
 */
const serverMessage = (kind: ServerMessage['kind']): ServerMessage => ({ $typeName: 'leasehold.v1.ServerMessage', kind });
const assignOf = ($unknown: UnknownField[]): ServerMessage_Assign => ({ $typeName: 'leasehold.v1.ServerMessage.Assign', jobs: [], $unknown });
const ackOf = ($unknown: UnknownField[]): ServerMessage_Ack => ({ $typeName: 'leasehold.v1.ServerMessage.Ack', items: [], $unknown });
const renewedOf = ($unknown: UnknownField[]): ServerMessage_Renewed => ({ $typeName: 'leasehold.v1.ServerMessage.Renewed', attemptIds: [], seq: 0n, $unknown });

/**
 * A `ServerMessage` with an `Assign` of `jobs`, the jobs encoded by hand and attached as the
 * `Assign`'s unknown fields (field 1, one per job), which protobuf-es writes unchanged.
 */
export function assignMessage(jobs: Claimed[]): ServerMessage {
  const assign = assignOf(jobs.map((c) => ({ no: 1, wireType: LEN, data: encodeClaimedJob(c) })));
  return withBytes(2, assign.$unknown!, serverMessage({ case: 'assign', value: assign }));
}

/** One `Ack.Item` as its unknown-field data (length first), as `toServerMessage` would build it. */
function encodeAckItem(i: AckItem): Uint8Array {
  const outcome = toPbOutcome(i.outcome);
  const current = i.current ? toBinary(CurrentStateSchema, toPbCurrent(i.current)) : undefined;
  const stored = isObject(i.storedResult) ? i.storedResult : undefined;
  const body =
    (i.attemptId ? lenField(Buffer.byteLength(i.attemptId)) : 0) +
    (outcome !== 0 ? 1 + int32Size(outcome) : 0) +
    (stored ? lenField(structSize(stored)) : 0) +
    (current ? lenField(current.length) : 0) +
    (i.message ? lenField(Buffer.byteLength(i.message)) : 0);
  const o = Writer.sized(varintSize(body) + body);
  o.varint(body);
  if (i.attemptId) o.string(1, i.attemptId);
  if (outcome !== 0) {
    o.tag(2, WireType.Varint);
    o.int32(outcome);
  }
  if (stored) o.struct(3, stored);
  if (current) {
    o.tag(4, LEN);
    o.varint(current.length);
    o.buf.set(current, o.pos);
    o.pos += current.length;
  }
  if (i.message) o.string(5, i.message);
  return o.buf;
}

/** A `ServerMessage` with an `Ack` of `items`, each encoded by hand (as the jobs of an `Assign`). */
export function ackMessage(items: AckItem[]): ServerMessage {
  const ack = ackOf(items.map((i) => ({ no: 1, wireType: LEN, data: encodeAckItem(i) })));
  return withBytes(3, ack.$unknown!, serverMessage({ case: 'ack', value: ack }));
}

/** A `ServerMessage` with a `Renewed`, its fields encoded by hand. */
export function renewedMessage(attemptIds: string[], leaseTtlMs: number, seq: bigint): ServerMessage {
  // A lease is never negative; such a duration (ten-byte varints) is left to protobuf-es.
  if (!(leaseTtlMs >= 0)) return create(ServerMessageSchema, { kind: { case: 'renewed', value: { attemptIds, leaseTtl: durationFromMs(leaseTtlMs), seq } } });
  const unknown: UnknownField[] = attemptIds.map((id) => {
    const o = Writer.sized(lenField(Buffer.byteLength(id)) - 1);
    o.stringBody(id);
    return { no: 1, wireType: LEN, data: o.buf };
  });
  const ttl = Writer.sized(lenField(timeSize(leaseTtlMs)) - 1);
  ttl.timeBody(leaseTtlMs);
  unknown.push({ no: 2, wireType: LEN, data: ttl.buf });
  if (seq !== 0n) {
    const o = Writer.sized(uint64Size(seq));
    o.uint64(seq);
    unknown.push({ no: 3, wireType: WireType.Varint, data: o.buf });
  }
  return withBytes(7, unknown, serverMessage({ case: 'renewed', value: renewedOf(unknown) }));
}
