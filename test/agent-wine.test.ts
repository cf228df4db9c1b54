/**
 * leasehold-agent on Windows, under Wine (8.0) with a Windows Node.js 20 (`node.exe` from the
 * npm registry), against a coordinator on Linux: both ways a Windows PC gets it, the packed
 * package installed with npm and the single file of `npm run build:agent`. Each serves:
 * - a `.cmd` in a path with spaces run through the shell, reading its payload with `set /p`;
 * - the same `.cmd` without `shell`: failed at once, not retried, saying why;
 * - `node.exe` scripts ending with a final and a retryable exit code (`retryableExitCodes`);
 * - `cmd /c ping …` past its timeout, and another one canceled: the whole tree (cmd and ping)
 *   is stopped, although Wine's taskkill refuses `/T`;
 * from a configuration saved as Notepad saves it (byte order mark, CRLF), a token file and an
 * outbox on `C:\`; `--check` first; Ctrl-C (SIGINT) drains it to exit code 0.
 *
 * What cannot be checked under Wine, and why (docs/agent.md lists it too): the agent as a
 * WinSW service (no service manager to speak of); `taskkill /T` itself (Wine's taskkill refuses
 * `/T`, so the tree is stopped by the fallback, which this test requires to have run); the
 * cleanup after a crashed agent (Wine's `tasklist` lists nothing, so the runner cannot confirm a
 * pid still runs the recorded image and rightly leaves it alone); PowerShell commands.
 *
 * Skipped where Wine is not installed, unless LEASEHOLD_REQUIRE_WINE=1 (CI sets it), which
 * makes a missing Wine a failure.
 */
import { execFile } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { jobEnqueue } from '../server/store/index.js';
import { buildSingleFileAgent, installAgent, packAgent, root } from './helpers/agent-package.js';
import { ADMIN_KEY, useCoordinator, waitFor } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';
import { rpc } from './helpers/http.js';
import { setUpWine, stopWine, wineMissing, type Wine } from './helpers/wine.js';

const run = promisify(execFile);
// .ci/run runs this file on its own after the suite (LEASEHOLD_WINE_TEST=after-suite during the
// suite): Windows programs under Wine are slow enough that, beside the suite's heaviest files on
// two cores, their timing is what gets tested rather than their behaviour.
const later = process.env.LEASEHOLD_WINE_TEST === 'after-suite' ? 'run on its own after the suite (.ci/run)' : undefined;
const missing = later ?? (await wineMissing());
if (!later && missing && process.env.LEASEHOLD_REQUIRE_WINE === '1') throw new Error(`LEASEHOLD_REQUIRE_WINE=1 but ${missing}`);

const t = useTestDb();
// Claims and leases of 30 s: a Windows Node.js under Wine, beside the rest of the suite on two
// cores, can take longer than the suite's usual 1.5 s to answer; this file is about what the agent
// does on Windows, not about lease loss (test/agent-runner.test.ts has that).
const lh = useCoordinator(t, { LEASEHOLD_CLAIM_TTL: '30s', LEASEHOLD_LEASE_TTL: '30s', LEASEHOLD_HEARTBEAT_INTERVAL: '2s' });

let work = '';
let wine: Wine | undefined;
let singleFile = '';

/** Linux processes of Wine running `ping -n <count> 127.0.0.1` (each test uses its own count). */
const pings = async (count: number) =>
  (await run('pgrep', ['-f', `ping -n ${count} 127.0.0.1`]).then(
    (r) => r.stdout.trim().split('\n').filter(Boolean),
    () => [] as string[],
  )).length;

const job = async (id: string) => (await t.pool.query(`SELECT status::text, result, job_error(id, status) AS error, attempt_no FROM jobs WHERE id = $1`, [id])).rows[0];
/** Every attempt of a job, for the message of a failed expectation. */
const history = async (id: string) =>
  JSON.stringify((await t.pool.query(`SELECT attempt_no, status::text, error, retryable FROM attempt_log WHERE job_id = $1 ORDER BY attempt_no`, [id])).rows);

async function enqueue(queue: string, payload: Record<string, unknown>, maxAttempts = 3) {
  const o = await jobEnqueue(t.pool, { queue, payload, maxAttempts });
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  return o.value.id;
}

beforeAll(async () => {
  if (missing) return;
  work = await mkdtemp(path.join(os.tmpdir(), 'leasehold-wine-'));
  wine = await setUpWine(work);
  singleFile = path.join(work, 'leasehold-agent.mjs');
  await buildSingleFileAgent(singleFile);
  // Where the Windows service template expects it: installed in C:\leasehold.
  const { tgz } = await packAgent(work);
  await installAgent(path.join(wine.driveC, 'leasehold'), tgz);
}, 600_000);

/** The WinSW template's `<arguments>`, split as Windows does (quotes group). */
function serviceArguments(): string[] {
  const xml = readFileSync(path.join(root, 'examples/windows/leasehold-agent.xml'), 'utf8');
  const line = /<arguments>(.*)<\/arguments>/.exec(xml)![1]!;
  return [...line.matchAll(/"([^"]*)"|(\S+)/g)].map((m) => m[1] ?? m[2]!);
}

afterAll(async () => {
  await stopWine(wine);
  if (work) await rm(work, { recursive: true, force: true });
});

describe.skipIf(missing)(`leasehold-agent under Wine${missing ? ` (skipped: ${missing})` : ''}`, () => {
  for (const [kind, pingBase] of [
    ['single-file', 61],
    ['package', 71],
  ] as const) {
    it(`${kind}: .cmd with and without shell, exit codes, timeout and cancel of a tree, --check, Ctrl-C`, async () => {
      const w = wine!;
      // The package as the service template runs it: C:\leasehold\agent.json.
      const dirName = kind === 'package' ? 'leasehold' : `leasehold-${kind}`;
      const dir = path.join(w.driveC, dirName);
      const winDir = `C:\\${dirName}`;
      await mkdir(path.join(dir, 'jobs dir'), { recursive: true });
      const token = await lh.agent(`wine-${kind}`);
      await writeFile(path.join(dir, 'token.txt'), `${token}\r\n`);
      await writeFile(path.join(dir, 'jobs dir', 'add.cmd'), ['@echo off', 'set /p P=', 'echo {"payload":%P%,"job":"%LEASEHOLD_JOB_ID%"}', ''].join('\r\n'));
      await writeFile(
        path.join(dir, 'jobs dir', 'exit.mjs'),
        [
          "let s = '';",
          "process.stdin.on('data', (d) => (s += d)).on('end', () => {",
          '  const p = JSON.parse(s);',
          "  if (p.code && String(p.okOnAttempt) !== process.env.LEASEHOLD_ATTEMPT_NO) { process.stderr.write('failing on purpose\\n'); process.exit(p.code); }",
          '  console.log(JSON.stringify({ ok: true, attempt: Number(process.env.LEASEHOLD_ATTEMPT_NO) }));',
          '});',
          '',
        ].join('\n'),
      );
      const q = (name: string) => `${kind}-${name}`;
      const config = {
        url: lh.url,
        tokenFile: `${winDir}\\token.txt`,
        slots: 4,
        outboxDir: `${winDir}\\outbox`,
        grace: '5s',
        queues: {
          [q('add')]: { command: [`"${winDir}\\jobs dir\\add.cmd"`], shell: true, timeout: '1m' },
          [q('noshell')]: { command: [`${winDir}\\jobs dir\\add.cmd`], timeout: '1m' },
          [q('exit')]: { command: [w.win(w.nodeExe), `${winDir}\\jobs dir\\exit.mjs`], retryableExitCodes: [75], timeout: '1m' },
          [q('ping')]: { command: ['cmd', '/c', `ping -n ${pingBase} 127.0.0.1`], timeout: '3s', killGrace: '1s' },
          [q('long')]: { command: ['cmd', '/c', `ping -n ${pingBase + 1} 127.0.0.1`], timeout: '5m', killGrace: '1s' },
        },
      };
      // As Notepad saves it: a byte order mark and CRLF line ends.
      await writeFile(path.join(dir, 'agent.json'), `\uFEFF${JSON.stringify(config, null, 2).replaceAll('\n', '\r\n')}`);
      const args = kind === 'package' ? serviceArguments() : [w.win(singleFile), '--config', `${winDir}\\agent.json`];
      expect(args.at(-1)).toBe(`${winDir}\\agent.json`);

      const check = await w.nodeRun([...args, '--check'], { cwd: work, logFile: path.join(work, `${kind}-check.log`) });
      expect(check.output).toMatch(/config ok: 5 queue\(s\), 4 slot\(s\), outbox C:\\leasehold/);
      expect(check.output).toMatch(/coordinator ok/);
      expect(check.code).toBe(0);

      const agent = w.node(args, { cwd: work, logFile: path.join(work, `${kind}-serve.log`) });
      try {
        await waitFor('serving', () => agent.output().includes('"event":"serving"'), 60_000);
        const add = await enqueue(q('add'), { a: 2, b: 40 });
        const noshell = await enqueue(q('noshell'), { a: 1, b: 1 }, 5);
        const final = await enqueue(q('exit'), { code: 3 });
        const retried = await enqueue(q('exit'), { code: 75, okOnAttempt: 2 });
        const timedOut = await enqueue(q('ping'), {}, 1);
        const canceled = await enqueue(q('long'), {});

        // The batch file got the whole payload line (it ends with a newline) and the job id.
        await waitFor('the .cmd job', async () => (await job(add)).status === 'succeeded', 60_000);
        expect((await job(add)).result).toEqual({ payload: { a: 2, b: 40 }, job: add });
        await waitFor('the .cmd without shell', async () => (await job(noshell)).status === 'failed', 60_000);
        expect(await job(noshell), await history(noshell)).toMatchObject({ attempt_no: 1, error: { message: expect.stringMatching(/EINVAL: a \.cmd or \.bat file needs "shell": true/) } });
        await waitFor('the exit codes', async () => (await job(final)).status === 'failed' && (await job(retried)).status === 'succeeded', 90_000);
        expect(await job(final), await history(final)).toMatchObject({ attempt_no: 1, error: { message: 'exited with code 3: failing on purpose' } });
        expect(await job(retried), await history(retried)).toMatchObject({ attempt_no: 2, result: { ok: true, attempt: 2 } });

        // Timeout: cmd and its ping are both gone (taskkill /T is refused here: the tree is found by parent ids).
        await waitFor('the ping to time out running', async () => (await pings(pingBase)) > 0, 60_000);
        await waitFor('the timed-out job ended', async () => ['dead', 'failed', 'succeeded', 'canceled'].includes((await job(timedOut)).status), 90_000);
        expect((await job(timedOut)).status, await history(timedOut)).toBe('dead');
        expect((await job(timedOut)).error.message).toMatch(/^timed out after 3000 ms/);
        await waitFor('no ping left of the timed-out job', async () => (await pings(pingBase)) === 0, 20_000);
        expect(agent.output()).toMatch(/taskkill failed: stopping the tree by parent process ids/);

        // Cancel: the same.
        await waitFor('the long ping running', async () => (await pings(pingBase + 1)) > 0, 60_000);
        const answer = await rpc(lh.httpUrl, 'leasehold.v1.JobService/CancelJob', { jobId: canceled }, ADMIN_KEY);
        expect(answer.status).toBe(200);
        await waitFor('no ping left of the canceled job', async () => (await pings(pingBase + 1)) === 0, 20_000);
        expect((await job(canceled)).status).toBe('canceled');
        // Its handler done too (stopping the tree by parent ids takes a few seconds under Wine):
        // the Ctrl-C below is about draining an agent, not about one sent amid taskkill runs (once,
        // in CI, a SIGINT sent then was never seen by the agent).
        await waitFor('the canceled handler finished', () =>
          agent.output().split('\n').some((l) => l.includes(`"jobId":"${canceled}"`) && l.includes('"event":"handler.finished"')),
        30_000);

        // Ctrl-C drains and exits 0.
        agent.child.kill('SIGINT');
        const code = await Promise.race([agent.exited, new Promise<string>((r) => setTimeout(() => r('still running 60 s after SIGINT'), 60_000))]);
        expect(code).toBe(0);
        expect(agent.output()).toMatch(/shutting down: draining/);
      } catch (err) {
        // What the agent said, with the failure: the test's folder is removed afterwards.
        (err as Error).message += `\n--- the agent's log, last lines ---\n${agent.output().split('\n').slice(-40).join('\n')}`;
        const jobs = await t.pool.query(`SELECT queue, status::text, attempt_no, job_error(id, status) AS error FROM jobs WHERE queue LIKE $1 ORDER BY created_at`, [`${kind}-%`]);
        (err as Error).message += `\n--- the jobs ---\n${jobs.rows.map((r) => JSON.stringify(r)).join('\n')}`;
        throw err;
      } finally {
        agent.child.kill('SIGKILL');
      }
    }, 480_000);
  }
});
