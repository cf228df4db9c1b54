/**
 * The agent stream's messages, encoded and decoded by hand where they come once per job:
 * `Assign`, `Renewed` and `Ack` read, `Started`, `Completed` and `Credit` written (and a
 * `Heartbeat` without progress). protobuf-es does the rest, and anything the hand reader does
 * not expect (an unknown field, a field twice, a truncated message): it decodes the same bytes
 * again and either understands them or says what is wrong. Measured in the benchmark's agent
 * process, decoding and encoding by reflection were a fifth of its CPU. `assignedJobProblem`
 * says which assigned jobs the agent must not take (ids that are not UUIDs).
 */
import { create, fromBinary, toBinary, type JsonObject, type MessageInitShape } from '@bufbuild/protobuf';
import { WireType } from '@bufbuild/protobuf/wire';
import {
  AgentMessageSchema,
  ServerMessageSchema,
  type ServerMessage,
  type ServerMessage_Ack,
  type ServerMessage_Ack_Item,
  type ServerMessage_Assign,
  type ServerMessage_Renewed,
} from './gen/leasehold/v1/agent_service_pb.js';
import type { ClaimedJob, CurrentState, Job } from './gen/leasehold/v1/job_pb.js';
import { LEN, Reader, UNEXPECTED, Writer, readByHand, int32Size, isObject, lenField, structSize, uint64Size } from './wire.js';

export type AgentMessageInit = MessageInitShape<typeof AgentMessageSchema>;

// ───────────────────────────── reading ─────────────────────────────

const timestamp = (r: Reader) => r.time('google.protobuf.Timestamp', r.len());

/** A message field met twice is merged by protobuf-es: left to it. */
function once(present: unknown): void {
  if (present !== undefined) throw UNEXPECTED;
}

/** A `ServerMessage` from its bytes, as `fromBinary(ServerMessageSchema, bytes)` gives it. */
export function decodeServerMessage(bytes: Uint8Array): ServerMessage {
  const buf = Buffer.isBuffer(bytes) ? bytes : Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  return readServerMessageByHand(buf) ?? fromBinary(ServerMessageSchema, bytes);
}

/** The hand reader alone: undefined for what it leaves to protobuf-es. */
export function readServerMessageByHand(buf: Buffer): ServerMessage | undefined {
  return readByHand(buf, readServerMessage);
}

function readServerMessage(r: Reader): ServerMessage {
  if (r.end === 0) throw UNEXPECTED;
  let kind: ServerMessage['kind'];
  const tag = r.varint();
  if (tag !== 18 && tag !== 26 && tag !== 58) throw UNEXPECTED;
  const end = r.len();
  if (tag === 18) kind = { case: 'assign', value: readAssign(r, end) };
  else if (tag === 26) kind = { case: 'ack', value: readAck(r, end) };
  else if (tag === 58) kind = { case: 'renewed', value: readRenewed(r, end) };
  else throw UNEXPECTED;
  if (r.pos !== r.end) throw UNEXPECTED;
  return { $typeName: 'leasehold.v1.ServerMessage', kind };
}

function readAssign(r: Reader, end: number): ServerMessage_Assign {
  const jobs: ClaimedJob[] = [];
  while (r.pos < end) {
    if (r.varint() !== 10) throw UNEXPECTED;
    jobs.push(readClaimed(r, r.len()));
  }
  if (r.pos !== end) throw UNEXPECTED;
  return { $typeName: 'leasehold.v1.ServerMessage.Assign', jobs };
}

function readClaimed(r: Reader, end: number): ClaimedJob {
  const c: ClaimedJob = { $typeName: 'leasehold.v1.ClaimedJob', attemptId: '', attemptNo: 0 };
  while (r.pos < end) {
    switch (r.varint()) {
      case 10:
        once(c.job);
        c.job = readJob(r, r.len());
        break;
      case 18:
        c.attemptId = r.string();
        break;
      case 24:
        c.attemptNo = r.int32();
        break;
      case 34:
        once(c.claimDeadline);
        c.claimDeadline = timestamp(r);
        break;
      default:
        throw UNEXPECTED;
    }
  }
  if (r.pos !== end) throw UNEXPECTED;
  return c;
}

function readJob(r: Reader, end: number): Job {
  const j: Job = {
    $typeName: 'leasehold.v1.Job',
    id: '',
    queue: '',
    priority: 0,
    status: 0,
    maxAttempts: 0,
    attemptNo: 0,
    attemptsStarted: 0,
    currentAttemptId: '',
    agentId: '',
    idempotencyKey: '',
    notifyUrl: '',
    labels: {},
  };
  while (r.pos < end) {
    switch (r.varint()) {
      case 10:
        j.id = r.string();
        break;
      case 18:
        j.queue = r.string();
        break;
      case 26:
        once(j.payload);
        j.payload = r.struct(r.len());
        break;
      case 32:
        j.priority = r.int32();
        break;
      case 40:
        j.status = r.int32();
        break;
      case 50:
        once(j.runAt);
        j.runAt = timestamp(r);
        break;
      case 56:
        j.maxAttempts = r.int32();
        break;
      case 64:
        j.attemptNo = r.int32();
        break;
      case 72:
        j.attemptsStarted = r.int32();
        break;
      case 82:
        j.currentAttemptId = r.string();
        break;
      case 90:
        j.agentId = r.string();
        break;
      case 98:
        once(j.leaseExpiresAt);
        j.leaseExpiresAt = timestamp(r);
        break;
      case 106:
        once(j.executionTimeout);
        j.executionTimeout = r.time('google.protobuf.Duration', r.len());
        break;
      case 114:
        j.idempotencyKey = r.string();
        break;
      case 122:
        once(j.result);
        j.result = r.struct(r.len());
        break;
      // Fields from 16 on: two-byte tags.
      case 130:
        once(j.error);
        j.error = r.struct(r.len());
        break;
      case 138:
        once(j.createdAt);
        j.createdAt = timestamp(r);
        break;
      case 146:
        once(j.updatedAt);
        j.updatedAt = timestamp(r);
        break;
      case 154:
        once(j.finishedAt);
        j.finishedAt = timestamp(r);
        break;
      case 162:
        j.notifyUrl = r.string();
        break;
      case 170:
        r.entry(j.labels, () => r.string(), '');
        break;
      default:
        // progress (22, a Value kept as a message), unknown fields: protobuf-es's.
        throw UNEXPECTED;
    }
  }
  if (r.pos !== end) throw UNEXPECTED;
  return j;
}

function readAck(r: Reader, end: number): ServerMessage_Ack {
  const items: ServerMessage_Ack_Item[] = [];
  while (r.pos < end) {
    if (r.varint() !== 10) throw UNEXPECTED;
    const itemEnd = r.len();
    const item: ServerMessage_Ack_Item = { $typeName: 'leasehold.v1.ServerMessage.Ack.Item', attemptId: '', outcome: 0, message: '' };
    while (r.pos < itemEnd) {
      switch (r.varint()) {
        case 10:
          item.attemptId = r.string();
          break;
        case 16:
          item.outcome = r.int32();
          break;
        case 26:
          once(item.storedResult);
          item.storedResult = r.struct(r.len());
          break;
        case 34:
          once(item.current);
          item.current = readCurrent(r, r.len());
          break;
        case 42:
          item.message = r.string();
          break;
        default:
          throw UNEXPECTED;
      }
    }
    if (r.pos !== itemEnd) throw UNEXPECTED;
    items.push(item);
  }
  if (r.pos !== end) throw UNEXPECTED;
  return { $typeName: 'leasehold.v1.ServerMessage.Ack', items };
}

function readCurrent(r: Reader, end: number): CurrentState {
  const c: CurrentState = { $typeName: 'leasehold.v1.CurrentState', jobId: '', status: 0, attemptNo: 0, currentAttemptId: '' };
  while (r.pos < end) {
    switch (r.varint()) {
      case 10:
        c.jobId = r.string();
        break;
      case 16:
        c.status = r.int32();
        break;
      case 24:
        c.attemptNo = r.int32();
        break;
      case 34:
        c.currentAttemptId = r.string();
        break;
      default:
        throw UNEXPECTED;
    }
  }
  if (r.pos !== end) throw UNEXPECTED;
  return c;
}

function readRenewed(r: Reader, end: number): ServerMessage_Renewed {
  const m: ServerMessage_Renewed = { $typeName: 'leasehold.v1.ServerMessage.Renewed', attemptIds: [], seq: 0n };
  while (r.pos < end) {
    switch (r.varint()) {
      case 10:
        m.attemptIds.push(r.string());
        break;
      case 18:
        once(m.leaseTtl);
        m.leaseTtl = r.time('google.protobuf.Duration', r.len());
        break;
      case 24:
        m.seq = r.uint64();
        break;
      default:
        throw UNEXPECTED;
    }
  }
  if (r.pos !== end) throw UNEXPECTED;
  return m;
}

// ───────────────────────────── checking ─────────────────────────────

/** Job and attempt ids as the coordinator makes them: UUIDs (8-4-4-4-12 hex digits, any version). */
const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

/** Whether `id` is a UUID, as every job and attempt id the coordinator sends is. */
export function isUuid(id: string): boolean {
  return UUID.test(id);
}

/**
 * Why an assigned job cannot be taken, or undefined when it can: it has no job, or its job id
 * or attempt id is not a UUID. Ids name things on this machine (the runner's pid files are
 * `<attempt id>.json`), so one like `../../x` from a coordinator that is not what it should be
 * must never reach a handler; such a job is declined (`Agent`), never started.
 */
export function assignedJobProblem(c: ClaimedJob): string | undefined {
  if (!c.job) return 'the assignment has no job';
  if (!isUuid(c.job.id)) return `the job id ${JSON.stringify(c.job.id.slice(0, 100))} is not a UUID`;
  if (!isUuid(c.attemptId)) return `the attempt id ${JSON.stringify(c.attemptId.slice(0, 100))} is not a UUID`;
  return undefined;
}

// ───────────────────────────── writing ─────────────────────────────

/** An `AgentMessage` (or what `create` takes for one) as `toBinary` writes it. */
export function encodeAgentMessage(m: AgentMessageInit): Buffer {
  const k = m.kind;
  switch (k?.case) {
    case 'started': {
      const ids = k.value.attemptIds ?? [];
      const seq = k.value.seq ?? 0n;
      let body = seq !== 0n ? 1 + uint64Size(seq) : 0;
      for (const id of ids) body += lenField(Buffer.byteLength(id));
      const w = Writer.sized(lenField(body));
      w.tag(3, LEN);
      w.varint(body);
      for (const id of ids) w.string(1, id);
      if (seq !== 0n) {
        w.tag(2, WireType.Varint);
        w.uint64(seq);
      }
      return w.buf;
    }
    case 'credit': {
      const n = k.value.n ?? 0;
      const body = n !== 0 ? 1 + int32Size(n) : 0;
      const w = Writer.sized(lenField(body));
      w.tag(2, LEN);
      w.varint(body);
      if (n !== 0) {
        w.tag(1, WireType.Varint);
        w.int32(n);
      }
      return w.buf;
    }
    case 'completed': {
      const results = k.value.results ?? [];
      const sizes = results.map((x) => {
        const id = x.attemptId ?? '';
        const result = x.result;
        if (result !== undefined && !isObject(result)) return -1;
        return (id ? lenField(Buffer.byteLength(id)) : 0) + (result ? lenField(structSize(result)) : 0);
      });
      if (sizes.includes(-1)) break;
      const credit = k.value.credit ?? 0;
      let body = credit !== 0 ? 1 + int32Size(credit) : 0;
      for (const s of sizes) body += lenField(s);
      const w = Writer.sized(lenField(body));
      w.tag(5, LEN);
      w.varint(body);
      results.forEach((x, i) => {
        w.tag(1, LEN);
        w.varint(sizes[i]!);
        if (x.attemptId) w.string(1, x.attemptId);
        if (x.result) w.struct(2, x.result as JsonObject);
      });
      if (credit !== 0) {
        w.tag(2, WireType.Varint);
        w.int32(credit);
      }
      return w.buf;
    }
    case 'heartbeat': {
      if (k.value.progress?.length) break;
      const seq = k.value.seq ?? 0n;
      const body = seq !== 0n ? 1 + uint64Size(seq) : 0;
      const w = Writer.sized(lenField(body));
      w.tag(4, LEN);
      w.varint(body);
      if (seq !== 0n) {
        w.tag(2, WireType.Varint);
        w.uint64(seq);
      }
      return w.buf;
    }
  }
  return Buffer.from(toBinary(AgentMessageSchema, create(AgentMessageSchema, m)));
}

/** A report as `reportSize` measures it (an outbox entry). */
interface ReportShape {
  attemptId: string;
  kind: 'completed' | 'failed';
  result?: object;
  error?: { message: string; details?: object };
}

/**
 * Bytes a report takes in a `Completed` or `Failed` message, its field's tag and length
 * included: what it adds to the message, as `toBinary` writes it (at most a few bytes more for
 * a failure, whose `retryable` is counted whether it is set or not).
 */
export function reportSize(e: ReportShape): number {
  const id = e.attemptId ? lenField(Buffer.byteLength(e.attemptId)) : 0;
  if (e.kind === 'completed') return lenField(id + (e.result ? lenField(structSize(e.result as JsonObject)) : 0));
  const err = e.error ? lenField(lenField(Buffer.byteLength(e.error.message)) + (e.error.details ? lenField(structSize(e.error.details as JsonObject)) : 0)) : 0;
  return lenField(id + err + 2);
}
