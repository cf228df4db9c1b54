/**
 * Each side of the agent stream says what it is (review of version skew, finding 3): the SDK
 * sends `Hello.agent_version` (its package's version, Node's, the OS) and the same as its
 * `user-agent`; the coordinator logs it on `agent connected` and answers with
 * `Welcome.coordinator_version`, which the agent logs on its `connected` line. An agent from before
 * the field (a raw grpc-js client that does not set it) still connects, and the log says it sent
 * none; a version is never a reason to refuse, only cut to a length fit for a log line.
 */
import { once } from 'node:events';
import { readFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import http2 from 'node:http2';
import type { AddressInfo } from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { Writable } from 'node:stream';
import pino from 'pino';
import { afterAll, afterEach, beforeAll, expect, it } from 'vitest';
import { createAgent, type Agent } from '@leasehold/agent-client';
import { LaneConnection } from '../agent-client/src/lane.js';
import { loadConfig } from '../server/config.js';
import { startCoordinator, type Coordinator } from '../server/coordinator.js';
import { agentCreate } from '../server/store/index.js';
import { waitFor } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { RawAgent, type HelloInit } from './helpers/raw-agent.js';

type Line = Record<string, unknown>;
const root = path.resolve(import.meta.dirname, '..');
const version = (file: string) => (JSON.parse(readFileSync(path.join(root, file), 'utf8')) as { version: string }).version;
const runtime = `(node ${process.version}; ${process.platform})`;
const AGENT_VERSION = `leasehold-agent-client/${version('agent-client/package.json')} ${runtime}`;
const COORDINATOR_VERSION = `leasehold/${version('package.json')} ${runtime}`;

const t = useTestDb();
const coordinatorLines: Line[] = [];
let c: Coordinator;
let work: string;
const agents: Agent[] = [];
const raws: RawAgent[] = [];

beforeAll(async () => {
  const sink = new Writable({
    write(chunk: Buffer, _enc, done) {
      for (const l of chunk.toString().split('\n')) if (l) coordinatorLines.push(JSON.parse(l) as Line);
      done();
    },
  });
  const config = loadConfig({ grpcAddr: '127.0.0.1:0', httpAddr: '127.0.0.1:0' }, { DATABASE_URL: t.url, LEASEHOLD_ADMIN_KEY: 'versions-admin' });
  c = await startCoordinator(config, pino({ level: 'info' }, sink));
  work = await mkdtemp(path.join(os.tmpdir(), 'leasehold-versions-'));
});
afterEach(async () => {
  for (const a of agents.splice(0)) await a.stop();
  for (const r of raws.splice(0)) r.close();
});
afterAll(async () => {
  await c?.stop();
  if (work) await rm(work, { recursive: true, force: true });
});

async function token(agentId: string): Promise<string> {
  const o = await agentCreate(t.pool, { agentId });
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  return o.value.token;
}
const connectedLine = (agentId: string) => waitFor(`the coordinator's "agent connected" line of ${agentId}`, () => coordinatorLines.find((l) => l.msg === 'agent connected' && l.agentId === agentId));

it("the SDK's agent says its version in Hello and logs the coordinator's from Welcome", async () => {
  const lines: Line[] = [];
  const agent = createAgent({
    url: `http://127.0.0.1:${c.grpc.address.port}`,
    token: await token('versioned'),
    outboxDir: await mkdtemp(path.join(work, 'outbox-')),
    handleSignals: false,
    log: pino({ level: 'info' }, { write: (s: string) => void lines.push(JSON.parse(s) as Line) }),
  });
  agents.push(agent);
  agent.handle('versions', () => ({}));
  await agent.start();

  expect((await connectedLine('versioned')).agentVersion).toBe(AGENT_VERSION);
  const connected = lines.filter((l) => l.event === 'connected');
  expect(connected).toHaveLength(1);
  expect(connected[0]).toMatchObject({ level: 30, msg: 'connected to the coordinator', agentVersion: AGENT_VERSION, coordinatorVersion: COORDINATOR_VERSION });
});

it('an agent from before agent_version (a raw client without it) connects, and is logged as sending none', async () => {
  const hello: HelloInit = { agentId: 'older', token: await token('older'), queues: ['versions'], slots: 1 };
  const raw = RawAgent.open(`127.0.0.1:${c.grpc.address.port}`, hello);
  raws.push(raw);
  const welcome = await raw.next('welcome');
  // The older agent's proto lacks the field: protobuf keeps it unknown and nothing reads it.
  expect(welcome.welcome).toMatchObject({ creditWithReports: true, coordinatorVersion: COORDINATOR_VERSION });
  expect((await connectedLine('older')).agentVersion).toBe('not sent (an agent from before versions were sent)');
  // The stream serves as before: a credit is taken, nothing ends it.
  raw.send({ credit: { n: 1 } });
  await new Promise((r) => setTimeout(r, 200));
  expect(raw.received.map((m) => m.kind)).toEqual(['welcome']);
});

it('a long or odd version is cut for the log, never refused', async () => {
  const hello = { agentId: 'verbose', token: await token('verbose'), queues: ['versions'], slots: 1, agentVersion: `x\n${'v'.repeat(500)}` };
  const raw = RawAgent.open(`127.0.0.1:${c.grpc.address.port}`, hello);
  raws.push(raw);
  await raw.next('welcome');
  expect((await connectedLine('verbose')).agentVersion).toBe(`x?${'v'.repeat(198)}…`);
});

it("the SDK's HTTP/2 lane sends the version as its user-agent", async () => {
  const server = http2.createServer();
  server.on('stream', (stream) => stream.respond({ ':status': 200, 'content-type': 'application/grpc', 'grpc-status': '16' }, { endStream: true }));
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', () => r()));
  const lane = new LaneConnection(`127.0.0.1:${(server.address() as AddressInfo).port}`, false, undefined);
  try {
    const seen = once(server, 'stream');
    const call = lane.connect();
    call.on('error', () => undefined);
    const [, headers] = (await seen) as [http2.ServerHttp2Stream, http2.IncomingHttpHeaders];
    expect(headers['user-agent']).toBe(AGENT_VERSION);
  } finally {
    lane.close();
    await new Promise((r) => server.close(r));
  }
});
