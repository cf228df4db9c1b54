/**
 * The table of days (migration 0019, docs/decisions.md "Finished jobs in a table of days"): `jobs`
 * is partitioned by LIST on `done_day`. `jobs_live`, its partition for NULL, holds the live jobs
 * (and finished ones from before the move, or kept back by a drop: below). Every end (a success, a
 * failure for good, a dead letter, a cancel) moves its job's row, in the statement that ends it,
 * to the partition of the UTC day it finished on: `jobs_done_YYYYMMDD`; a requeue moves it back. This file makes those partitions
 * ahead of their day, and drops a day's partition whole once all of it is past the retention.
 *
 * Making one: a plain table shaped like `jobs` with a CHECK that proves its day, its indexes built
 * while it is empty, then `ATTACH PARTITION`, which takes only a SHARE UPDATE EXCLUSIVE lock on
 * `jobs` (writes go on) and, thanks to the CHECK, does not scan it. Dropping one: `DETACH
 * PARTITION … CONCURRENTLY` (readers and writers go on; there is no DEFAULT partition, which
 * would forbid it), then, with the table no longer part of `jobs`, its jobs' other rows deleted
 * (attempts, events, steps, …), the kept counts corrected, and `DROP TABLE`: half a second for a
 * day of 1.7 million jobs, where deleting them by rows took 35 s.
 *
 * Every step is safe to repeat: a run cut short (a crash, a lost connection) leaves a partition
 * attached, pending detach, or detached, and the next run finishes it.
 */
import pg from 'pg';
import { countChangeSql, endedCountSql, endedCutoff, endedKindSql } from './counts.js';
import { REFERENCE_TABLES, referencesDeleteSql } from './references.js';
import { JOB_COLUMNS, JOB_REFERENCES } from './schema.js';
import type { Queryable } from './sql.js';

/** The name of the partition of `day` (`YYYY-MM-DD`). */
export const dayTable = (day: string): string => `jobs_done_${day.replaceAll('-', '')}`;

/** Today's UTC day, as PostgreSQL sees it, and the days after it that are made ahead. */
export const DAYS_AHEAD = 2;

// Serialises the makers and droppers of all coordinators (an arbitrary constant).
const DAYS_LOCK = 7_140_356_019;

/**
 * The indexes of a day's partition: those of `jobs_live` that finished jobs use (the lists, a job
 * by id, a success's attempt by id and by agent, the purge by finish time), with the same columns
 * and predicates so that every plan over `jobs` reads each partition the same way. Not the live
 * ones (the claim's, the current attempt's, the idempotency key's: a key is held by `job_keys`).
 */
const DAY_INDEXES = [
  (t: string) => `CREATE UNIQUE INDEX "${t}_id_uq" ON "${t}" USING btree ("id")`,
  (t: string) => `CREATE INDEX "${t}_created_idx" ON "${t}" USING btree ("created_at" DESC NULLS LAST, "id" DESC NULLS LAST)`,
  (t: string) =>
    `CREATE INDEX "${t}_finished_queue_idx" ON "${t}" USING btree ("queue", "created_at" DESC NULLS LAST, "id" DESC NULLS LAST) WHERE "finished_at" IS NOT NULL`,
  (t: string) =>
    `CREATE INDEX "${t}_unsucceeded_idx" ON "${t}" USING btree ("created_at" DESC NULLS LAST, "id" DESC NULLS LAST) WHERE "finished_at" IS NOT NULL AND "result" IS NULL`,
  (t: string) => `CREATE INDEX "${t}_finished_idx" ON "${t}" USING btree ("finished_at") WHERE "finished_at" IS NOT NULL`,
  (t: string) => `CREATE UNIQUE INDEX "${t}_final_attempt_uq" ON "${t}" USING btree ("final_attempt_id") WHERE "final_attempt_id" IS NOT NULL`,
  (t: string) =>
    `CREATE INDEX "${t}_final_agent_idx" ON "${t}" USING btree ("final_agent_id", "created_at" DESC NULLS LAST, "id" DESC NULLS LAST) WHERE "final_attempt_id" IS NOT NULL`,
];

/** The partitions of `jobs` other than `jobs_live`, with their day and whether a detach is pending. */
async function dayPartitions(c: pg.PoolClient | pg.Client): Promise<Array<{ table: string; day: string; pending: boolean }>> {
  const { rows } = await c.query<{ table: string; bound: string; pending: boolean }>(
    `SELECT c.relname AS table, pg_get_expr(c.relpartbound, c.oid) AS bound, i.inhdetachpending AS pending
     FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
     WHERE i.inhparent = 'jobs'::regclass AND c.relname <> 'jobs_live'`,
  );
  return rows.map((r) => ({ table: r.table, day: /'(\d{4}-\d{2}-\d{2})'/.exec(r.bound)?.[1] ?? '', pending: r.pending })).filter((r) => r.day);
}

/**
 * Makes the partitions of today and the next `DAYS_AHEAD` days (UTC, PostgreSQL's clock, or `at`:
 * tests), or of `days` (`YYYY-MM-DD`: seed-history's past days), that do not exist yet; returns
 * the days it made. Coordinators call it at start and on the purger's
 * schedule; a completion that finds no partition for its day calls it and tries once more.
 */
export async function daysEnsure(db: pg.Pool | pg.PoolClient, days?: string[], at?: Date): Promise<string[]> {
  const c = 'release' in db ? db : await db.connect();
  try {
    // Dates plus integers, written out as timestamps without a zone: a series of timestamps with
    // one, or a date given to to_char (which takes it as local midnight), goes through the
    // session's time zone and skips a day where local midnight does not exist (daylight saving
    // beginning at midnight in America/Sao_Paulo; Samoa's 2011-12-30).
    const wanted =
      days ??
      (
        await c.query<{ day: string }>(
          `SELECT to_char(((coalesce($2::timestamptz, now()) AT TIME ZONE 'UTC')::date + i)::timestamp, 'YYYY-MM-DD') AS day
           FROM generate_series(0, $1::int) i`,
          [DAYS_AHEAD, at ?? null],
        )
      ).rows.map((r) => r.day);
    for (const d of wanted) if (!/^\d{4}-\d{2}-\d{2}$/.test(d)) throw new Error(`daysEnsure: not a day: ${d}`);
    const have = new Set((await dayPartitions(c)).map((p) => p.day));
    const missing = wanted.filter((d) => !have.has(d));
    if (!missing.length) return [];
    // A table of one of those days left detached by a drop cut short: its drop is finished first.
    const names = new Set(missing.map(dayTable));
    for (const table of await unattached(c, 'jobs_done_')) if (names.has(table)) await dropDetached(c, table);
    const made: string[] = [];
    await c.query('BEGIN');
    try {
      await c.query('SELECT pg_advisory_xact_lock($1)', [DAYS_LOCK]);
      const now = new Set((await dayPartitions(c)).map((p) => p.day));
      for (const day of missing) {
        if (now.has(day)) continue;
        const t = dayTable(day);
        // One round trip for the day (a first start far from its database makes three days).
        await c.query(
          [
            `CREATE TABLE "${t}" (LIKE jobs INCLUDING DEFAULTS INCLUDING CONSTRAINTS)`,
            `ALTER TABLE "${t}" ADD CONSTRAINT "${t}_day" CHECK (done_day IS NOT NULL AND done_day = DATE '${day}')`,
            ...DAY_INDEXES.map((ix) => ix(t)),
            // Waits at most this long for the readers of jobs that hold its lock in a conflicting
            // mode (none of the transitions' do): the next run tries again.
            `SET LOCAL lock_timeout = '5s'`,
            `ALTER TABLE jobs ATTACH PARTITION "${t}" FOR VALUES IN ('${day}')`,
          ].join(';\n'),
        );
        made.push(day);
      }
      await c.query('COMMIT');
    } catch (err) {
      await c.query('ROLLBACK').catch(() => undefined);
      throw err;
    }
    return made;
  } finally {
    if (c !== db) c.release();
  }
}

/** What `daysDrop` did. */
export interface DaysDropped {
  /** Days whose partition was dropped, oldest first. */
  days: string[];
  /** Jobs dropped with them. */
  jobs: number;
  /** Jobs of those days kept (moved back to `jobs_live`) because their notification is still to be delivered. */
  kept: number;
  /** Milliseconds until the days were gone from `jobs` and from the counts (the rest is the sweep). */
  goneMs: number;
  /** Jobs whose other rows the sweep deleted (of these days, and of days a run before left to sweep). */
  swept: number;
  /** Whether a sweep is left for the next run (`signal` aborted it). */
  unswept: boolean;
  /** Milliseconds spent vacuuming the tables the rows were deleted from (0 if none was). */
  vacuumMs: number;
}

/** How `daysDrop` runs. */
export interface DaysDropOptions {
  /**
   * Days that ended at or before `now` minus this are dropped (the retention). The cutoff is
   * reckoned by PostgreSQL's clock, as the row purge's (purge.ts) and every finish time are: a
   * coordinator whose clock is ahead would otherwise drop days of history still retained.
   * Negative reaches past now (tests: `-86_400_000` drops today).
   */
  olderThanMs: number;
  /** Pins the time the cutoff is reckoned from (tests); default PostgreSQL's `now()`. */
  now?: Date;
  /**
   * The share of its time the sweep spends working: after a batch that took t ms it waits
   * t × (1 − share) / share ms. Default 1 (no pause).
   */
  share?: number;
  /** Jobs per sweep batch; default 1000. */
  batch?: number;
  /** Stops the sweep between two batches (the coordinator stopping); the next run finishes it. */
  signal?: AbortSignal;
  /**
   * Awaited before each sweep batch: the sweep waits while it is pending, and that wait is not
   * counted as the sweep's work (the pause after a batch is reckoned from the batch alone). The
   * benchmark holds the sweep this way to time the hot path with it working and held, in turns.
   */
  hold?: () => Promise<void>;
}

/** Whether `SQLSTATE` says a row found no partition of `jobs` (its day's partition is missing). */
export const isNoPartition = (err: unknown): boolean => {
  const e = (err as { cause?: { code?: string; message?: string } }).cause ?? (err as { code?: string; message?: string });
  return e?.code === '23514' && /no partition of relation/.test(e.message ?? '');
};

/**
 * Runs a statement that moves jobs to their day's partition (an end: complete.ts, fail.ts,
 * rescue.ts, cancel.ts). When the day's partition is missing (the coordinator was stopped for days, or its
 * clock jumped), it is made and the statement tried once more; only on a pool, since inside a
 * caller's transaction the failed statement has aborted it.
 */
export async function withDays<T>(db: Queryable, statement: () => Promise<T>): Promise<T> {
  try {
    return await statement();
  } catch (err) {
    if (!isNoPartition(err) || !(db instanceof pg.Pool)) throw err;
    await daysEnsure(db);
    return statement();
  }
}

/**
 * Drops the partitions of the days that ended at or before the cutoff, `olderThanMs` before
 * PostgreSQL's `now()` (a success is so kept for the retention rounded up to the end of its UTC
 * day), and finishes any drop a run before it left
 * undone. The jobs of such a day whose notification is still to be delivered (or whose dead-letter
 * alert is not raised) go back to `jobs_live` first, for the row purge to take later, as it keeps
 * such jobs today.
 *
 * A day leaves in two steps. First, at once, its partition is detached (gone from every read),
 * the kept counts lose its jobs, and the table is renamed `jobs_gone_YYYYMMDD`: under a second
 * for a day of 1.7 million jobs. Then the sweep deletes its jobs' rows in the other tables
 * (attempts, events, steps, keys, …: references.ts), a batch at a time, pausing so that it works
 * `share` of its time, and drops the table. Those rows belong to no job any read can reach (a key
 * of a gone job is free: enqueue.ts, `keyFreeSql`), so the sweep may take minutes and leave the hot
 * path its cores; deleting them in one statement made a drain run at half its speed meanwhile
 * (docs/performance-history.md, "Cost as the work grows"). A day whose jobs ended within the per-minute
 * counts' window (a retention under a day) is dropped in one transaction instead, as the counts of
 * what ended lose its attempts with the rows.
 */
export async function daysDrop(pool: pg.Pool, p: DaysDropOptions): Promise<DaysDropped> {
  const out: DaysDropped = { days: [], jobs: 0, kept: 0, goneMs: 0, swept: 0, unswept: false, vacuumMs: 0 };
  const t0 = performance.now();
  const c = await pool.connect();
  try {
    // One dropper at a time, across coordinators: a session lock, since DETACH CONCURRENTLY
    // cannot run inside a transaction.
    const { rows: lk } = await c.query<{ ok: boolean }>('SELECT pg_try_advisory_lock($1) AS ok', [DAYS_LOCK + 1]);
    if (!lk[0]?.ok) return out;
    try {
      const cutoffDay = (
        await c.query<{ d: string }>(
          `SELECT to_char(((coalesce($1::timestamptz, now()) - make_interval(secs => $2::float8 / 1000.0)) AT TIME ZONE 'UTC')::timestamp, 'YYYY-MM-DD') AS d`,
          [p.now ?? null, p.olderThanMs],
        )
      ).rows[0]!.d;
      const parts = (await dayPartitions(c)).sort((a, b) => a.day.localeCompare(b.day));
      for (const part of parts) {
        // The day ended at or before the cutoff: it is before the cutoff's own day.
        if (!part.pending && part.day >= cutoffDay) continue;
        if (!part.pending) {
          const kept = await c.query(
            `WITH open AS (
               SELECT e.job_id FROM webhook_events e JOIN webhook_deliveries d ON d.event_id = e.id WHERE d.status = 'pending' OR d.status = 'sending'
               UNION
               SELECT e.job_id FROM webhook_events e WHERE e.type = 'job.dead' AND e.alerted_at IS NULL
             ), m AS (
               DELETE FROM "${part.table}" x USING open WHERE x.id = open.job_id RETURNING x.*
             )
             INSERT INTO jobs_live (${JOB_COLUMNS.join(', ')}) SELECT ${JOB_COLUMNS.map((k) => (k === 'done_day' ? 'NULL' : k)).join(', ')} FROM m`,
          );
          out.kept += kept.rowCount ?? 0;
          await c.query(`ALTER TABLE jobs DETACH PARTITION "${part.table}" CONCURRENTLY`);
        } else {
          await c.query(`ALTER TABLE jobs DETACH PARTITION "${part.table}" FINALIZE`);
        }
        out.jobs += await retire(c, part.table);
        out.days.push(part.day);
      }
      // Tables detached by a run that stopped before retiring them.
      for (const table of await unattached(c, 'jobs_done_')) {
        const n = await retire(c, table);
        out.jobs += n;
        if (n) out.days.push(dayOf(table));
      }
      out.goneMs = performance.now() - t0;
      for (const table of await unattached(c, 'jobs_gone_')) {
        const swept = await sweep(c, table, p);
        out.swept += swept.jobs;
        if (!swept.done) {
          out.unswept = true;
          break;
        }
      }
      if ((out.jobs || out.swept) && !out.unswept) {
        const tv = performance.now();
        await vacuum(pool, c, p.signal);
        out.vacuumMs = performance.now() - tv;
      }
    } finally {
      await c.query('SELECT pg_advisory_unlock($1)', [DAYS_LOCK + 1]).catch(() => undefined);
    }
    return out;
  } finally {
    c.release();
  }
}

const dayOf = (table: string) => table.replace(/^jobs_(done|gone)_(\d{4})(\d{2})(\d{2})$/, '$2-$3-$4');
const goneTable = (table: string) => table.replace(/^jobs_done_/, 'jobs_gone_');

/** Tables named `<prefix>YYYYMMDD` that are not a partition of `jobs`, oldest first. */
async function unattached(c: pg.PoolClient | pg.Client, prefix: 'jobs_done_' | 'jobs_gone_'): Promise<string[]> {
  const { rows } = await c.query<{ table: string }>(
    `SELECT c.relname AS table FROM pg_class c
     WHERE c.relkind = 'r' AND c.relname ~ ('^' || $1 || '[0-9]{8}$') AND c.relnamespace = 'public'::regnamespace
       AND NOT EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = c.oid)
     ORDER BY c.relname`,
    [prefix],
  );
  return rows.map((r) => r.table);
}

/**
 * A detached day table leaves the counts: the kept counts lose its jobs and the table becomes
 * `jobs_gone_YYYYMMDD` (its indexes but the id's dropped, the id's renamed, so that the day's
 * partition can be made again), for the sweep; in one transaction. A table holding jobs that ended
 * within the per-minute counts' window goes whole instead (`dropDetached`). Returns its jobs.
 */
async function retire(c: pg.PoolClient | pg.Client, table: string): Promise<number> {
  const gone = goneTable(table);
  // A table of the same day still being swept (the day's partition made again and dropped again).
  if ((await unattached(c, 'jobs_gone_')).includes(gone)) await sweep(c, gone, {});
  await c.query('BEGIN');
  try {
    // The last finish, from the table's finished_idx; then the counts, read once.
    const { rows } = await c.query<{ recent: boolean }>(`SELECT coalesce(max(finished_at) >= ${endedCutoff}, false) AS recent FROM "${table}"`);
    if (rows[0]!.recent) {
      await c.query('COMMIT');
      return dropDetached(c, table);
    }
    const { rows: counted } = await c.query<{ n: number }>(
      `WITH g AS (SELECT queue, status, count(*) AS n FROM "${table}" GROUP BY 1, 2),
       k AS (${countChangeSql('SELECT queue, status, -n FROM g')})
       SELECT coalesce(sum(n), 0)::int AS n FROM g`,
    );
    const n = counted[0]!.n;
    const { rows: ix } = await c.query<{ name: string }>(`SELECT indexrelid::regclass::text AS name FROM pg_index WHERE indrelid = $1::regclass`, [`"${table}"`]);
    for (const { name } of ix) {
      if (name.replaceAll('"', '') === `${table}_id_uq`) await c.query(`ALTER INDEX ${name} RENAME TO "${gone}_id_uq"`);
      else await c.query(`DROP INDEX ${name}`);
    }
    await c.query(`ALTER TABLE "${table}" RENAME TO "${gone}"`);
    await c.query('COMMIT');
    return n;
  } catch (err) {
    await c.query('ROLLBACK').catch(() => undefined);
    throw err;
  }
}

/**
 * Deletes the rows the jobs of a `jobs_gone_*` table left in other tables, `batch` jobs at a time
 * (each batch one statement: its jobs leave the table with their rows, so a sweep cut short goes on
 * where it stopped), pausing after each as `share` says; drops the table when it is empty. Returns
 * the jobs swept and whether it finished.
 */
async function sweep(c: pg.PoolClient | pg.Client, table: string, p: Omit<DaysDropOptions, 'olderThanMs' | 'now'>): Promise<{ jobs: number; done: boolean }> {
  const share = p.share ?? 1;
  const batch = p.batch ?? 1000;
  let jobs = 0;
  // Each batch starts after the last id of the one before: the index entries of the jobs swept
  // stay until the table goes, and a scan from the start would step over all of them every time.
  let after: string | null = null;
  for (;;) {
    if (p.hold) await p.hold();
    if (p.signal?.aborted) return { jobs, done: false };
    const t = performance.now();
    const res: pg.QueryResult<{ n: number; last: string | null }> = await c.query(
      `WITH c AS (
         SELECT id, idempotency_key FROM "${table}" WHERE $2::uuid IS NULL OR id > $2::uuid ORDER BY id LIMIT $1
       ), ids AS (
         SELECT array_agg(id) AS ids, array_agg(idempotency_key) FILTER (WHERE idempotency_key IS NOT NULL) AS keys FROM c
       ), d AS (
         DELETE FROM "${table}" WHERE id = ANY((SELECT ids FROM ids)::uuid[]) RETURNING 1
       ), ${referencesDeleteSql('(SELECT ids FROM ids)::uuid[]', '(SELECT keys FROM ids)::text[]')}
       SELECT (SELECT count(*) FROM d)::int AS n, (SELECT id FROM c ORDER BY id DESC LIMIT 1)::text AS last`,
      [batch, after],
    );
    const { n, last } = res.rows[0]!;
    jobs += n;
    after = last;
    if (n < batch) break;
    if (share < 1) await pause(((performance.now() - t) * (1 - share)) / share, p.signal);
  }
  await c.query(`DROP TABLE "${table}"`);
  return { jobs, done: true };
}

/**
 * VACUUMs the tables a drop deleted rows from, throttled as autovacuum is. A day is about a
 * seventh of what they hold, under autovacuum's threshold (a fifth), so its dead rows would
 * otherwise stay until the next day's drop; meanwhile every index read over them steps past their
 * entries, and the planner's probe of an index's ends reads them too: an agent's list took 8.6
 * ms instead of 2.4 on a database whose attempts were four-fifths dead rows (docs/performance-history.md,
 * "Cost as the work grows"). `signal` cancels a VACUUM under way (harmless: autovacuum or the
 * next drop does it).
 */
async function vacuum(pool: pg.Pool, c: pg.PoolClient, signal: AbortSignal | undefined): Promise<void> {
  const pid = (c as pg.PoolClient & { processID?: number }).processID;
  // Sent from another connection; waited for before `c` runs anything else, so that it can only
  // land in the VACUUM (a cancel reaching an idle backend is ignored).
  let cancelled: Promise<unknown> | undefined;
  const cancel = () => (cancelled = pool.query('SELECT pg_cancel_backend($1)', [pid]).catch(() => undefined));
  await c.query(`SET vacuum_cost_delay = '2ms'`);
  try {
    for (const table of REFERENCE_TABLES) {
      if (signal?.aborted) return;
      signal?.addEventListener('abort', cancel, { once: true });
      try {
        await c.query(`VACUUM (SKIP_LOCKED) ${table}`);
      } catch (err) {
        if (!signal?.aborted) throw err;
      } finally {
        signal?.removeEventListener('abort', cancel);
        await cancelled;
      }
    }
  } finally {
    await c.query('RESET vacuum_cost_delay').catch(() => undefined);
  }
}

/** Waits `ms`, or less if `signal` aborts. */
function pause(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      signal?.removeEventListener('abort', done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    signal?.addEventListener('abort', done, { once: true });
  });
}

/**
 * A detached day table: its jobs' other rows go (each table through its job_id index, or by key
 * for job_keys), the kept counts lose its jobs, the per-minute counts what of theirs ended in the
 * kept minutes, and the table is dropped, in one transaction. Returns how many jobs it held.
 */
async function dropDetached(c: pg.PoolClient | pg.Client, table: string): Promise<number> {
  await c.query('BEGIN');
  try {
    const { rows } = await c.query<{ n: number }>(`SELECT count(*)::int AS n FROM "${table}"`);
    const n = rows[0]!.n;
    if (n) {
      await c.query(
        `WITH x AS MATERIALIZED (SELECT id, queue, status, finished_at, final_attempt_id, idempotency_key FROM "${table}"),
         a AS (DELETE FROM attempts WHERE job_id IN (SELECT id FROM x) RETURNING ended_at, status, job_status),
         e AS (DELETE FROM job_events WHERE job_id IN (SELECT id FROM x) RETURNING kind, at),
         ${JOB_REFERENCES.filter((t) => t !== 'job_events')
           .map((t) => `del_${t} AS (DELETE FROM ${t} WHERE job_id IN (SELECT id FROM x))`)
           .join(',\n         ')},
         keys AS (DELETE FROM job_keys k USING x WHERE k.key = x.idempotency_key AND k.job_id = x.id),
         k AS (${countChangeSql('SELECT queue, status, -1 FROM x')}),
         ec AS (${endedCountSql(
           `SELECT ended_at, ${endedKindSql('status', 'job_status')} FROM a WHERE ended_at >= ${endedCutoff}
             UNION ALL SELECT finished_at, 'completed' FROM x WHERE final_attempt_id IS NOT NULL AND finished_at >= ${endedCutoff}
             UNION ALL SELECT at, 'canceled' FROM e WHERE kind = 'canceled' AND at >= ${endedCutoff}`,
           '-1',
         )})
         SELECT 1`,
      );
    }
    await c.query(`DROP TABLE "${table}"`);
    await c.query('COMMIT');
    return n;
  } catch (err) {
    await c.query('ROLLBACK').catch(() => undefined);
    throw err;
  }
}
