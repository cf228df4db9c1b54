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

/**
 * Starts `node --import tsx server/cli.ts <args>` with `env` added to this process's. With
 * `group`, in a process group of its own, as a shell runs a foreground command: a signal to
 * `-pid` then reaches it and everything it started, as Ctrl-C in a terminal does.
 */
export function serve(args: string[], env: Record<string, string>, opts: { group?: boolean } = {}): Proc {
  const child = spawn(process.execPath, ['--import', 'tsx', 'server/cli.ts', ...args], {
    cwd: root,
    env: { ...process.env, LEASEHOLD_LOG_FORMAT: 'json', LEASEHOLD_LOG_LEVEL: 'info', ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
    detached: Boolean(opts.group),
  });
  children.add(child);
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
  return {
    child,
    lines,
    exited,
    waitFor: (re) =>
      new Promise((resolve, reject) => {
        const hit = lines.find((l) => re.test(String(l.msg)));
        if (hit) return resolve(hit);
        waiters.push({ re, resolve });
        void exited.then(({ code }) => reject(new Error(`exited (${code}) before ${re}: ${JSON.stringify(lines.slice(-8))}`)));
      }),
  };
}

/** SIGKILLs every child still running. */
export function killAll(): void {
  for (const c of children) c.kill('SIGKILL');
}
