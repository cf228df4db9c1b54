/**
 * The gateway's hand reader of an EnqueueJob body (server/transport/enqueue-request.ts) gives the
 * message protobuf-es's `fromJson` gives, for arbitrary bodies: the fields it reads with values of
 * every JSON type, the fields and names it leaves to protobuf-es, payloads of any JSON, bytes that
 * are not UTF-8. Where it reads a body, the message is the same, key for key; where it does not,
 * protobuf-es reads it (or refuses it) as before.
 */
import { fromJsonString } from '@bufbuild/protobuf';
import fc from 'fast-check';
import { expect, it } from 'vitest';
import { EnqueueJobRequestSchema } from '../gen/leasehold/v1/job_service_pb.js';
import { readEnqueueRequest } from '../server/transport/enqueue-request.js';

const odd = fc.oneof(
  fc.constant(null),
  fc.boolean(),
  fc.string(),
  fc.double(),
  fc.integer(),
  fc.constantFrom(-0, 2 ** 31, -(2 ** 31), 2 ** 31 - 1, 1.5, '5', '1e3'),
  fc.jsonValue(),
);
const int = fc.oneof(fc.integer(), fc.constantFrom(0, -1, 2 ** 31 - 1, -(2 ** 31)));
/** A body of the fields read by hand, their values mostly of the types read. */
const usual = fc.record(
  {
    queue: fc.oneof({ weight: 5, arbitrary: fc.string({ unit: 'grapheme' }) }, fc.string({ unit: 'binary' }), odd),
    payload: fc.oneof({ weight: 5, arbitrary: fc.dictionary(fc.string(), fc.jsonValue({ maxDepth: 4 })) }, odd),
    priority: fc.oneof({ weight: 5, arbitrary: int }, odd),
    maxAttempts: fc.oneof({ weight: 5, arbitrary: int }, odd),
    idempotencyKey: fc.oneof({ weight: 5, arbitrary: fc.string() }, odd),
    notifyUrl: fc.oneof({ weight: 5, arbitrary: fc.webUrl() }, odd),
  },
  { requiredKeys: [] },
);
/** Any body: those fields, others, and other names. */
const body = fc.record(
  {
    queue: fc.oneof(fc.string(), fc.string({ unit: 'grapheme' }), odd),
    payload: fc.oneof(fc.dictionary(fc.string(), fc.jsonValue({ maxDepth: 4 })), fc.object(), odd, fc.constant({ __proto__x: 1 })),
    priority: fc.oneof(int, odd),
    maxAttempts: fc.oneof(int, odd),
    max_attempts: int,
    idempotencyKey: fc.oneof(fc.string(), odd),
    notifyUrl: fc.oneof(fc.webUrl(), odd),
    labels: fc.dictionary(fc.string(), fc.string()),
    runAt: fc.constant('2026-01-01T00:00:00Z'),
    other: fc.string(),
  },
  { requiredKeys: [] },
);

/** protobuf-es's reading, or its error's text. */
function reflective(text: string): unknown {
  try {
    return fromJsonString(EnqueueJobRequestSchema, text, { ignoreUnknownFields: false });
  } catch (e) {
    return `error: ${(e as Error).message}`;
  }
}

it('reads an EnqueueJob body as protobuf-es does, or leaves it to protobuf-es', () => {
  let read = 0;
  let total = 0;
  const seen = new Set<number>();
  fc.assert(
    fc.property(fc.oneof({ weight: 4, arbitrary: usual.map((b) => JSON.stringify(b)) }, { weight: 3, arbitrary: body.map((b) => JSON.stringify(b)) }, { weight: 1, arbitrary: fc.string() }), (text) => {
      total++;
      const mine = readEnqueueRequest(Buffer.from(text));
      if (mine === undefined) return;
      read++;
      seen.add(Object.keys(JSON.parse(text) as object).length);
      expect(mine).toStrictEqual(reflective(text));
    }),
    { numRuns: 3000 },
  );
  // Both arms ran: many bodies read by hand, many left (or the comparison above proves little).
  expect(read).toBeGreaterThan(total / 20);
  expect(read).toBeLessThan(total * 0.9);
  expect(seen.size).toBeGreaterThanOrEqual(5);
});

it('reads the bodies n8n sends, and leaves the others to protobuf-es', () => {
  const n8n = '{"queue":"emails","payload":{"to":"a@example.com","n":[1,2.5,null,{"x":true}]},"priority":3,"maxAttempts":5,"idempotencyKey":"k-1","notifyUrl":"https://n8n.example/webhook/1"}';
  expect(readEnqueueRequest(Buffer.from(n8n))).toStrictEqual(reflective(n8n));
  for (const same of ['{"queue":"q"}', '{"queue":"q","priority":-0,"payload":{"a":-0,"b":1e400}}', '{}']) {
    expect(readEnqueueRequest(Buffer.from(same)), same).toStrictEqual(reflective(same));
  }
  for (const left of [
    '{"queue":"q","runAt":"2026-01-01T00:00:00Z"}',
    '{"queue":"q","max_attempts":3}',
    '{"queue":"q","priority":"3"}',
    '{"queue":"q","payload":null}',
    '{"queue":"q","payload":{"__proto__":{"a":1}}}',
    '{"queue":"q","labels":{"a":"b"}}',
    '\uFEFF{"queue":"q"}',
    '[1]',
    '{"queue":',
  ]) {
    expect(readEnqueueRequest(Buffer.from(left)), left).toBeUndefined();
  }
  expect(readEnqueueRequest(Buffer.from([0x7b, 0x22, 0x71, 0xff, 0x22, 0x3a, 0x31, 0x7d]))).toBeUndefined();
});
