/** Durations as operators write them (`LEASEHOLD_*` settings, CLI flags), without dependencies. */

const units: Record<string, number> = { ms: 1, s: 1000, m: 60_000, h: 3_600_000, d: 86_400_000 };

/** Parses `250ms`, `2s`, `1.5m`, `1h`, `7d` (or a bare number of milliseconds) into milliseconds. */
export function parseDuration(text: string): number | undefined {
  const m = /^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$/.exec(text);
  if (!m) return undefined;
  const ms = Number(m[1]) * units[m[2] ?? 'ms']!;
  return Number.isFinite(ms) ? Math.round(ms) : undefined;
}
