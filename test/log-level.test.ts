/**
 * `LEASEHOLD_LOG_LEVEL` as every program reads it: empty is the default (`info`), a level name in
 * any case is that level, and anything else is a bad setting: the coordinator's command and the
 * runner stop with exit code 2 and one line naming it and the levels (not pino's stack trace), and
 * the SDK's constructor throws that message (a library does not end its host's process).
 */
import { spawn } from 'node:child_process';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { createAgent } from '@leasehold/agent-client';
import { envLogLevel } from '../agent-client/src/agent.js';
import { logLevel } from '../server/log.js';
import { root } from './helpers/serve.js';

const LEVELS = 'trace, debug, info, warn, error, fatal, silent';
const dirs: string[] = [];
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

function run(args: string[], env: Record<string, string>): Promise<{ code: number | null; stdout: string; stderr: string }> {
  const child = spawn(process.execPath, args, { cwd: root, env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (d: Buffer) => (stdout += d));
  child.stderr.on('data', (d: Buffer) => (stderr += d));
  return new Promise((resolve) => child.on('close', (code) => resolve({ code, stdout, stderr })));
}

describe('reading LEASEHOLD_LOG_LEVEL', () => {
  it('unset or empty: info; a name in any case: that level; else an error naming the setting and the levels', () => {
    for (const read of [logLevel, envLogLevel]) {
      expect(read({})).toBe('info');
      expect(read({ LEASEHOLD_LOG_LEVEL: '' })).toBe('info');
      expect(read({ LEASEHOLD_LOG_LEVEL: ' ' })).toBe('info');
      expect(read({ LEASEHOLD_LOG_LEVEL: 'DEBUG' })).toBe('debug');
      expect(read({ LEASEHOLD_LOG_LEVEL: 'silent' })).toBe('silent');
      expect(() => read({ LEASEHOLD_LOG_LEVEL: 'verbose' })).toThrow(`LEASEHOLD_LOG_LEVEL="verbose" is not a log level: use ${LEVELS} (default info)`);
    }
  });
});

describe('a bad LEASEHOLD_LOG_LEVEL', () => {
  it('stops the leasehold command (serve, stats) with exit code 2 and one line', async () => {
    for (const args of [['serve'], ['stats', '--url', 'http://127.0.0.1:1', '--key', 'k']]) {
      const r = await run(['server/leasehold.mjs', ...args], { LEASEHOLD_LOG_LEVEL: 'verbose', LEASEHOLD_DATA_DIR: '/nonexistent/leasehold-log-level' });
      expect(r, args.join(' ')).toEqual({ code: 2, stdout: '', stderr: `LEASEHOLD_LOG_LEVEL="verbose" is not a log level: use ${LEVELS} (default info)\n` });
    }
  });

  it('empty is the default: the command runs (here: cannot reach the coordinator, exit code 3)', async () => {
    const r = await run(['server/leasehold.mjs', 'stats', '--url', 'http://127.0.0.1:1', '--key', 'k'], { LEASEHOLD_LOG_LEVEL: '' });
    expect(r.code, r.stderr).toBe(3);
    expect(r.stderr).toMatch(/^error: cannot reach the coordinator at http:\/\/127\.0\.0\.1:1: connect ECONNREFUSED/);
  });

  it('stops leasehold-agent (--check) with exit code 2 and one line, before it reads its configuration', async () => {
    const dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-log-level-'));
    dirs.push(dir);
    const config = path.join(dir, 'agent.json');
    await writeFile(config, JSON.stringify({ url: 'http://127.0.0.1:1', token: 'lh_agent_x', outboxDir: path.join(dir, 'outbox'), queues: { q: { command: ['true'] } } }));
    const r = await run(['agent-client/bin/leasehold-agent.mjs', '--config', config, '--check'], { LEASEHOLD_LOG_LEVEL: 'verbose' });
    expect(r).toEqual({ code: 2, stdout: '', stderr: `leasehold-agent: LEASEHOLD_LOG_LEVEL="verbose" is not a log level: use ${LEVELS} (default info)\n` });
  });

  describe('the SDK without a logger of its own', () => {
    const saved = process.env.LEASEHOLD_LOG_LEVEL;
    afterEach(() => {
      if (saved === undefined) delete process.env.LEASEHOLD_LOG_LEVEL;
      else process.env.LEASEHOLD_LOG_LEVEL = saved;
    });

    it('throws from createAgent, naming the setting; a logger given is used as it is', () => {
      process.env.LEASEHOLD_LOG_LEVEL = 'verbose';
      const opts = { url: 'http://127.0.0.1:1', token: 'lh_agent_x', outboxDir: path.join(os.tmpdir(), 'leasehold-never-opened') };
      expect(() => createAgent(opts)).toThrow(`LEASEHOLD_LOG_LEVEL="verbose" is not a log level: use ${LEVELS} (default info)`);
      process.env.LEASEHOLD_LOG_LEVEL = '';
      expect(createAgent(opts).log.level).toBe('info');
    });
  });
});
