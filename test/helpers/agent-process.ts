/**
 * Real agent processes for crash tests: the SDK fixture (test/fixtures/sdk-agent.ts), bundled
 * once with esbuild so each start takes a fraction of a second (the tests start dozens), spawned
 * with node, its JSON log lines collected, killable at any moment.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { createInterface } from 'node:readline';
import { build } from 'esbuild';

const root = path.resolve(import.meta.dirname, '../..');
let bundle: Promise<string> | undefined;

/**
 * Builds the fixture agent into one file (once per test process) and returns its path: in a
 * directory of its own, removed when the process exits (the chaos run) or, under vitest, with the
 * run's files directory (global-setup.ts). It was 1.3 MB a test process left in the temporary
 * directory.
 */
export function agentBundle(): Promise<string> {
  bundle ??= (async () => {
    const dir = mkdtempSync(path.join(process.env.LEASEHOLD_TEST_TMP ?? os.tmpdir(), 'leasehold-sdk-agent-'));
    process.once('exit', () => rmSync(dir, { recursive: true, force: true }));
    const outfile = path.join(dir, 'agent.mjs');
    await build({
      entryPoints: [path.join(root, 'test/fixtures/sdk-agent.ts')],
      bundle: true,
      platform: 'node',
      format: 'esm',
      target: 'node20',
      outfile,
      // CommonJS dependencies (grpc-js) call require(): give the ES module one.
      banner: { js: "import { createRequire as __lhRequire } from 'node:module'; const require = __lhRequire(import.meta.url);" },
      logLevel: 'warning',
    });
    return outfile;
  })();
  return bundle;
}

export interface AgentProcess {
  child: ChildProcess;
  lines: Array<Record<string, unknown>>;
  /** Resolves with the first line (from now or earlier) for which `match` is true. */
  waitFor(match: (l: Record<string, unknown>) => boolean, ms?: number): Promise<Record<string, unknown>>;
  /** Calls `fn` on every line from now on. */
  onLine(fn: (l: Record<string, unknown>) => void): void;
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  kill(): Promise<void>;
}

/** Starts the fixture agent from `bundlePath` (see `agentBundle()`) with `env`. */
export function spawnAgent(bundlePath: string, env: Record<string, string>): AgentProcess {
  const child = spawn(process.execPath, [bundlePath], {
    cwd: root,
    env: { ...process.env, LEASEHOLD_LOG_LEVEL: 'debug', ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  const lines: Array<Record<string, unknown>> = [];
  const listeners: Array<(l: Record<string, unknown>) => void> = [];
  const onLine = (text: string) => {
    let l: Record<string, unknown>;
    try {
      l = JSON.parse(text) as Record<string, unknown>;
    } catch {
      l = { msg: text };
    }
    lines.push(l);
    for (const f of [...listeners]) f(l);
  };
  createInterface({ input: child.stdout! }).on('line', onLine);
  createInterface({ input: child.stderr! }).on('line', onLine);
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) => child.on('exit', (code, signal) => resolve({ code, signal })));
  return {
    child,
    lines,
    exited,
    onLine: (fn) => listeners.push(fn),
    waitFor: (match, ms = 20_000) =>
      new Promise((resolve, reject) => {
        const hit = lines.find(match);
        if (hit) return resolve(hit);
        const t = setTimeout(() => reject(new Error(`agent process: no matching line within ${ms} ms; last: ${JSON.stringify(lines.slice(-5))}`)), ms);
        listeners.push((l) => {
          if (match(l)) {
            clearTimeout(t);
            resolve(l);
          }
        });
        exited.then(({ code, signal }) => {
          clearTimeout(t);
          reject(new Error(`agent process exited (${code ?? signal}) before the line; last: ${JSON.stringify(lines.slice(-5))}`));
        });
      }),
    kill: async () => {
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
      await exited;
    },
  };
}
