/**
 * The LISTEN connection over a network that drops it without a word (a NAT's or load balancer's
 * idle timeout, a failover that sends no reset; here a proxy that drops every byte, the sockets
 * left open): the connection only receives, so nothing noticed, and every coordinator went on
 * without other replicas' cancels, drains and revocations for good. Now it is probed, given up
 * and `disconnected` is emitted (the credential cache goes offline with it), then it reconnects.
 */
import pino from 'pino';
import { expect, it } from 'vitest';
import { Listener } from '../server/store/notify.js';
import { useTestDb } from './helpers/db.js';
import { startProxy } from './helpers/tcp-proxy.js';

const t = useTestDb();

it('gives up a connection that stops answering, says disconnected, and connects again once the network is back', async () => {
  const direct = new URL(t.url);
  const proxy = await startProxy(Number(direct.port));
  const via = new URL(t.url);
  via.port = String(proxy.port);
  const listener = new Listener(via.toString(), pino({ level: 'silent' }), { probeMs: 200 });
  try {
    await listener.start();
    expect(listener.connected).toBe(true);
    const disconnected = new Promise<void>((r) => listener.once('disconnected', () => r()));
    proxy.blackhole();
    await disconnected;
    expect(listener.connected).toBe(false);
    // The network back: the retries get through again.
    const connected = new Promise<void>((r) => listener.once('connected', () => r()));
    proxy.cutAll();
    await connected;
    expect(listener.connected).toBe(true);
  } finally {
    await listener.stop();
    await proxy.close();
  }
}, 30_000);
