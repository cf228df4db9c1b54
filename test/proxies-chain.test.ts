/**
 * Two proxies in front of the coordinator, as behind a CDN or a cloud load balancer
 * (docs/deploy.md, "Behind a CDN or a load balancer"): an outer proxy (a small HTTP proxy of this
 * test standing in for the CDN: it appends the address it saw to X-Forwarded-For and connects
 * on from 127.0.0.4), then Caddy run from deploy/Caddyfile with LEASEHOLD_OUTER_PROXIES naming
 * the outer one, then the coordinator.
 *
 * Shown: with LEASEHOLD_TRUST_PROXY listing both proxies, refused keys are counted per client
 * behind them (the coordinator's warning for a refused key names the client): two guessers each
 * get their own 30 before 429s, and a key new to the coordinator, sent from a third client, is
 * served. With LEASEHOLD_TRUST_PROXY=1 behind the same chain every client is the outer proxy
 * (the warning names it), so all of them would share one bucket: what the list is for.
 *
 * Skipped when caddy is not installed, unless LEASEHOLD_REQUIRE_PROXIES=1 (CI), which fails instead.
 */
import http from 'node:http';
import https from 'node:https';
import { readFile } from 'node:fs/promises';
import type { AddressInfo } from 'node:net';
import pino from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { keyCreate } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, useCoordinator, type TestCoordinator } from './helpers/coordinator.js';
import { missing, startCaddy, type RunningProxy } from './helpers/proxies.js';

const t = useTestDb();
/** The outer proxy's address towards Caddy. */
const OUTER = '127.0.0.4';
/** A coordinator with LEASEHOLD_TRUST_PROXY=`setting`, and its warnings (a refused key's says its caller). */
function coordinator(setting: string): { lh: TestCoordinator; warnings: Record<string, unknown>[] } {
  const warnings: Record<string, unknown>[] = [];
  const log = pino({ level: 'warn' }, { write: (l: string) => void warnings.push(JSON.parse(l) as Record<string, unknown>) });
  return { lh: useCoordinator(t, { LEASEHOLD_TRUST_PROXY: setting }, log), warnings };
}
const listed = coordinator(`127.0.0.1 ${OUTER}`);
const oneHop = coordinator('1');
const absent = missing('caddy');
const required = process.env.LEASEHOLD_REQUIRE_PROXIES === '1';

/**
 * The outer proxy: plain HTTP on loopback in, HTTPS to Caddy out from `OUTER`, with the
 * address it saw appended to X-Forwarded-For, as a CDN's edge or a load balancer does.
 */
async function outerProxy(caddy: RunningProxy): Promise<{ port: number; close(): Promise<void> }> {
  const ca = await readFile(caddy.caFile);
  const server = http.createServer((req, res) => {
    const seen = req.socket.remoteAddress!;
    const before = req.headers['x-forwarded-for'];
    const headers = { ...req.headers, host: `localhost:${caddy.port}`, 'x-forwarded-for': before ? `${String(before)}, ${seen}` : seen };
    const out = https.request(
      { host: 'localhost', port: caddy.port, family: 4, localAddress: OUTER, method: req.method, path: req.url, headers, ca, servername: 'localhost', agent: false },
      (answer) => {
        res.writeHead(answer.statusCode ?? 502, answer.headers);
        answer.pipe(res);
      },
    );
    out.on('error', (err) => {
      res.writeHead(502);
      res.end(String(err));
    });
    req.pipe(out);
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  return {
    port: (server.address() as AddressInfo).port,
    close: () => new Promise<void>((r) => server.close(() => r())),
  };
}

/** A gateway call through the outer proxy, from the client address `from`. */
function list(port: number, key: string, from: string): Promise<{ status: number; body: string }> {
  return new Promise((resolve, reject) => {
    const req = http.request(
      { host: '127.0.0.1', port, localAddress: from, method: 'POST', path: '/leasehold.v1.JobService/ListJobs', agent: false, headers: { 'content-type': 'application/json', authorization: `Bearer ${key}` } },
      (res) => {
        let body = '';
        res.on('data', (c: Buffer) => (body += c.toString('utf8')));
        res.on('end', () => resolve({ status: res.statusCode ?? 0, body }));
      },
    );
    req.on('error', reject);
    req.end('{}');
  });
}

describe.each([
  { setting: `127.0.0.1 ${OUTER}`, ...listed, caller: '127.0.0.2' },
  { setting: '1', ...oneHop, caller: OUTER },
])('a CDN, then Caddy, then the coordinator with LEASEHOLD_TRUST_PROXY=$setting', ({ lh, warnings, caller }) => {
  const newKeyServed = caller !== OUTER;
  let caddy: RunningProxy | undefined;
  let outer: Awaited<ReturnType<typeof outerProxy>> | undefined;
  beforeAll(async () => {
    if (absent) return;
    caddy = await startCaddy({ grpcPort: lh.port, httpPort: lh.c.http.address.port }, { LEASEHOLD_OUTER_PROXIES: OUTER });
    outer = await outerProxy(caddy);
  }, 60_000);
  afterAll(async () => {
    await outer?.close();
    await caddy?.dispose();
  });

  it.skipIf(absent && !required)(
    newKeyServed
      ? 'counts refused keys per client behind both proxies: each guesser has a bucket of its own, and a new key from another client is served'
      : 'counts every client as the outer proxy: a refused key is counted against its address',
    async () => {
      if (absent) throw new Error(absent);
      // Through the chain at all: the admin key is served.
      const through = await list(outer!.port, ADMIN_KEY, '127.0.0.3');
      expect(through.status, through.body).toBe(200);
      // One wrong key from 127.0.0.2: the coordinator's warning names whom it counts it against.
      expect((await list(outer!.port, 'lh_key_guess-first', '127.0.0.2')).status).toBe(401);
      expect(warnings.find((w) => w.msg === 'key refused')).toMatchObject({ listener: 'http', remote: caller });
      if (!newKeyServed) return;
      // Two guessers, at 127.0.0.2 and 127.0.0.3, 45 wrong keys each, all at once: each has a
      // bucket of its own (30 at once, the first guess above took one of 127.0.0.2's).
      const guesses = await Promise.all(
        ['127.0.0.2', '127.0.0.3'].map((from) => Promise.all(Array.from({ length: 45 }, (_, i) => list(outer!.port, `lh_key_guess-${from}-${i}`, from)))),
      );
      for (const g of guesses) {
        expect(g.every((a) => a.status === 401 || a.status === 429), JSON.stringify(g.map((a) => a.status))).toBe(true);
        expect(g.filter((a) => a.status === 401).length).toBeGreaterThanOrEqual(29);
      }
      // n8n at 127.0.0.6, with a key the coordinator has not seen yet (as after a restart): served.
      const fresh = await keyCreate(t.pool, { name: 'chain-listed', scopes: ['read'] });
      if (fresh.outcome !== 'ok') throw new Error(fresh.outcome);
      const answer = await list(outer!.port, fresh.value.key, '127.0.0.6');
      expect(answer.status, answer.body).toBe(200);
    },
  );
});
