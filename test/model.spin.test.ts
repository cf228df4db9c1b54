/**
 * The Promela model of the lease/fence protocol (model/leasehold.pml), checked with spin:
 *
 * - as written, an exhaustive search finds no violation of invariants 1, 2 and 4 of DESIGN.md
 *   in any reachable state (safety run), and no run where a passed lease stays passed forever
 *   under weak fairness (liveness run);
 * - with the attempt check removed from completion (-DNO_FENCE_ON_COMPLETE) the search must
 *   find a counterexample and write a trail, so the model is known to be able to fail.
 *
 * spin writes pan.c, pan.h, … and trails into its working directory: every run happens in a
 * fresh temporary directory holding a copy of the model. Without spin (Debian's `spin` package)
 * or gcc the test is skipped and says why.
 */
import { execFile } from 'node:child_process';
import { copyFile, mkdtemp, readdir, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, describe, expect, it } from 'vitest';

const MODEL = fileURLToPath(new URL('../model/leasehold.pml', import.meta.url));
const STEP_TIMEOUT_MS = 120_000;

interface Ran {
  code: number;
  stdout: string;
  stderr: string;
}

/** Runs a program without a shell; a non-zero exit is returned, not thrown (pan's verdict is in its output). */
function run(file: string, args: string[], cwd: string): Promise<Ran> {
  return new Promise((resolve, reject) => {
    execFile(file, args, { cwd, timeout: STEP_TIMEOUT_MS, maxBuffer: 64 * 1024 * 1024 }, (err, stdout, stderr) => {
      if (err && (typeof err.code !== 'number' || err.killed)) {
        reject(new Error(`${file} ${args.join(' ')} failed: ${err.message}\n${stdout}\n${stderr}`));
        return;
      }
      resolve({ code: typeof err?.code === 'number' ? err.code : 0, stdout, stderr });
    });
  });
}

/** Why the model cannot be checked here, or undefined when spin and gcc are both present. */
async function missingTool(): Promise<string | undefined> {
  for (const [tool, args] of [
    ['spin', ['-V']],
    ['gcc', ['--version']],
  ] as const) {
    try {
      await run(tool, [...args], os.tmpdir());
    } catch {
      return `${tool} is not installed (apt-get install -y ${tool === 'spin' ? 'spin' : 'gcc'}, as .ci/run does)`;
    }
  }
  return undefined;
}

const missing = await missingTool();
if (missing) console.log(`model check skipped: ${missing}`);

interface Pan {
  output: string;
  errors: number;
  statesStored: number;
  transitions: number;
  depth: number;
  seconds: number;
}

function figure(output: string, re: RegExp, what: string): number {
  const m = re.exec(output);
  if (!m) throw new Error(`pan output has no ${what}:\n${output}`);
  return Number(m[1]);
}

function parsePan(output: string): Pan {
  return {
    output,
    errors: figure(output, /errors: (\d+)/, 'error count'),
    statesStored: figure(output, /^\s*(\d+) states, stored/m, 'stored states'),
    transitions: figure(output, /^\s*(\d+) transitions/m, 'transitions'),
    depth: figure(output, /depth reached (\d+)/, 'depth'),
    seconds: figure(output, /elapsed time ([\d.e+-]+) seconds/, 'elapsed time'),
  };
}

/** The search covered the whole state space: not cut by the depth limit or memory. */
function expectComplete(p: Pan) {
  expect(p.output).toContain('Full statespace search for:');
  expect(p.output).not.toMatch(/max search depth too small/);
  expect(p.output).not.toMatch(/out of memory|reached -DMEMLIM|hash table is full|aborted/i);
}

const dirs: string[] = [];

/**
 * Generates and compiles the verifier for one configuration in a fresh directory, runs it and
 * returns its figures (printed, so the test output carries them).
 */
async function check(name: string, p: { spin: string[]; gcc: string[]; pan: string[] }): Promise<{ dir: string; pan: Pan }> {
  const dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-spin-'));
  dirs.push(dir);
  await copyFile(MODEL, path.join(dir, 'leasehold.pml'));
  const gen = await run('spin', [...p.spin, '-a', 'leasehold.pml'], dir);
  expect(gen.code, `spin -a failed:\n${gen.stdout}\n${gen.stderr}`).toBe(0);
  const cc = await run('gcc', ['-O2', ...p.gcc, '-o', 'pan', 'pan.c'], dir);
  expect(cc.code, `gcc failed:\n${cc.stderr}`).toBe(0);
  const ran = await run(path.join(dir, 'pan'), p.pan, dir);
  const pan = parsePan(ran.stdout);
  console.log(
    `${name}: spin ${[...p.spin, '-a'].join(' ')}; gcc -O2 ${p.gcc.join(' ')}; ./pan ${p.pan.join(' ')}\n` +
      `  errors: ${pan.errors}, states stored: ${pan.statesStored}, transitions: ${pan.transitions}, ` +
      `depth: ${pan.depth}, time: ${pan.seconds} s`,
  );
  return { dir, pan };
}

afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

describe.skipIf(missing !== undefined)('the Promela model of the protocol (spin)', () => {
  it('holds invariants 1, 2 and 4 in every reachable state (exhaustive safety search)', { timeout: 300_000 }, async () => {
    const { pan } = await check('safety', {
      spin: [],
      gcc: ['-DSAFETY', '-DNOCLAIM'],
      pan: ['-m100000', '-w20'],
    });
    expectComplete(pan);
    expect(pan.output).toMatch(/assertion violations\s+\+/);
    expect(pan.errors).toBe(0);
    expect(pan.statesStored).toBeGreaterThan(1000);
  });

  it('never leaves a passed lease passed forever (ltl lease_ends, weak fairness)', { timeout: 300_000 }, async () => {
    // Without the operator: under weak fairness an always-enabled cancel would end every lease.
    const { pan } = await check('liveness', {
      spin: ['-DNO_CANCEL'],
      gcc: ['-DNFAIR=4'],
      pan: ['-a', '-f', '-m100000', '-w20'],
    });
    expectComplete(pan);
    expect(pan.output).toMatch(/never claim\s+\+ \(lease_ends\)/);
    expect(pan.output).toMatch(/acceptance\s+cycles\s+\+ \(fairness enabled\)/);
    expect(pan.errors).toBe(0);
  });

  it('finds a counterexample when completion does not check the attempt', { timeout: 300_000 }, async () => {
    const { dir, pan } = await check('broken (-DNO_FENCE_ON_COMPLETE)', {
      spin: ['-DNO_FENCE_ON_COMPLETE'],
      gcc: ['-DSAFETY', '-DNOCLAIM', '-DREACH'],
      // -i: keep searching for a shorter trail, so the one printed is readable.
      pan: ['-m100000', '-w20', '-i'],
    });
    expect(pan.errors).toBeGreaterThanOrEqual(1);
    expect(pan.output).toMatch(/assertion violated/);
    expect(await readdir(dir)).toContain('leasehold.pml.trail');
    const replay = await run('spin', ['-DNO_FENCE_ON_COMPLETE', '-t', 'leasehold.pml'], dir);
    expect(replay.stdout).toMatch(/assertion violated/);
    const story = replay.stdout
      .split('\n')
      .filter((l) => /STEP|assertion violated|failed assertion/.test(l))
      .map((l) => `  ${l.trim()}`);
    console.log(`counterexample (spin -t):\n${story.join('\n')}`);
    // The trail ends with a write applied on behalf of an attempt that is not the current one.
    expect(story.join('\n')).toMatch(/write applied for attempt (\d+) of agent \d+ \(attempt (?!\1\b)\d+ of agent/);
  });
});
