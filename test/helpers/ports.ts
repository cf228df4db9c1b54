import { readFileSync } from 'node:fs';
import net from 'node:net';

/**
 * Where freePort looks: below the ports the OS hands out for `listen(0)` and for the local end
 * of outgoing connections (Linux: ip_local_port_range, 32768 and up by default; Windows and
 * macOS: 49152 and up). A test that stops a server and starts it again on the same port needs
 * the port to stay free in between; in the ephemeral range any outgoing connection of any
 * process can take it meanwhile, a proxy retrying that very port can even connect to itself on
 * it, and the restart then fails with EADDRINUSE (seen in CI: test/proxies-replicas.test.ts).
 */
function stableRange(): [number, number] {
  let low = 32768;
  try {
    const first = Number(readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/)[0]);
    if (Number.isInteger(first) && first > 0) low = Math.min(low, first);
  } catch {
    // not Linux: 32768 is below the other systems' ranges too
  }
  const from = 10_000;
  return low - from >= 1_000 ? [from, low - 1] : [1_024, low - 1];
}

function tryListen(port: number): Promise<boolean> {
  const s = net.createServer();
  return new Promise((resolve) => {
    s.once('error', () => resolve(false));
    s.listen(port, '127.0.0.1', () => s.close(() => resolve(true)));
  });
}

/**
 * A free TCP port on 127.0.0.1, outside the OS's ephemeral range (see stableRange), checked
 * by binding it and released: the caller binds it at once, and may bind it again after a stop.
 */
export async function freePort(): Promise<number> {
  const [from, to] = stableRange();
  for (let tries = 0; tries < 200; tries++) {
    const port = from + Math.floor(Math.random() * (to - from + 1));
    if (await tryListen(port)) return port;
  }
  throw new Error(`no free port found between ${from} and ${to} in 200 tries`);
}
