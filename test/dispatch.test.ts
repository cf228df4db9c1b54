/**
 * Dispatch under load: 20 agents with 4 slots each drain 2,000 jobs over real streams. No agent
 * ever holds more than its slots (seen by the agents and sampled in the database), every job is
 * done exactly once, and no agent starves.
 */
import { expect, it } from 'vitest';
import { useTestDb } from './helpers/db.js';
import { until, useCoordinator, waitFor } from './helpers/coordinator.js';
import { makeQueuedJobs } from './helpers/factories.js';
import { checkInvariants } from './helpers/invariants.js';
import { RawAgent, toStruct } from './helpers/raw-agent.js';

const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_LEASE_TTL: '30s', LEASEHOLD_CLAIM_TTL: '30s', LEASEHOLD_HEARTBEAT_INTERVAL: '5s' });
const AGENTS = 20;
const SLOTS = 4;
const JOBS = 2000;

it(`${AGENTS} agents × ${SLOTS} slots drain ${JOBS} jobs: within their slots, each job once, nobody starved`, async () => {
  await makeQueuedJobs(t.pool, JOBS, 'bulk');
  const stats = Array.from({ length: AGENTS }, () => ({ held: 0, maxHeld: 0, done: 0, acks: 0 }));
  const seenAttempts = new Set<string>();
  const agents: RawAgent[] = [];
  let dbMax = 0;
  let sampling = true;
  const sampler = (async () => {
    const pool = t.newPool(1);
    while (sampling) {
      const { rows } = await pool.query(
        `SELECT coalesce(max(n), 0)::int AS m FROM (SELECT count(*) AS n FROM jobs WHERE status IN ('claimed', 'running') GROUP BY agent_id) x`,
      );
      dbMax = Math.max(dbMax, rows[0].m);
      await new Promise((r) => setImmediate(r));
    }
  })();

  try {
    for (let i = 0; i < AGENTS; i++) {
      const agentId = `w${i}`;
      const token = await lh.agent(agentId);
      const a = RawAgent.open(`127.0.0.1:${lh.port}`, { agentId, token, queues: ['bulk'], slots: SLOTS });
      agents.push(a);
      const s = stats[i]!;
      a.call.on('data', (m: { kind: string; assign?: any; ack?: any }) => {
        if (m.kind === 'assign') {
          const ids = m.assign.jobs.map((j: { attemptId: string }) => j.attemptId);
          for (const id of ids) {
            if (seenAttempts.has(id)) throw new Error(`attempt ${id} assigned twice`);
            seenAttempts.add(id);
          }
          s.held += ids.length;
          s.maxHeld = Math.max(s.maxHeld, s.held);
          a.send({ started: { attemptIds: ids } });
          a.send({ completed: { results: ids.map((attemptId: string) => ({ attemptId, result: toStruct({ by: agentId }) })) } });
        } else if (m.kind === 'ack') {
          const n = m.ack.items.filter((x: { outcome: string }) => x.outcome === 'OUTCOME_OK').length;
          s.held -= m.ack.items.length;
          s.done += n;
          s.acks++;
          a.send({ credit: { n: m.ack.items.length } });
        }
      });
    }
    await until(
      lh,
      'every job done',
      async () => (await t.pool.query(`SELECT count(*)::int AS n FROM jobs WHERE status = 'succeeded'`)).rows[0].n === JOBS,
      60_000,
    );
    // Acks follow the commit on the stream: the last ones may still be on their way (what the
    // agents received is theirs to know, so this polls).
    await waitFor('every ack received', () => stats.reduce((n, s) => n + s.done, 0) >= JOBS, 10_000);
  } finally {
    sampling = false;
    await sampler;
    for (const a of agents) a.close();
  }

  const counts = stats.map((s) => s.done);
  console.log(`per-agent jobs: ${counts.join(' ')}; max held seen by agents ${Math.max(...stats.map((s) => s.maxHeld))}, in the database ${dbMax}`);
  expect(counts.reduce((a, b) => a + b, 0)).toBe(JOBS);
  for (const s of stats) expect(s.maxHeld).toBeLessThanOrEqual(SLOTS);
  expect(dbMax).toBeLessThanOrEqual(SLOTS);
  // Fair shares: 100 each; nobody gets less than 40% of it.
  expect(Math.min(...counts)).toBeGreaterThanOrEqual((JOBS / AGENTS) * 0.4);
  const db = (
    await t.pool.query(`SELECT (SELECT count(*) FROM attempt_log)::int AS attempts, (SELECT count(*) FROM attempt_log WHERE status = 'succeeded')::int AS succeeded,
                               (SELECT count(*) FROM jobs WHERE attempt_no <> 1)::int AS retried`)
  ).rows[0];
  expect(db).toEqual({ attempts: JOBS, succeeded: JOBS, retried: 0 });
  await checkInvariants(t.pool);
});
