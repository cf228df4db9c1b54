/**
 * `leasehold serve` (what `npm start` runs) as a real process on its own embedded PostgreSQL:
 * it comes up, keeps its data between runs, stops cleanly on SIGINT and SIGTERM (database
 * stopped, exit 0), recovers a database left running by a SIGKILLed coordinator, and refuses a
 * bad setting with exit code 2.
 */
import { execFile } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import pg from 'pg';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { killAll, serve as spawnServe, type Proc } from './helpers/serve.js';
import { alive } from './helpers/pids.js';

const root = path.resolve(import.meta.dirname, '..');
const run = promisify(execFile);
let dataDir: string;

/** `leasehold serve` (or another command) on this file's data directory, gRPC and HTTP on free ports. */
function serve(args: string[] = ['serve', '--grpc-addr', '127.0.0.1:0', '--http-addr', '127.0.0.1:0'], env: Record<string, string> = {}, opts: { group?: boolean; npm?: boolean } = {}): Proc {
  return spawnServe(args, { DATABASE_URL: '', LEASEHOLD_DATA_DIR: dataDir, ...env }, opts);
}

function postmasterPid(): number | undefined {
  const f = path.join(dataDir, 'pg', 'postmaster.pid');
  return existsSync(f) ? Number(readFileSync(f, 'utf8').split('\n')[0]) : undefined;
}
/** Resolves once `cond` holds, checking every 50 ms; fails after `ms`. */
async function until(cond: () => boolean, ms: number): Promise<void> {
  const deadline = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > deadline) throw new Error(`not within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 50));
  }
}
/** Whether `pid` is a postgres running on this file's data directory (its command line names it). */
function ourPostmaster(pid: number): boolean {
  try {
    return readFileSync(`/proc/${pid}/cmdline`, 'utf8').split('\0').includes(path.join(dataDir, 'pg'));
  } catch {
    return false;
  }
}

beforeAll(async () => {
  dataDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-serve-'));
});
afterEach(() => killAll());
afterAll(async () => {
  // A server a failed test left running, stopped only if that pid still is it: the file may be
  // stale and its pid another process's by now (the whole suite runs in parallel).
  const pid = postmasterPid();
  if (pid && alive(pid) && ourPostmaster(pid)) process.kill(pid, 'SIGINT');
  await rm(dataDir, { recursive: true, force: true });
});

describe('leasehold serve', () => {
  it('comes up on a new embedded database, answers, and stops cleanly on SIGINT', async () => {
    const p = serve();
    const started = await p.waitFor(/embedded PostgreSQL started/);
    await p.waitFor(/leasehold coordinator ready/);
    expect(p.lines.some((l) => /initialising a new embedded PostgreSQL cluster/.test(String(l.msg)))).toBe(true);
    const journal = JSON.parse(readFileSync(path.join(root, 'server/store/migrations/meta/_journal.json'), 'utf8'));
    expect(p.lines.find((l) => /migrations applied/.test(String(l.msg)))).toMatchObject({ applied: journal.entries.length });

    // gRPC with health and reflection, as an outside client sees it.
    const grpcAddr = String((await p.waitFor(/gRPC listening/)).addr);
    const buf = path.join(root, 'node_modules', '.bin', 'buf');
    const health = await run(buf, ['curl', '--protocol', 'grpc', '--http2-prior-knowledge', `http://${grpcAddr}/grpc.health.v1.Health/Check`]);
    expect(JSON.parse(health.stdout)).toEqual({ status: 'SERVING' });
    const methods = await run(buf, ['curl', '--protocol', 'grpc', '--http2-prior-knowledge', '--list-methods', `http://${grpcAddr}`]);
    expect(methods.stdout).toMatch(/leasehold\.v1\.AgentService\/Connect/);

    const creds = JSON.parse(readFileSync(path.join(dataDir, 'credentials.json'), 'utf8'));
    const c = new pg.Client({ host: '127.0.0.1', port: Number(started.port), user: creds.user, password: creds.password, database: 'postgres' });
    await c.connect();
    const { rows } = await c.query(`SELECT count(*)::int AS n FROM information_schema.tables WHERE table_name IN ('jobs','attempts','job_events','steps','stale_reports')`);
    expect(rows[0].n).toBe(5);
    await c.end();

    const pgPid = postmasterPid()!;
    expect(alive(pgPid)).toBe(true);
    p.child.kill('SIGINT');
    expect(await p.exited).toEqual({ code: 0, signal: null });
    expect(alive(pgPid)).toBe(false);
    expect(postmasterPid()).toBeUndefined();
  });

  it('keeps its data between runs and stops cleanly on SIGTERM', async () => {
    const p = serve();
    await p.waitFor(/leasehold coordinator ready/);
    expect(p.lines.some((l) => /initialising/.test(String(l.msg)))).toBe(false);
    expect(p.lines.find((l) => /schema up to date/.test(String(l.msg)))).toBeDefined();
    p.child.kill('SIGTERM');
    expect(await p.exited).toEqual({ code: 0, signal: null });
    expect(postmasterPid()).toBeUndefined();
  });

  it.skipIf(process.platform === 'win32')('stops cleanly on Ctrl-C in a terminal (SIGINT to its whole process group)', async () => {
    const p = serve(undefined, {}, { group: true });
    await p.waitFor(/leasehold coordinator ready/);
    const pgPid = postmasterPid()!;
    const before = p.lines.length;
    process.kill(-p.child.pid!, 'SIGINT');
    expect(await p.exited).toEqual({ code: 0, signal: null });
    expect(alive(pgPid)).toBe(false);
    // The database stops after the coordinator, not with it: no connection lost on the way out.
    expect(p.lines.slice(before).filter((l) => Number(l.level) >= 40)).toEqual([]);
    expect(p.lines.slice(before).some((l) => /embedded PostgreSQL stopped/.test(String(l.msg)))).toBe(true);
  });

  for (const signal of ['SIGTERM', 'SIGINT', 'SIGKILL'] as const) {
    it.skipIf(process.platform === 'win32')(`npm start stops cleanly, database included, when only npm gets ${signal}`, async () => {
      // What Docker, pm2 and service wrappers do: signal npm, not what it started (SIGKILL: what
      // they do after their timeout, and what any signal to npm amounts to on Windows).
      const p = serve(undefined, {}, { npm: true });
      const ready = await p.waitFor(/leasehold coordinator ready/);
      const coordinatorPid = Number(ready.pid);
      expect(coordinatorPid).not.toBe(p.child.pid);
      const pgPid = postmasterPid()!;
      const before = p.lines.length;
      p.child.kill(signal);
      // SIGTERM and SIGINT reach the coordinator (npm forwards them, and the script execs node);
      // after SIGKILL it sees within a second that npm is gone.
      await p.waitFor(/^stopped$/);
      await until(() => !alive(coordinatorPid) && !alive(pgPid), 10_000);
      expect(await p.exited).toEqual(signal === 'SIGKILL' ? { code: null, signal: 'SIGKILL' } : { code: 0, signal: null });
      expect(postmasterPid()).toBeUndefined();
      const after = p.lines.slice(before);
      expect(after.filter((l) => l.event === 'stopping')).toHaveLength(1);
      if (signal === 'SIGKILL') expect(after.find((l) => /the process that started this one is gone/.test(String(l.msg)))).toBeDefined();
      expect(after.filter((l) => Number(l.level) >= 40)).toEqual([]);
    });
  }

  it.skipIf(process.platform === 'win32')('npm start stops cleanly on Ctrl-C in a terminal (SIGINT to npm, its shell and the coordinator)', async () => {
    const p = serve(undefined, {}, { npm: true, group: true });
    const ready = await p.waitFor(/leasehold coordinator ready/);
    const pgPid = postmasterPid()!;
    const before = p.lines.length;
    process.kill(-p.child.pid!, 'SIGINT');
    await p.waitFor(/^stopped$/);
    await until(() => !alive(Number(ready.pid)) && !alive(pgPid), 10_000);
    // One clean stop: the signal, not the launcher's end, and no warning on the way out.
    const after = p.lines.slice(before);
    expect(after.filter((l) => l.event === 'stopping')).toHaveLength(1);
    expect(after.filter((l) => Number(l.level) >= 40)).toEqual([]);
  });

  it('stops a database left running by a SIGKILLed coordinator and starts again', async () => {
    const p = serve();
    await p.waitFor(/leasehold coordinator ready/);
    const orphan = postmasterPid()!;
    p.child.kill('SIGKILL');
    await p.exited;
    expect(alive(orphan)).toBe(true);

    const q = serve();
    await q.waitFor(/leasehold coordinator ready/);
    expect(q.lines.some((l) => /left running by a coordinator that is gone/.test(String(l.msg)))).toBe(true);
    expect(alive(orphan)).toBe(false);
    q.child.kill('SIGINT');
    expect((await q.exited).code).toBe(0);
  });

  it('migrate applies nothing on an up-to-date database and exits 0', async () => {
    const p = serve(['migrate']);
    expect((await p.exited).code).toBe(0);
    expect(p.lines.find((l) => /schema up to date/.test(String(l.msg)))).toBeDefined();
    expect(postmasterPid()).toBeUndefined();
  });

  it('refuses a bad setting with exit code 2 and a message naming it', async () => {
    const p = serve(['serve'], { LEASEHOLD_LEASE_TTL: 'soon' });
    expect((await p.exited).code).toBe(2);
    expect(p.lines.map((l) => String(l.msg)).join('\n')).toMatch(/LEASEHOLD_LEASE_TTL="soon" is not a duration/);
  });

  it('refuses to listen beyond loopback in cleartext unless told to (--insecure), and warns when told', async () => {
    const refused = serve(['serve', '--grpc-addr', '127.0.0.1:0', '--http-addr', '0.0.0.0:0']);
    expect((await refused.exited).code).toBe(2);
    expect(refused.lines.map((l) => String(l.msg)).join('\n')).toMatch(/refusing to listen for HTTP on 0\.0\.0\.0:0 .* without TLS/);
    expect(postmasterPid(), 'refused before the database started').toBeUndefined();

    const told = serve(['serve', '--grpc-addr', '127.0.0.1:0', '--http-addr', '0.0.0.0:0', '--insecure']);
    try {
      await told.waitFor(/^HTTP listening$/);
      const warning = told.lines.find((l) => String(l.msg).startsWith('cleartext listeners beyond loopback'));
      expect(warning).toMatchObject({ addrs: ['0.0.0.0:0'], reason: '--insecure' });
    } finally {
      told.child.kill('SIGTERM');
      await told.exited;
    }
  });
});
