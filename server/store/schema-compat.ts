/**
 * Which releases can run on a database (docs/deploy.md, "Which releases can run on one
 * database"). A release's reader level is the number of migrations it ships
 * (`migrations/meta/_journal.json`). Each migration is marked in `migrations/compat.json`:
 * `add-only` when a release without it keeps working on a database with it, `breaks` otherwise;
 * an unmarked one counts as `breaks`, so a forgotten mark stops old replicas rather than letting
 * them run wrongly. The database keeps the lowest level a reader must have in `schema_compat`
 * (one row, `min_reader`): the number of its last breaking migration plus one. The migrator raises
 * it (never lowers it) and sends NOTIFY `leasehold_schema` with the new value; coordinators refuse
 * to start below it and stop when they find themselves below it (core/schema-watch.ts).
 */
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { SCHEMA_CHANNEL } from './notify.js';
import { run, statement, type Queryable } from './sql.js';

/** A migration's mark: whether a release without it can run on a database with it. */
export type CompatMark = 'add-only' | 'breaks';

/** This release's migrations, in order, with their marks. */
export interface CompatInfo {
  /** The number of migrations this release ships: the highest `min_reader` it can run on. */
  readerLevel: number;
  /** The `min_reader` a database migrated by this release has: its last breaking migration's number plus one. */
  minReader: number;
  migrations: Array<{ tag: string; mark: CompatMark; marked: boolean }>;
}

/** Reads the journal and the marks of the migrations in `folder`. */
export function compatInfo(folder: string): CompatInfo {
  const journal = JSON.parse(readFileSync(path.join(folder, 'meta/_journal.json'), 'utf8')) as { entries: Array<{ tag: string }> };
  let marks: Record<string, { mark?: string }> = {};
  try {
    marks = (JSON.parse(readFileSync(path.join(folder, 'compat.json'), 'utf8')) as { migrations?: typeof marks }).migrations ?? {};
  } catch (err) {
    // No file: every migration breaks (the safe reading). A file that does not parse is a mistake to see.
    if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw new Error(`${path.join(folder, 'compat.json')}: ${(err as Error).message}`, { cause: err });
  }
  const migrations = journal.entries.map((e) => {
    const given = marks[e.tag]?.mark;
    return { tag: e.tag, mark: given === 'add-only' ? ('add-only' as const) : ('breaks' as const), marked: given === 'add-only' || given === 'breaks' };
  });
  const lastBreaking = migrations.findLastIndex((m) => m.mark === 'breaks');
  return { readerLevel: migrations.length, minReader: lastBreaking + 1, migrations };
}

const getSql = statement('schemaCompatGet', `SELECT min_reader FROM schema_compat`);

/** The database's `min_reader`; undefined when it has no `schema_compat` row. */
export async function schemaCompatGet(db: Queryable): Promise<number | undefined> {
  const [r] = await run<{ min_reader: number }>(db, getSql, []);
  return r?.min_reader;
}

// Raises only: a release older than the database's (LEASEHOLD_ALLOW_NEWER_SCHEMA=1) computes a
// lower value, which must not let releases older still back in. The NOTIFY is sent only when the
// value changed, and delivered when this statement's transaction commits. `before` is read in the
// same statement (one round trip): a CTE's write is not seen by the rest of its statement, so it is
// the value from before, and the value left is the one raised or else that one.
const raiseSql = statement(
  'schemaCompatRaise',
  `WITH u AS (
     INSERT INTO schema_compat (min_reader) VALUES ($1)
     ON CONFLICT (one) DO UPDATE SET min_reader = excluded.min_reader WHERE schema_compat.min_reader < excluded.min_reader
     RETURNING min_reader
   ), n AS (
     SELECT min_reader, pg_notify('${SCHEMA_CHANNEL}', min_reader::text) AS notified FROM u
   )
   SELECT (SELECT min_reader FROM n) AS raised, (SELECT min_reader FROM schema_compat) AS before`,
);

/**
 * Raises the database's `min_reader` to `minReader` when it is lower, and then tells every
 * coordinator (NOTIFY `leasehold_schema`, payload the new value). Returns the new value as
 * `raised` (undefined when it was already at least `minReader`), and the value the database holds
 * now as `minReader`.
 */
export async function schemaCompatRaise(db: Queryable, minReader: number): Promise<{ raised: number | undefined; minReader: number | undefined }> {
  const [r] = await run<{ raised: number | null; before: number | null }>(db, raiseSql, [minReader]);
  const raised = r?.raised ?? undefined;
  return { raised, minReader: raised ?? r?.before ?? undefined };
}

/** What an operator is told when the database needs a newer reader than `readerLevel`. */
export function schemaTooNewMessage(minReader: number, readerLevel: number): string {
  return (
    `the database was migrated to schema level ${minReader} by a newer release; this release reads up to level ${readerLevel} ` +
    `(it ships ${readerLevel} migrations, and a later one changed what it reads and writes: see the newer release's ` +
    `server/store/migrations/compat.json). Run a release of level ${minReader} or more here (upgrade this replica), or restore ` +
    `the database from a backup taken before the newer release migrated it; LEASEHOLD_ALLOW_NEWER_SCHEMA=1 does not override this`
  );
}
