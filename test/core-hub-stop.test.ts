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
import type pg from 'pg';
import { agentCreate } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { makeJob } from './helpers/factories.js';

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

it('tells its streams to go within stopWaitMs when the database stops answering a report in flight', async () => {
  // The database as the hub sees it: answering, until `hang` is set; then no statement returns.
  const hang = { on: false };
  let statementHung!: () => void;
  const hung = new Promise<void>((r) => (statementHung = r));
  const db = new Proxy(t.pool, {
    get(target, prop, receiver) {
      if (prop === 'query') return (...a: unknown[]) => (hang.on ? (statementHung(), new Promise(() => undefined)) : (target.query as (...x: unknown[]) => unknown)(...a));
      const v = Reflect.get(target, prop, receiver) as unknown;
      return typeof v === 'function' ? v.bind(target) : v;
    },
  }) as pg.Pool;
  const lines: Array<Record<string, unknown>> = [];
  const log = pino({ level: 'warn' }, { write: (l: string) => void lines.push(JSON.parse(l) as Record<string, unknown>) });
  const hub = new AgentHub(db, log, { leaseTtlMs: 30_000, claimTtlMs: 30_000, heartbeatIntervalMs: 500, stallMs: 5_000, stopWaitMs: 300 });
  hub.start();
  const made = await agentCreate(t.pool, { agentId: 'hub-stop-hang' });
  if (made.outcome !== 'ok') throw new Error(JSON.stringify(made));
  const job = await makeJob(t.pool, { status: 'running', agentId: 'hub-stop-hang' });
  const o = await hub.open({ agentId: 'hub-stop-hang', token: made.value.token, queues: ['q'], labels: {}, slots: 1, resume: [job.currentAttemptId!], seq: 0n });
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  hang.on = true;
  // The report's statement never returns.
  void hub.handle(o.value, { type: 'completed', results: [{ attemptId: job.currentAttemptId!, result: { ok: true } }] }).catch(() => undefined);
  await hung;
  const t0 = Date.now();
  await hub.stop();
  expect(Date.now() - t0).toBeLessThan(5_000);
  expect(lines.find((l) => String(l.msg).startsWith('the database has not answered the statements in flight'))).toMatchObject({ waitedMs: 300 });
  const types: string[] = [];
  const ended = await (async () => {
    for await (const m of o.value.out) types.push(m.type);
  })().catch((e: unknown) => e);
  expect(types).toContain('goAway');
  expect(ended).toMatchObject({ code: Code.Unavailable });
});
