/**
 * The gateway's EnqueueJob answer written by hand (server/transport/job-json.ts) is byte for
 * byte what protobuf-es writes for the same job with the gateway's JSON options, for arbitrary
 * jobs; where protobuf-es refuses (a date outside years 1–9999), the hand writer steps aside.
 */
import { create, toJsonString } from '@bufbuild/protobuf';
import fc from 'fast-check';
import { expect, it } from 'vitest';
import { OutcomeSchema } from '../gen/leasehold/v1/job_pb.js';
import { EnqueueJobResponseSchema } from '../gen/leasehold/v1/job_service_pb.js';
import type { Job } from '../server/store/index.js';
import { toPbJob } from '../server/transport/codec.js';
import { enqueueAnswerJson } from '../server/transport/job-json.js';
import { job } from './helpers/arbitraries.js';

const byProtobufEs = (j: Job, outcome: number) =>
  toJsonString(EnqueueJobResponseSchema, create(EnqueueJobResponseSchema, { job: toPbJob(j), outcome }), { alwaysEmitImplicit: true });
const outcome = fc.constantFrom(...OutcomeSchema.values.map((v) => v.number));

it('writes what protobuf-es writes, for any job and outcome', () => {
  fc.assert(
    fc.property(job, outcome, (j, o) => {
      expect(enqueueAnswerJson(j, o)).toBe(byProtobufEs(j, o));
    }),
    { numRuns: 2000 },
  );
});

it('steps aside for dates protobuf-es will not write', () => {
  fc.assert(
    fc.property(job, fc.constantFrom(Date.parse('+010000-01-01T00:00:00Z'), Date.parse('0000-12-31T23:59:59.999Z')), (j, far) => {
      const odd = { ...j, runAt: new Date(far) };
      expect(enqueueAnswerJson(odd, 1)).toBeUndefined();
      expect(() => byProtobufEs(odd, 1)).toThrow(/must be from 0001-01-01T00:00:00Z/);
    }),
    { numRuns: 50 },
  );
  // The edges themselves are written.
  const [some] = fc.sample(job, { numRuns: 1, seed: 1 });
  for (const ms of [Date.parse('0001-01-01T00:00:00Z'), Date.parse('9999-12-31T23:59:59.999Z')]) {
    const j = { ...some!, runAt: new Date(ms) };
    expect(enqueueAnswerJson(j, 1)).toBe(byProtobufEs(j, 1));
  }
});
