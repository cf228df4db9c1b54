-- Finished jobs in a table of days (docs/decisions.md, "Finished jobs in a table of days"): `jobs`
-- becomes a table partitioned by LIST on `done_day`. The existing table, renamed `jobs_live`, is
-- its partition for NULL: the live jobs, and every finished job it already holds (the purger
-- deletes those by rows, as before). A success moves its job's row to the partition of the day it
-- finished (`jobs_done_YYYYMMDD`, made ahead by the coordinator, server/store/days.ts), and the
-- purger drops a day's partition once all of it is past the retention. Catalog changes, the copy of
-- the keyed jobs' keys into job_keys (schema.ts: a key is unique across partitions there), and one
-- read of the table to prove the new column NULL (the CHECK's VALIDATE, which the ATTACH then
-- relies on): seconds for ten million jobs, under the lock the migrations hold (they run in one
-- transaction).
CREATE TABLE "job_keys" (
	"key" text PRIMARY KEY NOT NULL,
	"job_id" uuid NOT NULL
);
--> statement-breakpoint
INSERT INTO "job_keys" ("key", "job_id") SELECT "idempotency_key", "id" FROM "jobs" WHERE "idempotency_key" IS NOT NULL;
--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "done_day" date;
--> statement-breakpoint
ALTER TABLE "jobs" ADD CONSTRAINT "jobs_live_done_day_null" CHECK ("done_day" IS NULL) NOT VALID;
--> statement-breakpoint
ALTER TABLE "jobs" VALIDATE CONSTRAINT "jobs_live_done_day_null";
--> statement-breakpoint
DROP VIEW "attempt_log";
--> statement-breakpoint
ALTER TABLE "jobs" RENAME TO "jobs_live";
--> statement-breakpoint
CREATE TABLE "jobs" (LIKE "jobs_live" INCLUDING DEFAULTS INCLUDING CONSTRAINTS) PARTITION BY LIST ("done_day");
--> statement-breakpoint
ALTER TABLE "jobs" DROP CONSTRAINT "jobs_live_done_day_null";
--> statement-breakpoint
ALTER TABLE "jobs" ATTACH PARTITION "jobs_live" FOR VALUES IN (NULL);
--> statement-breakpoint
-- As in 0018, now over every partition of jobs.
CREATE VIEW "attempt_log" AS
  SELECT id, job_id, attempt_no, agent_id, status, claimed_at, claim_deadline, started_at, ended_at, suspect_since,
         error, retryable, job_status, run_at, seq, job_created_at
  FROM "attempts"
  UNION ALL
  SELECT final_attempt_id, id, attempt_no, final_agent_id, 'succeeded'::attempt_status, final_claimed_at, final_claim_deadline,
         final_started_at, finished_at, final_suspect_since, NULL::jsonb, NULL::boolean, 'succeeded'::job_status,
         NULL::timestamptz, NULL::bigint, created_at
  FROM "jobs"
  WHERE final_attempt_id IS NOT NULL;
