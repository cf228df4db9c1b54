/**
 * `runCommand` on its own, without a coordinator: the moments around a command's start, where an
 * event that comes before its listener is lost for good.
 * - A cancel, revoke or drain that aborts the attempt right after the spawn, while the pid file
 *   is written (on Windows tasklist runs then, for up to seconds), stops the command: before the
 *   fix it was heard only once the pid file was written, so an abort in between was lost and the
 *   command ran to its own end after its attempt was gone.
 * - A pid file that cannot be written does not leave the command running unwatched: it is run,
 *   its result read, and the failure logged.
 * And what a command's end and output mean:
 * - killed by a signal nobody in the agent sent (SIGTERM, SIGKILL…, Windows' Ctrl+C exit code)
 *   it was stopped, not failed: retried;
 * - stdout is read in lines of at most 1 MiB: a longer one is dropped as it comes (a huge line
 *   once crashed the agent), and a last JSON line too long fails the job; a UTF-8 character
 *   split between two writes stays whole, on stdout and in the stderr tail;
 * - lines end at \n, \r\n or a lone \r (progress output), and a UTF-8 byte order mark before a
 *   line (PowerShell) is skipped, as the line reader before did: the result is still found; the
 *   \r of a CRLF does not count toward the cap, and a dropped log line in brackets (`[INFO] …`)
 *   is not taken for a result too long;
 * - a last line without a newline is read even when a process the command left (outside its
 *   group) holds stdout open;
 * - a missing working directory is named as such;
 * - `killRunningCommands` (the runner's exit) kills what still runs, a command ignoring SIGTERM too;
 *   a pid file it cannot remove stops no other kill, and one whose tree it could not list stays.
 */
import { existsSync, readFileSync } from 'node:fs';
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Writable } from 'node:stream';
import pino from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { JobContext, JobError, JobInfo } from '../agent-client/src/context.js';
import { configSchema } from '../agent-client/src/runner/config.js';
import { killRunningCommands, looksLikeJson, MAX_LINE_BYTES, OutputLines, runCommand, stoppedFromOutside, TextTail } from '../agent-client/src/runner/run-command.js';
import { waitFor } from './helpers/coordinator.js';
import { groupAlive } from './helpers/process-group.js';

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
function context(abort: AbortController, attemptId = '01a24a00-0000-7000-8000-0000000000a1'): JobContext {
  return { attempt: { id: attemptId, number: 1 }, signal: abort.signal, idempotencyKey: (s: string) => `${job.id}:${s}` } as unknown as JobContext;
}

/** Runs a node script as the command; resolves with its result, or with the JobError it threw. */
async function runNode(script: string, opts: { log?: ReturnType<typeof logger>['log']; cwd?: string } = {}) {
  const cmd = command({ command: [process.execPath, '-e', script], ...(opts.cwd ? { cwd: opts.cwd } : {}) });
  return runCommand(cmd, job, context(new AbortController()), { log: opts.log ?? logger().log, pidDir: path.join(work, 'pids') }).catch((err: JobError) => ({
    message: err.message,
    retryable: err.retryable,
    details: err.options.details,
  }));
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

describe('how a command ended', () => {
  it('counts a kill nobody in the agent asked for (SIGTERM, SIGINT, SIGKILL, SIGHUP, SIGQUIT, Ctrl+C on Windows) as stopped, not failed', () => {
    for (const sig of ['SIGTERM', 'SIGINT', 'SIGKILL', 'SIGHUP', 'SIGQUIT'] as const) expect(stoppedFromOutside(null, sig), sig).toBe(true);
    for (const sig of ['SIGSEGV', 'SIGABRT', 'SIGBUS'] as const) expect(stoppedFromOutside(null, sig), sig).toBe(false);
    // Windows: STATUS_CONTROL_C_EXIT as Node gives it (unsigned), and the same 32 bits signed.
    expect(stoppedFromOutside(3221225786, null)).toBe(true);
    expect(stoppedFromOutside(-1073741510, null)).toBe(true);
    expect(stoppedFromOutside(1, null)).toBe(false);
    expect(stoppedFromOutside(3221225477, null)).toBe(false); // an access violation is a crash
  });

  it.skipIf(process.platform === 'win32')('retries a command killed from outside, and fails for good one that crashed', async () => {
    const killed = await runNode("process.kill(process.pid, 'SIGTERM'); setTimeout(() => {}, 10000)");
    expect(killed).toMatchObject({ message: 'exited with signal SIGTERM (stopped from outside: retried)', retryable: true, details: { signal: 'SIGTERM', stoppedFromOutside: true } });
    const crashed = await runNode("process.kill(process.pid, 'SIGSEGV'); setTimeout(() => {}, 10000)");
    expect(crashed).toMatchObject({ message: 'exited with signal SIGSEGV', retryable: false });
  }, 20_000);

  it('accepts Windows exit codes (32-bit, unsigned) in retryableExitCodes', () => {
    expect(command({ command: ['x'], retryableExitCodes: [75, 3221225477, 4294967295] }).retryableExitCodes).toEqual([75, 3221225477, 4294967295]);
    expect(() => command({ command: ['x'], retryableExitCodes: [4294967296] })).toThrow();
    expect(() => command({ command: ['x'], retryableExitCodes: [0] })).toThrow();
  });
});

describe('reading the output', () => {
  it('holds at most the line cap of a huge line, drops it, and reads the lines around it', () => {
    const out = new OutputLines(1024);
    out.write(Buffer.from('{"first":1}\n'));
    const chunk = Buffer.alloc(64 * 1024, 'x');
    let most = 0;
    for (let i = 0; i < 640; i++) {
      out.write(chunk); // 40 MiB without a newline
      most = Math.max(most, out.buffered);
    }
    out.write(Buffer.from('\n{"ok":1}\n'));
    out.end();
    expect(most).toBeLessThanOrEqual(1024);
    expect(out).toMatchObject({ discarded: 1, lastJson: { ok: 1 }, resultTooLong: undefined });
  });

  it('marks a last JSON line too long to read (an earlier one is not the result); a long log line is only dropped', () => {
    const json = new OutputLines(100);
    json.write(Buffer.from(`{"small":1}\n{"big":"${'y'.repeat(200)}`));
    json.write(Buffer.from('"}\r\n'));
    json.end();
    expect(json.resultTooLong).toBe(210); // the line without its \r\n
    const log = new OutputLines(100);
    log.write(Buffer.from(`{"small":1}\n[info] ${'y'.repeat(200)} done\n`));
    log.end();
    expect(log).toMatchObject({ discarded: 1, lastJson: { small: 1 }, resultTooLong: undefined });
  });

  /** What OutputLines reads of these writes, with a cap of `max` bytes. */
  const read = (chunks: Array<string | Buffer>, max = MAX_LINE_BYTES) => {
    const out = new OutputLines(max);
    for (const c of chunks) out.write(typeof c === 'string' ? Buffer.from(c) : c);
    out.end();
    return { lastJson: out.lastJson, resultTooLong: out.resultTooLong, discarded: out.discarded };
  };
  const BOM = Buffer.from([0xef, 0xbb, 0xbf]);

  it('skips a UTF-8 byte order mark before a line (PowerShell writes one), whole or split between reads', () => {
    expect(read([Buffer.concat([BOM, Buffer.from('{"a":1}\n')])]).lastJson).toEqual({ a: 1 });
    expect(read([Buffer.from([0xef]), Buffer.concat([BOM.subarray(1), Buffer.from('{"a":1}')])]).lastJson).toEqual({ a: 1 });
    expect(read(['log\n', Buffer.concat([BOM, Buffer.from(' [1,2]\r\n')])]).lastJson).toEqual([1, 2]);
    // The line reader before trimmed with String.prototype.trim: a form feed too.
    expect(read(['\f{"a":1}\n']).lastJson).toEqual({ a: 1 });
  });

  it('ends lines at a lone \\r (progress output) and at \\r\\n once, split between reads or not', () => {
    expect(read(['10%\r20%\r{"a":1}\n']).lastJson).toEqual({ a: 1 });
    expect(read(['10%\r20%\r{"a":1}']).lastJson).toEqual({ a: 1 });
    expect(read(['{"a":1}\r{"b":2}\r']).lastJson).toEqual({ b: 2 });
    expect(read(['{"a":1}\r', '\n', '{"b":2}\r', '\r\n', 'done\r']).lastJson).toEqual({ b: 2 });
    expect(read(['progress\r', '{"c":3}\r\n']).lastJson).toEqual({ c: 3 });
  });

  it('does not count the \\r of a CRLF toward the line cap, split between reads or not', () => {
    const line = '{"a":"12345678"}'; // 16 bytes
    expect(Buffer.byteLength(line)).toBe(16);
    expect(read([`${line}\r\n`], 16)).toEqual({ lastJson: { a: '12345678' }, resultTooLong: undefined, discarded: 0 });
    expect(read([`${line}\r`, '\n'], 16)).toEqual({ lastJson: { a: '12345678' }, resultTooLong: undefined, discarded: 0 });
    expect(read([line.slice(0, 10), `${line.slice(10)}\r\n{"b":1}\r\n`], 16)).toMatchObject({ lastJson: { b: 1 }, discarded: 0 });
  });

  it('takes a dropped line for a result too long only when it looks like JSON, not a log line in brackets', () => {
    const pad = 'y'.repeat(200);
    for (const log of [`[INFO] ${pad} [done]`, `[2024-05-01 10:00:00] ${pad} [x]`, `[12:00:01] ${pad}]`, `[trace] ${pad}]`, `[ 1.5.2 ] ${pad}]`]) {
      expect(read(['{"b":1}\n', `${log}\n`], 100), log).toEqual({ lastJson: { b: 1 }, resultTooLong: undefined, discarded: 1 });
    }
    for (const json of [`[{"a":"${pad}"}]`, `[ "${pad}" ]`, `[1, ${'2, '.repeat(80)}3]`, `[-1.5e3,${'0,'.repeat(80)}0]`, `[true, ${'null, '.repeat(40)}false]`, `[[${'[],'.repeat(60)}[]]]`, `{"a":"${pad}"}`]) {
      const bytes = Buffer.concat([BOM, Buffer.from(` ${json}\r\n`)]);
      expect(read(['{"b":1}\n', bytes], 100).resultTooLong, json).toBe(bytes.length - 2);
    }
    expect([looksLikeJson(Buffer.from('[]')), looksLikeJson(Buffer.from('[INFO]')), looksLikeJson(Buffer.from('\t{')), looksLikeJson(Buffer.from('[2024-05-01]'))]).toEqual(['[', undefined, '{', undefined]);
  });

  it('keeps a UTF-8 character split between two reads whole, on stdout and in the stderr tail', () => {
    const bytes = Buffer.from('{"word":"Grüße 👋"}\n', 'utf8');
    const out = new OutputLines();
    const tail = new TextTail();
    for (let i = 0; i < bytes.length; i++) {
      out.write(bytes.subarray(i, i + 1)); // byte by byte: every character split
      tail.write(bytes.subarray(i, i + 1));
    }
    out.end();
    tail.end();
    expect(out.lastJson).toEqual({ word: 'Grüße 👋' });
    expect(tail.text).toBe('{"word":"Grüße 👋"}\n');
    // The tail cut in the middle of a surrogate pair drops the half.
    const short = new TextTail(2);
    short.write(Buffer.from('a👋b', 'utf8'));
    expect(short.text).toBe('b');
  });
});

describe.skipIf(process.platform === 'win32')('runCommand output', () => {
  it('completes a command that writes a 40 MB line then its result: the line dropped, counted in the log', async () => {
    const { log, lines } = logger();
    const result = await runNode(
      "const chunk = 'x'.repeat(1 << 20); let n = 40; const more = () => { while (n > 0) { n--; if (!process.stdout.write(chunk)) return process.stdout.once('drain', more); } process.stdout.write('\\n' + JSON.stringify({ ok: 1 }) + '\\n'); }; more();",
      { log },
    );
    expect(result).toEqual({ ok: 1 });
    expect(lines.find((l) => l.msg === 'command ended')).toMatchObject({ code: 0, discardedLines: 1 });
    expect(lines.find((l) => l.msg === 'dropped stdout lines longer than the limit')).toMatchObject({ lines: 1, maxBytes: MAX_LINE_BYTES });
  }, 60_000);

  it('fails the job for good when its last JSON line is over the cap, rather than return an earlier one', async () => {
    const err = await runNode(`console.log(JSON.stringify({ early: true })); console.log(JSON.stringify({ big: 'z'.repeat(${MAX_LINE_BYTES}) }))`);
    expect(err).toMatchObject({ retryable: false, details: { resultBytes: MAX_LINE_BYTES + 10 } });
    expect(err.message).toMatch(/^result too long: the last JSON line on stdout has 1048586 bytes, over the limit of 1048576/);
  }, 20_000);

  it('keeps a UTF-8 character the command wrote in two halves whole, on stdout and in stderr', async () => {
    // 'é' is 0xC3 0xA9: the halves go out in two writes, the second once the first was flushed.
    const result = await runNode(
      "const e = Buffer.from('é'); process.stdout.write('{\"w\":\"'); process.stdout.write(e.subarray(0, 1), () => setTimeout(() => { process.stdout.write(Buffer.concat([e.subarray(1), Buffer.from('\"}\\n')])); process.stderr.write(e.subarray(0, 1), () => setTimeout(() => process.stderr.write(e.subarray(1), () => process.exit(3)), 100)); }, 100));",
    );
    expect(result).toMatchObject({ message: 'exited with code 3: é', details: { exitCode: 3 } });
    expect(result.details).not.toHaveProperty('stderr'); // once, in the message (runner-report-limits.test.ts)
    const ok = await runNode("const e = Buffer.from('ü'); process.stdout.write(Buffer.concat([Buffer.from('{\"w\":\"'), e.subarray(0, 1)]), () => setTimeout(() => process.stdout.write(Buffer.concat([e.subarray(1), Buffer.from('\"}\\n')])), 100));");
    expect(ok).toEqual({ w: 'ü' });
  }, 20_000);

  it('reads a result after progress output and a byte order mark, its line ended by a lone \\r', async () => {
    const result = await runNode("process.stdout.write(Buffer.concat([Buffer.from('10%\\r20%\\r'), Buffer.from([0xef, 0xbb, 0xbf]), Buffer.from('{\"a\":1}\\r')]))");
    expect(result).toEqual({ a: 1 });
  }, 20_000);

  it.skipIf(process.platform !== 'linux')('reads a last line without a newline while a process outside the group holds stdout open', async () => {
    // The command leaves a sleep in a session of its own (outside the group killed at its exit)
    // that inherits stdout; once the sleep's pid file says it has left the group, the command
    // prints its result without a newline and exits.
    const pidOut = path.join(work, 'holder.pid');
    const script = `setsid sh -c 'echo $$ > "$0.tmp" && mv "$0.tmp" "$0" && exec sleep 30' '${pidOut}' & while [ ! -e '${pidOut}' ]; do sleep 0.01; done; printf '{"a":1}'`;
    const cmd = command({ command: ['/bin/sh', '-c', script] });
    const t0 = Date.now();
    try {
      const result = await runCommand(cmd, job, context(new AbortController()), { log: logger().log, pidDir: path.join(work, 'pids') });
      expect(result).toEqual({ a: 1 });
      expect(Date.now() - t0).toBeLessThan(20_000); // read after the 2 s wait for the pipes, not at the sleep's end
      expect(() => process.kill(Number(readFileSync(pidOut, 'utf8')), 0)).not.toThrow(); // it held stdout all along
    } finally {
      try {
        process.kill(Number(readFileSync(pidOut, 'utf8')), 'SIGKILL');
      } catch {
        // gone
      }
    }
  }, 40_000);

  it('says the working directory is missing, not the command', async () => {
    const cwd = path.join(work, 'no such dir');
    const err = await runNode('1', { cwd });
    expect(err).toMatchObject({ retryable: false });
    expect(err.message).toBe(`cannot start ${JSON.stringify(process.execPath)}: ENOENT: its working directory (cwd) ${JSON.stringify(cwd)} does not exist`);
  }, 20_000);
});

describe.skipIf(process.platform !== 'linux')('killRunningCommands (the runner exiting)', () => {
  it('kills a running command that ignores SIGTERM, with its group, and removes its pid file', async () => {
    const { log, lines } = logger();
    const pidDir = path.join(work, 'pids-exit');
    const cmd = command({ command: ['/bin/sh', '-c', 'trap "" TERM; sleep 60 & wait'], killGrace: '60s' });
    const attemptId = '01a24a00-0000-7000-8000-0000000000e1';
    const running = runCommand(cmd, job, context(new AbortController(), attemptId), { log, pidDir }).catch((err: JobError) => ({ message: err.message, retryable: err.retryable }));
    const started = await waitFor('command started', () => lines.find((l) => l.msg === 'command started'));
    const pid = started.pid as number;
    try {
      expect(groupAlive(pid)).toBe(true);
      expect(existsSync(path.join(pidDir, `${attemptId}.json`))).toBe(true);
      expect(killRunningCommands()).toEqual([pid]);
      expect(existsSync(path.join(pidDir, `${attemptId}.json`))).toBe(false);
      await waitFor('the group gone', () => !groupAlive(pid), 5000);
      expect(await running).toMatchObject({ message: 'exited with signal SIGKILL (stopped from outside: retried)', retryable: true });
      expect(killRunningCommands()).toEqual([]);
    } finally {
      try {
        process.kill(-pid, 'SIGKILL'); // what a failed run left behind
      } catch {
        // gone, as it should be
      }
      await running;
    }
  }, 20_000);

  it('kills the next command when a pid file cannot be removed, and never throws', async () => {
    const { log, lines } = logger();
    const pidDir = path.join(work, 'pids-exit-busy');
    const [first, second] = ['01a24a00-0000-7000-8000-0000000000f1', '01a24a00-0000-7000-8000-0000000000f2'];
    // The first command's pid file path is a directory with a file in it: rmSync throws for it
    // (as it does on Windows for a file an antivirus holds, EPERM/EBUSY).
    await mkdir(path.join(pidDir, `${first}.json`, 'busy'), { recursive: true });
    const cmd = command({ command: [process.execPath, '-e', 'setTimeout(() => {}, 60000)'] });
    const runs: Promise<unknown>[] = [];
    const pids: number[] = [];
    try {
      for (const attemptId of [first, second]) {
        runs.push(runCommand(cmd, job, context(new AbortController(), attemptId), { log, pidDir }).catch((err: JobError) => ({ message: err.message })));
        const started = await waitFor('command started', () => lines.find((l) => l.msg === 'command started' && l.attemptId === attemptId));
        pids.push(started.pid as number);
      }
      expect(existsSync(path.join(pidDir, `${second}.json`))).toBe(true);
      let killed: number[] = [];
      expect(() => (killed = killRunningCommands())).not.toThrow();
      expect(killed).toEqual(pids);
      expect(existsSync(path.join(pidDir, `${second}.json`))).toBe(false);
      await waitFor('both groups gone', () => pids.every((p) => !groupAlive(p)), 5000);
    } finally {
      for (const p of pids) {
        try {
          process.kill(-p, 'SIGKILL');
        } catch {
          // gone, as it should be
        }
      }
      await Promise.all(runs);
    }
  }, 20_000);

  it('keeps the pid file of a Windows command whose tree could not be listed, for the next start', async () => {
    // Here, as on a Windows without taskkill /T, wmic or PowerShell: the command itself is
    // killed, what it started is unknown, so its pid file stays for killLeftover.
    const { log, lines } = logger();
    const pidDir = path.join(work, 'pids-exit-unlisted');
    const attemptId = '01a24a00-0000-7000-8000-0000000000f3';
    const cmd = command({ command: [process.execPath, '-e', 'setTimeout(() => {}, 60000)'] });
    const running = runCommand(cmd, job, context(new AbortController(), attemptId), { log, pidDir }).catch((err: JobError) => ({ message: err.message }));
    const pid = (await waitFor('command started', () => lines.find((l) => l.msg === 'command started'))).pid as number;
    try {
      expect(killRunningCommands('win32')).toEqual([pid]);
      expect(existsSync(path.join(pidDir, `${attemptId}.json`))).toBe(true);
      expect(await running).toMatchObject({ message: 'exited with signal SIGKILL (stopped from outside: retried)' });
    } finally {
      try {
        process.kill(-pid, 'SIGKILL');
      } catch {
        // gone, as it should be
      }
      await running;
    }
  }, 20_000);
});
