/**
 * Why the agent cannot connect, said where its user looks: a connection that cannot be made (a
 * closed port, a TLS certificate of a CA the agent does not trust) ends the stream with its reason
 * (`Connection dropped: connect ECONNREFUSED …`, `… unable to verify the first certificate`) in
 * the `disconnected` event and the reconnect's log line, and `leasehold-agent --check` gives up
 * saying the last one, with how to trust the CA. The coordinator's stand-in is a bare HTTP/2 TLS
 * server: nothing here gets as far as a Hello being read.
 */
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import http2 from 'node:http2';
import type { AddressInfo } from 'node:net';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pino from 'pino';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { createAgent, type Agent } from '@leasehold/agent-client';
import { waitFor } from './helpers/coordinator.js';
import { freePort } from './helpers/ports.js';
import { makePrivateCa, type PrivateCa } from './helpers/private-ca.js';
import { root } from './helpers/serve.js';

let ca: PrivateCa;
let tlsServer: http2.Http2SecureServer;
const sessions = new Set<http2.ServerHttp2Session>();
let work: string;
const agents: Agent[] = [];

beforeAll(async () => {
  ca = await makePrivateCa();
  work = await mkdtemp(path.join(os.tmpdir(), 'leasehold-connect-errors-'));
  tlsServer = http2.createSecureServer(ca.pem);
  tlsServer.on('session', (s) => (sessions.add(s), s.on('close', () => sessions.delete(s))));
  // Past TLS, every stream is refused as a coordinator refuses a bad token (trailers-only).
  tlsServer.on('stream', (stream) => stream.respond({ ':status': 200, 'content-type': 'application/grpc', 'grpc-status': '16', 'grpc-message': 'the stand-in refuses every token' }, { endStream: true }));
  await new Promise<void>((r) => tlsServer.listen(0, '127.0.0.1', () => r()));
});
afterEach(async () => {
  for (const a of agents.splice(0)) await a.stop();
});
afterAll(async () => {
  for (const s of sessions) s.destroy();
  await new Promise((r) => tlsServer.close(r));
  await rm(ca.dir, { recursive: true, force: true });
  await rm(work, { recursive: true, force: true });
});
const tlsUrl = () => `https://localhost:${(tlsServer.address() as AddressInfo).port}`;

/** An agent logging into `lines`, reconnecting quickly; its `start()` settles into `started`. */
async function agentTo(url: string, extra: { tls?: { ca: string } } = {}) {
  const lines: Array<Record<string, unknown>> = [];
  const log = pino({ level: 'info' }, { write: (s: string) => void lines.push(JSON.parse(s) as Record<string, unknown>) });
  const outboxDir = await mkdtemp(path.join(work, 'outbox-'));
  const agent = createAgent({ url, token: 'lh_agent_x', outboxDir, handleSignals: false, log, reconnect: { baseMs: 20, maxMs: 100 }, ...extra });
  agents.push(agent);
  agent.handle('q', () => ({}));
  const started = agent.start().then(
    () => undefined,
    (err: Error) => err,
  );
  return { agent, lines, started };
}

const reconnectLine = (lines: Array<Record<string, unknown>>) => waitFor('the reconnect log line', () => lines.find((l) => l.msg === 'disconnected from the coordinator; reconnecting'));

describe('an agent that cannot connect says why', () => {
  it('a closed port: connect ECONNREFUSED, in the disconnected event and the log', async () => {
    const port = await freePort();
    const { agent, lines } = await agentTo(`http://127.0.0.1:${port}`);
    const [{ error }] = await once(agent, 'disconnected');
    expect(error?.message).toBe(`14 UNAVAILABLE: Connection dropped: connect ECONNREFUSED 127.0.0.1:${port}`);
    expect((await reconnectLine(lines)).err).toBe(`Connection dropped: connect ECONNREFUSED 127.0.0.1:${port}`);
  });

  it("a TLS certificate of a CA it does not trust: unable to verify the first certificate; with tls.ca it gets through", async () => {
    const { agent, lines } = await agentTo(tlsUrl());
    const [{ error }] = await once(agent, 'disconnected');
    expect(error?.message).toBe('14 UNAVAILABLE: Connection dropped: unable to verify the first certificate');
    expect((await reconnectLine(lines)).err).toBe('Connection dropped: unable to verify the first certificate');

    // Trusting the CA, TLS holds and the stand-in's refusal is what ends the start.
    const trusted = await agentTo(tlsUrl(), { tls: { ca: ca.ca } });
    expect(await trusted.started).toEqual(new Error('the coordinator refused this agent: the stand-in refuses every token'));
  });
});

describe('leasehold-agent --check', () => {
  it('gives up after 10 s with the last reason and how to trust the CA', async () => {
    const config = path.join(work, 'agent.json');
    await writeFile(config, JSON.stringify({ url: tlsUrl(), token: 'lh_agent_x', outboxDir: path.join(work, 'check-outbox'), queues: { q: { command: ['true'] } } }));
    const child = spawn(process.execPath, ['agent-client/bin/leasehold-agent.mjs', '--config', config, '--check'], { cwd: root, env: { ...process.env, LEASEHOLD_LOG_LEVEL: 'silent' }, stdio: ['ignore', 'pipe', 'pipe'] });
    let stderr = '';
    child.stdout.resume();
    child.stderr.on('data', (d: Buffer) => (stderr += d));
    const [code] = (await once(child, 'close')) as [number | null];
    expect(code).toBe(1);
    expect(stderr).toBe(
      `leasehold-agent: cannot reach the coordinator at ${tlsUrl()} within 10 s: Connection dropped: unable to verify the first certificate` +
        ` (the coordinator's TLS certificate is not trusted: set "tls": {"ca": "ca.pem"} to the CA that signed it, or NODE_EXTRA_CA_CERTS=ca.pem to trust it beside the public ones)\n`,
    );
  });
});
