/**
 * `leasehold backup` and `leasehold restore`: an online copy of the embedded PostgreSQL, and
 * putting one back.
 *
 * The embedded cluster (embedded.ts) ships only `initdb`, `postgres` and `pg_ctl`, and a
 * distribution's `pg_dump` is older than it (Debian 12 has 15, Ubuntu 24.04 16) and refuses a
 * newer server. So the backup is PostgreSQL's own low-level base backup ("Making a Base Backup
 * Using the Low Level API" in its manual), done as `pg_basebackup` does it:
 *
 * 1. a temporary physical replication slot, so that no WAL written from here on is recycled
 *    before it is copied (the session holds it; it goes with the session);
 * 2. `pg_backup_start(label, fast)`: a checkpoint, and full-page writes from then on, so a page
 *    copied half-written is rewritten whole by the WAL replay;
 * 3. the data directory copied file by file, leaving out what basebackup.c leaves out (what the
 *    server recreates or empties at start, temporary files, unlogged relations' data, the WAL),
 *    `global/pg_control` last;
 * 4. `pg_backup_stop()`: its `backup_label` written into the copy (it tells the restored server
 *    where to begin the replay and where the backup ends);
 * 5. once the server has flushed the WAL up to the backup's end, the WAL segments from the
 *    backup's start to its end copied into the copy's `pg_wal`, checked to be all there.
 *
 * Every file and directory is fsynced, and `BACKUP.json` is written last: a directory without it
 * is an interrupted backup, which `restore` refuses. The cluster's credentials go with it.
 *
 * Restoring moves the current cluster aside (never deleted), puts the copy in its place, and
 * starts it once: PostgreSQL replays the WAL to the backup's end, and the jobs are counted. If
 * that start fails, the cluster that was there is put back.
 */
import { existsSync } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import pg from 'pg';
import type { Logger } from '../log.js';
import { embeddedLayout, embeddedServerPid, startEmbedded, type RunAs } from './embedded.js';

/** A backup or restore that cannot be done as asked: one line, exit code 2 (`leasehold` reports it so). */
export class BackupError extends Error {
  override readonly name = 'BackupError';
}

/** What `BACKUP.json` says. */
export interface BackupManifest {
  format: 1;
  createdAt: string;
  /** `SHOW server_version` of the cluster copied. */
  postgres: string;
  /** The newest migration applied, from drizzle.__drizzle_migrations (null: none). */
  migrationCreatedAt: number | null;
  startLsn: string;
  stopLsn: string;
  files: number;
  bytes: number;
  walSegments: string[];
}

const MANIFEST = 'BACKUP.json';

// basebackup.c: directories whose contents the server recreates or empties at start (kept
// empty), files never copied (exact names; pg_internal.init by prefix), and the temporary
// files' prefix.
const EMPTY_DIRS = new Set(['pg_stat_tmp', 'pg_replslot', 'pg_dynshmem', 'pg_notify', 'pg_serial', 'pg_snapshots', 'pg_subtrans']);
const SKIP_FILES = new Set(['postgresql.auto.conf.tmp', 'current_logfiles.tmp', 'backup_label', 'tablespace_map', 'backup_manifest', 'postmaster.pid', 'postmaster.opts']);
const TEMP_PREFIX = 'pgsql_tmp';
const RELATION_FILE = /^(\d+)(?:_(fsm|vm|init))?(?:\.\d+)?$/;
const TEMP_RELATION = /^t\d+_\d+(?:_(fsm|vm|init))?(?:\.\d+)?$/;
const WAL_FILE = /^[0-9A-F]{24}$/;
const HISTORY_FILE = /^[0-9A-F]{8}\.history$/;

export interface BackupOptions {
  /** The coordinator's data directory (`LEASEHOLD_DATA_DIR`). */
  dataDir: string;
  /** A new directory (or an empty one) for the backup. */
  to: string;
  log: Logger;
}

/** Copies the embedded cluster of `dataDir` into `to` while it serves. */
export async function backupEmbedded(opts: BackupOptions): Promise<BackupManifest> {
  const to = path.resolve(opts.to);
  const entries = await fs.readdir(to).catch((err: NodeJS.ErrnoException) => {
    if (err.code === 'ENOENT') return [];
    throw new BackupError(`cannot use ${to} for the backup: ${err.message}`);
  });
  if (entries.length) throw new BackupError(`${to} is not empty: give a new directory for the backup`);
  const log = opts.log.child({ component: 'backup' });
  const db = await startEmbedded({ dataDir: opts.dataDir, log: opts.log });
  const client = new pg.Client({ connectionString: db.url });
  client.on('error', () => undefined);
  try {
    await client.connect();
    const q = async <T extends object>(sql: string, params: unknown[] = []) => (await client.query<T>(sql, params)).rows[0]!;
    const { dir, version } = await q<{ dir: string; version: string }>(
      `SELECT current_setting('data_directory') AS dir, current_setting('server_version') AS version`,
    );
    const pgdata = await fs.realpath(dir);
    if (!path.relative(pgdata, await fs.realpath(path.dirname(to)).then((d) => path.join(d, path.basename(to)), () => to)).startsWith('..')) {
      throw new BackupError(`${to} is inside the cluster's own directory ${pgdata}: give a directory outside it`);
    }
    const links = await fs.readdir(path.join(pgdata, 'pg_tblspc'));
    if (links.length) throw new BackupError(`the cluster has tablespaces (${links.join(', ')}): leasehold backup copies the data directory alone`);

    await fs.mkdir(path.join(to, 'pg'), { recursive: true, mode: 0o700 });
    const slot = `leasehold_backup_${process.pid}`;
    await q(`SELECT pg_create_physical_replication_slot($1, true, true)`, [slot]);
    const { lsn: startLsn } = await q<{ lsn: string }>(`SELECT pg_backup_start($1, true)::text AS lsn`, [`leasehold backup ${new Date().toISOString()}`]);
    log.info({ pgdata, to, startLsn }, 'backup started');

    const copied = { files: 0, bytes: 0 };
    let stop: { lsn: string; labelfile: string; spcmapfile: string | null };
    try {
      await copyTree(pgdata, path.join(to, 'pg'), '', copied);
      await copyFile(path.join(pgdata, 'global', 'pg_control'), path.join(to, 'pg', 'global', 'pg_control'), copied);
    } finally {
      // Always ended: a session that ends without it aborts the backup anyway, but this says so.
      stop = await q(`SELECT lsn::text AS lsn, labelfile, spcmapfile FROM pg_backup_stop(false)`);
    }
    await writeDurably(path.join(to, 'pg', 'backup_label'), stop.labelfile);
    if (stop.spcmapfile) await writeDurably(path.join(to, 'pg', 'tablespace_map'), stop.spcmapfile);

    // pg_backup_stop switched to a new segment, which flushes the one it ended in; waited for all
    // the same, since the copy below must hold every record up to the backup's end.
    for (;;) {
      const { flushed } = await q<{ flushed: boolean }>(`SELECT pg_current_wal_flush_lsn() >= $1::pg_lsn AS flushed`, [stop.lsn]);
      if (flushed) break;
      await new Promise((r) => setTimeout(r, 20));
    }
    // The segments the replay needs, from the start's to the end's (pg_walfile_name, as
    // basebackup.c, names the segment holding the byte before an LSN).
    const { rows: wal } = await client.query<{ name: string }>(
      `SELECT DISTINCT pg_walfile_name(least($1::pg_lsn + g * s.bytes, $2::pg_lsn)) AS name
       FROM (SELECT pg_size_bytes(current_setting('wal_segment_size')) AS bytes) s,
            generate_series(0, ceil(($2::pg_lsn - $1::pg_lsn) / s.bytes)::int) g
       ORDER BY 1`,
      [startLsn, stop.lsn],
    );
    const walSegments = await copyWal(pgdata, path.join(to, 'pg'), wal.map((r) => r.name), copied);

    const created = await client
      .query<{ created: string | null }>(`SELECT max(created_at)::text AS created FROM drizzle.__drizzle_migrations`)
      .then((r) => r.rows[0]!.created, (err: { code?: string }) => {
        if (err.code === '3F000' || err.code === '42P01') return null; // never migrated
        throw err;
      });
    await fs.copyFile(path.join(path.resolve(opts.dataDir), 'credentials.json'), path.join(to, 'credentials.json'));
    await fs.chmod(path.join(to, 'credentials.json'), 0o600);
    await fsyncPath(path.join(to, 'credentials.json'));
    await fsyncDirs(to);
    const manifest: BackupManifest = {
      format: 1,
      createdAt: new Date().toISOString(),
      postgres: version,
      migrationCreatedAt: created === null ? null : Number(created),
      startLsn,
      stopLsn: stop.lsn,
      files: copied.files,
      bytes: copied.bytes,
      walSegments,
    };
    await writeDurably(path.join(to, MANIFEST), `${JSON.stringify(manifest, null, 2)}\n`);
    await fsyncPath(to);
    log.info({ to, files: copied.files, bytes: copied.bytes, stopLsn: stop.lsn }, 'backup done');
    return manifest;
  } finally {
    await client.end().catch(() => undefined);
    await db.stop();
  }
}

/** Copies the directory `rel` of `from` into `to`, as basebackup.c's sendDir chooses. */
async function copyTree(from: string, to: string, rel: string, copied: { files: number; bytes: number }): Promise<void> {
  const src = path.join(from, rel);
  const names = await fs.readdir(src).catch((err: NodeJS.ErrnoException) => {
    if (err.code === 'ENOENT') return []; // a directory dropped while copying: the WAL says so
    throw err;
  });
  const databaseDir = /^base\/\d+$/.test(rel.split(path.sep).join('/'));
  for (const name of names) {
    if (name.startsWith(TEMP_PREFIX) || SKIP_FILES.has(name) || name.startsWith('pg_internal.init')) continue;
    if (databaseDir && TEMP_RELATION.test(name)) continue;
    const relFile = databaseDir ? RELATION_FILE.exec(name) : null;
    // An unlogged relation's data is emptied at start; only its init fork is kept.
    if (relFile && relFile[2] !== 'init' && existsSync(path.join(src, `${relFile[1]}_init`))) continue;
    const child = path.join(rel, name);
    if (child === path.join('global', 'pg_control')) continue; // copied last
    const st = await fs.lstat(path.join(from, child)).catch((err: NodeJS.ErrnoException) => {
      if (err.code === 'ENOENT') return undefined;
      throw err;
    });
    if (!st) continue;
    if (st.isDirectory()) {
      await fs.mkdir(path.join(to, child), { mode: 0o700 });
      if (EMPTY_DIRS.has(child)) continue;
      if (child === 'pg_wal') {
        await fs.mkdir(path.join(to, child, 'archive_status'), { mode: 0o700 });
        continue;
      }
      await copyTree(from, to, child, copied);
    } else if (st.isFile()) {
      await copyFile(path.join(from, child), path.join(to, child), copied);
    } else {
      throw new BackupError(`${path.join(from, child)} is neither a file nor a directory: not copied, so no backup`);
    }
  }
}

async function copyFile(from: string, to: string, copied: { files: number; bytes: number }): Promise<void> {
  try {
    await fs.copyFile(from, to);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT' && !existsSync(to)) return; // removed while copying: the WAL says so
    throw err;
  }
  await fs.chmod(to, 0o600);
  copied.files += 1;
  copied.bytes += (await fsyncPath(to)).size;
}

/** Copies the WAL segments `wanted` (matched on any timeline) and the timeline history files. */
async function copyWal(pgdata: string, to: string, wanted: string[], copied: { files: number; bytes: number }): Promise<string[]> {
  const names = await fs.readdir(path.join(pgdata, 'pg_wal'));
  const byPart = new Map(names.filter((n) => WAL_FILE.test(n)).map((n) => [n.slice(8), n]));
  const missing = wanted.filter((w) => !byPart.has(w.slice(8)));
  if (missing.length) throw new BackupError(`the WAL segments ${missing.join(', ')} of the backup are not in ${path.join(pgdata, 'pg_wal')}: no backup`);
  const segments = wanted.map((w) => byPart.get(w.slice(8))!);
  for (const n of [...segments, ...names.filter((n) => HISTORY_FILE.test(n))]) {
    await copyFile(path.join(pgdata, 'pg_wal', n), path.join(to, 'pg_wal', n), copied);
  }
  return segments;
}

async function writeDurably(file: string, text: string): Promise<void> {
  await fs.writeFile(file, text, { mode: 0o600 });
  await fsyncPath(file);
}

async function fsyncPath(p: string): Promise<{ size: number }> {
  const h = await fs.open(p, 'r');
  try {
    await h.sync();
    return { size: (await h.stat()).size };
  } finally {
    await h.close();
  }
}

async function fsyncDirs(dir: string): Promise<void> {
  for (const e of await fs.readdir(dir, { withFileTypes: true })) {
    if (e.isDirectory()) await fsyncDirs(path.join(dir, e.name));
  }
  await fsyncPath(dir);
}

export interface RestoreOptions {
  /** The coordinator's data directory (`LEASEHOLD_DATA_DIR`), whose cluster is replaced. */
  dataDir: string;
  /** A directory `leasehold backup` wrote. */
  from: string;
  log: Logger;
}

export interface RestoreResult {
  manifest: BackupManifest;
  /** Where the cluster that was there now is (undefined: there was none). */
  previous: string | undefined;
  jobs: number;
}

/** Puts the backup in `from` in place of the embedded cluster of `dataDir`; no server may be running on it. */
export async function restoreEmbedded(opts: RestoreOptions): Promise<RestoreResult> {
  const from = path.resolve(opts.from);
  const log = opts.log.child({ component: 'restore' });
  const manifest = await fs
    .readFile(path.join(from, MANIFEST), 'utf8')
    .then((t) => JSON.parse(t) as BackupManifest)
    .catch(() => undefined);
  if (manifest?.format !== 1) {
    throw new BackupError(`${from} holds no complete backup (no ${MANIFEST}: not written by leasehold backup, or the backup was interrupted)`);
  }
  for (const f of ['pg/PG_VERSION', 'pg/backup_label', 'pg/global/pg_control', 'credentials.json']) {
    if (!existsSync(path.join(from, f))) throw new BackupError(`${from} is damaged: ${f} is missing`);
  }
  const layout = await embeddedLayout(opts.dataDir, opts.log);
  const running = await embeddedServerPid(layout.dataDir, layout.pgdata);
  if (running !== undefined) {
    throw new BackupError(`PostgreSQL (pid ${running}) is running on ${layout.pgdata}: stop the coordinator first (systemctl stop leasehold, or Ctrl-C)`);
  }

  const stamp = new Date().toISOString().replace(/[:.]/g, '-');
  const credentials = path.join(layout.dataDir, 'credentials.json');
  const previous = existsSync(layout.pgdata) ? `${layout.pgdata}.before-restore-${stamp}` : undefined;
  const previousCredentials = existsSync(credentials) ? `${credentials}.before-restore-${stamp}` : undefined;
  if (previous) await fs.rename(layout.pgdata, previous);
  if (previousCredentials) await fs.rename(credentials, previousCredentials);
  const putBack = async () => {
    await fs.rm(layout.pgdata, { recursive: true, force: true });
    await fs.rm(credentials, { force: true });
    if (previous) await fs.rename(previous, layout.pgdata);
    if (previousCredentials) await fs.rename(previousCredentials, credentials);
  };
  try {
    await fs.cp(path.join(from, 'pg'), layout.pgdata, { recursive: true, errorOnExist: true, force: false });
    await fs.chmod(layout.pgdata, 0o700);
    if (layout.runAs.uid !== undefined) await chownTree(layout.pgdata, layout.runAs);
    await fs.copyFile(path.join(from, 'credentials.json'), credentials);
    await fs.chmod(credentials, 0o600);
  } catch (err) {
    await putBack();
    throw err;
  }
  log.info({ from, pgdata: layout.pgdata, previous }, 'backup copied into place; starting it to replay its WAL');

  // The first start replays the WAL to the backup's end: the proof that the copy is whole.
  let jobs: number;
  try {
    const db = await startEmbedded({ dataDir: layout.dataDir, log: opts.log });
    try {
      const client = new pg.Client({ connectionString: db.url });
      client.on('error', () => undefined);
      await client.connect();
      try {
        // A cluster never migrated has no jobs table (and a query naming one fails to parse).
        const { rows } = await client.query<{ t: string | null }>(`SELECT to_regclass('public.jobs')::text AS t`);
        jobs = rows[0]!.t === null ? 0 : Number((await client.query<{ n: string }>(`SELECT count(*) AS n FROM jobs`)).rows[0]!.n);
      } finally {
        await client.end();
      }
    } finally {
      await db.stop();
    }
  } catch (err) {
    await putBack();
    throw new BackupError(`the restored cluster did not start, so ${previous ? 'the one that was there is back in place' : 'nothing was left in its place'}: ${(err as Error).message}`);
  }
  log.info({ jobs, previous }, 'restored');
  return { manifest, previous, jobs };
}

async function chownTree(dir: string, runAs: RunAs): Promise<void> {
  await fs.chown(dir, runAs.uid!, runAs.gid!);
  for (const e of await fs.readdir(dir, { withFileTypes: true })) {
    const p = path.join(dir, e.name);
    if (e.isDirectory()) await chownTree(p, runAs);
    else await fs.chown(p, runAs.uid!, runAs.gid!);
  }
}
