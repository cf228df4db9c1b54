/**
 * The benchmark closes graphile-worker's system and then stops its database. A connection still
 * open then gets PostgreSQL's 57P01 ("terminating connection due to administrator command"); on a
 * pool with no 'error' listener Node throws it, and the benchmark ended with that error after
 * writing its results (test/bench/systems.ts says how graphile-worker's own pool came to it).
 */
import pg from 'pg';
import { afterAll, beforeAll, expect, inject, it } from 'vitest';
import { graphile } from './bench/systems.js';
import { waitFor } from './helpers/coordinator.js';

const name = `${inject('pgPrefix')}bench_close`;
const admin = new pg.Client({ connectionString: inject('pgAdminUrl') });
const thrown: Error[] = [];
const keep = (err: Error) => thrown.push(err);

beforeAll(async () => {
  await admin.connect();
  process.on('uncaughtException', keep);
});

afterAll(async () => {
  process.off('uncaughtException', keep);
  await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
  await admin.end();
});

it("graphile-worker's system, closed, leaves no connection that a stopping database can end with a throw", async () => {
  for (let round = 0; round < 5; round++) {
    const s = await graphile(inject('pgAdminUrl'), true, name);
    await Promise.all(Array.from({ length: 10 }, (_, k) => s.enqueueOne({ k })));
    await s.close();
    // What a stopping database does to every connection it still has, right after the close.
    await admin.query(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1`, [name]);
    // Each backend writes its 57P01 and then exits: once none is left, every one is in its
    // socket, and the poll after this turn reads them all (the wait itself takes several).
    await waitFor('the terminated connections gone', async () => {
      const { rows } = await admin.query(`SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = $1`, [name]);
      return rows[0].n === 0;
    });
    await new Promise((r) => setTimeout(r, 0));
  }
  expect(thrown.map((e) => e.message)).toEqual([]);
});
