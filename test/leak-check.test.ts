/**
 * The leak check (test/helpers/leak-check.ts) itself: a file that leaves a listening server, a
 * socket or a child process open fails, naming what it left; a file that closes them passes.
 * Runs vitest on throwaway files in a directory of their own, with the check as their setup file.
 */
import { execFile } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { afterAll, expect, it } from 'vitest';

const root = path.resolve(import.meta.dirname, '..');
const dir = mkdtempSync(path.join(tmpdir(), 'leasehold-leak-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const files: Record<string, string> = {
  'vitest.config.mjs': `export default { test: { include: ['*.test.mjs'], setupFiles: [${JSON.stringify(path.join(root, 'test/helpers/leak-check.ts'))}], pool: 'forks' } };\n`,
  'server.test.mjs': `import net from 'node:net'; import { it } from 'vitest';
it('listens', async () => { const s = net.createServer(); await new Promise((r) => s.listen(0, '127.0.0.1', r)); });\n`,
  'socket.test.mjs': `import net from 'node:net'; import { afterAll, it } from 'vitest';
const s = net.createServer((c) => c.on('error', () => {}));
afterAll(() => { s.close(); });
it('connects', async () => { await new Promise((r) => s.listen(0, '127.0.0.1', r)); await new Promise((r) => net.connect(s.address().port, '127.0.0.1', r)); });\n`,
  'child.test.mjs': `import { spawn } from 'node:child_process'; import { it } from 'vitest';
it('spawns', async () => { const c = spawn(process.execPath, ['-e', 'setTimeout(() => {}, 5000)'], { stdio: 'ignore' }); await new Promise((r) => c.once('spawn', r)); });\n`,
  'tidy.test.mjs': `import net from 'node:net'; import { spawn } from 'node:child_process'; import { it } from 'vitest';
it('closes what it opens', async () => {
  const s = net.createServer((c) => c.end());
  await new Promise((r) => s.listen(0, '127.0.0.1', r));
  const c = net.connect(s.address().port, '127.0.0.1');
  await new Promise((r) => c.on('close', r).resume());
  await new Promise((r) => s.close(r));
  const p = spawn(process.execPath, ['-e', '0'], { stdio: 'ignore' });
  await new Promise((r) => p.on('exit', r));
});\n`,
};
for (const [name, text] of Object.entries(files)) writeFileSync(path.join(dir, name), text);

it('fails a file for each server, socket or child process it leaves open, and passes a tidy one', async () => {
  const vitest = path.join(root, 'node_modules/.bin/vitest');
  const out = await promisify(execFile)(vitest, ['run', '--root', dir, '--config', path.join(dir, 'vitest.config.mjs'), '--reporter', 'json'], {
    cwd: dir,
    env: { ...process.env, CI: '1' },
  }).then(
    (r) => r.stdout,
    (e: { stdout: string }) => e.stdout,
  );
  const report = JSON.parse(out.slice(out.indexOf('{'))) as { testResults: Array<{ name: string; status: string; message: string }> };
  const byFile = Object.fromEntries(report.testResults.map((r) => [path.basename(r.name), r]));
  expect(byFile['tidy.test.mjs']!.status).toBe('passed');
  expect(byFile['server.test.mjs']!.status).toBe('failed');
  expect(byFile['server.test.mjs']!.message).toMatch(/1 TCPServerWrap[\s\S]*server listening on/);
  expect(byFile['socket.test.mjs']!.status).toBe('failed');
  expect(byFile['socket.test.mjs']!.message).toMatch(/\d TCPSocketWrap[\s\S]*socket to 127\.0\.0\.1:/);
  expect(byFile['child.test.mjs']!.status).toBe('failed');
  expect(byFile['child.test.mjs']!.message).toMatch(/1 ProcessWrap[\s\S]*child process \d+/);
});
