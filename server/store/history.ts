/**
 * Seeded history: finished jobs written in bulk with exactly the rows the real transitions leave
 * behind, for measuring what operators' reads cost as history grows (`npm run seed:history`,
 * `server/seed-history.ts`). Nothing here runs in the coordinator.
 *
 * One chunk is one transaction: a temporary table gets one row per attempt (and one for a job
 * canceled before any attempt), drawn with `random()` from `generate_series` and timed in whole
 * microseconds so that every time adds up exactly; then each table is filled from it by one
 * INSERT … SELECT. What each row holds, and which transition writes it for real:
 *
 * - `jobs`: the row as the last transition left it (complete, fail, the reaper's dead letter,
 *   cancel), a success's in the partition of its day: `current_attempt_id`, the lease and the
 *   live attempt's columns NULL, `finished_at`
 *   and `updated_at` the end, `run_at` the last retry's due time (else the enqueue time),
 *   `heartbeat_at` the last attempt's last heartbeat (no transition clears it), `result` only
 *   when it succeeded. Inserted in `created_at` order, as enqueues append them.
 * - `attempts`: one per attempt that did not succeed, as `attemptEndSql` writes it when the
 *   attempt ends (fail, the reaper, cancel), in `ended_at` order with `seq` from
 *   `job_events_id_seq`, as real ends append them (attempts_ended_brin relies on that order). A
 *   success's attempt is on its job's row (`final_*`), as the completion keeps it.
 * - `job_events`: a `canceled` event for a job canceled while queued (no attempt made it).
 * - `steps`: the step ledger of the jobs whose agent used `ctx.step`, recorded by the last attempt.
 * - `webhook_events`: what `outboxSql` writes: a `job.dead` event for every dead letter (its
 *   alert raised, as the deliverer would have), and an event for every end of a job with a
 *   `notify_url`; `webhook_deliveries`: that URL's delivery, delivered at the first try.
 *
 * The statements take the mix as parameters; `server/seed-history.ts` chooses it and explains it.
 */
import { attemptIdSql } from './claim.js';
import { countChangeSql, endedCountSql, endedCutoff, endedKindSql } from './counts.js';
import { run, statement, withTransaction, type Queryable } from './sql.js';

/** Outcomes of a seeded job: `retried` succeeded after one or two retries. */
export const HISTORY_OUTCOMES = ['succeeded', 'retried', 'failed', 'dead', 'canceled'] as const;
export type HistoryOutcome = (typeof HISTORY_OUTCOMES)[number];

/** The shares of a seeded mix (fractions of all jobs, of canceled ones, of retried and dead ones). */
export interface HistoryShares {
  /** Shares of jobs with an idempotency key, required labels, a notify_url, recorded steps. */
  keyShare: number;
  labelShare: number;
  notifyShare: number;
  stepShare: number;
  /** Of canceled jobs, the share canceled while queued (the rest while running). */
  canceledQueuedShare: number;
  /** Of retried and dead jobs, the share whose attempts lost their lease (the rest reported failures). */
  leaseLostShare: number;
}

/** One chunk of seeded jobs: which, over what time, and in what mix. */
export interface HistoryChunkParams extends HistoryShares {
  /** Number (1-based) of the chunk's first job among all `total`, and how many it holds. */
  first: number;
  count: number;
  total: number;
  /** Jobs finish uniformly over `[end − spanMs, end]`, job `n` of `total` at about `n/total` of the way. */
  end: Date;
  spanMs: number;
  /** Queue names and their shares (summing to 1). */
  queues: Array<{ name: string; share: number }>;
  /** Outcomes and their shares (summing to 1). */
  outcomes: Array<{ outcome: HistoryOutcome; share: number }>;
  /** Agents that run the attempts; the first `labeledAgents` carry the labels a labeled job requires. */
  agents: string[];
  labeledAgents: number;
  /** The labels a labeled job requires. */
  labels: Record<string, string>;
  maxAttempts: number;
  claimTtlMs: number;
  leaseTtlMs: number;
  heartbeatIntervalMs: number;
  /** Unique per seeding run: makes its idempotency keys unique among every run's. */
  runId: string;
}

/** Rows a chunk wrote, per table. */
export interface HistoryChunkCounts {
  jobs: number;
  attempts: number;
  jobEvents: number;
  steps: number;
  webhookEvents: number;
  webhookDeliveries: number;
}

// A duration in whole microseconds: log-uniform between lo and hi milliseconds, or uniform.
const logUs = (lo: number, hi: number) => `round(exp(ln(${lo}) + random() * (ln(${hi}) - ln(${lo}))) * 1000)::int8`;
const uniUs = (lo: string | number, hi: string | number) => `round((${lo} + random() * (${hi} - ${lo})) * 1000)::int8`;
const us = (x: string) => `(${x}) * interval '1 microsecond'`;

const stageCreateSql = statement(
  'historyStageCreate',
  `CREATE TEMP TABLE history_stage (
     n int8, job_id uuid, queue text, attempts int4, k int4, last boolean, how text, job_status text, after text,
     agent_id text, attempt_id uuid, created_at timestamptz, claimed_at timestamptz, started_at timestamptz,
     ended_at timestamptz, heartbeat_at timestamptz, suspect_since timestamptz, retry_at timestamptz, job_run_at timestamptz,
     finished_at timestamptz, work_us int8, error jsonb, retryable boolean, payload jsonb, result jsonb,
     idempotency_key text, labels jsonb, notify_url text, has_steps boolean, event_id uuid
   ) ON COMMIT DROP`,
);

// Parameters: $1 first, $2 last, $3 total, $4 end, $5 span (µs), $6 queue names, $7 their lower
// bounds in [0, 1), $8 outcomes, $9 their lower bounds, $10–$13 key, label, notify and step
// shares, $14 canceled-while-queued share, $15 lease-lost share, $16 agents, $17 labeled agents,
// $18 labels, $19 max attempts, $20 lease TTL, $21 heartbeat interval (ms), $22 run id.
//
// j draws each job's fate; s unrolls it into attempts and says how each ended; d draws the
// durations (µs) of each attempt: the wait before it (queue wait for the first), claim to start,
// start to end, and for one that goes back to the queue the backoff and the dispatch after. The
// CTEs that draw are MATERIALIZED, so each draw is made once however often it is read. w adds
// the durations up per job (its rows in attempt order): the job ends at its drawn time and was
// enqueued their total before; t and r turn the sums into each attempt's times.
const stageFillSql = statement(
  'historyStageFill',
  `INSERT INTO history_stage
   WITH e AS MATERIALIZED (
     SELECT g, round($5::float8 * (1 - (g - 1 + random()) / $3::float8))::int8 AS before_end_us
     FROM generate_series($1::int8, $2::int8) g
   ), j AS MATERIALIZED (
     -- Job ids as the coordinator makes them (time-ordered), of the job's time: its end (its
     -- creation, a few seconds before, is drawn below).
     SELECT g AS n, job_id_v7($4::timestamptz - ${us('before_end_us')}) AS job_id, before_end_us,
       ($6::text[])[width_bucket(random(), $7::float8[])] AS queue,
       ($8::text[])[width_bucket(random(), $9::float8[])] AS outcome,
       random() < $10::float8 AS has_key, random() < $11::float8 AS has_labels, random() < $12::float8 AS has_notify,
       random() < $13::float8 AS has_steps, random() < $14::float8 AS canceled_queued, random() < $15::float8 AS lease_lost,
       random() < 0.5 AS twice
     FROM e
   ), f AS (
     SELECT j.*,
       CASE j.outcome WHEN 'retried' THEN least(2 + j.twice::int, $19::int) WHEN 'dead' THEN $19::int
                      WHEN 'canceled' THEN CASE WHEN j.canceled_queued THEN 0 ELSE 1 END ELSE 1 END AS attempts,
       CASE j.outcome WHEN 'retried' THEN 'succeeded' ELSE j.outcome END AS job_status
     FROM j
   ), s AS MATERIALIZED (
     SELECT f.*, k, k = greatest(f.attempts, 1) AS last,
       CASE WHEN f.attempts = 0 THEN NULL
            WHEN k < f.attempts OR f.outcome = 'dead' THEN CASE WHEN f.lease_lost THEN 'lease_expired' ELSE 'failed' END
            WHEN f.outcome = 'canceled' THEN 'canceled'
            WHEN f.outcome = 'failed' THEN 'failed'
            ELSE 'succeeded' END AS how,
       CASE WHEN f.attempts = 0 THEN NULL
            WHEN f.has_labels THEN ($16::text[])[1 + floor(random() * $17::int)::int]
            ELSE ($16::text[])[1 + floor(random() * cardinality($16::text[]))::int] END AS agent_id
     FROM f CROSS JOIN LATERAL generate_series(1, greatest(f.attempts, 1)) k
   ), d AS MATERIALIZED (
     SELECT s.*,
       CASE WHEN s.k = 1 AND s.attempts > 0 THEN ${logUs(2, 2000)} ELSE 0 END AS wait_us,
       CASE WHEN s.attempts > 0 THEN ${uniUs(1, 50)} ELSE 0 END AS start_us,
       -- Working: until the end it reported, or until the heartbeat after which its agent vanished.
       CASE WHEN s.attempts = 0 THEN 0
            WHEN s.how = 'lease_expired' THEN floor(random() * 6)::int8 * $21::int8 * 1000
            ELSE ${logUs(5, 5000)} END AS work_us,
       -- A lost lease ends a lease TTL after the last heartbeat, when the reaper (every second) sees it.
       CASE WHEN s.how = 'lease_expired' THEN $20::int8 * 1000 + ${uniUs(0, 1000)}
            WHEN s.attempts = 0 THEN ${logUs(50, 30000)} ELSE 0 END AS tail_us,
       CASE WHEN NOT s.last AND s.how = 'failed'
            THEN round(least(1000 * power(2, s.k - 1), 3600000) * (0.5 + random() * 0.5) * 1000)::int8 ELSE 0 END AS backoff_us,
       CASE WHEN NOT s.last THEN ${uniUs(1, 100)} ELSE 0 END AS dispatch_us,
       ${uniUs(0, '$21::float8')} AS drop_us
     FROM s
   ), w AS (
     SELECT d.*, d.wait_us + d.start_us + d.work_us + d.tail_us + d.backoff_us + d.dispatch_us AS span_us,
       (sum(d.wait_us + d.start_us + d.work_us + d.tail_us + d.backoff_us + d.dispatch_us) OVER (PARTITION BY d.n ORDER BY d.k))::int8 AS upto_us,
       (sum(d.wait_us + d.start_us + d.work_us + d.tail_us + d.backoff_us + d.dispatch_us) OVER (PARTITION BY d.n))::int8 AS total_us
     FROM d
   ), t AS (
     SELECT w.*, $4::timestamptz - ${us('w.before_end_us')} AS finished_at,
       $4::timestamptz - ${us('w.before_end_us + w.total_us')} AS created_at,
       w.upto_us - w.span_us + w.wait_us AS claimed_us,
       CASE WHEN w.backoff_us > 0 THEN w.upto_us - w.dispatch_us END AS retry_us
     FROM w
   ), r AS (
     SELECT t.*, lag(t.retry_us) OVER (PARTITION BY t.n ORDER BY t.k) AS previous_retry_us FROM t
   )
   SELECT r.n, r.job_id, r.queue, r.attempts, r.k, r.last, r.how, r.job_status,
     CASE WHEN r.last THEN r.job_status ELSE 'queued' END,
     r.agent_id,
     -- Its attempt id as the claim makes them: in claim-time order (claim.ts, attemptIdSql).
     CASE WHEN r.attempts > 0 THEN ${attemptIdSql(`r.created_at + ${us('r.claimed_us')}`, 'uuid_send(gen_random_uuid())')} END,
     r.created_at,
     CASE WHEN r.attempts > 0 THEN r.created_at + ${us('r.claimed_us')} END,
     CASE WHEN r.attempts > 0 THEN r.created_at + ${us('r.claimed_us + r.start_us')} END,
     CASE WHEN r.attempts > 0 THEN r.created_at + ${us('r.claimed_us + r.start_us + r.work_us + r.tail_us')} END,
     -- Heartbeats every interval from the start (which stamps the first).
     CASE WHEN r.attempts > 0 THEN r.created_at + ${us('r.claimed_us + r.start_us + (r.work_us / ($21::int8 * 1000)) * $21::int8 * 1000')} END,
     -- A lease is lost when the agent's stream is: the attempt was marked suspect before the lease ran out.
     CASE WHEN r.how = 'lease_expired' THEN r.created_at + ${us('r.claimed_us + r.start_us + r.work_us + r.drop_us')} END,
     CASE WHEN r.retry_us IS NOT NULL THEN r.created_at + ${us('r.retry_us')} END,
     CASE WHEN r.last AND r.previous_retry_us IS NOT NULL THEN r.created_at + ${us('r.previous_retry_us')} END,
     r.finished_at, r.work_us,
     CASE r.how
       WHEN 'failed' THEN (ARRAY['{"message": "upstream answered 503", "code": "E_UPSTREAM"}', '{"message": "connection reset by peer", "code": "E_NETWORK"}',
                                 '{"message": "invalid input: missing field", "code": "E_INPUT"}', '{"message": "timed out after 30 s", "code": "E_TIMEOUT"}']::jsonb[])[1 + floor(random() * 4)::int]
       WHEN 'lease_expired' THEN jsonb_build_object('message', 'lease expired: no heartbeat from the agent', 'reason', 'lease_expired',
                                                    'attemptNo', r.k, 'agentId', r.agent_id)
     END,
     CASE WHEN r.how = 'failed' THEN NOT (r.last AND r.job_status = 'failed') END,
     jsonb_build_object('n', r.n, 'item', 'item-' || (r.n % 1000)),
     CASE WHEN r.last AND r.job_status = 'succeeded' THEN jsonb_build_object('ok', true, 'ms', r.work_us / 1000) END,
     CASE WHEN r.has_key THEN r.queue || ':' || $22::text || ':' || r.n END,
     CASE WHEN r.has_labels THEN $18::jsonb ELSE '{}'::jsonb END,
     CASE WHEN r.has_notify THEN 'https://n8n.example.com/webhook-waiting/' || $22::text || '-' || r.n END,
     r.has_steps AND r.attempts > 0,
     CASE WHEN r.last AND (r.has_notify OR r.job_status = 'dead') THEN gen_random_uuid() END
   FROM r`,
);

// The jobs rows as their last transition left them, in enqueue order; a success's attempt on its
// job's row, as the completion keeps it ($2: the claim TTL), and the row in the partition of the
// day it finished (server/store/days.ts; seed-history.ts makes the partitions first).
const jobsSql = statement(
  'historyJobs',
  `INSERT INTO jobs (id, queue, payload, priority, status, run_at, max_attempts, attempt_no, attempts_started, heartbeat_at,
                     idempotency_key, labels, result, notify_url, created_at, updated_at, finished_at,
                     final_attempt_id, final_agent_id, final_claimed_at, final_claim_deadline, final_started_at, final_suspect_since, done_day)
   SELECT job_id, queue, payload, 0, job_status::job_status, coalesce(job_run_at, created_at), $1::int, attempts, attempts,
     CASE WHEN attempts > 0 THEN heartbeat_at END, idempotency_key, labels, result, notify_url, created_at, finished_at, finished_at,
     f.*, (finished_at AT TIME ZONE 'UTC')::date
   FROM history_stage
   LEFT JOIN LATERAL (
     SELECT attempt_id, agent_id, claimed_at, claimed_at + make_interval(secs => $2::float8 / 1000.0), started_at, suspect_since
     WHERE how = 'succeeded'
   ) f ON true
   WHERE last
   ORDER BY created_at`,
);

// Every seeded job is finished: the kept counts gain them (counts.ts).
const countsSql = statement('historyCounts', countChangeSql('SELECT queue, job_status::job_status, 1 FROM history_stage WHERE last'));

// What GetStats counts of them (the attempts and cancels of the kept minutes), as the transitions append it.
const endedSql = statement(
  'historyEnded',
  endedCountSql(`SELECT ended_at, ${endedKindSql('how', 'after')} FROM history_stage WHERE attempts > 0 AND ended_at >= ${endedCutoff}
    UNION ALL
    SELECT finished_at, 'canceled' FROM history_stage WHERE attempts = 0 AND finished_at >= ${endedCutoff}`),
);

// As attemptEndSql writes them, in the order they ended (seq: its default, in that order); not
// a success's, which its job's row keeps.
const attemptsSql = statement(
  'historyAttempts',
  `INSERT INTO attempts (id, job_id, attempt_no, agent_id, claimed_at, claim_deadline, started_at, ended_at, suspect_since,
                         status, error, retryable, job_status, run_at, job_created_at)
   SELECT attempt_id, job_id, k, agent_id, claimed_at, claimed_at + make_interval(secs => $1::float8 / 1000.0), started_at, ended_at,
     suspect_since, how::attempt_status, error, retryable, after::job_status, retry_at, created_at
   FROM history_stage WHERE attempts > 0 AND how <> 'succeeded'
   ORDER BY ended_at`,
);

// The keys of the keyed jobs, as the enqueue takes them (schema.ts, job_keys).
const keysSql = statement(
  'historyKeys',
  `INSERT INTO job_keys (key, job_id) SELECT idempotency_key, job_id FROM history_stage WHERE last AND idempotency_key IS NOT NULL`,
);

// jobCancel of a queued job: its event holds the columns the cancel set (job_event_delta).
const eventsSql = statement(
  'historyEvents',
  `INSERT INTO job_events (job_id, kind, at, data)
   SELECT job_id, 'canceled', finished_at, jsonb_build_object('status', 'canceled', 'finished_at', finished_at)
   FROM history_stage WHERE attempts = 0
   ORDER BY finished_at`,
);

// stepReserve then stepRecord by the last attempt: a step of its work's first half, and for a
// success a second one after it.
const stepsSql = statement(
  'historySteps',
  `INSERT INTO steps (job_id, step, status, attempt_id, output, reservations, started_at, finished_at)
   SELECT h.job_id, x.step, 'done', h.attempt_id, jsonb_build_object('ok', true, 'ref', x.step || '-' || h.n), 1,
     h.started_at + ${us('(h.work_us * x.a)::int8')}, h.started_at + ${us('(h.work_us * x.b)::int8')}
   FROM history_stage h
   CROSS JOIN LATERAL (VALUES ('fetch', 0.1, 0.4), ('deliver', 0.5, 0.9)) AS x(step, a, b)
   WHERE h.last AND h.has_steps AND (x.step = 'fetch' OR h.how = 'succeeded')`,
);

// outboxSql: the event of the job's end, its body rendered once by webhook_event_body from the
// job (with its error) and the attempt that ended it; a dead letter's alert raised by the
// deliverer's next run. The arguments come from a MATERIALIZED CTE, as in outboxSql: given
// column references, PostgreSQL inlines the function (given expressions it calls it per row, ~7
// times slower).
const webhookEventsSql = statement(
  'historyWebhookEvents',
  `WITH e AS MATERIALIZED (
     SELECT h.event_id, h.job_id, 'job.' || h.job_status AS type, h.finished_at AS at,
       jsonb_build_object('id', h.job_id, 'queue', h.queue, 'status', h.job_status, 'payload', h.payload, 'priority', 0,
         'attempt_no', h.attempts, 'attempts_started', h.attempts, 'max_attempts', $1::int, 'idempotency_key', h.idempotency_key,
         'labels', h.labels, 'result', h.result, 'error', CASE WHEN h.job_status <> 'succeeded' THEN h.error END,
         'notify_url', h.notify_url, 'created_at', h.created_at, 'finished_at', h.finished_at) AS job,
       CASE WHEN h.attempts > 0 THEN jsonb_build_object('id', h.attempt_id, 'attempt_no', h.k, 'agent_id', h.agent_id, 'status', h.how,
         'claimed_at', h.claimed_at, 'started_at', h.started_at, 'ended_at', h.ended_at) END AS attempt
     FROM history_stage h WHERE h.event_id IS NOT NULL
   )
   INSERT INTO webhook_events (id, job_id, type, body, created_at, alerted_at)
   SELECT e.event_id, e.job_id, e.type::webhook_event_type, webhook_event_body(e.event_id, e.type, e.at, e.job, e.attempt), e.at,
     CASE WHEN e.type = 'job.dead' THEN e.at + ${us(uniUs(5, 500))} END
   FROM e
   ORDER BY e.at`,
);

// The notify_url's delivery: claimed, sent and marked delivered at the first try (deliveryClaim,
// deliveryFinish), its due time the event's.
const deliveriesSql = statement(
  'historyWebhookDeliveries',
  `INSERT INTO webhook_deliveries (event_id, url, status, attempts, next_attempt_at, last_status, created_at, updated_at, delivered_at)
   SELECT x.event_id, x.notify_url, 'delivered', 1, x.finished_at, 200, x.finished_at, x.sent, x.sent
   FROM (SELECT h.event_id, h.notify_url, h.finished_at, h.finished_at + ${us(uniUs(20, 800))} AS sent
         FROM history_stage h WHERE h.event_id IS NOT NULL AND h.notify_url IS NOT NULL) x
   ORDER BY x.finished_at`,
);

/** Lower bounds of consecutive shares in [0, 1), for `width_bucket`. */
function lowerBounds(shares: number[]): number[] {
  const out: number[] = [];
  let sum = 0;
  for (const s of shares) {
    out.push(sum);
    sum += s;
  }
  return out;
}

async function rowCount(db: Queryable, stmt: { name: string; text: string }, values: unknown[]): Promise<number> {
  const r = await db.query({ name: stmt.name, text: stmt.text, values });
  return r.rowCount ?? 0;
}

/** Writes one chunk of finished jobs and their history, in one transaction. */
export async function historyChunkInsert(db: Queryable, p: HistoryChunkParams): Promise<HistoryChunkCounts> {
  const queues = p.queues.filter((q) => q.share > 0);
  const outcomes = p.outcomes.filter((o) => o.share > 0);
  return withTransaction(db, async (tx) => {
    // The window sums sort a chunk's attempts: in memory rather than in temporary files.
    await tx.query(`SET LOCAL work_mem = '256MB'`);
    await run(tx, stageCreateSql, []);
    await rowCount(tx, stageFillSql, [
      p.first,
      p.first + p.count - 1,
      p.total,
      p.end,
      p.spanMs * 1000,
      queues.map((q) => q.name),
      lowerBounds(queues.map((q) => q.share)),
      outcomes.map((o) => o.outcome),
      lowerBounds(outcomes.map((o) => o.share)),
      p.keyShare,
      p.labelShare,
      p.notifyShare,
      p.stepShare,
      p.canceledQueuedShare,
      p.leaseLostShare,
      p.agents,
      p.labeledAgents,
      JSON.stringify(p.labels),
      p.maxAttempts,
      p.leaseTtlMs,
      p.heartbeatIntervalMs,
      p.runId,
    ]);
    const jobs = await rowCount(tx, jobsSql, [p.maxAttempts, p.claimTtlMs]);
    await rowCount(tx, keysSql, []);
    await rowCount(tx, countsSql, []);
    await rowCount(tx, endedSql, []);
    return {
      jobs,
      attempts: await rowCount(tx, attemptsSql, [p.claimTtlMs]),
      jobEvents: await rowCount(tx, eventsSql, []),
      steps: await rowCount(tx, stepsSql, []),
      webhookEvents: await rowCount(tx, webhookEventsSql, [p.maxAttempts]),
      webhookDeliveries: await rowCount(tx, deliveriesSql, []),
    };
  });
}

const agentsSql = statement(
  'historyAgents',
  `INSERT INTO agents (id, token_hash, created_at, last_seen_at)
   SELECT a, encode(sha256(uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid())), 'hex'), $2, $3
   FROM unnest($1::text[]) a
   ON CONFLICT (id) DO NOTHING`,
);

/**
 * Registers the agents that ran the seeded attempts (as `agents add` would, created at `since`,
 * last seen at `seen`), with tokens nobody knows; agents that exist are left alone.
 */
export async function historyAgentsInsert(db: Queryable, p: { agents: string[]; since: Date; seen: Date }): Promise<number> {
  return rowCount(db, agentsSql, [p.agents, p.since, p.seen]);
}

/** The tables a seeding fills. */
export const HISTORY_TABLES = ['jobs', 'job_keys', 'attempts', 'job_events', 'steps', 'webhook_events', 'webhook_deliveries', 'agents'] as const;

/**
 * Refreshes the planner's statistics of the tables a seeding filled (`ANALYZE`), and with
 * `vacuum` (`VACUUM (ANALYZE)`) also what autovacuum would otherwise do later, in the middle of
 * whatever is measured next: the visibility maps (index-only scans), the hint bits (else the
 * first read of each page writes it), and the summaries of the BRIN indexes (attempts_ended_brin
 * and job_events_at_brin summarize new pages only on VACUUM: until then GetStats' per-minute
 * counts read every page of them).
 */
export async function historyAnalyze(db: Queryable, p: { vacuum?: boolean } = {}): Promise<void> {
  await db.query(`${p.vacuum ? 'VACUUM (ANALYZE)' : 'ANALYZE'} ${HISTORY_TABLES.join(', ')}`);
}

const dbNowSql = statement('historyNow', `SELECT now() AS now`);

/** The database's clock: seeded history ends here. */
export async function historyNow(db: Queryable): Promise<Date> {
  const [r] = await run<{ now: Date }>(db, dbNowSql, []);
  return r!.now;
}
