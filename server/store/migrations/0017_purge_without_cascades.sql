-- Every row of these tables is written while its job's row is locked, and jobPurge deletes them
-- with their job, by index (schema.ts, JOB_REFERENCES): ON DELETE CASCADE ran one query per table
-- for every purged job, more than half of a purge batch. Catalog changes only.
ALTER TABLE "job_events" DROP CONSTRAINT "job_events_job_id_jobs_id_fk";
--> statement-breakpoint
ALTER TABLE "notify_headers" DROP CONSTRAINT "notify_headers_job_id_jobs_id_fk";
--> statement-breakpoint
ALTER TABLE "stale_reports" DROP CONSTRAINT "stale_reports_job_id_jobs_id_fk";
--> statement-breakpoint
ALTER TABLE "steps" DROP CONSTRAINT "steps_job_id_jobs_id_fk";
--> statement-breakpoint
ALTER TABLE "webhook_events" DROP CONSTRAINT "webhook_events_job_id_jobs_id_fk";
