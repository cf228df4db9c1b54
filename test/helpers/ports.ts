import net from 'node:net';

/** A free TCP port on 127.0.0.1 (asked of the OS, then released: the caller binds it at once). */
export async function freePort(): Promise<number> {
  const s = net.createServer();
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', () => r()));
  const port = (s.address() as net.AddressInfo).port;
  await new Promise((r) => s.close(r));
  return port;
}
