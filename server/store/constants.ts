/**
 * Value lists of the schema that the command line shows in its help, kept apart from
 * `schema.ts` so that the CLI can print them without loading Drizzle. `schema.ts` re-exports them.
 */

/** What an API key may do: `admin` implies `enqueue` and `read`, never `agent`. */
export const API_KEY_SCOPES = ['enqueue', 'read', 'agent', 'admin'] as const;

/** The notification events of DESIGN.md: one per terminal transition of a job. */
export const WEBHOOK_EVENT_TYPES = ['job.succeeded', 'job.failed', 'job.dead', 'job.canceled'] as const;

/** The statuses a job ends in: it leaves them only by an operator's requeue, or its purge. */
export const FINISHED_STATUSES = ['succeeded', 'failed', 'dead', 'canceled'] as const;
