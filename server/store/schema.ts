/**
 * The Leasehold schema, in Drizzle. `drizzle-kit generate` turns it into the SQL migrations
 * under `server/store/migrations/` (committed); `npm run migrate` and the coordinator's start
 * apply them.
 *
 * The `jobs` row is the current state of a job and the only place a fence is checked: every
 * write on behalf of an attempt matches `current_attempt_id`. While an attempt is live (claimed
 * or running) the `jobs` row holds it (`current_attempt_id`, `agent_id`, `claimed_at`,
 * `started_at`, the lease); when it ends, the statement that ends it writes its `attempts` row,
 * once, with how it ended and what became of the job. The history of a job is therefore its
 * row as enqueued, its `attempts`, and `job_events` for the transitions no attempt makes (a
 * queued job canceled, an operator's requeue). `steps` is the effect ledger, `stale_reports`
 * the late calls refused.
 *
 * What a no-op job writes, enqueue to success: the `jobs` row inserted, then updated by the
 * claim, the start and the completion, and its `attempts` row inserted by the completion: five
 * row writes. The start (and every heartbeat) changes no indexed column, so PostgreSQL makes it
 * a HOT update (no index entries) when the page has room: hence the fillfactor, and no index on
 * `status` or the lease (the reaper walks the held jobs instead, see jobRescueExpired).
 */
import { getTableColumns, sql } from 'drizzle-orm';
import {
  bigint,
  boolean,
  check,
  date,
  index,
  integer,
  jsonb,
  pgEnum,
  pgTable,
  primaryKey,
  text,
  timestamp,
  uniqueIndex,
  uuid,
} from 'drizzle-orm/pg-core';
import {
  ATTEMPT_STATUSES,
  DELIVERY_STATUSES,
  EVENT_KINDS,
  JOB_STATUSES,
  STEP_STATUSES,
  WEBHOOK_EVENT_TYPES,
} from '../domain/statuses.js';

/** Job states of DESIGN.md (`domain/statuses.ts`). */
export const jobStatus = pgEnum('job_status', JOB_STATUSES);

/** How an attempt ended, or that it has not ended yet (`domain/statuses.ts`). */
export const attemptStatus = pgEnum('attempt_status', ATTEMPT_STATUSES);

/** The kinds of `job_events` rows (`domain/statuses.ts` says which are still written). */
export const eventKind = pgEnum('event_kind', EVENT_KINDS);

/** A step of the effect ledger is `started` (reserved by an attempt, outcome unknown) or `done`. */
export const stepStatus = pgEnum('step_status', STEP_STATUSES);

const tsz = (name: string) => timestamp(name, { withTimezone: true, mode: 'date' });

/**
 * The tables whose rows belong to a job (`job_id`), besides `attempts` (see there). None has a
 * foreign key to `jobs`. Every statement that writes one holds the job's row locked as it writes
 * (the transition's update for events and webhook events, the step fence's FOR SHARE, the stale
 * report's FOR KEY SHARE, the enqueue that inserts the job for its notify header), so no row is
 * written for a job being deleted; `jobPurge` deletes them with their job, in its own statement,
 * each through its `job_id` index. With `ON DELETE CASCADE` PostgreSQL ran one query per table
 * for every deleted job, more than half of a purge batch (docs/decisions.md). The test
 * invariants report any row whose job is missing.
 */
export const JOB_REFERENCES = ['job_events', 'steps', 'stale_reports', 'notify_headers', 'webhook_events'] as const;

export const jobs = pgTable(
  'jobs',
  {
    /**
     * Time-ordered (UUIDv7: milliseconds since the epoch, then 74 random bits; `job_id_v7()` in
     * SQL, the column's default, and `newJobId()` for the enqueue, ids.ts),
     * so new ids land at the right edge of the primary key and of every index that carries the
     * id, where the live jobs' pages stay in memory however much history the table keeps.
     */
    id: uuid('id').primaryKey().default(sql`job_id_v7()`),
    queue: text('queue').notNull(),
    payload: jsonb('payload').notNull(),
    priority: integer('priority').notNull().default(0),
    status: jobStatus('status').notNull().default('queued'),
    runAt: tsz('run_at').notNull().defaultNow(),
    maxAttempts: integer('max_attempts').notNull().default(5),
    /** Number of the newest attempt; the next claim creates attempt `attempt_no + 1`. */
    attemptNo: integer('attempt_no').notNull().default(0),
    /** Attempts that reached `start`: only these count toward `max_attempts`. */
    attemptsStarted: integer('attempts_started').notNull().default(0),
    /** The fencing token: set exactly while the job is `claimed` or `running`. */
    currentAttemptId: uuid('current_attempt_id'),
    /** The agent holding the current attempt. */
    agentId: text('agent_id'),
    /** When the current attempt was claimed, and its start deadline (written to its `attempts` row when it ends). */
    claimedAt: tsz('claimed_at'),
    claimDeadline: tsz('claim_deadline'),
    /** When the current attempt started (`running`). */
    startedAt: tsz('started_at'),
    /** Set when the agent's stream was lost while it held the current attempt; cleared on resume. */
    suspectSince: tsz('suspect_since'),
    /** Start deadline while `claimed`, run lease while `running` (never past `execution_deadline`). */
    leaseExpiresAt: tsz('lease_expires_at'),
    heartbeatAt: tsz('heartbeat_at'),
    executionTimeoutMs: integer('execution_timeout_ms'),
    /** `started_at + execution_timeout` of the current attempt. */
    executionDeadline: tsz('execution_deadline'),
    idempotencyKey: text('idempotency_key'),
    /** Labels an agent must have (its `Hello.labels` contain these pairs) to be given this job. */
    labels: jsonb('labels').notNull().default({}),
    /** The latest progress its current attempt reported with a heartbeat (not a transition). */
    progress: jsonb('progress'),
    /** The result of the attempt that succeeded: stored here, once (its `attempts` row refers to it). */
    result: jsonb('result'),
    /** An http(s) URL that receives one signed notification when the job ends (`webhook_deliveries`). */
    notifyUrl: text('notify_url'),
    createdAt: tsz('created_at').notNull().defaultNow(),
    updatedAt: tsz('updated_at').notNull().defaultNow(),
    finishedAt: tsz('finished_at'),
    /**
     * The attempt that succeeded, kept on its job's row instead of a row of `attempts` (its end is
     * `finished_at`, its number `attempt_no`, its result `result`): a success writes no attempt
     * row. Set only by the completion, never changed after (a succeeded job never moves). The
     * view `attempt_log` (migration 0018) reads it as an attempt beside the rows of `attempts`.
     */
    finalAttemptId: uuid('final_attempt_id'),
    finalAgentId: text('final_agent_id'),
    finalClaimedAt: tsz('final_claimed_at'),
    finalClaimDeadline: tsz('final_claim_deadline'),
    finalStartedAt: tsz('final_started_at'),
    finalSuspectSince: tsz('final_suspect_since'),
    /**
     * The partition it is kept in (`jobs` is partitioned by LIST on this, migration 0019): NULL in
     * `jobs_live` (live jobs, and finished ones kept there: from before every end moved its job,
     * or whose notification was undelivered when their day was dropped), else the UTC day its end
     * moved it to its day's partition, which the purger drops whole (server/store/days.ts).
     */
    doneDay: date('done_day', { mode: 'string' }),
  },
  (t) => [
    // Serves jobClaim: the next queued jobs of the agent's queues in priority order. Partial,
    // so it holds only claimable rows and stays small however many finished jobs are kept.
    // "Queued" is spelled by columns the start and the heartbeats never change (a CHECK ties
    // it to status = 'queued'), so those stay HOT updates.
    index('jobs_claim_idx')
      .on(t.queue, t.priority.desc(), t.runAt, t.id)
      .where(sql`${t.currentAttemptId} is null and ${t.finishedAt} is null`),
    // Serves every fenced write (start, heartbeat, complete, fail, steps) and the reaper's walk
    // of the held jobs: the fence is this column, and a unique index also makes two jobs
    // sharing an attempt id impossible.
    uniqueIndex('jobs_current_attempt_uq')
      .on(t.currentAttemptId)
      .where(sql`${t.currentAttemptId} is not null`),
    // Serves jobEnqueue's ON CONFLICT: one job per idempotency key.
    uniqueIndex('jobs_idempotency_key_uq')
      .on(t.idempotencyKey)
      .where(sql`${t.idempotencyKey} is not null`),
    // Serves the lists without a queue, status or agent filter (job-list.ts): newest first,
    // paged by (created_at, id), a time range bounding the scan.
    index('jobs_created_idx').on(t.createdAt.desc(), t.id.desc()),
    // Serve the lists of finished jobs (job-list.ts), newest first: of a queue, and the failed,
    // dead and canceled ones (a succeeded job has a result, the others none). Partial, so a job
    // takes an entry only when it finishes; neither holds a column that the start or a heartbeat
    // changes, so those stay HOT. Built CONCURRENTLY by migrate.ts (not by a migration), so a
    // database holding a week of history keeps taking writes while they build.
    index('jobs_finished_queue_idx')
      .on(t.queue, t.createdAt.desc(), t.id.desc())
      .where(sql`${t.finishedAt} is not null`),
    index('jobs_unsucceeded_idx')
      .on(t.createdAt.desc(), t.id.desc())
      .where(sql`${t.finishedAt} is not null and ${t.result} is null`),
    // Serve the attempts kept on their job's row (final_attempt_id): a late or repeated report
    // of a succeeded attempt, found by its id; and ListJobs by agent, newest job first, beside
    // attempts_agent_idx. Built CONCURRENTLY by migrate.ts.
    uniqueIndex('jobs_final_attempt_uq')
      .on(t.finalAttemptId)
      .where(sql`${t.finalAttemptId} is not null`),
    index('jobs_final_agent_idx')
      .on(t.finalAgentId, t.createdAt.desc(), t.id.desc())
      .where(sql`${t.finalAttemptId} is not null`),
    // Serves listing and purging finished jobs by age.
    index('jobs_finished_idx')
      .on(t.finishedAt)
      .where(sql`${t.finishedAt} is not null`),
    check('jobs_payload_object', sql`jsonb_typeof(${t.payload}) = 'object'`),
    check('jobs_max_attempts_positive', sql`${t.maxAttempts} > 0`),
    check(
      'jobs_held_has_attempt',
      sql`(${t.status} in ('claimed', 'running')) = (${t.currentAttemptId} is not null and ${t.leaseExpiresAt} is not null and ${t.agentId} is not null and ${t.claimedAt} is not null)`,
    ),
    check('jobs_queued_shape', sql`(${t.status} = 'queued') = (${t.currentAttemptId} is null and ${t.finishedAt} is null)`),
  ],
);

/** The columns of `jobs`, in order: a row moved between its partitions is inserted with all of them. */
export const JOB_COLUMNS = Object.values(getTableColumns(jobs)).map((c) => c.name);

/**
 * Finished jobs per queue and status, kept rather than counted: every statement that moves jobs
 * into a finished status or out of one (complete, fail, the reaper, cancel, requeue, purge,
 * seed-history) appends its change here, one row per queue and status it touched (`n` may be
 * negative). `jobCountsCompact` folds the rows into one per queue and status; the reads sum
 * them. Live jobs are counted from the small partial indexes that hold them. No key: writers
 * only append, so no two of them wait on one row (docs/decisions.md).
 */
export const jobCounts = pgTable('job_counts', {
  queue: text('queue').notNull(),
  status: jobStatus('status').notNull(),
  n: bigint('n', { mode: 'number' }).notNull(),
});

/**
 * What ended per minute (GetStats' per-minute counts and rates), kept rather than counted:
 * every statement that ends attempts or cancels queued jobs (complete, fail, the reaper, cancel,
 * seed-history) appends, per minute and kind it touched, how many (`endedCountSql`, counts.ts).
 * `kind` is what the counts show: completed, failed, retry_scheduled, dead, canceled,
 * claim_expired, lease_expired, timed_out. The count keeper folds the rows into one per minute
 * and kind and drops the minutes older than a day (the longest window). No key, as job_counts.
 */
export const endedCounts = pgTable(
  'ended_counts',
  {
    minute: tsz('minute').notNull(),
    kind: text('kind').notNull(),
    n: bigint('n', { mode: 'number' }).notNull(),
  },
  // GetStats reads its window's minutes (15 by default) of the day kept: without it, every row
  // of the day (8,635 at a busy day's end, 0.51 ms against 0.15 with it; docs/performance-history.md,
  // "Cost as the work grows").
  (t) => [index('ended_counts_minute_idx').on(t.minute)],
);

/**
 * Attempts that ended, one row each, written once by the statement that ended it (complete,
 * fail, the reaper, cancel): who held it, when it was claimed, started and ended, how it ended,
 * the error it reported (or the reaper recorded), and what became of the job. A live attempt is
 * in its `jobs` row. A success's result is the job's `result` (stored once).
 */
export const attempts = pgTable(
  'attempts',
  {
    /** The fencing token: 128 unpredictable bits (see jobClaimSlots), written as a UUID. */
    id: uuid('id').primaryKey(),
    /**
     * Its job. No foreign key: a row is written only by the statement that ends the attempt,
     * which holds the job's row (locked) as it writes, and `jobPurge` deletes it with its job.
     * The key's check cost every completion a lookup of the job it had just locked: 27 % of the
     * completion statement's time (docs/decisions.md).
     */
    jobId: uuid('job_id').notNull(),
    attemptNo: integer('attempt_no').notNull(),
    agentId: text('agent_id').notNull(),
    /** How it ended (never `claimed` or `running`: live attempts are in `jobs`). */
    status: attemptStatus('status').notNull(),
    claimedAt: tsz('claimed_at').notNull(),
    claimDeadline: tsz('claim_deadline').notNull(),
    startedAt: tsz('started_at'),
    endedAt: tsz('ended_at').notNull(),
    /** Its agent's stream was lost while it held the attempt (and it was not resumed since). */
    suspectSince: tsz('suspect_since'),
    /** The failure it reported (`failed`), or the reaper's account (`lease_expired`, `timed_out`). */
    error: jsonb('error'),
    /** For a reported failure: whether the agent asked for a retry. */
    retryable: boolean('retryable'),
    /** The job's status once this attempt ended: queued again, or terminal. */
    jobStatus: jobStatus('job_status').notNull(),
    /** When the job was queued again with a new due time (a retry's backoff), that time. */
    runAt: tsz('run_at'),
    /**
     * Its place in the history of its job, from the sequence that numbers `job_events` (taken
     * when the attempt ends): attempts and events in this order are the job's transitions in the
     * order they happened, whatever the clocks said.
     */
    seq: bigint('seq', { mode: 'number' })
      .notNull()
      .default(sql`nextval('job_events_id_seq')`),
    /**
     * When its job was created (the job's `created_at`, which never changes): the lists of an
     * agent's jobs are newest job first, read from `attempts_agent_idx` in that order.
     * NULL only for an attempt ended by a coordinator older than migration 0014.
     */
    jobCreatedAt: tsz('job_created_at'),
  },
  (t) => [
    // Serves a job's attempts in order (GetJob, the explanation of a repeat) and the purge's
    // delete of a job's attempts; unique, so an attempt number is used once.
    uniqueIndex('attempts_job_attempt_no_uq').on(t.jobId, t.attemptNo),
    // Serves the per-minute counts of GetStats: rows are written when attempts end, so in
    // ended_at order, and a BRIN index finds the last minutes for next to nothing.
    // autosummarize: a page range is summarized as soon as it fills (an autovacuum work item);
    // without it only VACUUM summarizes, which on a large table waits for ~20 % new rows, and
    // until then every read of recent minutes scans all the pages written since (290 ms after a
    // million seeded jobs, 2.4 ms summarized).
    index('attempts_ended_brin').using('brin', t.endedAt).with({ autosummarize: 'on' }),
    // Serves ListJobs by agent: an agent's ended attempts, newest job first (job-list.ts). Built
    // CONCURRENTLY by migrate.ts, like the lists' indexes on jobs.
    index('attempts_agent_idx').on(t.agentId, t.jobCreatedAt.desc(), t.jobId.desc()),
    // The attempts still without their job's creation time (ended before migration 0014, or by an
    // older coordinator since), for migrate.ts to fill in by batches; empty once it has.
    index('attempts_created_missing_idx')
      .on(t.id)
      .where(sql`${t.jobCreatedAt} is null`),
    check('attempts_ended', sql`${t.status} not in ('claimed', 'running')`),
  ],
);

/**
 * Idempotency keys, one row per keyed job for as long as the job is kept (migration 0019): the
 * enqueue inserts the key here and the job only if the key was free, in one statement. A key
 * cannot be kept unique by an index on `jobs` once finished jobs are in partitions of their own
 * (PostgreSQL's unique indexes on a partitioned table must hold the partition key). The purge
 * deletes a key with its job.
 */
export const jobKeys = pgTable('job_keys', {
  key: text('key').primaryKey(),
  /** Its job. No foreign key: see `JOB_REFERENCES` (written by the enqueue that inserts the job). */
  jobId: uuid('job_id').notNull(),
});

/** Agents that may connect: the token is shown once at creation and stored as a SHA-256 hash. */
export const agents = pgTable(
  'agents',
  {
    id: text('id').primaryKey(),
    tokenHash: text('token_hash').notNull(),
    createdAt: tsz('created_at').notNull().defaultNow(),
    revokedAt: tsz('revoked_at'),
    lastSeenAt: tsz('last_seen_at'),
  },
  (t) => [
    // Serves authenticating a token (Hello, stream-less calls).
    uniqueIndex('agents_token_hash_uq').on(t.tokenHash),
  ],
);


/**
 * Keys of gateway callers (`Authorization: Bearer <key>`): shown once at creation, stored as
 * the SHA-256 of the key, revoked by stamping `revoked_at`. A key with the `agent` scope acts as
 * the agent named like the key.
 */
export const apiKeys = pgTable(
  'api_keys',
  {
    name: text('name').primaryKey(),
    keyHash: text('key_hash').notNull(),
    scopes: text('scopes').array().notNull(),
    createdAt: tsz('created_at').notNull().defaultNow(),
    revokedAt: tsz('revoked_at'),
    /** Stamped at most once a minute, so authenticating is not a write per request. */
    lastUsedAt: tsz('last_used_at'),
  },
  (t) => [
    // Serves keyAuthenticate: a key is looked up by its SHA-256 hash.
    uniqueIndex('api_keys_key_hash_uq').on(t.keyHash),
    check(
      'api_keys_scopes_known',
      sql`cardinality(${t.scopes}) > 0 and ${t.scopes} <@ array['enqueue', 'read', 'agent', 'admin']::text[]`,
    ),
  ],
);

export const webhookEventType = pgEnum('webhook_event_type', WEBHOOK_EVENT_TYPES);

/**
 * Per-queue subscriptions (`queue = '*'`: every queue) to some of the events. Each has its own
 * signing secret, kept in clear because the coordinator signs with it.
 */
export const subscriptions = pgTable(
  'subscriptions',
  {
    id: uuid('id').primaryKey().defaultRandom(),
    queue: text('queue').notNull(),
    url: text('url').notNull(),
    events: webhookEventType('events').array().notNull(),
    secret: text('secret').notNull(),
    createdAt: tsz('created_at').notNull().defaultNow(),
  },
  (t) => [
    // Serves the outbox CTE of every terminal transition (subscriptions of the job's queue and
    // of '*'), and makes one URL subscribe to one queue once.
    uniqueIndex('subscriptions_queue_url_uq').on(t.queue, t.url),
    check('subscriptions_events_not_empty', sql`cardinality(${t.events}) > 0`),
  ],
);

/**
 * Terminal events of jobs that someone listens to (and every `job.dead`, which is an alert),
 * written by the transition's own statement: the body is rendered there, once, so every
 * delivery and retry sends the same bytes.
 */
export const webhookEvents = pgTable(
  'webhook_events',
  {
    id: uuid('id').primaryKey(),
    /** Its job. No foreign key: see `JOB_REFERENCES` (written by the job's transition, which locks its row). */
    jobId: uuid('job_id').notNull(),
    type: webhookEventType('type').notNull(),
    /** The JSON body sent to every target, exactly these bytes (the signature covers them). */
    body: text('body').notNull(),
    createdAt: tsz('created_at').notNull(),
    /** When the alert of a `job.dead` event was raised (log line, alert URL). */
    alertedAt: tsz('alerted_at'),
  },
  (t) => [
    // Serves the deliverer's alert scan: dead-letter events not alerted yet.
    index('webhook_events_unalerted_idx')
      .on(t.createdAt)
      .where(sql`${t.type} = 'job.dead' and ${t.alertedAt} is null`),
    index('webhook_events_job_idx').on(t.jobId),
  ],
);

/** Where a delivery stands: `sending` while a deliverer holds its claim. */
export const deliveryStatus = pgEnum('delivery_status', DELIVERY_STATUSES);

/** The delivery outbox: one row per event and target URL, sent by the webhook deliverer. */
export const webhookDeliveries = pgTable(
  'webhook_deliveries',
  {
    id: bigint('id', { mode: 'number' }).primaryKey().generatedAlwaysAsIdentity(),
    eventId: uuid('event_id')
      .notNull()
      .references(() => webhookEvents.id, { onDelete: 'cascade' }),
    /** The subscription it is for; null for a job's notify_url and the alert URL (signed with the secret of the URL: a subscribed URL's, else the notify secret). */
    subscriptionId: uuid('subscription_id').references(() => subscriptions.id, { onDelete: 'cascade' }),
    url: text('url').notNull(),
    status: deliveryStatus('status').notNull().default('pending'),
    /** Sends tried so far (a claim counts one); at the cap a failed send moves it to `failed`. */
    attempts: integer('attempts').notNull().default(0),
    nextAttemptAt: tsz('next_attempt_at').notNull().defaultNow(),
    /** The fence of the deliverer that holds it while `sending`. */
    claimId: uuid('claim_id'),
    /** A claim still `sending` past this is taken back by the reconciliation sweep. */
    claimedUntil: tsz('claimed_until'),
    lastStatus: integer('last_status'),
    lastError: text('last_error'),
    createdAt: tsz('created_at').notNull().defaultNow(),
    updatedAt: tsz('updated_at').notNull().defaultNow(),
    deliveredAt: tsz('delivered_at'),
  },
  (t) => [
    // Serves deliveryClaim: due pending deliveries, oldest first (FOR UPDATE SKIP LOCKED).
    index('webhook_deliveries_due_idx')
      .on(t.nextAttemptAt)
      .where(sql`${t.status} = 'pending'`),
    // Serves deliveryReclaimExpired (the reconciliation sweep): claims that outlived their deliverer.
    index('webhook_deliveries_sending_idx')
      .on(t.claimedUntil)
      .where(sql`${t.status} = 'sending'`),
    // Serves listing an event's deliveries, and the failed ones for operators.
    index('webhook_deliveries_event_idx').on(t.eventId),
    index('webhook_deliveries_failed_idx')
      .on(t.updatedAt)
      .where(sql`${t.status} = 'failed'`),
    check(
      'webhook_deliveries_sending_has_claim',
      sql`(${t.status} = 'sending') = (${t.claimId} is not null and ${t.claimedUntil} is not null)`,
    ),
  ],
);

/**
 * A header a job's notify_url deliveries carry (given at enqueue), so that a receiver without
 * HMAC (an n8n Wait node with Header Auth) can check them. A table of its own, so that no read of
 * a job (`jobs.*`) can ever carry the secret; deleted with its job.
 */
export const notifyHeaders = pgTable('notify_headers', {
  /** Its job. No foreign key: see `JOB_REFERENCES` (written by the enqueue that inserts the job). */
  jobId: uuid('job_id').primaryKey(),
  name: text('name').notNull(),
  value: text('value').notNull(),
});

/** Secrets of the coordinator itself; `notify` signs deliveries to URLs no subscription names (notify_url, the alert URL). */
export const signingSecrets = pgTable('signing_secrets', {
  name: text('name').primaryKey(),
  secret: text('secret').notNull(),
  createdAt: tsz('created_at').notNull().defaultNow(),
});

/** Transitions no attempt makes: an operator's requeue, and the cancel of a queued job. */
export const jobEvents = pgTable(
  'job_events',
  {
    id: bigint('id', { mode: 'number' }).primaryKey().generatedAlwaysAsIdentity(),
    /** Its job. No foreign key: see `JOB_REFERENCES` (written by a requeue or cancel, which locks its row). */
    jobId: uuid('job_id').notNull(),
    attemptId: uuid('attempt_id'),
    kind: eventKind('kind').notNull(),
    at: tsz('at').notNull(),
    /** The columns of `jobs` this transition set, by column name. */
    data: jsonb('data').notNull(),
  },
  (t) => [
    // Serves jobGet's history, the rebuild of a job from its history and the purge's delete.
    index('job_events_job_idx').on(t.jobId, t.id),
    // Serves the per-minute counts of GetStats (cancels of queued jobs by time).
    index('job_events_at_brin').using('brin', t.at).with({ autosummarize: 'on' }),
  ],
);

export const steps = pgTable(
  'steps',
  {
    /** Its job. No foreign key: see `JOB_REFERENCES` (written under the fence's FOR SHARE on its row). */
    jobId: uuid('job_id').notNull(),
    step: text('step').notNull(),
    status: stepStatus('status').notNull(),
    /** The attempt holding the reservation, or the one that recorded the outcome. */
    attemptId: uuid('attempt_id').notNull(),
    /** The attempt whose reservation this one took over (its outcome was unknown). */
    previousAttemptId: uuid('previous_attempt_id'),
    output: jsonb('output'),
    /** How many attempts have reserved this step: more than one means an outcome was once unknown. */
    reservations: integer('reservations').notNull().default(1),
    startedAt: tsz('started_at').notNull(),
    finishedAt: tsz('finished_at'),
  },
  (t) => [primaryKey({ columns: [t.jobId, t.step] })],
);

export const staleReports = pgTable(
  'stale_reports',
  {
    id: bigint('id', { mode: 'number' }).primaryKey().generatedAlwaysAsIdentity(),
    /** Its job. No foreign key: see `JOB_REFERENCES` (written with FOR KEY SHARE on its row). */
    jobId: uuid('job_id').notNull(),
    /** The attempt that made the late call. */
    attemptId: uuid('attempt_id').notNull(),
    agentId: text('agent_id'),
    call: text('call', { enum: ['start', 'heartbeat', 'complete', 'fail', 'step'] }).notNull(),
    /** The job's current attempt at the time of the call, if it had one. */
    currentAttemptId: uuid('current_attempt_id'),
    currentAttemptNo: integer('current_attempt_no').notNull(),
    currentStatus: jobStatus('current_status').notNull(),
    at: tsz('at').notNull(),
  },
  (t) => [
    // Serves listing stale reports newest first, and a job's own reports.
    index('stale_reports_at_idx').on(t.at),
    index('stale_reports_job_idx').on(t.jobId),
  ],
);

/**
 * The agent streams open on every coordinator (one row per session), so any replica can list
 * them. A coordinator inserts a row when a stream opens and deletes it when it closes, and
 * stamps `seen_at` on its rows every few seconds; rows not stamped for a while belong to a
 * coordinator that died, and any replica deletes them. What a session holds is read from
 * `attempts` (the truth), not kept here.
 */
export const agentSessions = pgTable(
  'agent_sessions',
  {
    /** The session id of `Welcome`. */
    id: uuid('id').primaryKey(),
    agentId: text('agent_id').notNull(),
    /** The coordinator process holding the stream (random at each start). */
    coordinatorId: uuid('coordinator_id').notNull(),
    queues: text('queues').array().notNull(),
    labels: jsonb('labels').notNull().default({}),
    slots: integer('slots').notNull(),
    connectedAt: tsz('connected_at').notNull(),
    /** Stamped by its coordinator while it lives. */
    seenAt: tsz('seen_at').notNull().defaultNow(),
    /** When an operator asked the agent to drain (DrainAgent). */
    drainingSince: tsz('draining_since'),
  },
  (t) => [
    // Serves listing an agent's sessions and draining them.
    index('agent_sessions_agent_idx').on(t.agentId),
    // Serves a coordinator stamping or removing its own rows.
    index('agent_sessions_coordinator_idx').on(t.coordinatorId),
  ],
);

/**
 * The schema's compatibility with releases that read it: one row, `min_reader`, the lowest reader
 * level a release must have to run on this database. A release's reader level is the number of
 * migrations it ships; a migration marked "breaks" in `migrations/compat.json` (or not marked at
 * all) raises it to its own number plus one. `migrateDatabase` raises it (never lowers it) after
 * applying migrations and sends NOTIFY `leasehold_schema`; every coordinator reads it at start and
 * while it runs (server/core/schema-watch.ts) and stops when it is above its own level.
 */
export const schemaCompat = pgTable(
  'schema_compat',
  {
    /** Always true: the key that keeps the table to one row. */
    one: boolean('one').primaryKey().default(true),
    minReader: integer('min_reader').notNull(),
  },
  (t) => [check('schema_compat_one_row', sql`${t.one}`)],
);

export type JobRow = typeof jobs.$inferSelect;
export type AttemptRow = typeof attempts.$inferSelect;
export type JobEventRow = typeof jobEvents.$inferSelect;
export type StepRow = typeof steps.$inferSelect;
export type StaleReportRow = typeof staleReports.$inferSelect;
export type AgentRow = typeof agents.$inferSelect;
export type AgentSessionRow = typeof agentSessions.$inferSelect;
export type ApiKeyRow = typeof apiKeys.$inferSelect;
export type SubscriptionRow = typeof subscriptions.$inferSelect;
export type WebhookDeliveryRow = typeof webhookDeliveries.$inferSelect;
