/**
 * Bounds on waiting for PostgreSQL (server/store/database.ts): the hot pool's statements end at
 * its statement timeout, in PostgreSQL (a lock waited for, a slow statement) or here (an answer
 * that never comes: a connection black-holed by a failover or a partition, which the kernel
 * gives up on only after about 15 minutes), and a connection that cannot be opened fails its
 * caller instead of holding it. Before, each of these waited for as long as it lasted.
 */
import net from 'node:net';
import type pg from 'pg';
import { afterEach, expect, it } from 'vitest';
import { createPool } from '../server/store/database.js';
import { withTransaction } from '../server/store/sql.js';
import { useTestDb } from './helpers/db.js';
import { startProxy, type TcpProxy } from './helpers/tcp-proxy.js';

const t = useTestDb();
const opened: Array<pg.Pool | TcpProxy | net.Server> = [];
afterEach(async () => {
  for (const o of opened.splice(0)) {
    if ('blackhole' in o) await o.close();
    else if (o instanceof net.Server) await new Promise((r) => o.close(r));
    else await o.end().catch(() => undefined);
  }
});

const elapsed = async (p: Promise<unknown>) => {
  const t0 = performance.now();
  const err = await p.then(() => undefined, (e: unknown) => e as Error & { code?: string });
  return { ms: performance.now() - t0, err };
};

it('ends a hot statement that waits for a lock at the statement timeout, and the pool goes on', async () => {
  const pool = createPool(t.url, 2, undefined, { hot: true, statementTimeoutMs: 300 });
  opened.push(pool);
  await t.pool.query('CREATE TABLE IF NOT EXISTS pool_lock (id int PRIMARY KEY)');
  await t.pool.query('INSERT INTO pool_lock VALUES (1) ON CONFLICT DO NOTHING');
  const holder = await t.pool.connect();
  try {
    await holder.query('BEGIN');
    await holder.query('SELECT id FROM pool_lock WHERE id = 1 FOR UPDATE');
    const { ms, err } = await elapsed(pool.query('UPDATE pool_lock SET id = 1 WHERE id = 1'));
    expect(err?.code).toBe('57014'); // canceling statement due to statement timeout
    expect(ms).toBeLessThan(2_000);
  } finally {
    await holder.query('ROLLBACK');
    holder.release();
  }
  expect((await pool.query('SELECT 1 AS one')).rows[0].one).toBe(1);
});

it('gives up on an answer that never comes (a silent connection) and drops that connection, in a statement and in a transaction', async () => {
  const proxy = await startProxy(Number(new URL(t.url).port));
  opened.push(proxy);
  const url = new URL(t.url);
  url.host = `127.0.0.1:${proxy.port}`;
  const pool = createPool(url.toString(), 2, undefined, { hot: true, statementTimeoutMs: 200, connectTimeoutMs: 500 });
  opened.push(pool);
  await pool.query('SELECT 1');
  await withTransaction(pool, (tx) => tx.query('SELECT 1'));
  proxy.blackhole();

  const single = await elapsed(pool.query('SELECT 1'));
  expect(single.err?.message).toBe('Query read timeout');
  expect(single.ms).toBeLessThan(10_000);
  const tx = await elapsed(withTransaction(pool, (c) => c.query('SELECT 1')));
  expect(tx.err?.message).toMatch(/Query read timeout|timeout expired|Connection terminated/);
  expect(tx.ms).toBeLessThan(10_000);
  // Neither silent client went back to the pool to be handed out again.
  expect(pool.idleCount).toBe(0);
});

it('fails a connection the server never answers within the connect timeout', async () => {
  const accepted: net.Socket[] = [];
  const mute = net.createServer((s) => void accepted.push(s));
  opened.push(mute);
  await new Promise<void>((r) => mute.listen(0, '127.0.0.1', () => r()));
  const port = (mute.address() as net.AddressInfo).port;
  const pool = createPool(`postgres://u:p@127.0.0.1:${port}/db`, 1, undefined, { connectTimeoutMs: 300 });
  opened.push(pool);
  const { ms, err } = await elapsed(pool.query('SELECT 1'));
  for (const s of accepted) s.destroy();
  expect(err?.message).toMatch(/timeout/i);
  expect(ms).toBeLessThan(3_000);
});
