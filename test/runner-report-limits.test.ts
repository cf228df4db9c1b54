/**
 * What `leasehold-agent` reports of a command, whatever the command wrote: the report must fit
 * the coordinator's limits (an error of at most 16 KiB of JSON, no NUL character, no lone
 * surrogate), or the coordinator refuses it and the job, failed for good, is run again and again
 * until it is dead with a generic message (review-pc finding 2). And what it takes for a result
 * (finding 6), and the pid file a full disk leaves (finding 7).
 * - stderr of 800 lines of CJK text (3 bytes a character), with NUL bytes, in UTF-16LE (a Windows
 *   tool: a NUL every other byte), with or without a byte order mark, ANSI-coloured, or any bytes
 *   at all: the failure carries the end of stderr, readable, once, within 4 KiB of UTF-8; its
 *   JSON stays under the limit. Against a real coordinator: one attempt, the job FAILED with the
 *   stderr, no report refused.
 * - the last JSON-looking line on stdout that does not parse (a Windows path with unescaped
 *   backslashes) fails the job for good, naming the parse error and the line's start, rather than
 *   let an earlier JSON line be the result; a log line starting with a bracket is still no result.
 * - a pid file whose write fails (ENOSPC) is removed, not left empty.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { lstat, mkdir, mkdtemp, rm, symlink, writeFile } from 'node:fs/promises';
import { existsSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { createInterface } from 'node:readline';
import { Writable } from 'node:stream';
import fc from 'fast-check';
import pino from 'pino';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import type { JobContext, JobError, JobInfo } from '../agent-client/src/context.js';
import { configSchema } from '../agent-client/src/runner/config.js';
import { OutputLines, runCommand } from '../agent-client/src/runner/run-command.js';
import { STDERR_TAIL_BYTES, TextTail } from '../agent-client/src/runner/stderr-tail.js';
import { limits } from '../server/domain/validation.js';
import { jobCancel, jobEnqueue } from '../server/store/index.js';
import { until, useCoordinator } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';

const root = path.resolve(import.meta.dirname, '..');
const bin = path.join(root, 'agent-client/bin/leasehold-agent.mjs');
let work = '';
beforeAll(async () => {
  work = await mkdtemp(path.join(os.tmpdir(), 'leasehold-report-limits-'));
});
afterAll(async () => {
  if (work) await rm(work, { recursive: true, force: true });
});

/** The report's `error` as the SDK builds it from a JobError (assignments.ts), and its size in JSON. */
function report(err: { message: string; details?: Record<string, unknown> }) {
  const error = { message: err.message, ...(err.details ? { details: err.details } : {}) };
  const json = JSON.stringify(error);
  return { error, json, bytes: Buffer.byteLength(json, 'utf8') };
}

/** What the coordinator checks of an error (server/domain/validation.ts): size, NUL, lone surrogates. */
function expectAccepted(err: { message: string; details?: Record<string, unknown> }) {
  const r = report(err);
  expect(r.bytes).toBeLessThanOrEqual(limits.errorBytes);
  expect(r.json).not.toContain('\\u0000');
  expect(r.json.isWellFormed()).toBe(true);
  // The stderr once: not again in the details when the message holds it.
  expect(err.details?.stderr).toBeUndefined();
  return r;
}

/** Commands as node scripts that write stderr and exit 3. */
const scripts = {
  cjk: "for (let i = 1; i <= 800; i++) process.stderr.write(`第${i}行：系统找不到指定的文件。\\n`); process.exitCode = 3;",
  nul: "for (let i = 1; i <= 2000; i++) process.stderr.write(`bad\\u0000byte ${i}\\n`); process.stderr.write('the end\\u0000!\\n'); process.exitCode = 3;",
  utf16: "process.stderr.write(Buffer.from('Zugriff verweigert.\\r\\n'.repeat(900) + 'Fehler 5: Ende\\r\\n', 'utf16le')); process.exitCode = 3;",
  utf16bom: "process.stderr.write(Buffer.concat([Buffer.from([0xff, 0xfe]), Buffer.from('系统找不到指定的文件。\\r\\n'.repeat(900) + '错误 5：结束\\r\\n', 'utf16le')])); process.exitCode = 3;",
  ansi: "for (let i = 1; i <= 3000; i++) process.stderr.write(`\\x1b[31;1mERROR\\x1b[0m \\x1b]0;title\\x07\\x1b[2K line ${i}\\r\\n`); process.exitCode = 3;",
} as const;
/** How each stderr above ends, as the report must show it. */
const ends: Record<keyof typeof scripts, string> = {
  cjk: '第799行：系统找不到指定的文件。\n第800行：系统找不到指定的文件。',
  nul: 'bad\uFFFDbyte 2000\nthe end\uFFFD!',
  utf16: 'Zugriff verweigert.\nFehler 5: Ende',
  utf16bom: '系统找不到指定的文件。\n错误 5：结束',
  ansi: 'ERROR  line 2999\nERROR  line 3000',
};

describe('the stderr tail', () => {
  const tailOf = (...chunks: Buffer[]) => {
    const t = new TextTail();
    for (const c of chunks) t.write(c);
    t.end();
    return t.text;
  };

  it('keeps the last 4 KiB of UTF-8, not 4096 characters', () => {
    const text = tailOf(Buffer.from('系统找不到指定的文件。\n'.repeat(800)));
    expect(Buffer.byteLength(text)).toBeLessThanOrEqual(STDERR_TAIL_BYTES);
    expect(Buffer.byteLength(text)).toBeGreaterThan(STDERR_TAIL_BYTES - 40);
    expect(text.endsWith('系统找不到指定的文件。\n')).toBe(true);
  });

  it('decodes UTF-16LE by its NULs, with its byte order mark, and cut at an odd offset of the stream', () => {
    expect(tailOf(Buffer.from('E\0r\0r\0o\0r\0'))).toBe('Error');
    const long = Buffer.from(`${'x'.repeat(99_999)}Ende\n`, 'utf16le');
    // Written in odd-sized chunks, so the kept window starts inside a character.
    const chunks = Array.from({ length: Math.ceil(long.length / 4097) }, (_, i) => long.subarray(i * 4097, (i + 1) * 4097));
    expect(tailOf(...chunks).endsWith('xxEnde\n')).toBe(true);
    expect(tailOf(Buffer.from([0xff, 0xfe]), Buffer.from('文件。\n', 'utf16le'))).toBe('文件。\n');
  });

  it('strips colours and replaces control characters; a surrogate pair is never cut', () => {
    expect(tailOf(Buffer.from('\x1b[1;31mred\x1b[0m \x1b]0;t\x07ok\x07\x00\r\n'))).toBe('red ok\uFFFD\uFFFD\n');
    const t = new TextTail(5);
    t.write(Buffer.from('ab👋c', 'utf8'));
    expect(t.text).toBe('👋c');
  });

  it('whatever the bytes, fits the coordinator: under the limit as JSON, no NUL, well-formed', () => {
    const piece = fc.oneof(
      fc.uint8Array({ maxLength: 3000 }).map((a) => Buffer.from(a)),
      fc.constantFrom('系统', '\x1b[31m', '\0', '\r\n', '"\\', '\x01\x02', '👋').map((s) => Buffer.from(s.repeat(400))),
      fc.string({ unit: 'binary', maxLength: 500 }).map((s) => Buffer.from(s, 'utf16le')),
    );
    fc.assert(
      fc.property(fc.array(piece, { maxLength: 30 }), (chunks) => {
        const text = tailOf(...chunks);
        expect(Buffer.byteLength(text)).toBeLessThanOrEqual(STDERR_TAIL_BYTES);
        expect(Buffer.byteLength(JSON.stringify(text))).toBeLessThanOrEqual(2 * STDERR_TAIL_BYTES + 2);
        expect(text).not.toContain('\0');
        expect(text.isWellFormed()).toBe(true);
      }),
      { numRuns: 200 },
    );
  });
});

const job: JobInfo = { id: '01a24a00-0000-7000-8000-000000000001', queue: 'q', payload: {}, priority: 0, attemptNo: 1, labels: {} };
const context = () =>
  ({ attempt: { id: '01a24a00-0000-7000-8000-0000000000a1', number: 1 }, signal: new AbortController().signal, idempotencyKey: (s: string) => `${job.id}:${s}` }) as unknown as JobContext;
const silent = pino({ level: 'silent' });
const command = (cmd: Record<string, unknown>) => configSchema.parse({ url: 'http://127.0.0.1:1', token: 't', queues: { q: cmd } }).queues.q!;

/** Runs a node script as the command: its result, or the JobError it threw as the SDK reads it. */
async function runNode(script: string, opts: { pidDir?: string; log?: pino.Logger } = {}) {
  return runCommand(command({ command: [process.execPath, '-e', script] }), job, context(), { log: opts.log ?? silent, pidDir: opts.pidDir ?? path.join(work, 'pids') }).then(
    (result) => ({ result }),
    (err: JobError) => ({ message: err.message, retryable: err.retryable, details: err.options.details }),
  );
}

describe.skipIf(process.platform === 'win32')('a failed command’s report', () => {
  for (const name of Object.keys(scripts) as Array<keyof typeof scripts>) {
    it(`fits the coordinator’s limits and ends with the end of stderr: ${name}`, async () => {
      const err = (await runNode(scripts[name])) as { message: string; retryable: boolean; details: Record<string, unknown> };
      expect(err).toMatchObject({ retryable: false, details: { exitCode: 3 } });
      expect(err.message).toMatch(/^exited with code 3: /);
      expect(err.message.endsWith(ends[name])).toBe(true);
      expectAccepted(err);
    }, 20_000);
  }

  it('a stopped command’s report too (the tail once, in the message)', async () => {
    const script = `${scripts.cjk.replace('process.exitCode = 3;', '')} setTimeout(() => {}, 30000);`;
    const cmd = command({ command: [process.execPath, '-e', script], timeout: '1s', killGrace: '200ms' });
    const err = await runCommand(cmd, job, context(), { log: silent, pidDir: path.join(work, 'pids') }).catch((e: JobError) => ({ message: e.message, details: e.options.details }));
    expect((err as { message: string }).message).toMatch(/^timed out after 1000 ms; stderr: /);
    expect((err as { message: string }).message.endsWith(ends.cjk)).toBe(true);
    expectAccepted(err as { message: string; details: Record<string, unknown> });
  }, 20_000);
});

describe('the last JSON line on stdout', () => {
  const read = (text: string) => {
    const out = new OutputLines();
    out.write(Buffer.from(text));
    out.end();
    return { lastJson: out.lastJson, badJson: out.badJson, resultTooLong: out.resultTooLong };
  };

  it('that does not parse stands where the result would be; a later good one, or a log line, does not change that', () => {
    const bad = String.raw`{"rows": 1200, "file": "C:\Users\José\out.csv"}`;
    expect(read(`{"progress":50}\n${bad}\n`)).toMatchObject({ lastJson: { progress: 50 }, badJson: { error: expect.stringMatching(/^Bad escaped character in JSON at position 27/), start: bad } });
    expect(read(`{"progress":50}\n${bad}\r\ndone\n[INFO] all good\n`).badJson).toBeDefined();
    expect(read(`${bad}\n{"rows":1200}\n`)).toEqual({ lastJson: { rows: 1200 }, badJson: undefined, resultTooLong: undefined });
    // Lines that start with a bracket but are no JSON's (a log line) are not taken for a result.
    expect(read('{"a":1}\n{pid 12} started\n[INFO] [x]\n[2024-05-01] done]\n')).toEqual({ lastJson: { a: 1 }, badJson: undefined, resultTooLong: undefined });
    // A long line's start, cut, with its control characters replaced.
    const long = `{"x":"\u0000${'y'.repeat(300)}"}`;
    expect(read(`${long}\n`).badJson?.start).toBe(`{"x":"\uFFFD${'y'.repeat(113)}…`);
  });

  it.skipIf(process.platform === 'win32')('fails the job for good, naming the parse error and the line, rather than succeed with an earlier line', async () => {
    const script = String.raw`console.log('{"progress":50}'); console.log('{"rows": 1200, "file": "C:\\Users\\José\\out.csv"}'); console.error('wrote it')`;
    const err = await runNode(script);
    expect(err).toEqual({
      message: String.raw`the last JSON line on stdout is not valid JSON: Bad escaped character in JSON at position 27 (the line starts: {"rows": 1200, "file": "C:\Users\José\out.csv"})`,
      retryable: false,
      details: { exitCode: 0, stderr: 'wrote it' },
    });
    expect(report(err as { message: string }).bytes).toBeLessThanOrEqual(limits.errorBytes);
    expect(await runNode(`console.log('{"progress":50}'); console.log('{"done":true}'); console.log('[1] all done [ok]x')`)).toEqual({ result: { done: true } });
  }, 20_000);
});

describe.skipIf(process.platform !== 'linux')('the pid file', () => {
  it('is removed when writing it fails (a full disk), not left empty', async () => {
    // The pid file's path leads to /dev/full, where every write fails with ENOSPC.
    const pidDir = path.join(work, 'full');
    await mkdir(pidDir, { recursive: true });
    const pidFile = path.join(pidDir, `${(context() as { attempt: { id: string } }).attempt.id}.json`);
    await symlink('/dev/full', pidFile);
    const lines: Array<Record<string, unknown>> = [];
    const log = pino({ level: 'info' }, new Writable({ write: (c: Buffer, _e, cb) => (lines.push(JSON.parse(c.toString()) as Record<string, unknown>), cb()) }));
    expect(await runNode("console.log('{\"ok\":true}')", { pidDir, log })).toEqual({ result: { ok: true } });
    expect(lines.find((l) => l.msg === 'could not write the pid file')).toMatchObject({ err: { code: 'ENOSPC' } });
    await expect(lstat(pidFile)).rejects.toMatchObject({ code: 'ENOENT' });
  }, 20_000);
});

// Against a real coordinator, through the real runner and the SDK's report.
const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_LEASE_TTL: '4s', LEASEHOLD_CLAIM_TTL: '4s', LEASEHOLD_HEARTBEAT_INTERVAL: '500ms' });
const children: ChildProcess[] = [];
afterEach(async () => {
  const left = await t.pool.query<{ id: string }>('SELECT id FROM jobs_live WHERE finished_at IS NULL');
  for (const { id } of left.rows) await jobCancel(t.pool, { jobId: id });
  for (const c of children.splice(0)) {
    if (c.exitCode === null && c.signalCode === null) {
      c.kill('SIGKILL');
      await new Promise((r) => c.once('exit', r));
    }
  }
});

describe.skipIf(process.platform === 'win32')('leasehold-agent against a coordinator', () => {
  it('fails for good, in one attempt, commands whose stderr is CJK, has NULs, is UTF-16LE or coloured, carrying the stderr', async () => {
    const token = await lh.agent('runner-report-limits');
    const queues = Object.fromEntries(Object.entries(scripts).map(([name, script]) => [name, { command: [process.execPath, '-e', script] }]));
    const file = path.join(work, 'agent.json');
    await writeFile(file, JSON.stringify({ url: lh.url, token, slots: 5, outboxDir: path.join(work, 'outbox'), queues, grace: '2s' }));
    const child = spawn(process.execPath, [bin, '--config', file], { cwd: root, stdio: ['ignore', 'pipe', 'pipe'] });
    children.push(child);
    const lines: string[] = [];
    createInterface({ input: child.stdout! }).on('line', (l) => lines.push(l));
    createInterface({ input: child.stderr! }).on('line', (l) => lines.push(l));
    const ids = new Map<string, string>();
    for (const queue of Object.keys(scripts)) {
      const o = await jobEnqueue(t.pool, { queue, payload: {}, maxAttempts: 3 });
      if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
      ids.set(queue, o.value.id);
    }
    const jobs = async () => (await t.pool.query(`SELECT queue, status::text, attempt_no, job_error(id, status) AS error FROM jobs WHERE id = ANY($1)`, [[...ids.values()]])).rows;
    try {
      await until(lh, 'every job ended', async () => (await jobs()).every((j) => ['succeeded', 'failed', 'dead', 'canceled'].includes(j.status)), 40_000);
      for (const j of await jobs()) {
        const name = j.queue as keyof typeof scripts;
        expect(j, name).toMatchObject({ status: 'failed', attempt_no: 1 });
        expect(j.error.message.startsWith('exited with code 3: '), name).toBe(true);
        expect(j.error.message.endsWith(ends[name]), name).toBe(true);
        expectAccepted(j.error);
      }
      expect(lines.filter((l) => l.includes('report refused'))).toEqual([]);
      expect(existsSync(path.join(work, 'outbox', 'superseded.jsonl'))).toBe(false);
    } catch (err) {
      console.error(`runner logged:\n${lines.join('\n')}`);
      throw err;
    }
  }, 60_000);
});
