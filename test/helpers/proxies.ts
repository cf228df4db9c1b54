/**
 * Caddy and nginx as child processes in front of a test coordinator, each run from the shipped
 * file in deploy/ with as few changes as a test needs (ports, paths, a certificate). A proxy can be
 * stopped and started again on the same ports and with the same certificate, as a restart would.
 */
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import https from 'node:https';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { waitFor } from './coordinator.js';
import { freePort } from './ports.js';

const root = path.resolve(import.meta.dirname, '../..');

/** The coordinators' ports (cleartext, loopback): one, or several replicas behind the one address. */
export interface Upstreams {
  grpcPort: number | number[];
  httpPort: number | number[];
}

const hostPorts = (p: number | number[]) => (Array.isArray(p) ? p : [p]).map((n) => `127.0.0.1:${n}`);

export interface RunningProxy {
  readonly name: 'caddy' | 'nginx';
  /** The HTTPS port, for agents and the gateway alike. */
  readonly port: number;
  /** The PEM file a client trusts to reach `https://localhost:<port>`. */
  readonly caFile: string;
  /** Everything the proxy wrote to stdout and stderr, across restarts. */
  log(): string;
  /**
   * Stops the process as systemd would: SIGTERM, then SIGKILL after `graceMs` (Debian's
   * caddy.service says TimeoutStopSec=5s). Says which ended it; safe to call twice.
   */
  stop(graceMs?: number): Promise<'exited' | 'killed'>;
  /** Starts it again on the same ports with the same files, and waits until it serves. */
  start(): Promise<void>;
  /** Caddy's admin API: the socket the shipped file puts it on, and `caddy reload` through it. */
  readonly admin?: { socket: string; reload(): Promise<{ code: number | null; output: string }> };
  /** Stops it and removes its files. */
  dispose(): Promise<void>;
}

/** `undefined` when `cmd` is on PATH, else why not. */
export function missing(cmd: string): string | undefined {
  const dirs = (process.env.PATH ?? '').split(path.delimiter).filter(Boolean);
  return dirs.some((d) => existsSync(path.join(d, cmd))) ? undefined : `${cmd} is not installed (not on PATH)`;
}

/** Resolves once something accepts TCP connections on 127.0.0.1:`port`. */
export async function accepting(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const s = net.connect({ host: '127.0.0.1', port }, () => {
      s.destroy();
      resolve(true);
    });
    s.on('error', () => resolve(false));
  });
}

export interface Answer {
  status: number;
  headers: Record<string, string | string[] | undefined>;
  body: string;
}

/**
 * One HTTP/1.1 request over TLS to `https://localhost:<port>`, trusting only `caFile` (node:https
 * offers no ALPN, so the proxy speaks HTTP/1.1, as n8n's client does). `body` as a Buffer goes
 * with its Content-Length; `chunked: true` sends it without one.
 */
export async function request(
  proxy: Pick<RunningProxy, 'port' | 'caFile'>,
  method: string,
  urlPath: string,
  opts: { body?: string | Buffer; headers?: Record<string, string>; chunked?: boolean; localAddress?: string } = {},
): Promise<Answer> {
  const ca = await readFile(proxy.caFile);
  const body = opts.body === undefined ? undefined : Buffer.from(opts.body);
  return new Promise((resolve, reject) => {
    const headers: Record<string, string | number> = { ...opts.headers };
    if (body && !opts.chunked) headers['content-length'] = body.length;
    const req = https.request({ host: 'localhost', port: proxy.port, path: urlPath, method, ca, headers, agent: false, ...(opts.localAddress ? { family: 4, localAddress: opts.localAddress } : {}) }, (res) => {
      const chunks: Buffer[] = [];
      res.on('data', (c: Buffer) => chunks.push(c));
      res.on('end', () => resolve({ status: res.statusCode ?? 0, headers: res.headers, body: Buffer.concat(chunks).toString('utf8') }));
      res.on('error', reject);
    });
    req.on('error', reject);
    if (body && opts.chunked) {
      // Several writes: a chunked body, as a client streaming it would send it.
      for (let i = 0; i < body.length; i += 64 * 1024) req.write(body.subarray(i, i + 64 * 1024));
      req.end();
    } else req.end(body);
  });
}

/** Spawns and supervises one long-running proxy process; `start()` waits until `ready()` says so. */
function supervise(
  name: RunningProxy['name'],
  dir: string,
  port: number,
  caFile: string,
  launch: () => ChildProcess,
  ready: () => Promise<boolean>,
): RunningProxy {
  let out = '';
  let child: ChildProcess | undefined;
  let exited: Promise<void> = Promise.resolve();
  const self: RunningProxy = {
    name,
    port,
    caFile,
    log: () => out,
    start: async () => {
      if (child) throw new Error(`${name} is already running`);
      const c = launch();
      child = c;
      // Should the test process end without stopping it (a crash, a kill), the proxy goes too.
      const orphan = () => c.kill('SIGTERM');
      process.once('exit', orphan);
      let gone = false;
      exited = new Promise((r) =>
        c.on('exit', (code, signal) => {
          gone = true;
          process.off('exit', orphan);
          out += `\n[${name} exited: ${signal ?? code}]\n`;
          r();
        }),
      );
      c.stdout!.on('data', (b: Buffer) => (out += b.toString('utf8')));
      c.stderr!.on('data', (b: Buffer) => (out += b.toString('utf8')));
      try {
        await waitFor(`${name} to serve on port ${port}`, async () => {
          if (gone) throw new Error(`${name} exited before serving:\n${out.slice(-4000)}`);
          return ready();
        }, 15_000);
      } catch (err) {
        await self.stop();
        throw err;
      }
    },
    stop: async (graceMs = 5_000) => {
      const c = child;
      child = undefined;
      if (!c || c.exitCode !== null || c.signalCode !== null) return 'exited';
      c.kill('SIGTERM');
      let killed = false;
      const timer = setTimeout(() => {
        out += `\n[${name} still running ${graceMs} ms after SIGTERM: SIGKILL]\n`;
        killed = true;
        c.kill('SIGKILL');
      }, graceMs);
      await exited;
      clearTimeout(timer);
      return killed ? 'killed' : 'exited';
    },
    dispose: async () => {
      await self.stop(1_000);
      await rm(dir, { recursive: true, force: true });
    },
  };
  return self;
}

/** Ready when the port accepts and `/healthz` answers 200 through the proxy, over TLS. */
function healthy(port: number, caFile: string) {
  return async () => {
    if (!existsSync(caFile) || !(await accepting(port))) return false;
    const r = await request({ port, caFile }, 'GET', '/healthz').catch(() => undefined);
    return r?.status === 200;
  };
}

/**
 * deploy/Caddyfile under `caddy run`. What the test changes is the admin API's socket (in a temp
 * dir, not /var/lib/caddy), and what it adds is global options (into the shipped file's block,
 * which sets none of these): storage in a temp dir (not ~/.local/share/caddy), certificates from Caddy's own local CA rather
 * than Let's Encrypt (`local_certs`) without touching the system trust store, and free ports in
 * place of 80 and 443. The site address and the upstreams come through the file's own
 * environment placeholders, and so may the others it reads (`placeholders`: LEASEHOLD_OUTER_PROXIES).
 */
export async function startCaddy(up: Upstreams, placeholders: Record<string, string> = {}): Promise<RunningProxy> {
  const dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-caddy-'));
  const [port, httpPort] = [await freePort(), await freePort()];
  const options = [`\tstorage file_system ${dir}/data`, '\tlocal_certs', '\tskip_install_trust', `\thttp_port ${httpPort}`, `\thttps_port ${port}`];
  // The admin API's socket, in the test's directory rather than Debian's /var/lib/caddy.
  const adminSocket = path.join(dir, 'admin.sock');
  const text = (await readFile(path.join(root, 'deploy/Caddyfile'), 'utf8')).replace(/^(\s*admin unix\/)\/var\/lib\/caddy\/admin\.sock$/m, `$1${adminSocket}`);
  if (!text.includes(adminSocket)) throw new Error('deploy/Caddyfile no longer sets `admin unix//var/lib/caddy/admin.sock`: update test/helpers/proxies.ts');
  const shipped = text.split('\n');
  // A Caddyfile has at most one global options block, first: into the shipped one if it has one.
  const first = shipped.findIndex((l) => !/^\s*(#.*)?$/.test(l));
  if (shipped[first]?.trim() === '{') shipped.splice(first + 1, 0, ...options);
  else shipped.unshift('{', ...options, '}');
  const file = path.join(dir, 'Caddyfile');
  await writeFile(file, shipped.join('\n'));
  const env = {
    PATH: process.env.PATH ?? '/usr/bin:/bin',
    HOME: dir,
    XDG_DATA_HOME: path.join(dir, 'xdg-data'),
    XDG_CONFIG_HOME: path.join(dir, 'xdg-config'),
    LEASEHOLD_SITE: `localhost:${port}`,
    // Several replicas: the placeholders take a space-separated list, as the Caddyfile says.
    LEASEHOLD_GRPC_UPSTREAM: hostPorts(up.grpcPort).join(' '),
    LEASEHOLD_HTTP_UPSTREAM: hostPorts(up.httpPort).join(' '),
    ...placeholders,
  };
  // The root of Caddy's local CA, made on the first start and kept in storage across restarts.
  const caFile = path.join(dir, 'data/pki/authorities/local/root.crt');
  const proxy = supervise(
    'caddy',
    dir,
    port,
    caFile,
    () => spawn('caddy', ['run', '--config', file, '--adapter', 'caddyfile'], { cwd: dir, env, stdio: ['ignore', 'pipe', 'pipe'] }),
    healthy(port, caFile),
  );
  await proxy.start().catch(async (err: unknown) => {
    await rm(dir, { recursive: true, force: true });
    throw err;
  });
  const reload = () =>
    new Promise<{ code: number | null; output: string }>((resolve, reject) => {
      // As Debian's caddy.service reloads: the file read again, sent through the admin endpoint it names.
      const p = spawn('caddy', ['reload', '--config', file, '--adapter', 'caddyfile', '--force'], { cwd: dir, env, stdio: ['ignore', 'pipe', 'pipe'] });
      let output = '';
      p.stdout.on('data', (d: Buffer) => (output += d));
      p.stderr.on('data', (d: Buffer) => (output += d));
      p.on('error', reject);
      p.on('exit', (code) => resolve({ code, output }));
    });
  return Object.assign(proxy, { admin: { socket: adminSocket, reload } });
}

/** Whether this machine can listen on IPv6 (`listen [::]:…` fails to start nginx otherwise). */
async function hasIpv6(): Promise<boolean> {
  return new Promise((resolve) => {
    const s = net.createServer();
    s.once('error', () => resolve(false));
    s.listen(0, '::1', () => s.close(() => resolve(true)));
  });
}

/** Replaces `from` in `text`, failing when the shipped file no longer contains it. */
function substitute(text: string, from: string | RegExp, to: string): string {
  const next = text.replace(from, to);
  if (next === text) throw new Error(`deploy/nginx.conf no longer contains ${String(from)}: update test/helpers/proxies.ts`);
  return next;
}

/**
 * deploy/nginx.conf as a server block included by a minimal main config (pid file, temp paths and
 * error log in a temp dir, in the foreground). In the shipped block the test changes only what is
 * the machine's: the listen ports (free ones for 443 and 80; the `[::]` listens dropped where IPv6
 * is unavailable), server_name, the certificate (a self-signed one for localhost), and the upstream
 * servers (the coordinators' own ports for 50051 and 8080, a `server` line per replica).
 */
export async function startNginx(up: Upstreams): Promise<RunningProxy> {
  const dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-nginx-'));
  try {
    const [port, httpPort] = [await freePort(), await freePort()];
    const [cert, key] = [path.join(dir, 'fullchain.pem'), path.join(dir, 'privkey.pem')];
    await promisify(execFile)('openssl', [
      'req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes', '-keyout', key, '-out', cert,
      '-days', '1', '-subj', '/CN=localhost', '-addext', 'subjectAltName=DNS:localhost,IP:127.0.0.1',
    ]);
    const v6 = await hasIpv6();
    let site = await readFile(path.join(root, 'deploy/nginx.conf'), 'utf8');
    site = substitute(site, /listen 443 /g, `listen ${port} `);
    site = substitute(site, /listen \[::\]:443 (.*);/g, v6 ? `listen [::]:${port} $1;` : '');
    site = substitute(site, /listen 80;/g, `listen ${httpPort};`);
    site = substitute(site, /listen \[::\]:80;/g, v6 ? `listen [::]:${httpPort};` : '');
    site = substitute(site, /server_name leasehold\.example\.com;/g, 'server_name localhost;');
    site = substitute(site, '/etc/ssl/leasehold/fullchain.pem', cert);
    site = substitute(site, '/etc/ssl/leasehold/privkey.pem', key);
    // Several replicas: a `server` line each in the upstream blocks, as the file says.
    site = substitute(site, /server 127\.0\.0\.1:50051 max_fails=0;/g, hostPorts(up.grpcPort).map((h) => `server ${h} max_fails=0;`).join('\n    '));
    site = substitute(site, /server 127\.0\.0\.1:8080 max_fails=0;/g, hostPorts(up.httpPort).map((h) => `server ${h} max_fails=0;`).join('\n    '));
    await writeFile(path.join(dir, 'leasehold.conf'), site);
    const temps = ['client_body', 'proxy', 'fastcgi', 'uwsgi', 'scgi'];
    for (const t of temps) await mkdir(path.join(dir, t));
    const main = [
      // Run as root (the test's user) the workers can read the temp dir; as anyone else `user` is ignored.
      ...(process.getuid?.() === 0 ? ['user root;'] : []),
      `pid ${dir}/nginx.pid;`,
      'error_log stderr notice;',
      'daemon off;',
      'worker_processes 1;',
      'events { worker_connections 512; }',
      'http {',
      '    access_log off;',
      ...temps.map((t) => `    ${t}_temp_path ${dir}/${t};`),
      `    include ${dir}/leasehold.conf;`,
      '}',
      '',
    ];
    const conf = path.join(dir, 'nginx.conf');
    await writeFile(conf, main.join('\n'));
    // `-e stderr`: not even the startup error log goes to /var/log/nginx.
    const args = ['-e', 'stderr', '-p', dir, '-c', conf];
    await promisify(execFile)('nginx', [...args, '-t']).catch((err: { stderr?: string }) => {
      throw new Error(`nginx -t refused the configuration:\n${err.stderr ?? String(err)}\n--- site ---\n${site}`);
    });
    const proxy = supervise('nginx', dir, port, cert, () => spawn('nginx', args, { cwd: dir, stdio: ['ignore', 'pipe', 'pipe'] }), healthy(port, cert));
    await proxy.start();
    return proxy;
  } catch (err) {
    await rm(dir, { recursive: true, force: true });
    throw err;
  }
}
