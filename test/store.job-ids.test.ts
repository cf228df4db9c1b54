/**
 * Job ids are time-ordered (UUIDv7): new jobs land at the right edge of every index that carries
 * a job id, whatever the history kept (migration 0011, docs/decisions.md).
 */
import { expect, it } from 'vitest';
import { jobEnqueue, jobGet } from '../server/store/index.js';
import { newJobId } from '../server/store/ids.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();
const V7 = /^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;
/** The milliseconds since the epoch in an id's first 48 bits. */
const msOf = (id: string) => parseInt(id.replace(/-/g, '').slice(0, 12), 16);

it('an enqueued job gets a version-7 id holding the time it was made, in enqueue order', async () => {
  const before = Date.now();
  const ids: string[] = [];
  for (let i = 0; i < 50; i++) {
    // Each of the enqueue's statements (with or without the key's CTEs, with or without the NOTIFY).
    const o = await jobEnqueue(t.pool, { queue: 'ids', payload: { i }, notify: i % 2 === 0, ...(i % 3 === 0 ? { idempotencyKey: `ids-${i}` } : {}) });
    if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
    ids.push(o.value.id);
  }
  const after = Date.now();
  for (const id of ids) {
    expect(id).toMatch(V7);
    // The database's clock and this process's are the same machine's.
    expect(msOf(id)).toBeGreaterThanOrEqual(before - 1);
    expect(msOf(id)).toBeLessThanOrEqual(after + 1);
  }
  const times = ids.map(msOf);
  expect(times).toEqual([...times].sort((a, b) => a - b));
  // Found by id like any other.
  const got = await jobGet(t.pool, { jobId: ids[0]! });
  expect(got).toMatchObject({ outcome: 'ok', value: { job: { id: ids[0] } } });
});

it('job_id_v7(at) carries the time given and 74 random bits', async () => {
  const at = new Date('2026-03-04T05:06:07.089Z');
  const { rows } = await t.pool.query<{ id: string }>('SELECT job_id_v7($1) AS id FROM generate_series(1, 10000)', [at]);
  const ids = rows.map((r) => r.id);
  for (const id of ids) {
    expect(id).toMatch(V7);
    expect(msOf(id)).toBe(at.getTime());
  }
  expect(new Set(ids).size).toBe(ids.length);
});

/** Per bit of the 128, how many of `ids` have it set. */
function bitCounts(ids: string[]): number[] {
  const counts = Array<number>(128).fill(0);
  for (const id of ids) {
    const hex = id.replace(/-/g, '');
    for (let b = 0; b < 128; b++) if ((parseInt(hex[b >> 2]!, 16) >> (3 - (b & 3))) & 1) counts[b]!++;
  }
  return counts;
}

it('newJobId (the enqueue\'s ids) lays them out as job_id_v7 does: the time, the version, the variant, 74 random bits', async () => {
  const ms = Date.parse('2026-03-04T05:06:07.089Z');
  const mine = Array.from({ length: 10_000 }, () => newJobId(ms));
  const { rows } = await t.pool.query<{ id: string }>('SELECT job_id_v7($1) AS id FROM generate_series(1, 10000)', [new Date(ms)]);
  for (const id of mine) {
    expect(id).toMatch(V7);
    expect(msOf(id)).toBe(ms);
  }
  expect(new Set(mine).size).toBe(mine.length);
  // Bit by bit: the 48 of the time, the 4 of the version and the 2 of the variant the same as
  // PostgreSQL's ids; each of the other 74 set in about half of the ids, as in PostgreSQL's.
  const a = bitCounts(mine);
  const b = bitCounts(rows.map((r) => r.id));
  const fixed = new Set([...Array.from({ length: 48 }, (_, i) => i), 48, 49, 50, 51, 64, 65]);
  for (let bit = 0; bit < 128; bit++) {
    if (fixed.has(bit)) expect([bit, a[bit]]).toEqual([bit, b[bit]]);
    else {
      expect(a[bit]! / mine.length, `bit ${bit}`).toBeGreaterThan(0.45);
      expect(a[bit]! / mine.length, `bit ${bit}`).toBeLessThan(0.55);
    }
  }
  expect(fixed.size).toBe(54);
});
