/**
 * New job ids, made by the coordinator: a UUIDv7 (RFC 9562) as `job_id_v7()` makes them in SQL
 * (migration 0011): 48 bits of milliseconds since the epoch, the version (7), 12 random bits, the
 * variant (10) and 62 random bits, from the CSPRNG. Time-ordered, so that a new job's id lands at
 * the right edge of the primary key and of every index that carries a job id. Made here rather
 * than in the enqueue's statement: `job_id_v7()` cost PostgreSQL 13 µs an enqueue (its numeric
 * epoch, its byte operations and its hex round trip; six paired rounds of a lab loop,
 * docs/performance.md), this a fraction of a microsecond. The time is this process's clock,
 * `created_at` PostgreSQL's: on machines whose clocks agree the two name the same millisecond,
 * and where they do not, ids are still unique and nearly in order, which is all the indexes need.
 */
import { randomFillSync } from 'node:crypto';

/** Random bytes for job ids, drawn from the CSPRNG 512 ids at a time (10 bytes an id). */
const entropy = Buffer.alloc(10 * 512);
let drawn = entropy.length;

/** A UUIDv7 for a new job, its time `ms` (default now). */
export function newJobId(ms: number = Date.now()): string {
  if (drawn === entropy.length) {
    randomFillSync(entropy);
    drawn = 0;
  }
  const r = drawn;
  drawn += 10;
  const t = ms.toString(16).padStart(12, '0');
  // 12 random bits after the version, 62 after the variant.
  const a = (0x7000 | (entropy.readUInt16BE(r) & 0x0fff)).toString(16);
  const b = (0x8000 | (entropy.readUInt16BE(r + 2) & 0x3fff)).toString(16);
  const c = entropy.toString('hex', r + 4, r + 10);
  return `${t.slice(0, 8)}-${t.slice(8, 12)}-${a}-${b}-${c}`;
}
