/**
 * An in-process coordinator on the test file's own database, gRPC and HTTP on free ports, with short
 * leases so recovery happens within a test. `useCoordinator()` starts it before the file's
 * tests and stops it after (the leak check fails a test that leaves it running).
 */
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

export function useCoordinator(t: TestDb, env: Record<string, string> = {}): TestCoordinator {
  let c: Coordinator | undefined;
  let config: Config | undefined;
  const log = pino({ level: process.env.LEASEHOLD_TEST_LOG ?? 'silent' });
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

/** Polls `check` until it returns a value other than undefined/false, or fails after `ms`. */
export async function waitFor<T>(what: string, check: () => Promise<T | undefined | false> | T | undefined | false, ms = 10_000): Promise<T> {
  const deadline = Date.now() + ms;
  for (;;) {
    const v = await check();
    if (v !== undefined && v !== false) return v;
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}
