/**
 * The embedded PostgreSQL's start when `postmaster.pid` is stale: after a crash or a reboot the
 * file stays, and its pid may by now belong to another process. That process must never be
 * signalled; only a server that answers for this data directory is stopped (a SIGKILLed
 * coordinator's, covered in coordinator.process.test.ts) or shared.
 */
import { spawn } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import pino from 'pino';
import { expect, it } from 'vitest';
import { startEmbedded } from '../server/store/embedded.js';
import { alive } from './helpers/pids.js';


it.skipIf(process.platform === 'win32')('leaves alone a live process named by a stale postmaster.pid, and starts', async () => {
  const dataDir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-embedded-'));
  const lines: Array<Record<string, unknown>> = [];
  const log = pino({ level: 'info' }, { write: (s: string) => void lines.push(JSON.parse(s) as Record<string, unknown>) });
  // A process that took the pid of a server gone without removing its file; SIGINT ends it.
  const stranger = spawn(process.execPath, ['-e', 'setInterval(() => {}, 1000)'], { stdio: 'ignore' });
  let second: Awaited<ReturnType<typeof startEmbedded>> | Error | undefined;
  try {
    const first = await startEmbedded({ dataDir, log });
    await first.stop();
    const pgdata = path.join(dataDir, 'pg');
    // The file as the postmaster writes it: pid, data directory, start time, port, socket
    // directory, listen address, shared memory key, status.
    writeFileSync(path.join(pgdata, 'postmaster.pid'), [stranger.pid, pgdata, Math.floor(Date.now() / 1000), first.port, '', '127.0.0.1', '', 'ready   ', ''].join('\n'));

    second = await startEmbedded({ dataDir, log }).catch((err: unknown) => err as Error);
    expect(alive(stranger.pid!), 'the stranger was signalled').toBe(true);
    expect(lines.find((l) => /not the PostgreSQL of this data directory/.test(String(l.msg)))).toMatchObject({ pid: stranger.pid, port: first.port });
    if (second instanceof Error) {
      // As the same user as the stranger, PostgreSQL itself refuses the file (it can signal that
      // pid, so it cannot tell it is not a postmaster); as root it runs as `postgres` and can't.
      expect(second.message).toMatch(/lock file "postmaster.pid" already exists/);
    } else {
      expect(second.owned).toBe(true);
      const c = new pg.Client({ connectionString: second.url });
      await c.connect();
      try {
        expect((await c.query('SELECT 1 AS one')).rows[0].one).toBe(1);
      } finally {
        // Ended before the server stops: its 57P01 on a client with no listener would be thrown
        // over this test's own failure.
        await c.end();
      }
    }
  } finally {
    if (second && !(second instanceof Error)) await second.stop();
    stranger.kill('SIGKILL');
    await rm(dataDir, { recursive: true, force: true });
  }
});
