/**
 * The coordinator against a PostgreSQL that speaks only TLS, as a managed database does: Debian's
 * `postgresql-15` with `ssl=on`, a certificate from a CA of our own (subjectAltName localhost and
 * 127.0.0.1) and a pg_hba.conf of one line, `hostssl … scram-sha-256`, so a cleartext connection
 * is refused. `leasehold serve` (a real process, as users run it) on an application role that
 * owns its database (no superuser) migrates, enqueues and reads back a job over the HTTP gateway,
 * and the server sees every one of its connections encrypted; a wrong CA file, a URL without
 * sslmode, and node-postgres's `sslmode=require` (which verifies, unlike libpq's) stop it with
 * exit code 2 and a message saying what to change; `uselibpqcompat=true&sslmode=require`
 * (encrypted, not verified) works.
 *
 * Skipped where /usr/lib/postgresql/15/bin/postgres is missing, unless LEASEHOLD_REQUIRE_PG15=1
 * (CI sets it and installs postgresql-15), which makes that a failure.
 */
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { chmod, chown, mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { createInterface } from 'node:readline';
import { promisify } from 'node:util';
import pg from 'pg';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { rpc } from './helpers/http.js';
import { freePort } from './helpers/ports.js';
import { killAll, serve, type Proc } from './helpers/serve.js';

const BIN = '/usr/lib/postgresql/15/bin';
const missing = existsSync(path.join(BIN, 'postgres')) ? undefined : `${BIN}/postgres is missing (apt-get install postgresql-15)`;
if (missing && process.env.LEASEHOLD_REQUIRE_PG15 === '1') throw new Error(`LEASEHOLD_REQUIRE_PG15=1 but ${missing}`);

const run = promisify(execFile);
const ADMIN_KEY = 'tls-test-admin-key';
const JOBS = 'leasehold.v1.JobService';
// The superuser made by initdb, and the application role the coordinator runs as.
const SUPER = { user: 'postgres', password: 'super-pw' };
const APP = { user: 'leasehold_app', password: 'app pw/with:specials', db: 'leasehold' };

let dir: string;
let port: number;
let postgres: ChildProcess | undefined;
let postgresExited: Promise<void> | undefined;

/** Where the certificates are, in `dir`. */
const file = (name: string) => path.join(dir, name);

/** `DATABASE_URL` of the application role, with `query` (e.g. `sslmode=verify-full&sslrootcert=…`). */
function appUrl(query: string, host = 'localhost'): string {
  const u = new URL(`postgres://${host}:${port}/${APP.db}`);
  u.username = encodeURIComponent(APP.user);
  u.password = encodeURIComponent(APP.password);
  return query ? `${u.toString()}?${query}` : u.toString();
}

/** A client of the superuser over verified TLS (the only way in). */
async function superClient(db = 'postgres'): Promise<pg.Client> {
  const c = new pg.Client({
    connectionString: `postgres://${SUPER.user}:${SUPER.password}@localhost:${port}/${db}?sslmode=verify-full&sslrootcert=${encodeURIComponent(file('ca.pem'))}`,
  });
  await c.connect();
  return c;
}


/** The uid and gid PostgreSQL runs as: the `postgres` user when we are root (it refuses root). */
async function runAs(): Promise<{ uid?: number; gid?: number }> {
  if (process.getuid?.() !== 0) return {};
  return { uid: Number((await run('id', ['-u', 'postgres'])).stdout), gid: Number((await run('id', ['-g', 'postgres'])).stdout) };
}

/** A CA (`<name>.pem`, `<name>.key`); with `signedBy`, a server certificate for localhost and 127.0.0.1 instead. */
async function makeCert(name: string, subject: string, signedBy?: string): Promise<void> {
  const ec = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes', '-keyout', file(`${name}.key`)];
  if (!signedBy) {
    await run('openssl', ['req', '-x509', ...ec, '-out', file(`${name}.pem`), '-days', '2', '-subj', subject,
      '-addext', 'basicConstraints=critical,CA:TRUE', '-addext', 'keyUsage=critical,keyCertSign,cRLSign']);
    return;
  }
  await run('openssl', ['req', ...ec, '-out', file(`${name}.csr`), '-subj', subject]);
  await writeFile(file(`${name}.ext`), 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n');
  await run('openssl', ['x509', '-req', '-in', file(`${name}.csr`), '-CA', file(`${signedBy}.pem`), '-CAkey', file(`${signedBy}.key`),
    '-CAcreateserial', '-out', file(`${name}.pem`), '-days', '2', '-extfile', file(`${name}.ext`)]);
}

/** Resolves with the first line of `stream` matching `re`; rejects on `ended` or after `ms`. */
function lineMatching(stream: NodeJS.ReadableStream, re: RegExp, ended: Promise<unknown>, ms: number, seen: string[]): Promise<void> {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no ${re} within ${ms} ms: ${seen.slice(-10).join('\n')}`)), ms);
    createInterface({ input: stream }).on('line', (l) => {
      seen.push(l);
      if (re.test(l)) {
        clearTimeout(timer);
        resolve();
      }
    });
    void ended.then(() => {
      clearTimeout(timer);
      reject(new Error(`postgres exited before ${re}: ${seen.slice(-10).join('\n')}`));
    });
  });
}

/** The exit code of a coordinator that must stop at start, and its error line; fails at once if it comes up instead. */
async function failure(p: Proc, ms = 20_000): Promise<{ code: number | null; msg: string; lines: Array<Record<string, unknown>> }> {
  let timer: NodeJS.Timeout | undefined;
  const { code } = await Promise.race([
    p.exited,
    p.waitFor(/leasehold coordinator ready|schema up to date|migrations applied/).then((l) => {
      throw new Error(`expected it to stop at start, but it got through: ${String(l.msg)}`);
    }),
    new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`still running after ${ms} ms: ${JSON.stringify(p.lines.slice(-5))}`)), ms))),
  ]).finally(() => clearTimeout(timer));
  // Output can trail the exit event by a moment; the line we want is an error (level 50).
  const last = await p.waitFor(/cannot connect to PostgreSQL/);
  return { code, msg: String(last.msg), lines: p.lines };
}

/** `leasehold serve` on `url`, gRPC and HTTP on free ports. */
const start = (url: string) =>
  serve(['serve', '--grpc-addr', '127.0.0.1:0', '--http-addr', '127.0.0.1:0'], { DATABASE_URL: url, LEASEHOLD_ADMIN_KEY: ADMIN_KEY });

/** SIGTERM, then the exit code (0 is a clean stop). */
async function stop(p: Proc): Promise<number | null> {
  p.child.kill('SIGTERM');
  return (await p.exited).code;
}

/** Every connection of the application role as the server sees it: name and whether it is TLS. */
async function appConnections(): Promise<Array<{ application_name: string; ssl: boolean; version: string | null }>> {
  const c = await superClient();
  try {
    const { rows } = await c.query(
      `SELECT a.application_name, s.ssl, s.version FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
        WHERE a.backend_type = 'client backend' AND a.usename = $1 ORDER BY 1`,
      [APP.user],
    );
    return rows;
  } finally {
    await c.end();
  }
}

describe.skipIf(missing)(`the coordinator on a PostgreSQL that requires TLS${missing ? ` (skipped: ${missing})` : ''}`, () => {
  beforeAll(async () => {
    dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-pgtls-'));
    const owner = await runAs();
    const pgOwn = async (f: string) => {
      if (owner.uid !== undefined) await chown(f, owner.uid, owner.gid!);
    };
    await pgOwn(dir);
    await makeCert('ca', '/CN=Leasehold test CA');
    await makeCert('other-ca', '/CN=Another test CA');
    await makeCert('server', '/CN=localhost', 'ca');
    // PostgreSQL refuses a key that others can read.
    await chmod(file('server.key'), 0o600);
    await pgOwn(file('server.key'));

    await writeFile(file('pwfile'), `${SUPER.password}\n`, { mode: 0o600 });
    await pgOwn(file('pwfile'));
    const data = file('data');
    await mkdir(data, { mode: 0o700 });
    await pgOwn(data);
    const env = { PATH: process.env.PATH ?? '/usr/bin:/bin', LC_ALL: 'C' };
    await run(path.join(BIN, 'initdb'), ['-D', data, '-U', SUPER.user, `--pwfile=${file('pwfile')}`, '--auth=scram-sha-256', '-E', 'UTF8', '--no-sync'], {
      ...owner,
      env,
      cwd: dir,
    });
    // Encrypted connections from loopback with a password, nothing else (no local socket, no cleartext).
    await writeFile(path.join(data, 'pg_hba.conf'), 'hostssl all all 127.0.0.1/32 scram-sha-256\n');
    await pgOwn(path.join(data, 'pg_hba.conf'));

    port = await freePort();
    postgres = spawn(
      path.join(BIN, 'postgres'),
      ['-D', data, '-p', String(port), '-c', 'ssl=on', '-c', `ssl_cert_file=${file('server.pem')}`, '-c', `ssl_key_file=${file('server.key')}`,
        '-c', 'listen_addresses=127.0.0.1', '-c', `unix_socket_directories=${dir}`, '-c', 'fsync=off'],
      { ...owner, env, cwd: dir, stdio: ['ignore', 'ignore', 'pipe'] },
    );
    postgresExited = new Promise((resolve) => postgres!.on('exit', () => resolve()));
    await lineMatching(postgres.stderr!, /database system is ready to accept connections/, postgresExited, 20_000, []);

    const c = await superClient();
    try {
      // What a managed database gives an application: a login role that owns its database.
      await c.query(`CREATE ROLE ${APP.user} LOGIN PASSWORD '${APP.password}'`);
      await c.query(`CREATE DATABASE ${APP.db} OWNER ${APP.user}`);
    } finally {
      await c.end();
    }
  });

  afterEach(() => killAll());

  afterAll(async () => {
    killAll();
    if (postgres && postgres.exitCode === null && postgres.signalCode === null) {
      postgres.kill('SIGINT'); // fast shutdown
      const bound = new Promise<void>((resolve) => setTimeout(resolve, 10_000).unref());
      await Promise.race([postgresExited, bound]);
      if (postgres.exitCode === null && postgres.signalCode === null) postgres.kill('SIGKILL');
    }
    if (dir) await rm(dir, { recursive: true, force: true });
  });

  it('with sslmode=verify-full and the right CA: migrates, enqueues and reads a job, every connection encrypted', async () => {
    const p = start(appUrl(`sslmode=verify-full&sslrootcert=${encodeURIComponent(file('ca.pem'))}`));
    await p.waitFor(/leasehold coordinator ready/);
    expect(p.lines.find((l) => /migrations applied/.test(String(l.msg)))?.applied).toBeGreaterThan(0);
    const http = `http://${String((await p.waitFor(/HTTP listening/)).addr)}`;

    const enqueued = await rpc(http, `${JOBS}/EnqueueJob`, { queue: 'tls', payload: { over: 'verify-full' } }, ADMIN_KEY);
    expect(enqueued.status).toBe(200);
    const jobId = String(enqueued.json.job.id);
    const read = await rpc(http, `${JOBS}/GetJob`, { jobId }, ADMIN_KEY);
    expect(read).toMatchObject({ status: 200, json: { job: { id: jobId, queue: 'tls', payload: { over: 'verify-full' } } } });

    // The server's view: the pools and the listener are all there, and all on TLS.
    const conns = await appConnections();
    expect(new Set(conns.map((r) => r.application_name))).toEqual(new Set(['leasehold', 'leasehold-hot', 'leasehold-listener']));
    expect(conns.filter((r) => !r.ssl)).toEqual([]);
    expect(conns[0]!.version).toMatch(/^TLSv1\.[23]$/);
    // The schema belongs to the application role: no superuser was needed to migrate.
    const c = await superClient(APP.db);
    try {
      const { rows } = await c.query(`SELECT tableowner FROM pg_tables WHERE tablename = 'jobs'`);
      expect(rows).toEqual([{ tableowner: APP.user }]);
    } finally {
      await c.end();
    }
    expect(await stop(p)).toBe(0);
  });

  it('with a CA that did not sign the server certificate: exit code 2, saying so in one line', async () => {
    const p = start(appUrl(`sslmode=verify-full&sslrootcert=${encodeURIComponent(file('other-ca.pem'))}`));
    const { code, msg, lines } = await failure(p);
    expect(code).toBe(2);
    expect(msg).toBe(
      `cannot connect to PostgreSQL at postgres://${APP.user}:***@localhost:${port}/${APP.db}?sslmode=verify-full&sslrootcert=${encodeURIComponent(file('other-ca.pem'))}: ` +
        `its TLS certificate is not signed by the CA in sslrootcert (${file('other-ca.pem')}); check sslrootcert / sslmode in DATABASE_URL (unable to verify the first certificate)`,
    );
    // One line, no stack trace, and it never got as far as the schema.
    expect(lines.some((l) => 'err' in l || /at .*\.ts:\d+/.test(String(l.msg)))).toBe(false);
    expect(lines.some((l) => /migrations applied|schema up to date/.test(String(l.msg)))).toBe(false);
  });

  it('with sslmode=verify-full by 127.0.0.1, which the certificate lists too', async () => {
    const p = serve(['migrate'], { DATABASE_URL: appUrl(`sslmode=verify-full&sslrootcert=${encodeURIComponent(file('ca.pem'))}`, '127.0.0.1') });
    expect((await p.exited).code).toBe(0);
    expect(p.lines.some((l) => /schema up to date/.test(String(l.msg)))).toBe(true);
  });

  it('without sslmode: refused by pg_hba (no encryption), exit code 2, saying to add sslmode', async () => {
    const { code, msg } = await failure(start(appUrl('')));
    expect(code).toBe(2);
    expect(msg).toBe(
      `cannot connect to PostgreSQL at postgres://${APP.user}:***@localhost:${port}/${APP.db}: the server accepts only encrypted connections and DATABASE_URL asks for none; ` +
        `add sslmode=verify-full&sslrootcert=<your provider's CA file> to it (no pg_hba.conf entry for host "127.0.0.1", user "${APP.user}", database "${APP.db}", no encryption)`,
    );
  });

  it("sslmode=require: node-postgres verifies it (refused with a private CA, saying how); uselibpqcompat=true&sslmode=require encrypts without verifying", async () => {
    const strict = await failure(start(appUrl('sslmode=require')));
    expect(strict.code).toBe(2);
    expect(strict.msg).toMatch(
      /: its TLS certificate is not signed by a CA that Node\.js trusts; give your provider's CA file with sslrootcert=<file> in DATABASE_URL \(node-postgres verifies it for sslmode=require too; uselibpqcompat=true&sslmode=require encrypts without verifying\) \(unable to verify the first certificate\)$/,
    );

    const p = start(appUrl('uselibpqcompat=true&sslmode=require'));
    await p.waitFor(/leasehold coordinator ready/);
    expect(p.lines.some((l) => /schema up to date/.test(String(l.msg)))).toBe(true);
    const http = `http://${String((await p.waitFor(/HTTP listening/)).addr)}`;
    const enqueued = await rpc(http, `${JOBS}/EnqueueJob`, { queue: 'tls', payload: { over: 'require' } }, ADMIN_KEY);
    expect(enqueued.status).toBe(200);
    const conns = await appConnections();
    expect(conns.length).toBeGreaterThanOrEqual(3);
    expect(conns.filter((r) => !r.ssl)).toEqual([]);
    expect(await stop(p)).toBe(0);
  });
});
