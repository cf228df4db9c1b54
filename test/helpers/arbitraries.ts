/**
 * fast-check arbitraries of the store's shapes, shared by the codec tests: random jobs with every
 * field set or not, payloads of any JSON, labels, errors, times.
 */
import fc from 'fast-check';
import type { Claimed, Job } from '../../server/store/index.js';

// Keys named __proto__ aside: protobuf-es drops them from a Struct it builds (assigning one sets
// the object's prototype), where the hand encoder keeps them.
const key = fc.string({ maxLength: 8 }).filter((k) => k !== '__proto__');
export const json = fc.jsonValue({ maxDepth: 3 }).map((v) => JSON.parse(JSON.stringify(v), (k, x) => (k === '__proto__' ? undefined : x)) as unknown);
export const object = fc.dictionary(key, json, { maxKeys: 5 });
// Mostly after 1970; now and then before (negative seconds take another path).
const time = fc.oneof({ weight: 9, arbitrary: fc.integer({ min: 0, max: 4_102_444_800_000 }) }, { weight: 1, arbitrary: fc.integer({ min: -2_208_988_800_000, max: 0 }) }).map((ms) => new Date(ms));
const maybe = <T>(a: fc.Arbitrary<T>) => fc.option(a, { nil: null });

export const job: fc.Arbitrary<Job> = fc.record({
  id: fc.uuid(),
  queue: fc.string({ minLength: 1, maxLength: 20 }),
  payload: object,
  priority: fc.integer({ min: -32767, max: 32767 }),
  status: fc.constantFrom('queued', 'claimed', 'running', 'succeeded', 'failed', 'dead', 'canceled' as const),
  runAt: time,
  maxAttempts: fc.integer({ min: 1, max: 1000 }),
  attemptNo: fc.integer({ min: 0, max: 1000 }),
  attemptsStarted: fc.integer({ min: 0, max: 1000 }),
  currentAttemptId: maybe(fc.uuid()),
  agentId: maybe(fc.string({ maxLength: 12 })),
  claimedAt: maybe(time),
  claimDeadline: maybe(time),
  startedAt: maybe(time),
  suspectSince: maybe(time),
  leaseExpiresAt: maybe(time),
  heartbeatAt: maybe(time),
  executionTimeoutMs: maybe(fc.integer({ min: 1, max: 604_800_000 })),
  executionDeadline: maybe(time),
  idempotencyKey: maybe(fc.string({ maxLength: 20 })),
  labels: fc.dictionary(key.filter((k) => k.length > 0), fc.string({ maxLength: 6 }), { maxKeys: 4 }),
  progress: maybe(json),
  result: maybe(object),
  error: maybe(object),
  notifyUrl: maybe(fc.webUrl()),
  createdAt: time,
  updatedAt: time,
  finishedAt: maybe(time),
}) as fc.Arbitrary<Job>;

export const claimed: fc.Arbitrary<Claimed> = fc.record({
  job,
  slot: fc.nat(),
  agentId: fc.string(),
  attemptId: fc.uuid(),
  attemptNo: fc.integer({ min: 1, max: 1000 }),
  claimDeadline: time,
});
