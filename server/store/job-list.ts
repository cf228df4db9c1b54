/**
 * Lists of jobs, newest first, paged by (created_at, id): AdminService ListJobs (`jobSearch`)
 * and JobService ListJobs (`jobList`) are both this, with their own filters. Page tokens and
 * sizes: page-token.ts.
 *
 * One statement per shape of the call (which filters it gives), holding only those filters, each
 * written so an index can serve it; and the jobs split by where an index holds them:
 *
 * - queued: `jobs_claim_idx` (its predicate spelled out), by queue;
 * - held (claimed, running): `jobs_current_attempt_uq`;
 * - finished: `jobs_finished_queue_idx` by queue, and `jobs_unsucceeded_idx` for the failed, dead
 *   and canceled ones (succeeded jobs have a result, the others none); newest first in both.
 *
 * Each part is read newest first up to a page and the parts merged. `status` itself is in no
 * index: the start changes it and must stay a HOT update; none of these indexes holds a column
 * that the start or a heartbeat changes, and the finished ones take an entry only when a job
 * finishes. Without a queue, status or agent the list is `jobs_created_idx` read newest first
 * (a time range bounds that scan on both ends).
 *
 * By agent: the jobs it holds now (`jobs_current_attempt_uq`), those of its ended attempts, read
 * newest job first from `attempts_agent_idx` (each attempt carries its job's `created_at`), and
 * those it succeeded (the attempt kept on the job's row), from `jobs_final_agent_idx` of each
 * partition, newest first; each job once.
 */
import { z } from 'zod';
import { ok, type Outcome } from '../domain/outcomes.js';
import { FINISHED_STATUSES, JOB_STATUSES, type JobStatus } from '../domain/statuses.js';
import { check, checkAll, schemas } from '../domain/validation.js';
import { DEFAULT_PAGE_SIZE, pageOf, pageSizeSchema, pageTokenDecode, type PageTokenFormat } from './page-token.js';
import { jobErrorSql, toJob, type Job } from './rows.js';
import { run, statement, withTransaction, type Queryable, type Statement } from './sql.js';

export interface JobListFilter {
  statuses?: readonly JobStatus[] | undefined;
  queue?: string | undefined;
  /** Jobs with an attempt by this agent (live or ended). */
  agentId?: string | undefined;
  createdAfter?: Date | undefined;
  createdBefore?: Date | undefined;
}

/** A page's position: after the job created at these microseconds since the epoch, with this id. */
export type JobCursor = [createdUs: number, id: string];

/** Where an index holds them: each a condition the planner matches to that index's predicate. */
const PARTS = {
  all: 'true',
  queued: 'j.current_attempt_id IS NULL AND j.finished_at IS NULL',
  held: 'j.current_attempt_id IS NOT NULL',
  finished: 'j.finished_at IS NOT NULL',
  unsucceeded: 'j.finished_at IS NOT NULL AND j.result IS NULL',
  // The agent's: its live attempts (the held jobs' rows), the jobs of its ended attempts (rows
  // of attempts), and those it succeeded (the attempt kept on the job's row).
  agentHeld: 'j.current_attempt_id IS NOT NULL AND j.agent_id = $A',
  agentEnded: '',
  // (the agent's own condition added as a range: see `led` in jobListQuery)
  agentSucceeded: 'j.final_attempt_id IS NOT NULL',
} as const;
type Part = keyof typeof PARTS;
// Parts that only live jobs are in: read from jobs_live, the partition that holds them (the others
// from jobs, all its partitions: finished jobs are in the partitions of their days, and some in jobs_live).
const LIVE_PARTS = new Set<Part>(['queued', 'held', 'agentHeld']);

const finishedSet = new Set<JobStatus>(FINISHED_STATUSES);

/** The parts a filter reads. */
function partsOf(f: JobListFilter): Part[] {
  const s = f.statuses?.length ? new Set(f.statuses) : undefined;
  if (f.agentId !== undefined) {
    // A queued job can have ended attempts by the agent (it was retried); a held one can too.
    return [
      ...(!s || s.has('claimed') || s.has('running') ? (['agentHeld'] as const) : []),
      'agentEnded',
      ...(!s || s.has('succeeded') ? (['agentSucceeded'] as const) : []),
    ];
  }
  if (!s && f.queue === undefined) return ['all'];
  const parts: Part[] = [];
  if (!s || s.has('queued')) parts.push('queued');
  if (!s || s.has('claimed') || s.has('running')) parts.push('held');
  const fin = s ? [...s].filter((x) => finishedSet.has(x)) : [...finishedSet];
  if (fin.length) parts.push(fin.includes('succeeded') ? 'finished' : 'unsucceeded');
  return parts;
}

const statements = new Map<string, Statement>();

/**
 * The LIMITs a statement is written with: a page's rows plus one, rounded up to one of these, so
 * that a page size is not a statement of its own. Written as a number, not a parameter: a
 * generic plan assumes a parameter's LIMIT returns a tenth of the rows, and planned for that
 * (sorting and reading in parallel; 13 ms against 1.8 for the page of an agent at ten million
 * jobs). `jobListPage` runs the statements in generic plans (it says why).
 */
const LIMITS = [11, 26, 51, 101, 201, 501];

/** The statement and parameters of one page: at least `limit` rows after `after`, newest first. */
export function jobListQuery(f: JobListFilter, limit: number, after?: JobCursor): { statement: Statement; values: unknown[] } {
  const values: unknown[] = [];
  // Conditions on the job, and (for the agent's ended attempts) the same on the attempt's copy
  // of the job's creation time and id, which its index is ordered by.
  const onJob: string[] = [];
  const onAttempt: string[] = [];
  // The statement's name says which filters it holds (one letter each) and which parts it reads.
  let shape = '';
  const param = (v: unknown, cast: string) => `$${values.push(v)}::${cast}`;
  const where = (letter: string, cond: (created: string, id: string) => string, attemptToo = false) => {
    shape += letter;
    onJob.push(cond('j.created_at', 'j.id'));
    if (attemptToo) onAttempt.push(cond('a.job_created_at', 'a.job_id'));
  };
  if (f.statuses?.length) {
    const v = param(f.statuses, 'job_status[]');
    where('s', () => `j.status = ANY (${v})`);
  }
  let queue: string | undefined;
  if (f.queue !== undefined) {
    queue = param(f.queue, 'text');
    where('q', () => `j.queue = ${queue}`);
  }
  const agent = f.agentId === undefined ? undefined : param(f.agentId, 'text');
  if (agent) shape += 'a';
  if (f.createdAfter) {
    const v = param(f.createdAfter, 'timestamptz');
    where('f', (c) => `${c} >= ${v}`, true);
  }
  if (f.createdBefore) {
    const v = param(f.createdBefore, 'timestamptz');
    where('b', (c) => `${c} < ${v}`, true);
  }
  // A row comparison on the index's columns, the token's microseconds turned back into the
  // timestamp exactly: each page starts with an index seek.
  if (after) {
    const [us, id] = [param(after[0], 'int8'), param(after[1], 'uuid')];
    where('k', (c, i) => `(${c}, ${i}) < ('epoch'::timestamptz + ${us} * interval '1 microsecond', ${id})`, true);
  }
  const n = LIMITS.find((l) => l >= limit) ?? limit;
  const parts = partsOf(f);
  const key = `jobList.${parts.join('+')}.${shape}.${n}`;
  let stmt = statements.get(key);
  if (!stmt) {
    // NULLS LAST as the indexes are built (drizzle's desc()): the columns are NOT NULL, so the
    // order is the same, but only an ORDER BY spelled like the index is read in index order.
    const order = (c: string, i: string, lead?: string) => `ORDER BY ${lead ? `${lead}, ` : ''}${c} DESC NULLS LAST, ${i} DESC NULLS LAST LIMIT ${n}`;
    // The parts read from an index led by the value they filter on (a queue's finished jobs,
    // an agent's succeeded ones), each partition's own: that value as a range and a first sort
    // key, which no other index has. Written as an equality the key is dropped (an equality to a
    // parameter sorts nothing), and the planner may read `_created_idx` newest first instead,
    // filtering: it expects the value spread evenly, but a burst of another queue's jobs (a drain
    // of 60,000) put 60,319 rows before the first match in today's partition, 15 ms against 0.4.
    const led = (p: Part): { conds: string[]; lead: string } | undefined => {
      const [column, value] = p === 'finished' && queue ? ['j.queue', queue] : p === 'agentSucceeded' && agent ? ['j.final_agent_id', agent] : [];
      if (!column) return undefined;
      const conds = [PARTS[p], `${column} >= ${value}`, `${column} <= ${value}`];
      return { conds: [...conds, ...onJob.filter((c) => c !== `j.queue = ${queue}`)], lead: column };
    };
    const one = (p: Part): string => {
      const l = led(p);
      if (l) return `SELECT j.* FROM jobs j WHERE ${l.conds.join(' AND ')} ${order('j.created_at', 'j.id', l.lead)}`;
      return p === 'agentEnded'
        ? // Its attempts from attempts_agent_idx, newest job first, each job once (its latest
          // attempt by the agent), and not one it holds now or succeeded (the other parts have
          // those).
          `SELECT j.* FROM attempts a JOIN jobs j ON j.id = a.job_id
           WHERE ${[
             `a.agent_id = ${agent}`,
             'a.job_created_at IS NOT NULL',
             'NOT EXISTS (SELECT 1 FROM attempts l WHERE l.job_id = a.job_id AND l.attempt_no > a.attempt_no AND l.agent_id = a.agent_id)',
             // nor one the agent succeeded (the agentSucceeded part has that one)
             'NOT (j.final_attempt_id IS NOT NULL AND j.final_agent_id = a.agent_id)',
             `NOT (j.current_attempt_id IS NOT NULL AND j.agent_id = ${agent})`,
             ...onAttempt,
             ...onJob,
           ].join(' AND ')}
           ${order('a.job_created_at', 'a.job_id')}`
        : `SELECT j.* FROM ${LIVE_PARTS.has(p) ? 'jobs_live' : 'jobs'} j WHERE ${[PARTS[p].replace('$A', agent ?? ''), ...onJob].join(' AND ')} ${order('j.created_at', 'j.id')}`;
    };
    const inner =
      parts.length === 1
        ? one(parts[0]!)
        : `SELECT * FROM (${parts.map((p) => `(${one(p)})`).join(' UNION ALL ')}) u ${order('u.created_at', 'u.id')}`;
    // A job's error is looked up for the page's rows only.
    stmt = statement(
      key,
      `SELECT y.*, ${jobErrorSql('y')} AS error, (extract(epoch FROM y.created_at) * 1000000)::int8 AS created_us
       FROM (${inner}) y ORDER BY y.created_at DESC, y.id DESC`,
    );
    statements.set(key, stmt);
  }
  return { statement: stmt, values };
}

/** A page's token: the position after its last job, `<created µs>.<job id>`. */
const cursorFormat: PageTokenFormat<JobCursor> = {
  write: ([us, id]) => `${us}.${id}`,
  read(text) {
    const m = /^(\d{1,20})\.([0-9a-f-]{36})$/.exec(text);
    return m ? [Number(m[1]), m[2]!] : undefined;
  },
};

/**
 * One page of the jobs matching `f`, newest first, after the page `pageToken` ended (a token
 * this server issued), and the next page's token (empty at the end).
 */
export async function jobListPage(
  db: Queryable,
  f: JobListFilter,
  size: number,
  pageToken: string | undefined,
): Promise<Outcome<{ jobs: Job[]; nextPageToken: string }>> {
  const start = pageTokenDecode(cursorFormat, pageToken);
  if ('failure' in start) return start.failure;
  const { statement: s, values } = jobListQuery(f, size + 1, start.after);
  // In a generic plan, planned once per connection: planning one of these statements (its parts
  // over every day's partition) took 2–3 ms, as long as running it. PostgreSQL's own choice,
  // custom plans first and the generic plan once it looks no costlier, went generic on a small
  // history and stayed custom on a large one (the generic plan's estimates grow with the
  // tables), so the page of an agent took 2.2 ms at 5,000 jobs and 4.4 ms at ten million,
  // against 1.8 ms in the generic plan (docs/performance-history.md, "Cost as the work grows"). Every
  // shape's generic plan reads the indexes it should (store.history-reads.test.ts). The setting
  // rides with the BEGIN: one round trip more than the statement alone (its COMMIT).
  const rows = await withTransaction(db, (tx) => run<Record<string, unknown> & { created_us: number; id: string }>(tx, s, values), {
    local: 'SET LOCAL plan_cache_mode = force_generic_plan',
  });
  const { page, nextPageToken } = pageOf(cursorFormat, rows, size, (last) => [last.created_us, last.id]);
  return ok({ jobs: page.map(({ created_us: _, ...r }) => toJob(r)), nextPageToken });
}

export interface ListParams {
  queue?: string;
  status?: JobStatus;
  /** 1 to 500; default 50. */
  pageSize?: number;
  /** From the previous page's `nextPageToken`. */
  pageToken?: string;
}

/** Built once (a zod schema costs tens of microseconds to build). */
const statusSchema = z.enum(JOB_STATUSES);

/** JobService ListJobs: a page of jobs, newest first, and the token of the next page (empty at the end). */
export async function jobList(db: Queryable, p: ListParams): Promise<Outcome<{ jobs: Job[]; nextPageToken: string }>> {
  const bad = checkAll(
    p.queue === undefined ? undefined : check('queue', schemas.queue, p.queue),
    p.status === undefined ? undefined : check('status', statusSchema, p.status),
    p.pageSize === undefined ? undefined : check('pageSize', pageSizeSchema, p.pageSize),
  );
  if (bad) return bad;
  return jobListPage(db, { queue: p.queue, statuses: p.status ? [p.status] : undefined }, p.pageSize ?? DEFAULT_PAGE_SIZE, p.pageToken);
}

const statuses = z.array(z.enum(JOB_STATUSES)).max(JOB_STATUSES.length);

export interface JobSearchParams {
  statuses?: JobStatus[];
  queue?: string;
  /** Jobs with an attempt by this agent. */
  agentId?: string;
  createdAfter?: Date;
  createdBefore?: Date;
  /** 1 to 500; default 50. */
  pageSize?: number;
  pageToken?: string;
}

/** AdminService ListJobs: a page of jobs matching every filter given, newest first, and the next page's token. */
export async function jobSearch(db: Queryable, p: JobSearchParams): Promise<Outcome<{ jobs: Job[]; nextPageToken: string }>> {
  const bad = checkAll(
    p.statuses === undefined ? undefined : check('statuses', statuses, p.statuses),
    p.queue === undefined ? undefined : check('queue', schemas.queue, p.queue),
    p.agentId === undefined ? undefined : check('agentId', schemas.agentId, p.agentId),
    p.createdAfter === undefined ? undefined : check('createdAfter', schemas.date, p.createdAfter),
    p.createdBefore === undefined ? undefined : check('createdBefore', schemas.date, p.createdBefore),
    p.pageSize === undefined ? undefined : check('pageSize', pageSizeSchema, p.pageSize),
  );
  if (bad) return bad;
  const { pageSize: size = DEFAULT_PAGE_SIZE, pageToken, ...filter } = p;
  return jobListPage(db, filter, size, pageToken);
}
