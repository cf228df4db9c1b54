/**
 * What the coordinator says when it ends an agent's stream for what the agent sent:
 * - a frame over the gRPC listener's size limit (8 MiB) ends it with RESOURCE_EXHAUSTED before it
 *   is read, and the log says which agent sent how much: an agent whose outbox resends such a
 *   report would otherwise reconnect and be cut off again with nothing in the coordinator's log
 *   but an HTTP/2 reset;
 * - a message of a kind added to the proto after this release (an agent newer than the
 *   coordinator) is called that, not "empty".
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

/** An agent stream that says Hello, then, once welcomed, sends `after`; what came back. */
async function exchange(agentId: string, after: Buffer): Promise<{ messages: ServerMessage[]; trailers: http2.IncomingHttpHeaders }> {
  const created = await agentCreate(t.pool, { agentId });
  if (created.outcome !== 'ok') throw new Error(JSON.stringify(created));
  const hello = toBinary(AgentMessageSchema, create(AgentMessageSchema, { kind: { case: 'hello', value: { agentId, token: created.value.token, queues: ['q'], slots: 1 } } }));
  const session = http2.connect(`http://127.0.0.1:${c.grpc.address.port}`);
  try {
    const s = session.request({ ':method': 'POST', ':path': AGENT_CONNECT_PATH, 'content-type': 'application/grpc', te: 'trailers' });
    const messages: ServerMessage[] = [];
    let pending = Buffer.alloc(0);
    let trailers: http2.IncomingHttpHeaders = {};
    s.on('data', (chunk: Buffer) => {
      pending = Buffer.concat([pending, chunk]);
      while (pending.length >= 5 && pending.length >= 5 + pending.readUInt32BE(1)) {
        const n = pending.readUInt32BE(1);
        messages.push(fromBinary(ServerMessageSchema, pending.subarray(5, 5 + n)));
        pending = pending.subarray(5 + n);
        if (messages.length === 1) s.write(after);
      }
    });
    s.on('trailers', (h) => {
      trailers = h;
      s.end(); // as gRPC clients do: the call is over
    });
    s.on('error', () => undefined);
    s.write(frame(hello));
    await new Promise((r) => s.on('close', r));
    expect(messages[0]?.kind.case).toBe('welcome');
    return { messages, trailers };
  } finally {
    session.close();
  }
}

const frame = (body: Uint8Array) => {
  const f = Buffer.alloc(5 + body.length);
  f.writeUInt32BE(body.length, 1);
  f.set(body, 5);
  return f;
};
const logged = (msg: string, agentId: string) => lines.find((l) => l.msg === msg && l.agentId === agentId);

it('ends the stream of an agent sending a frame over the limit, and logs the agent and the size', async () => {
  // Only the header of a frame over the limit: its body never needs to come.
  const declared = READ_MAX_BYTES + 1000;
  const head = Buffer.alloc(5);
  head.writeUInt32BE(declared, 1);
  const { trailers } = await exchange('big-sender', head);
  expect(trailers['grpc-status']).toBe('8'); // RESOURCE_EXHAUSTED
  expect(logged('agent stream ended: a message over the size limit', 'big-sender')).toMatchObject({
    err: `message size ${declared} is larger than configured readMaxBytes ${READ_MAX_BYTES}`,
  });
});

it('tells an agent newer than the coordinator that its message kind is unknown, not that it is empty', async () => {
  // Field 8 of AgentMessage, a message kind a later release might add (length-delimited, empty).
  const { trailers } = await exchange('newer-agent', frame(Uint8Array.from([(8 << 3) | 2, 0])));
  expect(trailers['grpc-status']).toBe('3'); // INVALID_ARGUMENT
  const said = decodeURIComponent(String(trailers['grpc-message']));
  expect(said).toContain('AgentMessage of a kind this coordinator does not know (field 8)');
  expect(logged('agent stream ended: protocol violation', 'newer-agent')).toMatchObject({ err: said });
  // A message with nothing in it is still called empty.
  const empty = await exchange('empty-sender', frame(new Uint8Array()));
  expect(decodeURIComponent(String(empty.trailers['grpc-message']))).toContain('empty AgentMessage: set one of hello');
});
