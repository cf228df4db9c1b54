/**
 * Refused keys, bounded per remote address. A wrong key used to cost the coordinator a database
 * query and tell the caller no more than "wrong", with nothing to limit or log it: 2,000 guesses a
 * second found a short admin key in 2.4 s, and left no line in the log
 * (.scratch/review-security.md, 3).
 *
 * Each address has a token bucket of refused keys (`FAILED_KEYS`: a burst of 30, then 5 a second).
 * Past it, a call whose key the credential cache does not hold verified is answered at once with
 * RESOURCE_EXHAUSTED (HTTP 429 with `retry-after`), and the database is not asked. A key found
 * good here before is never limited (it is still checked), so callers already at work from that
 * address (n8n behind the same NAT or proxy) carry on. A key not verified yet (a new one, or one whose cache entry aged out) waits like a
 * guess. A check takes its token before it asks the database, and a key found good gives it back:
 * a thousand guesses sent at once get no more checks than a thousand sent one after another. The
 * same key sent many times at once (n8n's first calls after a restart, before the cache holds its
 * key) is checked once, for one token.
 *
 * The address is the caller's as caller-address.ts tells it: the socket's, or behind a proxy
 * the one `X-Forwarded-For` names (its last, or the last past the proxies listed). IPv6 addresses share a bucket per /64, which one host commonly
 * holds whole. Each listener keeps its own buckets, at most `addresses` of them: a bucket full again
 * is dropped (it is as good as none), and past the bound the one whose last check is oldest goes.
 *
 * Refused keys are logged as summaries (`LogSummary`), with the address and the listener and never
 * the key, and counted in `/metrics` (`leasehold_auth_refused_total`).
 */
import net from 'node:net';
import { Code, ConnectError } from '@connectrpc/connect';
import type { CredentialCache } from '../core/credential-cache.js';
import { LogSummary } from '../lib/log-summary.js';
import type { Logger } from '../log.js';
import { hashSecret, type Queryable } from '../store/index.js';
import { authenticate, authenticateCached, type Principal } from './auth.js';
import type { ProxyTrust } from '../lib/proxy-trust.js';
import { callerAddress } from './caller-address.js';
import type { Metrics } from './metrics.js';

export interface FailedKeyBounds {
  /** Refused keys an address may have in a row. */
  burst: number;
  /** Then this many a second. */
  perSecond: number;
  /** Addresses a listener keeps a bucket for. */
  addresses: number;
  /**
   * Refused keys the whole listener may have in a row, then a second, whatever addresses they
   * come from (many addresses, or addresses a trusted proxy's header names): what bounds the
   * guessing, and the database lookups, in all. Default 10 times an address's.
   */
  listenerBurst?: number;
  listenerPerSecond?: number;
}

/** A real caller never meets these: a script with a wrong key fails a few times, then stops. */
export const FAILED_KEYS: FailedKeyBounds = { burst: 30, perSecond: 5, addresses: 10_000, listenerBurst: 300, listenerPerSecond: 50 };

export interface KeyGateDeps {
  db: Queryable;
  credentials?: CredentialCache<Principal> | undefined;
  log: Logger;
  metrics?: Pick<Metrics, 'authRefused'> | undefined;
  /** Whose `X-Forwarded-For` names a call's address (`LEASEHOLD_TRUST_PROXY`, caller-address.ts); undefined: none's. */
  trustProxy?: ProxyTrust | undefined;
  /** Which listener this gate guards (the log's and the metric's label). */
  listener: 'http' | 'grpc';
}

export interface KeyGate {
  /**
   * The principal of `token` sent from `peer` (a socket's `remoteAddress`) with `forwardedFor`
   * (its `X-Forwarded-For`, read only with `trustProxy`). Throws UNAUTHENTICATED for a refused
   * key, as `authenticate` does; RESOURCE_EXHAUSTED, with `retry-after` in its metadata, when the
   * caller's address (or the listener) is past its bound and the key is not in the cache. Any
   * other error (the database unavailable) is passed on and counts against no one.
   */
  check(token: string, peer: string | undefined, forwardedFor?: string | string[]): Promise<Principal>;
  /** Addresses with a bucket now. */
  readonly size: number;
  /** Logs the summaries' counts now (`LogSummary.flush`). */
  flush(): void;
}

interface Bucket {
  tokens: number;
  /** `performance.now()` when `tokens` was counted. */
  at: number;
}

/** A gate for one listener's key checks, within `bounds`. */
export function createKeyGate(deps: KeyGateDeps, bounds: FailedKeyBounds = FAILED_KEYS): KeyGate {
  const { listener } = deps;
  /** Insertion order is the order of last checks: the first is the stalest. */
  const buckets = new Map<string, Bucket>();
  const refused = new LogSummary(deps.log, 'warn', 'key refused');
  const limited = new LogSummary(deps.log, 'warn', 'call refused without a check: too many refused keys from its address');
  const limitedAll = new LogSummary(deps.log, 'warn', 'call refused without a check: too many refused keys on this listener, from all addresses');

  /** Tokens in a bucket of `burst` refilled at `perSecond`, at `now`. */
  const fill = (b: Bucket, burst: number, perSecond: number, now: number) => Math.min(burst, b.tokens + ((now - b.at) / 1000) * perSecond);
  const level = (b: Bucket, now: number) => fill(b, bounds.burst, bounds.perSecond, now);
  /** The listener's own bucket, taken from by every check an address's bucket lets through. */
  const allBurst = bounds.listenerBurst ?? bounds.burst * 10;
  const allPerSecond = bounds.listenerPerSecond ?? bounds.perSecond * 10;
  const all: Bucket = { tokens: allBurst, at: performance.now() };
  const allLevel = (now: number) => fill(all, allBurst, allPerSecond, now);

  /**
   * Takes a token of `addr`'s bucket and one of the listener's: 0, or the seconds until both
   * have one (none taken); `wide` says the listener's bucket was the one empty.
   */
  const take = (addr: string): { wait: number; wide: boolean } => {
    const now = performance.now();
    const b = buckets.get(addr);
    const tokens = b ? level(b, now) : bounds.burst;
    if (tokens < 1) return { wait: (1 - tokens) / bounds.perSecond, wide: false };
    const allTokens = allLevel(now);
    if (allTokens < 1) return { wait: (1 - allTokens) / allPerSecond, wide: true };
    all.tokens = allTokens - 1;
    all.at = now;
    buckets.delete(addr);
    buckets.set(addr, { tokens: tokens - 1, at: now });
    if (buckets.size > bounds.addresses) buckets.delete(buckets.keys().next().value!);
    return { wait: 0, wide: false };
  };

  /** Gives back the tokens a check took when the key was not refused. */
  const giveBack = (addr: string) => {
    const now = performance.now();
    all.tokens = Math.min(allBurst, allLevel(now) + 1);
    all.at = now;
    const b = buckets.get(addr);
    if (!b) return;
    const tokens = level(b, now) + 1;
    if (tokens >= bounds.burst) buckets.delete(addr);
    else {
      b.tokens = tokens;
      b.at = now;
    }
  };

  /** A check: its key looked up, the token it took (`took`) given back unless the key is refused. */
  const lookup = async (addr: string, token: string, hash: string, took: boolean, remote: string | undefined): Promise<Principal> => {
    try {
      const principal = await authenticate(deps.db, token, deps.credentials, hash);
      if (took) giveBack(addr);
      remember(hash);
      return principal;
    } catch (err) {
      if (!(err instanceof ConnectError)) {
        if (took) giveBack(addr);
        throw err;
      }
      known.delete(hash);
      // The reason names at most a key's or an agent's name ("… was revoked"), never the secret.
      refused.note({ listener, remote, reason: err.rawMessage });
      deps.metrics?.authRefused(listener, 'key');
      throw err;
    }
  };

  /** Lookups in flight, by address and the token's SHA-256. */
  const inFlight = new Map<string, Promise<Principal>>();
  /**
   * SHA-256 of keys found good here, most recent last: they are checked as usual, never limited.
   * The credential cache alone could not say so: its entries age out (60 s) and are all dropped
   * when the listener reconnects, and a key in use then met the limit like a guess, for as long
   * as someone kept guessing from its address (behind a proxy, every caller's).
   */
  const known = new Map<string, true>();
  const remember = (hash: string) => {
    known.delete(hash);
    known.set(hash, true);
    if (known.size > bounds.addresses) known.delete(known.keys().next().value!);
  };

  return {
    check(token, peer, forwardedFor) {
      const remote = callerAddress(peer, forwardedFor, deps.trustProxy);
      const addr = addressKey(remote);
      const hash = hashSecret(token);
      const id = `${addr} ${hash}`;
      const same = inFlight.get(id);
      if (same) return same;
      const took = !known.has(hash);
      const { wait, wide } = took ? take(addr) : { wait: 0, wide: false };
      if (wait > 0) {
        return authenticateCached(token, deps.credentials, () => {
          (wide ? limitedAll : limited).note({ listener, remote });
          deps.metrics?.authRefused(listener, 'limited');
          const s = Math.ceil(wait);
          const from = wide ? 'on this listener' : 'from this address';
          return new ConnectError(`too many refused keys ${from}: retry in ${s} s`, Code.ResourceExhausted, { 'retry-after': String(s) });
        }, hash);
      }
      const p = lookup(addr, token, hash, took, remote);
      inFlight.set(id, p);
      const done = () => inFlight.delete(id);
      p.then(done, done);
      return p;
    },
    get size() {
      return buckets.size;
    },
    flush() {
      refused.flush();
      limited.flush();
      limitedAll.flush();
    },
  };
}

/**
 * The bucket of a remote address: the address itself, IPv4 for an IPv4-mapped IPv6 address, the
 * /64 of any other IPv6 address (written `a:b:c:d::/64`).
 */
export function addressKey(remote: string | undefined): string {
  if (!remote) return '';
  const mapped = /^::ffff:(\d+\.\d+\.\d+\.\d+)$/i.exec(remote);
  if (mapped) return mapped[1]!;
  if (!net.isIPv6(remote)) return remote;
  const [head = '', tail] = remote.split('%', 1)[0]!.split('::');
  // A dotted IPv4 tail is two groups, and only ever the last two.
  const groups = (s: string) => (s ? s.split(':').flatMap((g) => (g.includes('.') ? ['0', '0'] : [g])) : []);
  const h = groups(head);
  const t = groups(tail ?? '');
  const all = tail === undefined ? h : [...h, ...Array<string>(8 - h.length - t.length).fill('0'), ...t];
  return `${all
    .slice(0, 4)
    .map((g) => parseInt(g, 16).toString(16))
    .join(':')}::/64`;
}
