/**
 * An agent's frame over the gRPC listener's size limit (8 MiB) ends its stream with
 * RESOURCE_EXHAUSTED before it is read, and the coordinator says which agent sent how much: an
 * agent whose outbox resends such a report would otherwise reconnect and be cut off again with
 * nothing in the coordinator's log but an HTTP/2 reset.
 */
import http2 from 'node:http2';
import { Writable } from 'node:stream';
import pino from 'pino';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { AgentMessageSchema, ServerMessageSchema, type ServerMessage } from '../gen/leasehold/v1/agent_service_pb.js';
import { loadConfig } from '../server/config.js';
import { startCoordinator, type Coordinator } from '../server/coordinator.js';
import { agentCreate } from '../server/store/index.js';
import { AGENT_CONNECT_PATH } from '../server/transport/agent-lane.js';
import { READ_MAX_BYTES } from '../server/transport/server.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();
const lines: Array<Record<string, unknown>> = [];
let c: Coordinator;

beforeAll(async () => {
  const sink = new Writable({
    write(chunk: Buffer, _enc, done) {
      for (const l of chunk.toString().split('\n')) if (l) lines.push(JSON.parse(l) as Record<string, unknown>);
      done();
    },
  });
  const config = loadConfig({ grpcAddr: '127.0.0.1:0', httpAddr: '127.0.0.1:0' }, { DATABASE_URL: t.url, LEASEHOLD_ADMIN_KEY: 'frame-limit-admin' });
  c = await startCoordinator(config, pino({ level: 'warn' }, sink));
});
afterAll(async () => {
  await c?.stop();
});

it('ends the stream of an agent sending a frame over the limit, and logs the agent and the size', async () => {
  const created = await agentCreate(t.pool, { agentId: 'big-sender' });
  if (created.outcome !== 'ok') throw new Error(JSON.stringify(created));
  const hello = toBinary(
    AgentMessageSchema,
    create(AgentMessageSchema, { kind: { case: 'hello', value: { agentId: 'big-sender', token: created.value.token, queues: ['q'], slots: 1 } } }),
  );
  const session = http2.connect(`http://127.0.0.1:${c.grpc.address.port}`);
  try {
    const s = session.request({ ':method': 'POST', ':path': AGENT_CONNECT_PATH, 'content-type': 'application/grpc', te: 'trailers' });
    const messages: ServerMessage[] = [];
    let pending = Buffer.alloc(0);
    let trailers: http2.IncomingHttpHeaders = {};
    const declared = READ_MAX_BYTES + 1000;
    s.on('data', (chunk: Buffer) => {
      pending = Buffer.concat([pending, chunk]);
      while (pending.length >= 5 && pending.length >= 5 + pending.readUInt32BE(1)) {
        const n = pending.readUInt32BE(1);
        messages.push(fromBinary(ServerMessageSchema, pending.subarray(5, 5 + n)));
        pending = pending.subarray(5 + n);
        // Welcomed: now the header of a frame over the limit (its body never needs to come).
        if (messages.length === 1) {
          const head = Buffer.alloc(5);
          head.writeUInt32BE(declared, 1);
          s.write(head);
        }
      }
    });
    s.on('trailers', (h) => {
      trailers = h;
      s.end(); // as gRPC clients do: the call is over
    });
    s.on('error', () => undefined);
    const frame = Buffer.alloc(5 + hello.length);
    frame.writeUInt32BE(hello.length, 1);
    frame.set(hello, 5);
    s.write(frame);
    await new Promise((r) => s.on('close', r));
    expect(messages[0]?.kind.case).toBe('welcome');
    expect(trailers['grpc-status']).toBe('8'); // RESOURCE_EXHAUSTED
    const line = lines.find((l) => l.msg === 'agent stream ended: a message over the size limit');
    expect(line).toMatchObject({ agentId: 'big-sender', err: `message size ${declared} is larger than configured readMaxBytes ${READ_MAX_BYTES}` });
  } finally {
    session.close();
  }
});
