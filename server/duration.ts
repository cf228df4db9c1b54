/** Durations as operators write them (`LEASEHOLD_*` settings, CLI flags), without dependencies. */

const units: Record<string, number> = { ms: 1, s: 1000, m: 60_000, h: 3_600_000, d: 86_400_000 };

/** Parses `250ms`, `2s`, `1.5m`, `1h`, `7d` (or a bare number of milliseconds) into milliseconds. */
export function parseDuration(text: string): number | undefined {
  const m = /^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$/.exec(text);
  if (!m) return undefined;
  const ms = Number(m[1]) * units[m[2] ?? 'ms']!;
  return Number.isFinite(ms) ? Math.round(ms) : undefined;
}

/**
 * Writes `ms` as `parseDuration` reads it, in the largest unit that divides it (`1d`, `10m`,
 * `1500ms`), for messages that quote a bound.
 */
export function formatDuration(ms: number): string {
  for (const unit of ['d', 'h', 'm', 's'] as const) {
    if (ms !== 0 && ms % units[unit]! === 0) return `${ms / units[unit]!}${unit}`;
  }
  return `${ms}ms`;
}
