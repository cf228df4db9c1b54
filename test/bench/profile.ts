/**
 * CPU profiles of the benchmark's processes (`npm run bench -- --profile DIR`): the benchmark
 * process (for Leasehold, the coordinator) through the inspector, the worker processes with
 * `--cpu-prof`. `summarize` reads a `.cpuprofile` and tells where the busy time went: by area
 * (a package of node_modules, a directory of this project, Node's internals, the garbage
 * collector) and by function, self time only.
 */
import { readFile, writeFile } from 'node:fs/promises';
import { Session } from 'node:inspector/promises';
import path from 'node:path';

interface ProfileNode {
  id: number;
  callFrame: { functionName: string; url: string; lineNumber: number };
  children?: number[];
}

interface CpuProfile {
  nodes: ProfileNode[];
  startTime: number;
  endTime: number;
  samples: number[];
  timeDeltas: number[];
}

/** Profiles this process until the returned function is called, which writes `file`. */
export async function profileSelf(file: string): Promise<() => Promise<void>> {
  const session = new Session();
  session.connect();
  await session.post('Profiler.enable');
  await session.post('Profiler.setSamplingInterval', { interval: 500 });
  await session.post('Profiler.start');
  return async () => {
    const { profile } = await session.post('Profiler.stop');
    session.disconnect();
    await writeFile(file, JSON.stringify(profile));
  };
}

/** Where a frame's code lives: a package, a directory of this project, or Node itself. */
function areaOf(url: string, name: string): string {
  if (!url) return name.startsWith('(') ? name : '(native)';
  if (url.startsWith('node:')) return `node:${url.slice(5).split('/')[0]}`;
  // The benchmark's worker, compiled with the agent SDK inside (run.ts, compiledWorker).
  if (url.includes('/.cache/leasehold-bench/')) return 'agent SDK and worker.ts (compiled)';
  const nm = url.lastIndexOf('node_modules/');
  if (nm >= 0) {
    const rest = url.slice(nm + 'node_modules/'.length).split('/');
    return rest[0]!.startsWith('@') ? `${rest[0]}/${rest[1]}` : rest[0]!;
  }
  const m = /\/(server|agent-client|gen|test)\/(.*)$/.exec(url);
  return m ? `${m[1]}/${path.dirname(m[2]!)}` : url;
}

/** Self time by area and by function, in ms and share of busy (non-idle) time. */
export async function summarize(file: string, top = 15): Promise<string> {
  const p = JSON.parse(await readFile(file, 'utf8')) as CpuProfile;
  const byId = new Map(p.nodes.map((n) => [n.id, n]));
  const self = new Map<number, number>();
  for (let i = 0; i < p.samples.length; i++) self.set(p.samples[i]!, (self.get(p.samples[i]!) ?? 0) + (p.timeDeltas[i] ?? 0) / 1000);
  const areas = new Map<string, number>();
  const fns = new Map<string, number>();
  let busy = 0;
  for (const [id, ms] of self) {
    const n = byId.get(id)!;
    const { functionName, url, lineNumber } = n.callFrame;
    if (functionName === '(idle)') continue;
    busy += ms;
    const area = areaOf(url, functionName);
    areas.set(area, (areas.get(area) ?? 0) + ms);
    const fn = `${functionName || '(anonymous)'} ${url ? `${url.replace(/^.*node_modules\//, '').replace(/^file:\/\/.*?\/(server|agent-client|gen|test)\//, '$1/')}:${lineNumber + 1}` : ''}`;
    fns.set(fn, (fns.get(fn) ?? 0) + ms);
  }
  const rows = (m: Map<string, number>) =>
    [...m]
      .sort((a, b) => b[1] - a[1])
      .slice(0, top)
      .map(([k, ms]) => `  ${ms.toFixed(0).padStart(7)} ms ${((ms / busy) * 100).toFixed(1).padStart(5)} %  ${k}`);
  const wall = (p.endTime - p.startTime) / 1000;
  return [
    `${busy.toFixed(0)} ms busy of ${wall.toFixed(0)} ms profiled`,
    ' by area (self time):',
    ...rows(areas),
    ' by function (self time):',
    ...rows(fns),
  ].join('\n');
}

const isMain = process.argv[1] && path.resolve(process.argv[1]) === path.resolve(new URL(import.meta.url).pathname);
if (isMain) {
  for (const f of process.argv.slice(2)) process.stdout.write(`${await summarize(f, 25)}\n\n`);
}
