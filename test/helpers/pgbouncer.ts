/**
 * Debian's PgBouncer in front of a test database, in the pool mode asked for: what a user gets
 * who pastes a hosted database's pooled connection string (transaction mode) or runs a pooler
 * in session mode (docs/deploy.md, "A pooler in front").
 */
import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { chmod, chown, mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { freePort } from './ports.js';
import { accepting, missing } from './proxies.js';

/** Debian installs it in /usr/sbin, which a user's PATH may lack; why it cannot be run, if it cannot. */
export function pgbouncerMissing(): string | undefined {
  return existsSync(DEBIAN_BIN) ? undefined : missing('pgbouncer');
}
const DEBIAN_BIN = '/usr/sbin/pgbouncer';

export interface RunningPgBouncer {
  /** `DATABASE_URL` through the pooler. */
  url: string;
  /** What PgBouncer logged so far. */
  log(): string;
  stop(): Promise<void>;
}

/** PgBouncer refuses to run as root: as root it runs as `postgres` (the test server's user). */
function runAs(): { uid: number; gid: number } | undefined {
  if (process.getuid?.() !== 0) return undefined;
  const id = (flag: string) => Number(execFileSync('id', [flag, 'postgres'], { encoding: 'utf8' }).trim());
  return { uid: id('-u'), gid: id('-g') };
}

export async function startPgBouncer(databaseUrl: string, mode: 'session' | 'transaction'): Promise<RunningPgBouncer> {
  const u = new URL(databaseUrl);
  const user = decodeURIComponent(u.username);
  const dbname = u.pathname.slice(1);
  const port = await freePort();
  const dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-pgbouncer-'));
  const ini = path.join(dir, 'pgbouncer.ini');
  await writeFile(path.join(dir, 'userlist.txt'), `"${user}" "${decodeURIComponent(u.password)}"\n`);
  await writeFile(
    ini,
    [
      '[databases]',
      `${dbname} = host=${u.hostname} port=${u.port} dbname=${dbname}`,
      '[pgbouncer]',
      'listen_addr = 127.0.0.1',
      `listen_port = ${port}`,
      'unix_socket_dir =',
      'auth_type = plain',
      `auth_file = ${path.join(dir, 'userlist.txt')}`,
      `pool_mode = ${mode}`,
      // Two coordinators hold up to 29 connections each (docs/deploy.md): a session pool of that many.
      'default_pool_size = 64',
      'max_client_conn = 200',
      '',
    ].join('\n'),
  );
  const as = runAs();
  if (as) await chown(dir, as.uid, as.gid);
  await chmod(dir, 0o700);
  if (as) for (const f of ['pgbouncer.ini', 'userlist.txt']) await chown(path.join(dir, f), as.uid, as.gid);
  let output = '';
  const child: ChildProcess = spawn(existsSync(DEBIAN_BIN) ? DEBIAN_BIN : 'pgbouncer', [ini], { stdio: ['ignore', 'pipe', 'pipe'], ...(as ?? {}) });
  child.stdout!.on('data', (b: Buffer) => (output += b.toString()));
  child.stderr!.on('data', (b: Buffer) => (output += b.toString()));
  const exited = new Promise<void>((resolve) => child.on('exit', () => resolve()));
  const deadline = Date.now() + 10_000;
  while (!(await accepting(port))) {
    if (child.exitCode !== null || Date.now() > deadline) {
      child.kill('SIGKILL');
      await rm(dir, { recursive: true, force: true });
      throw new Error(`pgbouncer did not start listening on ${port}:\n${output}`);
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  u.port = String(port);
  return {
    url: u.toString(),
    log: () => output,
    stop: async () => {
      if (child.exitCode === null) {
        child.kill('SIGINT'); // its fast shutdown: clients are closed at once
        await Promise.race([exited, new Promise((r) => setTimeout(r, 5_000))]);
        if (child.exitCode === null) child.kill('SIGKILL');
        await exited;
      }
      await rm(dir, { recursive: true, force: true });
    },
  };
}
