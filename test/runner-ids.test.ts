/**
 * Ids from the coordinator name files on the agent's machine (the runner's pid file is
 * `<outboxDir>/running/<attempt id>.json`), so they are checked before anything is done with them:
 * - the SDK refuses an assigned job whose job id or attempt id is not a UUID (or that has no job):
 *   it is logged (`job.refused`), never started (no `Started`, no handler), and its slot is given
 *   back; the other jobs of the same `Assign` run as usual;
 * - `runCommand` refuses such ids too, before it starts the command or writes anything.
 * The review's case, through a fake coordinator and the runner's handler: an attempt id
 * `../../victim/settings` made the runner write, then delete, `<outboxDir>/../victim/settings.json`.
 */
import { randomUUID } from 'node:crypto';
import { once } from 'node:events';
import { existsSync, readFileSync } from 'node:fs';
import { mkdir, mkdtemp, readdir, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Writable } from 'node:stream';
import { create } from '@bufbuild/protobuf';
import pino from 'pino';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { createAgent, type Agent, type JobError } from '@leasehold/agent-client';
import { assignedJobProblem, isUuid } from '../agent-client/src/codec.js';
import type { JobContext, JobInfo } from '../agent-client/src/context.js';
import { ClaimedJobSchema } from '../agent-client/src/gen/leasehold/v1/job_pb.js';
import { configSchema } from '../agent-client/src/runner/config.js';
import { runCommand } from '../agent-client/src/runner/run-command.js';
import { grpc, services } from './helpers/raw-agent.js';

const dirs: string[] = [];
const agents: Agent[] = [];
const servers: grpc.Server[] = [];
afterEach(async () => {
  for (const a of agents.splice(0)) await a.stop();
  for (const s of servers.splice(0)) s.forceShutdown();
});
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

async function tempDir(): Promise<string> {
  const d = await mkdtemp(path.join(os.tmpdir(), 'leasehold-runner-ids-'));
  dirs.push(d);
  return d;
}

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

/** A queue's command as the runner's configuration gives it. */
function command(cmd: Record<string, unknown>) {
  return configSchema.parse({ url: 'http://127.0.0.1:1', token: 't', queues: { q: cmd } }).queues.q!;
}

/**
 * A coordinator that welcomes the agent (without credit on reports, so freed slots come as
 * `Credit`), sends `jobs` in one `Assign`, confirms every `Started`, and acknowledges reports.
 */
async function fakeCoordinator(jobs: Array<{ jobId: string; attemptId: string; queue?: string }>) {
  const received: Array<Record<string, any>> = [];
  const server = new grpc.Server();
  servers.push(server);
  server.addService(services.AgentService!.service, {
    connect(call: grpc.ServerDuplexStream<any, any>) {
      const ttl = { seconds: 30 };
      call.on('data', (m: Record<string, any>) => {
        received.push(m);
        if (m.kind === 'hello') {
          call.write({ welcome: { sessionId: 's', leaseTtl: ttl, heartbeatInterval: { seconds: 10 } } });
          const claimDeadline = { seconds: Math.floor(Date.now() / 1000) + 30 };
          call.write({
            assign: {
              jobs: jobs.map((j) => ({ job: { id: j.jobId, queue: j.queue ?? 'q', payload: { fields: {} }, attemptNo: 1 }, attemptId: j.attemptId, attemptNo: 1, claimDeadline })),
            },
          });
        }
        if (m.kind === 'started') call.write({ renewed: { attemptIds: m.started.attemptIds, leaseTtl: ttl, seq: m.started.seq } });
        const report = m.completed?.results ?? m.failed?.failures;
        if (report) call.write({ ack: { items: report.map((r: any) => ({ attemptId: r.attemptId, outcome: 'OUTCOME_OK' })) } });
      });
      call.on('error', () => undefined);
    },
  });
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (err, p) => (err ? reject(err) : resolve(p))),
  );
  return { url: `http://127.0.0.1:${port}`, received };
}

describe('assignedJobProblem', () => {
  it('takes UUIDs of any version in either case, and names what is wrong otherwise', () => {
    const ok = randomUUID();
    const claimed = (jobId: string | undefined, attemptId: string) =>
      create(ClaimedJobSchema, { ...(jobId === undefined ? {} : { job: { id: jobId, queue: 'q' } }), attemptId, attemptNo: 1 });
    expect(assignedJobProblem(claimed(ok, randomUUID()))).toBeUndefined();
    expect(assignedJobProblem(claimed(ok.toUpperCase(), '00000000-0000-0000-0000-000000000000'))).toBeUndefined();
    expect(assignedJobProblem(claimed(ok, '../../victim/settings'))).toBe('the attempt id "../../victim/settings" is not a UUID');
    expect(assignedJobProblem(claimed('../x', ok))).toBe('the job id "../x" is not a UUID');
    expect(assignedJobProblem(claimed(undefined, ok))).toBe('the assignment has no job');
    for (const bad of ['', `${ok}/..`, ` ${ok}`, `${ok}\n`, ok.replaceAll('-', ''), `{${ok}}`, 'x'.repeat(36)]) expect(isUuid(bad), JSON.stringify(bad)).toBe(false);
    expect(assignedJobProblem(claimed(ok, 'y'.repeat(5000)))!.length).toBeLessThan(200);
  });
});

describe('runCommand', () => {
  it('refuses a job or attempt id that is not a UUID before it starts the command or writes a file', async () => {
    const base = await tempDir();
    const pidDir = path.join(base, 'outbox', 'running');
    const victim = path.join(base, 'victim', 'settings.json');
    await mkdir(path.dirname(victim), { recursive: true });
    await writeFile(victim, '{"keep":true}');
    const marker = path.join(base, 'ran');
    const cmd = command({ command: [process.execPath, '-e', `require('fs').writeFileSync(${JSON.stringify(marker)}, 'x')`] });
    const job: JobInfo = { id: randomUUID(), queue: 'q', payload: {}, priority: 0, attemptNo: 1, labels: {} };
    const ctx = (attemptId: string) =>
      ({ attempt: { id: attemptId, number: 1 }, signal: new AbortController().signal, idempotencyKey: (s: string) => `${job.id}:${s}` }) as unknown as JobContext;
    const { log } = logger();

    for (const [j, c, what] of [
      [job, ctx('../../victim/settings'), 'attempt id "../../victim/settings"'],
      [{ ...job, id: '../../victim/settings' }, ctx(randomUUID()), 'job id "../../victim/settings"'],
    ] as const) {
      const err = (await runCommand(cmd, j, c, { log, pidDir }).catch((e: JobError) => e)) as JobError;
      expect(err).toMatchObject({ name: 'JobError', message: `not started: the ${what} is not a UUID`, retryable: true });
    }
    expect(existsSync(marker), 'the command never ran').toBe(false);
    expect(readFileSync(victim, 'utf8')).toBe('{"keep":true}');
    expect(existsSync(pidDir)).toBe(false);

    // A UUID runs as before, and leaves no pid file.
    expect(await runCommand(cmd, job, ctx(randomUUID()), { log, pidDir })).toEqual({});
    expect(existsSync(marker)).toBe(true);
    expect(await readdir(pidDir)).toEqual([]);
  }, 30_000);
});

describe('the SDK and the runner against a coordinator that sends ids that are not UUIDs', () => {
  it('refuses those jobs (logged, never started, slots given back), runs the rest, and the file the id points at is untouched', async () => {
    const base = await tempDir();
    const outboxDir = path.join(base, 'outbox');
    const pidDir = path.join(outboxDir, 'running');
    // Where `path.join(pidDir, '../../victim/settings.json')` points.
    const victim = path.join(base, 'victim', 'settings.json');
    await mkdir(path.dirname(victim), { recursive: true });
    await writeFile(victim, '{"keep":true}');

    const good = { jobId: randomUUID(), attemptId: randomUUID() };
    const coordinator = await fakeCoordinator([
      { jobId: randomUUID(), attemptId: '../../victim/settings' },
      { jobId: '../../victim/settings', attemptId: randomUUID() },
      good,
    ]);
    const { log, lines } = logger();
    const agent = createAgent({ url: coordinator.url, token: 'any-token', queues: ['q'], slots: 3, outboxDir, handleSignals: false, log });
    agents.push(agent);
    const ran: string[] = [];
    const cmd = command({ command: [process.execPath, '-e', 'console.log(JSON.stringify({ ok: true }))'] });
    agent.handle('q', (job, ctx) => {
      ran.push(ctx.attempt.id);
      return runCommand(cmd, job, ctx, { log, pidDir });
    });
    const acked = once(agent, 'acked');
    await agent.start();
    await acked;

    expect(ran).toEqual([good.attemptId]);
    const started = coordinator.received.filter((m) => m.kind === 'started').flatMap((m) => m.started.attemptIds as string[]);
    expect(started).toEqual([good.attemptId]);
    const completed = coordinator.received.filter((m) => m.kind === 'completed').flatMap((m) => m.completed.results.map((r: any) => r.attemptId));
    expect(completed).toEqual([good.attemptId]);
    // The two refused slots came back at once, before the good job's own.
    const credits = coordinator.received.filter((m) => m.kind === 'credit').map((m) => m.credit.n as number);
    expect(credits[0]).toBe(2);
    const refused = lines.filter((l) => l.event === 'job.refused').map((l) => l.reason);
    expect(refused).toEqual(['the attempt id "../../victim/settings" is not a UUID', 'the job id "../../victim/settings" is not a UUID']);
    expect(lines.find((l) => l.event === 'job.refused')).toMatchObject({ level: 50 });

    expect(readFileSync(victim, 'utf8')).toBe('{"keep":true}');
    expect(await readdir(pidDir)).toEqual([]);
  }, 30_000);
});
