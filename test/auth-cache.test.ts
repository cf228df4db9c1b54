/**
 * The credential cache, over the real listeners and two coordinators on one database: a key
 * used once is served without the database (proved by locking `api_keys` against the lookup's
 * write: the cached call answers, an uncached one waits); revoking a key, an agent or the
 * bootstrap key through one coordinator, or by the store verb, is refused on the other within a
 * second (the revoking statement's NOTIFY); a listener that reconnects clears the cache and one
 * that is down serves nothing from it; a revoke written in SQL without NOTIFY is refused after
 * the maximum age, whose re-verification also stamps `last_used_at`.
 */
import { once, type EventEmitter } from 'node:events';
import { describe, expect, it } from 'vitest';
import { loadConfig, ConfigError } from '../server/config.js';
import { CredentialCache } from '../server/core/credential-cache.js';
import { agentCreate, keyBootstrap, keyCreate, keyRevoke } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, untilEvents, useCoordinator, waitFor, type TestCoordinator } from './helpers/coordinator.js';
import { rpc } from './helpers/http.js';
import { grpc, rawClient, unary } from './helpers/raw-agent.js';

const t = useTestDb();

const LIST = 'leasehold.v1.JobService/ListJobs';
const CLAIM = 'leasehold.v1.AttemptService/ClaimJobs';

async function key(name: string, scopes: string[] = ['read']): Promise<string> {
  const o = await keyCreate(t.pool, { name, scopes });
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  return o.value.key;
}

async function agentToken(name: string): Promise<string> {
  const o = await agentCreate(t.pool, { agentId: name });
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  return o.value.token;
}

const list = (lh: TestCoordinator, k: string) => rpc(lh.httpUrl, LIST, {}, k);
const stats = (lh: TestCoordinator) => ({ ...lh.c.credentials.stats });

/**
 * Calls `call` until it is refused (401), failing past `ms` after `since`; returns how long after
 * `since` the refusal came.
 */
async function refusedWithin(what: string, since: number, ms: number, call: () => Promise<number>): Promise<number> {
  const deadline = since + ms;
  for (;;) {
    const status = await call();
    const at = performance.now();
    if (status === 401) return at - since;
    expect(status, what).toBe(200);
    if (at > deadline) throw new Error(`${what}: still accepted ${Math.round(at - since)} ms after the revoke`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

describe('two coordinators with the default cache (60 s)', () => {
  const a = useCoordinator(t);
  const b = useCoordinator(t);
  const admin = (lh: TestCoordinator, method: string, body: unknown) => rpc(lh.httpUrl, `leasehold.v1.AdminService/${method}`, body, ADMIN_KEY);

  it('serves a key used once from memory: the database is not asked (api_keys locked against writers), an uncached key waits', async () => {
    const [cached, uncached] = [await key('ac-cached'), await key('ac-uncached')];
    const s0 = stats(a);
    expect((await list(a, cached)).status).toBe(200);
    expect(stats(a)).toMatchObject({ misses: s0.misses + 1, hits: s0.hits });

    // keyAuthenticate stamps last_used_at in its statement, so it needs a ROW EXCLUSIVE lock on
    // api_keys; SHARE MODE holds every such statement until the transaction ends.
    const locker = await t.pool.connect();
    let pending: Promise<{ status: number }> | undefined;
    try {
      await locker.query('BEGIN');
      await locker.query('LOCK TABLE api_keys IN SHARE MODE');
      for (let i = 0; i < 20; i++) expect((await list(a, cached)).status).toBe(200);
      expect(stats(a)).toMatchObject({ hits: s0.hits + 20, misses: s0.misses + 1 });

      // The control: a key this coordinator has not verified goes to the database and waits.
      pending = list(a, uncached);
      await waitFor('the uncached lookup to wait for the lock', async () => {
        const { rows } = await t.pool.query(`SELECT count(*)::int AS n FROM pg_locks WHERE NOT granted AND relation = 'api_keys'::regclass AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`);
        return rows[0].n > 0;
      });
      expect((await list(a, cached)).status).toBe(200);
    } finally {
      await locker.query('ROLLBACK');
      locker.release();
    }
    expect((await pending).status).toBe(200);
    expect(stats(a).misses).toBe(s0.misses + 2);
  });

  it('keeps no refusal: an unknown token goes to the database every time and adds nothing', async () => {
    const s0 = stats(a);
    const size = a.c.credentials.size;
    for (let i = 0; i < 3; i++) expect((await list(a, 'lh_key_not-a-real-key')).status).toBe(401);
    expect(stats(a).misses).toBe(s0.misses + 3);
    expect(a.c.credentials.size).toBe(size);
  });

  it('a key revoked through one coordinator (AdminService) is refused there at once and on the other within a second', async () => {
    const k = await key('ac-shared');
    for (const lh of [a, b, a, b]) expect((await list(lh, k)).status).toBe(200);
    const hitsB = stats(b).hits;
    expect((await list(b, k)).status).toBe(200);
    expect(stats(b).hits).toBe(hitsB + 1); // B serves it from memory

    const t0 = performance.now();
    expect((await admin(a, 'RevokeKey', { name: 'ac-shared' })).status).toBe(200);
    expect(await list(a, k)).toMatchObject({ status: 401, json: { message: 'key ac-shared was revoked' } });
    const took = await refusedWithin('B after the revoke on A', t0, 1000, async () => (await list(b, k)).status);
    expect(took).toBeLessThan(1000);
    expect((await list(b, k)).json.message).toBe('key ac-shared was revoked');
  });

  it('a key revoked by the store verb (no coordinator involved) is refused on both within a second', async () => {
    const k = await key('ac-store');
    for (const lh of [a, b, a, b]) expect((await list(lh, k)).status).toBe(200);
    const t0 = performance.now();
    expect((await keyRevoke(t.pool, { name: 'ac-store' })).outcome).toBe('ok');
    for (const [name, lh] of [['A', a], ['B', b]] as const) {
      expect(await refusedWithin(name, t0, 1000, async () => (await list(lh, k)).status)).toBeLessThan(1000);
    }
  });

  it('an agent token revoked through one coordinator is refused by AttemptService calls on the other within a second (HTTP and gRPC)', async () => {
    const token = await agentToken('ac-agent');
    const grpcB = rawClient('AttemptService', `127.0.0.1:${b.port}`);
    try {
      const claimGrpc = () =>
        unary(grpcB, 'claimJobs', { queues: ['ac-nothing'] }, token).then(
          () => 200,
          (e: grpc.ServiceError) => (e.code === grpc.status.UNAUTHENTICATED ? 401 : 500),
        );
      const claimHttp = async (lh: TestCoordinator) => (await rpc(lh.httpUrl, CLAIM, { queues: ['ac-nothing'] }, token)).status;
      for (let i = 0; i < 2; i++) {
        expect(await claimHttp(a)).toBe(200);
        expect(await claimHttp(b)).toBe(200);
        expect(await claimGrpc()).toBe(200);
      }
      const hitsB = stats(b).hits;
      expect(await claimGrpc()).toBe(200);
      expect(stats(b).hits).toBe(hitsB + 1);

      const t0 = performance.now();
      expect((await admin(a, 'RevokeAgent', { agentId: 'ac-agent' })).status).toBe(200);
      expect(await claimHttp(a)).toBe(401);
      expect(await refusedWithin('B over gRPC', t0, 1000, claimGrpc)).toBeLessThan(1000);
      expect(await claimHttp(b)).toBe(401);
    } finally {
      grpcB.close();
    }
  });

  it('a replaced bootstrap key (LEASEHOLD_ADMIN_KEY changed on another replica) is refused on both within a second', async () => {
    for (const lh of [a, b, a, b]) expect((await list(lh, ADMIN_KEY)).status).toBe(200);
    const t0 = performance.now();
    try {
      expect(await keyBootstrap(t.pool, { key: 'ac-rotated-admin-key' })).toEqual({ outcome: 'ok', value: { created: true, replaced: true } });
      for (const [name, lh] of [['A', a], ['B', b]] as const) {
        expect(await refusedWithin(name, t0, 1000, async () => (await list(lh, ADMIN_KEY)).status)).toBeLessThan(1000);
        expect((await list(lh, 'ac-rotated-admin-key')).status).toBe(200);
      }
    } finally {
      expect((await keyBootstrap(t.pool, { key: ADMIN_KEY })).outcome).toBe('ok');
    }
    await waitFor('the admin key back on both', async () => (await list(a, ADMIN_KEY)).status === 200 && (await list(b, ADMIN_KEY)).status === 200, 1000);
  });

  it('forgets everything when the listener reconnects, and serves nothing while it is down', async () => {
    const k = await key('ac-reconnect');
    for (const lh of [a, b, a, b]) expect((await list(lh, k)).status).toBe(200);
    // Revoked behind the coordinators' backs: no NOTIFY, so both still serve it from memory.
    await t.pool.query(`UPDATE api_keys SET revoked_at = now() WHERE name = 'ac-reconnect'`);
    for (const lh of [a, b]) expect((await list(lh, k)).status).toBe(200);

    const seen: Array<{ who: string; reason: string; enabled: boolean; size: number }> = [];
    const offs = [
      ['A', a],
      ['B', b],
    ].map(([who, lh]) => {
      const c = (lh as TestCoordinator).c.credentials;
      const fn = (x: { reason: string }) => seen.push({ who: who as string, reason: x.reason, enabled: c.enabled, size: c.size });
      c.on('credentials:cleared', fn);
      return () => c.off('credentials:cleared', fn);
    });
    try {
      const reconnected = Promise.all([a, b].map((lh) => once(lh.c.credentials, 'credentials:cleared', { signal: AbortSignal.timeout(10_000) })));
      const { rows } = await t.pool.query(
        `SELECT pg_terminate_backend(pid) AS done FROM pg_stat_activity WHERE application_name = 'leasehold-listener' AND datname = current_database()`,
      );
      expect(rows).toEqual([{ done: true }, { done: true }]);
      await reconnected; // the disconnects
      await untilEvents(
        [a, b].map((lh) => [lh.c.credentials, 'credentials:cleared'] as [EventEmitter, string]),
        'both listeners back',
        () => seen.filter((s) => s.reason === 'listener reconnected').length === 2,
      );
    } finally {
      for (const off of offs) off();
    }
    // Going down: nothing served and nothing kept (a failed reconnect attempt says so again);
    // coming back: empty, then served again.
    const down = seen.filter((s) => s.reason === 'listener disconnected');
    expect(new Set(down.map((s) => s.who))).toEqual(new Set(['A', 'B']));
    for (const s of down) expect(s).toMatchObject({ enabled: false, size: 0 });
    const up = seen.filter((s) => s.reason === 'listener reconnected');
    expect(up.map((s) => s.who).sort()).toEqual(['A', 'B']);
    for (const s of up) expect(s).toMatchObject({ enabled: true, size: 0 });
    for (const lh of [a, b]) expect(await list(lh, k)).toMatchObject({ status: 401, json: { message: 'key ac-reconnect was revoked' } });
    // And the cache works again after the reconnect.
    const k2 = await key('ac-after-reconnect');
    expect((await list(a, k2)).status).toBe(200);
    const hits = stats(a).hits;
    expect((await list(a, k2)).status).toBe(200);
    expect(stats(a).hits).toBe(hits + 1);
  });
});

describe('a short maximum age (LEASEHOLD_AUTH_CACHE_TTL=1500ms)', () => {
  const TTL = 1500;
  const lh = useCoordinator(t, { LEASEHOLD_AUTH_CACHE_TTL: `${TTL}ms` });

  it('refuses a key revoked in SQL without NOTIFY once its entry is older than the maximum age', async () => {
    const k = await key('ac-silent');
    const t0 = performance.now();
    expect((await list(lh, k)).status).toBe(200); // verified: the entry's age counts from here
    await t.pool.query(`UPDATE api_keys SET revoked_at = now() WHERE name = 'ac-silent'`);
    const hits = stats(lh).hits;
    expect((await list(lh, k)).status).toBe(200); // nobody told this coordinator
    expect(stats(lh).hits).toBe(hits + 1);
    const took = await refusedWithin('after the maximum age', t0, TTL + 1000, async () => (await list(lh, k)).status);
    expect(took).toBeGreaterThanOrEqual(TTL);
  });

  it('stamps last_used_at when an entry past the maximum age is verified again', async () => {
    const k = await key('ac-stamp');
    expect((await list(lh, k)).status).toBe(200);
    // As if the last stamp were two minutes old (the statement stamps at most once a minute).
    await t.pool.query(`UPDATE api_keys SET last_used_at = now() - interval '2 minutes' WHERE name = 'ac-stamp'`);
    const lastUsed = async () =>
      (await t.pool.query(`SELECT last_used_at > now() - interval '1 minute' AS fresh FROM api_keys WHERE name = 'ac-stamp'`)).rows[0].fresh as boolean;
    expect((await list(lh, k)).status).toBe(200); // from memory: no stamp
    expect(await lastUsed()).toBe(false);
    const misses = stats(lh).misses;
    await waitFor(
      'a re-verification',
      async () => (await list(lh, k)).status === 200 && stats(lh).misses > misses,
      TTL + 2000,
    );
    expect(await lastUsed()).toBe(true);
  });
});

describe('the cache off (LEASEHOLD_AUTH_CACHE_TTL=0)', () => {
  const lh = useCoordinator(t, { LEASEHOLD_AUTH_CACHE_TTL: '0' });

  it('verifies every call in the database and keeps nothing', async () => {
    const k = await key('ac-off');
    const s0 = stats(lh);
    for (let i = 0; i < 3; i++) expect((await list(lh, k)).status).toBe(200);
    expect(stats(lh)).toMatchObject({ hits: s0.hits, bypassed: s0.bypassed + 3 });
    expect(lh.c.credentials.size).toBe(0);
  });
});

describe('CredentialCache and its setting', () => {
  it('is bounded: the least recently used entry goes first', async () => {
    const c = new CredentialCache<string>((p) => p, { maxEntries: 2 });
    c.setOnline(true);
    const v = (x: string) => () => Promise.resolve(x);
    await c.resolve('h1', v('one'));
    await c.resolve('h2', v('two'));
    await c.resolve('h1', v('unused')); // a hit: h1 is now the most recent
    await c.resolve('h3', v('three'));
    expect(c.size).toBe(2);
    expect(c.stats).toMatchObject({ hits: 1, misses: 3, evicted: 1 });
    expect(await c.resolve('h1', v('again'))).toBe('one');
    expect(await c.resolve('h2', v('two, verified again'))).toBe('two, verified again');
  });

  it('does not keep an answer that raced a revocation', async () => {
    const c = new CredentialCache<string>((p) => p);
    c.setOnline(true);
    let release!: () => void;
    const slow = c.resolve('h', () => new Promise<string>((r) => (release = () => r('key:k'))));
    c.drop('key:k'); // heard while the database was answering
    release();
    expect(await slow).toBe('key:k');
    expect(c.size).toBe(0);
    expect(c.stats.misses).toBe(1);
  });

  it('reads LEASEHOLD_AUTH_CACHE_TTL: 60 s by default, 0 turns it off, at most 1 h', () => {
    expect(loadConfig({}, {}).authCacheTtlMs).toBe(60_000);
    expect(loadConfig({}, { LEASEHOLD_AUTH_CACHE_TTL: '0' }).authCacheTtlMs).toBe(0);
    expect(loadConfig({}, { LEASEHOLD_AUTH_CACHE_TTL: '5s' }).authCacheTtlMs).toBe(5000);
    expect(() => loadConfig({}, { LEASEHOLD_AUTH_CACHE_TTL: '2h' })).toThrow(ConfigError);
    expect(() => loadConfig({}, { LEASEHOLD_AUTH_CACHE_TTL: 'soon' })).toThrow(/LEASEHOLD_AUTH_CACHE_TTL="soon" is not a duration/);
  });
});
