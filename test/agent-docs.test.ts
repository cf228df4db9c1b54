/**
 * docs/agent.md as a new user meets it: the Linux block pasted whole into a shell (with the
 * coordinator of the test instead of `npm start`, and a home directory of its own) registers an
 * agent, checks it, runs a job through the user's own command and prints the result. The WinSW
 * template is checked for the paths the guide tells the user to keep in step.
 */
import { execFile } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { afterAll, expect, it } from 'vitest';
import { useTestDb } from './helpers/db.js';
import { useCoordinator } from './helpers/coordinator.js';

const run = promisify(execFile);
const root = path.resolve(import.meta.dirname, '..');
const guide = readFileSync(path.join(root, 'docs/agent.md'), 'utf8');
const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_ADMIN_KEY: 'dev-admin-key' });
let home: string | undefined;
afterAll(async () => {
  if (home) await rm(home, { recursive: true, force: true });
});

it('the Linux walk-through of docs/agent.md runs as pasted', async () => {
  const blocks = [...guide.matchAll(/```sh\n([\s\S]*?)```/g)].map((m) => m[1]!);
  const walk = blocks.find((b) => b.includes('npx leasehold-agent --config ~/leasehold-demo/agent.json --check'))!;
  expect(walk).toBeDefined();
  home = await mkdtemp(path.join(os.tmpdir(), 'leasehold-home-'));
  // Only the ports differ from what a user pastes: the test's coordinator listens on free ones.
  const script = walk.replaceAll('127.0.0.1:50051', `127.0.0.1:${lh.port}`).replaceAll('http://127.0.0.1:8080', lh.httpUrl);
  expect(script).toContain(lh.httpUrl);
  const { stdout, stderr } = await run('bash', ['-e', '-c', script], {
    cwd: root,
    env: { ...process.env, HOME: home, LEASEHOLD_LOG_LEVEL: 'warn', PATH: `${path.join(root, 'node_modules/.bin')}:${process.env.PATH}` },
    timeout: 120_000,
  });
  expect(stdout).toMatch(/config ok: 1 queue\(s\), 2 slot\(s\)/);
  // The guide makes the file that holds the token its user's alone.
  expect(stdout).not.toMatch(/can be read by other users/);
  expect(stdout).toMatch(/coordinator ok/);
  expect(stdout, stderr).toMatch(/job [0-9a-f-]{36}: JOB_STATUS_SUCCEEDED \{"sum":42\}/);
}, 150_000);

it('the WinSW template runs the installed package\'s bin with the guide\'s configuration path, and drains on stop', () => {
  const xml = readFileSync(path.join(root, 'examples/windows/leasehold-agent.xml'), 'utf8');
  for (const tag of ['id', 'executable', 'arguments', 'workingdirectory', 'stoptimeout', 'logpath']) {
    expect(xml, tag).toMatch(new RegExp(`<${tag}>[^<]+</${tag}>`));
  }
  // The package installed in C:\leasehold (test/agent-wine.test.ts runs these arguments under Wine).
  expect(xml).toMatch(/<arguments>"C:\\leasehold\\node_modules\\@leasehold\\agent-client\\bin\\leasehold-agent\.mjs" --config "C:\\leasehold\\agent\.json"<\/arguments>/);
  expect(guide).toContain('C:\\leasehold\\agent.json');
  // A stop drains: WinSW 2.x stops the children before node unless told otherwise, and waits
  // longer than the agent's default grace (30 s) before killing node.
  expect(xml).toMatch(/<stopparentprocessfirst>true<\/stopparentprocessfirst>/);
  const stop = /<stoptimeout>(\d+) sec<\/stoptimeout>/.exec(xml);
  expect(Number(stop?.[1])).toBeGreaterThan(30);
  // Balanced tags: every element opened is closed.
  const open = [...xml.replace(/<!--[\s\S]*?-->/g, '').matchAll(/<(\/?)([a-zA-Z]+)[^>]*?(\/?)>/g)];
  const stack: string[] = [];
  for (const [, close, name, self] of open) {
    if (self) continue;
    if (close) expect(stack.pop()).toBe(name);
    else stack.push(name!);
  }
  expect(stack).toEqual([]);
});
