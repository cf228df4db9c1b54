CREATE TABLE "agents" (
	"id" text PRIMARY KEY NOT NULL,
	"token_hash" text NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	"revoked_at" timestamp with time zone,
	"last_seen_at" timestamp with time zone
);
--> statement-breakpoint
ALTER TABLE "attempts" ADD COLUMN "suspect_since" timestamp with time zone;--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "labels" jsonb DEFAULT '{}'::jsonb NOT NULL;--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "progress" jsonb;--> statement-breakpoint
CREATE UNIQUE INDEX "agents_token_hash_uq" ON "agents" USING btree ("token_hash");--> statement-breakpoint
CREATE INDEX "attempts_live_agent_idx" ON "attempts" USING btree ("agent_id") WHERE "attempts"."status" in ('claimed', 'running');--> statement-breakpoint
CREATE INDEX "jobs_created_idx" ON "jobs" USING btree ("created_at" DESC NULLS LAST,"id" DESC NULLS LAST);--> statement-breakpoint
-- progress moves with heartbeats, like heartbeat_at: not a transition, left out of the deltas.
CREATE OR REPLACE FUNCTION job_event_delta(new_row jsonb, old_row jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT coalesce(jsonb_object_agg(n.key, n.value), '{}'::jsonb)
  FROM jsonb_each(new_row - '{updated_at,heartbeat_at,progress}'::text[]) AS n
  WHERE n.value IS DISTINCT FROM (old_row -> n.key)
$$;--> statement-breakpoint
COMMENT ON INDEX "agents_token_hash_uq" IS 'Serves agentAuthenticate: a token is looked up by its SHA-256 hash.';--> statement-breakpoint
COMMENT ON INDEX "attempts_live_agent_idx" IS 'Serves attemptsResume and listing an agent''s live and suspect attempts.';--> statement-breakpoint
COMMENT ON INDEX "jobs_created_idx" IS 'Serves jobList: newest first, paged by (created_at, id).';
