/**
 * `npm start` on Windows, under Wine: npm runs the script through `cmd.exe /d /s /c`, where
 * `exec` is `exec.cmd` in the package root, and stopping npm (on Windows, any signal is
 * TerminateProcess) stops nothing below it, so the coordinator watches npm above its cmd.exe
 * (server/launcher.ts). Here a Windows Node.js plays npm: it starts `cmd.exe /d /s /c "exec
 * node.exe child.mjs"` exactly as npm does, the child (the launcher watch, bundled) reports whom it
 * watches (npm must be among them: found above cmd.exe through wmic here, PowerShell on Windows),
 * then "npm" ends, and the child must notice within seconds. (Under Wine cmd.exe ends with npm,
 * so it is the watch of the parent that fires; on Windows cmd.exe stays and the watch of npm
 * does: that one is not seen here.)
 *
 * Skipped where Wine is not installed, unless LEASEHOLD_REQUIRE_WINE=1; run on its own after the
 * suite in CI (LEASEHOLD_WINE_TEST=after-suite during the suite), as test/agent-wine.test.ts.
 */
import { existsSync, readFileSync } from 'node:fs';
import { copyFile, mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { build } from 'esbuild';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { setUpWine, stopWine, wineMissing, type Wine } from './helpers/wine.js';

const root = path.resolve(import.meta.dirname, '..');
const later = process.env.LEASEHOLD_WINE_TEST === 'after-suite' ? 'run on its own after the suite (.ci/run)' : undefined;
const missing = later ?? (await wineMissing());
if (!later && missing && process.env.LEASEHOLD_REQUIRE_WINE === '1') throw new Error(`LEASEHOLD_REQUIRE_WINE=1 but ${missing}`);

let work = '';
let wine: Wine | undefined;

/** Resolves once `file` exists, checking every 100 ms; fails after `ms`. */
async function appears(file: string, ms: number): Promise<string> {
  const deadline = Date.now() + ms;
  while (!existsSync(file)) {
    if (Date.now() > deadline) throw new Error(`${path.basename(file)} did not appear within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 100));
  }
  return readFileSync(file, 'utf8'); // whole: each file is written beside its name and renamed into place
}

describe.skipIf(missing)(`npm start's stop on Windows, under Wine${missing ? ` (skipped: ${missing})` : ''}`, () => {
  beforeAll(async () => {
    work = await mkdtemp(path.join(os.tmpdir(), 'leasehold-launcher-wine-'));
    wine = await setUpWine(work);
  }, 300_000);
  afterAll(async () => {
    await stopWine(wine);
    if (work) await rm(work, { recursive: true, force: true });
  });

  it('exec.cmd runs the script, the watch finds npm above cmd.exe, and the child stops when npm ends', async () => {
    const w = wine!;
    const dir = path.join(work, 'pkg');
    await build({
      stdin: {
        resolveDir: root,
        loader: 'ts',
        contents: `
          import { renameSync, writeFileSync } from 'node:fs';
          import { watchLauncher } from './server/launcher.ts';
          // Written whole or not at all, for the test (and npm.mjs) that read them once they exist.
          const put = (file, text) => {
            writeFileSync(file + '.tmp', text);
            renameSync(file + '.tmp', file);
          };
          const log = {
            debug: (o) => put('watching.json', JSON.stringify({ pid: process.pid, ppid: process.ppid, ...o })),
            info() {},
            warn() {},
          };
          watchLauncher(log, (why) => {
            put('gone.txt', why);
            process.exit(0);
          });
          setInterval(() => undefined, 1000);
        `,
      },
      bundle: true,
      platform: 'node',
      format: 'esm',
      outfile: path.join(dir, 'child.mjs'),
      logLevel: 'silent',
    });
    await copyFile(path.join(root, 'exec.cmd'), path.join(dir, 'exec.cmd'));
    // What npm does for `"start": "exec node …"`: cmd.exe /d /s /c "<script>", verbatim.
    await writeFile(
      path.join(dir, 'npm.mjs'),
      `
      import { spawn } from 'node:child_process';
      import { existsSync, renameSync, writeFileSync } from 'node:fs';
      spawn('cmd.exe', ['/d', '/s', '/c', '"exec "' + process.execPath + '" child.mjs"'], {
        env: { ...process.env, npm_lifecycle_event: 'start' },
        stdio: 'ignore',
        windowsVerbatimArguments: true,
      });
      const t = setInterval(() => {
        if (!existsSync('watching.json')) return;
        clearInterval(t);
        writeFileSync('npm.txt.tmp', String(process.pid));
        renameSync('npm.txt.tmp', 'npm.txt');
        process.exit(0); // npm ends; cmd.exe and the child do not
      }, 100);
      `,
    );
    const npm = w.node(['npm.mjs'], { cwd: dir, logFile: path.join(work, 'npm.log') });
    const watching = JSON.parse(await appears(path.join(dir, 'watching.json'), 120_000)) as { watched: Record<string, string> };
    const npmPid = Number(await appears(path.join(dir, 'npm.txt'), 30_000));
    // It found npm above cmd.exe (wmic under Wine; PowerShell on Windows).
    expect(watching.watched[String(npmPid)], JSON.stringify(watching)).toBe('npm');
    expect(await npm.exited).toBe(0);
    // On Windows cmd.exe outlives npm and the watch of npm fires; under Wine cmd.exe ends with it,
    // and the watch of the parent fires first. Either way the child stops within seconds.
    const gone = await appears(path.join(dir, 'gone.txt'), 30_000);
    expect(gone).toMatch(new RegExp(`^(npm \\(pid ${npmPid}\\)|the process that started it \\(pid \\d+\\)) ended$`));
  }, 300_000);
});
