/**
 * The coordinator's listeners once they listen: a server error (an `accept` that fails, out of
 * file descriptors or memory) is logged and the server keeps serving. Without a listener, Node
 * throws such an error and the coordinator's process ends, every agent stream with it.
 */
import http from 'node:http';
import { describe, expect, it } from 'vitest';
import { listenOn } from '../server/transport/server.js';

describe('listenOn', () => {
  it('logs a server error after the listen and goes on serving', async () => {
    const logged: Array<[unknown, string]> = [];
    const server = http.createServer((_req, res) => res.end('still here'));
    try {
      const address = await listenOn(server, '127.0.0.1:0', { error: (obj: unknown, msg: string) => void logged.push([obj, msg]) } as never);
      const err = Object.assign(new Error('accept EMFILE'), { code: 'EMFILE', syscall: 'accept' });
      // What Node's net.Server does with a failed accept: emit 'error' (it throws when nobody listens).
      expect(() => server.emit('error', err)).not.toThrow();
      expect(logged).toEqual([[{ err, addr: '127.0.0.1:0' }, 'listener error; still listening']]);
      const res = await fetch(`http://127.0.0.1:${address.port}/`);
      expect(await res.text()).toBe('still here');
    } finally {
      await new Promise((r) => server.close(r));
    }
  });

  it('rejects when the address cannot be listened on', async () => {
    const a = http.createServer();
    const b = http.createServer();
    try {
      const { port } = await listenOn(a, '127.0.0.1:0', { error: () => undefined } as never);
      await expect(listenOn(b, `127.0.0.1:${port}`, { error: () => undefined } as never)).rejects.toMatchObject({ code: 'EADDRINUSE' });
    } finally {
      await new Promise((r) => a.close(r));
    }
  });
});
