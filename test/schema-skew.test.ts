/**
 * A coordinator that is running when a newer release migrates its database past what it can run
 * beside (the newer release's migration breaks it, store/schema-compat.ts) stops by itself: it
 * hears the migrator's NOTIFY (or finds the raised `min_reader` when its listener reconnects, or
 * at its periodic look), answers NOT_SERVING, logs an error naming both levels, stops claiming,
 * tells its agents to go (GoAway) and stops as on SIGTERM; the process exits with code 2. The
 * newer coordinator on the same database carries on with the agents.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Writable } from 'node:stream';
import pino from 'pino';
import { afterAll, afterEach, expect, it } from 'vitest';
import { createAgent } from '@leasehold/agent-client';
import { loadConfig } from '../server/config.js';
import { SchemaWatch } from '../server/core/schema-watch.js';
import { startCoordinator } from '../server/coordinator.js';
import { agentCreate, jobEnqueue, type Queryable } from '../server/store/index.js';
import { migrateDatabase, migrationsFolder } from '../server/store/migrate.js';
import { SCHEMA_CHANNEL } from '../server/store/notify.js';
import { compatInfo } from '../server/store/schema-compat.js';
import { ADMIN_KEY, waitFor, within } from './helpers/coordinator.js';
import { newerRelease, ownDatabase, type OwnDatabase } from './helpers/newer-release.js';
import { freePort } from './helpers/ports.js';
import { killAll, serve } from './helpers/serve.js';

const LEVEL = compatInfo(migrationsFolder).readerLevel;
const cleanups: Array<() => Promise<unknown>> = [];
afterEach(() => killAll());
afterAll(async () => {
  for (const c of cleanups.reverse()) await c().catch(() => undefined);
});

/** A logger whose lines are kept. */
function capture() {
  const lines: Array<Record<string, unknown>> = [];
  const stream = new Writable({
    write(chunk: Buffer, _enc, done) {
      lines.push(JSON.parse(chunk.toString()) as Record<string, unknown>);
      done();
    },
  });
  return { log: pino({ level: 'info' }, stream), lines };
}

async function coordinator(db: OwnDatabase, grpcPort: number, opts: Parameters<typeof startCoordinator>[2] = {}) {
  const config = loadConfig(
    { grpcAddr: `127.0.0.1:${grpcPort}`, httpAddr: '127.0.0.1:0' },
    { DATABASE_URL: db.url, LEASEHOLD_ADMIN_KEY: ADMIN_KEY, LEASEHOLD_LEASE_TTL: '10s', LEASEHOLD_HEARTBEAT_INTERVAL: '1s', LEASEHOLD_RETENTION: 'off' },
  );
  const { log, lines } = capture();
  const c = await startCoordinator(config, log, opts);
  cleanups.push(() => c.stop());
  return { c, lines };
}

/** What the halted coordinator said, and when: its error line names both levels and says it stops. */
function expectStopLine(lines: Array<Record<string, unknown>>, minReader: number) {
  const error = lines.find((l) => l.level === 50);
  expect(error).toMatchObject({
    readerLevel: LEVEL,
    minReader,
    msg: expect.stringMatching(new RegExp(`^the database was migrated to schema level ${minReader} by a newer release; this release reads up to level ${LEVEL} .*upgrade this replica.*: stopping$`)),
  });
}

it("a newer release's breaking migration stops the coordinator running beside it within a second or two: NOT_SERVING, an error naming both levels, GoAway; its agent carries on at the newer one", async () => {
  const db = await ownDatabase();
  cleanups.push(() => db.drop());
  const newer = await newerRelease();
  cleanups.push(() => newer.remove());
  const ports = [await freePort(), await freePort()];
  const old = await coordinator(db, ports[0]!);
  expect(old.c.schema.config.readerLevel).toBe(LEVEL);

  // At the moment it learns of it: unhealthy on both listeners, /healthz included.
  const seen = new Promise<{ http: string | undefined; grpc: string | undefined; healthz: number | string }>((resolve) =>
    old.c.schema.once('schema:incompatible', () => {
      const at = { http: old.c.http.health.status(''), grpc: old.c.grpc.health.status('') };
      fetch(`http://127.0.0.1:${old.c.http.address.port}/healthz`).then(
        (r) => resolve({ ...at, healthz: r.status }),
        (err: Error) => resolve({ ...at, healthz: `no answer (${err.message})` }),
      );
    }),
  );

  const made = await agentCreate(db.pool, { agentId: 'skew' });
  if (made.outcome !== 'ok') throw new Error(JSON.stringify(made));
  const outboxDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-skew-'));
  cleanups.push(() => rm(outboxDir, { recursive: true, force: true }));
  const agent = createAgent({
    url: ports.map((p) => `http://127.0.0.1:${p}`),
    token: made.value.token,
    queues: ['skew'],
    slots: 2,
    outboxDir,
    handleSignals: false,
    log: pino({ level: 'silent' }),
  });
  cleanups.push(() => agent.stop());
  const ends: Array<{ code?: number; details?: string }> = [];
  agent.on('disconnected', (d) => ends.push({ code: (d.error as { code?: number } | undefined)?.code, details: (d.error as { details?: string } | undefined)?.details }));
  const ran: string[] = [];
  agent.handle('skew', async (job) => {
    ran.push(job.id);
    return { ok: true };
  });
  await agent.start();
  const first = await jobEnqueue(db.pool, { queue: 'skew', payload: {} });
  if (first.outcome !== 'ok') throw new Error(JSON.stringify(first));
  await waitFor('the first job run at the old coordinator', () => ran.includes(first.value.id));

  // The newer release starts on the same database: it applies its migration, raises min_reader, NOTIFY.
  const started = performance.now();
  const fresh = await coordinator(db, ports[1]!, { migrationsFolder: newer.folder });
  const err = await within(old.c.halted, 2_000, 'the old coordinator did not stop by itself');
  expect(performance.now() - started).toBeLessThan(10_000);
  expect(err).toMatchObject({ name: 'NewerSchemaError', message: expect.stringContaining(`schema level ${newer.readerLevel}`) });
  expect(await seen).toMatchObject({ http: 'NOT_SERVING', grpc: 'NOT_SERVING' });
  expect([503, expect.stringMatching(/^no answer/)]).toContainEqual((await seen).healthz);
  expectStopLine(old.lines, newer.readerLevel);
  await within(old.c.stop(), 10_000, 'the stop did not end');
  expect(old.lines.some((l) => l.level === 50 && /stop step failed/.test(String(l.msg)))).toBe(false);

  // The agent was told to go (GoAway, then UNAVAILABLE) and works at the newer coordinator.
  expect(ends[0]).toEqual({ code: 14, details: expect.stringMatching(/^this coordinator is stopping: reconnect/) });
  const second = await jobEnqueue(db.pool, { queue: 'skew', payload: {} });
  if (second.outcome !== 'ok') throw new Error(JSON.stringify(second));
  await waitFor('the second job run at the newer coordinator', () => ran.includes(second.value.id), 15_000);
  expect(fresh.c.http.health.status('')).toBe('SERVING');
  expect(fresh.lines.some((l) => l.level === 50)).toBe(false);
  expect((await fetch(`http://127.0.0.1:${fresh.c.http.address.port}/healthz`)).status).toBe(200);
}, 60_000);

it('without the NOTIFY, it finds the raised min_reader when its listener reconnects, and at its periodic look', async () => {
  const db = await ownDatabase();
  cleanups.push(() => db.drop());
  const raise = () => db.pool.query('UPDATE schema_compat SET min_reader = $1', [LEVEL + 1]);

  // The listener's connection cut (a failover, a proxy's idle timeout): it reconnects and looks.
  const a = await coordinator(db, 0);
  await a.c.schema.runOnce(); // its look at start is over
  await raise();
  await new Promise((r) => setTimeout(r, 300));
  expect(a.c.http.health.status(''), 'nothing heard yet').toBe('SERVING');
  await db.pool.query(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'leasehold-listener' AND datname = current_database()`);
  await within(a.c.halted, 8_000, 'the coordinator did not stop after its listener reconnected');
  expectStopLine(a.lines, LEVEL + 1);
  await a.c.stop();

  // Neither NOTIFY nor reconnection: the periodic look (every 30 s by default; 200 ms here).
  await db.pool.query('UPDATE schema_compat SET min_reader = 20');
  const b = await coordinator(db, 0, { schemaCheckIntervalMs: 200 });
  await b.c.schema.runOnce();
  await raise();
  await within(b.c.halted, 3_000, 'the periodic look did not stop the coordinator');
  expectStopLine(b.lines, LEVEL + 1);
  await b.c.stop();
}, 60_000);

it('`leasehold serve` exits with code 2 when a newer release migrates its database past it', async () => {
  const db = await ownDatabase();
  cleanups.push(() => db.drop());
  const newer = await newerRelease();
  cleanups.push(() => newer.remove());
  const p = serve(['serve', '--grpc-addr', '127.0.0.1:0', '--http-addr', '127.0.0.1:0'], { DATABASE_URL: db.url });
  await p.waitFor(/leasehold coordinator ready/);
  expect(p.lines.find((l) => /^schema level:/.test(String(l.msg)))).toMatchObject({ readerLevel: LEVEL, minReader: 20 });
  const httpAddr = String((await p.waitFor(/HTTP listening/)).addr);
  // /healthz as a proxy asks it, until the process is gone.
  const answers: Array<number | string> = [];
  let asking = true;
  const asker = (async () => {
    while (asking) {
      answers.push(await fetch(`http://${httpAddr}/healthz`).then((r) => r.status, () => 'refused'));
      await new Promise((r) => setTimeout(r, 20));
    }
  })();
  try {
    await migrateDatabase(db.pool, { migrationsFolder: newer.folder });
    const migrated = performance.now();
    const exit = await within(p.exited, 10_000, 'the coordinator process did not exit');
    expect(exit).toEqual({ code: 2, signal: null });
    expect(performance.now() - migrated).toBeLessThan(5_000);
  } finally {
    asking = false;
    await asker;
  }
  expectStopLine(p.lines, newer.readerLevel);
  expect(p.lines.at(-1)).toMatchObject({ msg: 'stopped' });
  // Up, then (perhaps briefly 503) gone; never up again once it said it stops.
  expect(answers[0]).toBe(200);
  const firstDown = answers.findIndex((a) => a !== 200);
  expect(firstDown).toBeGreaterThan(0);
  expect(answers.slice(firstDown).filter((a) => a === 200)).toEqual([]);
}, 60_000);

it('tells its agents to go at once, even while a maintenance run in progress holds the rest of its stop', async () => {
  const db = await ownDatabase();
  cleanups.push(() => db.drop());
  const old = await coordinator(db, await freePort());
  await old.c.schema.runOnce();
  // A recount (or a VACUUM) that takes its time to end.
  let release = () => undefined as void;
  const held = new Promise<void>((r) => (release = r));
  const countsStop = old.c.counts.stop.bind(old.c.counts);
  old.c.counts.stop = () => held.then(countsStop);
  cleanups.push(async () => release());

  const made = await agentCreate(db.pool, { agentId: 'skew-held' });
  if (made.outcome !== 'ok') throw new Error(JSON.stringify(made));
  const outboxDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-skew-'));
  cleanups.push(() => rm(outboxDir, { recursive: true, force: true }));
  const agent = createAgent({ url: `http://127.0.0.1:${old.c.grpc.address.port}`, token: made.value.token, queues: ['skew-held'], outboxDir, handleSignals: false, log: pino({ level: 'silent' }) });
  cleanups.push(() => agent.stop());
  const told = new Promise<number | undefined>((resolve) => agent.once('disconnected', (d) => resolve((d.error as { code?: number } | undefined)?.code)));
  await agent.start();

  await db.pool.query(`UPDATE schema_compat SET min_reader = $1; NOTIFY ${SCHEMA_CHANNEL}`.replace('$1', String(LEVEL + 1)));
  await within(old.c.halted, 3_000, 'the coordinator did not stop by itself');
  expect(await within(told, 3_000, 'the agent was not told to go while the recount held the stop')).toBe(14);
  release();
  await within(old.c.stop(), 10_000, 'the stop did not end');
}, 60_000);

it('a look asked for while one is running (a NOTIFY after its read) is followed by another', async () => {
  class Held extends SchemaWatch {
    readonly reads: Array<(v: number) => void> = [];
    protected override read(): Promise<number | undefined> {
      return new Promise((r) => this.reads.push(r));
    }
  }
  const w = new Held({} as Queryable, pino({ level: 'silent' }), { readerLevel: 5 });
  const incompatible = new Promise((r) => w.once('schema:incompatible', r));
  w.look('started');
  w.look('notified');
  expect(w.reads).toHaveLength(1);
  w.reads[0]!(5); // read before the change the NOTIFY announces
  await waitFor('a second look', () => w.reads.length === 2, 2_000);
  w.reads[1]!(6);
  expect(await incompatible).toMatchObject({ readerLevel: 5, minReader: 6, compatible: false });
});
