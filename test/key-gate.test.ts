/**
 * The key gate alone (server/transport/key-gate.ts), with small bounds: past its burst of refused
 * keys an address is refused without a database lookup, a key the credential cache holds still
 * passes, the bucket refills, guesses sent at once get no more lookups than the burst, one key
 * sent many times at once is checked once, the buckets are bounded, and refused keys are logged as a summary without the key. Also how
 * addresses are grouped, and the warning about a short admin key.
 */
import { Code, ConnectError } from '@connectrpc/connect';
import pino from 'pino';
import { describe, expect, it, vi } from 'vitest';
import { CredentialCache } from '../server/core/credential-cache.js';
import { keyCreate } from '../server/store/index.js';
import { adminKeyWeakness, principalOwner, type Principal } from '../server/transport/auth.js';
import { addressKey, createKeyGate, FAILED_KEYS, type FailedKeyBounds } from '../server/transport/key-gate.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();

/** A gate on a pool of its own, whose lookups are counted, with its log lines and metric calls. */
function gate(bounds: FailedKeyBounds) {
  const pool = t.newPool(4);
  const seen = { lookups: 0 };
  pool.on('acquire', () => seen.lookups++);
  const lines: Array<Record<string, unknown>> = [];
  const log = pino({ level: 'warn' }, { write: (l: string) => void lines.push(JSON.parse(l) as Record<string, unknown>) });
  const credentials = new CredentialCache<Principal>(principalOwner);
  credentials.setOnline(true);
  const counted: string[] = [];
  const g = createKeyGate({ db: pool, credentials, log, listener: 'http', metrics: { authRefused: (l, r) => void counted.push(`${l} ${r}`) } }, bounds);
  return { g, seen, lines, counted, credentials };
}

/** What `check` did: the principal's name, or the error's code and message. */
async function outcome(p: Promise<Principal>): Promise<string> {
  try {
    const v = await p;
    return v.kind === 'key' ? `ok ${v.name}` : `ok ${v.agentId}`;
  } catch (err) {
    if (!(err instanceof ConnectError)) throw err;
    return `${Code[err.code]}: ${err.rawMessage}`;
  }
}

async function key(name: string): Promise<string> {
  const o = await keyCreate(t.pool, { name, scopes: ['read'] });
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  return o.value.key;
}

/** What an address past its bound is told (the wait is rounded up to whole seconds). */
const limited = (s: number) => `ResourceExhausted: too many refused keys from this address: retry in ${s} s`;
const LIMITED = limited(1);

describe('the key gate', () => {
  it('refuses an address past its burst without a lookup; a cached key passes; another address is not concerned; the bucket refills', async () => {
    // The gate's clock (performance.now) is the test's to move: on the real one, the lookups and
    // the key created below take time that a loaded machine can stretch past a refill.
    vi.useFakeTimers({ toFake: ['performance'] });
    try {
      await refillsOnItsClock();
    } finally {
      vi.useRealTimers();
    }
  });

  async function refillsOnItsClock() {
    const { g, seen, counted } = gate({ burst: 3, perSecond: 2, addresses: 100 });
    const good = await key('gate-good');
    expect(await outcome(g.check(good, '10.0.0.1'))).toBe('ok gate-good');
    for (let i = 0; i < 3; i++) expect(await outcome(g.check(`lh_key_guess-${i}`, '10.0.0.1'))).toBe('Unauthenticated: unknown key or token');
    const before = seen.lookups;
    expect(await outcome(g.check('lh_key_guess-3', '10.0.0.1'))).toBe(LIMITED);
    expect(seen.lookups).toBe(before);
    // The cached key, from the same address: served from the cache.
    expect(await outcome(g.check(good, '10.0.0.1'))).toBe('ok gate-good');
    expect(seen.lookups).toBe(before);
    // A good key not verified yet waits like a guess.
    expect(await outcome(g.check(await key('gate-new'), '10.0.0.1'))).toBe(LIMITED);
    expect(await outcome(g.check('lh_key_guess-4', '10.0.0.2'))).toBe('Unauthenticated: unknown key or token');
    // 2 a second: 0.4 s later still none; after 0.6 s one more key is checked, then the address
    // is refused again.
    vi.advanceTimersByTime(400);
    expect(await outcome(g.check('lh_key_guess-4b', '10.0.0.1'))).toBe(LIMITED);
    vi.advanceTimersByTime(200);
    expect(await outcome(g.check('lh_key_guess-5', '10.0.0.1'))).toBe('Unauthenticated: unknown key or token');
    expect(await outcome(g.check('lh_key_guess-6', '10.0.0.1'))).toBe(LIMITED);
    expect(counted).toEqual([...Array<string>(3).fill('http key'), 'http limited', 'http limited', 'http key', 'http limited', 'http key', 'http limited']);
  }

  it('never limits a key found good here, after its cache entry aged or the cache was cleared (a listener reconnect)', async () => {
    const { g, seen, credentials } = gate({ burst: 2, perSecond: 0.01, addresses: 100 });
    const good = await key('gate-known');
    expect(await outcome(g.check(good, '10.0.0.7'))).toBe('ok gate-known');
    for (let i = 0; i < 2; i++) await outcome(g.check(`lh_key_known-guess-${i}`, '10.0.0.7'));
    expect(await outcome(g.check('lh_key_known-guess-2', '10.0.0.7'))).toBe(limited(100));
    // Before, a key whose cache entry was gone met the limit as a guess, for as long as the guessing went on.
    credentials.setOnline(true);
    const before = seen.lookups;
    expect(await outcome(g.check(good, '10.0.0.7'))).toBe('ok gate-known');
    expect(seen.lookups - before).toBe(1); // checked in the database again, as it must be
    expect(await outcome(g.check('lh_key_known-guess-3', '10.0.0.7'))).toBe(limited(100)); // and no token given to the guesser
  });

  it('gives guesses sent at once no more lookups than the burst', async () => {
    const { g, seen } = gate({ burst: 3, perSecond: 0.5, addresses: 100 });
    const answers = await Promise.all(Array.from({ length: 20 }, (_, i) => outcome(g.check(`lh_key_at-once-${i}`, '10.0.0.3'))));
    expect(answers.filter((a) => a === limited(2))).toHaveLength(17);
    expect(seen.lookups).toBe(3);
  });

  it('checks the same key sent many times at once once, for one token', async () => {
    const { g, seen } = gate({ burst: 3, perSecond: 0.5, addresses: 100 });
    const fresh = await key('gate-at-once');
    const before = seen.lookups;
    expect(new Set(await Promise.all(Array.from({ length: 20 }, () => outcome(g.check(fresh, '10.0.0.6')))))).toEqual(new Set(['ok gate-at-once']));
    expect(seen.lookups - before).toBe(1);
    expect(new Set(await Promise.all(Array.from({ length: 20 }, () => outcome(g.check('lh_key_same-guess', '10.0.0.6')))))).toEqual(new Set(['Unauthenticated: unknown key or token']));
    // The 20 took one token: two more guesses are checked, the next is not.
    expect(await outcome(g.check('lh_key_other-1', '10.0.0.6'))).toBe('Unauthenticated: unknown key or token');
    expect(await outcome(g.check('lh_key_other-2', '10.0.0.6'))).toBe('Unauthenticated: unknown key or token');
    expect(await outcome(g.check('lh_key_other-3', '10.0.0.6'))).toBe(limited(2));
  });

  it('gives back the token of a good key, and of a check the database could not answer', async () => {
    const { g } = gate({ burst: 2, perSecond: 0.5, addresses: 100 });
    const good = await key('gate-giveback');
    for (let i = 0; i < 5; i++) expect(await outcome(g.check(good, '10.0.0.4'))).toBe('ok gate-giveback');
    expect(g.size).toBe(0);
    const pool = t.newPool(1);
    const db = new Proxy(pool, { get: (p, name) => (name === 'query' ? () => Promise.reject(new Error('the database is down (test)')) : Reflect.get(p, name)) });
    const down = createKeyGate({ db, log: pino({ level: 'silent' }), listener: 'grpc' }, { burst: 2, perSecond: 0.5, addresses: 100 });
    for (let i = 0; i < 5; i++) await expect(down.check(`lh_key_down-${i}`, '10.0.0.4')).rejects.toThrow('the database is down (test)');
    expect(down.size).toBe(0);
  });

  it('keeps at most `addresses` buckets, dropping the stalest', async () => {
    const { g } = gate({ burst: 1, perSecond: 0.01, addresses: 3 });
    for (let i = 1; i <= 5; i++) expect(await outcome(g.check('lh_key_many', `10.0.1.${i}`))).toBe('Unauthenticated: unknown key or token');
    expect(g.size).toBe(3);
    // 10.0.1.1 was dropped: it starts afresh; 10.0.1.5 is still refused.
    expect(await outcome(g.check('lh_key_many', '10.0.1.1'))).toBe('Unauthenticated: unknown key or token');
    expect(await outcome(g.check('lh_key_many', '10.0.1.5'))).toBe(limited(100));
  });

  it('logs refused keys as a summary, with the address and the listener, never the key', async () => {
    const { g, lines } = gate({ burst: 3, perSecond: 0.5, addresses: 100 });
    for (let i = 0; i < 6; i++) await outcome(g.check(`lh_key_secret-guess-${i}`, '10.0.0.5'));
    expect(lines.map((l) => l.msg)).toEqual(['key refused', 'call refused without a check: too many refused keys from its address']);
    expect(lines[0]).toMatchObject({ listener: 'http', remote: '10.0.0.5', reason: 'unknown key or token' });
    g.flush();
    expect(lines.slice(2)).toEqual([
      expect.objectContaining({ msg: 'key refused (2 more like it in the last 60 s; the last of them shown)', listener: 'http', remote: '10.0.0.5', more: 2 }),
      expect.objectContaining({ msg: expect.stringMatching(/^call refused without a check: .* \(2 more like it/), listener: 'http', remote: '10.0.0.5', more: 2 }),
    ]);
    expect(JSON.stringify(lines)).not.toContain('secret-guess');
  });

  it('bounds the checks of the whole listener too, whatever addresses they come from (many, or named by a trusted proxy)', async () => {
    const { g, seen, lines } = gate({ burst: 3, perSecond: 0.5, addresses: 100, listenerBurst: 5, listenerPerSecond: 0.5 });
    const good = await key('gate-wide');
    expect(await outcome(g.check(good, '10.0.2.100'))).toBe('ok gate-wide');
    const before = seen.lookups;
    const answers: string[] = [];
    for (let i = 1; i <= 10; i++) answers.push(await outcome(g.check(`lh_key_wide-${i}`, `10.0.2.${i}`)));
    // The good key gave its token back: 5 guesses checked, from 5 addresses each under its own bound.
    expect(answers).toEqual([...Array<string>(5).fill('Unauthenticated: unknown key or token'), ...Array<string>(5).fill('ResourceExhausted: too many refused keys on this listener: retry in 2 s')]);
    expect(seen.lookups - before).toBe(5);
    // A key found good here is still served; a new one waits.
    expect(await outcome(g.check(good, '10.0.2.200'))).toBe('ok gate-wide');
    expect(await outcome(g.check(await key('gate-wide-new'), '10.0.2.201'))).toBe('ResourceExhausted: too many refused keys on this listener: retry in 2 s');
    expect(lines.map((l) => l.msg)).toContain('call refused without a check: too many refused keys on this listener, from all addresses');
  });

  it('has bounds no real caller meets', () => {
    expect(FAILED_KEYS).toEqual({ burst: 30, perSecond: 5, addresses: 10_000, listenerBurst: 300, listenerPerSecond: 50 });
  });
});

describe('addressKey', () => {
  it('keeps IPv4 addresses, unwraps IPv4-mapped ones, and takes the /64 of IPv6 ones', () => {
    expect(addressKey('127.0.0.1')).toBe('127.0.0.1');
    expect(addressKey('::ffff:10.1.2.3')).toBe('10.1.2.3');
    expect(addressKey('2001:db8:1:2:3:4:5:6')).toBe('2001:db8:1:2::/64');
    expect(addressKey('2001:db8:1:2::9')).toBe(addressKey('2001:DB8:1:2:ffff:ffff:ffff:ffff'));
    expect(addressKey('2001:db8::1')).toBe('2001:db8:0:0::/64');
    expect(addressKey('::1')).toBe('0:0:0:0::/64');
    expect(addressKey('64:ff9b::10.1.2.3')).toBe('64:ff9b:0:0::/64');
    expect(addressKey('fe80::1%eth0')).toBe('fe80:0:0:0::/64');
    expect(addressKey(undefined)).toBe('');
  });
});

describe('adminKeyWeakness', () => {
  it('warns about an admin key under 24 characters, saying how to make one, without showing it', () => {
    const w = adminKeyWeakness('dev-admin-key');
    expect(w).toBe('LEASEHOLD_ADMIN_KEY has 13 characters, few enough to guess: set a random one of at least 24, e.g. the output of `openssl rand -hex 24`');
    expect(w).not.toContain('dev-admin-key');
    expect(adminKeyWeakness('x'.repeat(23))).toMatch(/^LEASEHOLD_ADMIN_KEY has 23 characters/);
    expect(adminKeyWeakness('x'.repeat(24))).toBeUndefined();
    expect(adminKeyWeakness('0123456789abcdef0123456789abcdef0123456789abcdef')).toBeUndefined();
  });
});
