/**
 * The hand codecs against protobuf-es, on random messages: the agent's (agent-client/src/codec.ts)
 * and the coordinator's reader of the agent's messages (server/transport/agent-codec.ts). What
 * they decode is what `fromBinary` gives, field for field and type for type; what the agent
 * encodes is what `toBinary` writes, byte for byte; bytes they do not expect (mutated, cut,
 * unknown fields) are decoded by protobuf-es, so they end as protobuf-es ends them.
 */
import { create, fromBinary, toBinary, type JsonObject } from '@bufbuild/protobuf';
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { AgentMessageSchema, ServerMessageSchema } from '../agent-client/src/gen/leasehold/v1/agent_service_pb.js';
import { decodeServerMessage, encodeAgentMessage, readServerMessageByHand, type AgentMessageInit } from '../agent-client/src/codec.js';
import { decodeAgentMessage, readAgentMessageByHand } from '../server/transport/agent-codec.js';
import { assignMessage } from '../server/transport/assign-codec.js';
import { claimed } from './helpers/arbitraries.js';

const key = fc.string({ maxLength: 8 }).filter((k) => k !== '__proto__');
const json = fc.jsonValue({ maxDepth: 3 }).map((v) => JSON.parse(JSON.stringify(v), (k, x) => (k === '__proto__' ? undefined : x)) as unknown);
const object = fc.dictionary(key, json, { maxKeys: 5 }) as fc.Arbitrary<JsonObject>;
const id = fc.oneof(fc.uuid(), fc.string({ maxLength: 10 }));
const seq = fc.oneof(fc.constant(0n), fc.bigInt({ min: 1n, max: 1000n }), fc.bigInt({ min: 0n, max: 2n ** 64n - 1n }));
const int32 = fc.integer({ min: -(2 ** 31), max: 2 ** 31 - 1 });
const duration = fc.record({ seconds: fc.bigInt({ min: 0n, max: 315_576_000_000n }), nanos: fc.integer({ min: 0, max: 999_999_999 }) });

/** The bytes of a ServerMessage the coordinator sends once per job (assign, ack, renewed). */
const serverBytes: fc.Arbitrary<Uint8Array> = fc.oneof(
  // Assign as the coordinator writes it (by hand, server/transport/assign-codec.ts).
  fc.array(claimed.map((c) => ({ ...c, job: { ...c.job, progress: null } })), { maxLength: 5 }).map((jobs) => toBinary(ServerMessageSchema, assignMessage(jobs))),
  fc
    .array(
      fc.record(
        {
          attemptId: id,
          outcome: fc.integer({ min: 0, max: 9 }),
          storedResult: object,
          current: fc.record({ jobId: id, status: fc.integer({ min: 0, max: 8 }), attemptNo: int32, currentAttemptId: id }),
          message: fc.string({ maxLength: 12 }),
        },
        { requiredKeys: ['attemptId', 'outcome'] },
      ),
      { maxLength: 5 },
    )
    .map((items) => toBinary(ServerMessageSchema, create(ServerMessageSchema, { kind: { case: 'ack', value: { items } } }))),
  fc
    .record({ attemptIds: fc.array(id, { maxLength: 6 }), leaseTtl: fc.option(duration, { nil: undefined }), seq })
    .map((value) => toBinary(ServerMessageSchema, create(ServerMessageSchema, { kind: { case: 'renewed', value } }))),
);

describe('decoding a ServerMessage by hand', () => {
  it('gives what protobuf-es gives, and reads every assign, ack and renewed itself', () => {
    fc.assert(
      fc.property(serverBytes, (bytes) => {
        const byHand = readServerMessageByHand(Buffer.from(bytes));
        expect(byHand).toBeDefined();
        expect(byHand).toStrictEqual(fromBinary(ServerMessageSchema, bytes));
      }),
      { numRuns: 1000 },
    );
  });

  it('leaves the rest to protobuf-es: other kinds, a job with progress, unknown fields', () => {
    const welcome = toBinary(ServerMessageSchema, create(ServerMessageSchema, { kind: { case: 'welcome', value: { sessionId: 's' } } }));
    const withProgress = create(ServerMessageSchema, {
      kind: { case: 'assign', value: { jobs: [{ attemptId: 'a', job: { id: 'j', progress: { kind: { case: 'numberValue', value: 1 } } } }] } },
    });
    const unknown = create(ServerMessageSchema, { kind: { case: 'renewed', value: { attemptIds: ['a'] } } });
    unknown.kind.value!.$unknown = [{ no: 9, wireType: 0, data: new Uint8Array([1]) }];
    for (const bytes of [welcome, toBinary(ServerMessageSchema, withProgress), toBinary(ServerMessageSchema, unknown)]) {
      expect(readServerMessageByHand(Buffer.from(bytes))).toBeUndefined();
      expect(decodeServerMessage(bytes)).toStrictEqual(fromBinary(ServerMessageSchema, bytes));
    }
  });

  it('ends as protobuf-es does on bytes mutated or cut', () => {
    const outcome = (f: () => unknown) => {
      try {
        return { ok: f() };
      } catch (e) {
        return { error: (e as Error).message };
      }
    };
    fc.assert(
      fc.property(serverBytes, fc.array(fc.tuple(fc.nat(), fc.integer({ min: 0, max: 255 })), { maxLength: 3 }), fc.nat(), (bytes, flips, cut) => {
        const b = Buffer.from(bytes);
        for (const [at, v] of flips) if (b.length) b[at % b.length] = v;
        const cutAt = b.length ? cut % (b.length + 1) : 0;
        const mutated = b.subarray(0, cutAt);
        expect(outcome(() => decodeServerMessage(mutated))).toStrictEqual(outcome(() => fromBinary(ServerMessageSchema, mutated)));
      }),
      { numRuns: 2000 },
    );
  });
});

const agentMessage: fc.Arbitrary<AgentMessageInit> = fc.oneof(
    fc.record({ attemptIds: fc.array(id, { maxLength: 6 }), seq }, { requiredKeys: [] }).map((value) => ({ kind: { case: 'started' as const, value } })),
    fc.record({ n: int32 }, { requiredKeys: [] }).map((value) => ({ kind: { case: 'credit' as const, value } })),
    fc
      .tuple(fc.array(fc.record({ attemptId: id, result: object }, { requiredKeys: [] }), { maxLength: 5 }), fc.option(int32, { nil: undefined }))
      .map(([results, credit]) => ({ kind: { case: 'completed' as const, value: { results, ...(credit === undefined ? {} : { credit }) } } })),
    fc.record({ seq }, { requiredKeys: [] }).map((value) => ({ kind: { case: 'heartbeat' as const, value } })),
    // Not written by hand: protobuf-es's, through the same call.
    fc.record({ drain: fc.boolean() }).map((value) => ({ kind: { case: 'bye' as const, value } })),
    fc.record({ queues: fc.array(fc.string(), { maxLength: 3 }), slots: int32, seq }).map((value) => ({ kind: { case: 'hello' as const, value } })),
  );

describe('encoding an AgentMessage by hand', () => {
  it('writes what protobuf-es writes, byte for byte', () => {
    fc.assert(
      fc.property(agentMessage, (m) => {
        expect(encodeAgentMessage(m).toString('hex')).toBe(Buffer.from(toBinary(AgentMessageSchema, create(AgentMessageSchema, m))).toString('hex'));
      }),
      { numRuns: 1000 },
    );
  });

  it('writes a result that is not JSON as protobuf-es does', () => {
    const odd = { u: undefined, d: new Date(0), nested: { n: Number.NaN, list: [undefined, -0, 1e300] } } as unknown as JsonObject;
    const m: AgentMessageInit = { kind: { case: 'completed', value: { results: [{ attemptId: 'a', result: odd }] } } };
    expect(encodeAgentMessage(m).toString('hex')).toBe(Buffer.from(toBinary(AgentMessageSchema, create(AgentMessageSchema, m))).toString('hex'));
  });
});

describe("decoding an AgentMessage by hand (the coordinator's agent lane)", () => {
  const agentBytes = agentMessage.map((m) => toBinary(AgentMessageSchema, create(AgentMessageSchema, m)));
  const outcome = (f: () => unknown) => {
    try {
      return { ok: f() };
    } catch (e) {
      return { error: (e as Error).message };
    }
  };

  it('gives what protobuf-es gives, and reads every started, completed and credit itself', () => {
    fc.assert(
      fc.property(agentBytes, (bytes) => {
        const buf = Buffer.from(bytes);
        const reference = fromBinary(AgentMessageSchema, buf);
        const byHand = readAgentMessageByHand(buf);
        if (['started', 'completed', 'credit'].includes(reference.kind.case ?? '')) expect(byHand).toBeDefined();
        else expect(byHand).toBeUndefined();
        expect(decodeAgentMessage(buf)).toStrictEqual(reference);
      }),
      { numRuns: 1000 },
    );
  });

  it('leaves the rest to protobuf-es: unknown fields, a field repeated, a result met twice', () => {
    const unknown = create(AgentMessageSchema, { kind: { case: 'started', value: { attemptIds: ['a'] } } });
    unknown.kind.value!.$unknown = [{ no: 9, wireType: 0, data: new Uint8Array([1]) }];
    const started = toBinary(AgentMessageSchema, create(AgentMessageSchema, { kind: { case: 'started', value: { attemptIds: ['a'], seq: 1n } } }));
    const result = toBinary(AgentMessageSchema, create(AgentMessageSchema, { kind: { case: 'completed', value: { results: [{ attemptId: 'a', result: { x: 1 } }] } } }));
    // A Result (attempt_id "a") whose struct field (tag 18) comes twice: protobuf-es merges the two.
    const resultBody = Buffer.from([0x0a, 0x01, 0x61, 0x12, 0x00, 0x12, 0x00]);
    const completedBody = Buffer.concat([Buffer.from([0x0a, resultBody.length]), resultBody]);
    const twice = Buffer.concat([Buffer.from([0x2a, completedBody.length]), completedBody]);
    expect(fromBinary(AgentMessageSchema, twice).kind).toMatchObject({ case: 'completed', value: { results: [{ attemptId: 'a', result: {} }] } });
    for (const bytes of [Buffer.from(toBinary(AgentMessageSchema, unknown)), Buffer.concat([started, started]), Buffer.concat([result, result]), twice]) {
      expect(readAgentMessageByHand(bytes)).toBeUndefined();
      // The same Buffer to both: protobuf-es keeps unknown fields as views of what it was given.
      expect(decodeAgentMessage(bytes)).toStrictEqual(fromBinary(AgentMessageSchema, bytes));
    }
  });

  it('ends as protobuf-es does on bytes mutated or cut', () => {
    fc.assert(
      fc.property(agentBytes, fc.array(fc.tuple(fc.nat(), fc.integer({ min: 0, max: 255 })), { maxLength: 3 }), fc.nat(), (bytes, flips, cut) => {
        const b = Buffer.from(bytes);
        for (const [at, v] of flips) if (b.length) b[at % b.length] = v;
        const mutated = b.subarray(0, b.length ? cut % (b.length + 1) : 0);
        expect(outcome(() => decodeAgentMessage(mutated))).toStrictEqual(outcome(() => fromBinary(AgentMessageSchema, mutated)));
      }),
      { numRuns: 2000 },
    );
  });
});

describe('the writer of strings (agent-client/src/wire.ts)', () => {
  it("writes any string as protobuf-es's writer does: ASCII by the short path, the rest (and long ones) as UTF-8", async () => {
    const { BinaryWriter } = await import('@bufbuild/protobuf/wire');
    const { Writer } = await import('../agent-client/src/wire.js');
    const text = fc.oneof(
      fc.string({ maxLength: 140 }),
      fc.string({ unit: 'grapheme', maxLength: 140 }),
      fc.string({ unit: 'binary', maxLength: 140 }),
      fc.tuple(fc.string({ minLength: 120, maxLength: 130 }), fc.constantFrom('é', '\u0080', '\u00ff', '\u{1F600}', '\ud800')).map(([a, b]) => a + b),
    );
    fc.assert(
      fc.property(text, (s) => {
        const theirs = new BinaryWriter().string(s).finish();
        const w = Writer.sized(theirs.length + 8);
        w.stringBody(s);
        expect(Buffer.from(w.buf.subarray(0, w.pos)).toString('hex')).toBe(Buffer.from(theirs).toString('hex'));
      }),
      { numRuns: 3000 },
    );
  });
});
