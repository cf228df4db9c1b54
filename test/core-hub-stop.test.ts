/**
 * `AgentHub.stop()` and a Hello still being answered: a session that finishes opening after the
 * hub began to stop is told to go (GoAway, then UNAVAILABLE) like every other, and given no
 * work; before, it was missed by stop()'s GoAways and its agent only learned of the stop when
 * the server reset the stream seconds later.
 */
import { Code } from '@connectrpc/connect';
import pino from 'pino';
import { afterEach, expect, it } from 'vitest';
import { AgentHub } from '../server/core/agent-hub.js';
import { agentCreate } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();
const hubs: AgentHub[] = [];
afterEach(async () => {
  await Promise.all(hubs.splice(0).map((h) => h.stop()));
});

it('tells a session that opens after stop() began to go, and gives it no credit', async () => {
  const hub = new AgentHub(t.pool, pino({ level: 'silent' }), { leaseTtlMs: 30_000, claimTtlMs: 30_000, heartbeatIntervalMs: 500, stallMs: 5_000 });
  hubs.push(hub);
  hub.start();
  const made = await agentCreate(t.pool, { agentId: 'hub-stop' });
  if (made.outcome !== 'ok') throw new Error(JSON.stringify(made));
  let credits = 0;
  hub.on('credit', () => credits++);
  // The Hello's authentication is in flight when the stop begins.
  const opening = hub.open({ agentId: 'hub-stop', token: made.value.token, queues: ['q'], labels: {}, slots: 2, resume: [], seq: 0n });
  const stopping = hub.stop();
  const o = await opening;
  await stopping;
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  const types: string[] = [];
  const ended = await (async () => {
    for await (const m of o.value.out) types.push(m.type);
  })().catch((e: unknown) => e);
  expect(types).toEqual(['welcome', 'goAway']);
  expect(ended).toMatchObject({ code: Code.Unavailable });
  expect(credits).toBe(0);
});
