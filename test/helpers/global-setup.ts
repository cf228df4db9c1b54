/**
 * Once per `npm test`: a PostgreSQL server (`DATABASE_URL` when set, otherwise a throwaway
 * embedded cluster) and a migrated template database that each test file clones.
 */
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import type { TestProject } from 'vitest/node';
import { createLogger } from '../../server/log.js';
import { startEmbedded } from '../../server/store/embedded.js';
import { migrateDatabase } from '../../server/store/migrate.js';

declare module 'vitest' {
  export interface ProvidedContext {
    /** A URL with the right to CREATE DATABASE. */
    pgAdminUrl: string;
    /** The migrated template every test database is cloned from. */
    pgTemplate: string;
    /** Prefix of every database this run creates (dropped at the end). */
    pgPrefix: string;
  }
}

export default async function setup(project: TestProject) {
  const log = createLogger({ ...process.env, LEASEHOLD_LOG_LEVEL: process.env.LEASEHOLD_LOG_LEVEL ?? 'warn', LEASEHOLD_LOG_FORMAT: 'json' });
  let adminUrl = process.env.DATABASE_URL;
  let stopEmbedded: (() => Promise<void>) | undefined;
  if (!adminUrl) {
    // Must be enterable by the postgres user when tests run as root: os.tmpdir() is.
    const dataDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-test-'));
    const db = await startEmbedded({
      dataDir,
      log,
      ephemeral: true,
      // A throwaway cluster: durability is not under test, concurrency is.
      settings: { fsync: 'off', synchronous_commit: 'off', full_page_writes: 'off', max_connections: '400' },
    });
    adminUrl = db.url;
    stopEmbedded = db.stop;
  }
  const prefix = `leasehold_test_${process.pid}_`;
  const template = `${prefix}template`;
  const admin = new pg.Client({ connectionString: adminUrl });
  await admin.connect();
  await admin.query(`CREATE DATABASE ${template}`);
  const tplUrl = withDatabase(adminUrl, template);
  const pool = new pg.Pool({ connectionString: tplUrl, max: 1 });
  await migrateDatabase(pool);
  await pool.end();
  await admin.end();

  // Files the test processes make (the agent bundle, agent-process.ts) go under one directory,
  // removed at the end: vitest ends its worker processes without their 'exit' handlers.
  const files = await mkdtemp(path.join(os.tmpdir(), 'leasehold-test-files-'));
  process.env.LEASEHOLD_TEST_TMP = files;

  project.provide('pgAdminUrl', adminUrl);
  project.provide('pgTemplate', template);
  project.provide('pgPrefix', prefix);

  return async () => {
    await rm(files, { recursive: true, force: true });
    const c = new pg.Client({ connectionString: adminUrl });
    await c.connect();
    const { rows } = await c.query<{ datname: string }>(`SELECT datname FROM pg_database WHERE datname LIKE $1`, [
      `${prefix}%`,
    ]);
    for (const r of rows) await c.query(`DROP DATABASE IF EXISTS ${r.datname} WITH (FORCE)`);
    await c.end();
    await stopEmbedded?.();
  };
}

/** The same server URL pointing at another database. */
export function withDatabase(url: string, database: string): string {
  const u = new URL(url);
  u.pathname = `/${database}`;
  return u.toString();
}
