/**
 * `npm run chaos -- --duration 120`: break everything on purpose and check every job afterwards.
 *
 * Three coordinator replicas on one PostgreSQL; six SDK agent processes (two steps per job
 * against a downstream effect sink, reconciling unknown steps through it) connected through TCP
 * fault proxies; two n8n-like notification receivers (one per subscription, one per notify_url)
 * that verify signatures and dedupe by event id, and answer 500 now and then. Jobs are enqueued
 * all along through the HTTP gateway of any live replica, with idempotency keys. Meanwhile, from
 * the fault menu (`--faults`, all by default): agents and replicas SIGKILLed at random, agents and
 * replicas frozen (SIGSTOP, then SIGCONT) for less and for more than the lease, agents' wall
 * clocks stepped 10 minutes back or forward (libfaketime), connections reset, delayed, silenced
 * and half-opened, and PostgreSQL restarted once. Then everything comes back, the run drains, and
 * the checks run:
 *
 * - every job enqueued is terminal (and, with a generous attempt cap, succeeded);
 * - every step's effect was applied exactly once at the sink;
 * - no write was accepted from a non-current attempt, and every job's row rebuilds from its
 *   events (the invariant checker over the whole database);
 * - every report an agent had refused as stale is in `stale_reports`;
 * - every terminal notification reached its receivers and, deduplicated by event id, was seen
 *   exactly once, each with a valid signature.
 *
 * Prints one line of figures and exits non-zero on any violation. `npm test` runs 20 seconds of it.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { createWriteStream, existsSync, readFileSync, writeFileSync } from 'node:fs';
import http from 'node:http';
import { chmod, mkdir, mkdtemp, rm } from 'node:fs/promises';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { Command } from 'commander';
import pino from 'pino';
import { startEmbedded, type EmbeddedDatabase } from '../../server/store/embedded.js';
import { agentCreate, migrateDatabase, signingSecretGet, subscriptionCreate } from '../../server/store/index.js';
import { signDelivery, WEBHOOK_HEADERS } from '../../server/core/webhook-deliverer.js';
import { agentBundle } from '../helpers/agent-process.js';
import { freePort } from '../helpers/ports.js'; // below the ephemeral range: replicas and PostgreSQL restart on theirs
import { checkInvariants } from '../helpers/invariants.js';
import { mono, startSink } from '../helpers/sink.js';
import { quietPool } from '../helpers/quiet-pool.js';
import { startFaultProxy, type FaultProxy } from './fault-proxy.js';

const here = path.dirname(new URL(import.meta.url).pathname);
const root = path.resolve(here, '../..');
const ADMIN = 'chaos-admin-key';
const QUEUE = 'chaos';
/** The lease of the run's replicas; pauses are drawn shorter and longer than it. */
const LEASE_MS = 2000;
const HEARTBEAT_MS = 400;

/** What the run can break; `--faults` picks some (all by default). */
export const FAULTS = ['agent-kill', 'replica-kill', 'agent-pause', 'replica-pause', 'clock', 'network', 'pg-restart'] as const;
export type Fault = (typeof FAULTS)[number];
/** How often each fault is drawn, relative to the others chosen. */
const WEIGHT: Record<Exclude<Fault, 'pg-restart'>, number> = {
  'agent-kill': 0.25,
  'replica-kill': 0.12,
  'agent-pause': 0.1,
  'replica-pause': 0.07,
  clock: 0.08,
  network: 0.38,
};

/** libfaketime (Debian's `faketime`), which steps an agent's wall clock for the `clock` fault. */
export const FAKETIME_LIB = ['/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1', '/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1'].find((f) => existsSync(f));

/** Parses `--faults` (`all`, or names separated by commas); throws on an unknown name. */
export function parseFaults(text: string): Fault[] {
  if (text.trim() === 'all') return [...FAULTS];
  const names = text.split(',').map((n) => n.trim()).filter(Boolean);
  const bad = names.filter((n) => !(FAULTS as readonly string[]).includes(n));
  if (bad.length || !names.length) throw new Error(`--faults: unknown ${bad.length ? bad.join(', ') : '(empty)'}; choose from all, ${FAULTS.join(', ')}`);
  return [...new Set(names)] as Fault[];
}

export interface ChaosOptions {
  durationSec: number;
  replicas: number;
  agents: number;
  /** Jobs enqueued per second while the chaos lasts. */
  rate: number;
  /** What to break (default: all of FAULTS). `clock` needs libfaketime. */
  faults?: readonly Fault[];
  seed?: number;
  log: (line: string) => void;
}

export interface ChaosReport {
  line: string;
  violations: string[];
  figures: Record<string, number>;
}

/** A small seeded PRNG (mulberry32), so a failing run can be replayed with its seed. */
function prng(seed: number) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

interface Proc {
  child: ChildProcess;
  exited: Promise<void>;
}

function startProc(cmd: string, args: string[], env: NodeJS.ProcessEnv, logFile: string): Proc {
  const child = spawn(cmd, args, { cwd: root, env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  const out = createWriteStream(logFile, { flags: 'a' });
  child.stdout!.pipe(out);
  child.stderr!.pipe(out);
  const exited = new Promise<void>((r) => child.once('exit', () => r()));
  return { child, exited };
}

async function kill(p: Proc | undefined): Promise<void> {
  if (!p || p.child.exitCode !== null || p.child.signalCode !== null) return;
  p.child.kill('SIGKILL');
  await p.exited;
}

/** Runs the chaos; resolves with the figures and the violations found (none: it passed). */
export async function chaos(o: ChaosOptions): Promise<ChaosReport> {
  const rand = prng(o.seed ?? Date.now());
  const faults = new Set<Fault>(o.faults ?? FAULTS);
  if (faults.has('clock') && !FAKETIME_LIB) throw new Error('the clock fault needs libfaketime: apt-get install faketime (or leave clock out of --faults)');
  const work = await mkdtemp(path.join(os.tmpdir(), 'leasehold-chaos-'));
  await chmod(work, 0o755); // the database runs as the postgres user when we are root: let it in
  const logs = path.join(work, 'logs');
  await mkdir(logs, { recursive: true });
  const figures: Record<string, number> = {
    jobs: 0,
    agentKills: 0,
    replicaKills: 0,
    agentPauses: 0,
    agentPausesPastLease: 0,
    replicaPauses: 0,
    replicaPausesPastLease: 0,
    clockSteps: 0,
    resets: 0,
    delays: 0,
    silences: 0,
    halfOpens: 0,
    pgRestarts: 0,
    staleReports: 0,
    lateApplies: 0,
    notifications: 0,
    deliveries: 0,
    receiver500s: 0,
    lost: 0,
    duplicated: 0,
  };
  const violations: string[] = [];
  let db: EmbeddedDatabase | undefined;
  const cleanup: Array<() => Promise<unknown>> = [];
  // Whether the run got to its report; a run that did not keeps its logs for the error to point at.
  let reported = false;
  try {
    // ── PostgreSQL, kept on one port so a restart is found again ──
    const pgPort = await freePort();
    const dataDir = path.join(work, 'pg');
    const startDb = () =>
      startEmbedded({ dataDir, log: pino({ level: 'warn' }), port: pgPort, settings: { max_connections: '300' } });
    db = await startDb();
    const url = db.url;
    const pool = quietPool({ connectionString: url, max: 4 });
    cleanup.push(() => pool.end());
    await migrateDatabase(pool);

    // ── receivers, sink ──
    const received = { sub: new Map<string, number>(), notify: new Map<string, number>() };
    const badSignatures: string[] = [];
    const notifySecret = await signingSecretGet(pool);
    const receiver = (kind: 'sub' | 'notify', secret: () => string) =>
      http.createServer((req, res) => {
        let body = '';
        req.on('data', (c) => (body += c));
        req.on('end', () => {
          const id = String(req.headers[WEBHOOK_HEADERS.eventId]);
          const ts = Number(req.headers[WEBHOOK_HEADERS.timestamp]);
          if (req.headers[WEBHOOK_HEADERS.signature] !== signDelivery(secret(), ts, body)) {
            badSignatures.push(id);
            res.writeHead(401).end();
            return;
          }
          figures.deliveries!++;
          if (rand() < 0.1) {
            figures.receiver500s!++;
            res.writeHead(500).end(); // n8n is down now and then: the deliverer must retry
            return;
          }
          received[kind].set(id, (received[kind].get(id) ?? 0) + 1);
          res.writeHead(200).end('{}');
        });
      });
    let subSecret = '';
    const subServer = receiver('sub', () => subSecret);
    const notifyServer = receiver('notify', () => notifySecret);
    // A downstream that checks the attempt number as a fencing token, as docs/agent.md advises.
    const sink = await startSink(undefined, { fence: true });
    cleanup.push(() => sink.close());
    const { applies } = sink;
    for (const s of [subServer, notifyServer]) {
      await new Promise<void>((r) => s.listen(0, '127.0.0.1', () => r()));
      cleanup.push(() => new Promise((r) => s.close(r)));
    }
    const portOf = (s: http.Server) => (s.address() as net.AddressInfo).port;
    const sub = await subscriptionCreate(pool, { queue: QUEUE, url: `http://127.0.0.1:${portOf(subServer)}/hook` });
    if (sub.outcome !== 'ok') throw new Error(JSON.stringify(sub));
    subSecret = sub.value.secret;

    // ── replicas, each behind a fault proxy for the agents ──
    const replicas = await Promise.all(
      Array.from({ length: o.replicas }, async (_, i) => ({ i, grpc: await freePort(), http: await freePort(), proc: undefined as Proc | undefined })),
    );
    const startReplica = (r: (typeof replicas)[number]) => {
      r.proc = startProc(
        process.execPath,
        ['--import', 'tsx', 'server/cli.ts', 'serve', '--grpc-addr', `127.0.0.1:${r.grpc}`, '--http-addr', `127.0.0.1:${r.http}`],
        {
          DATABASE_URL: url,
          LEASEHOLD_ADMIN_KEY: ADMIN,
          LEASEHOLD_LEASE_TTL: `${LEASE_MS}ms`,
          LEASEHOLD_CLAIM_TTL: `${LEASE_MS}ms`,
          LEASEHOLD_HEARTBEAT_INTERVAL: `${HEARTBEAT_MS}ms`,
          LEASEHOLD_REAPER_INTERVAL: '200ms',
          LEASEHOLD_WEBHOOK_INTERVAL: '200ms',
          LEASEHOLD_WEBHOOK_BACKOFF: '200ms',
          LEASEHOLD_WEBHOOK_TIMEOUT: '2s',
          LEASEHOLD_WEBHOOK_MAX_ATTEMPTS: '100',
          LEASEHOLD_LOG_LEVEL: 'warn',
          LEASEHOLD_LOG_FORMAT: 'json',
        },
        path.join(logs, `replica-${r.i}.log`),
      );
    };
    for (const r of replicas) startReplica(r);
    cleanup.push(async () => {
      for (const r of replicas) await kill(r.proc);
    });
    const proxies: FaultProxy[] = [];
    for (const r of replicas) proxies.push(await startFaultProxy(r.grpc));
    cleanup.push(async () => {
      for (const p of proxies) await p.close();
    });
    const httpUp = async (r: (typeof replicas)[number]) => {
      try {
        const res = await fetch(`http://127.0.0.1:${r.http}/healthz`, { signal: AbortSignal.timeout(1000) });
        return res.ok;
      } catch {
        return false;
      }
    };
    for (const r of replicas) {
      const until = Date.now() + 60_000;
      while (!(await httpUp(r))) {
        if (Date.now() > until) throw new Error(`replica ${r.i} did not come up (see ${logs})`);
        await sleep(200);
      }
    }

    // ── agents ──
    const bundle = await agentBundle();
    const agents = await Promise.all(
      Array.from({ length: o.agents }, async (_, i) => {
        const created = await agentCreate(pool, { agentId: `chaos-agent-${i}` });
        if (created.outcome !== 'ok') throw new Error(JSON.stringify(created));
        // Each agent lists the replicas from a different one, so they spread out.
        const urls = proxies.map((_, k) => `127.0.0.1:${proxies[(i + k) % proxies.length]!.port}`);
        return {
          i,
          token: created.value.token,
          urls,
          outbox: path.join(work, `outbox-${i}`),
          log: path.join(logs, `agent-${i}.log`),
          clock: path.join(work, `clock-${i}`),
          proc: undefined as Proc | undefined,
        };
      }),
    );
    // With the clock fault, every agent runs under libfaketime, its wall clock read from a file
    // (re-read every second) that a step rewrites; its monotonic clock is left alone, as a time
    // service or a person stepping the clock leaves it.
    const clockEnv = (a: (typeof agents)[number]) =>
      faults.has('clock')
        ? { LD_PRELOAD: FAKETIME_LIB!, FAKETIME_TIMESTAMP_FILE: a.clock, FAKETIME_CACHE_DURATION: '1', FAKETIME_DONT_FAKE_MONOTONIC: '1' }
        : {};
    for (const a of agents) writeFileSync(a.clock, '+0\n');
    const startAgent = (a: (typeof agents)[number]) => {
      a.proc = startProc(
        process.execPath,
        [bundle],
        { LH_URL: a.urls.join(','), LH_TOKEN: a.token, LH_OUTBOX: a.outbox, LH_QUEUE: QUEUE, LH_MODE: 'sink', LH_SLOTS: '2', LH_SINK: sink.url, LEASEHOLD_LOG_LEVEL: 'info', ...clockEnv(a) },
        a.log,
      );
    };
    for (const a of agents) startAgent(a);
    cleanup.push(async () => {
      for (const a of agents) await kill(a.proc);
    });

    // ── the load: jobs through the gateway of any live replica, retried with their key ──
    const enqueued = new Map<string, string>(); // idempotency key → job id
    let enqueuing = true;
    const enqueueOne = async (n: number) => {
      const key = `chaos-${n}`;
      const body = JSON.stringify({
        queue: QUEUE,
        payload: { n },
        idempotencyKey: key,
        maxAttempts: 100,
        ...(n % 2 ? { notifyUrl: `http://127.0.0.1:${portOf(notifyServer)}/notify` } : {}),
      });
      for (let attempt = 0; ; attempt++) {
        const r = replicas[Math.floor(rand() * replicas.length)]!;
        try {
          const res = await fetch(`http://127.0.0.1:${r.http}/leasehold.v1.JobService/EnqueueJob`, {
            method: 'POST',
            headers: { 'content-type': 'application/json', authorization: `Bearer ${ADMIN}` },
            body,
            signal: AbortSignal.timeout(5000),
          });
          if (res.ok) {
            const j = (await res.json()) as { job: { id: string } };
            enqueued.set(key, j.job.id);
            return;
          }
        } catch {
          // that replica is down or the database is restarting: try again, same key
        }
        if (attempt > 200) throw new Error(`could not enqueue ${key}`);
        await sleep(100);
      }
    };
    const loader = (async () => {
      let n = 0;
      const pending: Promise<void>[] = [];
      while (enqueuing) {
        pending.push(enqueueOne(n++));
        await sleep(1000 / o.rate);
      }
      await Promise.all(pending);
    })();

    // ── the chaos ──
    const endAt = Date.now() + o.durationSec * 1000;
    const pgRestartAt = Date.now() + o.durationSec * 1000 * 0.4;
    let pgRestarted = !faults.has('pg-restart');
    const restarts: Promise<void>[] = [];
    const menu = (Object.keys(WEIGHT) as Array<keyof typeof WEIGHT>).filter((f) => faults.has(f));
    const total = menu.reduce((n, f) => n + WEIGHT[f], 0);
    // Every kind on the menu comes first, once each in a random order, so that a short run (the
    // 20 s of npm test) exercises each whatever the seed. A kind drawn when it cannot be applied
    // (its target dead or frozen) goes to the back of the line and is drawn again, up to
    // OWED_TRIES times (a kind that can never apply, a replica fault with one replica, must not
    // hold up the rest). Then by weight.
    const OWED_TRIES = 5;
    const owed = menu.map((kind) => ({ kind, tries: 0 }));
    for (let i = owed.length - 1; i > 0; i--) {
      const j = Math.floor(rand() * (i + 1));
      [owed[i], owed[j]] = [owed[j]!, owed[i]!];
    }
    const applied = () =>
      figures.agentKills! + figures.replicaKills! + figures.agentPauses! + figures.replicaPauses! + figures.clockSteps! + figures.resets! + figures.delays! + figures.silences! + figures.halfOpens!;
    let appliedBefore = 0;
    let drewOwed = false;
    const draw = (): keyof typeof WEIGHT | undefined => {
      // The owed kind drawn last time is at the front: applied, it is paid; else it waits.
      if (drewOwed) {
        const last = owed.shift()!;
        if (applied() === appliedBefore && ++last.tries < OWED_TRIES) owed.push(last);
      }
      appliedBefore = applied();
      drewOwed = owed.length > 0;
      if (drewOwed) return owed[0]!.kind;
      let x = rand() * total;
      for (const f of menu) if ((x -= WEIGHT[f]) < 0) return f;
      return menu.at(-1);
    };
    const running = (p: Proc | undefined): p is Proc => Boolean(p && p.child.exitCode === null && p.child.signalCode === null);
    const paused = new Set<Proc>();
    /** Each pause, on this machine's monotonic clock (the sink's and the agents' `mono`), by whom. */
    const pauses: Array<{ who: string; from: number; to?: number }> = [];
    /** Neither dead nor frozen. */
    const live = (p: Proc | undefined): p is Proc => running(p) && !paused.has(p);
    /** Freezes `p` for less or (half the time) more than the lease, then lets it run again. */
    const pause = (p: Proc, who: string): boolean => {
      const past = rand() < 0.5;
      const ms = past ? LEASE_MS * (1.25 + rand() * 1.5) : LEASE_MS * (0.15 + rand() * 0.6);
      paused.add(p);
      const at = { who, from: mono(), to: undefined as number | undefined };
      pauses.push(at);
      p.child.kill('SIGSTOP');
      restarts.push(
        sleep(ms).then(() => {
          paused.delete(p);
          if (running(p)) p.child.kill('SIGCONT');
          at.to = mono();
        }),
      );
      return past;
    };
    while (Date.now() < endAt) {
      await sleep(300 + rand() * 900);
      if (!pgRestarted && Date.now() > pgRestartAt) {
        pgRestarted = true;
        figures.pgRestarts!++;
        o.log(`chaos: restarting PostgreSQL`);
        await db.stop();
        await sleep(500 + rand() * 1000);
        db = await startDb();
        continue;
      }
      const fault = draw();
      if (fault === 'agent-kill') {
        const a = agents[Math.floor(rand() * agents.length)]!;
        if (!running(a.proc)) continue;
        figures.agentKills!++;
        paused.delete(a.proc);
        await kill(a.proc);
        restarts.push(sleep(200 + rand() * 1500).then(() => startAgent(a)));
      } else if (fault === 'replica-kill' || fault === 'replica-pause') {
        // Never the last replica that runs.
        const r = replicas[Math.floor(rand() * replicas.length)]!;
        if (!live(r.proc) || replicas.filter((q) => live(q.proc)).length <= 1) continue;
        if (fault === 'replica-pause') {
          figures.replicaPauses!++;
          if (pause(r.proc, `replica-${r.i}`)) figures.replicaPausesPastLease!++;
          continue;
        }
        figures.replicaKills!++;
        await kill(r.proc);
        restarts.push(sleep(500 + rand() * 2000).then(() => startReplica(r)));
      } else if (fault === 'agent-pause') {
        const a = agents[Math.floor(rand() * agents.length)]!;
        if (!live(a.proc)) continue;
        figures.agentPauses!++;
        if (pause(a.proc, `chaos-agent-${a.i}`)) figures.agentPausesPastLease!++;
      } else if (fault === 'clock') {
        // Stepped 10 minutes back or forward, and back to true time 1–4 s later.
        const a = agents[Math.floor(rand() * agents.length)]!;
        figures.clockSteps!++;
        writeFileSync(a.clock, rand() < 0.5 ? '-10m\n' : '+10m\n');
        restarts.push(sleep(1000 + rand() * 3000).then(() => writeFileSync(a.clock, '+0\n')));
      } else if (fault === 'network') {
        const p = proxies[Math.floor(rand() * proxies.length)]!;
        const y = rand();
        const kind = y < 0.3 ? 'reset' : y < 0.55 ? 'delay' : y < 0.8 ? 'drop' : 'half-open';
        if (kind === 'reset') {
          figures.resets!++;
          p.reset();
          continue;
        }
        if (kind === 'delay') {
          figures.delays!++;
          p.set({ kind: 'delay', ms: 50 + Math.floor(rand() * 400) });
        } else if (kind === 'drop') {
          figures.silences!++;
          p.set({ kind: 'drop' });
        } else {
          figures.halfOpens!++;
          p.set({ kind: 'half-open' });
        }
        restarts.push(
          sleep(500 + rand() * 2500).then(() => {
            p.set({ kind: 'ok' });
            if (kind !== 'delay') p.reset(); // a silence ends like a real one: the connections are dead
          }),
        );
      }
    }
    enqueuing = false;
    await loader;
    await Promise.all(restarts);
    for (const p of proxies) p.set({ kind: 'ok' });
    // Everything comes back (the pauses ended with the restarts).
    for (const r of replicas) if (!running(r.proc)) startReplica(r);
    for (const a of agents) if (!running(a.proc)) startAgent(a);
    figures.jobs = enqueued.size;
    o.log(`chaos over: ${enqueued.size} jobs enqueued; draining`);

    // ── drain ──
    const ids = [...enqueued.values()];
    const settled = async (what: string, check: () => Promise<boolean>, ms: number) => {
      const until = Date.now() + ms;
      while (!(await check().catch(() => false))) {
        if (Date.now() > until) {
          violations.push(`${what} did not happen within ${ms / 1000} s`);
          return;
        }
        await sleep(250);
      }
    };
    await settled(
      'every job terminal',
      async () => Number((await pool.query(`SELECT count(*) AS n FROM jobs WHERE id = ANY($1::uuid[]) AND status IN ('queued', 'claimed', 'running')`, [ids])).rows[0].n) === 0,
      120_000,
    );
    await settled(
      'every notification delivered',
      async () => Number((await pool.query(`SELECT count(*) AS n FROM webhook_deliveries WHERE status <> 'delivered'`)).rows[0].n) === 0,
      90_000,
    );

    // ── checks ──
    const statuses = (await pool.query(`SELECT status::text, count(*)::int AS n FROM jobs WHERE id = ANY($1::uuid[]) GROUP BY status`, [ids])).rows;
    const byStatus = Object.fromEntries(statuses.map((r) => [r.status, r.n])) as Record<string, number>;
    const known = Number((await pool.query(`SELECT count(*) AS n FROM jobs WHERE id = ANY($1::uuid[])`, [ids])).rows[0].n);
    figures.lost = ids.length - known + (byStatus.queued ?? 0) + (byStatus.claimed ?? 0) + (byStatus.running ?? 0);
    if (figures.lost) {
      violations.push(`${figures.lost} job(s) missing or never finished`);
      // What they look like, to tell why.
      const stuck = (await pool.query(`SELECT id, status::text, attempt_no, attempts_started, agent_id, lease_expires_at, run_at, current_attempt_id FROM jobs WHERE id = ANY($1::uuid[]) AND status IN ('queued', 'claimed', 'running')`, [ids])).rows;
      for (const j of stuck.slice(0, 5)) {
        const at = (await pool.query(`SELECT attempt_no, agent_id, status::text, claimed_at, started_at, ended_at, suspect_since FROM attempt_log WHERE job_id = $1 ORDER BY attempt_no`, [j.id])).rows;
        const ev = (await pool.query(`SELECT kind::text, at FROM job_events WHERE job_id = $1 ORDER BY id`, [j.id])).rows;
        violations.push(`stuck ${JSON.stringify(j)} attempts ${JSON.stringify(at)} events ${JSON.stringify(ev.map((e) => `${e.kind}@${(e.at as Date).toISOString().slice(11, 23)}`))} now ${new Date().toISOString().slice(11, 23)}`);
      }
    }
    for (const s of ['failed', 'dead', 'canceled']) if (byStatus[s]) violations.push(`${byStatus[s]} job(s) ${s} (none expected: every job can succeed)`);
    figures.succeeded = byStatus.succeeded ?? 0;

    // Applies the fencing refused. An attempt passes its step's lease check only while its
    // local deadline runs, at least one heartbeat interval before the coordinator's lease ends,
    // and no later attempt can touch the key before that lease ends: so a refused apply took
    // longer than one interval from that check to the sink (the fixture sends the check's own
    // clock reading, from the agent's `effect` event). It was frozen between the check and its
    // request leaving (the window docs/agent.md names). One that took less was let through by a
    // lease check that should have stopped it.
    for (const l of sink.late) {
      if (l.delayMs !== undefined && l.delayMs >= HEARTBEAT_MS) figures.lateApplies!++;
      else {
        // What is needed to tell why: the attempt's agent's pauses of the last lease and a half,
        // and its step's reservation, against when its lease check passed (ms before it reached the sink).
        const agent = (await pool.query(`SELECT agent_id FROM attempt_log WHERE id = $1`, [l.attemptId])).rows[0]?.agent_id as string | undefined;
        const near = pauses
          .filter((p) => p.who === agent && (p.to ?? Infinity) >= l.at - 1.5 * LEASE_MS - 5_000 && p.from <= l.at)
          .map((p) => `paused ${l.at - p.from} ms before it reached the sink, for ${p.to === undefined ? '?' : p.to - p.from} ms`);
        const step = (await pool.query(`SELECT started_at, finished_at, reservations FROM steps WHERE job_id::text || ':' || step = $1`, [l.key])).rows[0];
        violations.push(
          `apply of ${l.key} by attempt ${l.attemptNo} (${l.attemptId}, ${agent}) reached the sink ${l.delayMs} ms after its lease check passed with ${l.leaseLeftMs} ms of its local lease left, after attempt ${l.newest} had touched the key: its lease check passed too late ` +
            `(${near.join('; ') || 'no pause of its agent'}; the step ${JSON.stringify(step)}, the sink's wall clock ${new Date(l.wall).toISOString()})`,
        );
      }
    }
    for (const id of ids) {
      for (const step of ['charge', 'email']) {
        const n = applies.get(`${id}:${step}`) ?? 0;
        if (n > 1) {
          figures.duplicated!++;
          // What is needed to tell why: which attempts applied it and when, and each attempt's life.
          const calls = (sink.history.get(`${id}:${step}`) ?? []).map((c) => `${c.attemptId}@${new Date(c.at).toISOString().slice(11, 23)}`);
          const at = (await pool.query(`SELECT id, attempt_no, agent_id, status::text, claimed_at, started_at, ended_at, suspect_since FROM attempt_log WHERE job_id = $1 ORDER BY attempt_no`, [id])).rows;
          violations.push(`effect ${id}:${step} applied ${n} times: ${calls.join(', ')}; attempts ${JSON.stringify(at)}`);
        }
        if (n === 0 && byStatus.succeeded) {
          const ok = (await pool.query(`SELECT status::text FROM jobs WHERE id = $1`, [id])).rows[0]?.status === 'succeeded';
          if (ok) violations.push(`job ${id} succeeded without its ${step} effect`);
        }
      }
    }

    try {
      await checkInvariants(pool);
    } catch (err) {
      violations.push((err as Error).message);
    }

    const refused = new Set<string>();
    for (const a of agents) {
      if (!existsSync(a.log)) continue;
      for (const line of readFileSync(a.log, 'utf8').split('\n')) {
        if (!line.includes('report refused as stale')) continue;
        try {
          refused.add(String((JSON.parse(line) as { attemptId: string }).attemptId));
        } catch {
          // a torn last line of a killed agent
        }
      }
    }
    // A process that crashed (an uncaught exception or rejection: Node prints its stack and its
    // version as it exits) is a violation even though the run restarted it and lost nothing:
    // every kill of this run is a SIGKILL, which prints nothing.
    for (const file of [...replicas.map((r) => path.join(logs, `replica-${r.i}.log`)), ...agents.map((a) => a.log)]) {
      if (!existsSync(file)) continue;
      const text = readFileSync(file, 'utf8');
      for (const m of text.matchAll(/^Node\.js v\d+\.\d+\.\d+$/gm)) {
        const before = text.slice(Math.max(0, m.index - 2000), m.index).split('\n');
        const cause = before.findLast((l) => /^\w*Error\b|^\s*(throw|Error|error):|Uncaught|Unhandled/.test(l)) ?? before.filter(Boolean).slice(-3).join(' | ');
        violations.push(`${path.basename(file, '.log')} crashed: ${cause.trim().slice(0, 300)}`);
      }
    }

    const logged = new Set((await pool.query(`SELECT DISTINCT attempt_id FROM stale_reports`)).rows.map((r) => r.attempt_id as string));
    figures.staleReports = Number((await pool.query(`SELECT count(*) AS n FROM stale_reports`)).rows[0].n);
    for (const id of refused) if (!logged.has(id)) violations.push(`stale report of attempt ${id} refused to the agent but not in stale_reports`);

    const events = (
      await pool.query(
        `SELECT e.id, e.job_id, e.type::text, array_agg(CASE WHEN d.subscription_id IS NULL THEN 'notify' ELSE 'sub' END) AS targets
         FROM webhook_events e JOIN webhook_deliveries d ON d.event_id = e.id GROUP BY e.id`,
      )
    ).rows as Array<{ id: string; job_id: string; type: string; targets: string[] }>;
    figures.notifications = events.length;
    const perJob = new Map<string, number>();
    for (const e of events) {
      perJob.set(e.job_id, (perJob.get(e.job_id) ?? 0) + 1);
      for (const t of new Set(e.targets)) {
        const seen = received[t as 'sub' | 'notify'].get(e.id) ?? 0;
        if (seen === 0) violations.push(`notification ${e.type} ${e.id} of job ${e.job_id} never reached its ${t} receiver`);
      }
    }
    for (const [job, n] of perJob) if (n > 1) violations.push(`job ${job} has ${n} terminal notifications`);
    for (const id of ids) if (byStatus.succeeded && !perJob.has(id)) violations.push(`job ${id} has no terminal notification`);
    const knownEvents = new Set(events.map((e) => e.id));
    for (const kind of ['sub', 'notify'] as const) for (const id of received[kind].keys()) if (!knownEvents.has(id)) violations.push(`receiver ${kind} saw unknown event ${id}`);
    if (badSignatures.length) violations.push(`${badSignatures.length} deliveries with a bad signature`);

    const line =
      `chaos ${o.durationSec}s seed=${o.seed ?? 'time'}: jobs=${figures.jobs} succeeded=${figures.succeeded} ` +
      `faults=${[...faults].join(',')} ` +
      `agent-kills=${figures.agentKills} replica-kills=${figures.replicaKills} pg-restarts=${figures.pgRestarts} ` +
      `agent-pauses=${figures.agentPauses}(${figures.agentPausesPastLease} past the lease) replica-pauses=${figures.replicaPauses}(${figures.replicaPausesPastLease} past the lease) clock-steps=${figures.clockSteps} ` +
      `resets=${figures.resets} delays=${figures.delays} silences=${figures.silences} half-opens=${figures.halfOpens} ` +
      `stale-reports=${figures.staleReports} late-applies-refused=${figures.lateApplies} notifications=${figures.notifications} deliveries=${figures.deliveries} receiver-500s=${figures.receiver500s} ` +
      `lost=${figures.lost} duplicated=${figures.duplicated} violations=${violations.length}`;
    reported = true;
    return { line, violations, figures };
  } finally {
    for (const c of cleanup.reverse()) await c().catch(() => undefined);
    await db?.stop().catch(() => undefined);
    if (process.env.LEASEHOLD_CHAOS_KEEP || !reported || violations.length) o.log(`kept ${work}`);
    else await rm(work, { recursive: true, force: true });
  }
}

const isMain = process.argv[1] && path.resolve(process.argv[1]) === path.resolve(new URL(import.meta.url).pathname);
if (isMain) {
  const f = new Command()
    .name('chaos')
    .option('--duration <seconds>', 'how long the chaos lasts', '120')
    .option('--rate <jobs>', 'jobs enqueued per second', '20')
    .option('--seed <n>', 'random seed (default: the time)')
    .option('--faults <list>', `what to break: all, or some of ${FAULTS.join(',')}`, 'all')
    .parse()
    .opts<{ duration: string; rate: string; seed?: string; faults: string }>();
  const seed = f.seed ? Number(f.seed) : Date.now() % 1_000_000;
  let faults: Fault[];
  try {
    faults = parseFaults(f.faults);
  } catch (err) {
    process.stderr.write(`${(err as Error).message}\n`);
    process.exit(2);
  }
  chaos({ durationSec: Number(f.duration), replicas: 3, agents: 6, rate: Number(f.rate), faults, seed, log: (l) => process.stdout.write(`${l}\n`) }).then(
    (r) => {
      process.stdout.write(`${r.line}\n`);
      for (const v of r.violations.slice(0, 50)) process.stdout.write(`VIOLATION: ${v}\n`);
      process.exit(r.violations.length ? 1 : 0);
    },
    (err: unknown) => {
      process.stderr.write(`chaos failed: ${(err as Error).stack ?? err}\n`);
      process.exit(1);
    },
  );
}
