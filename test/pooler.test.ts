/**
 * A connection pooler in front of PostgreSQL (docs/deploy.md, "A pooler in front"), with
 * Debian's PgBouncer. Transaction mode, what a hosted database's pooled connection string gives:
 * Leasehold cannot run there (its LISTEN and prepared statements live in server sessions), and
 * before session-check.ts it started anyway on fresh server sessions, hearing no notification,
 * and crashed at a later start on another client's prepared statement; now `leasehold serve`
 * refuses it at start with exit code 2 and one line. Session mode: everything works, the
 * notifications between replicas included.
 */
import { afterEach, describe, expect, it } from 'vitest';
import type { Coordinator } from '../server/coordinator.js';
import { sessionProblem } from '../server/store/session-check.js';
import { ADMIN_KEY, waitFor } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { pgbouncerMissing, startPgBouncer, type RunningPgBouncer } from './helpers/pgbouncer.js';
import { freePort } from './helpers/ports.js';
import { replica } from './helpers/replicas.js';
import { killAll, serve } from './helpers/serve.js';

const t = useTestDb();
const required = process.env.LEASEHOLD_REQUIRE_PROXIES === '1';
const cleanups: Array<() => Promise<unknown>> = [];
afterEach(async () => {
  killAll();
  for (const c of cleanups.splice(0).reverse()) await c();
});

function skipIfMissing(ctx: { skip(note?: string): void }): boolean {
  const absent = pgbouncerMissing();
  if (!absent) return false;
  if (required) throw new Error(`${absent}, and LEASEHOLD_REQUIRE_PROXIES=1 (apt-get install pgbouncer)`);
  ctx.skip(absent);
  return true;
}

async function pooler(mode: 'session' | 'transaction'): Promise<RunningPgBouncer> {
  const p = await startPgBouncer(t.url, mode);
  cleanups.push(() => p.stop());
  return p;
}

/** A gateway call with `key` as the bearer key. */
async function call(c: Coordinator, method: string, body: unknown, key = ADMIN_KEY): Promise<{ status: number; body: string }> {
  const r = await fetch(`http://127.0.0.1:${c.http.address.port}/leasehold.v1.${method}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', authorization: `Bearer ${key}` },
    body: JSON.stringify(body),
  });
  return { status: r.status, body: await r.text() };
}

it('the check passes on PostgreSQL itself, within milliseconds', async () => {
  const started = performance.now();
  expect(await sessionProblem(t.url)).toBeUndefined();
  expect(performance.now() - started).toBeLessThan(2_000);
});

describe('behind PgBouncer', () => {
  it('in transaction mode, leasehold serve refuses at start with exit code 2 and one line saying why and what to use', async (ctx) => {
    if (skipIfMissing(ctx)) return;
    const p = await pooler('transaction');
    // Twice: the first start meets fresh server sessions, on which the old code started and served.
    for (let i = 0; i < 2; i++) {
      const proc = serve(['serve', '--grpc-addr', '127.0.0.1:0', '--http-addr', '127.0.0.1:0'], { DATABASE_URL: p.url, LEASEHOLD_ADMIN_KEY: ADMIN_KEY });
      const { code } = await proc.exited;
      const said = proc.lines.map((l) => String(l.msg));
      expect(code, said.join('\n')).toBe(2);
      const refusal = said.find((m) => m.startsWith('cannot use PostgreSQL at '));
      expect(refusal, said.join('\n')).toMatch(/pooler in transaction or statement mode/);
      expect(refusal).toMatch(/point DATABASE_URL at the database itself, or at a pooler in session mode/);
      expect(refusal).not.toContain(new URL(t.url).password); // the URL is shown redacted
      expect(said.some((m) => /leasehold coordinator ready|gRPC listening/.test(m))).toBe(false);
    }
  }, 60_000);

  it('in session mode, two replicas serve through it and hear each other: a key revoked on one is refused by the other at once', async (ctx) => {
    if (skipIfMissing(ctx)) return;
    const p = await pooler('session');
    const [a, b] = [await replica(p.url, await freePort()), await replica(p.url, await freePort())];
    cleanups.push(() => a.stop(), () => b.stop());

    const made = await call(a, 'AdminService/CreateKey', { name: 'pooled-reader', scopes: ['read'] });
    expect(made.status, made.body).toBe(200);
    const key = (JSON.parse(made.body) as { key: string }).key;
    const enq = await call(b, 'JobService/EnqueueJob', { queue: 'pooled', payload: { n: 1 } });
    expect(enq.status, enq.body).toBe(200);
    const id = (JSON.parse(enq.body) as { job: { id: string } }).job.id;
    // B verifies the key and keeps it (its cache serves it for up to 60 s, unless told otherwise).
    for (let i = 0; i < 2; i++) expect((await call(b, 'JobService/GetJob', { jobId: id }, key)).status).toBe(200);

    expect((await call(a, 'AdminService/RevokeKey', { name: 'pooled-reader' })).status).toBe(200);
    // Only A's NOTIFY, heard on B's listening session, can make B forget it within the second.
    const revokedAt = Date.now();
    await waitFor('the other replica refuses the revoked key', async () => (await call(b, 'JobService/GetJob', { jobId: id }, key)).status === 401, 1_000);
    expect(Date.now() - revokedAt).toBeLessThan(1_000);
  }, 60_000);
});
