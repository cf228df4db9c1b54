CREATE TABLE "agent_sessions" (
	"id" uuid PRIMARY KEY NOT NULL,
	"agent_id" text NOT NULL,
	"coordinator_id" uuid NOT NULL,
	"queues" text[] NOT NULL,
	"labels" jsonb DEFAULT '{}'::jsonb NOT NULL,
	"slots" integer NOT NULL,
	"connected_at" timestamp with time zone NOT NULL,
	"seen_at" timestamp with time zone DEFAULT now() NOT NULL,
	"draining_since" timestamp with time zone
);
--> statement-breakpoint
CREATE INDEX "agent_sessions_agent_idx" ON "agent_sessions" USING btree ("agent_id");--> statement-breakpoint
CREATE INDEX "agent_sessions_coordinator_idx" ON "agent_sessions" USING btree ("coordinator_id");--> statement-breakpoint
CREATE INDEX "completions_job_idx" ON "completions" USING btree ("job_id");--> statement-breakpoint
CREATE INDEX "job_events_at_brin" ON "job_events" USING brin ("at");--> statement-breakpoint
COMMENT ON TABLE "agent_sessions" IS 'Agent streams open on every coordinator, so any replica can list them; rows of a coordinator that stopped stamping seen_at are swept.';--> statement-breakpoint
COMMENT ON INDEX "agent_sessions_agent_idx" IS 'Serves ListAgents and DrainAgent: the sessions of an agent.';--> statement-breakpoint
COMMENT ON INDEX "agent_sessions_coordinator_idx" IS 'Serves a coordinator stamping (seen_at) or removing its own sessions.';--> statement-breakpoint
COMMENT ON INDEX "completions_job_idx" IS 'Serves the ON DELETE CASCADE from jobs when finished jobs are purged.';--> statement-breakpoint
COMMENT ON INDEX "job_events_at_brin" IS 'Serves GetStats per-minute counts (recent events by time). BRIN: events are appended in time order, and it costs transitions next to nothing.';
