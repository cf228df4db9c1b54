/**
 * The coordinator's configuration: the fixed points of DESIGN.md, read from flags and the
 * environment, validated once at start with errors that name the setting.
 */
import { X509Certificate } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { z } from 'zod';
import { formatDuration, parseDuration } from './duration.js';
import { DEFAULT_RETENTION_MS, DEFAULT_SWEEP_SHARE } from './core/purger.js';
import { limits, MAX_TIMER_MS } from './domain/validation.js';
import { DEFAULT_VACUUM_DEAD_ROWS } from './core/vacuumer.js';
import { EgressPolicy } from './lib/egress.js';
import { ProxyTrust } from './lib/proxy-trust.js';
import { HOT_POOL_MAX, POOL_MAX } from './store/database.js';

export interface Config {
  /** `DATABASE_URL`; when absent an embedded PostgreSQL runs with its data under `dataDir`. */
  databaseUrl: string | undefined;
  dataDir: string;
  /**
   * The sizes of the main pool and of the hot pool (claims, starts, reports, heartbeats, the
   * reaper): `LEASEHOLD_DB_POOL_MAX` (default 20, at least 2: the purger holds one connection
   * while it cancels its VACUUM from another) and `LEASEHOLD_DB_HOT_POOL_MAX` (default 8). A
   * coordinator opens up to both plus one, its listener's; a small database's `max_connections`
   * needs them lower (docs/deploy.md, "A managed PostgreSQL").
   */
  dbPoolMax: number;
  dbHotPoolMax: number;
  grpcAddr: string;
  httpAddr: string;
  adminKey: string | undefined;
  leaseTtlMs: number;
  claimTtlMs: number;
  heartbeatIntervalMs: number;
  /**
   * How long a reported completion that finds no completion statement running waits for others
   * to share its statement and commit (`LEASEHOLD_COMPLETION_LINGER`, default 20 ms, `0`: none;
   * at most a tenth of what is left of a lease after a heartbeat interval, and at most 1 s).
   * Jobs that come one at a time then cost PostgreSQL fewer commits; a job reads as finished,
   * and the agent hears its ack, that much later. Starts never wait.
   */
  completionLingerMs: number;
  reaperIntervalMs: number;
  /**
   * Finished jobs older than this are purged by the purger (`LEASEHOLD_RETENTION`, default 7
   * days); `undefined` (`off` or `0`) keeps them forever.
   */
  retentionMs: number | undefined;
  /** Time between purger runs (`LEASEHOLD_PURGE_INTERVAL`, default 10 minutes). */
  purgeIntervalMs: number;
  /**
   * The share of its time the purger's sweep of a dropped day's rows spends working, the rest
   * left to the transitions (`LEASEHOLD_PURGE_SWEEP_SHARE`, default 0.1; 1: no pause).
   */
  purgeSweepShare: number;
  /**
   * The vacuumer VACUUMs `jobs_live` once this many of its rows were updated other than HOT or
   * deleted (each leaving a dead row) since the last VACUUM (`LEASEHOLD_VACUUM_DEAD_ROWS`, default
   * 50,000: about 25,000 jobs); `undefined` (`off` or `0`) leaves it all to autovacuum.
   */
  vacuumDeadRows: number | undefined;
  /**
   * How long a verified API key or agent token is trusted from memory before it is checked in
   * the database again (`LEASEHOLD_AUTH_CACHE_TTL`, default 60 s, at most 1 hour; `0` turns the
   * cache off). Revocations reach every coordinator sooner, by NOTIFY; this bounds the rest.
   */
  authCacheTtlMs: number;
  /**
   * The webhook deliverer: run interval, send timeout, sends per delivery, first retry delay, and
   * the addresses no send may connect to (`LEASEHOLD_WEBHOOK_DENY`, default link-local and the
   * clouds' metadata services).
   */
  webhook: { intervalMs: number; timeoutMs: number; maxAttempts: number; backoffMs: number; egress: EgressPolicy };
  /** Every dead-letter alert is also POSTed here (`LEASEHOLD_ALERT_URL`), signed with the notify secret. */
  alertUrl: string | undefined;
  /**
   * A new agent stream must send Hello within this (`LEASEHOLD_HELLO_TIMEOUT`, default 10 s) or
   * is closed with DEADLINE_EXCEEDED; at most `helloPendingMax` (`LEASEHOLD_HELLO_PENDING_MAX`,
   * default 256) streams wait for theirs at once, the rest are refused with RESOURCE_EXHAUSTED.
   */
  helloTimeoutMs: number;
  helloPendingMax: number;
  /**
   * Every HTTP/2 connection of the gRPC listener is sent a PING this often, and closed when its
   * ack takes as long again (`LEASEHOLD_AGENT_KEEPALIVE`, default 20 s; `off`: none): an agent on
   * a PC that slept, lost its network or froze leaves no stream open, holding slots the dispatcher
   * would keep filling, until the kernel gives its socket up (about 15 minutes).
   */
  agentKeepaliveMs: number | undefined;
  /**
   * TLS on both listeners when both are set (`LEASEHOLD_TLS_CERT`, `LEASEHOLD_TLS_KEY`: PEM files).
   * `clientCaFile` (`LEASEHOLD_TLS_CLIENT_CA`, a PEM file of one or more CA certificates): the
   * gRPC listener then asks every connection for a client certificate signed by one of them and
   * fails the handshake of any without (mTLS for agents); the HTTP listener does not ask. The
   * agent token is still required on top.
   */
  tls: { certFile: string; keyFile: string; clientCaFile?: string } | undefined;
  /**
   * Cleartext listeners on an address other than loopback were asked for: `--insecure`
   * (`LEASEHOLD_INSECURE=1`). Without it (or TLS, or `trustProxy`) such a start is refused.
   */
  insecure: boolean;
  /**
   * A TLS-terminating proxy is the only way to the listeners (`LEASEHOLD_TRUST_PROXY=1`, or the
   * proxies' addresses), e.g. Caddy in front of a container that listens on `0.0.0.0`: cleartext
   * on a non-loopback address is allowed, as the proxy's own network leg, and a caller's address
   * is read from `X-Forwarded-For` (transport/caller-address.ts). Undefined: not set.
   */
  trustProxy: ProxyTrust | undefined;
  /**
   * Start on a database migrated by a newer release (`LEASEHOLD_ALLOW_NEWER_SCHEMA=1`), as a
   * deliberate rollback; without it such a start (and `leasehold migrate`) is refused. Never
   * past a schema level above this release's (store/schema-compat.ts): that is always refused.
   */
  allowNewerSchema: boolean;
}

/** The completion linger when `LEASEHOLD_COMPLETION_LINGER` is not set (less where the lease leaves less room). */
export const DEFAULT_COMPLETION_LINGER_MS = 20;

/** Flags given on the command line; each overrides its environment variable. */
export interface ConfigFlags {
  grpcAddr?: string;
  httpAddr?: string;
  dataDir?: string;
  /** `--insecure`: accept cleartext listeners on a non-loopback address. */
  insecure?: boolean;
}

export class ConfigError extends Error {
  override readonly name = 'ConfigError';
}

export { parseDuration } from './duration.js';

const TTL_LIMIT = 'a claim or a start takes a TTL of at most a day, and one above would refuse them all';

const addr = z.string().regex(/^[^\s:]+:\d{1,5}$|^\[[0-9a-fA-F:]+\]:\d{1,5}$/, 'must be host:port, e.g. 127.0.0.1:50051');

/**
 * The jitter of the maintenance services' schedules (reaper, purger, webhook deliverer: their
 * default, which the coordinator keeps): a wait is the interval ± 10 %.
 */
const SCHEDULE_JITTER = 0.1;

/**
 * The longest interval of a jittered schedule (`LEASEHOLD_REAPER_INTERVAL`,
 * `LEASEHOLD_PURGE_INTERVAL`, `LEASEHOLD_WEBHOOK_INTERVAL`): its longest wait, the interval plus
 * its jitter, must fit a timer (`MAX_TIMER_MS`); about 22.6 days.
 */
export const MAX_SCHEDULE_INTERVAL_MS = Math.floor(MAX_TIMER_MS / (1 + SCHEDULE_JITTER));

/** Why a duration has its maximum, for the message that refuses one above it. */
const TIMER_LIMIT = `the longest a timer can wait is ${MAX_TIMER_MS} ms, about 24.8 days; a timer set longer fires at once`;
const EXACT_LIMIT = 'a larger number of milliseconds is not held exactly';
const SCHEDULE_LIMIT = `with the schedule's jitter (+10 %) it must fit a timer, at most ${MAX_TIMER_MS} ms; a timer set longer fires at once`;

/**
 * A duration setting: `fallback` when unset, else from `min` to `max` ms (by default the longest
 * timer, `MAX_TIMER_MS`: every duration here ends up in one), `why` saying where the maximum
 * comes from.
 */
function duration(name: string, raw: string | undefined, fallback: number, min: number, max = MAX_TIMER_MS, why = TIMER_LIMIT): number {
  if (raw === undefined || raw === '') return fallback;
  const ms = parseDuration(raw);
  if (ms === undefined) throw new ConfigError(`${name}=${JSON.stringify(raw)} is not a duration: use e.g. 500ms, 2s, 1m`);
  if (ms < min) throw new ConfigError(`${name}=${raw} is below the minimum of ${min} ms`);
  if (ms > max) {
    const written = formatDuration(max);
    throw new ConfigError(`${name}=${raw} is above the maximum of ${written.endsWith('ms') ? `${max} ms` : `${written} (${max} ms)`}: ${why}`);
  }
  return ms;
}

function count(name: string, raw: string | undefined, fallback: number, min: number, max: number): number {
  if (raw === undefined || raw === '') return fallback;
  const n = Number(raw);
  if (!Number.isInteger(n) || n < min || n > max) throw new ConfigError(`${name}=${JSON.stringify(raw)} must be a whole number from ${min} to ${max}`);
  return n;
}

/** `LEASEHOLD_TRUST_PROXY`: whose `X-Forwarded-For` names the caller (server/lib/proxy-trust.ts). */
function proxyTrust(raw: string | undefined): ProxyTrust | undefined {
  try {
    return ProxyTrust.parse(raw, 'LEASEHOLD_TRUST_PROXY');
  } catch (err) {
    throw new ConfigError((err as Error).message);
  }
}

/** `LEASEHOLD_WEBHOOK_DENY`: where webhook sends may not connect (server/lib/egress.ts). */
function egressPolicy(raw: string | undefined): EgressPolicy {
  try {
    return EgressPolicy.parse(raw, 'LEASEHOLD_WEBHOOK_DENY');
  } catch (err) {
    throw new ConfigError((err as Error).message);
  }
}

function fraction(name: string, raw: string | undefined, fallback: number): number {
  if (raw === undefined || raw.trim() === '') return fallback;
  const n = Number(raw);
  if (!Number.isFinite(n) || n <= 0 || n > 1) throw new ConfigError(`${name}=${JSON.stringify(raw)} must be a number above 0 and at most 1, e.g. 0.1`);
  return n;
}

function flag(name: string, raw: string | undefined): boolean {
  const v = raw?.trim().toLowerCase() ?? '';
  if (['', '0', 'false', 'no', 'off'].includes(v)) return false;
  if (['1', 'true', 'yes', 'on'].includes(v)) return true;
  throw new ConfigError(`${name}=${JSON.stringify(raw)} must be 1 or 0 (true or false)`);
}

/**
 * Whether `host:port` listens on loopback only: 127.0.0.0/8, `localhost`, `[::1]`. Anything else
 * (`0.0.0.0`, `[::]`, a LAN address, a host name) may be reached from a network.
 */
export function isLoopback(hostPort: string): boolean {
  const host = hostPort.slice(0, hostPort.lastIndexOf(':')).toLowerCase();
  return host === 'localhost' || host === '[::1]' || /^127\.\d{1,3}\.\d{1,3}\.\d{1,3}$/.test(host);
}

/** Builds the configuration from flags and environment; throws `ConfigError` naming the bad setting. */
export function loadConfig(flags: ConfigFlags = {}, env: NodeJS.ProcessEnv = process.env): Config {
  const grpcAddr = flags.grpcAddr ?? env.LEASEHOLD_GRPC_ADDR ?? '127.0.0.1:50051';
  const httpAddr = flags.httpAddr ?? env.LEASEHOLD_HTTP_ADDR ?? '127.0.0.1:8080';
  for (const [name, value] of [
    ['grpc address (--grpc-addr, LEASEHOLD_GRPC_ADDR)', grpcAddr],
    ['http address (--http-addr, LEASEHOLD_HTTP_ADDR)', httpAddr],
  ] as const) {
    const r = addr.safeParse(value);
    if (!r.success) throw new ConfigError(`${name} ${JSON.stringify(value)} ${r.error.issues[0]?.message}`);
  }
  const databaseUrl = env.DATABASE_URL || undefined;
  if (databaseUrl && !/^postgres(ql)?:\/\//.test(databaseUrl)) {
    throw new ConfigError('DATABASE_URL must start with postgres:// or postgresql://');
  }
  const cfg: Config = {
    databaseUrl,
    dataDir: path.resolve(flags.dataDir ?? env.LEASEHOLD_DATA_DIR ?? '.leasehold'),
    dbPoolMax: count('LEASEHOLD_DB_POOL_MAX', env.LEASEHOLD_DB_POOL_MAX, POOL_MAX, 2, 1_000),
    dbHotPoolMax: count('LEASEHOLD_DB_HOT_POOL_MAX', env.LEASEHOLD_DB_HOT_POOL_MAX, HOT_POOL_MAX, 1, 1_000),
    grpcAddr,
    httpAddr,
    adminKey: env.LEASEHOLD_ADMIN_KEY || undefined,
    // A claim and a start take a TTL of at most a day (schemas.ttlMs): one above would be
    // accepted here and then refuse every claim and start.
    leaseTtlMs: duration('LEASEHOLD_LEASE_TTL', env.LEASEHOLD_LEASE_TTL, 30_000, 100, limits.ttlMs, TTL_LIMIT),
    claimTtlMs: duration('LEASEHOLD_CLAIM_TTL', env.LEASEHOLD_CLAIM_TTL, 30_000, 100, limits.ttlMs, TTL_LIMIT),
    heartbeatIntervalMs: duration('LEASEHOLD_HEARTBEAT_INTERVAL', env.LEASEHOLD_HEARTBEAT_INTERVAL, 10_000, 50),
    completionLingerMs: 0, // set below, from the lease it must fit in
    reaperIntervalMs: duration('LEASEHOLD_REAPER_INTERVAL', env.LEASEHOLD_REAPER_INTERVAL, 1_000, 10, MAX_SCHEDULE_INTERVAL_MS, SCHEDULE_LIMIT),
    // Not a timer: the purge reckons it back from PostgreSQL's clock.
    retentionMs: ['off', '0'].includes(env.LEASEHOLD_RETENTION?.trim() ?? '')
      ? undefined
      : // As long as PurgeJobs' older_than may be: the purger's cutoff is checked as one.
        duration('LEASEHOLD_RETENTION', env.LEASEHOLD_RETENTION, DEFAULT_RETENTION_MS, 60_000, limits.purgeOlderThanMs, 'a purge reaches back at most 1000 years'),
    purgeIntervalMs: duration('LEASEHOLD_PURGE_INTERVAL', env.LEASEHOLD_PURGE_INTERVAL, 600_000, 10, MAX_SCHEDULE_INTERVAL_MS, SCHEDULE_LIMIT),
    purgeSweepShare: fraction('LEASEHOLD_PURGE_SWEEP_SHARE', env.LEASEHOLD_PURGE_SWEEP_SHARE, DEFAULT_SWEEP_SHARE),
    vacuumDeadRows:
      env.LEASEHOLD_VACUUM_DEAD_ROWS?.trim().toLowerCase() === 'off'
        ? undefined
        : count('LEASEHOLD_VACUUM_DEAD_ROWS', env.LEASEHOLD_VACUUM_DEAD_ROWS?.trim(), DEFAULT_VACUUM_DEAD_ROWS, 0, 1_000_000_000) || undefined,
    authCacheTtlMs: duration(
      'LEASEHOLD_AUTH_CACHE_TTL',
      env.LEASEHOLD_AUTH_CACHE_TTL,
      60_000,
      0,
      3_600_000,
      'it bounds how long a revoked key may work if a notification is lost',
    ),
    webhook: {
      intervalMs: duration('LEASEHOLD_WEBHOOK_INTERVAL', env.LEASEHOLD_WEBHOOK_INTERVAL, 500, 10, MAX_SCHEDULE_INTERVAL_MS, SCHEDULE_LIMIT),
      // The deliverer's own bound (webhook-deliverer.ts), which would otherwise stop the start with a stack trace.
      timeoutMs: duration('LEASEHOLD_WEBHOOK_TIMEOUT', env.LEASEHOLD_WEBHOOK_TIMEOUT, 10_000, 100, 600_000, 'the webhook deliverer waits at most that long for an answer'),
      maxAttempts: count('LEASEHOLD_WEBHOOK_MAX_ATTEMPTS', env.LEASEHOLD_WEBHOOK_MAX_ATTEMPTS, 12, 1, 100),
      // Not a timer: the retry's due time is written in SQL (and no delay exceeds an hour).
      backoffMs: duration('LEASEHOLD_WEBHOOK_BACKOFF', env.LEASEHOLD_WEBHOOK_BACKOFF, 5_000, 0, Number.MAX_SAFE_INTEGER, EXACT_LIMIT),
      egress: egressPolicy(env.LEASEHOLD_WEBHOOK_DENY),
    },
    alertUrl: env.LEASEHOLD_ALERT_URL || undefined,
    helloTimeoutMs: duration('LEASEHOLD_HELLO_TIMEOUT', env.LEASEHOLD_HELLO_TIMEOUT, 10_000, 100),
    helloPendingMax: count('LEASEHOLD_HELLO_PENDING_MAX', env.LEASEHOLD_HELLO_PENDING_MAX, 256, 1, 100_000),
    agentKeepaliveMs:
      env.LEASEHOLD_AGENT_KEEPALIVE?.trim().toLowerCase() === 'off'
        ? undefined
        : duration('LEASEHOLD_AGENT_KEEPALIVE', env.LEASEHOLD_AGENT_KEEPALIVE, 20_000, 100),
    tls: undefined,
    insecure: flags.insecure === true || flag('LEASEHOLD_INSECURE', env.LEASEHOLD_INSECURE),
    trustProxy: proxyTrust(env.LEASEHOLD_TRUST_PROXY),
    allowNewerSchema: flag('LEASEHOLD_ALLOW_NEWER_SCHEMA', env.LEASEHOLD_ALLOW_NEWER_SCHEMA),
  };
  if (cfg.alertUrl && !/^https?:\/\/[^\s/]+/.test(cfg.alertUrl)) {
    throw new ConfigError(`LEASEHOLD_ALERT_URL=${JSON.stringify(cfg.alertUrl)} must be an http:// or https:// URL`);
  }
  const alertRefused = cfg.alertUrl && cfg.webhook.egress.refusal(cfg.alertUrl);
  if (alertRefused) throw new ConfigError(`LEASEHOLD_ALERT_URL=${JSON.stringify(cfg.alertUrl)}: ${alertRefused.message}`);
  const cert = env.LEASEHOLD_TLS_CERT || undefined;
  const key = env.LEASEHOLD_TLS_KEY || undefined;
  if (Boolean(cert) !== Boolean(key)) throw new ConfigError('set both LEASEHOLD_TLS_CERT and LEASEHOLD_TLS_KEY (PEM files), or neither');
  if (cert && key) {
    for (const [name, file] of [['LEASEHOLD_TLS_CERT', cert], ['LEASEHOLD_TLS_KEY', key]] as const) {
      if (!existsSync(file)) throw new ConfigError(`${name}=${file}: no such file`);
    }
    cfg.tls = { certFile: cert, keyFile: key };
  }
  const clientCa = env.LEASEHOLD_TLS_CLIENT_CA || undefined;
  if (clientCa) {
    if (!cfg.tls) throw new ConfigError(`LEASEHOLD_TLS_CLIENT_CA=${clientCa} needs TLS: set LEASEHOLD_TLS_CERT and LEASEHOLD_TLS_KEY (PEM files) too`);
    // Read here, as the listener will: a file it could not use would stop the start later, with a stack trace.
    let pem: string;
    try {
      pem = readFileSync(clientCa, 'utf8');
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      const why = code === 'ENOENT' ? 'no such file' : code === 'EACCES' ? 'cannot be read (permission denied)' : code === 'EISDIR' ? 'is a directory' : (err as Error).message;
      throw new ConfigError(`LEASEHOLD_TLS_CLIENT_CA=${clientCa}: ${why}`);
    }
    const certs = pem.match(/-----BEGIN CERTIFICATE-----[\s\S]+?-----END CERTIFICATE-----/g) ?? [];
    if (!certs.length) throw new ConfigError(`LEASEHOLD_TLS_CLIENT_CA=${clientCa}: no PEM certificate in it (-----BEGIN CERTIFICATE-----): it must hold the CA certificate(s) that sign the agents' certificates`);
    for (const [i, c] of certs.entries()) {
      try {
        new X509Certificate(c);
      } catch (err) {
        throw new ConfigError(`LEASEHOLD_TLS_CLIENT_CA=${clientCa}: certificate ${i + 1} does not parse (${(err as Error).message})`);
      }
    }
    cfg.tls.clientCaFile = clientCa;
  }
  // API keys and agent tokens travel in every request: in cleartext only where no network can
  // read them (loopback), behind a TLS-terminating proxy, or when the operator says so.
  if (!cfg.tls && !cfg.insecure && !cfg.trustProxy) {
    for (const [what, value, flagName, envName] of [
      ['gRPC', grpcAddr, '--grpc-addr', 'LEASEHOLD_GRPC_ADDR'],
      ['HTTP', httpAddr, '--http-addr', 'LEASEHOLD_HTTP_ADDR'],
    ] as const) {
      if (isLoopback(value)) continue;
      throw new ConfigError(
        `refusing to listen for ${what} on ${value} (${flagName}, ${envName}) without TLS: keys and tokens would cross the network in cleartext. ` +
          'Set LEASEHOLD_TLS_CERT and LEASEHOLD_TLS_KEY; or, with a TLS-terminating proxy in front, LEASEHOLD_TRUST_PROXY=1 (or the addresses of the proxies, for more than one hop); ' +
          'or accept cleartext with --insecure (LEASEHOLD_INSECURE=1).',
      );
    }
  }
  if (cfg.heartbeatIntervalMs >= cfg.leaseTtlMs) {
    throw new ConfigError(
      `LEASEHOLD_HEARTBEAT_INTERVAL (${cfg.heartbeatIntervalMs} ms) must be shorter than LEASEHOLD_LEASE_TTL (${cfg.leaseTtlMs} ms)`,
    );
  }
  // A lingering completion is no longer renewed by heartbeats: it must be written well inside
  // what is left of its lease (or claim) after the last renewal, a heartbeat interval ago at most.
  const held = Math.min(cfg.leaseTtlMs, cfg.claimTtlMs);
  const maxLinger = Math.min(1_000, Math.max(0, Math.floor((held - cfg.heartbeatIntervalMs) / 10)));
  const linger = env.LEASEHOLD_COMPLETION_LINGER?.trim();
  if (linger) {
    cfg.completionLingerMs = duration('LEASEHOLD_COMPLETION_LINGER', linger, DEFAULT_COMPLETION_LINGER_MS, 0);
    if (cfg.completionLingerMs > maxLinger) {
      throw new ConfigError(
        `LEASEHOLD_COMPLETION_LINGER=${linger} is above the maximum of ${maxLinger} ms: at most 1s, and at most a tenth of ` +
          `what a lease or claim (${held} ms) leaves after a heartbeat interval (${cfg.heartbeatIntervalMs} ms)`,
      );
    }
  } else {
    cfg.completionLingerMs = Math.min(DEFAULT_COMPLETION_LINGER_MS, maxLinger);
  }
  return cfg;
}
