-- Each ended attempt carries when its job was created: ListJobs by agent reads an agent's attempts
-- newest job first from attempts_agent_idx (built CONCURRENTLY by migrate.ts, not here).
ALTER TABLE "attempts" ADD COLUMN "job_created_at" timestamp with time zone;--> statement-breakpoint
-- The attempts already kept get it from their job. Row locks on attempts only: the transitions
-- only insert attempts, so they go on meanwhile. An attempt an older coordinator ends after this
-- (a rolling upgrade) keeps NULL and is missing from the lists by agent until it is purged.
UPDATE "attempts" a SET "job_created_at" = j."created_at" FROM "jobs" j WHERE j."id" = a."job_id" AND a."job_created_at" IS NULL;
