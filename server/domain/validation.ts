/**
 * Input bounds and validation. Every value that reaches a store verb from outside passes here
 * first, so bad input becomes an `invalid` or `too_large` outcome naming the field, and never a
 * database error, a crash or a partial write.
 */
import { z } from 'zod';
import { invalid, type Failure } from './outcomes.js';

/** Size and range bounds. Exported so transports and docs quote the same numbers. */
export const limits = {
  payloadBytes: 256 * 1024,
  resultBytes: 256 * 1024,
  errorBytes: 16 * 1024,
  stepOutputBytes: 256 * 1024,
  progressBytes: 4 * 1024,
  /** Nesting depth of any JSON document (PostgreSQL's parser recurses on it). */
  jsonDepth: 64,
  queueLength: 128,
  idempotencyKeyLength: 255,
  agentIdLength: 128,
  stepNameLength: 200,
  maxAttempts: 1000,
  priority: 32767,
  executionTimeoutMs: 7 * 24 * 3600 * 1000,
  /** A lease or claim TTL: at most a day (`schemas.ttlMs`, and `LEASEHOLD_LEASE_TTL` / `LEASEHOLD_CLAIM_TTL`). */
  ttlMs: 86_400_000,
  claimBatch: 1000,
  heartbeatBatch: 10_000,
  queuesPerClaim: 100,
  /** notify_url and subscription URLs. */
  urlLength: 2048,
  /**
   * A purge's `olderThan`: 1000 years. Its cutoff, now minus it, must be a time PostgreSQL holds
   * and the answer's Timestamp can write (from 0001-01-01, `dateRange`); 10000 years gave a 500.
   * No job finished earlier, so a larger value would purge nothing more.
   */
  purgeOlderThanMs: 1000 * 365.25 * 86_400_000,
} as const;

/**
 * The longest delay `setTimeout` and `setInterval` keep: 2^31 − 1 ms (about 24.8 days). Node runs
 * a timer given more after 1 ms (a TimeoutOverflowWarning), so every duration that reaches a timer
 * (the `LEASEHOLD_*` intervals and timeouts, a service's interval plus its jitter) stays within it.
 */
export const MAX_TIMER_MS = 2_147_483_647;

/**
 * The times a `schemas.date` (a job's `runAt`, a list's bounds) may hold: those a Timestamp's JSON
 * form can write (RFC 3339, years 0001 to 9999). PostgreSQL takes more (4713 BC to 294276 AD): a
 * runAt outside was stored, and every JSON answer that carried the job then failed with 500 (the
 * enqueue's own, after its commit; GetJob, ListJobs; a ClaimJobs that had claimed it).
 */
export const dateRange = { min: new Date('0001-01-01T00:00:00Z'), max: new Date('9999-12-31T23:59:59.999Z') } as const;

/** Ids are 128-bit values written as UUIDs (any version: attempt ids are 128 random bits). */
export const idPattern = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
/** Queue names: letters, digits and `_ . : -`, starting with a letter or digit. */
export const queuePattern = /^[A-Za-z0-9][A-Za-z0-9_.:-]*$/;
/** Agent ids: the queue alphabet plus `@`. */
export const agentIdPattern = /^[A-Za-z0-9][A-Za-z0-9_.:@-]*$/;

const printable = (what: string) =>
  z
    .string()
    .refine((s) => s.isWellFormed(), `${what} must be well-formed Unicode`)
    .refine((s) => !/[\u0000-\u001f\u007f]/.test(s), `${what} must not contain control characters`);

export const schemas = {
  id: z.string().regex(idPattern, 'must be a UUID-shaped id (8-4-4-4-12 hex digits)'),
  queue: z
    .string()
    .min(1, 'must not be empty')
    .max(limits.queueLength, `must be at most ${limits.queueLength} characters`)
    .regex(queuePattern, 'must be letters, digits and _ . : - (starting with a letter or digit)'),
  agentId: z
    .string()
    .min(1, 'must not be empty')
    .max(limits.agentIdLength, `must be at most ${limits.agentIdLength} characters`)
    .regex(agentIdPattern, 'must be letters, digits and _ . : @ - (starting with a letter or digit)'),
  idempotencyKey: printable('the key')
    .min(1, 'must not be empty')
    .max(limits.idempotencyKeyLength, `must be at most ${limits.idempotencyKeyLength} characters`),
  stepName: printable('the step name')
    .min(1, 'must not be empty')
    .max(limits.stepNameLength, `must be at most ${limits.stepNameLength} characters`),
  priority: z
    .int('must be an integer')
    .min(-limits.priority, `must be at least ${-limits.priority}`)
    .max(limits.priority, `must be at most ${limits.priority}`),
  maxAttempts: z
    .int('must be an integer')
    .min(1, 'must be at least 1')
    .max(limits.maxAttempts, `must be at most ${limits.maxAttempts}`),
  executionTimeoutMs: z
    .int('must be an integer number of milliseconds')
    .min(1, 'must be positive')
    .max(limits.executionTimeoutMs, `must be at most ${limits.executionTimeoutMs} ms (7 days)`),
  /** A lease or claim TTL: from 100 ms to a day. */
  ttlMs: z.int('must be an integer number of milliseconds').min(100, 'must be at least 100 ms').max(limits.ttlMs, 'must be at most a day'),
  /**
   * Agent labels, and the labels a job requires of its agent: at most 32 `key: value` pairs of
   * printable text (jsonb refuses a NUL or a lone surrogate: the statement failed, a 500).
   */
  labels: z
    .record(
      printable('label names').min(1, 'label names must not be empty').max(64, 'label names must be at most 64 characters'),
      printable('label values').max(256, 'label values must be at most 256 characters'),
    )
    .refine((r) => Object.keys(r).length <= 32, 'must hold at most 32 labels'),
  /** A time from 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999Z (`dateRange`). */
  date: z
    .date()
    .refine((d) => Number.isFinite(d.getTime()), 'must be a valid time')
    .refine(
      (d) => d.getTime() >= dateRange.min.getTime() && d.getTime() <= dateRange.max.getTime(),
      'must be from 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999Z',
    ),
  /**
   * A header a job's notify_url deliveries carry: an HTTP token name (not one Leasehold or the
   * transport sets) and a value of visible ASCII characters and spaces.
   */
  notifyHeader: z.object({
    name: z
      .string()
      .min(1, 'must not be empty')
      .max(64, 'must be at most 64 characters')
      .regex(/^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/, 'must be an HTTP header name (letters, digits and !#$%&\'*+.^_`|~-)')
      .refine((n) => !RESERVED_HEADERS.has(n.toLowerCase()) && !n.toLowerCase().startsWith('leasehold-'), 'is a header Leasehold or HTTP itself sets: pick another name'),
    value: z
      .string()
      .min(1, 'must not be empty')
      .max(1024, 'must be at most 1024 characters')
      .regex(/^[\x20-\x7e]+$/, 'must be visible ASCII characters and spaces'),
  }),
  /** Where notifications go: an absolute http(s) URL of at most 2048 characters. */
  url: printable('the URL')
    .min(1, 'must not be empty')
    .max(limits.urlLength, `must be at most ${limits.urlLength} characters`)
    .refine((s) => isHttpUrl(s), 'must be an absolute http:// or https:// URL'),
} as const;

/**
 * Quick yes-answers for the shapes the hot verbs check on every call (an agent id, an attempt
 * id, a queue name), without zod. A false is then explained by `check` with the schema.
 */
export const valid = {
  id: (v: unknown): v is string => typeof v === 'string' && idPattern.test(v),
  queue: (v: unknown): v is string => typeof v === 'string' && v.length <= limits.queueLength && queuePattern.test(v),
  agentId: (v: unknown): v is string => typeof v === 'string' && v.length <= limits.agentIdLength && agentIdPattern.test(v),
} as const;

/** Headers a notify_url delivery's own header may not be: Leasehold sets them, or HTTP does. */
const RESERVED_HEADERS = new Set(['content-type', 'content-length', 'user-agent', 'host', 'connection', 'transfer-encoding', 'keep-alive', 'upgrade', 'te', 'trailer', 'expect', 'proxy-connection']);

function isHttpUrl(s: string): boolean {
  try {
    const u = new URL(s);
    return (u.protocol === 'http:' || u.protocol === 'https:') && u.hostname !== '';
  } catch {
    return false;
  }
}

/**
 * Validates `value` against `schema`; on failure returns an `invalid` outcome naming `field`
 * (and the path inside it), on success `undefined`.
 */
export function check(field: string, schema: z.ZodType, value: unknown): Failure | undefined {
  const r = schema.safeParse(value);
  if (r.success) return undefined;
  const issue = r.error.issues[0];
  const path = issue?.path.length ? `${field}.${issue.path.join('.')}` : field;
  // A record's bad key: zod's own message is "Invalid key in record"; the key's schema says why.
  const why = issue?.code === 'invalid_key' ? issue.issues[0]?.message : undefined;
  return invalid(path, why ?? issue?.message ?? 'is invalid');
}

/** Runs several `check`s in order and returns the first failure. */
export function checkAll(...checks: Array<Failure | undefined>): Failure | undefined {
  return checks.find((c) => c !== undefined);
}

export interface JsonOptions {
  maxBytes: number;
  /** Require a JSON object (not an array, string, number, boolean or null). */
  object?: boolean;
}

/**
 * Checks a JSON document a caller sent: serializable, no NUL characters or lone surrogates
 * (PostgreSQL's jsonb refuses both), at most `limits.jsonDepth` deep, at most `maxBytes` of
 * UTF-8, and an object when asked. Returns the serialized text to store, or the failure.
 */
export function checkJson(field: string, value: unknown, opts: JsonOptions): { json: string } | { failure: Failure } {
  if (opts.object && (value === null || typeof value !== 'object' || Array.isArray(value))) {
    return { failure: invalid(field, `must be a JSON object, got ${describe(value)}`) };
  }
  let json: string;
  try {
    json = JSON.stringify(value);
  } catch (err) {
    return { failure: invalid(field, `is not JSON: ${(err as Error).message}`) };
  }
  if (json === undefined) return { failure: invalid(field, 'is not a JSON value') };
  const bytes = Buffer.byteLength(json, 'utf8');
  if (bytes > opts.maxBytes) {
    return {
      failure: {
        outcome: 'too_large',
        field,
        message: `is ${bytes} bytes of JSON, over the limit of ${opts.maxBytes}`,
        limitBytes: opts.maxBytes,
      },
    };
  }
  const problem = inspect(value, field, 0);
  if (problem) return { failure: problem };
  return { json };
}

function describe(v: unknown): string {
  if (v === null) return 'null';
  if (Array.isArray(v)) return 'an array';
  return `a ${typeof v}`;
}

/** Walks a value once (after JSON.stringify has ruled out cycles), refusing what jsonb cannot hold. */
function inspect(v: unknown, path: string, depth: number): Failure | undefined {
  if (depth > limits.jsonDepth) return invalid(path, `nests deeper than ${limits.jsonDepth} levels`);
  switch (typeof v) {
    case 'string':
      return badString(v, path);
    case 'number':
      return Number.isFinite(v) ? undefined : invalid(path, 'must be a finite number');
    case 'boolean':
      return undefined;
    case 'object': {
      if (v === null) return undefined;
      if (Array.isArray(v)) {
        for (let i = 0; i < v.length; i++) {
          const p = inspect(v[i], `${path}.${i}`, depth + 1);
          if (p) return p;
        }
        return undefined;
      }
      const proto = Object.getPrototypeOf(v);
      if (proto !== Object.prototype && proto !== null) {
        return invalid(path, `must be plain JSON, got ${(v as object).constructor?.name ?? 'an object'}`);
      }
      for (const [k, x] of Object.entries(v)) {
        const bad = badString(k, `${path}.${k}`);
        if (bad) return bad;
        const p = inspect(x, `${path}.${k}`, depth + 1);
        if (p) return p;
      }
      return undefined;
    }
    default:
      return invalid(path, `cannot hold a ${typeof v}`);
  }
}

function badString(s: string, path: string): Failure | undefined {
  if (s.includes('\u0000')) return invalid(path, 'must not contain the NUL character');
  if (!s.isWellFormed()) return invalid(path, 'must be well-formed Unicode (no lone surrogates)');
  return undefined;
}
