/**
 * Stale reports: a call made for an attempt that is no longer current (superseded, ended,
 * canceled) is answered `stale` and leaves a `stale_reports` row (`reportStale`), which operators
 * list (`staleReportList`).
 */
import { ok, stale, type CurrentState, type Failure, type Outcome } from '../domain/outcomes.js';
import type { JobStatus } from '../domain/statuses.js';
import { check, checkAll, schemas } from '../domain/validation.js';
import { DEFAULT_PAGE_SIZE, pageOf, pageSizeSchema, pageTokenDecode, type PageTokenFormat } from './page-token.js';
import { camelRow } from './rows.js';
import type { StaleReportRow } from './schema.js';
import { run, statement, type Queryable } from './sql.js';

/** The call that came too late: the `call` column of `stale_reports`. */
export type Call = 'start' | 'heartbeat' | 'complete' | 'fail' | 'step';

// FOR KEY SHARE: a job purged (or deleted) while its late report is answered is skipped, not a
// foreign-key error: the lock waits for the delete and then finds no row, where the key's own
// check would have failed the statement (and with it a heartbeat tick of every agent). It does
// not conflict with the transitions' updates, which change no key.
const staleReportSql = statement(
  'staleReportInsert',
  `INSERT INTO stale_reports (job_id, attempt_id, agent_id, call, current_attempt_id, current_attempt_no, current_status, at)
   SELECT j.id, $2, $3, $4, j.current_attempt_id, j.attempt_no, j.status, coalesce($5::timestamptz, now())
   FROM jobs j WHERE j.id = $1
   FOR KEY SHARE
   RETURNING current_attempt_id, current_attempt_no, current_status`,
);

/** Writes the `stale_reports` row for a late call and returns the `stale` outcome. */
export async function reportStale(
  db: Queryable,
  p: { jobId: string; attemptId: string; agentId: string; call: Call; now?: Date | undefined },
): Promise<Failure> {
  type Row = { current_attempt_id: string | null; current_attempt_no: number; current_status: JobStatus };
  const params = [p.jobId, p.attemptId, p.agentId, p.call, p.now ?? null];
  // No row: the job was purged, or a success was moving its row to its day's partition while the
  // lock waited (a delete and an insert, which the lock does not follow): a new snapshot sees it
  // moved.
  let [r] = await run<Row>(db, staleReportSql, params);
  if (!r) [r] = await run<Row>(db, staleReportSql, params);
  const current: CurrentState = {
    jobId: p.jobId,
    status: r?.current_status ?? 'canceled',
    attemptNo: r?.current_attempt_no ?? 0,
    currentAttemptId: r?.current_attempt_id ?? null,
  };
  return stale(
    `attempt ${p.attemptId} is not current: job ${p.jobId} is ${current.status} at attempt ${current.attemptNo}` +
      (current.currentAttemptId ? ` (current attempt ${current.currentAttemptId})` : ''),
    current,
  );
}

// Newest first, paged by id (the primary key; stale_reports_job_idx serves the job filter).
const staleSql = statement(
  'adminStaleReports',
  `SELECT * FROM stale_reports
   WHERE ($1::uuid IS NULL OR job_id = $1) AND ($2::text IS NULL OR agent_id = $2) AND ($3::bigint IS NULL OR id < $3)
   ORDER BY id DESC LIMIT $4`,
);

/** A page's token: the id of its last report, `s<id>`. */
const cursorFormat: PageTokenFormat<number> = {
  write: (id) => `s${id}`,
  read(text) {
    const m = /^s(\d{1,15})$/.exec(text);
    return m ? Number(m[1]) : undefined;
  },
};

/** A page of stale reports, newest first. */
export async function staleReportList(
  db: Queryable,
  p: { jobId?: string; agentId?: string; pageSize?: number; pageToken?: string },
): Promise<Outcome<{ reports: StaleReportRow[]; nextPageToken: string }>> {
  const bad = checkAll(
    p.jobId === undefined ? undefined : check('jobId', schemas.id, p.jobId),
    p.agentId === undefined ? undefined : check('agentId', schemas.agentId, p.agentId),
    p.pageSize === undefined ? undefined : check('pageSize', pageSizeSchema, p.pageSize),
  );
  if (bad) return bad;
  const start = pageTokenDecode(cursorFormat, p.pageToken);
  if ('failure' in start) return start.failure;
  const size = p.pageSize ?? DEFAULT_PAGE_SIZE;
  const rows = await run<Record<string, unknown>>(db, staleSql, [p.jobId ?? null, p.agentId ?? null, start.after ?? null, size + 1]);
  const { page, nextPageToken } = pageOf(cursorFormat, rows.map((r) => camelRow<StaleReportRow>(r)), size, (last) => last.id);
  return ok({ reports: page, nextPageToken });
}
