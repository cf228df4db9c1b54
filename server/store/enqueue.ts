/**
 * Enqueue: a new job, `queued` (or, with a hand-off, claimed at once for a free slot of the
 * caller's coordinator). One statement; the row it inserts is the enqueue's record. With an
 * idempotency key, the same key, queue and payload return the existing job.
 */
import { conflict, duplicate, invalid, type Failure, type Outcome } from '../domain/outcomes.js';
import { check, checkAll, checkJson, limits, schemas, valid } from '../domain/validation.js';
import { newJobId } from './ids.js';
import { JOBS_CHANNEL } from './notify.js';
import { currentOf, jobColumns, toJob, withoutNotified, type Job } from './rows.js';
import { run, statement, StoreError, type Queryable } from './sql.js';

export interface EnqueueParams {
  queue: string;
  /** A JSON object, at most `limits.payloadBytes` serialized. */
  payload: unknown;
  /** Higher runs first; default 0. */
  priority?: number;
  /** Not before this time; default now. */
  runAt?: Date;
  /** Started attempts before the job is dead-lettered; default 5. */
  maxAttempts?: number;
  /** The same key with the same queue and payload returns the existing job; another payload is `conflict`. */
  idempotencyKey?: string;
  /** A running attempt past this is revoked and failed as retryable. */
  executionTimeoutMs?: number;
  /** Only agents carrying all these labels are given the job. */
  labels?: Record<string, string>;
  /**
   * An http(s) URL that receives one signed notification when the job ends. Not part of the
   * idempotency comparison: a duplicate enqueue keeps the first call's URL.
   */
  notifyUrl?: string;
  /**
   * A header every delivery to `notifyUrl` carries (a receiver checking a header instead of the
   * signature). Kept in `notify_headers`, never read back by any read of the job. Needs `notifyUrl`.
   */
  notifyHeader?: { name: string; value: string };
  /**
   * A free slot of an agent on the caller's coordinator (the dispatcher's `reserve`): the job is
   * claimed for it by the enqueue itself when nothing comes before it (see the statement).
   */
  handOff?: { agentId: string; agentLabels: Record<string, string>; attemptId: string; claimTtlMs: number };
  /**
   * Whether the statement itself NOTIFYs the dispatchers when the job is queued and due
   * (default). A caller that wakes them after the commit instead (`QueueWaker`: the gateway)
   * passes false, so that enqueues do not commit one at a time on PostgreSQL's NOTIFY lock.
   */
  notify?: boolean;
  /**
   * What to answer instead of inserting a new job (the gateway's refusal of a notifyUrl that
   * webhooks may not reach). An idempotency key's earlier job is still answered as any repeat is
   * (duplicate, or conflict), so that a retry of an enqueue taken before the refusal learns its
   * job rather than a refusal. Nothing is written either way.
   */
  refused?: Failure;
  now?: Date;
}

export const DEFAULT_MAX_ATTEMPTS = 5;

// The row is the enqueue's record: what was asked for stays in its columns, the time in
// created_at. Nothing else is written. Its id ($17) is a UUIDv7 made by the caller's process
// (ids.ts).
//
// With a hand-off ($11–$14: an agent with a free slot on the caller's coordinator, its labels,
// a fresh attempt id and the claim TTL), the job is inserted already claimed for that agent (the
// claim and its attempt as jobClaim makes them) when it could have been claimed for it right
// away: due now, its labels carried by the agent, and no due queued job in the queue that the
// agent could take would come before it (priority, then age: the job is the newest). That
// check reads jobs_claim_idx from the front of the queue and stops at the first match. Then no
// NOTIFY is sent: the job is not waiting.
//
// Four statements of the same parameters, each leaving out what its callers do not need, which
// PostgreSQL would otherwise set up on every execution for nothing:
// - with `extras`, the idempotency key's CTE (k) and the notification header's (nh); without, for
//   an enqueue with neither (most of them), the statement without those two (a table and its
//   indexes opened for nothing to insert: a median 13.7 µs of a backend's CPU an enqueue of
//   122–152, in ten paired rounds), and without CTEs at all when it does not notify: one INSERT
//   whose source computes the hand-off's check once (`OFFSET 0` keeps it a subquery; its NOT
//   EXISTS is an InitPlan, run once), 7 µs less than the same in CTEs (six paired rounds);
// - with `notify`, the NOTIFY to the dispatchers when the job is queued and due; without, for a
//   caller that wakes them after the commit instead (`QueueWaker`: the gateway; see
//   `jobsNotify`), the statement without that subquery (8–10 µs less, six paired rounds).
// (docs/performance.md, "What would close what is left", "CPU time beside the floor".)
const handOffCheck = `$12::text IS NOT NULL
       AND ($4::timestamptz IS NULL OR $4::timestamptz <= coalesce($8::timestamptz, now()))
       AND $9::jsonb <@ $13::jsonb
       AND NOT EXISTS (
         SELECT 1 FROM jobs_live q
         WHERE q.current_attempt_id IS NULL AND q.finished_at IS NULL AND q.queue = $1 AND q.priority >= $3
           AND q.run_at <= coalesce($8::timestamptz, now()) AND (q.labels = '{}'::jsonb OR q.labels <@ $13::jsonb)
       )`;

/** The job's INSERT: its id `id`, the hand-off's check `h.yes`, both from `from`, when `where` holds. */
const insertJobSql = (id: string, from: string, where: string, returning: string) =>
  `INSERT INTO jobs_live (id, queue, payload, priority, run_at, max_attempts, idempotency_key, execution_timeout_ms,
                       labels, notify_url, created_at, updated_at,
                       status, attempt_no, current_attempt_id, agent_id, claimed_at, claim_deadline, lease_expires_at)
     SELECT ${id}, $1, $2::jsonb, $3, coalesce($4::timestamptz, $8::timestamptz, now()), $5, $6, $7, $9::jsonb, $10,
            coalesce($8::timestamptz, now()), coalesce($8::timestamptz, now()),
            CASE WHEN h.yes THEN 'claimed' ELSE 'queued' END::job_status, CASE WHEN h.yes THEN 1 ELSE 0 END,
            CASE WHEN h.yes THEN $11::uuid END, CASE WHEN h.yes THEN $12::text END,
            CASE WHEN h.yes THEN coalesce($8::timestamptz, now()) END,
            CASE WHEN h.yes THEN coalesce($8::timestamptz, now()) + make_interval(secs => $14::float8 / 1000.0) END,
            CASE WHEN h.yes THEN coalesce($8::timestamptz, now()) + make_interval(secs => $14::float8 / 1000.0) END
     FROM ${from}
     WHERE ${where}
     RETURNING ${returning}`;

/** The plain insert's condition: no key, no header (always true for the parameters it is given). */
const PLAIN = '$6::text IS NULL AND $15::text IS NULL AND $16::text IS NULL';
const PLAIN_FROM = `(SELECT ${handOffCheck} AS yes OFFSET 0) h`;

// Wakes the dispatchers of every coordinator (delivered at commit) when the job is due now.
const notifiedSql = `(SELECT count(pg_notify('${JOBS_CHANNEL}', n.queue)) FROM n WHERE n.status = 'queued' AND n.run_at <= now()) AS notified`;

// What the plain statements return: what PostgreSQL decided (claimed or queued) and the times it
// set, from which and the parameters the job is the caller's to write (`plainJob`). Writing out
// the other 30 columns, its JSON and its times, cost PostgreSQL 17 µs an enqueue in a lab loop.
const PLAIN_RETURNS = 'status, run_at, created_at, claim_deadline';

// Whether the job is due by the database's clock (the one the claim reads run_at by), for a
// caller that wakes the dispatchers after the commit: its own clock may be behind PostgreSQL's.
const dueSql = (runAt: string) => `${runAt} <= coalesce($8::timestamptz, now()) AS due`;

const enqueueText = (extras: boolean, notify: boolean) => {
  if (!extras) {
    if (!notify) return insertJobSql('$17::uuid', PLAIN_FROM, PLAIN, `${PLAIN_RETURNS}, ${dueSql('run_at')}`);
    return `WITH n AS (
     ${insertJobSql('$17::uuid', PLAIN_FROM, PLAIN, '*')}
   )
   SELECT ${PLAIN_RETURNS.split(', ').map((c) => `n.${c}`).join(', ')}, ${dueSql('n.run_at')}, ${notifiedSql} FROM n`;
  }
  return `WITH h AS MATERIALIZED (
     SELECT ${handOffCheck} AS yes
   ), i AS MATERIALIZED (
     SELECT $17::uuid AS id
   ), k AS (
     -- The key taken for this job, unless another job holds it (then no job is inserted).
     INSERT INTO job_keys (key, job_id) SELECT $6, i.id FROM i WHERE $6::text IS NOT NULL
     ON CONFLICT (key) DO NOTHING
     RETURNING job_id
   ), n AS (
     ${insertJobSql('i.id', 'h, i', '$6::text IS NULL OR EXISTS (SELECT 1 FROM k)', '*')}
   ), nh AS (
     INSERT INTO notify_headers (job_id, name, value) SELECT n.id, $15, $16 FROM n WHERE $15::text IS NOT NULL
   )
   SELECT n.*, NULL::jsonb AS error, ${dueSql('n.run_at')}${notify ? `, ${notifiedSql}` : ''} FROM n`;
};
/** The enqueue's statements by [extras][notify] (see enqueueText). */
const enqueueSqls = {
  extras: { notify: statement('jobEnqueue', enqueueText(true, true)), quiet: statement('jobEnqueueQuiet', enqueueText(true, false)) },
  plain: { notify: statement('jobEnqueuePlain', enqueueText(false, true)), quiet: statement('jobEnqueuePlainQuiet', enqueueText(false, false)) },
};

// Runs after the key's ON CONFLICT DO NOTHING inserted nothing: a new snapshot, so it sees the
// competing insert that made it skip (READ COMMITTED). The job is looked up by id in every
// partition of jobs (live or moved to its day). `k_job_id` without a job: a key left behind.
const byKeySql = statement(
  'jobByIdempotencyKey',
  `SELECT ${jobColumns('j')}, (j.queue = $2 AND j.payload = $3::jsonb) AS same, k.job_id AS k_job_id
   FROM job_keys k LEFT JOIN jobs j ON j.id = k.job_id WHERE k.key = $1`,
);

// A key whose job is gone (deleted behind the store's back): freed, so the enqueue can take it.
const keyFreeSql = statement('jobKeyFree', `DELETE FROM job_keys k WHERE k.key = $1 AND k.job_id = $2 AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = $2)`);

/** What the plain statements return (PLAIN_RETURNS). */
interface PlainReturned {
  status: 'queued' | 'claimed';
  run_at: Date;
  created_at: Date;
  claim_deadline: Date | null;
  due: boolean;
}

/**
 * What `jobEnqueue` answers: for a job it inserted, also whether the job was due when inserted,
 * by the database's clock (`run_at <= now()`, or the `now` given): a caller that wakes the
 * dispatchers itself (the gateway's QueueWaker) wakes them on that, not on its own clock.
 */
export type EnqueueOutcome = Outcome<Job> & { due?: boolean };

/**
 * The job a plain enqueue inserted, as `toJob` of its `RETURNING *` row would give it: each
 * column from what the statement was given or what it returned, as insertJobSql sets it
 * (claimed_at and updated_at are created_at's expression, lease_expires_at claim_deadline's), the
 * JSON values as PostgreSQL reads them back (the same values; an object's keys in the order
 * given), the other columns those of a new job. One object literal, every key in it: an object of
 * one shape, made at once (a row built key by key cost more than decoding PostgreSQL's).
 * test/store.enqueue-row.test.ts holds it equal to the job read back, every column.
 */
function plainJob(id: string, p: EnqueueParams, payloadJson: string, labelsJson: string, r: PlainReturned): Job {
  const claimed = r.status === 'claimed';
  const job: Job & Record<StorageColumn, null> = {
    id,
    queue: p.queue,
    payload: JSON.parse(payloadJson) as unknown,
    priority: p.priority ?? 0,
    status: r.status,
    runAt: r.run_at,
    maxAttempts: p.maxAttempts ?? DEFAULT_MAX_ATTEMPTS,
    attemptNo: claimed ? 1 : 0,
    attemptsStarted: 0,
    currentAttemptId: claimed ? p.handOff!.attemptId.toLowerCase() : null,
    agentId: claimed ? p.handOff!.agentId : null,
    claimedAt: claimed ? r.created_at : null,
    claimDeadline: r.claim_deadline,
    startedAt: null,
    suspectSince: null,
    leaseExpiresAt: r.claim_deadline,
    heartbeatAt: null,
    executionTimeoutMs: p.executionTimeoutMs ?? null,
    executionDeadline: null,
    idempotencyKey: null,
    labels: JSON.parse(labelsJson) as unknown,
    progress: null,
    result: null,
    notifyUrl: p.notifyUrl ?? null,
    createdAt: r.created_at,
    updatedAt: r.created_at,
    finishedAt: null,
    finalAttemptId: null,
    finalAgentId: null,
    finalClaimedAt: null,
    finalClaimDeadline: null,
    finalStartedAt: null,
    finalSuspectSince: null,
    doneDay: null,
    error: null,
  };
  return job;
}

/** The row's columns that are not the job as the API shows it (rows.ts), null in a new job. */
type StorageColumn = 'finalAttemptId' | 'finalAgentId' | 'finalClaimedAt' | 'finalClaimDeadline' | 'finalStartedAt' | 'finalSuspectSince' | 'doneDay';

/**
 * Adds a job in `queued`. With an idempotency key: `ok` for a new job, `duplicate` with the
 * existing job for the same queue and payload, `conflict` for another one.
 */
export async function jobEnqueue(db: Queryable, p: EnqueueParams): Promise<EnqueueOutcome> {
  const bad = checkAll(
    valid.queue(p.queue) ? undefined : check('queue', schemas.queue, p.queue),
    p.priority === undefined ? undefined : check('priority', schemas.priority, p.priority),
    p.maxAttempts === undefined ? undefined : check('maxAttempts', schemas.maxAttempts, p.maxAttempts),
    p.runAt === undefined ? undefined : check('runAt', schemas.date, p.runAt),
    p.idempotencyKey === undefined ? undefined : check('idempotencyKey', schemas.idempotencyKey, p.idempotencyKey),
    p.executionTimeoutMs === undefined
      ? undefined
      : check('executionTimeoutMs', schemas.executionTimeoutMs, p.executionTimeoutMs),
    p.labels === undefined ? undefined : check('labels', schemas.labels, p.labels),
    p.notifyUrl === undefined ? undefined : check('notifyUrl', schemas.url, p.notifyUrl),
    p.notifyHeader === undefined ? undefined : check('notifyHeader', schemas.notifyHeader, p.notifyHeader),
    p.notifyHeader !== undefined && p.notifyUrl === undefined ? invalid('notifyHeader', 'needs notifyUrl: it is sent with the deliveries to it') : undefined,
  );
  if (bad) return bad;
  const payload = checkJson('payload', p.payload, { maxBytes: limits.payloadBytes, object: true });
  if ('failure' in payload) return payload.failure;

  if (p.refused) return p.idempotencyKey === undefined ? p.refused : keyedRepeat(db, p.idempotencyKey, p.queue, payload.json, p.refused);

  const plain = p.idempotencyKey === undefined && p.notifyHeader === undefined;
  const id = newJobId();
  const labels = JSON.stringify(p.labels ?? {});
  const rows = await run(db, enqueueSqls[plain ? 'plain' : 'extras'][p.notify === false ? 'quiet' : 'notify'], [
    p.queue,
    payload.json,
    p.priority ?? 0,
    p.runAt ?? null,
    p.maxAttempts ?? DEFAULT_MAX_ATTEMPTS,
    p.idempotencyKey ?? null,
    p.executionTimeoutMs ?? null,
    p.now ?? null,
    labels,
    p.notifyUrl ?? null,
    p.handOff?.attemptId ?? null,
    p.handOff?.agentId ?? null,
    JSON.stringify(p.handOff?.agentLabels ?? {}),
    p.handOff?.claimTtlMs ?? null,
    p.notifyHeader?.name ?? null,
    p.notifyHeader?.value ?? null,
    id,
  ]);
  // Without a key the job is always inserted (the statement's WHERE holds for these parameters).
  if (plain && !rows[0]) throw new StoreError('the enqueue without a key or a header inserted no job');
  if (plain) {
    const r = rows[0] as PlainReturned;
    return { outcome: 'ok', value: plainJob(id, p, payload.json, labels, r), due: r.due };
  }
  if (rows[0]) {
    const { due, ...row } = withoutNotified(rows[0]);
    return { outcome: 'ok', value: toJob(row), due: due === true };
  }

  const [existing] = await run<Record<string, unknown> & { same: boolean; k_job_id: string }>(db, byKeySql, [p.idempotencyKey, p.queue, payload.json]);
  // The conflicting job was purged between the two statements: the key is free again.
  if (!existing) return jobEnqueue(db, p);
  const { same, k_job_id, ...row } = existing;
  if (row.id === null) {
    await run(db, keyFreeSql, [p.idempotencyKey, k_job_id]);
    return jobEnqueue(db, p);
  }
  return repeatOf(p.idempotencyKey!, same, row);
}

/**
 * An enqueue that may not insert (`refused`) with an idempotency key: the key's job answered as
 * a repeat is (duplicate with the same queue and payload, else conflict), or `refused` when the
 * key holds no job. Reads only.
 */
async function keyedRepeat(db: Queryable, key: string, queue: string, payloadJson: string, refused: Failure): Promise<EnqueueOutcome> {
  const [existing] = await run<Record<string, unknown> & { same: boolean; k_job_id: string }>(db, byKeySql, [key, queue, payloadJson]);
  if (!existing || existing.id === null) return refused;
  const { same, k_job_id: _k, ...row } = existing;
  return repeatOf(key, same, row);
}

/** What a repeat of `key` is answered, given its job's row (`byKeySql`): duplicate with the same queue and payload, else conflict. */
function repeatOf(key: string, same: boolean, row: Record<string, unknown>): EnqueueOutcome {
  if (same) return duplicate(toJob(row));
  return conflict(`idempotency key ${JSON.stringify(key)} was used for job ${String(row.id)} with another queue or payload`, currentOf(row as never));
}
