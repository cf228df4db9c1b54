/**
 * The delivery outbox's writing half: CTEs appended to every fenced statement that ends a job
 * (complete, fail, cancel, rescue to dead), so a notification exists if and only if its
 * transition committed. Kept apart from `deliveries.ts` so the transition modules can import it
 * without a cycle.
 */
/**
 * The CTEs that write a transition's notification, to append after the statement's last CTE.
 * `source` is a SELECT yielding, per job that ended, `job_id`, `queue`, `notify_url`, `type`
 * (an event type, or NULL for none), `at` (the transition time), `job` (the new jobs row as
 * jsonb) and `attempt` (the attempt that ended, as jsonb, or NULL).
 *
 * Targets are the job's notify_url and the subscriptions of its queue (or of '*') to that
 * event type, one delivery per URL: a URL that is both the job's notify_url and subscribed, or
 * subscribed to the queue and to '*', gets the event once (two at the same moment were two
 * concurrent n8n executions, which a dedupe by event id in static data does not stop). The
 * notify_url's row is the one kept, so its header goes with it; the secret is the URL's either
 * way. An event is stored when it has a target, and always for `job.dead` (the deliverer raises
 * an alert for each). Outbox times are `now()` (transaction time), not a pinned `now`
 * parameter: the deliverer runs on database time.
 */
export function outboxSql(source: string): string {
  return `, ob_src AS MATERIALIZED (
     SELECT gen_random_uuid() AS event_id, s.* FROM (${source}) s WHERE s.type IS NOT NULL
   ), ob_tg AS (
     SELECT DISTINCT ON (t.event_id, t.url) t.event_id, t.subscription_id, t.url FROM (
       SELECT event_id, NULL::uuid AS subscription_id, notify_url AS url, 0 AS rank FROM ob_src WHERE notify_url IS NOT NULL
       UNION ALL
       SELECT o.event_id, sub.id, sub.url, 1 FROM ob_src o
       JOIN subscriptions sub ON sub.queue IN (o.queue, '*') AND o.type::webhook_event_type = ANY (sub.events)
     ) t
     ORDER BY t.event_id, t.url, t.rank, t.subscription_id
   ), ob_ev AS (
     INSERT INTO webhook_events (id, job_id, type, body, created_at)
     SELECT o.event_id, o.job_id, o.type::webhook_event_type, webhook_event_body(o.event_id, o.type, o.at, o.job, o.attempt), o.at
     FROM ob_src o
     WHERE o.type = 'job.dead' OR EXISTS (SELECT 1 FROM ob_tg WHERE ob_tg.event_id = o.event_id)
   ), ob_dl AS (
     INSERT INTO webhook_deliveries (event_id, subscription_id, url)
     SELECT event_id, subscription_id, url FROM ob_tg
   )`;
}
