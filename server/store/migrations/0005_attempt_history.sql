-- 0005: an attempt is written once, when it ends, and carries its own history; the job's result
-- is stored once (jobs.result); job_events keeps only the transitions no attempt makes. Existing
-- data is carried over: live attempts move into their jobs rows, ended attempts take their error,
-- retry flag and the job's next state from the completions and events that recorded them, and
-- the events an attempt row now holds are removed.
ALTER TABLE "jobs" ADD COLUMN "claimed_at" timestamp with time zone;--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "claim_deadline" timestamp with time zone;--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "started_at" timestamp with time zone;--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "suspect_since" timestamp with time zone;--> statement-breakpoint
UPDATE "jobs" j SET "claimed_at" = a."claimed_at", "claim_deadline" = a."claim_deadline", "started_at" = a."started_at",
  "suspect_since" = a."suspect_since"
FROM "attempts" a WHERE a."id" = j."current_attempt_id";--> statement-breakpoint
ALTER TABLE "attempts" ADD COLUMN "error" jsonb;--> statement-breakpoint
ALTER TABLE "attempts" ADD COLUMN "retryable" boolean;--> statement-breakpoint
ALTER TABLE "attempts" ADD COLUMN "job_status" "job_status";--> statement-breakpoint
ALTER TABLE "attempts" ADD COLUMN "run_at" timestamp with time zone;--> statement-breakpoint
ALTER TABLE "attempts" ADD COLUMN "seq" bigint;--> statement-breakpoint
-- A reported failure's error and retry flag were in its completion.
UPDATE "attempts" a SET "error" = c."error", "retryable" = c."retryable"
FROM "completions" c WHERE c."attempt_id" = a."id" AND c."kind" = 'failed';--> statement-breakpoint
-- What became of the job, a retry's new due time and the reaper's error were in the event that
-- ended the attempt (its data: the jobs columns that transition set).
UPDATE "attempts" a SET "job_status" = (e."data" ->> 'status')::job_status,
  "run_at" = CASE WHEN e."data" ->> 'status' = 'queued' AND e."data" ? 'run_at' THEN (e."data" ->> 'run_at')::timestamptz END,
  "error" = coalesce(a."error", CASE WHEN a."status" IN ('lease_expired', 'timed_out') THEN e."data" -> 'error' END),
  -- The ending event's place in the history is the attempt's.
  "seq" = e."id"
FROM "job_events" e
WHERE e."attempt_id" = a."id" AND e."kind" NOT IN ('enqueued', 'claimed', 'started', 'requeued') AND e."data" ? 'status';--> statement-breakpoint
-- Live attempts are their jobs rows now.
DELETE FROM "attempts" WHERE "status" IN ('claimed', 'running');--> statement-breakpoint
-- An ended attempt whose event was missing (none is expected): the job went back to the queue
-- unless this was its last attempt and the job is finished.
UPDATE "attempts" a SET "job_status" = CASE WHEN j."attempt_no" = a."attempt_no" AND j."finished_at" IS NOT NULL THEN j."status" ELSE 'queued' END,
  "ended_at" = coalesce(a."ended_at", j."updated_at")
FROM "jobs" j WHERE j."id" = a."job_id" AND (a."job_status" IS NULL OR a."ended_at" IS NULL);--> statement-breakpoint
UPDATE "attempts" SET "seq" = nextval('job_events_id_seq') WHERE "seq" IS NULL;--> statement-breakpoint
ALTER TABLE "attempts" ALTER COLUMN "seq" SET DEFAULT nextval('job_events_id_seq');--> statement-breakpoint
ALTER TABLE "attempts" ALTER COLUMN "seq" SET NOT NULL;--> statement-breakpoint
ALTER TABLE "attempts" ALTER COLUMN "job_status" SET NOT NULL;--> statement-breakpoint
ALTER TABLE "attempts" ALTER COLUMN "status" DROP DEFAULT;--> statement-breakpoint
ALTER TABLE "attempts" ALTER COLUMN "ended_at" SET NOT NULL;--> statement-breakpoint
ALTER TABLE "attempts" ADD CONSTRAINT "attempts_ended" CHECK ("attempts"."status" not in ('claimed', 'running'));--> statement-breakpoint
DELETE FROM "job_events" WHERE NOT ("kind" = 'requeued' OR ("kind" = 'canceled' AND "attempt_id" IS NULL));--> statement-breakpoint
ALTER TABLE "completions" DISABLE ROW LEVEL SECURITY;--> statement-breakpoint
DROP TABLE "completions" CASCADE;--> statement-breakpoint
ALTER TABLE "jobs" DROP CONSTRAINT "jobs_held_has_attempt";--> statement-breakpoint
DROP INDEX "attempts_live_agent_idx";--> statement-breakpoint
DROP INDEX "jobs_lease_idx";--> statement-breakpoint
DROP INDEX "jobs_claim_idx";--> statement-breakpoint
CREATE INDEX "attempts_ended_brin" ON "attempts" USING brin ("ended_at");--> statement-breakpoint
CREATE INDEX "jobs_claim_idx" ON "jobs" USING btree ("queue","priority" DESC NULLS LAST,"run_at","id") WHERE "jobs"."current_attempt_id" is null and "jobs"."finished_at" is null;--> statement-breakpoint
ALTER TABLE "jobs" DROP COLUMN "last_attempt_id";--> statement-breakpoint
ALTER TABLE "jobs" DROP COLUMN "error";--> statement-breakpoint
ALTER TABLE "jobs" ADD CONSTRAINT "jobs_queued_shape" CHECK (("jobs"."status" = 'queued') = ("jobs"."current_attempt_id" is null and "jobs"."finished_at" is null));--> statement-breakpoint
ALTER TABLE "jobs" ADD CONSTRAINT "jobs_held_has_attempt" CHECK (("jobs"."status" in ('claimed', 'running')) = ("jobs"."current_attempt_id" is not null and "jobs"."lease_expires_at" is not null and "jobs"."agent_id" is not null and "jobs"."claimed_at" is not null));--> statement-breakpoint
-- Room on each page for the new versions of its rows: the start and every heartbeat change no
-- indexed column, so with room they are HOT updates (no index entries). New pages only; a
-- VACUUM FULL or pg_repack applies it to an existing table.
ALTER TABLE "jobs" SET (fillfactor = 70);--> statement-breakpoint
COMMENT ON INDEX "jobs_claim_idx" IS 'Serves jobClaim: queued jobs (no current attempt, not finished) of a queue in priority DESC, run_at, id order (FOR UPDATE SKIP LOCKED). Partial, so it holds only claimable rows.';--> statement-breakpoint
COMMENT ON INDEX "jobs_current_attempt_uq" IS 'Serves every fenced write (start, heartbeat, complete, fail, steps) by attempt id, and the reaper''s walk of held jobs; unique, so no two jobs can share a fencing token.';--> statement-breakpoint
COMMENT ON INDEX "attempts_ended_brin" IS 'Serves the per-minute counts of GetStats: attempts are written when they end, in time order.';--> statement-breakpoint
-- job.error is read from the job's attempts (the newest that has one); a success has none.
CREATE FUNCTION job_error(job_id uuid, status job_status) RETURNS jsonb
LANGUAGE sql STABLE PARALLEL SAFE AS $$
  SELECT CASE WHEN status = 'succeeded' THEN NULL ELSE (
    SELECT a.error FROM attempts a WHERE a.job_id = job_error.job_id AND a.error IS NOT NULL ORDER BY a.attempt_no DESC LIMIT 1) END
$$;
