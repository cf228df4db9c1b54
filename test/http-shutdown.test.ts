/**
 * The HTTP gateway closing (a restart, a rolling deploy) while a kept-alive client is using it:
 * the answer of a request in flight says `connection: close` and its connection is closed after
 * it, so the client (n8n, Node's agent, a proxy's upstream pool) sends its next request elsewhere.
 * Before, that connection stayed kept alive and served whatever came on it until the close's
 * deadline cut it, a request in flight then answered by ECONNRESET (or a proxy's 502).
 */
import http from 'node:http';
import { expect, it } from 'vitest';
import { ADMIN_KEY, useCoordinator } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();
const lh = useCoordinator(t);

it('answers a request in flight with connection: close, and closes without waiting for the deadline', async () => {
  const agent = new http.Agent({ keepAlive: true, maxSockets: 1 });
  const { hostname, port } = new URL(lh.httpUrl);
  // A kept-alive connection, as n8n's HTTP Request node holds one.
  const first = await new Promise<http.IncomingMessage>((resolve, reject) => http.get({ hostname, port, path: '/healthz', agent }, resolve).on('error', reject));
  first.resume();
  expect(first.headers.connection).toBe('keep-alive');

  // A request on that connection whose body is still to come when the close begins: with
  // `Expect: 100-continue`, the server says Continue once it has the headers and is handling it.
  const body = JSON.stringify({ queue: 'shutdown', payload: { n: 1 } });
  const req = http.request({
    hostname,
    port,
    path: '/leasehold.v1.JobService/EnqueueJob',
    method: 'POST',
    agent,
    headers: { 'content-type': 'application/json', authorization: `Bearer ${ADMIN_KEY}`, 'content-length': Buffer.byteLength(body), expect: '100-continue' },
  });
  const answered = new Promise<http.IncomingMessage>((resolve, reject) => req.on('response', resolve).on('error', reject));
  await new Promise<void>((resolve) => req.once('continue', resolve));
  const t0 = Date.now();
  const closing = lh.c.http.close();
  req.end(body);
  const res = await answered;
  res.resume();
  expect(res.statusCode).toBe(200);
  expect(res.headers.connection).toBe('close');
  await closing;
  expect(Date.now() - t0, 'closed once its connections were, not at the 2 s deadline').toBeLessThan(1500);
  agent.destroy();
});
