/**
 * The rows that belong to a job outside `jobs`: its idempotency key (`job_keys`), its ended
 * attempts (`attempts`), and the tables of `JOB_REFERENCES` (events, steps, stale reports, notify
 * header, webhook events, whose deliveries the events' cascade takes). None has a foreign key to
 * `jobs` (schema.ts), so whatever deletes jobs deletes these with them: the purge of a batch
 * (purge.ts, `jobPurge`) and the sweep of a dropped day (days.ts).
 */
import { JOB_REFERENCES } from './schema.js';

/** Every table `referencesDeleteSql` deletes from (webhook deliveries through the events' cascade). */
export const REFERENCE_TABLES = ['job_keys', 'attempts', ...JOB_REFERENCES, 'webhook_deliveries'] as const;

/**
 * CTEs (to follow others in a `WITH`) deleting the rows of the jobs whose ids are the SQL array
 * `ids` (`uuid[]`) and whose keys are the array `keys` (`text[]`; a key is deleted only while it
 * still names one of those jobs). Each table is read through its index on `job_id` (or the key),
 * the arrays giving an index scan whatever the planner thinks of the table's size. `a` returns
 * the deleted attempts' `ended_at, status, job_status` and `e` the events' `kind, at`, for the
 * per-minute counts.
 */
export function referencesDeleteSql(ids: string, keys: string): string {
  return [
    `keys AS (DELETE FROM job_keys WHERE key = ANY(${keys}) AND job_id = ANY(${ids}))`,
    `a AS (DELETE FROM attempts WHERE job_id = ANY(${ids}) RETURNING ended_at, status, job_status)`,
    `e AS (DELETE FROM job_events WHERE job_id = ANY(${ids}) RETURNING kind, at)`,
    ...JOB_REFERENCES.filter((t) => t !== 'job_events').map((t) => `del_${t} AS (DELETE FROM ${t} WHERE job_id = ANY(${ids}))`),
  ].join(',\n   ');
}
