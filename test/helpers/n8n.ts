/**
 * Real n8n for the workflow templates: `n8nHome()` makes a fresh n8n user folder (its own SQLite
 * database, so runs share no state), imports credentials and workflows with n8n's own CLI, runs a
 * workflow with `n8n execute` and returns the execution it printed, or starts `n8n start` on a
 * free port for the webhook templates. n8n comes from `LEASEHOLD_N8N_DIR`, a folder where
 * `npm i n8n@1.123.81` was run; `n8nMissing` says why it cannot be used (undefined when it can).
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { closeSync, existsSync, openSync } from 'node:fs';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { freePort } from './ports.js';

/** The n8n install the tests use (`LEASEHOLD_N8N_DIR`), or undefined. */
export const N8N_DIR = process.env.LEASEHOLD_N8N_DIR || undefined;
const BIN = N8N_DIR ? path.join(N8N_DIR, 'node_modules', '.bin', 'n8n') : '';

/** Why real n8n is not available here, or undefined when it is. */
export const n8nMissing: string | undefined = !N8N_DIR
  ? 'LEASEHOLD_N8N_DIR is not set (a folder with `npm i n8n@1.123.81`)'
  : !existsSync(BIN)
    ? `LEASEHOLD_N8N_DIR=${N8N_DIR} has no node_modules/.bin/n8n`
    : undefined;

/** The templates' placeholder base URL, replaced by the coordinator's. */
export const TEMPLATE_BASE_URL = 'http://127.0.0.1:8080';

/** One node's run in an execution: its output items, by output index. */
export interface NodeRun {
  main: Array<Array<{ json: any }> | null>;
  error?: unknown;
}

/** What `n8n execute` printed: the execution's run data. */
export interface Execution {
  /** `n8n execute` exited 0 (no node error ended the run). */
  ok: boolean;
  lastNodeExecuted: string | undefined;
  /** The error that ended the run (a Stop and Error node, a failing HTTP request). */
  error: { message?: string; node?: { name: string } } | undefined;
  /** Runs of each node that ran, in order. */
  runs: Record<string, NodeRun[]>;
  /** Items a node put on `output` in its first run ([] when it did not run or sent nothing there). */
  out(node: string, output?: number): any[];
  ran(node: string): boolean;
}

/** An n8n server started by `N8nHome.start`. */
export interface N8nServer {
  url: string;
  port: number;
  /** Its output so far (stdout and stderr). */
  log(): string;
  stop(): Promise<void>;
}

export interface N8nHome {
  /** The N8N_USER_FOLDER. */
  readonly dir: string;
  /** Runs `n8n <args>` and returns stdout; throws on a non-zero exit with its output. */
  cli(args: string[], timeoutMs?: number): Promise<string>;
  /** Imports `httpHeaderAuth` credentials (value `Bearer <key>`), each with the given id. */
  importCredentials(creds: Array<{ id: string; name: string; key: string }>): Promise<void>;
  /** Imports workflows (each must have an `id`) in one `n8n import:workflow --separate`. */
  importWorkflows(workflows: Array<Record<string, any>>): Promise<void>;
  /** Activates workflows for the next `start` (n8n reads this at start-up). */
  activate(id: string): Promise<void>;
  execute(id: string): Promise<Execution>;
  /** `n8n start` on `port` (default: a free one); resolves once its editor is up. */
  start(port?: number): Promise<N8nServer>;
  close(): Promise<void>;
}

function n8nEnv(userFolder: string, extra: Record<string, string> = {}): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = { ...process.env };
  // Not the test runner's: NODE_ENV=test silences n8n's log, and with it `n8n execute`'s output.
  for (const k of Object.keys(env)) if (/^(N8N_|DB_|VITEST|NODE_ENV$|NODE_OPTIONS$)/.test(k)) delete env[k];
  return {
    ...env,
    N8N_USER_FOLDER: userFolder,
    // n8n 1.x's defaults, said out loud: Code nodes in-process, no task runners.
    N8N_RUNNERS_ENABLED: 'false',
    N8N_DIAGNOSTICS_ENABLED: 'false',
    N8N_VERSION_NOTIFICATIONS_ENABLED: 'false',
    N8N_TEMPLATES_ENABLED: 'false',
    N8N_ENFORCE_SETTINGS_FILE_PERMISSIONS: 'false',
    N8N_LOG_LEVEL: 'info',
    ...extra,
  };
}

/** Parses `n8n execute --rawOutput`: the execution JSON, alone or after n8n's log lines. */
function parseExecution(stdout: string, stderr: string, ok: boolean): Execution {
  const lines = stdout.split('\n');
  const from = lines.indexOf('{');
  const to = lines.indexOf('}', from);
  if (from < 0 || to < 0) throw new Error(`n8n execute printed no execution:\n${stdout.slice(-3000)}\n${stderr.slice(-3000)}`);
  const data = JSON.parse(lines.slice(from, to + 1).join('\n')) as any;
  const result = data.data?.resultData ?? {};
  const runs = (result.runData ?? {}) as Record<string, Array<{ data?: { main: NodeRun['main'] }; error?: unknown }>>;
  const norm: Record<string, NodeRun[]> = {};
  for (const [k, v] of Object.entries(runs)) norm[k] = v.map((r) => ({ main: r.data?.main ?? [], error: r.error }));
  return {
    ok,
    lastNodeExecuted: result.lastNodeExecuted,
    error: result.error,
    runs: norm,
    out: (node, output = 0) => (norm[node]?.[0]?.main[output] ?? []).map((i) => i.json),
    ran: (node) => node in norm,
  };
}


/** A fresh n8n user folder in a temp dir. */
export async function n8nHome(): Promise<N8nHome> {
  if (n8nMissing) throw new Error(n8nMissing);
  const dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-n8n-'));
  const servers = new Set<N8nServer>();
  let runs = 0;
  // Output goes to files, not pipes: n8n ends with process.exit(), which cuts a piped stdout short.
  const cli = async (args: string[], timeoutMs = 90_000) => {
    const base = path.join(dir, `cli-${++runs}`);
    const [out, err] = [openSync(`${base}.out`, 'w'), openSync(`${base}.err`, 'w')];
    const child = spawn(BIN, args, { env: n8nEnv(dir), cwd: dir, stdio: ['ignore', out, err] });
    closeSync(out);
    closeSync(err);
    const timer = setTimeout(() => child.kill('SIGKILL'), timeoutMs);
    const code = await new Promise<number | null>((r) => child.on('exit', (c) => r(c)));
    clearTimeout(timer);
    const [stdout, stderr] = [await readFile(`${base}.out`, 'utf8'), await readFile(`${base}.err`, 'utf8')];
    if (code === null) throw new Error(`n8n ${args.join(' ')}: killed after ${timeoutMs} ms\n${stdout.slice(-3000)}\n${stderr.slice(-3000)}`);
    return { code, stdout, stderr };
  };
  const ok = async (args: string[], timeoutMs?: number) => {
    const r = await cli(args, timeoutMs);
    if (r.code !== 0) throw new Error(`n8n ${args.join(' ')} exited ${r.code}:\n${r.stdout.slice(-3000)}\n${r.stderr.slice(-3000)}`);
    return r.stdout;
  };
  const self: N8nHome = {
    dir,
    cli: ok,
    importCredentials: async (creds) => {
      const file = path.join(dir, 'credentials.json');
      const body = creds.map((c) => ({ id: c.id, name: c.name, type: 'httpHeaderAuth', data: { name: 'Authorization', value: `Bearer ${c.key}` } }));
      await writeFile(file, JSON.stringify(body));
      await ok(['import:credentials', `--input=${file}`]);
    },
    importWorkflows: async (workflows) => {
      const folder = await mkdtemp(path.join(dir, 'workflows-'));
      for (const w of workflows) {
        if (!w.id) throw new Error(`workflow ${w.name} has no id`);
        await writeFile(path.join(folder, `${w.id}.json`), JSON.stringify(w));
      }
      await ok(['import:workflow', '--separate', `--input=${folder}`]);
    },
    activate: async (id) => {
      await ok(['update:workflow', `--id=${id}`, '--active=true']);
    },
    execute: async (id) => {
      const r = await cli(['execute', `--id=${id}`, '--rawOutput']);
      return parseExecution(r.stdout, r.stderr, r.code === 0);
    },
    start: async (wanted) => {
      const port = wanted ?? (await freePort());
      const child: ChildProcess = spawn(BIN, ['start'], { env: n8nEnv(dir, { N8N_PORT: String(port), N8N_LISTEN_ADDRESS: '127.0.0.1' }), cwd: dir, stdio: ['ignore', 'pipe', 'pipe'] });
      let log = '';
      let exited: number | null | undefined;
      const waiters = new Set<() => void>();
      const onData = (c: Buffer) => {
        log += c.toString('utf8');
        for (const w of [...waiters]) w();
      };
      child.stdout!.on('data', onData);
      child.stderr!.on('data', onData);
      const gone = new Promise<void>((r) =>
        child.on('exit', (code) => {
          exited = code;
          for (const w of [...waiters]) w();
          r();
        }),
      );
      const server: N8nServer = {
        url: `http://127.0.0.1:${port}`,
        port,
        log: () => log,
        stop: async () => {
          servers.delete(server);
          if (exited === undefined) {
            child.kill('SIGTERM');
            const timer = setTimeout(() => child.kill('SIGKILL'), 20_000);
            await gone;
            clearTimeout(timer);
          }
        },
      };
      servers.add(server);
      // Ready when it says so: the editor line comes after the active workflows' webhooks are registered.
      await new Promise<void>((resolve, reject) => {
        const timer = setTimeout(() => done(new Error(`n8n start: not ready after 120 s\n${log.slice(-3000)}`)), 120_000);
        const check = () => {
          if (/Editor is now accessible/.test(log)) done();
          else if (exited !== undefined) done(new Error(`n8n start exited ${exited}\n${log.slice(-3000)}`));
        };
        const done = (e?: Error) => {
          clearTimeout(timer);
          waiters.delete(check);
          if (e) reject(e);
          else resolve();
        };
        waiters.add(check);
        check();
      }).catch(async (e) => {
        await server.stop();
        throw e;
      });
      return server;
    },
    close: async () => {
      for (const s of [...servers]) await s.stop();
      await rm(dir, { recursive: true, force: true });
    },
  };
  return self;
}

/** The template `file` of examples/n8n, read as a workflow object. */
export async function readTemplate(file: string): Promise<Record<string, any>> {
  return JSON.parse(await readFile(path.resolve(import.meta.dirname, '../../examples/n8n', file), 'utf8')) as Record<string, any>;
}

/**
 * A template ready to import: `id` set, the base URL replaced by `baseUrl`, each credential
 * reference given the id of the credential of that name, and any further `replace` pairs
 * applied to the JSON text (each must match, so a template change cannot silently void a test).
 */
export function prepare(
  template: Record<string, any>,
  p: { id: string; baseUrl: string; credentialIds: Record<string, string>; replace?: Array<[string, string]> },
): Record<string, any> {
  let text = JSON.stringify(template);
  const all = (s: string, from: string, to: string) => {
    if (!s.includes(from)) throw new Error(`${template.name}: the template has no ${JSON.stringify(from)}`);
    return s.split(from).join(to);
  };
  text = all(text, TEMPLATE_BASE_URL, p.baseUrl);
  for (const [from, to] of p.replace ?? []) text = all(text, JSON.stringify(from).slice(1, -1), JSON.stringify(to).slice(1, -1));
  const w = JSON.parse(text) as Record<string, any>;
  w.id = p.id;
  for (const n of w.nodes as Array<Record<string, any>>) {
    const ref = n.credentials?.httpHeaderAuth as { id: string; name: string } | undefined;
    if (!ref) continue;
    const id = p.credentialIds[ref.name];
    if (!id) throw new Error(`${template.name}: node ${n.name} names credential ${ref.name}, which the test does not provide`);
    ref.id = id;
  }
  return w;
}
