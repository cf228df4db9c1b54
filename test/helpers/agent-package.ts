/**
 * @leasehold/agent-client as a user gets it: packed with `npm pack` in agent-client/ (prepack
 * compiles it) and installed with `npm install <tgz>` into an empty folder outside the
 * repository. Also the single-file agent of `npm run build:agent`.
 */
import { execFile } from 'node:child_process';
import { mkdir, rm, stat } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';

const run = promisify(execFile);
export const root = path.resolve(import.meta.dirname, '../..');

/** This process's environment without the npm_* settings of the run that started the tests. */
export function cleanEnv(): NodeJS.ProcessEnv {
  const env = { ...process.env };
  for (const k of Object.keys(env)) if (k.startsWith('npm_')) delete env[k];
  return env;
}

/** npm with output captured, in a clean environment (`cleanEnv`). */
export function npm(args: string[], cwd: string) {
  return run('npm', args, { cwd, env: cleanEnv(), maxBuffer: 16 << 20 });
}

/**
 * Packs the agent package into `dir`; returns the tarball's path and the files it holds. One pack
 * at a time on this machine: `prepack` empties and rebuilds agent-client/dist, so two test files
 * packing at once (they run in parallel) could each pack the other's half-built dist.
 */
export async function packAgent(dir: string): Promise<{ tgz: string; files: string[] }> {
  const release = await lock(path.join(os.tmpdir(), 'leasehold-agent-pack.lock'));
  try {
    const { stdout } = await npm(['pack', '--json', '--pack-destination', dir], path.join(root, 'agent-client'));
    const packed = JSON.parse(stdout) as { filename: string; files: { path: string }[] }[];
    return { tgz: path.join(dir, packed[0]!.filename), files: packed[0]!.files.map((f) => f.path) };
  } finally {
    await release();
  }
}

/**
 * A lock between processes: a directory made with `mkdir`, which fails for all but one. One left
 * by a killed test run is taken over once it is older than any pack takes (5 minutes).
 */
async function lock(dir: string): Promise<() => Promise<void>> {
  const deadline = Date.now() + 600_000;
  for (;;) {
    try {
      await mkdir(dir);
      return () => rm(dir, { recursive: true, force: true });
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err;
      const age = await stat(dir).then((s) => Date.now() - s.mtimeMs, () => 0);
      if (age > 300_000) await rm(dir, { recursive: true, force: true });
      else if (Date.now() > deadline) throw new Error(`${dir} is held for over 10 minutes`);
      else await new Promise((r) => setTimeout(r, 200));
    }
  }
}

/** `npm install <tgz> [extra…]` in `app`, an empty folder (made if missing), as docs/agent.md says. */
export async function installAgent(app: string, tgz: string, extra: string[] = []): Promise<void> {
  await mkdir(app, { recursive: true });
  await npm(['install', '--no-audit', '--no-fund', tgz, ...extra], app);
}

/** Writes the single-file agent (`npm run build:agent`) to `file`. */
export async function buildSingleFileAgent(file: string): Promise<void> {
  await npm(['run', '-s', 'build:agent', '--', file], root);
}
