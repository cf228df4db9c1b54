/**
 * The agent's messages as the coordinator's agent lane reads them (agent-lane.ts). `Started`,
 * `Completed` and `Credit`, what a running agent sends for every job, are read by hand with the
 * SDK's reader (agent-client/src/wire.ts), which the SDK uses for the coordinator's messages;
 * everything else, and anything the hand reader does not expect (another kind, an unknown or
 * repeated message field, bytes out of bounds), is decoded by protobuf-es, the reference, which
 * either decodes it or says what is wrong. One at a time, protobuf-es's reflection was 3 % of
 * the coordinator's process (docs/performance.md). test/wire-codec.test.ts holds the two to the
 * same result on random and on mutated messages.
 */
import { fromBinary } from '@bufbuild/protobuf';
import { readByHand, UNEXPECTED, type Reader } from '../../agent-client/src/wire.js';
import {
  AgentMessageSchema,
  type AgentMessage,
  type AgentMessage_Completed,
  type AgentMessage_Completed_Result,
  type AgentMessage_Credit,
  type AgentMessage_Started,
} from '../../gen/leasehold/v1/agent_service_pb.js';

/** An `AgentMessage` from its bytes, as `fromBinary(AgentMessageSchema, bytes)` gives it (or throws). */
export function decodeAgentMessage(bytes: Buffer): AgentMessage {
  return readAgentMessageByHand(bytes) ?? fromBinary(AgentMessageSchema, bytes);
}

/** The hand reader alone: undefined for what it leaves to protobuf-es. */
export function readAgentMessageByHand(buf: Buffer): AgentMessage | undefined {
  return readByHand(buf, readAgentMessage);
}

// Field tags (number << 3 | wire type) of AgentMessage's oneof: credit = 2, started = 3,
// completed = 5, each a length-delimited message.
const CREDIT = 18;
const STARTED = 26;
const COMPLETED = 42;

function readAgentMessage(r: Reader): AgentMessage {
  if (r.end === 0) throw UNEXPECTED;
  const tag = r.varint();
  if (tag !== CREDIT && tag !== STARTED && tag !== COMPLETED) throw UNEXPECTED;
  const end = r.len();
  let kind: AgentMessage['kind'];
  if (tag === CREDIT) kind = { case: 'credit', value: readCredit(r, end) };
  else if (tag === STARTED) kind = { case: 'started', value: readStarted(r, end) };
  else kind = { case: 'completed', value: readCompleted(r, end) };
  // A second field (the oneof set again, merged or replaced) is protobuf-es's to resolve.
  if (r.pos !== r.end) throw UNEXPECTED;
  return { $typeName: 'leasehold.v1.AgentMessage', kind };
}

function readCredit(r: Reader, end: number): AgentMessage_Credit {
  const c: AgentMessage_Credit = { $typeName: 'leasehold.v1.AgentMessage.Credit', n: 0 };
  while (r.pos < end) {
    if (r.varint() !== 8) throw UNEXPECTED;
    c.n = r.int32();
  }
  if (r.pos !== end) throw UNEXPECTED;
  return c;
}

function readStarted(r: Reader, end: number): AgentMessage_Started {
  const s: AgentMessage_Started = { $typeName: 'leasehold.v1.AgentMessage.Started', attemptIds: [], seq: 0n };
  while (r.pos < end) {
    const tag = r.varint();
    if (tag === 10) s.attemptIds.push(r.string());
    else if (tag === 16) s.seq = r.uint64();
    else throw UNEXPECTED;
  }
  if (r.pos !== end) throw UNEXPECTED;
  return s;
}

function readCompleted(r: Reader, end: number): AgentMessage_Completed {
  const c: AgentMessage_Completed = { $typeName: 'leasehold.v1.AgentMessage.Completed', results: [], credit: 0 };
  while (r.pos < end) {
    const tag = r.varint();
    if (tag === 10) c.results.push(readResult(r, r.len()));
    else if (tag === 16) c.credit = r.int32();
    else throw UNEXPECTED;
  }
  if (r.pos !== end) throw UNEXPECTED;
  return c;
}

function readResult(r: Reader, end: number): AgentMessage_Completed_Result {
  const x: AgentMessage_Completed_Result = { $typeName: 'leasehold.v1.AgentMessage.Completed.Result', attemptId: '' };
  while (r.pos < end) {
    const tag = r.varint();
    if (tag === 10) x.attemptId = r.string();
    else if (tag === 18) {
      // A Struct met twice is merged by protobuf-es: left to it.
      if (x.result !== undefined) throw UNEXPECTED;
      x.result = r.struct(r.len());
    } else throw UNEXPECTED;
  }
  if (r.pos !== end) throw UNEXPECTED;
  return x;
}
