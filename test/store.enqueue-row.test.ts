/**
 * The enqueue without a key or a header returns only what PostgreSQL decided and the times it set,
 * and writes the rest of the job's row from what it was given (`plainJob` in
 * server/store/enqueue.ts). Over arbitrary enqueues, queued or claimed by a hand-off, with the
 * NOTIFY or without: the job it returns is the job read back (GetJob's read, every column).
 */
import fc from 'fast-check';
import { randomUUID } from 'node:crypto';
import { expect, it } from 'vitest';
import { jobEnqueue, jobGet } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();

/** A JSON object PostgreSQL's jsonb takes (no NUL in a string). */
const object = fc
  .dictionary(fc.string({ minLength: 1, maxLength: 8 }), fc.jsonValue({ maxDepth: 3 }), { maxKeys: 6 })
  .filter((v) => !JSON.stringify(v).includes('\\u0000'));
const label = fc.stringMatching(/^[a-z][a-z0-9_.-]{0,11}$/);

const enqueue = fc.record(
  {
    queue: fc.constantFrom('row-a', 'row-b'),
    payload: object,
    priority: fc.integer({ min: -32767, max: 32767 }),
    maxAttempts: fc.integer({ min: 1, max: 1000 }),
    runAt: fc.integer({ min: -3_600_000, max: 3_600_000 }).map((d) => new Date(Date.now() + d)),
    executionTimeoutMs: fc.integer({ min: 1, max: 7 * 24 * 3600 * 1000 }),
    labels: fc.dictionary(label, fc.string({ maxLength: 12 }).filter((s) => !s.includes('\u0000')), { maxKeys: 3 }),
    notifyUrl: fc.constantFrom('https://example.com/done', 'http://10.0.0.1:8080/n?x=1'),
    notify: fc.boolean(),
    handOff: fc.record({
      agentId: fc.constantFrom('row-agent', 'row.agent-2'),
      agentLabels: fc.dictionary(label, fc.string({ maxLength: 12 }).filter((s) => !s.includes('\u0000')), { maxKeys: 3 }),
      claimTtlMs: fc.integer({ min: 100, max: 86_400_000 }),
      upper: fc.boolean(),
    }),
  },
  { requiredKeys: ['queue', 'payload'] },
);

it('the job a plain enqueue returns is the job read back, column for column', async () => {
  let claimed = 0;
  let queued = 0;
  let runs = 0;
  await fc.assert(
    fc.asyncProperty(enqueue, async ({ handOff, ...p }) => {
      const attemptId = randomUUID();
      const o = await jobEnqueue(t.pool, {
        ...p,
        // A queue of its own: whether the hand-off is taken depends on this enqueue alone (a job
        // queued earlier in the same queue would come before it).
        queue: `${p.queue}-${++runs}`,
        ...(handOff
          ? { handOff: { agentId: handOff.agentId, agentLabels: handOff.agentLabels, claimTtlMs: handOff.claimTtlMs, attemptId: handOff.upper ? attemptId.toUpperCase() : attemptId } }
          : {}),
      });
      if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
      if (o.value.status === 'claimed') claimed++;
      else queued++;
      const read = await jobGet(t.pool, { jobId: o.value.id });
      if (read.outcome !== 'ok') throw new Error(JSON.stringify(read));
      expect(o.value).toEqual(read.value.job);
      // Every column, the null ones too: the same keys.
      expect(Object.keys(o.value).sort()).toEqual(Object.keys(read.value.job).sort());
    }),
    { numRuns: 300 },
  );
  // Both shapes of the row were made: a hand-off is taken when the job is due and its labels are
  // the agent's (about one run in six here: 51–55 of 300 in four runs; fewer than 10 is more
  // than six standard deviations away).
  expect(claimed).toBeGreaterThanOrEqual(10);
  expect(queued).toBeGreaterThanOrEqual(10);
});
