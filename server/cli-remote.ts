/**
 * The `leasehold` commands that talk to a running coordinator over its API (AdminService and
 * JobService, Connect JSON on the HTTP listener): `agents add|list|revoke|drain`,
 * `keys add|list|revoke`, `jobs ls|show|requeue|cancel|purge|stale`, `stats`. Where and as whom
 * come from `--url` / `LEASEHOLD_URL` (default http://127.0.0.1:8080, or the host:port of
 * `LEASEHOLD_HTTP_ADDR`) and `--key` / `LEASEHOLD_KEY` (falling back to `LEASEHOLD_ADMIN_KEY`).
 * Answers go to stdout (aligned tables, or the API's JSON with `--json`); errors go to stderr
 * as one line, with the exit codes of `EXIT` (1 refused, 2 bad input, 3 unreachable, 4 key).
 */
import { toJson, type DescMessage, type MessageShape } from '@bufbuild/protobuf';
import { durationFromMs, timestampDate, timestampFromDate, type Duration, type Timestamp } from '@bufbuild/protobuf/wkt';
import type { Command } from 'commander';
import {
  AdminServiceCancelJobResponseSchema,
  AdminServiceGetJobResponseSchema,
  AdminServiceListJobsResponseSchema,
  AgentInfoSchema,
  ApiKeySchema,
  CreateAgentResponseSchema,
  CreateKeyResponseSchema,
  DrainAgentResponseSchema,
  GetStatsResponseSchema,
  ListStaleReportsResponseSchema,
  PurgeJobsResponseSchema,
  RequeueJobResponseSchema,
  RevokeAgentResponseSchema,
  RevokeKeyResponseSchema,
  type AgentInfo,
} from '../gen/leasehold/v1/admin_service_pb.js';
import { AttemptStatus, JobStatus, Outcome } from '../gen/leasehold/v1/job_pb.js';
import { parseDuration } from './duration.js';
import { API_KEY_SCOPES } from './domain/statuses.js';
import { createApiClients, EXIT, explainFailure, type ApiClients, type ApiTarget } from './transport/admin-client.js';

export interface ApiFlags {
  url?: string;
  key?: string;
  json?: boolean;
}

/** Raised for bad command-line input before any call: printed, exit code 2. */
export class UsageError extends Error {}

/** The coordinator's address and key, from flags, then the environment. */
export function apiTarget(flags: ApiFlags, env: NodeJS.ProcessEnv = process.env): ApiTarget {
  const addr = env.LEASEHOLD_HTTP_ADDR?.replace(/^0\.0\.0\.0:/, '127.0.0.1:').replace(/^\[::\]:/, '127.0.0.1:');
  const url = flags.url ?? env.LEASEHOLD_URL ?? (addr ? `http://${addr}` : 'http://127.0.0.1:8080');
  if (!/^https?:\/\/[^\s/]+/.test(url)) throw new UsageError(`--url ${JSON.stringify(url)} must be an http:// or https:// URL of the coordinator's HTTP listener`);
  const key = flags.key ?? env.LEASEHOLD_KEY ?? env.LEASEHOLD_ADMIN_KEY;
  if (!key) {
    const e = new UsageError('no key: pass --key <key>, or set LEASEHOLD_KEY (or LEASEHOLD_ADMIN_KEY) to a key with the admin scope');
    (e as UsageError & { exitCode?: number }).exitCode = EXIT.unauthorized;
    throw e;
  }
  return { url: url.replace(/\/+$/, ''), key };
}

/** Adds `--url`, `--key` and `--json` to a command. */
export const remote = (c: Command, json = true) => {
  c.option('--url <url>', "the coordinator's HTTP listener (env LEASEHOLD_URL, default http://127.0.0.1:8080)").option(
    '--key <key>',
    'a key with the admin scope (env LEASEHOLD_KEY, else LEASEHOLD_ADMIN_KEY)',
  );
  return json ? c.option('--json', 'print the answer as JSON (the API\'s JSON mapping)') : c;
};

/** Runs a remote command: clients from the flags, failures printed as one line with their exit code. */
export function action<A extends unknown[]>(fn: (api: ApiClients, ...args: A) => Promise<void>) {
  return async (...args: A) => {
    // commander passes the declared arguments, then the options, then the command.
    const flags = args[args.length - 2] as ApiFlags;
    endQuietlyWhenStdoutCloses();
    let target: ApiTarget | undefined;
    try {
      target = apiTarget(flags);
      await fn(createApiClients(target), ...args);
    } catch (err) {
      if (err instanceof UsageError) {
        process.stderr.write(`error: ${err.message}\n`);
        process.exitCode = (err as UsageError & { exitCode?: number }).exitCode ?? EXIT.invalid;
        return;
      }
      const f = explainFailure(err, target!);
      process.stderr.write(`error: ${f.message}\n`);
      process.exitCode = f.exitCode;
    }
  };
}

let stdoutWatched = false;
/**
 * A reader that stops early (`leasehold jobs ls | head -1`) closes the pipe: the next write fails
 * with EPIPE, which would end the process with a stack trace and exit code 1. The command ends
 * there instead, quietly, with the exit code it had (0), as `ls | head` does; the answer was
 * read as far as the reader wanted.
 */
function endQuietlyWhenStdoutCloses(): void {
  if (stdoutWatched) return;
  stdoutWatched = true;
  process.stdout.on('error', (err: NodeJS.ErrnoException) => {
    if (err.code === 'EPIPE') process.exit();
    throw err;
  });
}

export const out = (s: string): void => void process.stdout.write(s.endsWith('\n') ? s : `${s}\n`);
// The API's JSON, as the HTTP gateway writes it (`toJson` with `alwaysEmitImplicit`): scalars,
// enums, lists and maps always present, zero values included; a message field left unset is
// absent (a timestamp not reached yet, such as `finishedAt`; `result` and `error` when there is none).
export const printJson = <D extends DescMessage>(schema: D, m: MessageShape<D>) => out(JSON.stringify(toJson(schema, m, { alwaysEmitImplicit: true })));
export const printJsonArray = <D extends DescMessage>(schema: D, ms: Array<MessageShape<D>>) =>
  out(JSON.stringify(ms.map((m) => toJson(schema, m, { alwaysEmitImplicit: true }))));

/** Prints rows as aligned columns (the first row is the header). */
export function table(rows: string[][]) {
  const widths = rows[0]!.map((_, i) => Math.max(...rows.map((r) => (r[i] ?? '').length)));
  for (const r of rows) out(r.map((c, i) => (i < r.length - 1 ? c.padEnd(widths[i]!) : c)).join('  ').trimEnd());
}

export const time = (t: Timestamp | undefined) => (t ? timestampDate(t).toISOString().replace(/\.\d{3}Z$/, 'Z') : '-');
function age(ms: number): string {
  const s = Math.round(ms / 1000);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, '0')}s`;
  if (s < 86_400) return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, '0')}m`;
  return `${Math.floor(s / 86_400)}d${String(Math.floor((s % 86_400) / 3600)).padStart(2, '0')}h`;
}
const durMs = (d: Duration | undefined) => (d ? Number(d.seconds) * 1000 + d.nanos / 1e6 : 0);
const status = (s: JobStatus) => (JobStatus[s] ?? String(s)).toLowerCase();
const attemptStatus = (s: AttemptStatus) => (AttemptStatus[s] ?? String(s)).toLowerCase();
export const list = (s: string) => s.split(',').map((x) => x.trim()).filter(Boolean);

/** `dead,failed` → JobStatus values; a bad name is a UsageError naming the good ones. */
function statuses(text: string | undefined): JobStatus[] {
  if (!text) return [];
  return list(text).map((name) => {
    const v = JobStatus[name.toUpperCase() as keyof typeof JobStatus];
    if (v === undefined || v === JobStatus.UNSPECIFIED) {
      throw new UsageError(`--status ${JSON.stringify(name)} is not a job status: use ${Object.keys(JobStatus).filter((k) => Number.isNaN(Number(k)) && k !== 'UNSPECIFIED').map((k) => k.toLowerCase()).join(', ')}`);
    }
    return v;
  });
}

/** An ISO time, or a duration ago (`2h`: two hours ago). */
function when(flag: string, text: string | undefined): Timestamp | undefined {
  if (!text) return undefined;
  const ms = parseDuration(text);
  if (ms !== undefined) return timestampFromDate(new Date(Date.now() - ms));
  const t = Date.parse(text);
  if (Number.isNaN(t)) throw new UsageError(`${flag} ${JSON.stringify(text)} is neither a time (2025-01-31T12:00:00Z) nor a duration ago (90m, 2h, 7d)`);
  return timestampFromDate(new Date(t));
}

function positiveInt(flag: string, text: string | undefined, max: number): number | undefined {
  if (text === undefined) return undefined;
  const n = Number(text);
  if (!Number.isInteger(n) || n < 1 || n > max) throw new UsageError(`${flag} must be a whole number from 1 to ${max}`);
  return n;
}

function agentState(a: AgentInfo): string {
  if (a.revokedAt) return 'revoked';
  if (!a.registered) return 'key';
  if (!a.sessions.length) return 'offline';
  return a.sessions.every((s) => s.drainingSince) ? 'draining' : 'online';
}

/** Registers the remote commands on `program`. */
export function registerRemoteCommands(program: Command): void {
  const agents = program.commands.find((c) => c.name() === 'agents') ?? program.command('agents');
  agents.description('agent identities (each connects with its own token), their streams and what they hold');

  remote(agents.command('add <name>').description('register an agent and print its token (shown once)'))
    .option('--quiet', 'print only the token')
    .action(
      action(async (api, name: string, f: ApiFlags & { quiet?: boolean }) => {
        const r = await api.admin.createAgent({ agentId: name });
        if (f.json) return printJson(CreateAgentResponseSchema, r);
        if (f.quiet) return out(r.token);
        out(`agent ${r.agentId} created; its token (shown once, keep it secret):\n${r.token}`);
      }),
    );

  remote(agents.command('list').description('list agents with their streams, slots and held (suspect) attempts'))
    .option('--all', 'include revoked agents that hold nothing')
    .action(
      action(async (api, f: ApiFlags & { all?: boolean }) => {
        const r = await api.admin.listAgents({ includeRevoked: Boolean(f.all) });
        if (f.json) return printJsonArray(AgentInfoSchema, r.agents);
        table([
          ['AGENT', 'STATE', 'STREAMS', 'SLOTS', 'HELD', 'SUSPECT', 'QUEUES', 'LAST SEEN'],
          ...r.agents.map((a) => [
            a.agentId,
            agentState(a),
            String(a.sessions.length),
            String(a.slots),
            String(a.attempts.length),
            String(a.suspect),
            [...new Set(a.sessions.flatMap((s) => s.queues))].join(',') || '-',
            time(a.lastSeenAt),
          ]),
        ]);
      }),
    );

  remote(agents.command('revoke <name>').description('revoke an agent: its token stops working and its streams end')).action(
    action(async (api, name: string, f: ApiFlags) => {
      const r = await api.admin.revokeAgent({ agentId: name });
      if (f.json) return printJson(RevokeAgentResponseSchema, r);
      out(`agent ${r.agentId} revoked`);
    }),
  );

  remote(agents.command('drain <name>').description('tell the agent to finish what it holds, take nothing new, and disconnect')).action(
    action(async (api, name: string, f: ApiFlags) => {
      const r = await api.admin.drainAgent({ agentId: name });
      if (f.json) return printJson(DrainAgentResponseSchema, r);
      out(r.sessions ? `agent ${name}: ${r.sessions} stream(s) told to drain` : `agent ${name} is not connected: nothing to drain`);
    }),
  );

  const keys = program.commands.find((c) => c.name() === 'keys') ?? program.command('keys');
  keys.description(`API keys for the HTTP gateway and gRPC callers; scopes: ${API_KEY_SCOPES.join(', ')}`);

  remote(keys.command('add <name>').description('create a key and print it (shown once)'))
    .requiredOption('--scope <scopes>', `comma-separated: ${API_KEY_SCOPES.join(', ')} (agent: the key acts as the agent <name>)`)
    .option('--quiet', 'print only the key')
    .action(
      action(async (api, name: string, f: ApiFlags & { scope: string; quiet?: boolean }) => {
        const r = await api.admin.createKey({ name, scopes: list(f.scope) });
        if (f.json) return printJson(CreateKeyResponseSchema, r);
        if (f.quiet) return out(r.key);
        out(`key ${r.name} created with scopes ${r.scopes.join(',')}; the key (shown once, keep it secret):\n${r.key}`);
      }),
    );

  remote(keys.command('list').description('list keys (never the keys themselves)')).action(
    action(async (api, f: ApiFlags) => {
      const r = await api.admin.listKeys({});
      if (f.json) return printJsonArray(ApiKeySchema, r.keys);
      table([
        ['KEY', 'SCOPES', 'STATE', 'CREATED', 'LAST USED'],
        ...r.keys.map((k) => [k.name, k.scopes.join(','), k.revokedAt ? 'revoked' : 'active', time(k.createdAt), time(k.lastUsedAt)]),
      ]);
    }),
  );

  remote(keys.command('revoke <name>').description('revoke a key: the next call with it is refused')).action(
    action(async (api, name: string, f: ApiFlags) => {
      const r = await api.admin.revokeKey({ name });
      if (f.json) return printJson(RevokeKeyResponseSchema, r);
      out(`key ${r.name} revoked`);
    }),
  );

  const jobs = program.command('jobs').description('find jobs, see their history, requeue dead letters, cancel, purge');

  remote(jobs.command('ls').description('list jobs, newest first'))
    .option('--status <statuses>', 'comma-separated: queued, claimed, running, succeeded, failed, dead, canceled')
    .option('--queue <queue>', 'only this queue')
    .option('--agent <agent>', 'only jobs this agent has held')
    .option('--since <time>', 'enqueued at or after: a time, or a duration ago (2h, 7d)')
    .option('--until <time>', 'enqueued before: a time, or a duration ago')
    .option('--limit <n>', 'at most this many (default 50, at most 500)')
    .option('--page-token <token>', 'the next page (printed after a full page)')
    .action(
      action(async (api, f: ApiFlags & { status?: string; queue?: string; agent?: string; since?: string; until?: string; limit?: string; pageToken?: string }) => {
        const r = await api.admin.listJobs({
          statuses: statuses(f.status),
          queue: f.queue ?? '',
          agentId: f.agent ?? '',
          createdAfter: when('--since', f.since),
          createdBefore: when('--until', f.until),
          pageSize: positiveInt('--limit', f.limit, 500) ?? 0,
          pageToken: f.pageToken ?? '',
        });
        if (f.json) return printJson(AdminServiceListJobsResponseSchema, r);
        table([
          ['JOB', 'QUEUE', 'STATUS', 'ATTEMPT', 'AGENT', 'CREATED', 'FINISHED', 'ERROR'],
          ...r.jobs.map((j) => [
            j.id,
            j.queue,
            status(j.status),
            `${j.attemptNo}/${j.maxAttempts}`,
            j.agentId || '-',
            time(j.createdAt),
            time(j.finishedAt),
            String((j.error as { message?: unknown } | undefined)?.message ?? '').slice(0, 60) || '-',
          ]),
        ]);
        if (r.nextPageToken) process.stderr.write(`more: --page-token ${r.nextPageToken}\n`);
      }),
    );

  remote(jobs.command('show <jobId>').description('one job with its attempts, events, steps and stale reports')).action(
    action(async (api, jobId: string, f: ApiFlags) => {
      const r = await api.admin.getJob({ jobId });
      if (f.json) return printJson(AdminServiceGetJobResponseSchema, r);
      const j = r.job!;
      out(`job ${j.id}  queue ${j.queue}  ${status(j.status)}  attempt ${j.attemptNo} (${j.attemptsStarted} started of ${j.maxAttempts})`);
      out(`created ${time(j.createdAt)}  due ${time(j.runAt)}  finished ${time(j.finishedAt)}  last heartbeat ${time(r.heartbeatAt)}`);
      if (j.agentId) out(`held by ${j.agentId} (attempt ${j.currentAttemptId}) until ${time(j.leaseExpiresAt)}`);
      if (j.error) out(`error: ${JSON.stringify(j.error)}`);
      if (j.result) out(`result: ${JSON.stringify(j.result)}`);
      out('');
      table([
        ['#', 'ATTEMPT', 'AGENT', 'STATUS', 'CLAIMED', 'STARTED', 'ENDED', 'SUSPECT'],
        ...r.attempts.map((a) => [String(a.attemptNo), a.id, a.agentId, attemptStatus(a.status), time(a.claimedAt), time(a.startedAt), time(a.endedAt), time(a.suspectSince)]),
      ]);
      out('');
      table([['AT', 'EVENT', 'ATTEMPT'], ...r.events.map((e) => [time(e.at), e.kind, e.attemptId || '-'])]);
      if (r.steps.length) {
        out('');
        table([['STEP', 'STATUS', 'ATTEMPT', 'RESERVATIONS'], ...r.steps.map((s) => [s.step, s.status === 2 ? 'done' : 'started', s.attemptId, String(s.reservations)])]);
      }
      if (r.staleReports.length) {
        out('');
        table([['STALE AT', 'CALL', 'LATE ATTEMPT', 'AGENT', 'CURRENT'], ...r.staleReports.map((s) => [time(s.at), s.call, s.attemptId, s.agentId || '-', `#${s.currentAttemptNo} ${status(s.currentStatus)}`])]);
      }
    }),
  );

  remote(jobs.command('requeue <jobId>').description('put a dead, failed or canceled job back in its queue')).action(
    action(async (api, jobId: string, f: ApiFlags) => {
      const r = await api.admin.requeueJob({ jobId });
      if (f.json) return printJson(RequeueJobResponseSchema, r);
      out(`job ${r.job!.id} requeued on ${r.job!.queue} (its next attempt is #${r.job!.attemptNo + 1})`);
    }),
  );

  remote(jobs.command('cancel <jobId>').description('cancel a job that has not finished (its agent is told)')).action(
    action(async (api, jobId: string, f: ApiFlags) => {
      const r = await api.admin.cancelJob({ jobId });
      if (f.json) return printJson(AdminServiceCancelJobResponseSchema, r);
      out(r.outcome === Outcome.DUPLICATE ? `job ${r.job!.id} was canceled already` : `job ${r.job!.id} canceled`);
    }),
  );

  remote(jobs.command('purge').description('delete finished jobs older than a retention, with their history'))
    .option('--older-than <duration>', "finished longer ago than this (7d, 12h); default: the coordinator's LEASEHOLD_RETENTION")
    .option('--status <statuses>', 'only these: succeeded, failed, dead, canceled (default all four)')
    .option('--queue <queue>', 'only this queue')
    .option('--dry-run', 'count, delete nothing')
    .action(
      action(async (api, f: ApiFlags & { olderThan?: string; status?: string; queue?: string; dryRun?: boolean }) => {
        let olderThan: Duration | undefined;
        if (f.olderThan !== undefined) {
          const ms = parseDuration(f.olderThan);
          if (ms === undefined || ms < 1000) throw new UsageError(`--older-than ${JSON.stringify(f.olderThan)} must be a duration of at least 1s (e.g. 7d, 12h)`);
          olderThan = durationFromMs(ms);
        }
        const r = await api.admin.purgeJobs({ olderThan, statuses: statuses(f.status), queue: f.queue ?? '', dryRun: Boolean(f.dryRun) });
        if (f.json) return printJson(PurgeJobsResponseSchema, r);
        out(`${r.dryRun ? 'would purge' : 'purged'} ${r.purged} finished job(s) that ended before ${time(r.cutoff)}`);
      }),
    );

  remote(jobs.command('stale').description('late calls refused because their attempt was no longer current, newest first'))
    .option('--job <jobId>', 'only about this job')
    .option('--agent <agent>', 'only made by this agent')
    .option('--limit <n>', 'at most this many (default 50, at most 500)')
    .option('--page-token <token>', 'the next page')
    .action(
      action(async (api, f: ApiFlags & { job?: string; agent?: string; limit?: string; pageToken?: string }) => {
        const r = await api.admin.listStaleReports({ jobId: f.job ?? '', agentId: f.agent ?? '', pageSize: positiveInt('--limit', f.limit, 500) ?? 0, pageToken: f.pageToken ?? '' });
        if (f.json) return printJson(ListStaleReportsResponseSchema, r);
        table([
          ['AT', 'JOB', 'CALL', 'LATE ATTEMPT', 'AGENT', 'CURRENT'],
          ...r.reports.map((s) => [time(s.at), s.jobId, s.call, s.attemptId, s.agentId || '-', `#${s.currentAttemptNo} ${status(s.currentStatus)}`]),
        ]);
        if (r.nextPageToken) process.stderr.write(`more: --page-token ${r.nextPageToken}\n`);
      }),
    );

  remote(program.command('stats').description('queue depths, the oldest waiting job per queue, completions and expiries per minute'))
    .option('--window <minutes>', 'per-minute counts over this many minutes (default 15)')
    .action(
      action(async (api, f: ApiFlags & { window?: string }) => {
        const r = await api.admin.getStats({ windowMinutes: positiveInt('--window', f.window, 1440) ?? 0 });
        if (f.json) return printJson(GetStatsResponseSchema, r);
        const cols = [JobStatus.QUEUED, JobStatus.CLAIMED, JobStatus.RUNNING, JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.DEAD, JobStatus.CANCELED];
        const queues = [...new Set([...r.depths.map((d) => d.queue), ...r.waiting.map((w) => w.queue)])].sort();
        const count = (q: string, s: JobStatus) => String(r.depths.find((d) => d.queue === q && d.status === s)?.count ?? 0n);
        table([
          ['QUEUE', ...cols.map((c) => status(c).toUpperCase()), 'DUE', 'OLDEST WAIT'],
          ...queues.map((q) => {
            const w = r.waiting.find((x) => x.queue === q);
            return [q, ...cols.map((c) => count(q, c)), String(w?.due ?? 0n), w ? age(durMs(w.oldestAge)) : '-'];
          }),
        ]);
        const fmt = (n: number) => n.toFixed(2);
        out(
          `\nlast ${r.windowMinutes} min: ${fmt(r.completionsPerMinute)} completions/min, ${fmt(r.failuresPerMinute)} failures/min, ` +
            `${fmt(r.expiriesPerMinute)} expiries/min, ${r.staleReports} stale report(s)`,
        );
      }),
    );
}
