/**
 * The hand-written encodings of `Assign`, `Ack` and `Renewed` (server/transport/assign-codec.ts)
 * write exactly the bytes protobuf-es writes for the same messages (the jobs through
 * `toPbClaimed`), on random ones: every field set or not, payloads of any JSON, labels, errors,
 * times; both through protobuf-es (the messages' unknown fields) and as the whole bytes each
 * message keeps for the agent stream's lane (`handEncoded`).
 */
import { create, toBinary, type JsonObject } from '@bufbuild/protobuf';
import { durationFromMs } from '@bufbuild/protobuf/wkt';
import fc from 'fast-check';
import { expect, it } from 'vitest';
import { ServerMessageSchema } from '../gen/leasehold/v1/agent_service_pb.js';
import type { AckItem } from '../server/core/agent-hub.js';
import { ackMessage, assignMessage, handEncoded, renewedMessage } from '../server/transport/assign-codec.js';
import { toPbClaimed, toPbCurrent } from '../server/transport/codec.js';
import { toPbOutcome } from '../server/transport/outcome-wire.js';
import { claimed, json, object } from './helpers/arbitraries.js';

it('encodes an Assign byte for byte as protobuf-es does', () => {
  fc.assert(
    fc.property(fc.array(claimed, { maxLength: 6 }), (jobs) => {
      const reflective = toBinary(ServerMessageSchema, create(ServerMessageSchema, { kind: { case: 'assign', value: { jobs: jobs.map(toPbClaimed) } } }));
      const m = assignMessage(jobs);
      expect(Buffer.from(toBinary(ServerMessageSchema, m)).toString('hex')).toBe(Buffer.from(reflective).toString('hex'));
      expect(Buffer.from(handEncoded(m)!).toString('hex')).toBe(Buffer.from(reflective).toString('hex'));
    }),
    { numRuns: 500 },
  );
});

const outcome = fc.constantFrom('ok', 'duplicate', 'stale', 'conflict', 'invalid', 'not_found', 'too_large', 'forbidden' as const);
const ackItem: fc.Arbitrary<AckItem> = fc.record(
  {
    attemptId: fc.oneof(fc.uuid(), fc.string({ maxLength: 8 })),
    outcome,
    storedResult: fc.oneof(fc.constant(undefined), fc.constant(null), object, json),
    current: fc.record({
      jobId: fc.uuid(),
      status: fc.constantFrom('queued', 'claimed', 'running', 'succeeded', 'failed', 'dead', 'canceled' as const),
      attemptNo: fc.integer({ min: 0, max: 1000 }),
      currentAttemptId: fc.option(fc.uuid(), { nil: null }),
    }),
    message: fc.string({ maxLength: 20 }),
  },
  { requiredKeys: ['attemptId', 'outcome', 'message'] },
) as fc.Arbitrary<AckItem>;

it('encodes an Ack byte for byte as protobuf-es does', () => {
  fc.assert(
    fc.property(fc.array(ackItem, { maxLength: 6 }), (items) => {
      const reflective = toBinary(
        ServerMessageSchema,
        create(ServerMessageSchema, {
          kind: {
            case: 'ack',
            value: {
              items: items.map((i) => ({
                attemptId: i.attemptId,
                outcome: toPbOutcome(i.outcome),
                storedResult: typeof i.storedResult === 'object' && i.storedResult !== null && !Array.isArray(i.storedResult) ? (i.storedResult as JsonObject) : undefined,
                current: i.current ? toPbCurrent(i.current) : undefined,
                message: i.message,
              })),
            },
          },
        }),
      );
      const m = ackMessage(items);
      expect(Buffer.from(toBinary(ServerMessageSchema, m)).toString('hex')).toBe(Buffer.from(reflective).toString('hex'));
      expect(Buffer.from(handEncoded(m)!).toString('hex')).toBe(Buffer.from(reflective).toString('hex'));
    }),
    { numRuns: 500 },
  );
});

it('encodes a Renewed byte for byte as protobuf-es does', () => {
  fc.assert(
    fc.property(
      fc.array(fc.oneof(fc.uuid(), fc.string({ maxLength: 8 })), { maxLength: 8 }),
      fc.oneof(fc.integer({ min: 0, max: 86_400_000 }), fc.integer({ min: -5000, max: -1 })),
      fc.oneof(fc.constant(0n), fc.bigInt({ min: 0n, max: 2n ** 64n - 1n })),
      (attemptIds, leaseTtlMs, seq) => {
        const reflective = toBinary(ServerMessageSchema, create(ServerMessageSchema, { kind: { case: 'renewed', value: { attemptIds, leaseTtl: durationFromMs(leaseTtlMs), seq } } }));
        const m = renewedMessage(attemptIds, leaseTtlMs, seq);
        expect(Buffer.from(toBinary(ServerMessageSchema, m)).toString('hex')).toBe(Buffer.from(reflective).toString('hex'));
        // A negative lease is left to protobuf-es whole: no bytes kept.
        if (leaseTtlMs >= 0) expect(Buffer.from(handEncoded(m)!).toString('hex')).toBe(Buffer.from(reflective).toString('hex'));
        else expect(handEncoded(m)).toBeUndefined();
      },
    ),
    { numRuns: 500 },
  );
});

it("makes the messages' objects as create() does (the same keys and zero values, the bytes kept aside)", () => {
  const strip = <T extends { $unknown?: unknown }>(m: T) => ({ ...m, $unknown: undefined });
  const jobs = fc.sample(claimed, 2);
  const assign = assignMessage(jobs);
  const a = assign.kind.value as { $unknown?: unknown };
  expect(strip(a)).toStrictEqual(strip(create(ServerMessageSchema, { kind: { case: 'assign', value: {} } }).kind.value as { $unknown?: unknown }));
  expect(Object.keys(assign).sort()).toEqual(Object.keys(create(ServerMessageSchema)).sort());
  expect(assign.$typeName).toBe(ServerMessageSchema.typeName);
  const ack = ackMessage([{ attemptId: 'a', outcome: 'ok', message: '' } as AckItem]);
  expect(strip(ack.kind.value as { $unknown?: unknown })).toStrictEqual(strip(create(ServerMessageSchema, { kind: { case: 'ack', value: {} } }).kind.value as { $unknown?: unknown }));
  const renewed = renewedMessage(['a'], 1000, 7n);
  expect(strip(renewed.kind.value as { $unknown?: unknown })).toStrictEqual(strip(create(ServerMessageSchema, { kind: { case: 'renewed', value: {} } }).kind.value as { $unknown?: unknown }));
});
