/**
 * A named statement is described once per connection (server/store/shaped-query.ts): later
 * executions send no Describe and read their rows as the first one described them, with the same
 * values; a changed row shape is refused by PostgreSQL, never read with the old one; an error
 * makes the next execution describe again.
 */
import pg from 'pg';
import { afterEach, beforeEach, expect, it } from 'vitest';
import { jobEnqueue, jobGet } from '../server/store/index.js';
import { queryShaped } from '../server/store/shaped-query.js';
import { run, statement } from '../server/store/sql.js';
import { interceptPool } from './helpers/core.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();

let client: pg.PoolClient;
/** The statement of every Describe this test's client sends ('' for an unnamed one). */
let described: string[];

/** Records in `into` the statement each Describe of `c` is for. */
function spyDescribes(c: pg.PoolClient, into: string[]): void {
  const con = (c as unknown as { connection: { bind(m: { statement?: string }): void; describe(m: object): void } }).connection;
  const bind = con.bind.bind(con);
  const describe = con.describe.bind(con);
  let bound = '';
  con.bind = (m) => {
    bound = m.statement ?? '';
    bind(m);
  };
  con.describe = (m) => {
    into.push(bound);
    describe(m);
  };
}

beforeEach(async () => {
  client = await t.pool.connect();
  described = [];
  spyDescribes(client, described);
});
afterEach(() => client.release(true));

const echo = statement(
  'testShapedEcho',
  `SELECT $1::int AS n, $2::text AS s, $3::jsonb AS j, $4::timestamptz AS at, $5::bigint AS big, NULL::uuid AS none,
          ARRAY[$1::int, 2] AS arr, $6::boolean AS yes`,
);

it('describes a statement on its first execution only, and reads the same values after', async () => {
  const at = new Date('2026-12-05T01:02:03.456Z');
  const rows = [];
  for (let i = 0; i < 3; i++) rows.push(await run(client, echo, [i, `s${i}`, JSON.stringify({ i, deep: [i] }), at, 2 ** 40 + i, i % 2 === 0]));
  expect(described).toEqual(['testShapedEcho']);
  expect(rows).toEqual([0, 1, 2].map((i) => [{ n: i, s: `s${i}`, j: { i, deep: [i] }, at, big: 2 ** 40 + i, none: null, arr: [i, 2], yes: i % 2 === 0 }]));
  // Each row is an object of its own: rows of one execution are not the next one's.
  expect(rows[0]![0]).not.toBe(rows[1]![0]);
});

it('of two columns of one name the last one stands, as in node-postgres', async () => {
  const twice = statement('testShapedTwice', 'SELECT $1::int AS a, NULL::int AS a, $1::int AS b, $1::int + 1 AS b');
  for (let i = 0; i < 2; i++) {
    expect(await run(client, twice, [7])).toEqual([{ a: null, b: 8 }]);
    expect(await run(client, twice, [7])).toEqual((await client.query('SELECT $1::int AS a, NULL::int AS a, $1::int AS b, $1::int + 1 AS b', [7])).rows);
  }
  expect(described.filter((d) => d === 'testShapedTwice')).toEqual(['testShapedTwice']);
});

it("a store verb's rows read without the Describe are the rows read with it", async () => {
  for (let i = 0; i < 6; i++) {
    // With the NOTIFY, then without it (notify: false, as the gateway enqueues: jobEnqueuePlainQuiet).
    const made = await jobEnqueue(client, { queue: 'shaped', payload: { a: i }, labels: { os: 'windows' }, maxAttempts: 3, runAt: new Date(Date.now() + 60_000), notify: i < 3 });
    if (made.outcome !== 'ok') throw new Error(JSON.stringify(made));
    const read = await jobGet(client, { jobId: made.value.id });
    if (read.outcome !== 'ok') throw new Error(JSON.stringify(read));
    expect(made.value).toEqual(read.value.job);
    // An unnamed statement is described on every execution.
    await client.query('SELECT $1::int AS n', [i]);
  }
  // Each enqueue statement (without a key or a header: jobEnqueuePlain, and its twin without the
  // NOTIFY) was described once, the first time, and so was GetJob's read (a named statement,
  // planned once a connection: docs/performance.md, "Statements planned on every
  // call"); the unnamed query every time.
  expect(described.filter((d) => d.startsWith('jobEnqueue'))).toEqual(['jobEnqueuePlain', 'jobEnqueuePlainQuiet']);
  expect(described.filter((d) => d.startsWith('jobGet'))).toEqual(['jobGetDetail']);
  expect(described.filter((d) => d === '')).toHaveLength(6);
});

it('a row shape changed under the statement is refused by PostgreSQL, and the next execution describes it anew', async () => {
  await client.query('CREATE TEMP TABLE shaped_t (a int)');
  await client.query('INSERT INTO shaped_t VALUES (1)');
  const all = statement('testShapedAll', 'SELECT * FROM shaped_t');
  expect(await run(client, all, [])).toEqual([{ a: 1 }]);
  expect(await run(client, all, [])).toEqual([{ a: 1 }]);
  expect(described).toEqual(['testShapedAll']);

  await client.query("ALTER TABLE shaped_t ADD COLUMN b text DEFAULT 'x'");
  await expect(run(client, all, [])).rejects.toThrow(/cached plan must not change result type/);
  // The statement stays prepared with its old shape in PostgreSQL; a new statement of the same
  // text reads the new one.
  await client.query('DEALLOCATE "testShapedAll"');
  delete (client as unknown as { connection: { parsedStatements: Record<string, string> } }).connection.parsedStatements.testShapedAll;
  expect(await run(client, all, [])).toEqual([{ a: 1, b: 'x' }]);
  expect(described).toEqual(['testShapedAll', 'testShapedAll']);
});

it('after an error the statement is described again, and its rows read right', async () => {
  const div = statement('testShapedDivide', 'SELECT 10 / $1::int AS q, $1::int AS d');
  expect(await run(client, div, [2])).toEqual([{ q: 5, d: 2 }]);
  expect(await run(client, div, [5])).toEqual([{ q: 2, d: 5 }]);
  await expect(run(client, div, [0])).rejects.toThrow(/division by zero/);
  expect(await run(client, div, [1])).toEqual([{ q: 10, d: 1 }]);
  expect(await run(client, div, [10])).toEqual([{ q: 1, d: 10 }]);
  // The first execution, and the one right after the error; the failed one went without.
  expect(described).toEqual(['testShapedDivide', 'testShapedDivide']);
});

it('a value that cannot be sent fails its call and leaves the connection working', async () => {
  const cyc: Record<string, unknown> = {};
  cyc.self = cyc;
  const one = statement('testShapedJson', 'SELECT $1::jsonb AS j');
  // On its first execution (its Parse goes out, and stands) and on a later one.
  await expect(run(client, one, [cyc])).rejects.toThrow(/circular/i);
  expect(await run(client, one, ['{"a":1}'])).toEqual([{ j: { a: 1 } }]);
  await expect(run(client, one, [cyc])).rejects.toThrow(/circular/i);
  expect(await run(client, one, ['{"b":2}'])).toEqual([{ j: { b: 2 } }]);
  // Described by the first call that was sent, and again after the error.
  expect(described).toEqual(['testShapedJson', 'testShapedJson']);
});

it('one name used for two statements on a connection fails the second, as node-postgres does, and the connection goes on', async () => {
  expect(await queryShaped(client, 'testShapedOneName', 'SELECT 1 AS a', [])).toEqual([{ a: 1 }]);
  await expect(queryShaped(client, 'testShapedOneName', 'SELECT 2 AS b', [])).rejects.toThrow(/Prepared statements must be unique - 'testShapedOneName'/);
  expect(await queryShaped(client, 'testShapedOneName', 'SELECT 1 AS a', [])).toEqual([{ a: 1 }]);
  expect(await run(client, echo, [7, 's', '{}', new Date(0), 1, true])).toHaveLength(1);
});

it('many rows, no rows, and a statement without a result read as before', async () => {
  await client.query('CREATE TEMP TABLE shaped_many (i int, t timestamptz)');
  const add = statement('testShapedAdd', 'INSERT INTO shaped_many SELECT g, $2::timestamptz FROM generate_series(1, $1::int) g');
  const some = statement('testShapedSome', 'SELECT i, t FROM shaped_many WHERE i <= $1::int ORDER BY i');
  const at = new Date('2026-01-02T03:04:05Z');
  expect(await run(client, add, [300, at])).toEqual([]);
  expect(await run(client, add, [2, at])).toEqual([]);
  expect(await run(client, some, [0])).toEqual([]);
  // Described by the first execution, which had no rows; read with that description since.
  const rows = await run<{ i: number; t: Date }>(client, some, [300]);
  expect(rows.map((r) => r.i)).toEqual([1, 1, 2, 2, ...Array.from({ length: 298 }, (_, k) => k + 3)]);
  expect(rows.every((r) => r.t.getTime() === at.getTime())).toBe(true);
  expect(await run(client, some, [1])).toEqual([{ i: 1, t: at }, { i: 1, t: at }]);
  // An INSERT without RETURNING has no row description: it is described each time.
  expect(described).toEqual(['testShapedAdd', 'testShapedAdd', 'testShapedSome']);
});

it("a call's result carries PostgreSQL's command and row count, as node-postgres' does", async () => {
  await client.query('CREATE TABLE shaped_counted (i int)');
  const seen: Array<{ command: string | null; rowCount: number | null }> = [];
  const pool = interceptPool(t.pool, async (_q, go) => {
    const res = await go();
    seen.push({ command: res.command, rowCount: res.rowCount });
    return res;
  });
  const add = statement('testShapedCounted', 'INSERT INTO shaped_counted SELECT generate_series(1, $1::int) RETURNING i');
  const upd = statement('testShapedCountedUp', 'UPDATE shaped_counted SET i = i + 1 WHERE i <= $1::int');
  for (let k = 0; k < 2; k++) {
    expect((await run(pool, add, [3])).length).toBe(3);
    expect(await run(pool, upd, [2])).toEqual([]);
  }
  expect(seen).toEqual([
    { command: 'INSERT', rowCount: 3 },
    { command: 'UPDATE', rowCount: 2 }, // 1 and 2 of 1, 2, 3
    { command: 'INSERT', rowCount: 3 },
    { command: 'UPDATE', rowCount: 3 }, // 1, 2 and 2 of 2, 3, 3, 1, 2, 3
  ]);
  await client.query('DROP TABLE shaped_counted');
});

it('each connection of a pool describes a statement once', async () => {
  const pool = t.newPool(2);
  const a = await pool.connect();
  const b = await pool.connect();
  const seen: string[] = [];
  const seenA: string[] = [];
  spyDescribes(a, seenA);
  spyDescribes(b, seen);
  a.release();
  b.release();
  const ids = statement('testShapedPid', 'SELECT pg_backend_pid() AS pid, $1::int AS i');
  // Two at once take both connections; then the same again.
  for (let round = 0; round < 3; round++) {
    const got = await Promise.all([run(pool, ids, [round]), run(pool, ids, [round])]);
    expect(got.map((r) => r[0]!.i)).toEqual([round, round]);
    expect(new Set(got.map((r) => r[0]!.pid)).size).toBe(2);
  }
  expect([...seenA, ...seen]).toEqual(['testShapedPid', 'testShapedPid']);
  expect(seenA).toEqual(['testShapedPid']);
});
