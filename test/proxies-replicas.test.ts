/**
 * Several replicas behind one address (docs/deploy.md): two coordinators on one database behind
 * Caddy (deploy/Caddyfile, both in its upstream lists) and behind nginx (deploy/nginx.conf, a
 * `server` line each), an SDK agent that knows only the proxy's address, jobs enqueued through the
 * proxy's gateway all the while. Each coordinator is stopped gracefully and started again in
 * turn, as a rolling upgrade does: its streams get GoAway, the agent reconnects to the same
 * address, and the proxy passes it to the replica that is up. Nothing may be lost, no handler may
 * run twice, nothing may be revoked.
 *
 * Skipped when caddy or nginx is not installed, unless LEASEHOLD_REQUIRE_PROXIES=1 (CI).
 */
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pino from 'pino';
import { afterEach, describe, expect, it } from 'vitest';
import { createAgent, type Agent } from '@leasehold/agent-client';
import type { Coordinator } from '../server/coordinator.js';
import { agentCreate } from '../server/store/index.js';
import { handlerGate, watchAgent } from './helpers/agent-watch.js';
import { ADMIN_KEY, waitFor } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { freePort } from './helpers/ports.js';
import { replica } from './helpers/replicas.js';
import { missing, request, startCaddy, startNginx, type RunningProxy, type Upstreams } from './helpers/proxies.js';

const t = useTestDb();
const log = pino({ level: process.env.LEASEHOLD_TEST_LOG ?? 'silent' });
const required = process.env.LEASEHOLD_REQUIRE_PROXIES === '1';
const cleanups: Array<() => Promise<unknown>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c().catch(() => undefined);
});

describe.each([
  { name: 'caddy' as const, start: startCaddy },
  { name: 'nginx' as const, start: startNginx },
])('two replicas behind $name', ({ name, start }) => {
  it('a rolling restart of both, one at a time, with jobs enqueued and run through the proxy: 0 lost, 0 run twice, 0 revoked', async (ctx) => {
    const absent = missing(name);
    if (absent) {
      if (required) throw new Error(`${absent}, and LEASEHOLD_REQUIRE_PROXIES=1 (apt-get install caddy nginx)`);
      return ctx.skip(absent);
    }
    const grpcPorts = [await freePort(), await freePort()];
    const httpPorts = [await freePort(), await freePort()];
    const live: Array<Coordinator | undefined> = [await replica(t.url, grpcPorts[0]!, httpPorts[0]!), await replica(t.url, grpcPorts[1]!, httpPorts[1]!)];
    cleanups.push(async () => {
      for (const c of live) await c?.stop();
    });
    const upstreams: Upstreams = { grpcPort: grpcPorts, httpPort: httpPorts };
    const proxy: RunningProxy = await start(upstreams);
    cleanups.push(() => proxy.dispose());
    ctx.onTestFailed(() => console.error(`--- ${name} log (tail) ---\n${proxy.log().slice(-6000)}`));

    const queue = `replicas-${name}`;
    const made = await agentCreate(t.pool, { agentId: `roller-${name}` });
    if (made.outcome !== 'ok') throw new Error(JSON.stringify(made));
    const outboxDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-replicas-'));
    cleanups.push(() => rm(outboxDir, { recursive: true, force: true }));
    const agent: Agent = createAgent({
      url: `https://localhost:${proxy.port}`, // the one address; the proxy picks the replica
      tls: { ca: proxy.caFile },
      token: made.value.token,
      queues: [queue],
      slots: 4,
      outboxDir,
      handleSignals: false,
      log,
      reconnect: { baseMs: 50, maxMs: 500 },
    });
    cleanups.push(() => agent.stop());
    const { runs, aborted, connected, ran } = watchAgent(agent);
    // While a replica is being stopped its handlers wait, so that the stream it moves holds running
    // jobs (without the gate, a slow restart let the agent finish every job before the wait below).
    const gate = handlerGate();
    agent.handle(queue, async (job) => {
      ran(job.id);
      await gate.passed();
      await new Promise((r) => setTimeout(r, 100 + (Number((job.payload as { n: number }).n) % 5) * 40));
      return { n: (job.payload as { n: number }).n };
    });
    await agent.start();

    // n8n's side: each job enqueued through the proxy's gateway, whichever replica answers.
    const ids: string[] = [];
    const enqueue = async (n: number) => {
      const r = await request(proxy, 'POST', '/leasehold.v1.JobService/EnqueueJob', {
        body: JSON.stringify({ queue, payload: { n } }),
        headers: { 'content-type': 'application/json', authorization: `Bearer ${ADMIN_KEY}` },
      });
      if (r.status !== 200) throw new Error(`EnqueueJob through ${name}: ${r.status} ${r.body.slice(0, 300)}`);
      ids.push((JSON.parse(r.body) as { job: { id: string } }).job.id);
    };
    const done = async () =>
      Number((await t.pool.query(`SELECT count(*) FROM jobs WHERE id = ANY($1::uuid[]) AND status = 'succeeded'`, [ids])).rows[0].count);

    let n = 0;
    for (; n < 20; n++) await enqueue(n);
    for (const i of [0, 1]) {
      gate.close();
      if (i === 1) for (const end = n + 10; n < end; n++) await enqueue(n);
      await waitFor('jobs running', () => agent.runningAttempts.length > 0, 10_000);
      const before = await done();
      // The agent's stream is on one of the two, whichever the proxy chose: stopping that one
      // moves it (GoAway, then a new stream through the proxy to the other).
      await live[i]!.stop();
      live[i] = undefined;
      // Jobs keep coming while this replica is down: the proxy sends them to the other.
      for (const end = n + 10; n < end; n++) await enqueue(n);
      live[i] = await replica(t.url, grpcPorts[i]!, httpPorts[i]!);
      gate.open();
      await waitFor('progress after the restart', async () => (await done()) > before + 5, 20_000);
    }
    for (const end = n + 10; n < end; n++) await enqueue(n);
    await waitFor('every job done', async () => (await done()) === ids.length, 60_000);

    expect(ids).toHaveLength(60);
    expect(ids.filter((id) => runs.get(id) !== 1)).toEqual([]);
    expect(aborted).toEqual([]);
    const attempts = (await t.pool.query(`SELECT status::text AS status, count(*)::int AS n FROM attempt_log WHERE job_id = ANY($1::uuid[]) GROUP BY 1`, [ids])).rows;
    expect(attempts).toEqual([{ status: 'succeeded', n: ids.length }]);
    expect((await t.pool.query(`SELECT max(attempt_no)::int AS m FROM jobs WHERE id = ANY($1::uuid[])`, [ids])).rows[0].m).toBe(1);
    // Both replicas were stopped in turn, so the one holding the stream was: it moved at least once.
    expect(connected.length).toBeGreaterThanOrEqual(2);
  }, 120_000);
});
