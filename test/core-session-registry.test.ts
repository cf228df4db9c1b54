/**
 * `SessionRegistry` alone, over a real hub (not started) and real PostgreSQL: a row per open
 * stream, written when the hub opens it and deleted when it closes; a run stamps, restores and
 * sweeps; drain and disconnect act on this coordinator's streams of one agent; `stop()` leaves
 * no row of its coordinator behind.
 */
import { randomUUID } from 'node:crypto';
import { Code, ConnectError } from '@connectrpc/connect';
import pino from 'pino';
import { afterEach, expect, it } from 'vitest';
import { AgentHub, type Session } from '../server/core/agent-hub.js';
import { SessionRegistry, type RegistryRun } from '../server/core/session-registry.js';
import type { AgentOutput } from '../server/core/session.js';
import { agentCreate, sessionRegister } from '../server/store/index.js';
import { interceptPool, sentTo } from './helpers/core.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();
const log = pino({ level: 'silent' });
const registries: SessionRegistry[] = [];

afterEach(async () => {
  await Promise.all(registries.splice(0).map((r) => r.stop()));
  await t.pool.query('DELETE FROM agent_sessions');
});

/** The file's pool, with a promise for the next completion of a named statement. */
function watchedPool() {
  const waiting = new Map<string, Array<() => void>>();
  const db = interceptPool(t.pool, async (q, run) => {
    const res = await run();
    const name = q.name ?? '';
    const ws = waiting.get(name) ?? [];
    waiting.delete(name);
    for (const w of ws) w();
    return res;
  });
  const next = (name: string) => new Promise<void>((r) => waiting.set(name, [...(waiting.get(name) ?? []), r]));
  return { db, next };
}

function setup(config: ConstructorParameters<typeof SessionRegistry>[3] = {}) {
  const hub = new AgentHub(t.pool, log, { leaseTtlMs: 30_000, claimTtlMs: 30_000, heartbeatIntervalMs: 5_000 });
  const w = watchedPool();
  const registry = new SessionRegistry(w.db, hub, log, { intervalMs: 3_600_000, ...config });
  registries.push(registry);
  const tokens = new Map<string, string>();
  const open = async (agentId: string, queues = ['q'], slots = 2): Promise<Session> => {
    if (!tokens.has(agentId)) {
      const made = await agentCreate(t.pool, { agentId });
      if (made.outcome !== 'ok') throw new Error(JSON.stringify(made));
      tokens.set(agentId, made.value.token);
    }
    const o = await hub.open({ agentId, token: tokens.get(agentId)!, queues, labels: { os: 'windows' }, slots, resume: [], seq: 0n });
    if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
    return o.value;
  };
  return { hub, registry, open, next: w.next };
}

async function rows(): Promise<Array<Record<string, unknown>>> {
  return (await t.pool.query(`SELECT id, agent_id, coordinator_id, queues, labels, slots FROM agent_sessions ORDER BY agent_id`)).rows;
}

/** What a session was sent, without `Welcome`; ends its channel. */
async function sent(s: Session): Promise<AgentOutput[]> {
  return (await sentTo(s)).filter((m) => m.type !== 'welcome');
}

it('writes a row for every stream the hub holds: those open before start(), then each as it opens; deletes it as it closes', async () => {
  const { hub, registry, open, next } = setup();
  const early = await open('reg-early');
  let written = next('sessionRegister');
  registry.start();
  registry.start();
  expect(hub.listenerCount('session:open')).toBe(1);
  await written;
  expect(await rows()).toEqual([
    { id: early.id, agent_id: 'reg-early', coordinator_id: registry.coordinatorId, queues: ['q'], labels: { os: 'windows' }, slots: 2 },
  ]);
  written = next('sessionRegister');
  const late = await open('reg-late', ['a', 'b'], 3);
  await written;
  expect((await rows()).map((r) => [r.id, r.queues, r.slots])).toEqual([
    [early.id, ['q'], 2],
    [late.id, ['a', 'b'], 3],
  ]);
  const removed = next('sessionRemove');
  await hub.close(early, { lost: false });
  await removed;
  expect((await rows()).map((r) => r.id)).toEqual([late.id]);
});

it('a run stamps its rows, writes again a row that went missing, and sweeps only the rows nobody stamped for staleAfterMs', async () => {
  const { registry, open, next } = setup({ staleAfterMs: 60_000 });
  const runs: RegistryRun[] = [];
  registry.on('registry:run', (r) => runs.push(r));
  registry.start();
  let written = next('sessionRegister');
  const a = await open('reg-run-a');
  await written;
  written = next('sessionRegister');
  const b = await open('reg-run-b');
  await written;
  // Another coordinator, alive; and one dead for two minutes.
  const alive = randomUUID();
  const dead = randomUUID();
  for (const coordinatorId of [alive, dead]) {
    const r = await sessionRegister(t.pool, { id: randomUUID(), agentId: 'elsewhere', coordinatorId, queues: ['q'], labels: {}, slots: 1, connectedAt: new Date() });
    expect(r.outcome).toBe('ok');
  }
  await t.pool.query(`UPDATE agent_sessions SET seen_at = now() - interval '2 minutes' WHERE coordinator_id = $1`, [dead]);
  expect(await registry.runOnce()).toEqual({ touched: 2, restored: 0, swept: 1 });
  // b's row is lost (swept while this process stalled, say): the next run writes it again.
  await t.pool.query(`DELETE FROM agent_sessions WHERE id = $1`, [b.id]);
  const restored = next('sessionRegister');
  const run = await registry.runOnce();
  await restored;
  expect(run).toEqual({ touched: 1, restored: 1, swept: 0 });
  expect(runs).toEqual([{ touched: 2, restored: 0, swept: 1 }, run]);
  const coordinators = (await rows()).map((r) => [r.id, r.coordinator_id]);
  expect(coordinators).toContainEqual([a.id, registry.coordinatorId]);
  expect(coordinators).toContainEqual([b.id, registry.coordinatorId]);
  expect(coordinators.filter(([, c]) => c === dead)).toEqual([]);
  expect(coordinators.filter(([, c]) => c === alive)).toHaveLength(1);
});

it('drain tells each open stream of the agent once, stops its assignments, and counts its streams', async () => {
  const { registry, open } = setup();
  const one = await open('reg-drain');
  const two = await open('reg-drain');
  const other = await open('reg-busy');
  expect(registry.drain('reg-drain')).toBe(2);
  expect(registry.drain('reg-drain')).toBe(2);
  expect(registry.drain('reg-nobody')).toBe(0);
  expect([one.draining, two.draining, other.draining]).toEqual([true, true, false]);
  expect(one.available).toBe(0);
  expect(await sent(one)).toEqual([{ type: 'drain' }]);
  expect(await sent(two)).toEqual([{ type: 'drain' }]);
  expect(await sent(other)).toEqual([]);
});

it('disconnect ends the open streams of a revoked agent with UNAUTHENTICATED, and no other', async () => {
  const { registry, open } = setup();
  const revoked = await open('reg-revoked');
  const other = await open('reg-kept');
  expect(registry.disconnect('reg-revoked', 'its token was revoked')).toBe(1);
  const reading = (async () => {
    for await (const _ of revoked.out) void _;
  })();
  const err = await reading.then(
    () => undefined,
    (e: unknown) => e,
  );
  expect(err).toBeInstanceOf(ConnectError);
  expect((err as ConnectError).code).toBe(Code.Unauthenticated);
  expect(other.out.closed).toBe(false);
  expect(registry.disconnect('reg-nobody', 'x')).toBe(0);
});

it('stop() deletes this coordinator\'s rows only and stops following the hub; twice is harmless', async () => {
  const { hub, registry, open, next } = setup();
  const written = next('sessionRegister');
  registry.start();
  await open('reg-stop');
  await written;
  const theirs = randomUUID();
  await sessionRegister(t.pool, { id: randomUUID(), agentId: 'elsewhere', coordinatorId: theirs, queues: ['q'], labels: {}, slots: 1, connectedAt: new Date() });
  await registry.stop();
  await registry.stop();
  expect((await rows()).map((r) => r.coordinator_id)).toEqual([theirs]);
  // No longer following the hub: a stream opened now is not written.
  expect(hub.listenerCount('session:open')).toBe(0);
  expect(hub.listenerCount('session:close')).toBe(0);
});

it('validates its config at construction; rows go stale after four intervals by default', () => {
  const hub = new AgentHub(t.pool, log, { leaseTtlMs: 30_000, claimTtlMs: 30_000, heartbeatIntervalMs: 5_000 });
  expect(() => new SessionRegistry(t.pool, hub, log, { coordinatorId: 'not-a-uuid' })).toThrow();
  expect(() => new SessionRegistry(t.pool, hub, log, { intervalMs: 1 })).toThrow();
  expect(() => new SessionRegistry(t.pool, hub, log, { jitter: 2 })).toThrow();
  const r = new SessionRegistry(t.pool, hub, log, { intervalMs: 1000 });
  expect([r.intervalMs, r.staleAfterMs]).toEqual([1000, 4000]);
});
