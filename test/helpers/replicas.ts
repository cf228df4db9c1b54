import pino from 'pino';
import { loadConfig } from '../../server/config.js';
import { startCoordinator, type Coordinator } from '../../server/coordinator.js';
import { ADMIN_KEY } from './coordinator.js';

const log = pino({ level: process.env.LEASEHOLD_TEST_LOG ?? 'silent' });

/**
 * One of several coordinators on one database, on fixed ports so that it comes back where
 * agents and proxies look for it after a restart; leases long enough that a restart never lets
 * one run out.
 */
export function replica(databaseUrl: string, grpcPort: number, httpPort = 0): Promise<Coordinator> {
  const config = loadConfig(
    { grpcAddr: `127.0.0.1:${grpcPort}`, httpAddr: `127.0.0.1:${httpPort}` },
    {
      DATABASE_URL: databaseUrl,
      LEASEHOLD_ADMIN_KEY: ADMIN_KEY,
      LEASEHOLD_LEASE_TTL: '10s',
      LEASEHOLD_CLAIM_TTL: '10s',
      LEASEHOLD_HEARTBEAT_INTERVAL: '1s',
      LEASEHOLD_REAPER_INTERVAL: '200ms',
      LEASEHOLD_RETENTION: 'off',
    },
  );
  return startCoordinator(config, log);
}
