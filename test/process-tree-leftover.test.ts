/**
 * `killLeftover` on Linux, with real processes: the cleanup, at an agent's start, of what a
 * command left running when the agent before it was killed outright. The command (here `sh`)
 * runs as the leader of its own group and session, as the runner spawns it; it starts a
 * `sleep` in the background and exits, so only its group's id and the recorded start time tell
 * the `sleep` is its. Records that cannot be the command (another boot, this process, a pid now
 * another process's, a group older than the command) stop nothing.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { createInterface } from 'node:readline';
import { afterEach, describe, expect, it } from 'vitest';
import { describeProcess, killLeftover, type PidRecord } from '../agent-client/src/runner/process-tree.js';

/** Whether the pid runs (a zombie, killed but not reaped, does not). */
function running(pid: number): boolean {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat[stat.lastIndexOf(')') + 2] !== 'Z';
  } catch {
    return false;
  }
}

async function waitFor(what: string, ok: () => boolean, ms = 5000): Promise<void> {
  const until = Date.now() + ms;
  while (!ok()) {
    if (Date.now() > until) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

/** Every pid a test started, killed after it if still running, and the children it spawned, awaited till closed. */
const started: number[] = [];
const spawned: Promise<void>[] = [];
afterEach(async () => {
  for (const pid of started.splice(0)) {
    if (!running(pid)) continue;
    try {
      process.kill(pid, 'SIGKILL');
    } catch {
      // gone meanwhile
    }
  }
  await Promise.all(spawned.splice(0));
});

/** `child` closed (exited, its pipes closed), also awaited after the test. */
function closedOf(child: ChildProcess): Promise<void> {
  const closed = new Promise<void>((resolve) => child.once('close', () => resolve()));
  spawned.push(closed);
  return closed;
}

/**
 * A command as the runner spawns it (`detached`: its own group and session) that starts
 * `sleep 300` in the background, prints the sleep's pid, and exits once its stdin closes.
 */
async function commandWithBackgroundSleep() {
  const sh = spawn('sh', ['-c', 'sleep 300 </dev/null >/dev/null 2>&1 & echo $!; read x'], { detached: true, stdio: ['pipe', 'pipe', 'ignore'] });
  const closed = closedOf(sh);
  sh.stdin.on('error', () => undefined); // ended after the command was killed
  const lines = createInterface({ input: sh.stdout });
  const sleep = Number(await new Promise<string>((resolve) => lines.once('line', resolve)));
  lines.close();
  started.push(sh.pid!, sleep);
  expect(running(sleep)).toBe(true);
  return {
    pid: sh.pid!,
    sleep,
    /** The command exits (and is reaped: its pid runs nothing); its background sleep runs on. */
    exit: async () => {
      sh.stdin.end();
      await closed;
      expect(running(sh.pid!)).toBe(false);
    },
  };
}

describe('killLeftover on Linux', () => {
  it('stops what a command left running in its group after the command itself exited', async () => {
    const cmd = await commandWithBackgroundSleep();
    const rec = await describeProcess(cmd.pid, { file: 'sh' }, 'linux');
    expect(rec).toMatchObject({ pid: cmd.pid, platform: 'linux', startTicks: expect.stringMatching(/^\d+$/) });
    await cmd.exit();
    expect(running(cmd.sleep)).toBe(true);

    expect(await killLeftover(JSON.parse(JSON.stringify(rec)) as PidRecord)).toBe(true);
    await waitFor('the background sleep to be killed', () => !running(cmd.sleep));
  });

  it('still stops a whole group whose command runs', async () => {
    const cmd = await commandWithBackgroundSleep();
    const rec = await describeProcess(cmd.pid, { file: 'sh' }, 'linux');
    expect(await killLeftover(rec)).toBe(true);
    await waitFor('the command and its sleep to be killed', () => !running(cmd.pid) && !running(cmd.sleep));
    await cmd.exit();
  });

  it('stops nothing for a record that cannot be the command', async () => {
    const cmd = await commandWithBackgroundSleep();
    const rec = await describeProcess(cmd.pid, { file: 'sh' }, 'linux');
    expect(rec.bootId).toBe(readFileSync('/proc/sys/kernel/random/boot_id', 'utf8').trim());
    await cmd.exit();
    // Written in another boot (start ticks count from the boot), or by an agent that recorded no boot.
    expect(await killLeftover({ ...rec, bootId: 'another-boot' })).toBe(false);
    const { bootId: _bootId, ...noBoot } = rec;
    expect(await killLeftover(noBoot)).toBe(false);
    // A group whose members started before the recorded command: not its group.
    expect(await killLeftover({ ...rec, startTicks: String(BigInt(rec.startTicks!) + 100_000n) })).toBe(false);
    expect(running(cmd.sleep)).toBe(true);

    // The pid now another process's (its own group leader, started after the record): left alone.
    const other = spawn('sleep', ['300'], { detached: true, stdio: 'ignore' });
    const otherExited = closedOf(other);
    started.push(other.pid!);
    expect(await killLeftover({ pid: other.pid!, platform: 'linux', startTicks: '1', bootId: rec.bootId! })).toBe(false);
    expect(running(other.pid!)).toBe(true);
    other.kill('SIGKILL');
    await otherExited;
  });

  it('never takes this very process for a leftover (an agent given the pid of a command that died)', async () => {
    const self = await describeProcess(process.pid, { file: 'node' }, 'linux');
    expect(await killLeftover(self)).toBe(false);
    expect(await killLeftover({ ...self, platform: 'win32', image: 'node.exe' })).toBe(false);
  });
});
