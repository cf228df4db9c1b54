-- job_event_delta(new, old): the columns of a jobs row that a transition changed, as
-- {column: value}. Every transition appends it to job_events, so folding the deltas of a job in
-- id order rebuilds its row (updated_at and heartbeat_at are left out: heartbeats are not
-- transitions and move only those and lease_expires_at).
CREATE FUNCTION job_event_delta(new_row jsonb, old_row jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT coalesce(jsonb_object_agg(n.key, n.value), '{}'::jsonb)
  FROM jsonb_each(new_row - '{updated_at,heartbeat_at}'::text[]) AS n
  WHERE n.value IS DISTINCT FROM (old_row -> n.key)
$$;--> statement-breakpoint
-- Operators see these with \di+ in psql: which query each index serves.
COMMENT ON INDEX "jobs_claim_idx" IS 'Serves jobClaim: queued jobs of a queue in priority DESC, run_at, id order (FOR UPDATE SKIP LOCKED). Partial on status = queued so it holds only claimable rows.';--> statement-breakpoint
COMMENT ON INDEX "jobs_lease_idx" IS 'Serves jobRescueExpired (the reaper): held jobs (claimed, running) whose start deadline or lease, capped by the execution deadline, has passed.';--> statement-breakpoint
COMMENT ON INDEX "jobs_current_attempt_uq" IS 'Serves every fenced write (start, heartbeat, complete, fail, steps) by attempt id; unique, so no two jobs can share a fencing token.';--> statement-breakpoint
COMMENT ON INDEX "jobs_idempotency_key_uq" IS 'Serves jobEnqueue ON CONFLICT: at most one job per idempotency key.';--> statement-breakpoint
COMMENT ON INDEX "jobs_finished_idx" IS 'Serves listing and purging finished jobs by age.';--> statement-breakpoint
COMMENT ON INDEX "job_events_job_idx" IS 'Serves jobGet history and rebuilding a job from its events.';--> statement-breakpoint
COMMENT ON INDEX "stale_reports_at_idx" IS 'Serves listing stale reports newest first.';--> statement-breakpoint
COMMENT ON INDEX "stale_reports_job_idx" IS 'Serves a job''s own stale reports in jobGet.';
