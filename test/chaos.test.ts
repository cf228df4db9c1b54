/**
 * The chaos run in `npm test`: 20 seconds of replicas and agents SIGKILLed, connections reset,
 * delayed, silenced and half-opened, and PostgreSQL restarted, against three coordinator
 * replicas and six agent processes; then every job, effect and notification is checked
 * (test/chaos/run.ts). `npm run chaos -- --duration 120` is the long version.
 */
import { expect, it } from 'vitest';
import { chaos } from './chaos/run.js';

it('20 s of chaos: nothing lost, nothing done twice, every notification seen once', async () => {
  const seed = Number(process.env.LEASEHOLD_CHAOS_SEED ?? Date.now() % 1_000_000);
  const r = await chaos({ durationSec: 20, replicas: 3, agents: 6, rate: 10, seed, log: () => undefined });
  console.log(r.line);
  expect(r.violations, `replay with LEASEHOLD_CHAOS_SEED=${seed}`).toEqual([]);
  expect(r.figures.jobs).toBeGreaterThan(50);
  expect(r.figures.pgRestarts).toBe(1);
  expect(r.figures.agentKills! + r.figures.replicaKills!).toBeGreaterThan(0);
}, 300_000);
