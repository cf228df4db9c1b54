import { readFileSync } from 'node:fs';
import net from 'node:net';
import { describe, expect, it } from 'vitest';
import { freePort } from './helpers/ports.js';

// Tests stop a server and start it again on the port freePort gave (rolling restarts, replica
// kills). A port in the ephemeral range can be taken in between by any outgoing connection's
// local end, and the restart fails with EADDRINUSE; freePort keeps below that range.
describe('freePort', () => {
  it.runIf(process.platform === 'linux')('gives ports below the ephemeral range that can be bound, released and bound again', async () => {
    const low = Number(readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/)[0]);
    const ports = await Promise.all(Array.from({ length: 20 }, () => freePort()));
    for (const port of ports) {
      expect(port).toBeGreaterThanOrEqual(1_024);
      expect(port).toBeLessThan(low);
    }
    const port = ports[0]!;
    for (let i = 0; i < 2; i++) {
      const s = net.createServer();
      await new Promise<void>((resolve, reject) => {
        s.once('error', reject);
        s.listen(port, '127.0.0.1', () => resolve());
      });
      await new Promise((r) => s.close(r));
    }
  });
});
