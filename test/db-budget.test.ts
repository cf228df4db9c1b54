/**
 * The connection budget. `LEASEHOLD_DB_POOL_MAX` and `LEASEHOLD_DB_HOT_POOL_MAX` size the pools
 * (a coordinator opens up to both plus one, its listener's); they were fixed at 20 and 8, more
 * than a small managed database allows, and a burst then filled `max_connections` by itself. A
 * start warns when PostgreSQL has less room for the role than that, and a start that finds no
 * free connection (SQLSTATE 53300) says so, with the budget and the settings, exit code 1 (it
 * said only the driver's words). Superusers are held to neither CONNECTION LIMIT nor the reserved
 * slots, so the role here is an ordinary one, as on a managed service.
 */
import { randomBytes } from 'node:crypto';
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import pino from 'pino';
import { afterEach, describe, expect, inject, it } from 'vitest';
import { ConfigError, loadConfig } from '../server/config.js';
import { startCoordinator } from '../server/coordinator.js';
import { createPool, openDatabase, ROOM_RETRY_MS, type Database } from '../server/store/database.js';
import { startEmbedded } from '../server/store/embedded.js';
import { withDatabase } from './helpers/global-setup.js';
import { ownDatabase } from './helpers/newer-release.js';
import { rpc } from './helpers/http.js';
import { killAll, serve } from './helpers/serve.js';

type Line = Record<string, unknown> & { level: number; msg: string };

const cleanups: Array<() => Promise<unknown>> = [];
afterEach(async () => {
  killAll();
  for (const c of cleanups.splice(0).reverse()) await c();
});

/** Runs each statement on a fresh connection to `url` (the admin's, by default). */
async function admin(sql: string[], url = inject('pgAdminUrl')): Promise<void> {
  const c = new pg.Client({ connectionString: url });
  await c.connect();
  try {
    for (const q of sql) await c.query(q);
  } finally {
    await c.end();
  }
}

/**
 * A login role that is no superuser: on the shared server, dropped after the test (after the
 * databases it used); `on` a server of the test's own, it goes with the server.
 */
async function ordinaryRole(on?: string): Promise<{ role: string; as(url: string): string }> {
  const role = `lh_budget_${randomBytes(4).toString('hex')}`;
  await admin([`CREATE ROLE ${role} LOGIN PASSWORD 'budget-pw'`], on);
  if (!on) cleanups.unshift(() => admin([`DROP ROLE IF EXISTS ${role}`]));
  return {
    role,
    as: (url) => {
      const u = new URL(url);
      u.username = role;
      u.password = 'budget-pw';
      return u.toString();
    },
  };
}

/**
 * A PostgreSQL server of the test's own, without autovacuum (a worker would be counted among the
 * connections open), gone after the test.
 */
async function quietServer(settings: Record<string, string> = {}): Promise<{ url: string }> {
  const dataDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-budget-'));
  cleanups.push(() => rm(dataDir, { recursive: true, force: true }));
  const server = await startEmbedded({ dataDir, log: pino({ level: 'silent' }), ephemeral: true, settings: { fsync: 'off', autovacuum: 'off', ...settings } });
  cleanups.push(() => server.stop());
  return server;
}

/** A database of this test's own; its name. */
async function database(opts: { empty?: boolean } = {}): Promise<{ url: string; name: string }> {
  const db = await ownDatabase(opts);
  cleanups.push(() => db.drop());
  return { url: db.url, name: new URL(db.url).pathname.slice(1) };
}

/** `n` connections held open on `url` until the test ends. */
async function hold(url: string, n: number): Promise<void> {
  const clients = Array.from({ length: n }, () => new pg.Client({ connectionString: url }));
  cleanups.push(() => Promise.all(clients.map((c) => c.end().catch(() => undefined))));
  for (const c of clients) await c.connect();
}

function capture() {
  const lines: Line[] = [];
  return { lines, log: pino({ level: 'info' }, { write: (s: string) => void lines.push(JSON.parse(s) as Line) }) };
}

/** Opens the database at `url` with these pool sizes (default 20 and 8); the warnings it logged. */
async function open(url: string, sizes: { max?: number; hotMax?: number } = {}): Promise<{ db: Database; warnings: Line[] }> {
  const { lines, log } = capture();
  const db = await openDatabase({ databaseUrl: url, dataDir: '', log, ...sizes });
  await db.close();
  return { db, warnings: lines.filter((l) => l.level === 40) };
}

const refusal = async (p: Promise<unknown>) =>
  (await p.then(
    () => undefined,
    (e: unknown) => e,
  )) as Error;

describe('LEASEHOLD_DB_POOL_MAX and LEASEHOLD_DB_HOT_POOL_MAX', () => {
  it('default to 20 and 8, take a whole number, and refuse anything else naming the setting', () => {
    expect(loadConfig({}, {})).toMatchObject({ dbPoolMax: 20, dbHotPoolMax: 8 });
    expect(loadConfig({}, { LEASEHOLD_DB_POOL_MAX: '6', LEASEHOLD_DB_HOT_POOL_MAX: '2' })).toMatchObject({ dbPoolMax: 6, dbHotPoolMax: 2 });
    // The least each may be: the purger holds a connection while it cancels its VACUUM from another.
    expect(loadConfig({}, { LEASEHOLD_DB_POOL_MAX: '2', LEASEHOLD_DB_HOT_POOL_MAX: '1' })).toMatchObject({ dbPoolMax: 2, dbHotPoolMax: 1 });
    for (const [name, raw, min] of [
      ['LEASEHOLD_DB_POOL_MAX', '1', 2],
      ['LEASEHOLD_DB_POOL_MAX', 'many', 2],
      ['LEASEHOLD_DB_POOL_MAX', '2.5', 2],
      ['LEASEHOLD_DB_POOL_MAX', '1001', 2],
      ['LEASEHOLD_DB_HOT_POOL_MAX', '0', 1],
      ['LEASEHOLD_DB_HOT_POOL_MAX', '-3', 1],
    ] as const) {
      let err: unknown;
      try {
        loadConfig({}, { [name]: raw });
      } catch (e) {
        err = e;
      }
      expect(err, `${name}=${raw}`).toBeInstanceOf(ConfigError);
      expect((err as Error).message).toBe(`${name}=${JSON.stringify(raw)} must be a whole number from ${min} to 1000`);
    }
  });

  it("size a coordinator's pools", async () => {
    const { url } = await database();
    const config = loadConfig(
      { grpcAddr: '127.0.0.1:0', httpAddr: '127.0.0.1:0' },
      { DATABASE_URL: url, LEASEHOLD_DB_POOL_MAX: '5', LEASEHOLD_DB_HOT_POOL_MAX: '3' },
    );
    const c = await startCoordinator(config, pino({ level: 'silent' }));
    cleanups.push(() => c.stop());
    expect([c.db.pool.options.max, c.db.hot.options.max]).toEqual([5, 3]);
    const { db } = await open(url);
    expect([db.pool.options.max, db.hot.options.max]).toEqual([20, 8]);
  });

  it('a bad one stops leasehold serve with exit code 2 and one line naming it', async () => {
    const p = serve(['serve'], { DATABASE_URL: 'postgres://nobody@127.0.0.1:1/none', LEASEHOLD_DB_HOT_POOL_MAX: '0' });
    const { code } = await p.exited;
    const said = p.lines.map((l) => String(l.msg));
    expect(code, said.join('\n')).toBe(2);
    expect(said).toContain('LEASEHOLD_DB_HOT_POOL_MAX="0" must be a whole number from 1 to 1000');
  });
});

describe('a start on a database with less room than the pools may take', () => {
  it("warns, with the numbers, when the database's CONNECTION LIMIT leaves the role less, and not when it fits", async () => {
    // On a server of the test's own, without autovacuum: a role that may not read all statistics
    // sees an autovacuum worker in its database as a client's connection (connectionRoomGet), and
    // the shared server's launcher visits a new database within seconds. The counts here are exact.
    const server = await quietServer();
    const name = 'budget';
    await admin([`CREATE DATABASE ${name}`, `ALTER DATABASE ${name} CONNECTION LIMIT 12`], server.url);
    const url = withDatabase(server.url, name);
    const { as } = await ordinaryRole(server.url);
    const mine = as(url);

    const { warnings } = await open(mine);
    expect(warnings).toHaveLength(1);
    expect(warnings[0]).toMatchObject({ left: 12, needs: 29, poolMax: 20, hotPoolMax: 8, databaseLimit: 12, databaseOpen: 0, roleLimit: -1 });
    expect(warnings[0]!.msg).toBe(
      `this coordinator may open up to 29 (LEASEHOLD_DB_POOL_MAX=20 + LEASEHOLD_DB_HOT_POOL_MAX=8 + 1 to listen) connections and PostgreSQL has room for 12 ` +
        `(database "${name}" CONNECTION LIMIT 12, 0 open by others): under load its calls will fail with SQLSTATE 53300 (too many connections). ` +
        `Lower LEASEHOLD_DB_POOL_MAX and LEASEHOLD_DB_HOT_POOL_MAX, or raise the database's CONNECTION LIMIT (docs/deploy.md, "A managed PostgreSQL")`,
    );
    // 8 + 3 + 1 fits 12 exactly.
    expect((await open(mine, { max: 8, hotMax: 3 })).warnings).toEqual([]);
    // Connections of other clients count against it.
    await hold(mine, 2);
    const crowded = (await open(mine, { max: 8, hotMax: 3 })).warnings;
    expect(crowded).toHaveLength(1);
    expect(crowded[0]).toMatchObject({ left: 10, needs: 12, databaseOpen: 2, roleOpen: 2 });
    expect((await open(mine, { max: 6, hotMax: 3 })).warnings).toEqual([]);
    // A superuser is held to no CONNECTION LIMIT.
    expect((await open(url)).warnings).toEqual([]);
  });

  it("warns on the role's CONNECTION LIMIT too", async () => {
    const { role, as } = await ordinaryRole();
    const { url } = await database();
    await admin([`ALTER ROLE ${role} CONNECTION LIMIT 9`]);
    const { warnings } = await open(as(url));
    expect(warnings).toHaveLength(1);
    expect(warnings[0]!.msg).toContain(`has room for 9 (role "${role}" CONNECTION LIMIT 9, 0 open by others)`);
    expect(warnings[0]!.msg).toContain("or raise the role's CONNECTION LIMIT");
    expect((await open(as(url), { max: 5, hotMax: 3 })).warnings).toEqual([]);
  });

  it('leasehold migrate opens the pools with the sizes the environment gives, and warns the same', async () => {
    const { role, as } = await ordinaryRole();
    const { url, name } = await database({ empty: true });
    // The migrations need the database's owner.
    await admin([`ALTER DATABASE ${name} OWNER TO ${role}`, `ALTER DATABASE ${name} CONNECTION LIMIT 12`]);
    const p = serve(['migrate'], { DATABASE_URL: as(url), LEASEHOLD_DB_POOL_MAX: '9', LEASEHOLD_DB_HOT_POOL_MAX: '3' });
    const { code } = await p.exited;
    const said = p.lines.map((l) => String(l.msg));
    expect(code, said.join('\n')).toBe(0);
    const warned = p.lines.filter((l) => l.level === 40);
    expect(warned, said.join('\n')).toHaveLength(1);
    expect(warned[0]).toMatchObject({ left: 12, needs: 13 });
    expect(String(warned[0]!.msg)).toMatch(/^this coordinator may open up to 13 \(LEASEHOLD_DB_POOL_MAX=9 \+ LEASEHOLD_DB_HOT_POOL_MAX=3 \+ 1 to listen\)/);
    expect(said).toContain('migrations applied');
  });
});

describe('a start that finds no free connection', () => {
  const needs = 'Leasehold needs up to 29 (LEASEHOLD_DB_POOL_MAX=20 + LEASEHOLD_DB_HOT_POOL_MAX=8 + 1 to listen) connections per coordinator, and 2 more while one starts';
  const advice = (limit: string) =>
    `close other clients' connections, raise ${limit}, or lower LEASEHOLD_DB_POOL_MAX and LEASEHOLD_DB_HOT_POOL_MAX (docs/deploy.md, "A managed PostgreSQL")`;

  it("says so when the role's CONNECTION LIMIT is reached: a plain error, exit code 1, as it may pass", async () => {
    const { role, as } = await ordinaryRole();
    const { url } = await database();
    await admin([`ALTER ROLE ${role} CONNECTION LIMIT 0`]);
    const mine = as(url);
    const err = await refusal(openDatabase({ databaseUrl: mine, dataDir: '', log: pino({ level: 'silent' }) }));
    expect(err.name).toBe('Error');
    expect(err.message).toBe(
      `cannot connect to PostgreSQL at ${mine.replace('budget-pw', '***')}: PostgreSQL has no free connection for role "${role}" (too many connections for role "${role}"). ` +
        `${needs}: ${advice("the role's CONNECTION LIMIT")}`,
    );

    const p = serve(['serve', '--grpc-addr', '127.0.0.1:0', '--http-addr', '127.0.0.1:0'], { DATABASE_URL: mine });
    const { code } = await p.exited;
    const said = p.lines.map((l) => String(l.msg));
    expect(code, said.join('\n')).toBe(1);
    expect(said.find((m) => m.startsWith('cannot connect to PostgreSQL'))).toBe(err.message);
  });

  it("says so when the database's CONNECTION LIMIT is reached, at the pools' first connection or at the session check's", async () => {
    const { as } = await ordinaryRole();
    const { url, name } = await database();
    const mine = as(url);
    await admin([`ALTER DATABASE ${name} CONNECTION LIMIT 2`]);
    await hold(mine, 2);
    const first = await refusal(openDatabase({ databaseUrl: mine, dataDir: '', log: pino({ level: 'silent' }) }));
    expect(first.message).toContain(`PostgreSQL has no free connection for role "`);
    expect(first.message).toContain(`(too many connections for database "${name}"). ${needs}: ${advice("the database's CONNECTION LIMIT")}`);
    // Room for the two pools and the session check's first connection, not its second.
    await admin([`ALTER DATABASE ${name} CONNECTION LIMIT 5`]);
    const check = await refusal(openDatabase({ databaseUrl: mine, dataDir: '', log: pino({ level: 'silent' }) }));
    expect(check.name).toBe('Error');
    expect(check.message).toContain(`(too many connections for database "${name}"). ${needs}: ${advice("the database's CONNECTION LIMIT")}`);
  });

  it('says so when max_connections is reached (the slots left are reserved), and warns when it leaves less than the pools may take', async () => {
    // Without autovacuum: its workers count among the connections open (connectionRoomGet).
    const server = await quietServer({ max_connections: '8' });
    const { as } = await ordinaryRole(server.url);
    const mine = as(server.url);

    // 8 less the 3 reserved for superusers.
    const { warnings } = await open(mine, { max: 4, hotMax: 2 });
    expect(warnings).toHaveLength(1);
    expect(warnings[0]).toMatchObject({ left: 5, needs: 7, maxConnections: 8, reserved: 3, open: 0 });
    expect(warnings[0]!.msg).toContain('has room for 5 (max_connections 8, 3 of them reserved, 0 open by others)');
    expect(warnings[0]!.msg).toContain('or raise max_connections');
    expect((await open(mine, { max: 2, hotMax: 2 })).warnings).toEqual([]);

    await hold(mine, 5);
    const err = await refusal(openDatabase({ databaseUrl: mine, dataDir: '', log: pino({ level: 'silent' }) }));
    expect(err.name).toBe('Error');
    expect(err.message).toMatch(/PostgreSQL has no free connection for role "lh_budget_\w+" \(remaining connection slots are reserved for roles with the SUPERUSER attribute\)\. /);
    expect(err.message).toContain(`${needs}: ${advice('max_connections')}`);
  });
});

describe('a pool at PostgreSQL\'s limit while it holds connections', () => {
  const NO_ROOM = 'PostgreSQL has no room for another connection of the pool: its calls wait for the connections it has';

  it('waits for the connections it has instead of failing the call, says so once, and opens no more for a while', async () => {
    const { role, as } = await ordinaryRole();
    const { url } = await database();
    await admin([`ALTER ROLE ${role} CONNECTION LIMIT 3`]);
    const { lines, log } = capture();
    const pool = createPool(as(url), 10, log);
    cleanups.push(() => pool.end());
    // Queries (pool.query checks out with a callback) and checkouts of its own (transactions).
    const calls = Array.from({ length: 40 }, (_, i) =>
      i % 4
        ? pool.query('SELECT pg_sleep(0.02)')
        : pool.connect().then(async (c) => {
            try {
              await c.query('SELECT pg_sleep(0.02)');
            } finally {
              c.release();
            }
          }),
    );
    const settled = await Promise.allSettled(calls);
    expect(settled.filter((r) => r.status === 'rejected').map((r) => String((r as PromiseRejectedResult).reason))).toEqual([]);
    expect(pool.totalCount).toBeLessThanOrEqual(3);
    expect(pool.options.max).toBeLessThanOrEqual(3);
    const said = lines.filter((l) => l.msg === NO_ROOM);
    expect(said).toHaveLength(1);
    expect(said[0]).toMatchObject({ level: 40, max: 10, retryInMs: ROOM_RETRY_MS, err: { code: '53300' } });
  });

  it('fails a call whose wait runs out with the refusal, so the caller is told there is no free connection', async () => {
    const { role, as } = await ordinaryRole();
    const { url } = await database();
    await admin([`ALTER ROLE ${role} CONNECTION LIMIT 1`]);
    const pool = createPool(as(url), 10, pino({ level: 'silent' }), { connectTimeoutMs: 400 });
    cleanups.push(() => pool.end());
    const held = await pool.connect();
    try {
      const started = performance.now();
      const err = (await refusal(pool.query('SELECT 1'))) as Error & { code?: string };
      const waited = performance.now() - started;
      expect({ code: err.code, message: err.message }).toEqual({ code: '53300', message: `too many connections for role "${role}"` });
      expect(waited).toBeGreaterThanOrEqual(390);
      expect(waited).toBeLessThan(3000);
    } finally {
      held.release();
    }
  });

  it('still fails a call when it holds no connection at all (nothing would free one)', async () => {
    const { role, as } = await ordinaryRole();
    const { url } = await database();
    await admin([`ALTER ROLE ${role} CONNECTION LIMIT 0`]);
    const pool = createPool(as(url), 10, pino({ level: 'silent' }));
    cleanups.push(() => pool.end());
    const err = await refusal(pool.query('SELECT 1'));
    expect((err as Error & { code?: string }).code).toBe('53300');
  });

  it('a burst of enqueues and reads through the gateway, with the default pools, on a role with room for 6: every one answered 200', async () => {
    const { role, as } = await ordinaryRole();
    const { url, name } = await database({ empty: true });
    await admin([`ALTER DATABASE ${name} OWNER TO ${role}`]);
    const config = loadConfig(
      { grpcAddr: '127.0.0.1:0', httpAddr: '127.0.0.1:0' },
      { DATABASE_URL: as(url), LEASEHOLD_ADMIN_KEY: 'budget-admin-key-of-some-length' },
    );
    const { lines, log } = capture();
    const c = await startCoordinator(config, log);
    cleanups.push(() => c.stop());
    // Set after the start, which needs 4 at once: the pools (20 and 8) may take 29.
    await admin([`ALTER ROLE ${role} CONNECTION LIMIT 6`]);
    const base = `http://127.0.0.1:${c.http.address.port}`;
    const key = 'budget-admin-key-of-some-length';
    // Enqueues (which the gateway batches) and reads (one connection each), as n8n workflows and a dashboard make them.
    const answers = await Promise.all(
      Array.from({ length: 600 }, (_, i) =>
        i % 3 === 2
          ? rpc(base, 'leasehold.v1.JobService/ListJobs', { queue: 'burst', pageSize: 5 }, key)
          : rpc(base, 'leasehold.v1.JobService/EnqueueJob', { queue: 'burst', payload: { i } }, key),
      ),
    );
    const statuses = new Map<number, number>();
    for (const a of answers) statuses.set(a.status, (statuses.get(a.status) ?? 0) + 1);
    expect(Object.fromEntries(statuses)).toEqual({ 200: 600 });
    expect(lines.some((l) => l.msg === NO_ROOM)).toBe(true);
  });
});
