/**
 * `leasehold-agent` as a real process running real commands, against a real coordinator:
 * results, retryable and final failures, timeouts and cancels that take the whole process tree
 * down, a revoke after the lease is lost, a restart with a result still in the outbox, paths
 * with spaces, `--check`, and an invalid configuration (exit code 2 naming the field). And what
 * a runner must not do to commands: a second runner started on the same configuration (a console
 * start beside the service) is refused by the outbox lock before it touches the first one's
 * commands; a drained runner leaves no command behind, one that ignores SIGTERM included; a
 * command killed from outside is retried.
 */
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { cp, mkdir, mkdtemp, open, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { createInterface } from 'node:readline';
import { promisify } from 'node:util';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { readOutbox } from '@leasehold/agent-client';
import { jobCancel, jobEnqueue } from '../server/store/index.js';
import type { ReaperRun } from '../server/core/reaper.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, until, useCoordinator, waitFor } from './helpers/coordinator.js';
import { checkInvariants } from './helpers/invariants.js';
import { rawClient, unary } from './helpers/raw-agent.js';
import { startProxy, type TcpProxy } from './helpers/tcp-proxy.js';
import { alive } from './helpers/pids.js';
import { groupAlive } from './helpers/process-group.js';

const run = promisify(execFile);
const root = path.resolve(import.meta.dirname, '..');
const bin = path.join(root, 'agent-client/bin/leasehold-agent.mjs');
const fixtures = path.join(root, 'test/fixtures/commands');
const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_LEASE_TTL: '4s', LEASEHOLD_CLAIM_TTL: '4s', LEASEHOLD_HEARTBEAT_INTERVAL: '500ms' });
const children: ChildProcess[] = [];
const runners: Runner[] = [];
const proxies: TcpProxy[] = [];
let work: string;

interface Runner {
  child: ChildProcess;
  lines: Array<Record<string, unknown>>;
  /** The first line (now or to come) that `what` accepts. */
  waitFor(what: (l: Record<string, unknown>) => boolean, ms?: number): Promise<Record<string, unknown>>;
  exited: Promise<number | null>;
}

function startRunner(configFile: string, env: NodeJS.ProcessEnv = process.env): Runner {
  const child = spawn(process.execPath, [bin, '--config', configFile], { cwd: root, env, stdio: ['ignore', 'pipe', 'pipe'] });
  children.push(child);
  const lines: Array<Record<string, unknown>> = [];
  const watchers = new Set<(l: Record<string, unknown>) => void>();
  const onLine = (text: string) => {
    let line: Record<string, unknown>;
    try {
      line = JSON.parse(text) as Record<string, unknown>;
    } catch {
      line = { msg: text };
    }
    lines.push(line);
    for (const w of watchers) w(line);
  };
  createInterface({ input: child.stdout! }).on('line', onLine);
  createInterface({ input: child.stderr! }).on('line', onLine);
  const exited = new Promise<number | null>((r) => child.on('exit', (c) => r(c)));
  const runner: Runner = {
    child,
    lines,
    exited,
    waitFor: (what, ms = 20_000) => {
      const seen = lines.find(what);
      if (seen) return Promise.resolve(seen);
      return new Promise((resolve, reject) => {
        const done = () => (clearTimeout(timer), watchers.delete(watch));
        const watch = (l: Record<string, unknown>) => void (what(l) && (done(), resolve(l)));
        const timer = setTimeout(() => (done(), reject(new Error(`timed out after ${ms} ms waiting for the runner's log line ${what.toString()}`))), ms);
        watchers.add(watch);
      });
    },
  };
  runners.push(runner);
  return runner;
}

/**
 * The pids that test/fixtures/commands/tree.mjs records: once the runner says its command started
 * (the runner's own start, its stream and the dispatch may take a while on a busy machine), then
 * the file, so a timeout says which of the two was slow.
 */
async function treePids(r: Runner, pidFile: string): Promise<{ child: number; grandchild: number }> {
  await r.waitFor((l) => l.event === 'command.started');
  return waitFor('pids', () => existsSync(pidFile) && (JSON.parse(readFileSync(pidFile, 'utf8')) as { child: number; grandchild: number }));
}

async function writeConfig(name: string, config: Record<string, unknown>): Promise<string> {
  const file = path.join(work, `${name}.json`);
  await writeFile(file, JSON.stringify(config, null, 2));
  return file;
}

async function config(name: string, queues: Record<string, unknown>, extra: Record<string, unknown> = {}) {
  const token = await lh.agent(name);
  const outboxDir = path.join(work, `outbox of ${name}`); // a space in the path on purpose
  return { file: await writeConfig(name, { url: lh.url, token, slots: 2, outboxDir, queues, grace: '2s', ...extra }), outboxDir, token };
}

async function enqueue(queue: string, payload: Record<string, unknown>, extra: Record<string, unknown> = {}) {
  const o = await jobEnqueue(t.pool, { queue, payload, ...extra });
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  return o.value;
}
const job = async (id: string) => (await t.pool.query(`SELECT status::text, result, job_error(id, status) AS error, attempt_no FROM jobs WHERE id = $1`, [id])).rows[0];
const node = (script: string) => [process.execPath, path.join(fixtures, script)];

afterEach(async (ctx) => {
  // A failed test shows what its runners logged, and leaves no job held: a later test's reaper
  // run (an hour ahead) must not take back a job this one left running.
  const ran = runners.splice(0);
  if (ctx.task.result?.state === 'fail') {
    for (const r of ran) console.error(`runner ${r.child.pid} logged:\n${r.lines.map((l) => JSON.stringify(l)).join('\n')}`);
  }
  const left = await t.pool.query<{ id: string }>('SELECT id FROM jobs_live WHERE finished_at IS NULL');
  for (const { id } of left.rows) await jobCancel(t.pool, { jobId: id });
  for (const c of children.splice(0)) {
    if (c.exitCode === null && c.signalCode === null) {
      c.kill('SIGKILL');
      await new Promise((r) => c.once('exit', r));
    }
  }
  for (const p of proxies.splice(0)) await p.close();
});
beforeAll(async () => {
  work = await mkdtemp(path.join(os.tmpdir(), 'leasehold runner '));
});
afterAll(async () => {
  if (work) await rm(work, { recursive: true, force: true });
});

describe('leasehold-agent', () => {
  it('runs a command (in a path with spaces), passing the job on stdin and in LEASEHOLD_*; the last JSON line is the result', async () => {
    const scriptDir = path.join(work, 'my tools');
    await mkdir(scriptDir);
    await cp(path.join(fixtures, 'echo-job.mjs'), path.join(scriptDir, 'echo job.mjs'));
    const c = await config('runner-ok', {
      add: { command: [process.execPath, path.join(scriptDir, 'echo job.mjs')], cwd: scriptDir, env: { EXTRA: 'yes' } },
    });
    const r = startRunner(c.file);
    await r.waitFor((l) => l.event === 'serving');
    const j = await enqueue('add', { a: 2, b: 40 });
    await until(lh, 'succeeded', async () => (await job(j.id)).status === 'succeeded');
    const res = (await job(j.id)).result;
    expect(res.sum).toBe(42);
    expect(res.cwd).toBe(scriptDir);
    expect(res.env).toMatchObject({ jobId: j.id, attemptNo: '1', key: `${j.id}:run`, payload: JSON.stringify({ a: 2, b: 40 }), extra: 'yes' });
    expect(res.env.attemptId).toMatch(/^[0-9a-f-]{36}$/);
  });

  it('retries on a retryable exit code and fails for good on another, with the tail of stderr', async () => {
    const c = await config('runner-fail', {
      flaky: { command: node('echo-job.mjs'), retryableExitCodes: [75] },
      broken: { command: node('fail.mjs'), retryableExitCodes: [75] },
    });
    startRunner(c.file);
    const flaky = await enqueue('flaky', { a: 1, b: 1, attemptToSucceed: 2 }, { maxAttempts: 3 });
    const broken = await enqueue('broken', { code: 3 }, { maxAttempts: 3 });
    await until(lh, 'both ended', async () => (await job(flaky.id)).status === 'succeeded' && (await job(broken.id)).status === 'failed', 30_000);
    expect(await job(flaky.id)).toMatchObject({ attempt_no: 2, result: { sum: 2 } });
    const b = await job(broken.id);
    expect(b.attempt_no).toBe(1);
    expect(b.error.message).toBe('exited with code 3: something went wrong: disk full');
    expect(b.error.details).toMatchObject({ exitCode: 3 });
  });

  it('fails at once, not retried, a command that cannot be spawned at all (spawn itself throws)', async () => {
    // A NUL byte makes spawn() throw before any process exists, as a .cmd without a shell does
    // on Windows (EINVAL): the job fails for good with the reason, it is not retried.
    const c = await config('runner-unspawnable', { bad: { command: [process.execPath, 'a\u0000b'] } });
    startRunner(c.file);
    const j = await enqueue('bad', {}, { maxAttempts: 5 });
    await until(lh, 'failed', async () => (await job(j.id)).status === 'failed', 20_000);
    const b = await job(j.id);
    expect(b.attempt_no).toBe(1);
    expect(b.error.message).toMatch(/^cannot start ".*node.*": ERR_INVALID_ARG_VALUE$/);
  });

  it.skipIf(process.platform === 'win32')('exits 0 on SIGINT while it has never reached the coordinator', async () => {
    const c = await config('runner-unreached', { q: { command: node('echo-job.mjs') } }, { url: 'http://127.0.0.1:1' });
    const r = startRunner(c.file);
    await r.waitFor((l) => l.msg === 'disconnected from the coordinator; reconnecting');
    r.child.kill('SIGINT');
    expect(await r.exited).toBe(0);
    expect(r.lines.some((l) => l.msg === 'shutting down: draining')).toBe(true);
    expect(r.lines.some((l) => String(l.msg).startsWith('leasehold-agent: '))).toBe(false);
  });

  it.skipIf(process.platform === 'win32')("does not hand the agent's token (LEASEHOLD_TOKEN) to its commands, unless a queue's env gives it", async () => {
    const show = ['/bin/sh', '-c', 'echo "{\\"token\\":\\"${LEASEHOLD_TOKEN:-none}\\",\\"home\\":\\"${HOME:-none}\\"}"'];
    const c = await config('runner-env', { plain: { command: show }, given: { command: show, env: { LEASEHOLD_TOKEN: 'given on purpose' } } });
    // The token in the agent's environment only, as a service would set it.
    const file = await writeConfig('runner-env-no-token', { ...JSON.parse(readFileSync(c.file, 'utf8')), token: undefined });
    startRunner(file, { ...process.env, LEASEHOLD_TOKEN: c.token });
    const plain = await enqueue('plain', {});
    const given = await enqueue('given', {});
    await until(lh, 'both succeeded', async () => (await job(plain.id)).status === 'succeeded' && (await job(given.id)).status === 'succeeded', 15_000);
    // The rest of the environment passes as before.
    expect((await job(plain.id)).result).toEqual({ token: 'none', home: process.env.HOME ?? 'none' });
    expect((await job(given.id)).result).toMatchObject({ token: 'given on purpose' });
  });

  it.skipIf(process.platform === 'win32')('completes commands that end within a millisecond of starting, their output read', async () => {
    // The runner listens for the exit and the output from the spawn on: a command done before
    // its pid file is written is not missed (it was, and the job then ran until its timeout).
    const c = await config('runner-fast', { fast: { command: ['/bin/sh', '-c', 'echo "{\\"n\\":$LEASEHOLD_ATTEMPT_NO}"'] } });
    startRunner(c.file);
    const ids = await Promise.all([1, 2, 3, 4].map(async () => (await enqueue('fast', {})).id));
    await until(lh, 'all four succeeded', async () => (await Promise.all(ids.map(job))).every((j) => j.status === 'succeeded'), 15_000);
    for (const id of ids) expect(await job(id)).toMatchObject({ attempt_no: 1, result: { n: 1 } });
  });

  it.skipIf(process.platform !== 'linux')('retries a command the machine could not start now (ETXTBSY: its file open for writing), and logs why the handler failed', async () => {
    // A command file being replaced (a deploy writing it) cannot be executed meanwhile: the
    // attempt fails retryable, and the next one, once the file is closed, runs it.
    const script = path.join(work, 'being written.sh');
    const fh = await open(script, 'w', 0o755);
    await fh.write('#!/bin/sh\necho \'{"ran":true}\'\n');
    const c = await config('runner-txtbsy', { busy: { command: [script] } });
    const r = startRunner(c.file);
    const j = await enqueue('busy', {}, { maxAttempts: 3 });
    try {
      const failed = await r.waitFor((l) => l.event === 'handler.finished' && l.jobId === j.id);
      expect(failed).toMatchObject({ kind: 'failed', retryable: true, error: `cannot start ${JSON.stringify(script)}: ETXTBSY (retried: the machine may start it later)` });
    } finally {
      await fh.close();
    }
    await until(lh, 'succeeded', async () => (await job(j.id)).status === 'succeeded', 30_000);
    expect(await job(j.id)).toMatchObject({ attempt_no: 2, result: { ran: true } });
  });

  it('kills the command and its grandchild on timeout', async () => {
    const c = await config('runner-timeout', { slow: { command: node('tree.mjs'), timeout: '1s', killGrace: '300ms' } });
    const r = startRunner(c.file);
    const pidFile = path.join(work, 'timeout-pids.json');
    const j = await enqueue('slow', { pidFile }, { maxAttempts: 1 });
    const pids = await treePids(r, pidFile);
    expect(alive(pids.child) && alive(pids.grandchild)).toBe(true);
    await until(lh, 'dead-lettered', async () => (await job(j.id)).status === 'dead', 20_000);
    expect((await job(j.id)).error.message).toMatch(/^timed out after 1000 ms/);
    await waitFor('tree gone', () => !alive(pids.child) && !alive(pids.grandchild), 5000);
  });

  it('kills the tree when the job is canceled mid-run', async () => {
    const c = await config('runner-cancel', { long: { command: node('tree.mjs'), killGrace: '300ms' } });
    const r = startRunner(c.file);
    const pidFile = path.join(work, 'cancel-pids.json');
    const j = await enqueue('long', { pidFile });
    const pids = await treePids(r, pidFile);
    const client = rawClient('JobService', `127.0.0.1:${lh.port}`);
    await unary(client, 'cancelJob', { jobId: j.id }, ADMIN_KEY).finally(() => client.close());
    await waitFor('tree gone', () => !alive(pids.child) && !alive(pids.grandchild), 5000);
    await r.waitFor((l) => l.setAside === 'superseded');
    expect((await job(j.id)).status).toBe('canceled');
  });

  it('kills the tree when the attempt is revoked after its lease was lost', async () => {
    const c = await config('runner-revoke', { long: { command: node('tree.mjs'), killGrace: '300ms' } });
    const r = startRunner(c.file);
    const pidFile = path.join(work, 'revoke-pids.json');
    // One attempt only: the rescued job goes dead instead of starting again on this runner (an
    // attempt 2 would outlive the test when the runner is SIGKILLed after it).
    const j = await enqueue('long', { pidFile }, { maxAttempts: 1 });
    const pids = await treePids(r, pidFile);
    await until(lh, 'running', async () => (await job(j.id)).status === 'running');
    // As if the lease had run out: the reaper takes the job back and revokes the attempt. Its
    // schedule is paused so these runs are ours, not one already going with the real clock. A
    // run skips a job whose row another transaction holds (FOR UPDATE SKIP LOCKED): a heartbeat
    // of the runner renewing the lease right then, which CI met once. The next run takes it, as
    // the schedule's would: up to five runs, each an hour after the last.
    await lh.c.reaper.stop();
    const runs: ReaperRun[] = [];
    try {
      for (let i = 1; i <= 5 && !runs.some((r) => r.rescued.some((x) => x.jobId === j.id)); i++) {
        runs.push(await lh.c.reaper.runOnce(new Date(Date.now() + i * 3_600_000)));
      }
    } finally {
      lh.c.reaper.start();
    }
    expect(runs.flatMap((r) => r.rescued).filter((x) => x.jobId === j.id), JSON.stringify(runs)).toMatchObject([{ reason: 'lease_expired', status: 'dead' }]);
    expect((await job(j.id)).status).toBe('dead');
    await waitFor('tree gone', () => !alive(pids.child) && !alive(pids.grandchild), 5000);
  });

  it('sends a result left in its outbox after being killed, once restarted', async () => {
    const c = await config('runner-restart', { add: { command: node('echo-job.mjs') } });
    const proxy = await startProxy(lh.port);
    proxies.push(proxy);
    const viaProxy = await writeConfig('runner-restart-proxy', { ...JSON.parse(readFileSync(c.file, 'utf8')), url: `http://127.0.0.1:${proxy.port}` });
    const first = startRunner(viaProxy);
    await first.waitFor((l) => l.event === 'serving');
    await until(lh, 'stream up', () => [...lh.c.hub.sessions].some((s) => s.agentId === 'runner-restart'));
    // Silence the network as soon as the job is running, so the result cannot get out.
    const j = await enqueue('add', { a: 20, b: 3 });
    await first.waitFor((l) => l.event === 'command.started');
    proxy.blackhole();
    const entry = await first.waitFor((l) => l.event === 'handler.finished');
    const inOutbox = async () => (await readOutbox(c.outboxDir)).pending.some((e) => e.attemptId === entry.attemptId);
    expect(await inOutbox()).toBe(true);
    first.child.kill('SIGKILL');
    await first.exited;
    expect((await job(j.id)).status).toBe('running');

    const second = startRunner(c.file);
    await second.waitFor((l) => l.event === 'report.acknowledged');
    expect(await job(j.id)).toMatchObject({ status: 'succeeded', attempt_no: 1, result: { sum: 23 } });
    expect(await inOutbox()).toBe(false);
    await checkInvariants(t.pool);
  });

  it('--check validates, authenticates and prints what it would serve', async () => {
    const c = await config('runner-check', { add: { command: node('echo-job.mjs'), timeout: '10m', retryableExitCodes: [75] } });
    const { stdout } = await run(process.execPath, [bin, '--config', c.file, '--check'], { cwd: root });
    expect(stdout).toMatch(/config ok: 1 queue\(s\), 2 slot\(s\)/);
    expect(stdout).toMatch(/add: .*echo-job\.mjs.*timeout 600000 ms, retry on exit 75/);
    expect(stdout).toMatch(/coordinator ok/);
    const bad = await writeConfig('runner-check-bad', { ...JSON.parse(readFileSync(c.file, 'utf8')), token: 'lh_agent_wrong' });
    const err = await run(process.execPath, [bin, '--config', bad, '--check'], { cwd: root }).catch((e: { code: number; stderr: string }) => e);
    expect((err as { code: number }).code).toBe(1);
    expect((err as { stderr: string }).stderr).toMatch(/refused this agent/);
  });

  it('refuses a second runner on the same configuration by the outbox lock, before it touches the first one\'s running command', async () => {
    // The command runs until the test creates its release file, then answers.
    const release = path.join(work, 'release-second-runner');
    const wait = `const fs = require('fs'); const t = setInterval(() => { if (fs.existsSync(process.env.RELEASE)) { clearInterval(t); console.log(JSON.stringify({ ok: true })); } }, 20);`;
    const c = await config('runner-second', { long: { command: [process.execPath, '-e', wait], env: { RELEASE: release } } });
    const first = startRunner(c.file);
    const j = await enqueue('long', {}, { maxAttempts: 2 });
    await first.waitFor((l) => l.event === 'command.started');
    const second = startRunner(c.file);
    expect(await second.exited).toBe(1);
    expect(second.lines.map((l) => String(l.msg))).toContainEqual(expect.stringMatching(/^leasehold-agent: outbox .* is in use by process \d+ \(lock file .*outbox\.lock/));
    expect(second.lines.some((l) => String(l.msg).startsWith('stopped a command left running'))).toBe(false);
    await writeFile(release, '');
    await until(lh, 'ended', async () => ['succeeded', 'failed', 'dead'].includes((await job(j.id)).status), 20_000);
    // Its first attempt, the one the second runner must not have killed, did the job.
    expect(await job(j.id)).toMatchObject({ status: 'succeeded', attempt_no: 1, result: { ok: true } });
  });

  it.skipIf(process.platform !== 'linux')('leaves no process of a command that ignores SIGTERM behind when drained (SIGTERM to the runner)', async () => {
    // The drain's polite stop is ignored, and the queue's killGrace is far longer than the drain:
    // the runner exits first, and kills the group on its way out.
    const c = await config('runner-drain-stubborn', { stubborn: { command: ['/bin/sh', '-c', 'trap "" TERM; sleep 40'], killGrace: '60s' } }, { grace: '300ms' });
    const r = startRunner(c.file);
    await enqueue('stubborn', {}, { maxAttempts: 1 });
    const pgid = (await r.waitFor((l) => l.event === 'command.started')).pid as number;
    expect(groupAlive(pgid)).toBe(true);
    try {
      r.child.kill('SIGTERM');
      expect(await r.exited).toBe(0);
      await waitFor('no process of the command left', () => !groupAlive(pgid), 5000);
      expect(r.lines.find((l) => l.event === 'commands.killed')).toMatchObject({ pids: [pgid] });
      expect(existsSync(path.join(c.outboxDir, 'running'))).toBe(true);
      expect(readdirSync(path.join(c.outboxDir, 'running'))).toEqual([]);
    } finally {
      try {
        process.kill(-pgid, 'SIGKILL'); // what a failed run left behind
      } catch {
        // gone, as it should be
      }
    }
  });

  it.skipIf(process.platform === 'win32')('retries a command killed from outside (a service manager stopping it first, the OOM killer), as stopped, not failed', async () => {
    const c = await config('runner-killed', {
      killed: { command: ['/bin/sh', '-c', 'if [ "$LEASEHOLD_ATTEMPT_NO" = 1 ]; then kill -KILL $$; fi; echo "{\\"attempt\\":$LEASEHOLD_ATTEMPT_NO}"'] },
    });
    const r = startRunner(c.file);
    const j = await enqueue('killed', {}, { maxAttempts: 3 });
    await until(lh, 'succeeded', async () => (await job(j.id)).status === 'succeeded', 30_000);
    expect(await job(j.id)).toMatchObject({ attempt_no: 2, result: { attempt: 2 } });
    expect(await r.waitFor((l) => l.event === 'handler.finished' && l.kind === 'failed')).toMatchObject({ retryable: true, error: 'exited with signal SIGKILL (stopped from outside: retried)' });
  });

  it.each([
    [{ url: 'http://x', token: 't', queues: {} }, /^leasehold-agent: invalid configuration: queues: must configure at least one queue/],
    [{ url: 'http://x', token: 't', queues: { q: { command: [] } } }, /queues\.q\.command: must name the executable/],
    [{ url: 'http://x', token: 't', queues: { q: { command: ['x'], timeout: 'soon' } } }, /queues\.q\.timeout: "soon" is not a duration/],
    [{ url: 'http://x', token: 't', queues: { q: { command: ['x'], retryableExitCodes: [0] } } }, /queues\.q\.retryableExitCodes\.0/],
    [{ url: 'http://x', token: 't', slots: 0, queues: { q: { command: ['x'] } } }, /slots:/],
    [{ url: 'http://x', token: 't', queues: { q: { command: ['x'], comand: 1 } } }, /queues\.q: unknown field\(s\) "comand"/],
    [{ url: 'http://x', queues: { q: { command: ['x'] } } }, /token: is required/],
  ])('refuses an invalid configuration with exit code 2 naming the field (%#)', async (cfg, message) => {
    const file = await writeConfig(`invalid-${Math.random().toString(36).slice(2)}`, cfg);
    const err = await run(process.execPath, [bin, '--config', file], { cwd: root, env: { ...process.env, LEASEHOLD_TOKEN: '' } }).catch((e: { code: number; stderr: string }) => e);
    expect((err as { code: number }).code).toBe(2);
    expect((err as { stderr: string }).stderr).toMatch(message);
  });
});
