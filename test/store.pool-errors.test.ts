/**
 * A pooled connection that dies while it is checked out (PostgreSQL restarting, a failover, a
 * killed backend, a reset): pg emits 'error' on the client, and pg-pool listens only while the
 * client is idle. Without a listener of Leasehold's own, Node threw it and the coordinator's
 * process ended. Now the statement fails, the error is logged, the pool drops the client and
 * goes on.
 * And what `redact` leaves of a database URL for logs: no password, neither the URL's own nor the
 * `password`, `sslpassword` or `sslkey` query parameters pg also reads (before, those were logged).
 */
import pino from 'pino';
import { describe, expect, it } from 'vitest';
import { createPool, redact } from '../server/store/database.js';
import { withTransaction } from '../server/store/sql.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();

function logged() {
  const lines: Array<Record<string, unknown>> = [];
  return { lines, log: pino({ level: 'debug' }, { write: (s: string) => void lines.push(JSON.parse(s) as Record<string, unknown>) }) };
}

describe.each([false, true])('createPool (hot: %s)', (hot) => {
  it('survives the connection of a checked-out client being killed: the transaction fails, the pool goes on', async () => {
    const { lines, log } = logged();
    const pool = createPool(t.url, 2, log, { hot });
    try {
      const failed = withTransaction(pool, async (tx) => {
        const pid = (await tx.query<{ p: number }>('SELECT pg_backend_pid() AS p')).rows[0]!.p;
        await t.pool.query('SELECT pg_terminate_backend($1)', [pid]);
        // The backend is gone: this statement, or the commit, finds the connection closed.
        await tx.query('SELECT pg_sleep(0.2)');
      });
      await expect(failed).rejects.toThrow();
      expect((await pool.query<{ one: number }>('SELECT 1 AS one')).rows[0]!.one).toBe(1);
      expect(lines.some((l) => l.msg === 'database connection failed while in use')).toBe(true);
    } finally {
      await pool.end();
    }
  });

  it('survives the connection of a checked-out idle client being killed (held, no statement running)', async () => {
    const { log } = logged();
    const pool = createPool(t.url, 2, log, { hot });
    const client = await pool.connect();
    try {
      const pid = (await client.query<{ p: number }>('SELECT pg_backend_pid() AS p')).rows[0]!.p;
      const ended = new Promise((r) => client.once('end', r));
      await t.pool.query('SELECT pg_terminate_backend($1)', [pid]);
      await ended;
      await expect(client.query('SELECT 1')).rejects.toThrow();
    } finally {
      client.release(true);
      await pool.end();
    }
  });
});

describe('redact', () => {
  it("hides the URL's password and the password, sslpassword and sslkey parameters, whatever their case; keeps the rest", () => {
    expect(redact('postgres://app:s3cret@db.example.com:5432/leasehold?sslmode=require')).toBe('postgres://app:***@db.example.com:5432/leasehold?sslmode=require');
    const r = redact('postgres://app@db/leasehold?password=s3cret&sslmode=verify-full&sslpassword=k3y-pass&sslkey=%2Fetc%2Fkeys%2Fapp.key&application_name=lh');
    expect(r).toBe('postgres://app@db/leasehold?password=***&sslmode=verify-full&sslpassword=***&sslkey=***&application_name=lh');
    for (const secret of ['s3cret', 'k3y-pass', 'app.key']) expect(r).not.toContain(secret);
    // Names pg would not read are hidden too: a spelling that is not logged costs nothing.
    expect(redact('postgresql://db/x?PassWord=a1&SSLPASSWORD=b2&pass%77ord=c3')).toBe('postgresql://db/x?PassWord=***&SSLPASSWORD=***&password=***');
    // Nothing to hide: the URL as it was written.
    expect(redact('postgres://app@db/leasehold?sslmode=require&application_name=a%20b')).toBe('postgres://app@db/leasehold?sslmode=require&application_name=a%20b');
    expect(redact('host=db password=x')).toBe('(unparseable DATABASE_URL)');
  });
});
