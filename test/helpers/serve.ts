/**
 * `leasehold serve` as a real child process (as `npm start` runs it: one node process with the
 * tsx loader, so a signal reaches the coordinator itself), with its JSON log lines collected.
 * `afterEach` of the caller should `killAll()`.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import path from 'node:path';
import { createInterface } from 'node:readline';

export const root = path.resolve(import.meta.dirname, '../..');

export interface Proc {
  child: ChildProcess;
  lines: Array<Record<string, unknown>>;
  /** Resolves with the first log line whose msg matches (rejects if the process exits first). */
  waitFor(msg: RegExp): Promise<Record<string, unknown>>;
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
}

const children = new Set<ChildProcess>();
const groups = new Set<number>();

/**
 * Starts `node --import tsx server/cli.ts <args>` with `env` added to this process's. With
 * `group`, in a process group of its own, as a shell runs a foreground command: a signal to
 * `-pid` then reaches it and everything it started, as Ctrl-C in a terminal does.
 */
export function serve(args: string[], env: Record<string, string>, opts: { group?: boolean; npm?: boolean } = {}): Proc {
  // With `npm`: `npm start -- <args after serve>`, as a user runs it (npm, its shell, then node).
  const [file, argv] = opts.npm
    ? [process.platform === 'win32' ? 'npm.cmd' : 'npm', ['start', '--', ...args.filter((a) => a !== 'serve')]]
    : [process.execPath, ['--import', 'tsx', 'server/cli.ts', ...args]];
  const child = spawn(file, argv, {
    cwd: root,
    env: { ...process.env, LEASEHOLD_LOG_FORMAT: 'json', LEASEHOLD_LOG_LEVEL: 'info', ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
    // npm in a group of its own too, so that a failed test can kill what it started.
    detached: Boolean(opts.group || opts.npm),
    shell: Boolean(opts.npm) && process.platform === 'win32',
  });
  children.add(child);
  if (opts.npm) groups.add(child.pid!);
  const lines: Array<Record<string, unknown>> = [];
  const waiters: Array<{ re: RegExp; resolve: (l: Record<string, unknown>) => void }> = [];
  const onLine = (text: string) => {
    let l: Record<string, unknown>;
    try {
      l = JSON.parse(text) as Record<string, unknown>;
    } catch {
      l = { msg: text };
    }
    lines.push(l);
    for (const w of [...waiters]) {
      if (w.re.test(String(l.msg))) {
        waiters.splice(waiters.indexOf(w), 1);
        w.resolve(l);
      }
    }
  };
  createInterface({ input: child.stdout! }).on('line', onLine);
  createInterface({ input: child.stderr! }).on('line', onLine);
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) =>
    child.on('exit', (code, signal) => {
      children.delete(child);
      resolve({ code, signal });
    }),
  );
  // Output ends when every process writing it has ended (under npm, the coordinator after npm).
  const closed = new Promise<void>((resolve) => child.on('close', () => resolve()));
  return {
    child,
    lines,
    exited,
    waitFor: (re) =>
      new Promise((resolve, reject) => {
        const hit = lines.find((l) => re.test(String(l.msg)));
        if (hit) return resolve(hit);
        waiters.push({ re, resolve });
        void closed.then(() => reject(new Error(`output ended before ${re}: ${JSON.stringify(lines.slice(-8))}`)));
      }),
  };
}

/** SIGKILLs every child still running. */
export function killAll(): void {
  for (const c of children) c.kill('SIGKILL');
  for (const g of groups) {
    try {
      process.kill(-g, 'SIGKILL');
    } catch {
      // the group is gone
    }
  }
  groups.clear();
}
