/**
 * The ids the coordinator makes itself, time-ordered so that each lands at the right edge of the
 * indexes that carry it (not on a random page of them), their random bits from one pool the
 * CSPRNG refills 512 ids at a time (`randomFillSync`, as Node's `randomUUID` pools its own:
 * `randomBytes` per id cost 3.5 µs, a tenth of that from the pool).
 */
import { randomFillSync } from 'node:crypto';

/** Random bytes for ids, 10 an id. */
const entropy = Buffer.alloc(10 * 512);
let drawn = entropy.length;

/** The offset in `entropy` of 10 fresh random bytes. */
function draw(): number {
  if (drawn === entropy.length) {
    randomFillSync(entropy);
    drawn = 0;
  }
  const r = drawn;
  drawn += 10;
  return r;
}

/** Milliseconds since the epoch as the 12 hex digits that open a time-ordered id. */
const timeHex = (ms: number) => ms.toString(16).padStart(12, '0');

/**
 * A new job's id: a UUIDv7 (RFC 9562) as `job_id_v7()` makes them in SQL (migration 0011): 48
 * bits of milliseconds since the epoch, the version (7), 12 random bits, the variant (10) and 62
 * random bits. Made here rather than in the enqueue's statement: `job_id_v7()` cost PostgreSQL
 * 13 µs an enqueue (its numeric epoch, its byte operations and its hex round trip; six paired
 * rounds of a lab loop, docs/performance.md), this a fraction of a microsecond. The time is this
 * process's clock, `created_at` PostgreSQL's: on machines whose clocks agree the two name the same
 * millisecond, and where they do not, ids are still unique and nearly in order, which is all the
 * indexes need.
 */
export function newJobId(ms: number = Date.now()): string {
  const r = draw();
  const t = timeHex(ms);
  // 12 random bits after the version, 62 after the variant.
  const a = (0x7000 | (entropy.readUInt16BE(r) & 0x0fff)).toString(16);
  const b = (0x8000 | (entropy.readUInt16BE(r + 2) & 0x3fff)).toString(16);
  const c = entropy.toString('hex', r + 4, r + 10);
  return `${t.slice(0, 8)}-${t.slice(8, 12)}-${a}-${b}-${c}`;
}

/**
 * An attempt id as the claim statement makes them (claim.ts, claimSql), for the dispatcher's
 * hand-off: 48 bits of milliseconds since the epoch, then 80 random bits, written as a UUID (not a
 * versioned one; DESIGN.md's fencing token). Time-ordered for jobs_current_attempt_uq, and
 * jobs_final_attempt_uq in its day's partition.
 */
export function randomAttemptId(): string {
  const r = draw();
  const t = timeHex(Date.now());
  const h = entropy.toString('hex', r, r + 10);
  return `${t.slice(0, 8)}-${t.slice(8, 12)}-${h.slice(0, 4)}-${h.slice(4, 8)}-${h.slice(8)}`;
}
