/**
 * The leak check of every test file (vitest's `setupFiles`): after the file's own teardown, it
 * has left no listening server, no socket (an agent stream, an HTTP connection, a client of
 * PostgreSQL) and no child process open that was not open before its first test. Its `afterAll`
 * is registered before the file's own, so it runs after them (vitest runs after-hooks as a stack).
 * Pool clients checked out across a test are test/helpers/db.ts's check.
 */
import { afterAll, beforeAll } from 'vitest';

/** libuv handle kinds (`process.getActiveResourcesInfo()`) a file must close. Timers are not among them. */
const KINDS = ['TCPServerWrap', 'TCPSocketWrap', 'TCPWrap', 'PipeServerWrap', 'PipeWrap', 'ProcessWrap', 'UDPWrap'];

function census(): Map<string, number> {
  const n = new Map<string, number>();
  for (const kind of process.getActiveResourcesInfo()) if (KINDS.includes(kind)) n.set(kind, (n.get(kind) ?? 0) + 1);
  return n;
}

/** What each open handle is, for the message: a server's address, a socket's peer, a child's pid. */
function describeHandles(): string[] {
  const handles = (process as unknown as { _getActiveHandles(): unknown[] })._getActiveHandles();
  return handles.flatMap((h) => {
    const o = h as Record<string, unknown> & { constructor: { name: string } };
    const name = o.constructor.name;
    if (name === 'Server' && typeof o.address === 'function') return [`server listening on ${JSON.stringify((o.address as () => unknown).call(o))}`];
    if (name === 'Socket' && o.remotePort) return [`socket to ${String(o.remoteAddress)}:${String(o.remotePort)} from port ${String(o.localPort)}`];
    if (name === 'ChildProcess') return [`child process ${String(o.pid)} (${String(o.spawnfile)})`];
    return [];
  });
}

let before = new Map<string, number>();
beforeAll(() => {
  before = census();
});

afterAll(async () => {
  // A handle whose close() was called goes in the close phase of the event loop's next turns.
  for (let i = 0; i < 3; i++) await new Promise((r) => setImmediate(r));
  const left = [...census()].filter(([kind, n]) => n > (before.get(kind) ?? 0)).map(([kind, n]) => `${n - (before.get(kind) ?? 0)} ${kind}`);
  if (left.length) throw new Error(`left open after the file's teardown: ${left.join(', ')}\n  ${describeHandles().join('\n  ')}`);
});
