/**
 * Verified credentials, in memory: SHA-256 of a presented API key or agent token → who it is, so
 * a caller that sends the same key on every request (n8n enqueuing one job at a time) is not a
 * database round trip per call. One cache per coordinator process.
 *
 * Why a cached credential still stops working within a second of its revocation, on every
 * replica: revoking (`keyRevoke`, `agentRevoke`, a replaced bootstrap key) sends a `credentials`
 * NOTIFY in its own statement, and each coordinator's listener calls `drop()` with the owner it
 * names. Notifications are only heard while the listener is connected, so the cache serves
 * nothing unless `setOnline(true)` said it is, and it forgets everything whenever the listener
 * drops or reconnects (what was sent meanwhile is lost). Whatever slips past all that (a
 * half-open listener socket that has not noticed yet, a revoke written by hand in SQL) is bounded
 * by `maxAgeMs`: an older entry is verified in the database again.
 *
 * Only successes are kept: an unknown or revoked credential goes to the database every time, so
 * a key works the moment it is created. Size is bounded (least recently used go first).
 *
 * A lookup that raced a drop is not cached: every drop and clear moves a generation counter,
 * and an answer from the database is kept only if the counter did not move while it was read
 * (a NOTIFY that arrives after the answer is stored drops it as usual).
 */
import { EventEmitter } from 'node:events';
import { z } from 'zod';

export interface CredentialCacheConfig {
  /** An entry older than this is verified in the database again; 0 turns the cache off. Default 60 s. */
  maxAgeMs?: number;
  /** Most entries kept; the least recently used go first. Default 4096. */
  maxEntries?: number;
}

/** What the cache did since it was made (tests and metrics read it). */
export interface CredentialCacheStats {
  /** Calls answered from memory. */
  hits: number;
  /** Calls verified in the database while the cache was usable (unknown, expired, or refused). */
  misses: number;
  /** Calls verified in the database because the cache was off or offline. */
  bypassed: number;
  /** Entries dropped by a revocation (`drop`). */
  dropped: number;
  /** Entries dropped by `clear` (listener lost or regained, shutdown). */
  cleared: number;
  /** Entries pushed out by the size bound. */
  evicted: number;
}

export interface CredentialCacheEvents {
  /** Entries of `owner` were dropped (a revocation). */
  'credentials:dropped': [{ owner: string; entries: number }];
  /** Every entry was dropped. */
  'credentials:cleared': [{ reason: string; entries: number }];
}

const configSchema = z.object({
  maxAgeMs: z.int().min(0).default(60_000),
  maxEntries: z.int().min(1).max(1_000_000).default(4096),
});

interface Entry<P> {
  value: P;
  owner: string;
  /** `performance.now()` when the database said yes. */
  verifiedAt: number;
}

/**
 * A bounded map from a credential's hash to its verified principal `P`; `owner(p)` names the
 * identity a revocation drops (e.g. `key:n8n-prod`, `agent:printer-1`).
 */
export class CredentialCache<P> extends EventEmitter<CredentialCacheEvents> {
  readonly config: z.output<typeof configSchema>;
  readonly stats: CredentialCacheStats = { hits: 0, misses: 0, bypassed: 0, dropped: 0, cleared: 0, evicted: 0 };
  /** Insertion order is recency order: a hit moves its entry to the end. */
  private readonly entries = new Map<string, Entry<P>>();
  private generation = 0;
  private online = false;

  constructor(
    private readonly owner: (p: P) => string,
    config: CredentialCacheConfig = {},
  ) {
    super();
    this.config = configSchema.parse(config);
  }

  /** Whether entries are served: the cache is on and the revocation channel is listened to. */
  get enabled(): boolean {
    return this.config.maxAgeMs > 0 && this.online;
  }

  /** Entries held now. */
  get size(): number {
    return this.entries.size;
  }

  /**
   * Says whether revocations can be heard (the listener's `connected` and `disconnected`). Either
   * way everything is forgotten: going offline, nothing may be served; coming back, what was
   * revoked meanwhile was never heard.
   */
  setOnline(online: boolean): void {
    this.online = online;
    this.clear(online ? 'listener reconnected' : 'listener disconnected');
  }

  /**
   * The principal of the credential whose SHA-256 is `hash`: from memory when the cache is
   * enabled and holds a fresh entry, otherwise from `verify` (the database), whose success is
   * kept and whose failure (thrown) is passed on and not kept.
   */
  async resolve(hash: string, verify: () => Promise<P>): Promise<P> {
    if (!this.enabled) {
      this.stats.bypassed++;
      return verify();
    }
    const hit = this.entries.get(hash);
    if (hit) {
      this.entries.delete(hash);
      if (performance.now() - hit.verifiedAt < this.config.maxAgeMs) {
        this.entries.set(hash, hit);
        this.stats.hits++;
        return hit.value;
      }
    }
    this.stats.misses++;
    const generation = this.generation;
    const verifiedAt = performance.now();
    const value = await verify();
    // A drop, a clear or an outage while the database answered: the answer may predate a
    // revocation that was just heard, so it is used for this call only.
    if (this.generation === generation && this.enabled) this.store(hash, { value, owner: this.owner(value), verifiedAt });
    return value;
  }

  /** Forgets every entry of `owner` (its credential was revoked or replaced); returns how many. */
  drop(owner: string): number {
    this.generation++;
    let n = 0;
    for (const [hash, e] of this.entries) {
      if (e.owner !== owner) continue;
      this.entries.delete(hash);
      n++;
    }
    this.stats.dropped += n;
    this.emit('credentials:dropped', { owner, entries: n });
    return n;
  }

  /** Forgets every entry. */
  clear(reason: string): void {
    this.generation++;
    const n = this.entries.size;
    this.entries.clear();
    this.stats.cleared += n;
    this.emit('credentials:cleared', { reason, entries: n });
  }

  private store(hash: string, e: Entry<P>) {
    this.entries.delete(hash);
    this.entries.set(hash, e);
    if (this.entries.size <= this.config.maxEntries) return;
    const oldest = this.entries.keys().next();
    if (!oldest.done) {
      this.entries.delete(oldest.value);
      this.stats.evicted++;
    }
  }
}
