/**
 * An in-process coordinator on the test file's own database, gRPC and HTTP on free ports, with short
 * leases so recovery happens within a test. `useCoordinator()` starts it before the file's
 * tests and stops it after (the leak check fails a test that leaves it running).
 */
import type { EventEmitter } from 'node:events';
import pino from 'pino';
import { afterAll, beforeAll } from 'vitest';
import { loadConfig, type Config } from '../../server/config.js';
import { startCoordinator, type Coordinator } from '../../server/coordinator.js';
import { agentCreate } from '../../server/store/index.js';
import type { TestDb } from './db.js';

export const ADMIN_KEY = 'test-admin-key';

export interface TestCoordinator {
  readonly c: Coordinator;
  /** `http://127.0.0.1:<port>` */
  readonly url: string;
  readonly port: number;
  /** The HTTP gateway: `http://127.0.0.1:<port>` */
  readonly httpUrl: string;
  readonly config: Config;
  /** Creates an agent and returns its token. */
  agent(name: string): Promise<string>;
}

export function useCoordinator(t: TestDb, env: Record<string, string> = {}, log: pino.Logger = pino({ level: process.env.LEASEHOLD_TEST_LOG ?? 'silent' })): TestCoordinator {
  let c: Coordinator | undefined;
  let config: Config | undefined;
  beforeAll(async () => {
    config = loadConfig(
      { grpcAddr: '127.0.0.1:0', httpAddr: '127.0.0.1:0' },
      {
        DATABASE_URL: t.url,
        LEASEHOLD_ADMIN_KEY: ADMIN_KEY,
        LEASEHOLD_LEASE_TTL: '1500ms',
        LEASEHOLD_CLAIM_TTL: '1500ms',
        LEASEHOLD_HEARTBEAT_INTERVAL: '300ms',
        LEASEHOLD_REAPER_INTERVAL: '100ms',
        ...env,
      },
    );
    c = await startCoordinator(config, log);
  });
  afterAll(async () => {
    await c?.stop();
  });
  const get = () => {
    if (!c) throw new Error('useCoordinator: only inside tests');
    return c;
  };
  return {
    get c() {
      return get();
    },
    get port() {
      return get().grpc.address.port;
    },
    get url() {
      return `http://127.0.0.1:${get().grpc.address.port}`;
    },
    get httpUrl() {
      return `http://127.0.0.1:${get().http.address.port}`;
    },
    get config() {
      return config!;
    },
    agent: async (name) => {
      const o = await agentCreate(t.pool, { agentId: name });
      if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
      return o.value.token;
    },
  };
}

/** `p`, or a failure naming `what` when it has not settled within `ms` (a deadline, never a pause). */
export async function within<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([p, new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`${what} within ${ms} ms`)), ms)))]);
  } finally {
    clearTimeout(timer);
  }
}

/**
 * Polls `check` every 20 ms until it returns a value other than undefined/false, or fails after
 * `ms`: for what another process changes (a child's file, a proxy's state). What the in-process
 * coordinator changes, `until` waits for on its events.
 */
export async function waitFor<T>(what: string, check: () => Promise<T | undefined | false> | T | undefined | false, ms = 10_000): Promise<T> {
  const deadline = Date.now() + ms;
  for (;;) {
    const v = await check();
    if (v !== undefined && v !== false) return v;
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

/**
 * The coordinator's events after which what a test waits for may have changed: the hub's (starts,
 * reports, lease ticks and revocations, sessions), the unary routes', the dispatcher's rounds and
 * hand-offs, and the runs of the reaper and the other services.
 */
function changeEvents(c: Coordinator): Array<[EventEmitter, string]> {
  const of = (em: EventEmitter | undefined, names: string[]) => (em ? names.map((n) => [em, n] as [EventEmitter, string]) : []);
  return [
    ...of(c.hub as EventEmitter, ['credit', 'lease:tick', 'lease:revoked', 'session:open', 'session:close', 'attempt:start', 'attempt:report']),
    ...of(c.activity as EventEmitter, ['attempt:claim', 'attempt:start', 'attempt:report', 'job:enqueued', 'job:canceled', 'job:requeued', 'jobs:purged']),
    ...of(c.dispatcher as EventEmitter, ['dispatch:round', 'dispatch:handoff']),
    ...of(c.reaper as EventEmitter, ['reaper:run']),
    ...of(c.registry as EventEmitter, ['registry:run']),
    ...of(c.deliverer as EventEmitter, ['webhook:run', 'webhook:sent']),
    ...of(c.counts as EventEmitter, ['counts:run']),
    ...of(c.purger as EventEmitter | undefined, ['purger:run']),
    ...of(c.vacuumer as EventEmitter | undefined, ['vacuumer:run']),
  ];
}

/**
 * Waits until `check` returns a value other than undefined/false: it checks now, then again after
 * each of the coordinator's events (`changeEvents`), one check at a time; never on a timer of its
 * own. Fails after `ms`. For what only another process can change, `waitFor` polls.
 */
export function until<T>(lh: TestCoordinator, what: string, check: () => Promise<T | undefined | false> | T | undefined | false, ms = 10_000): Promise<T> {
  return untilEvents(changeEvents(lh.c), what, check, ms);
}

/** `until` on the events named: `[emitter, event name]` pairs. */
export function untilEvents<T>(
  sources: Array<[EventEmitter, string]>,
  what: string,
  check: () => Promise<T | undefined | false> | T | undefined | false,
  ms = 10_000,
): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    let running = false;
    let again = false;
    let done = false;
    const finish = (settle: () => void) => {
      done = true;
      clearTimeout(timer);
      for (const [em, name] of sources) em.off(name, poke);
      settle();
    };
    const run = async () => {
      do {
        again = false;
        try {
          const v = await check();
          if (v !== undefined && v !== false) return finish(() => resolve(v));
        } catch (err) {
          return finish(() => reject(err));
        }
      } while (again && !done);
      running = false;
    };
    function poke() {
      if (done) return;
      if (running) {
        again = true;
        return;
      }
      running = true;
      void run();
    }
    const timer = setTimeout(() => finish(() => reject(new Error(`timed out after ${ms} ms waiting for ${what}`))), ms);
    for (const [em, name] of sources) em.on(name, poke);
    poke();
  });
}
