/**
 * The chaos run in `npm test`: 20 seconds of replicas and agents SIGKILLed and frozen, agents'
 * clocks stepped, connections reset, delayed, silenced and half-opened, and PostgreSQL restarted,
 * against three coordinator replicas and six agent processes; then every job, effect and
 * notification is checked (test/chaos/run.ts). `npm run chaos -- --duration 120` is the long
 * version. Clock steps need libfaketime: left out where it is missing, unless
 * LEASEHOLD_REQUIRE_FAKETIME=1 (CI installs it).
 */
import { expect, it } from 'vitest';
import { chaos, FAKETIME_LIB, FAULTS } from './chaos/run.js';

const faults = FAKETIME_LIB || process.env.LEASEHOLD_REQUIRE_FAKETIME === '1' ? [...FAULTS] : FAULTS.filter((f) => f !== 'clock');

it(`20 s of chaos (${faults.join(', ')}): nothing lost, nothing done twice, every notification seen once`, async () => {
  const seed = Number(process.env.LEASEHOLD_CHAOS_SEED ?? Date.now() % 1_000_000);
  const r = await chaos({ durationSec: 20, replicas: 3, agents: 6, rate: 10, faults, seed, log: () => undefined });
  console.log(r.line);
  expect(r.violations, `replay with LEASEHOLD_CHAOS_SEED=${seed}`).toEqual([]);
  expect(r.figures.jobs).toBeGreaterThan(50);
  expect(r.figures.pgRestarts).toBe(1);
  // Every kind on the menu happened at least once (run.ts draws each first).
  const f = r.figures;
  const happened: Record<string, number> = {
    'agent-kill': f.agentKills!,
    'replica-kill': f.replicaKills!,
    'agent-pause': f.agentPauses!,
    'replica-pause': f.replicaPauses!,
    clock: f.clockSteps!,
    network: f.resets! + f.delays! + f.silences! + f.halfOpens!,
  };
  for (const kind of faults) if (kind !== 'pg-restart') expect(happened[kind], kind).toBeGreaterThan(0);
}, 300_000);
