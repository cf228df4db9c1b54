/**
 * Job ids are time-ordered (UUIDv7): new jobs land at the right edge of every index that carries
 * a job id, whatever the history kept (migration 0011, docs/decisions.md).
 */
import { expect, it } from 'vitest';
import { jobEnqueue, jobGet } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();
const V7 = /^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;
/** The milliseconds since the epoch in an id's first 48 bits. */
const msOf = (id: string) => parseInt(id.replace(/-/g, '').slice(0, 12), 16);

it('an enqueued job gets a version-7 id holding the time it was made, in enqueue order', async () => {
  const before = Date.now();
  const ids: string[] = [];
  for (let i = 0; i < 50; i++) {
    const o = await jobEnqueue(t.pool, { queue: 'ids', payload: { i } });
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
