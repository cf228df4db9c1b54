-- Each ended attempt carries when its job was created: ListJobs by agent reads an agent's attempts
-- newest job first from attempts_agent_idx (built CONCURRENTLY by migrate.ts, not here). A new
-- column without a default: a catalog change, nothing rewritten. The attempts already kept get it
-- from their jobs after the migrations, by batches (migrate.ts), not here: the migrations run in
-- one transaction, which would hold this table's lock while every attempt was rewritten.
ALTER TABLE "attempts" ADD COLUMN "job_created_at" timestamp with time zone;
