/**
 * The days made ahead (server/store/days.ts, `daysEnsure`) are UTC days counted as dates, whatever
 * the session's time zone: a PostgreSQL set up in America/Sao_Paulo (its TimeZone from the
 * operating system at initdb; the coordinator does not set one) skipped a day where daylight
 * saving began at local midnight, as on 2018-11-04, when the days were a series of timestamps;
 * and the purge's cutoff day, a date given to to_char, was read as local midnight (Samoa skipped
 * 2011-12-30: a cutoff on that day dropped it too).
 */
import pg from 'pg';
import { afterAll, expect, it } from 'vitest';
import { DAYS_AHEAD, daysDrop, daysEnsure } from '../server/store/days.js';
import { useTestDb } from './helpers/db.js';
import { quietPool } from './helpers/quiet-pool.js';

const t = useTestDb();
const pools: pg.Pool[] = [];
afterAll(async () => {
  for (const p of pools) await p.end();
});

it.each(['America/Sao_Paulo', 'Pacific/Apia', 'UTC'])('makes today and the next two days in a session of %s', async (zone) => {
  const pool = quietPool({ connectionString: t.url, max: 1, options: `-c TimeZone=${zone}` });
  pools.push(pool);
  // 2018-11-03 12:00 UTC: Sao Paulo's clocks went from 00:00 to 01:00 on 2018-11-04.
  // 2011-12-29 12:00 UTC: Samoa skipped 2011-12-30 (local) altogether.
  const at = zone === 'Pacific/Apia' ? new Date('2011-12-29T12:00:00Z') : new Date('2018-11-03T12:00:00Z');
  const first = at.toISOString().slice(0, 10);
  const want = Array.from({ length: DAYS_AHEAD + 1 }, (_, i) => new Date(Date.parse(first) + i * 86_400_000).toISOString().slice(0, 10));
  const made = await daysEnsure(pool, undefined, at);
  // A zone after another in this file finds the days it shares already made: what it made and
  // what was there together are every day wanted.
  const have = (await pool.query<{ day: string }>(`SELECT substring(relname from 11) AS day FROM pg_class WHERE relname LIKE 'jobs_done_%' AND relkind = 'r'`)).rows.map((r) => r.day);
  for (const d of want) expect(have, `${d} in ${zone}`).toContain(d.replaceAll('-', ''));
  expect(made.every((d) => want.includes(d))).toBe(true);
});

it("cuts the days it drops at the UTC day of the cutoff, also where that day's local midnight never was", async () => {
  const pool = quietPool({ connectionString: t.url, max: 2, options: '-c TimeZone=Pacific/Apia' });
  pools.push(pool);
  await daysEnsure(pool, ['2011-12-28', '2011-12-29', '2011-12-30']);
  // The cutoff falls on 2011-12-30 (UTC): the days that ended before it go, that day stays.
  const run = await daysDrop(pool, { olderThanMs: 0, now: new Date('2011-12-30T12:00:00Z') });
  expect(run.days.filter((d) => d.startsWith('2011-'))).toEqual(['2011-12-28', '2011-12-29']);
});
