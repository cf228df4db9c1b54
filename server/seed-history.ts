/**
 * `leasehold seed-history` (`npm run seed:history -- --jobs N`): fills a database with N finished
 * jobs and the rows their real transitions would have written (`store/history.ts`), spread over
 * the last `--days`, for measuring operators' reads against a long history (docs/history.md).
 * The database is the one every command that works on it uses (`DATABASE_URL`, else the
 * embedded PostgreSQL under `--data-dir`), or `--database-url`; it is migrated first.
 */
import { randomBytes } from 'node:crypto';
import type { Command } from 'commander';
import type { ConfigFlags } from './config.js';
import { createLogger } from './log.js';
import type { HistoryChunkCounts, HistoryOutcome, HistoryShares } from './store/history.js';
import type { Queryable } from './store/sql.js';

/** Raised for bad command-line input: printed as one line, exit code 2, before any database work. */
export class SeedUsageError extends Error {
  override readonly name = 'SeedUsageError';
}

/** What to seed. Shares are fractions of all jobs (of canceled / retried-and-dead jobs for the two noted). */
export interface SeedOptions extends HistoryShares {
  jobs: number;
  /** Jobs finish uniformly over the last `days` days, ending now. */
  days: number;
  /** Jobs per transaction. */
  chunk: number;
  /** Queues and their weights (any positive numbers; normalised). */
  queues: Array<{ name: string; weight: number }>;
  /** Outcomes and their weights. */
  outcomes: Record<HistoryOutcome, number>;
  /** Size of the agent pool (`seed-agent-01`, …); the first quarter carry the labels. */
  agents: number;
  maxAttempts: number;
  /** The lease settings the history was made under (the coordinator's: LEASEHOLD_CLAIM_TTL, …). */
  claimTtlMs: number;
  leaseTtlMs: number;
  heartbeatIntervalMs: number;
}

/** The default mix: one big queue and a long tail; 90 % succeeded at once. */
export const DEFAULT_SEED: Omit<SeedOptions, 'jobs'> = {
  days: 7,
  chunk: 500_000,
  queues: [
    { name: 'default', weight: 50 },
    { name: 'emails', weight: 20 },
    { name: 'reports', weight: 12 },
    { name: 'images', weight: 9 },
    { name: 'exports', weight: 6 },
    { name: 'webhooks', weight: 3 },
  ],
  outcomes: { succeeded: 90, retried: 2, failed: 4, dead: 2, canceled: 2 },
  keyShare: 0.3,
  labelShare: 0.1,
  notifyShare: 0.05,
  stepShare: 0.05,
  canceledQueuedShare: 0.5,
  leaseLostShare: 0.2,
  agents: 20,
  maxAttempts: 5,
  claimTtlMs: 30_000,
  leaseTtlMs: 30_000,
  heartbeatIntervalMs: 10_000,
};

/** The labels a labeled seeded job requires (and the first quarter of the agents carry). */
export const SEED_LABELS = { os: 'windows' };

/** Progress after each chunk. */
export interface SeedProgress {
  done: number;
  total: number;
  chunk: number;
  chunks: number;
  elapsedMs: number;
  rows: HistoryChunkCounts;
}

/** What a seeding wrote and how long it took. */
export interface SeedResult {
  rows: HistoryChunkCounts;
  agentsCreated: number;
  end: Date;
  insertMs: number;
  analyzeMs: number;
  totalMs: number;
}

/** The pool's agent ids. */
export const seedAgentIds = (n: number) => Array.from({ length: n }, (_, i) => `seed-agent-${String(i + 1).padStart(2, '0')}`);

/**
 * Seeds `o.jobs` finished jobs in chunks of `o.chunk`, then runs VACUUM (ANALYZE) on the tables
 * it filled (with `vacuum: false`, ANALYZE only). `onProgress` hears of each chunk.
 */
export async function seedHistory(
  db: Queryable,
  o: SeedOptions,
  p: { vacuum?: boolean; onProgress?: (s: SeedProgress) => void; onAnalyze?: () => void } = {},
): Promise<SeedResult> {
  const { historyAgentsInsert, historyAnalyze, historyChunkInsert, historyNow, HISTORY_OUTCOMES } = await import('./store/history.js');
  const t0 = performance.now();
  const end = await historyNow(db);
  const spanMs = o.days * 86_400_000;
  const agents = seedAgentIds(o.agents);
  const agentsCreated = await historyAgentsInsert(db, { agents, since: new Date(end.getTime() - spanMs - 86_400_000), seen: end });
  const queueSum = o.queues.reduce((s, q) => s + q.weight, 0);
  const outcomeSum = HISTORY_OUTCOMES.reduce((s, k) => s + o.outcomes[k], 0);
  const rows: HistoryChunkCounts = { jobs: 0, attempts: 0, jobEvents: 0, steps: 0, webhookEvents: 0, webhookDeliveries: 0 };
  // The partitions of the days the jobs finished on (server/store/days.ts).
  const days: string[] = [];
  for (let t = Date.parse(new Date(end.getTime() - spanMs).toISOString().slice(0, 10)); t <= end.getTime(); t += 86_400_000) days.push(new Date(t).toISOString().slice(0, 10));
  const { daysEnsure } = await import('./store/days.js');
  const { default: pg } = await import('pg');
  if (db instanceof pg.Pool || 'release' in db) await daysEnsure(db as import('pg').Pool, days);
  const chunks = Math.ceil(o.jobs / o.chunk);
  const runId = randomBytes(4).toString('hex');
  for (let c = 0; c < chunks; c++) {
    const first = c * o.chunk + 1;
    const counts = await historyChunkInsert(db, {
      first,
      count: Math.min(o.chunk, o.jobs - first + 1),
      total: o.jobs,
      end,
      spanMs,
      queues: o.queues.map((q) => ({ name: q.name, share: q.weight / queueSum })),
      outcomes: HISTORY_OUTCOMES.map((k) => ({ outcome: k, share: o.outcomes[k] / outcomeSum })),
      keyShare: o.keyShare,
      labelShare: o.labelShare,
      notifyShare: o.notifyShare,
      stepShare: o.stepShare,
      canceledQueuedShare: o.canceledQueuedShare,
      leaseLostShare: o.leaseLostShare,
      agents,
      labeledAgents: Math.max(1, Math.floor(o.agents / 4)),
      labels: SEED_LABELS,
      maxAttempts: o.maxAttempts,
      claimTtlMs: o.claimTtlMs,
      leaseTtlMs: o.leaseTtlMs,
      heartbeatIntervalMs: o.heartbeatIntervalMs,
      runId,
    });
    for (const k of Object.keys(rows) as Array<keyof HistoryChunkCounts>) rows[k] += counts[k];
    p.onProgress?.({ done: rows.jobs, total: o.jobs, chunk: c + 1, chunks, elapsedMs: performance.now() - t0, rows: { ...rows } });
  }
  const t1 = performance.now();
  p.onAnalyze?.();
  await historyAnalyze(db, { vacuum: p.vacuum ?? true });
  const t2 = performance.now();
  return { rows, agentsCreated, end, insertMs: t1 - t0, analyzeMs: t2 - t1, totalMs: t2 - t0 };
}

// ───────────────────────────── the command line ─────────────────────────────

function wholeNumber(flag: string, raw: string, min: number, max: number): number {
  const n = /^\s*\d[\d_,]*\s*$/.test(raw) ? Number(raw.replace(/[_,\s]/g, '')) : NaN;
  if (!Number.isSafeInteger(n) || n < min || n > max) {
    throw new SeedUsageError(`${flag} must be a whole number from ${min.toLocaleString('en')} to ${max.toLocaleString('en')}, not ${JSON.stringify(raw)}`);
  }
  return n;
}

function decimal(flag: string, raw: string, min: number, max: number, what = 'a number'): number {
  const n = /^\s*\d*\.?\d+\s*$/.test(raw) ? Number(raw) : NaN;
  if (!Number.isFinite(n) || n < min || n > max) throw new SeedUsageError(`${flag} must be ${what} from ${min} to ${max}, not ${JSON.stringify(raw)}`);
  return n;
}

const share = (flag: string, raw: string) => decimal(flag, raw, 0, 1, 'a fraction');

/** `name=weight,…` (weights any non-negative numbers, at least one positive). */
function weights(flag: string, raw: string, names?: readonly string[]): Array<{ name: string; weight: number }> {
  const out: Array<{ name: string; weight: number }> = [];
  for (const part of raw.split(',').map((s) => s.trim()).filter(Boolean)) {
    const m = /^([^=\s]+)\s*=\s*(\d*\.?\d+)$/.exec(part);
    if (!m) throw new SeedUsageError(`${flag}: ${JSON.stringify(part)} is not name=weight (e.g. ${names ? 'succeeded=90' : 'default=50'})`);
    const name = m[1]!;
    if (names && !names.includes(name)) throw new SeedUsageError(`${flag}: ${JSON.stringify(name)} is not one of ${names.join(', ')}`);
    if (!names && !/^[A-Za-z0-9][A-Za-z0-9_.:-]*$/.test(name)) {
      throw new SeedUsageError(`${flag}: ${JSON.stringify(name)} is not a queue name (letters, digits and _ . : -)`);
    }
    if (out.some((o) => o.name === name)) throw new SeedUsageError(`${flag}: ${name} is named twice`);
    out.push({ name, weight: Number(m[2]) });
  }
  if (!out.some((o) => o.weight > 0)) throw new SeedUsageError(`${flag} must give at least one positive weight, not ${JSON.stringify(raw)}`);
  return out;
}

/** Flags of `seed-history`, as commander hands them over (strings, unparsed). */
export interface SeedFlags extends ConfigFlags {
  jobs?: string;
  days?: string;
  chunk?: string;
  databaseUrl?: string;
  queues?: string;
  outcomes?: string;
  keyShare?: string;
  labelShare?: string;
  notifyShare?: string;
  stepShare?: string;
  agents?: string;
  maxAttempts?: string;
  vacuum?: boolean;
}

/** Turns the flags into options; throws `SeedUsageError` naming the first bad one. */
export function seedOptions(f: SeedFlags, base: Pick<SeedOptions, 'claimTtlMs' | 'leaseTtlMs' | 'heartbeatIntervalMs'>): SeedOptions {
  if (f.jobs === undefined) throw new SeedUsageError('--jobs <n> is required: how many finished jobs to write (e.g. --jobs 1000000)');
  const d = DEFAULT_SEED;
  const outcomes = f.outcomes === undefined ? undefined : weights('--outcomes', f.outcomes, ['succeeded', 'retried', 'failed', 'dead', 'canceled']);
  return {
    ...d,
    ...base,
    jobs: wholeNumber('--jobs', f.jobs, 1, 1_000_000_000),
    days: f.days === undefined ? d.days : decimal('--days', f.days, 0.001, 3650),
    chunk: f.chunk === undefined ? d.chunk : wholeNumber('--chunk', f.chunk, 1, 5_000_000),
    queues: f.queues === undefined ? d.queues : weights('--queues', f.queues),
    outcomes: outcomes
      ? { succeeded: 0, retried: 0, failed: 0, dead: 0, canceled: 0, ...Object.fromEntries(outcomes.map((o) => [o.name, o.weight])) }
      : d.outcomes,
    keyShare: f.keyShare === undefined ? d.keyShare : share('--key-share', f.keyShare),
    labelShare: f.labelShare === undefined ? d.labelShare : share('--label-share', f.labelShare),
    notifyShare: f.notifyShare === undefined ? d.notifyShare : share('--notify-share', f.notifyShare),
    stepShare: f.stepShare === undefined ? d.stepShare : share('--step-share', f.stepShare),
    agents: f.agents === undefined ? d.agents : wholeNumber('--agents', f.agents, 1, 10_000),
    maxAttempts: f.maxAttempts === undefined ? d.maxAttempts : wholeNumber('--max-attempts', f.maxAttempts, 1, 1000),
  };
}

const fmt = (n: number) => Math.round(n).toLocaleString('en');
const secs = (ms: number) => `${(ms / 1000).toFixed(1)} s`;

/** Registers `seed-history` on the `leasehold` program. */
export function registerSeedCommand(program: Command, deps: { withDbFlags: (c: Command) => Command }) {
  const d = DEFAULT_SEED;
  const q = d.queues.map((x) => `${x.name}=${x.weight}`).join(',');
  const oc = Object.entries(d.outcomes).map(([k, v]) => `${k}=${v}`).join(',');
  deps
    .withDbFlags(
      program
        .command('seed-history')
        .description('fill the database with finished jobs and their history, for measuring reads as history grows (docs/history.md)')
        .option('--jobs <n>', 'finished jobs to write (required)')
        .option('--days <d>', `they finished over the last d days, ending now (default ${d.days})`)
        .option('--chunk <n>', `jobs per transaction (default ${d.chunk})`)
        .option('--database-url <url>', 'the database (default DATABASE_URL, else the embedded PostgreSQL under --data-dir)')
        .option('--queues <name=weight,…>', `queues and their weights (default ${q})`)
        .option('--outcomes <outcome=weight,…>', `succeeded, retried (succeeded after 1-2 retries), failed, dead, canceled (default ${oc})`)
        .option('--key-share <f>', `fraction of jobs with an idempotency key (default ${d.keyShare})`)
        .option('--label-share <f>', `fraction of jobs requiring the label os=windows (default ${d.labelShare})`)
        .option('--notify-share <f>', `fraction of jobs with a notify_url, its notification delivered (default ${d.notifyShare})`)
        .option('--step-share <f>', `fraction of jobs whose agent recorded steps (default ${d.stepShare})`)
        .option('--agents <n>', `agents that ran them, seed-agent-01… (default ${d.agents})`)
        .option('--max-attempts <n>', `each job's max_attempts: a dead letter made that many (default ${d.maxAttempts})`)
        .option('--no-vacuum', 'end with ANALYZE only, not VACUUM (ANALYZE): leaves the visibility maps, hint bits and BRIN summaries to autovacuum'),
    )
    .action(async (flags: SeedFlags) => {
      const out = (s: string) => void process.stdout.write(`${s}\n`);
      let options: SeedOptions;
      let config: Awaited<ReturnType<typeof import('./config.js').loadConfig>>;
      try {
        const { loadConfig } = await import('./config.js');
        if (flags.databaseUrl !== undefined && !/^postgres(ql)?:\/\//.test(flags.databaseUrl)) {
          throw new SeedUsageError('--database-url must start with postgres:// or postgresql://');
        }
        config = loadConfig(flags, flags.databaseUrl ? { ...process.env, DATABASE_URL: flags.databaseUrl } : process.env);
        options = seedOptions(flags, config);
      } catch (err) {
        if (!(err instanceof SeedUsageError) && (err as Error).name !== 'ConfigError') throw err;
        process.stderr.write(`error: ${(err as Error).message}\n`);
        process.exitCode = 2;
        return;
      }
      const { openDatabase, migrateDatabase, redact } = await import('./store/index.js');
      // Logs (the embedded server starting and stopping) go to stderr: stdout is the progress.
      const log = createLogger(process.env, { stderr: true });
      const db = await openDatabase({ databaseUrl: config.databaseUrl, dataDir: config.dataDir, log, max: 2, hotMax: 1 });
      try {
        const applied = await migrateDatabase(db.pool);
        out(
          `seeding ${fmt(options.jobs)} finished jobs over ${options.days} day(s) into ${redact(db.url)}` +
            `${db.embedded ? ' (embedded PostgreSQL)' : ''}${applied ? `, after ${applied} migration(s)` : ''}; ${fmt(options.chunk)} per transaction`,
        );
        const r = await seedHistory(db.pool, options, {
          vacuum: flags.vacuum !== false,
          onProgress: (s) =>
            out(
              `  ${fmt(s.done)} / ${fmt(s.total)} jobs (${((100 * s.done) / s.total).toFixed(0)} %), ${fmt(s.rows.attempts)} attempts, ` +
                `${secs(s.elapsedMs)}, ${fmt((s.done / s.elapsedMs) * 1000)} jobs/s`,
            ),
          onAnalyze: () => out(`  ${flags.vacuum !== false ? 'VACUUM (ANALYZE)' : 'ANALYZE'} of the filled tables…`),
        });
        out(
          `done in ${secs(r.totalMs)} (inserts ${secs(r.insertMs)}: ${fmt((r.rows.jobs / r.insertMs) * 1000)} jobs/s; ` +
            `${flags.vacuum !== false ? 'VACUUM (ANALYZE)' : 'ANALYZE'} ${secs(r.analyzeMs)}): ${fmt(r.rows.jobs)} jobs, ${fmt(r.rows.attempts)} attempts, ` +
            `${fmt(r.rows.jobEvents)} job_events, ${fmt(r.rows.steps)} steps, ${fmt(r.rows.webhookEvents)} webhook_events, ` +
            `${fmt(r.rows.webhookDeliveries)} webhook_deliveries, ${r.agentsCreated} new agents; history ends at ${r.end.toISOString()}`,
        );
      } finally {
        await db.close();
      }
    });
}
