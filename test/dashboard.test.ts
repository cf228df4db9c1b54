/**
 * The dashboard in a real browser: Debian's Chromium driven by playwright-core (never a
 * downloaded browser; `.ci/run` installs `chromium` when it is missing). The page loads from the
 * HTTP listener, takes the admin key, shows a job this test enqueued and the agents online,
 * requeues a dead job with a click, and draws a job's attempt timeline (a lease that expired,
 * then a run with heartbeats that succeeded). A screenshot goes to test/artifacts/. Where no
 * Chromium can be found the test is skipped and says why.
 */
import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { chromium, type BrowserContext } from 'playwright-core';
import { afterAll, describe, expect, it } from 'vitest';
import { jobEnqueue } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, useCoordinator, waitFor } from './helpers/coordinator.js';
import { makeJob } from './helpers/factories.js';
import { RawAgent, toStruct } from './helpers/raw-agent.js';
import { root } from './helpers/serve.js';

const CANDIDATES = [process.env.LEASEHOLD_CHROMIUM, '/usr/bin/chromium', '/usr/bin/chromium-browser'].filter((p): p is string => Boolean(p));
const executablePath = CANDIDATES.find((p) => existsSync(p));
if (!executablePath) {
  console.log(`dashboard test skipped: no Chromium at ${CANDIDATES.join(', ')} (install Debian's chromium: apt-get install -y chromium, as .ci/run does)`);
}

const t = useTestDb();
const lh = useCoordinator(t);
/** The page fetches and draws after each click: on a busy 2-core machine that can take seconds (1 s is the default). */
const POLL = { timeout: 15_000 };
let context: BrowserContext | undefined;
let profile: string | undefined;
const agents: RawAgent[] = [];
afterAll(async () => {
  for (const a of agents) a.close();
  await context?.close();
  if (profile) await rm(profile, { recursive: true, force: true });
});

describe.skipIf(!executablePath)('the dashboard in headless Chromium', () => {
  it('loads, shows an enqueued job and the agents, requeues a dead job with a click, and draws a timeline', async () => {
    // What there is to see: a job waiting, a dead letter, and a job that lost its first lease
    // (no heartbeats) and succeeded on its second attempt with heartbeats, its agent still online.
    const waiting = await jobEnqueue(t.pool, { queue: 'dash-waiting', payload: { hello: 'dashboard' } });
    if (waiting.outcome !== 'ok') throw new Error('enqueue');
    const dead = await makeJob(t.pool, { queue: 'dash-dead', status: 'dead' });
    // The job's error is its attempt's.
    await t.pool.query(`UPDATE attempts SET error = '{"message": "boom: the printer caught fire"}' WHERE job_id = $1`, [dead.id]);
    const token = await lh.agent('dash-agent');
    const a = RawAgent.open(`127.0.0.1:${lh.port}`, { agentId: 'dash-agent', token, queues: ['dash-run'], slots: 1 });
    agents.push(a);
    await a.next('welcome');
    const run = await jobEnqueue(t.pool, { queue: 'dash-run', payload: {} });
    if (run.outcome !== 'ok') throw new Error('enqueue');
    const first = (await a.next('assign')).assign.jobs[0];
    a.send({ started: { attemptIds: [first.attemptId] } });
    await a.next('revoke', 10_000); // the lease (1.5 s) ran out
    a.send({ credit: { n: 1 } });
    const second = (await a.next('assign')).assign.jobs[0];
    a.send({ started: { attemptIds: [second.attemptId] } });
    for (let i = 0; i < 3; i++) {
      await a.next('renewed');
      a.send({ heartbeat: { progress: [] } });
    }
    await a.next('renewed');
    a.send({ completed: { results: [{ attemptId: second.attemptId, result: toStruct({ pages: 3 }) }] } });
    expect((await a.next('ack')).ack.items[0].outcome).toBe('OUTCOME_OK');

    profile = await mkdtemp(path.join(os.tmpdir(), 'leasehold-chromium-'));
    context = await chromium.launchPersistentContext(profile, {
      executablePath,
      headless: true,
      args: ['--no-sandbox', '--headless', '--disable-gpu', '--disable-background-networking', '--disable-component-update', '--disable-sync', '--no-first-run'],
      viewport: { width: 1400, height: 1100 },
    });
    const page = context.pages()[0] ?? (await context.newPage());
    const problems: string[] = [];
    page.on('pageerror', (err) => problems.push(`page error: ${err.message}`));
    page.on('console', (m) => {
      if (m.type() === 'error') problems.push(`console: ${m.text()}`);
    });

    const res = await page.goto(`${lh.httpUrl}/`);
    expect(res?.status()).toBe(200);
    expect(res?.headers()['content-security-policy']).toMatch(/script-src 'self'/);
    await page.fill('#key', ADMIN_KEY);
    await page.click('#connect');

    // The job this test enqueued, the queue depths and the agent online.
    await page.locator(`#jobs tr[data-job-id="${waiting.value.id}"]`).waitFor();
    await expect.poll(() => page.locator('#queues tr[data-queue="dash-waiting"] td.queued').textContent(), POLL).toBe('1');
    await page.locator('#agents tr[data-agent-id="dash-agent"]').waitFor();

    // The dead letter, requeued with a click.
    const row = page.locator(`#failures tr[data-job-id="${dead.id}"]`);
    await expect.poll(() => row.locator('td.error').textContent(), POLL).toBe('boom: the printer caught fire');
    await row.locator('button.requeue').click();
    await waitFor('the dead job queued again', async () => (await t.pool.query(`SELECT status::text FROM jobs WHERE id = $1`, [dead.id])).rows[0].status === 'queued');
    await expect.poll(() => page.locator('#message').textContent(), POLL).toBe(`job ${dead.id} requeued on dash-dead`);
    await row.waitFor({ state: 'detached' });

    // One job's attempts as a picture.
    await page.locator(`#jobs tr[data-job-id="${run.value.id}"] a.job-link`).click();
    const lanes = page.locator('#timeline svg.timeline g.attempt');
    await expect.poll(() => lanes.count(), POLL).toBe(2);
    expect(await lanes.nth(0).getAttribute('class')).toContain('lease_expired');
    expect(await lanes.nth(1).getAttribute('class')).toContain('succeeded');
    expect(await lanes.nth(1).locator('line.heartbeat').count()).toBeGreaterThanOrEqual(1);
    expect(await lanes.nth(0).locator('circle.claimed-mark').count()).toBe(1);
    expect(await lanes.nth(1).locator('path.started-mark').count()).toBe(1);
    expect(await page.locator('#events tbody tr').count()).toBe(7);

    await mkdir(path.join(root, 'test/artifacts'), { recursive: true });
    await page.screenshot({ path: path.join(root, 'test/artifacts/dashboard.png'), fullPage: true });
    expect(problems).toEqual([]);
  });
});
