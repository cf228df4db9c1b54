/**
 * `node --import tsx test/bench/cold.ts [--rounds 3000] [--gap 5]`: what the same few lines of
 * JavaScript cost on this machine when they run back to back, and when they run once every few
 * milliseconds, as a job's code does when jobs come one at a time (200 jobs/s: one every 5 ms).
 *
 * Three small operations, timed one by one with `performance.now()`: the sum of a 1,000-number
 * array, `new Date().toISOString()`, and an object spread of five fields and two more (what the
 * SDK's `run` does once a job). Three ways of running them, `--rounds` times each after a
 * discarded third as warm-up, medians printed in nanoseconds:
 * - `loop`: back to back;
 * - `sleep`: once every `--gap` ms (`setTimeout`), the process idle in between;
 * - `busy`: once every `--gap` ms, the process computing in between (an arithmetic loop that
 *   touches no memory), so the gap is not idle.
 * For `sleep` it also prints the process's CPU time per round (`process.cpuUsage()`): the three
 * operations and the timer's wake-up.
 */
import { setTimeout as sleep } from 'node:timers/promises';
import { Command } from 'commander';

const program = new Command()
  .option('--rounds <n>', 'rounds measured per way', (v) => Number(v), 3000)
  .option('--gap <ms>', 'milliseconds between rounds in sleep and busy', (v) => Number(v), 5)
  .parse();
const opts = program.opts<{ rounds: number; gap: number }>();
if (!Number.isInteger(opts.rounds) || opts.rounds < 10) program.error('--rounds: an integer, at least 10');
if (!(opts.gap > 0)) program.error('--gap: a number of milliseconds above 0');

const numbers = Array.from({ length: 1000 }, (_, i) => i);
const base = { attemptId: 'a', jobId: 'b', queue: 'q', attemptNo: 1, writtenAt: '' };
let kept: unknown;

const ops = {
  sum: () => {
    let s = 0;
    for (let i = 0; i < numbers.length; i++) s += numbers[i]!;
    return s;
  },
  toISOString: () => new Date().toISOString(),
  spread: () => ({ ...base, kind: 'completed', result: kept }),
};
type Op = keyof typeof ops;

function round(into: Record<Op, number[]>): void {
  for (const name of Object.keys(ops) as Op[]) {
    const t0 = performance.now();
    kept = ops[name]();
    into[name].push((performance.now() - t0) * 1e6);
  }
}

/** Computes for `ms` without touching memory (the clock read once every 4,096 steps). */
function compute(ms: number): number {
  const until = performance.now() + ms;
  let x = 1;
  for (let i = 0; ; i++) {
    x = (x * 31 + i) | 0;
    if ((i & 4095) === 0 && performance.now() >= until) return x;
  }
}

async function measure(way: 'loop' | 'sleep' | 'busy'): Promise<void> {
  const warm = Math.ceil(opts.rounds / 3);
  const times: Record<Op, number[]> = { sum: [], toISOString: [], spread: [] };
  let cpu = { user: 0, system: 0 };
  for (let n = 0; n < warm + opts.rounds; n++) {
    if (n === warm) {
      for (const k of Object.keys(times) as Op[]) times[k] = [];
      cpu = process.cpuUsage();
    }
    if (way === 'sleep') await sleep(opts.gap);
    else if (way === 'busy') kept = compute(opts.gap);
    round(times);
  }
  const used = process.cpuUsage(cpu);
  const median = (v: number[]) => [...v].sort((a, b) => a - b)[Math.floor(v.length / 2)]!;
  const parts = (Object.keys(times) as Op[]).map((k) => `${k} ${Math.round(median(times[k]))} ns`);
  const perRound = way === 'sleep' ? `; the process's CPU ${((used.user + used.system) / opts.rounds).toFixed(1)} µs a round` : '';
  console.log(`${way.padEnd(5)} ${parts.join(', ')}${perRound}`);
}

for (const way of ['loop', 'sleep', 'busy', 'loop'] as const) await measure(way);
