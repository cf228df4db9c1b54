/**
 * `leasehold serve` whose gRPC port is taken (an old instance still running): it says so and
 * exits 1. The start failed after the agent hub had started its lease ticker, which nothing
 * stopped: the process said it failed and then never exited, so no supervisor restarted it.
 */
import { spawn } from 'node:child_process';
import net from 'node:net';
import path from 'node:path';
import { expect, it } from 'vitest';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();
const root = path.resolve(import.meta.dirname, '..');

it('exits 1, saying why, when its gRPC port is taken', async () => {
  const squatter = net.createServer();
  await new Promise<void>((r) => squatter.listen(0, '127.0.0.1', r));
  const port = (squatter.address() as net.AddressInfo).port;
  try {
    const child = spawn(process.execPath, ['--import', 'tsx', 'server/cli.ts', 'serve'], {
      cwd: root,
      env: { ...process.env, DATABASE_URL: t.url, LEASEHOLD_GRPC_ADDR: `127.0.0.1:${port}`, LEASEHOLD_HTTP_ADDR: '127.0.0.1:0', LEASEHOLD_LOG_FORMAT: 'json' },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    let output = '';
    child.stdout.on('data', (d: Buffer) => (output += d.toString()));
    child.stderr.on('data', (d: Buffer) => (output += d.toString()));
    const code = await Promise.race([
      new Promise<number | null>((r) => child.once('exit', (c) => r(c))),
      new Promise<string>((r) => setTimeout(() => r('still running 30 s after its start failed'), 30_000)),
    ]);
    if (typeof code === 'string') child.kill('SIGKILL');
    expect(code, output).toBe(1);
    expect(output).toMatch(/EADDRINUSE/);
  } finally {
    await new Promise((r) => squatter.close(r));
  }
}, 60_000);
