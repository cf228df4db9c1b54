/**
 * A TCP fault proxy for the chaos run: it forwards to a target, and can be told to add delay,
 * drop everything while keeping connections open (a silent network), go half-open (the client
 * still sends, nothing comes back), hold what comes back until the next fault is set (then it
 * arrives all at once, in order), or reset every connection.
 */
import net from 'node:net';

export type Fault = { kind: 'ok' } | { kind: 'delay'; ms: number } | { kind: 'drop' } | { kind: 'half-open' } | { kind: 'hold' };

export interface FaultProxy {
  port: number;
  set(fault: Fault): void;
  /** Destroys every open connection now (a reset); new ones are accepted. */
  reset(): number;
  close(): Promise<void>;
}

/** Listens on `port` (0: any) and forwards to 127.0.0.1:`targetPort`. */
export async function startFaultProxy(targetPort: number, port = 0): Promise<FaultProxy> {
  let fault: Fault = { kind: 'ok' };
  const pairs = new Set<[net.Socket, net.Socket]>();
  const held: Array<[net.Socket, Buffer]> = [];
  const forward = (to: net.Socket, upstream: boolean) => (chunk: Buffer) => {
    if (fault.kind === 'drop' || (fault.kind === 'half-open' && !upstream)) return;
    if (fault.kind === 'hold' && !upstream) {
      held.push([to, chunk]);
      return;
    }
    if (fault.kind === 'delay') setTimeout(() => to.writable && to.write(chunk), fault.ms);
    else if (to.writable) to.write(chunk);
  };
  const server = net.createServer((client) => {
    const target = net.connect(targetPort, '127.0.0.1');
    const pair: [net.Socket, net.Socket] = [client, target];
    pairs.add(pair);
    const drop = () => {
      client.destroy();
      target.destroy();
      pairs.delete(pair);
    };
    client.on('error', drop).on('close', drop).on('data', forward(target, true));
    target.on('error', drop).on('close', drop).on('data', forward(client, false));
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(port, '127.0.0.1', () => resolve());
  });
  return {
    port: (server.address() as net.AddressInfo).port,
    set: (f) => {
      fault = f;
      if (f.kind !== 'hold') for (const [to, chunk] of held.splice(0)) if (to.writable) to.write(chunk);
    },
    reset: () => {
      const n = pairs.size;
      for (const [a, b] of pairs) {
        a.destroy();
        b.destroy();
      }
      pairs.clear();
      return n;
    },
    close: () =>
      new Promise((resolve) => {
        for (const [a, b] of pairs) {
          a.destroy();
          b.destroy();
        }
        server.close(() => resolve());
      }),
  };
}
