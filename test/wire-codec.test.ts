/**
 * The agent's hand codec (agent-client/src/codec.ts) against protobuf-es, on random messages:
 * what it decodes is what `fromBinary` gives, field for field and type for type; what it
 * encodes is what `toBinary` writes, byte for byte; bytes it does not expect (mutated, cut,
 * unknown fields) are decoded by protobuf-es, so they end as protobuf-es ends them.
 */
import { create, fromBinary, toBinary, type JsonObject } from '@bufbuild/protobuf';
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { AgentMessageSchema, ServerMessageSchema } from '../agent-client/src/gen/leasehold/v1/agent_service_pb.js';
import { decodeServerMessage, encodeAgentMessage, readServerMessageByHand, type AgentMessageInit } from '../agent-client/src/codec.js';
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

describe('encoding an AgentMessage by hand', () => {
  const message: fc.Arbitrary<AgentMessageInit> = fc.oneof(
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

  it('writes what protobuf-es writes, byte for byte', () => {
    fc.assert(
      fc.property(message, (m) => {
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
