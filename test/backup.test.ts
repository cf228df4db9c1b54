/**
 * `leasehold backup` and `leasehold restore` (server/store/backup.ts), run as an operator runs
 * them: the package's bin, as child processes, on an embedded PostgreSQL of the test's own.
 *
 * The backup is taken while a writer enqueues, claims and completes jobs as fast as it can. The
 * restored cluster, started on another data directory, must hold every job committed before the
 * backup began and none that was never committed, pass amcheck on every table and index, and keep
 * the six invariants. A backup missing one of its WAL segments must not restore, and must leave
 * the cluster that was there in place. And the refusals: a non-empty target, DATABASE_URL set, a
 * directory that is not a complete backup, a server running on the cluster to replace.
 */
import { execFile } from 'node:child_process';
import { existsSync } from 'node:fs';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import pg from 'pg';
import pino from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startEmbedded, type EmbeddedDatabase } from '../server/store/embedded.js';
import { attemptComplete, attemptStart, jobClaim, jobEnqueue, migrateDatabase } from '../server/store/index.js';
import { checkInvariants } from './helpers/invariants.js';
import { root } from './helpers/serve.js';
import { quietPool } from './helpers/quiet-pool.js';

const exec = promisify(execFile);
const log = pino({ level: 'warn' });

interface Run {
  code: number;
  stdout: string;
  stderr: string;
}

async function leasehold(args: string[], env: Record<string, string | undefined> = {}): Promise<Run> {
  const base: NodeJS.ProcessEnv = { ...process.env, DATABASE_URL: undefined, LEASEHOLD_LOG_FORMAT: 'json', ...env };
  for (const k of Object.keys(base)) if (base[k] === undefined) delete base[k];
  try {
    const { stdout, stderr } = await exec(process.execPath, ['server/leasehold.mjs', ...args], { cwd: root, env: base, timeout: 120_000 });
    return { code: 0, stdout, stderr };
  } catch (e) {
    const err = e as { code: number; stdout: string; stderr: string };
    return { code: err.code, stdout: err.stdout, stderr: err.stderr };
  }
}

/** A pool on one database of an embedded cluster. */
function poolOn(db: EmbeddedDatabase): pg.Pool {
  return quietPool({ connectionString: db.url, max: 4 });
}

/** Every table and index of the database checked by amcheck: throws on any corruption. */
async function amcheck(pool: pg.Pool): Promise<number> {
  await pool.query('CREATE EXTENSION IF NOT EXISTS amcheck');
  const { rows: tables } = await pool.query<{ oid: number }>(`SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.relkind IN ('r', 'm', 't') AND n.nspname NOT IN ('pg_catalog', 'information_schema')`);
  for (const { oid } of tables) {
    const { rows } = await pool.query(`SELECT * FROM verify_heapam($1::regclass)`, [oid]);
    expect(rows, `verify_heapam(${oid})`).toEqual([]);
  }
  const { rows: indexes } = await pool.query<{ oid: number }>(`SELECT c.oid FROM pg_class c JOIN pg_am a ON a.oid = c.relam
     JOIN pg_index i ON i.indexrelid = c.oid WHERE a.amname = 'btree' AND c.relkind = 'i' AND i.indisvalid`);
  for (const { oid } of indexes) await pool.query(`SELECT bt_index_check($1::regclass, true)`, [oid]);
  return tables.length + indexes.length;
}

describe.skipIf(process.platform === 'win32')('leasehold backup and restore', () => {
  let base: string;
  let source: EmbeddedDatabase;
  let pool: pg.Pool;

  beforeAll(async () => {
    base = await fs.mkdtemp(path.join(os.tmpdir(), 'leasehold-backup-'));
    // Enterable by the postgres user (tests run as root), so the clusters live inside it and go with it.
    await fs.chmod(base, 0o755);
    source = await startEmbedded({ dataDir: path.join(base, 'source'), log });
    pool = poolOn(source);
    await migrateDatabase(pool, { log });
  });

  afterAll(async () => {
    await pool?.end();
    await source?.stop();
    await fs.rm(base, { recursive: true, force: true });
  });

  it('copies the cluster while jobs are enqueued, run and completed, and restores every job committed before it began', async () => {
    // A writer: each round enqueues 20 jobs (2 KB payloads, so the copy has pages to race with),
    // claims and starts 10 and completes 5 of them. `committed` is every id whose enqueue returned.
    const committed: string[] = [];
    let writing = true;
    let round = 0;
    const writer = (async () => {
      while (writing) {
        round += 1;
        for (let i = 0; i < 20; i++) {
          const r = await jobEnqueue(pool, { queue: 'backup', payload: { round, i, pad: 'x'.repeat(2000) } });
          if (r.outcome !== 'ok') throw new Error(r.outcome);
          committed.push(r.value.id);
        }
        const claimed = await jobClaim(pool, { queues: ['backup'], agentId: 'agent-b', limit: 10, claimTtlMs: 60_000 });
        if (claimed.outcome !== 'ok') throw new Error(claimed.outcome);
        for (const [n, c] of claimed.value.entries()) {
          const s = await attemptStart(pool, { attemptId: c.attemptId, agentId: 'agent-b', leaseTtlMs: 60_000 });
          if (s.outcome !== 'ok') throw new Error(s.outcome);
          if (n % 2 === 0) {
            const c2 = await attemptComplete(pool, { attemptId: c.attemptId, agentId: 'agent-b', result: { n } });
            if (c2.outcome !== 'ok') throw new Error(c2.outcome);
          }
        }
      }
    })();
    while (committed.length < 2000) await new Promise((r) => setTimeout(r, 20));
    const before = committed.length;
    const beforeIds = committed.slice(0, before);

    const to = path.join(base, 'backup-1');
    const backup = await leasehold(['backup', to, '--data-dir', path.join(base, 'source')]);
    const roundsDuring = round;
    writing = false;
    await writer;
    expect(backup.code, backup.stderr).toBe(0);
    expect(backup.stdout).toMatch(/^backup of \d+ files \([\d.]+ MiB, PostgreSQL 17\.\d+\) in /);
    expect(roundsDuring, 'the writer went on during the backup').toBeGreaterThan(0);
    const manifest = JSON.parse(await fs.readFile(path.join(to, 'BACKUP.json'), 'utf8'));
    expect(manifest).toMatchObject({ format: 1, postgres: expect.stringMatching(/^17\./) });
    expect(manifest.walSegments.length).toBeGreaterThan(0);
    expect(existsSync(path.join(to, 'pg', 'postmaster.pid'))).toBe(false);

    const target = path.join(base, 'restored');
    const restore = await leasehold(['restore', to, '--data-dir', target]);
    expect(restore.code, restore.stderr).toBe(0);
    const jobs = Number(/\((\d+) jobs\)/.exec(restore.stdout)?.[1]);

    const restored = await startEmbedded({ dataDir: target, log });
    const rpool = poolOn(restored);
    try {
      const { rows } = await rpool.query<{ id: string }>(`SELECT id FROM jobs WHERE queue = 'backup'`);
      const ids = new Set(rows.map((r) => r.id));
      expect(ids.size).toBe(jobs);
      expect(beforeIds.filter((id) => !ids.has(id)), 'jobs committed before the backup began, missing').toEqual([]);
      const all = new Set(committed);
      expect([...ids].filter((id) => !all.has(id)), 'jobs never committed').toEqual([]);
      expect(ids.size).toBeGreaterThanOrEqual(before);
      expect(await amcheck(rpool)).toBeGreaterThan(20);
      await checkInvariants(rpool);
      // The restored database takes work.
      const more = await jobEnqueue(rpool, { queue: 'backup', payload: { after: true } });
      expect(more.outcome).toBe('ok');
    } finally {
      await rpool.end();
      await restored.stop();
    }
  }, 240_000);

  it('refuses what it cannot do, and puts the cluster that was there back when the backup does not start', async () => {
    const to = path.join(base, 'backup-2');
    expect((await leasehold(['backup', to, '--data-dir', path.join(base, 'source')])).code).toBe(0);

    const full = await leasehold(['backup', to, '--data-dir', path.join(base, 'source')]);
    expect(full.code).toBe(2);
    expect(full.stderr).toMatch(/is not empty: give a new directory for the backup/);

    const external = await leasehold(['backup', path.join(base, 'backup-x')], { DATABASE_URL: 'postgres://u:p@127.0.0.1:1/db' });
    expect(external.code).toBe(2);
    expect(external.stderr).toMatch(/works on the embedded PostgreSQL \(DATABASE_URL unset\)/);

    const notBackup = await leasehold(['restore', path.join(base, 'source'), '--data-dir', path.join(base, 'elsewhere')]);
    expect(notBackup.code).toBe(2);
    expect(notBackup.stderr).toMatch(/holds no complete backup/);

    const running = await leasehold(['restore', to, '--data-dir', path.join(base, 'source')]);
    expect(running.code).toBe(2);
    expect(running.stderr).toMatch(/PostgreSQL \(pid \d+\) is running on .*: stop the coordinator first/);

    // A cluster with a job of its own, then a backup without its last WAL segment put over it.
    const target = path.join(base, 'kept');
    const kept = await startEmbedded({ dataDir: target, log });
    const kpool = poolOn(kept);
    await kpool.query(`CREATE TABLE mine (v text)`);
    await kpool.query(`INSERT INTO mine VALUES ('still here')`);
    await kpool.end();
    await kept.stop();
    const manifest = JSON.parse(await fs.readFile(path.join(to, 'BACKUP.json'), 'utf8'));
    await fs.rm(path.join(to, 'pg', 'pg_wal', manifest.walSegments.at(-1)));
    const t0 = performance.now();
    const broken = await leasehold(['restore', to, '--data-dir', target]);
    // At once: the server's exit ends the wait for it (it had held the process for 60 s).
    expect(performance.now() - t0).toBeLessThan(30_000);
    expect(broken.code).toBe(2);
    expect(broken.stderr).toMatch(/the restored cluster did not start, so the one that was there is back in place/);
    const again = await startEmbedded({ dataDir: target, log });
    const apool = poolOn(again);
    try {
      expect((await apool.query(`SELECT v FROM mine`)).rows).toEqual([{ v: 'still here' }]);
    } finally {
      await apool.end();
      await again.stop();
    }
  }, 240_000);
});
