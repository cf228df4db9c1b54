/**
 * Clock jumps, for real: an agent process whose wall clock is stepped by libfaketime (Debian's
 * `faketime`; a timestamp file changed while the process runs, the monotonic clock left alone, as
 * a time service or a person stepping the clock leaves it) while it holds a running attempt.
 * Stepped back and forward by 10 minutes, a healthy attempt goes on; stepped back 10 minutes while
 * its network goes silent, the handler is still aborted on time, its report is refused once the
 * network returns, and every effect through `ctx.step` happened once.
 *
 * Skipped where libfaketime is missing, unless LEASEHOLD_REQUIRE_FAKETIME=1 (CI installs it).
 */
import { existsSync } from 'node:fs';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pino from 'pino';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { createAgent, readOutbox, type Agent } from '@leasehold/agent-client';
import { jobEnqueue } from '../server/store/index.js';
import { agentBundle, spawnAgent, type AgentProcess } from './helpers/agent-process.js';
import { useCoordinator, waitFor } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { checkInvariants } from './helpers/invariants.js';
import { handleWithSteps, startSink, type Sink } from './helpers/sink.js';
import { startProxy, type TcpProxy } from './helpers/tcp-proxy.js';

const LIB = ['/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1', '/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1'].find((f) => existsSync(f));
const missing = LIB ? undefined : 'libfaketime is not installed (apt-get install faketime)';
if (missing && process.env.LEASEHOLD_REQUIRE_FAKETIME === '1') throw new Error(`LEASEHOLD_REQUIRE_FAKETIME=1 but ${missing}`);

const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_LEASE_TTL: '1500ms', LEASEHOLD_CLAIM_TTL: '1500ms', LEASEHOLD_HEARTBEAT_INTERVAL: '300ms' });
let bundlePath = '';
let dir = '';
const procs: AgentProcess[] = [];
const proxies: TcpProxy[] = [];
const inproc: Agent[] = [];
const sinks: Sink[] = [];

describe.skipIf(missing)(`an agent whose wall clock is stepped${missing ? ` (skipped: ${missing})` : ''}`, () => {
  beforeAll(async () => {
    bundlePath = await agentBundle();
    dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-clock-'));
  });
  afterEach(async () => {
    for (const p of procs.splice(0)) await p.kill();
    for (const a of inproc.splice(0)) await a.stop();
    for (const p of proxies.splice(0)) await p.close();
    for (const s of sinks.splice(0)) await s.close();
  });
  afterAll(async () => {
    if (dir) await rm(dir, { recursive: true, force: true });
    if (bundlePath) await rm(bundlePath, { force: true });
  });

  /** The fixture agent (pause mode: a step, workMs, a step) with a wall clock set by `clockFile`. */
  async function steppedAgent(name: string, url: string, sink: Sink) {
    const clockFile = path.join(dir, `${name}.clock`);
    await writeFile(clockFile, '+0\n');
    const outbox = path.join(dir, `${name}-outbox`);
    const p = spawnAgent(bundlePath, {
      LH_URL: url,
      LH_TOKEN: await lh.agent(name),
      LH_OUTBOX: outbox,
      LH_QUEUE: name,
      LH_MODE: 'pause',
      LH_SINK: sink.url,
      LD_PRELOAD: LIB!,
      FAKETIME_TIMESTAMP_FILE: clockFile,
      FAKETIME_NO_CACHE: '1',
      FAKETIME_DONT_FAKE_MONOTONIC: '1',
    });
    procs.push(p);
    await p.waitFor((l) => l.event === 'connected');
    return { p, outbox, step: (offset: string) => writeFile(clockFile, `${offset}\n`) };
  }
  const enqueue = async (queue: string, payload: Record<string, unknown>) => {
    const o = await jobEnqueue(t.pool, { queue, payload });
    if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
    return o.value;
  };
  const row = async (id: string) => (await t.pool.query(`SELECT status::text, attempt_no, result FROM jobs WHERE id = $1`, [id])).rows[0];

  it('keeps a healthy attempt going while its wall clock is stepped 10 minutes back, then forward', async () => {
    const sink = await startSink();
    sinks.push(sink);
    const a = await steppedAgent('clock-steady', lh.url, sink);
    const job = await enqueue('clock-steady', { n: 3, workMs: 4000 });
    await a.p.waitFor((l) => l.msg === 'between steps');
    const seen = (test: (wall: number) => boolean) => a.p.waitFor((l) => l.msg === 'tick' && test(Number(l.wall)), 5000);
    // Each step is seen by the process (its ticks' wall time) while the attempt runs on.
    await a.step('-10m');
    await seen((wall) => wall < Date.now() - 9 * 60_000);
    await a.step('+10m');
    await seen((wall) => wall > Date.now() + 9 * 60_000);
    const forward = a.p.lines.length;
    await a.p.waitFor((l) => l.msg === 'tick' && a.p.lines.indexOf(l) > forward + 1, 5000); // two more slices
    await a.step('+0');
    await waitFor('done', async () => (await row(job.id)).status === 'succeeded', 15_000);
    expect(await row(job.id)).toMatchObject({ status: 'succeeded', attempt_no: 1 });
    expect(a.p.lines.filter((l) => l.event === 'attempt.aborted')).toEqual([]);
    expect(a.p.lines.find((l) => l.msg === 'woke between steps')).toMatchObject({ aborted: false });
    expect(sink.applies.get(`${job.id}:charge`)).toBe(1);
    expect(sink.applies.get(`${job.id}:email`)).toBe(1);
  });

  it('aborts on time when its clock is stepped 10 minutes back as its network goes silent; its late report is refused; every effect once', async () => {
    const sink = await startSink();
    sinks.push(sink);
    const proxy = await startProxy(lh.port);
    proxies.push(proxy);
    const a = await steppedAgent('clock-back', `http://127.0.0.1:${proxy.port}`, sink);
    const job = await enqueue('clock-back', { n: 4, workMs: 10_000 });
    const between = await a.p.waitFor((l) => l.msg === 'between steps');
    const first = String(between.attemptId);
    await a.step('-10m');
    proxy.blackhole();
    const silentAt = performance.now();
    // Aborted by its monotonic deadline (no renewal gets through): within the lease, not 10 min later.
    const woke = await a.p.waitFor((l) => l.msg === 'woke between steps', 5000);
    expect(woke).toMatchObject({ attemptId: first, aborted: true });
    expect(performance.now() - silentAt).toBeLessThan(1500 + 500);

    // Another agent finishes the job (attempt 2): the charge found recorded, the email applied.
    const rescuer = createAgent({ url: lh.url, token: await lh.agent('clock-rescuer'), queues: ['clock-back'], outboxDir: path.join(dir, 'rescuer'), handleSignals: false, log: pino({ level: 'silent' }) });
    inproc.push(rescuer);
    handleWithSteps(rescuer, 'clock-back', sink, 'rescuer');
    await rescuer.start();
    await waitFor('finished by the rescuer', async () => (await row(job.id)).status === 'succeeded', 15_000);

    // The network comes back: the first agent's report is refused and kept aside.
    proxy.cutAll();
    await a.p.waitFor((l) => l.setAside === 'superseded' && l.attemptId === first, 15_000);
    expect((await readOutbox(a.outbox)).superseded).toEqual([expect.objectContaining({ attemptId: first, reason: 'STALE' })]);
    expect(await row(job.id)).toMatchObject({ status: 'succeeded', attempt_no: 2, result: { by: 'rescuer' } });
    expect(sink.applies.get(`${job.id}:charge`)).toBe(1);
    expect(sink.applies.get(`${job.id}:email`)).toBe(1);
    await checkInvariants(t.pool);
  });
});
