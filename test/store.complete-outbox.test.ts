/**
 * The completion's two forms: without the outbox's CTEs for jobs no one listens to, with them for
 * the rest. Whichever runs, a success that has a listener (the job's notify_url, a subscription of
 * its queue or of '*') gets its event and deliveries, one that has none gets nothing, every report
 * gets its own outcome, and once a completion needed the outbox the next ones take it at once.
 */
import pg from 'pg';
import { afterAll, afterEach, beforeEach, expect, it } from 'vitest';
import { createPool } from '../server/store/database.js';
import { attemptCompleteMany, HEARD_COMPLETIONS_MS, heardCompletions, subscriptionCreate, subscriptionRemove } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { makeJob } from './helpers/factories.js';
import { checkInvariants } from './helpers/invariants.js';

const t = useTestDb();
// One connection, so that the statements it prepared say which forms ran.
const one: pg.Pool = createPool(t.url, 1, undefined, { hot: true });
afterAll(() => one.end());
beforeEach(async () => {
  heardCompletions.until = 0;
  await freshConnection();
});
afterEach(() => checkInvariants(t.pool));

/** The pool's connection ends, so the next statement opens one with nothing prepared. */
const freshConnection = () => one.query('SELECT pg_terminate_backend(pg_backend_pid())').catch(() => undefined);

async function prepared(): Promise<string[]> {
  const { rows } = await one.query(`SELECT name FROM pg_prepared_statements WHERE name LIKE 'attemptComplete%' ORDER BY name`);
  return rows.map((r: { name: string }) => r.name);
}

const running = (queue: string, extra: { notifyUrl?: string } = {}) =>
  makeJob(t.pool, { queue, status: 'running', agentId: 'ob-agent' }).then(async (j) => {
    if (extra.notifyUrl) await t.pool.query('UPDATE jobs SET notify_url = $2 WHERE id = $1', [j.id, extra.notifyUrl]);
    return j;
  });

async function events(jobIds: string[]): Promise<Array<{ job_id: string; urls: string[] }>> {
  const { rows } = await t.pool.query(
    `SELECT e.job_id, array_agg(d.url ORDER BY d.url) AS urls FROM webhook_events e JOIN webhook_deliveries d ON d.event_id = e.id
     WHERE e.job_id = ANY($1::uuid[]) AND e.type = 'job.succeeded' GROUP BY e.job_id ORDER BY e.job_id`,
    [jobIds],
  );
  return rows;
}

it('completes jobs no one listens to without the outbox, in one statement', async () => {
  const jobs = await Promise.all([running('ob-quiet'), running('ob-quiet')]);
  const out = await attemptCompleteMany(one, { items: jobs.map((j) => ({ attemptId: j.currentAttemptId!, agentId: 'ob-agent', result: { n: 1 } })) });
  expect(out.map((o) => o.outcome)).toEqual(['ok', 'ok']);
  expect(await prepared()).toEqual(['attemptCompleteManyUnheard']);
  expect(await events(jobs.map((j) => j.id))).toEqual([]);
  const { rows } = await t.pool.query(`SELECT status, result FROM jobs WHERE id = ANY($1::uuid[])`, [jobs.map((j) => j.id)]);
  expect(rows).toEqual([
    { status: 'succeeded', result: { n: 1 } },
    { status: 'succeeded', result: { n: 1 } },
  ]);
  expect(heardCompletions.until).toBe(0);
});

it("a job's notify_url alone, no subscription anywhere: its event is written", async () => {
  const quiet = await running('ob-plain');
  const called = await running('ob-plain', { notifyUrl: 'https://example.com/only' });
  const out = await attemptCompleteMany(one, { items: [quiet, called].map((j) => ({ attemptId: j.currentAttemptId!, agentId: 'ob-agent', result: {} })) });
  expect(out.map((o) => o.outcome)).toEqual(['ok', 'ok']);
  expect(await prepared()).toEqual(['attemptCompleteMany', 'attemptCompleteManyUnheard']);
  expect(await events([quiet.id, called.id])).toEqual([{ job_id: called.id, urls: ['https://example.com/only'] }]);
  expect(heardCompletions.until).toBeGreaterThan(Date.now());
});

it("a batch of heard and unheard jobs: each completed once, the heard ones' events written, and the next completion takes the outbox at once", async () => {
  const sub = await subscriptionCreate(t.pool, { queue: 'ob-watched', url: 'https://example.com/sub' });
  const all = await subscriptionCreate(t.pool, { queue: '*', url: 'https://example.com/all', events: ['job.succeeded'] });
  if (sub.outcome !== 'ok' || all.outcome !== 'ok') throw new Error('subscriptions');
  try {
    const watched = await running('ob-watched');
    const elsewhere = await running('ob-elsewhere');
    const called = await running('ob-elsewhere', { notifyUrl: 'https://example.com/callback' });
    const jobs = [watched, elsewhere, called];
    const at = Date.now();
    const out = await attemptCompleteMany(one, { items: jobs.map((j) => ({ attemptId: j.currentAttemptId!, agentId: 'ob-agent', result: { id: j.id } })) });
    expect(out.map((o) => [o.outcome, o.outcome === 'ok' ? o.value.id : undefined])).toEqual(jobs.map((j) => ['ok', j.id]));
    expect(await prepared()).toEqual(['attemptCompleteMany', 'attemptCompleteManyUnheard']);
    expect(await events(jobs.map((j) => j.id))).toEqual(
      [
        { job_id: watched.id, urls: ['https://example.com/all', 'https://example.com/sub'] },
        { job_id: elsewhere.id, urls: ['https://example.com/all'] },
        { job_id: called.id, urls: ['https://example.com/all', 'https://example.com/callback'] },
      ].sort((a, b) => a.job_id.localeCompare(b.job_id)),
    );
    expect(heardCompletions.until).toBeGreaterThanOrEqual(at + HEARD_COMPLETIONS_MS);

    // While someone listens: straight to the statement with the outbox.
    await freshConnection();
    const next = await running('ob-watched');
    expect((await attemptCompleteMany(one, { items: [{ attemptId: next.currentAttemptId!, agentId: 'ob-agent', result: {} }] }))[0]!.outcome).toBe('ok');
    expect(await prepared()).toEqual(['attemptCompleteMany']);
    expect(await events([next.id])).toEqual([{ job_id: next.id, urls: ['https://example.com/all', 'https://example.com/sub'] }]);
  } finally {
    await subscriptionRemove(t.pool, { id: sub.value.id });
    await subscriptionRemove(t.pool, { id: all.value.id });
  }
});

it("a repeat, another result and another agent's report are answered as before once both forms left them", async () => {
  const done = await running('ob-quiet3');
  const item = { attemptId: done.currentAttemptId!, agentId: 'ob-agent', result: { once: true } };
  expect((await attemptCompleteMany(one, { items: [item] }))[0]!.outcome).toBe('ok');
  // The job is gone from jobs_live, so neither form finds these; the stored result stands.
  const again = await attemptCompleteMany(one, { items: [item, { ...item, result: { other: true } }, { attemptId: done.currentAttemptId!, agentId: 'someone-else', result: {} }] });
  expect(again.map((o) => o.outcome)).toEqual(['duplicate', 'conflict', 'forbidden']);
  expect(again[0]).toMatchObject({ value: { result: { once: true } } });
  // Neither form completed anything the first did not: no one listens.
  expect(heardCompletions.until).toBe(0);
});
