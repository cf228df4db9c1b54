-- Finished jobs per queue and status, kept rather than counted on every read (server/store/counts.ts):
-- the statements that finish, requeue and purge jobs append their change here.
CREATE TABLE "job_counts" (
	"queue" text NOT NULL,
	"status" "job_status" NOT NULL,
	"n" bigint NOT NULL
);--> statement-breakpoint
-- What is there now: one scan of the finished jobs, without a lock, so the coordinators keep
-- running. A job an older coordinator finishes meanwhile (or until it is upgraded) is not
-- counted here; the purger's recount at its start and every hour corrects that, and logs it.
INSERT INTO "job_counts" ("queue", "status", "n")
SELECT "queue", "status", count(*) FROM "jobs" WHERE "finished_at" IS NOT NULL GROUP BY "queue", "status";
