/**
 * The benchmark report: a markdown table (median, min–max over the repetitions) and an SVG of
 * the dispatch latency distributions (percentile against latency, log scale).
 */
/** The names `results.json` uses (scripts read these, not the markdown). */
export type ScenarioKey = 'throughput' | 'latency' | 'writes' | 'recovery' | 'heartbeats' | 'history' | 'ceiling';
export type SystemKey = 'leasehold' | 'graphile-on' | 'graphile-off' | 'pg-boss' | 'postgresql' | 'floor';
export type MetricKey =
  | 'jobs_per_s'
  | 'cpu_ms_per_job'
  | 'p50_ms'
  | 'p95_ms'
  | 'p99_ms'
  | 'rows_per_job'
  | 'wal_bytes_per_job'
  | 'lease_multiple'
  | 'commits_per_s'
  | 'tps'
  | 'read_ms'
  | 'read_ms_ratio'
  | 'read_ms_ratio_after_purge'
  | 'jobs_per_s_ratio'
  | 'wal_bytes_per_job_ratio'
  | 'purge_gone_ms'
  | 'purge_ms'
  | 'purge_jobs_per_s_ratio'
  | 'deep_jobs_per_s_ratio'
  | 'deep_agent_cpu_ratio';

export interface Figure {
  /** Set for the figures that go to `results.json`. */
  metric?: MetricKey;
  median: number;
  min: number;
  max: number;
  digits: number;
  n: number;
  unit: string;
}

export interface Row {
  scenarioKey: ScenarioKey;
  systemKey: SystemKey;
  /** The history scenario's rows of one read each: its name (in `results.json` as `read`). */
  read?: string;
  scenario: string;
  system: string;
  figures: Figure[];
  note?: string | undefined;
}

export interface RunInfo {
  date: string;
  machine: string;
  node: string;
  postgres: string;
  commit: string;
  reps: number;
}

const f = (x: number, d: number) => x.toLocaleString('en-US', { minimumFractionDigits: d, maximumFractionDigits: d });

/** Markdown: one table per scenario. */
export function markdown(rows: Row[], info: RunInfo): string {
  const out = [
    '# Benchmark results',
    '',
    `Run ${info.date} on ${info.machine}; Node ${info.node}; ${info.postgres}; commit ${info.commit}.`,
    `Every system on the same server, one run. Figures: median of ${info.reps} repetition(s), [min – max].`,
    '',
  ];
  const scenarios = [...new Set(rows.map((r) => r.scenario))];
  for (const sc of scenarios) {
    const rs = rows.filter((r) => r.scenario === sc);
    const units = [...new Set(rs.flatMap((r) => r.figures.map((x) => x.unit)))];
    out.push(`## ${sc}`, '', `| system | ${units.join(' | ')} | note |`, `|---|${units.map(() => '---:').join('|')}|---|`);
    for (const r of rs) {
      const cells = units.map((u) => {
        const x = r.figures.find((y) => y.unit === u);
        return x ? `${f(x.median, x.digits)} [${f(x.min, x.digits)} – ${f(x.max, x.digits)}]` : '–';
      });
      out.push(`| ${r.system} | ${cells.join(' | ')} | ${r.note ?? ''} |`);
    }
    out.push('');
  }
  return out.join('\n');
}

/** One line of `results.json`. */
export interface Result {
  scenario: ScenarioKey;
  system: SystemKey;
  /** Set on the history scenario's rows of one read each. */
  read?: string;
  metric: MetricKey;
  median: number;
  min: number;
  max: number;
  commit: string;
}

/** The figures that carry a metric name, flat, for `results.json`. */
export function results(rows: Row[], commit: string): Result[] {
  return rows.flatMap((r) =>
    r.figures.flatMap((x) =>
      x.metric
        ? [{ scenario: r.scenarioKey, system: r.systemKey, ...(r.read ? { read: r.read } : {}), metric: x.metric, median: x.median, min: x.min, max: x.max, commit }]
        : [],
    ),
  );
}

const COLORS = ['#1b7837', '#2166ac', '#b2182b', '#e08214', '#762a83'];

/** An SVG line chart: for each system, the share of jobs (y) started within x ms (log scale). */
export function latencySvg(latencies: Map<string, number[]>): string {
  const W = 720;
  const H = 420;
  const m = { l: 60, r: 20, t: 30, b: 50 };
  const all = [...latencies.values()].flat();
  const lo = Math.max(0.1, Math.min(...all, 1));
  const hi = Math.max(...all, 10);
  const x = (v: number) => m.l + ((Math.log10(Math.max(v, lo)) - Math.log10(lo)) / (Math.log10(hi) - Math.log10(lo))) * (W - m.l - m.r);
  const y = (p: number) => H - m.b - p * (H - m.t - m.b);
  const parts: string[] = [
    `<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" font-family="sans-serif" font-size="12">`,
    `<rect width="${W}" height="${H}" fill="white"/>`,
    `<text x="${W / 2}" y="18" text-anchor="middle" font-size="14">Dispatch latency: share of jobs started within x ms (enqueue → handler start)</text>`,
    `<line x1="${m.l}" y1="${H - m.b}" x2="${W - m.r}" y2="${H - m.b}" stroke="black"/>`,
    `<line x1="${m.l}" y1="${m.t}" x2="${m.l}" y2="${H - m.b}" stroke="black"/>`,
  ];
  for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) {
    const v = 10 ** e;
    if (v < lo || v > hi) continue;
    parts.push(`<line x1="${x(v)}" y1="${m.t}" x2="${x(v)}" y2="${H - m.b}" stroke="#ddd"/><text x="${x(v)}" y="${H - m.b + 16}" text-anchor="middle">${v} ms</text>`);
  }
  for (const p of [0, 0.5, 0.95, 0.99, 1]) {
    parts.push(`<line x1="${m.l}" y1="${y(p)}" x2="${W - m.r}" y2="${y(p)}" stroke="#eee"/><text x="${m.l - 6}" y="${y(p) + 4}" text-anchor="end">${p * 100}%</text>`);
  }
  let i = 0;
  for (const [name, ls] of latencies) {
    const s = [...ls].sort((a, b) => a - b);
    const pts = s.map((v, k) => `${x(v).toFixed(1)},${y((k + 1) / s.length).toFixed(1)}`).join(' ');
    const c = COLORS[i % COLORS.length];
    parts.push(`<polyline fill="none" stroke="${c}" stroke-width="2" points="${pts}"/>`);
    parts.push(`<rect x="${m.l + 12}" y="${m.t + 8 + i * 18}" width="12" height="12" fill="${c}"/><text x="${m.l + 30}" y="${m.t + 18 + i * 18}">${name} (${s.length} jobs)</text>`);
    i++;
  }
  parts.push(`<text x="${W / 2}" y="${H - 10}" text-anchor="middle">latency (ms, log scale)</text></svg>`);
  return parts.join('\n');
}
