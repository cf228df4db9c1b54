/**
 * The HTTP gateway and a `Host` header that is no host: Connect builds the request's URL from it
 * and threw, which the gateway answered as a 500 `internal` (and logged as its own error). It is
 * the caller's mistake: a 400 naming the header. EnqueueJob's direct path never parsed it.
 */
import net from 'node:net';
import { describe, expect, it } from 'vitest';
import { ADMIN_KEY, useCoordinator } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();
const lh = useCoordinator(t);

/** One raw HTTP/1.1 request (the header as given, which no client library would send); its status line and body. */
function raw(host: string, path: string, body = '{}'): Promise<{ status: number; body: string }> {
  const { hostname, port } = new URL(lh.httpUrl);
  return new Promise((resolve, reject) => {
    const s = net.connect(Number(port), hostname);
    let data = '';
    s.on('data', (d: Buffer) => (data += d.toString()));
    s.on('error', reject);
    s.on('end', () => resolve({ status: Number(/^HTTP\/1\.1 (\d+)/.exec(data)?.[1]), body: data.slice(data.indexOf('\r\n\r\n') + 4) }));
    // Written, not ended: the server answers (Connection: close) and closes the socket itself.
    s.write(
      `POST ${path} HTTP/1.1\r\nHost: ${host}\r\nAuthorization: Bearer ${ADMIN_KEY}\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`,
    );
  });
}

describe('the HTTP gateway and a Host that is no host', () => {
  it.each(['x:99999', 'a b'])('answers 400 naming the Host header (%j)', async (host) => {
    const r = await raw(host, '/leasehold.v1.AdminService/GetStats');
    expect(r.status).toBe(400);
    expect(JSON.parse(r.body)).toMatchObject({ code: 'invalid_argument', outcome: 'invalid', field: 'host' });
  });

  it('serves the same call with a valid Host', async () => {
    expect((await raw(new URL(lh.httpUrl).host, '/leasehold.v1.AdminService/GetStats')).status).toBe(200);
  });
});
