/**
 * A TCP proxy in front of the coordinator, so a test can cut an agent's connection the way a
 * network does (both sockets destroyed, no goodbye).
 */
import net from 'node:net';

export interface TcpProxy {
  port: number;
  /** From now on, bytes from the server to the client are dropped (the client hears nothing). */
  muteDownstream(): void;
  /** From now on, bytes are dropped both ways while the connections stay open (a silent network). */
  blackhole(): void;
  /**
   * From now on, bytes from the server reach the client `ms` later (a slow way back); those on
   * their way when `blackhole` is called still arrive.
   */
  delayDownstream(ms: number): void;
  /** How many chunks arrived late because of `delayDownstream`. */
  readonly delayed: number;
  /** Destroys every open connection (new ones are still accepted). */
  cutAll(): void;
  close(): Promise<void>;
}

export async function startProxy(targetPort: number): Promise<TcpProxy> {
  const pairs = new Set<[net.Socket, net.Socket]>();
  let mute = false;
  let hole = false;
  let delayMs = 0;
  let delayed = 0;
  const server = net.createServer((client) => {
    const upstream = net.connect(targetPort, '127.0.0.1');
    const pair: [net.Socket, net.Socket] = [client, upstream];
    pairs.add(pair);
    const drop = () => {
      client.destroy();
      upstream.destroy();
      pairs.delete(pair);
    };
    client.on('error', drop).on('close', drop);
    // What the server sent before it closed reaches the client first (a refusal's error, say),
    // late by the delay as the rest was.
    const upstreamGone = () => {
      if (!delayMs || hole) return drop();
      // Ended rather than destroyed (a reset can overtake what was written last), then dropped.
      setTimeout(() => {
        client.end();
        setTimeout(drop, 100);
      }, delayMs);
    };
    upstream.on('error', upstreamGone).on('close', upstreamGone);
    client.on('data', (chunk: Buffer) => {
      if (!hole) upstream.write(chunk);
    });
    upstream.on('data', (chunk: Buffer) => {
      if (mute || hole) return;
      if (!delayMs) client.write(chunk);
      else
        setTimeout(() => {
          if (!client.writable) return;
          client.write(chunk);
          delayed++;
        }, delayMs);
    });
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', () => r()));
  return {
    port: (server.address() as net.AddressInfo).port,
    muteDownstream: () => {
      mute = true;
    },
    blackhole: () => {
      hole = true;
    },
    delayDownstream: (ms) => {
      delayMs = ms;
    },
    get delayed() {
      return delayed;
    },
    cutAll: () => {
      mute = false;
      hole = false;
      for (const [a, b] of pairs) {
        a.destroy();
        b.destroy();
      }
      pairs.clear();
    },
    close: () =>
      new Promise((r) => {
        for (const [a, b] of pairs) {
          a.destroy();
          b.destroy();
        }
        server.close(() => r());
      }),
  };
}
