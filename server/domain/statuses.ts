/**
 * The value lists of DESIGN.md: the states a job and an attempt go through, the reasons an
 * attempt is taken back, and the other closed vocabularies the store's enums, the transports and
 * the command line's help all quote. They live here, below the store, so that every layer reads
 * the same list and the CLI can print them without loading Drizzle; `store/schema.ts` builds its
 * PostgreSQL enums from them.
 */

/** Job states. `claimed` (holds a start deadline) and `running` (holds a lease) are the two held states. */
export const JOB_STATUSES = ['queued', 'claimed', 'running', 'succeeded', 'failed', 'dead', 'canceled'] as const;
export type JobStatus = (typeof JOB_STATUSES)[number];

/** The statuses a job ends in: it leaves them only by an operator's requeue, or its purge. */
export const FINISHED_STATUSES = ['succeeded', 'failed', 'dead', 'canceled'] as const satisfies readonly JobStatus[];

/** How an attempt ended, or that it has not ended yet (`claimed`, `running`). */
export const ATTEMPT_STATUSES = [
  'claimed',
  'running',
  'succeeded',
  'failed',
  'claim_expired',
  'lease_expired',
  'timed_out',
  'canceled',
] as const;
export type AttemptStatus = (typeof ATTEMPT_STATUSES)[number];

/** Why the reaper takes back an attempt it finds past a deadline: the attempt's status afterwards. */
export const RESCUE_REASONS = ['claim_expired', 'lease_expired', 'timed_out'] as const satisfies readonly AttemptStatus[];
export type RescueReason = (typeof RESCUE_REASONS)[number];

/**
 * The kinds of `job_events` rows. Only `requeued` and `canceled` (of a job no attempt held) are
 * written now; the others are from before attempts carried their own history (migration 0005).
 */
export const EVENT_KINDS = [
  'enqueued',
  'claimed',
  'started',
  'completed',
  'failed',
  'retry_scheduled',
  'claim_expired',
  'lease_expired',
  'timed_out',
  'dead',
  'canceled',
  'requeued',
] as const;
export type EventKind = (typeof EVENT_KINDS)[number];

/** A step of the effect ledger is `started` (reserved by an attempt, outcome unknown) or `done`. */
export const STEP_STATUSES = ['started', 'done'] as const;

/** What an API key may do: `admin` implies `enqueue` and `read`, never `agent`. */
export const API_KEY_SCOPES = ['enqueue', 'read', 'agent', 'admin'] as const;
export type ApiKeyScope = (typeof API_KEY_SCOPES)[number];

/** The notification events of DESIGN.md: one per terminal transition of a job. */
export const WEBHOOK_EVENT_TYPES = ['job.succeeded', 'job.failed', 'job.dead', 'job.canceled'] as const;
export type WebhookEventType = (typeof WEBHOOK_EVENT_TYPES)[number];

/** Where a webhook delivery stands: `sending` while a deliverer holds its claim. */
export const DELIVERY_STATUSES = ['pending', 'sending', 'delivered', 'failed'] as const;
export type DeliveryStatus = (typeof DELIVERY_STATUSES)[number];
