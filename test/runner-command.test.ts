/**
 * `runCommand` on its own, without a coordinator: the moments around a command's start, where an
 * event that comes before its listener is lost for good.
 * - A cancel, revoke or drain that aborts the attempt right after the spawn, while the pid file
 *   is written (on Windows tasklist runs then, for up to seconds), stops the command: before the
 *   fix it was heard only once the pid file was written, so an abort in between was lost and the
 *   command ran to its own end after its attempt was gone.
 * - A pid file that cannot be written does not leave the command running unwatched: it is run,
 *   its result read, and the failure logged.
 */
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Writable } from 'node:stream';
import pino from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { JobContext, JobInfo } from '../agent-client/src/context.js';
import { configSchema } from '../agent-client/src/runner/config.js';
import { runCommand } from '../agent-client/src/runner/run-command.js';

let work = '';
beforeAll(async () => {
  work = await mkdtemp(path.join(os.tmpdir(), 'leasehold-run-command-'));
});
afterAll(async () => {
  if (work) await rm(work, { recursive: true, force: true });
});

/** A logger whose lines are kept, parsed. */
function logger() {
  const lines: Array<Record<string, unknown>> = [];
  const out = new Writable({
    write(chunk: Buffer, _enc, cb) {
      for (const l of chunk.toString('utf8').split('\n').filter(Boolean)) lines.push(JSON.parse(l) as Record<string, unknown>);
      cb();
    },
  });
  return { log: pino({ level: 'info' }, out), lines };
}

/** A queue's command as the configuration gives it (defaults applied). */
function command(cmd: Record<string, unknown>) {
  return configSchema.parse({ url: 'http://127.0.0.1:1', token: 't', queues: { q: cmd } }).queues.q!;
}

const job: JobInfo = { id: '01a24a00-0000-7000-8000-000000000001', queue: 'q', payload: { a: 1 }, priority: 0, attemptNo: 1, labels: {} };

/** What runCommand reads of a context: the attempt, its signal and the idempotency key. */
function context(abort: AbortController): JobContext {
  return { attempt: { id: '01a24a00-0000-7000-8000-0000000000a1', number: 1 }, signal: abort.signal, idempotencyKey: (s: string) => `${job.id}:${s}` } as unknown as JobContext;
}

describe.skipIf(process.platform === 'win32')('runCommand around the start', () => {
  it('stops the command when the attempt is aborted right after the spawn, before the pid file is written', async () => {
    const { log } = logger();
    const abort = new AbortController();
    const cmd = command({ command: [process.execPath, '-e', 'setTimeout(() => {}, 30000)'], killGrace: '200ms' });
    const t0 = Date.now();
    const running = runCommand(cmd, job, context(abort), { log, pidDir: path.join(work, 'pids') });
    // runCommand spawned synchronously and now waits for the spawn event: the abort comes now.
    abort.abort(new Error('canceled by an operator'));
    await expect(running).rejects.toMatchObject({ message: 'canceled by an operator', retryable: true });
    expect(Date.now() - t0).toBeLessThan(10_000);
  }, 20_000);

  it('runs and reads a command whose pid file cannot be written, and logs why', async () => {
    const { log, lines } = logger();
    const notADir = path.join(work, 'a file');
    await writeFile(notADir, '');
    const cmd = command({ command: [process.execPath, '-e', 'console.log(JSON.stringify({ ok: true }))'] });
    const result = await runCommand(cmd, job, context(new AbortController()), { log, pidDir: path.join(notADir, 'pids') });
    expect(result).toEqual({ ok: true });
    expect(lines.find((l) => l.msg === 'could not write the pid file')).toBeDefined();
  }, 20_000);
});
