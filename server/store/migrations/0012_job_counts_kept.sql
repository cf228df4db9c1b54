-- Finished jobs per queue and status, kept rather than counted on every read (server/store/counts.ts):
-- the statements that finish, requeue and purge jobs append their change here. What the jobs kept
-- already count is written after the migrations (migrate.ts, a recount), not here: the migrations
-- run in one transaction, holding the locks of the tables they alter while it would scan.
CREATE TABLE "job_counts" (
	"queue" text NOT NULL,
	"status" "job_status" NOT NULL,
	"n" bigint NOT NULL
);
