/**
 * Opens the database: `DATABASE_URL` when set, otherwise the embedded PostgreSQL. Returns a
 * connection pool and a `close()` that ends the pool and stops an embedded server we started.
 */
import pg from 'pg';
import type { Logger } from '../log.js';
import { startEmbedded, type EmbeddedDatabase } from './embedded.js';

export interface Database {
  pool: pg.Pool;
  url: string;
  /** Set when the embedded server is in use. */
  embedded: EmbeddedDatabase | undefined;
  /** Ends the pool, then stops the embedded server if this process started it. Safe to call twice. */
  close(): Promise<void>;
}

export interface OpenOptions {
  databaseUrl: string | undefined;
  dataDir: string;
  log: Logger;
  /** Pool size; default 20. */
  max?: number;
}

// int8 (bigint ids, counts) as numbers: every value we keep in one fits in 2^53.
pg.types.setTypeParser(pg.types.builtins.INT8, (v) => Number(v));

/** Opens a pool on `DATABASE_URL` or on a freshly started embedded PostgreSQL. */
export async function openDatabase(opts: OpenOptions): Promise<Database> {
  const log = opts.log.child({ component: 'database' });
  const embedded = opts.databaseUrl ? undefined : await startEmbedded({ dataDir: opts.dataDir, log: opts.log });
  const url = opts.databaseUrl ?? embedded!.url;
  const pool = createPool(url, opts.max ?? 20, log);
  try {
    await pool.query('SELECT 1');
  } catch (err) {
    await pool.end().catch(() => undefined);
    await embedded?.stop();
    throw new Error(`cannot connect to PostgreSQL at ${redact(url)}: ${(err as Error).message}`, { cause: err });
  }
  log.info({ url: redact(url), embedded: Boolean(embedded) }, 'database connected');
  let closed: Promise<void> | undefined;
  return {
    pool,
    url,
    embedded,
    close: () =>
      (closed ??= (async () => {
        await pool.end();
        await embedded?.stop();
      })()),
  };
}

/** A pool whose idle-client errors (a server restart, a killed backend) are logged, not thrown. */
export function createPool(url: string, max: number, log?: Logger): pg.Pool {
  const pool = new pg.Pool({ connectionString: url, max, application_name: 'leasehold' });
  // pg attaches the client to the error; logging it would dump the connection and its statements.
  pool.on('error', (err: Error & { code?: string }) => log?.warn({ err: { message: err.message, code: err.code } }, 'idle database connection failed'));
  return pool;
}

/** The URL with its password hidden, for logs and errors. */
export function redact(url: string): string {
  try {
    const u = new URL(url);
    if (u.password) u.password = '***';
    return u.toString();
  } catch {
    return '(unparseable DATABASE_URL)';
  }
}
