/**
 * Bounded fuzzing (fast-check) of what outsiders can send: the HTTP gateway's JSON and the agent
 * stream's protobuf. Every input here is invalid by construction (not JSON, wrong types, unknown
 * fields, huge strings, deep nesting, unknown enums, random bytes); the server must answer each
 * with a 4xx or INVALID_ARGUMENT, keep serving, and write nothing.
 */
import { fromBinary } from '@bufbuild/protobuf';
import fc from 'fast-check';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Health } from '../gen/grpc/health/v1/health_pb.js';
import { AdminService } from '../gen/leasehold/v1/admin_service_pb.js';
import { AttemptService } from '../gen/leasehold/v1/attempt_service_pb.js';
import { JobService } from '../gen/leasehold/v1/job_service_pb.js';
import { keyCreate } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, useCoordinator } from './helpers/coordinator.js';
import { grpc } from './helpers/raw-agent.js';

const t = useTestDb();
const lh = useCoordinator(t);
const TABLES = ['jobs', 'attempts', 'job_events', 'steps', 'stale_reports'];
const RUNS = Number(process.env.LEASEHOLD_FUZZ_RUNS ?? 150);

async function counts() {
  const out: Record<string, number> = {};
  for (const tb of TABLES) out[tb] = (await t.pool.query(`SELECT count(*)::int AS n FROM ${tb}`)).rows[0].n;
  return out;
}

const METHODS = [
  'leasehold.v1.JobService/EnqueueJob',
  'leasehold.v1.JobService/GetJob',
  'leasehold.v1.JobService/ListJobs',
  'leasehold.v1.JobService/CancelJob',
  'leasehold.v1.AttemptService/ClaimJobs',
  'leasehold.v1.AttemptService/StartAttempt',
  'leasehold.v1.AttemptService/CompleteAttempt',
  'leasehold.v1.AttemptService/FailAttempt',
  'leasehold.v1.AttemptService/RecordStep',
];

/** JSON nested `depth` levels deep. */
const deep = (depth: number, leaf: unknown): unknown => {
  let v = leaf;
  for (let i = 0; i < depth; i++) v = i % 2 ? [v] : { d: v };
  return v;
};

/** Bodies no method accepts. */
const badBody = fc.oneof(
  // Not JSON at all: random bytes, truncated JSON.
  fc.uint8Array({ minLength: 1, maxLength: 200 }).map((b) => Buffer.from(b).toString('latin1')).filter((s) => {
    try {
      JSON.parse(s);
      return false;
    } catch {
      return true;
    }
  }),
  fc.constantFrom('{"queue":', '[1,2', '{"payload": {"a": }}', 'null', '"just a string"', '42', 'true', '[]'),
  // Known fields with the wrong types.
  fc.record({
    queue: fc.oneof(fc.integer(), fc.boolean(), fc.array(fc.string()), fc.constant({})),
    payload: fc.oneof(fc.string(), fc.integer(), fc.array(fc.integer())),
  }).map((o) => JSON.stringify(o)),
  fc.record({ jobId: fc.oneof(fc.integer(), fc.constant(null), fc.array(fc.string())), attemptId: fc.dictionary(fc.string(), fc.string()) }).map((o) => JSON.stringify(o)),
  // Unknown fields.
  fc.dictionary(fc.string({ minLength: 1, maxLength: 12 }).map((k) => `x_${k}`), fc.jsonValue(), { minKeys: 1, maxKeys: 4 }).map((o) => JSON.stringify(o)),
  // Unknown enum values.
  fc.oneof(fc.string({ minLength: 1, maxLength: 20 }), fc.integer({ min: 100, max: 1e6 })).map((status) => JSON.stringify({ status: typeof status === 'string' ? `JOB_STATUS_${status}_NOPE` : status })),
  // Huge strings where ids and names go.
  fc.integer({ min: 300, max: 200_000 }).map((n) => JSON.stringify({ queue: 'q'.repeat(n), jobId: 'f'.repeat(n), attemptId: 'a'.repeat(n), step: 's'.repeat(n) })),
  // Deep nesting inside the payload / result (past the 64 levels allowed) and in the body itself.
  fc.integer({ min: 70, max: 3000 }).map((d) => JSON.stringify({ queue: 'fuzz', payload: deep(d, 1), jobId: 'x', attemptId: 'y', result: deep(d, 1) })),
);

describe('fuzzing the HTTP gateway', () => {
  it(`answers ${RUNS} invalid requests with 4xx JSON, writes nothing, keeps serving`, async () => {
    const before = await counts();
    const statuses = new Map<number, number>();
    await fc.assert(
      fc.asyncProperty(fc.constantFrom(...METHODS), badBody, fc.constantFrom(ADMIN_KEY, 'lh_key_nope', ''), async (method, body, key) => {
        const res = await fetch(`${lh.httpUrl}/${method}`, {
          method: 'POST',
          headers: { 'content-type': 'application/json', ...(key ? { authorization: `Bearer ${key}` } : {}) },
          body,
        });
        const text = await res.text();
        statuses.set(res.status, (statuses.get(res.status) ?? 0) + 1);
        expect(res.status, `${method} ${body.slice(0, 120)} → ${res.status} ${text.slice(0, 200)}`).toBeGreaterThanOrEqual(400);
        expect(res.status).toBeLessThan(500);
        expect(() => JSON.parse(text), `${method} answered non-JSON: ${text.slice(0, 200)}`).not.toThrow();
      }),
      { numRuns: RUNS },
    );
    console.log('gateway fuzz statuses', Object.fromEntries(statuses));
    expect(await counts()).toEqual(before);
    expect((await fetch(`${lh.httpUrl}/healthz`)).status).toBe(200);
  }, 180_000);
});

describe('raw protobuf on every unary method', () => {
  const unary = [JobService, AttemptService, AdminService, Health].flatMap((svc) =>
    svc.methods.filter((m) => m.methodKind === 'unary').map((m) => ({ path: `/${svc.typeName}/${m.name}`, input: m.input })),
  );
  const clients: grpc.Client[] = [];
  afterAll(() => clients.forEach((c) => c.close()));
  const client = () => {
    const c = new grpc.Client(`127.0.0.1:${lh.port}`, grpc.credentials.createInsecure());
    clients.push(c);
    return c;
  };
  // A key that may read and nothing else: the request is decoded (a caller without a key is
  // refused before its body is read), and nothing it decodes into can write.
  let readKey = '';
  beforeAll(async () => {
    const o = await keyCreate(t.pool, { name: 'fuzz-reader', scopes: ['read'] });
    if (o.outcome !== 'ok') throw new Error(o.outcome);
    readKey = o.value.key;
  });
  const call = (c: grpc.Client, path: string, bytes: Buffer) =>
    new Promise<{ code: number; details: string }>((resolve) => {
      const md = new grpc.Metadata();
      md.set('authorization', `Bearer ${readKey}`);
      c.makeUnaryRequest(path, (b: Buffer) => b, (b: Buffer) => b, bytes, md, (err: grpc.ServiceError | null) =>
        resolve(err ? { code: err.code, details: err.details } : { code: grpc.status.OK, details: '' }),
      );
    });
  // Random bytes, and bytes that look like protobuf: a tag of a real field number with every wire
  // type, followed by random bytes (wrong types, truncated lengths).
  const bytes = fc.oneof(
    fc.uint8Array({ minLength: 1, maxLength: 200 }),
    fc.tuple(fc.integer({ min: 1, max: 12 }), fc.integer({ min: 0, max: 7 }), fc.uint8Array({ maxLength: 40 })).map(([field, wire, rest]) =>
      Uint8Array.from([(field << 3) | wire, ...rest]),
    ),
  );

  it(`answers ${RUNS} undecodable requests on gRPC and on the gateway with INVALID_ARGUMENT / 400 naming the message, and keeps serving`, async () => {
    const before = await counts();
    const c = client();
    const seen = { malformed: 0, decodable: 0 };
    await fc.assert(
      fc.asyncProperty(fc.constantFrom(...unary), bytes, async (m, raw) => {
        const b = Buffer.from(raw);
        let decodable = true;
        try {
          fromBinary(m.input, b);
        } catch {
          decodable = false;
        }
        seen[decodable ? 'decodable' : 'malformed']++;
        const g = await call(c, m.path, b);
        const res = await fetch(`${lh.httpUrl}${m.path}`, { method: 'POST', headers: { 'content-type': 'application/proto', authorization: `Bearer ${readKey}` }, body: b });
        const text = await res.text();
        if (!decodable) {
          expect(g.code, `${m.path} gRPC ${g.code} ${g.details}`).toBe(grpc.status.INVALID_ARGUMENT);
          expect(g.details).toMatch(new RegExp(`^malformed ${m.input.typeName.replaceAll('.', '\\.')}: `));
          expect(res.status, `${m.path} HTTP ${res.status} ${text}`).toBe(400);
          expect(JSON.parse(text)).toMatchObject({ code: 'invalid_argument', outcome: 'invalid', message: expect.stringMatching(/^malformed /) });
        } else {
          // Decoded (into some message): whatever the answer, never the server's own failure.
          expect([grpc.status.INTERNAL, grpc.status.UNKNOWN], `${m.path} gRPC ${g.code} ${g.details}`).not.toContain(g.code);
          expect(res.status, `${m.path} HTTP ${res.status} ${text}`).toBeLessThan(500);
        }
      }),
      { numRuns: RUNS },
    );
    console.log('raw protobuf fuzz', seen);
    expect(seen.malformed).toBeGreaterThan(0);
    expect(await counts()).toEqual(before); // the key may only read: nothing could be written
    expect(await call(c, '/grpc.health.v1.Health/Check', Buffer.alloc(0))).toEqual({ code: grpc.status.OK, details: '' });
    expect((await fetch(`${lh.httpUrl}/healthz`)).status).toBe(200);
  }, 180_000);
});

describe('fuzzing the agent stream', () => {
  const clients: grpc.Client[] = [];
  afterAll(() => clients.forEach((c) => c.close()));

  /** Opens Connect with raw bytes as messages; resolves with the status the stream ends with. */
  function rawStream(frames: Buffer[]): Promise<{ code: number; details: string; messages: number }> {
    const client = new grpc.Client(`127.0.0.1:${lh.port}`, grpc.credentials.createInsecure());
    clients.push(client);
    const call = client.makeBidiStreamRequest('/leasehold.v1.AgentService/Connect', (b: Buffer) => b, (b: Buffer) => b);
    let messages = 0;
    return new Promise((resolve) => {
      call.on('data', () => messages++);
      call.on('error', (err: grpc.ServiceError) => resolve({ code: err.code, details: err.details, messages }));
      call.on('end', () => resolve({ code: grpc.status.OK, details: '', messages }));
      for (const f of frames) call.write(f);
      call.end();
    });
  }

  it(`ends ${RUNS} streams of random bytes with INVALID_ARGUMENT (or a clean end), writing nothing`, async () => {
    const before = await counts();
    const codes = new Map<number, number>();
    await fc.assert(
      fc.asyncProperty(fc.array(fc.uint8Array({ minLength: 0, maxLength: 300 }), { minLength: 1, maxLength: 4 }), async (frames) => {
        const r = await rawStream(frames.map((f) => Buffer.from(f)));
        codes.set(r.code, (codes.get(r.code) ?? 0) + 1);
        // Bytes that happen to decode as an empty or unknown-field message end as a missing Hello
        // (INVALID_ARGUMENT); a Hello without a valid token is UNAUTHENTICATED; nothing else.
        expect([grpc.status.INVALID_ARGUMENT, grpc.status.UNAUTHENTICATED, grpc.status.OK], `${r.code} ${r.details}`).toContain(r.code);
      }),
      { numRuns: RUNS },
    );
    console.log('stream fuzz codes', Object.fromEntries(codes));
    expect(await counts()).toEqual(before);
    // Still serving: a real agent connects.
    const token = await lh.agent('after-fuzz');
    const { RawAgent } = await import('./helpers/raw-agent.js');
    const a = RawAgent.open(`127.0.0.1:${lh.port}`, { agentId: 'after-fuzz', token, queues: ['q'], slots: 1 });
    try {
      await a.next('welcome');
    } finally {
      a.close();
    }
  }, 180_000);
});
