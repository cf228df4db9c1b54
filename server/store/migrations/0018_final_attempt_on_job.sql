-- A job's succeeded attempt is kept on its row (final_attempt_id and the final_* columns) instead
-- of a row of `attempts`: a success writes one row less (docs/decisions.md, "The succeeded attempt
-- on its job's row"). New columns without defaults: catalog changes, nothing rewritten. Their
-- indexes (jobs_final_attempt_uq, jobs_final_agent_idx) are built CONCURRENTLY by migrate.ts, not
-- here. Attempts that succeeded before this migration keep their `attempts` rows; the view reads
-- both, so no row moves.
ALTER TABLE "jobs" ADD COLUMN "final_attempt_id" uuid;--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "final_agent_id" text;--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "final_claimed_at" timestamp with time zone;--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "final_claim_deadline" timestamp with time zone;--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "final_started_at" timestamp with time zone;--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "final_suspect_since" timestamp with time zone;--> statement-breakpoint
-- Every ended attempt, whichever row keeps it: the rows of `attempts`, then the succeeded attempts
-- kept on their jobs' rows (seq NULL: a job's success is its last transition). A filter on a
-- column reaches both branches (an attempt by id: attempts_pkey and jobs_final_attempt_uq; a
-- job's attempts: attempts_job_attempt_no_uq and jobs_pkey; an agent's: attempts_agent_idx and
-- jobs_final_agent_idx; a time range: attempts_ended_brin and jobs_finished_idx).
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
