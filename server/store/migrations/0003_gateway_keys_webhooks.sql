CREATE TYPE "public"."delivery_status" AS ENUM('pending', 'sending', 'delivered', 'failed');--> statement-breakpoint
CREATE TYPE "public"."webhook_event_type" AS ENUM('job.succeeded', 'job.failed', 'job.dead', 'job.canceled');--> statement-breakpoint
CREATE TABLE "api_keys" (
	"name" text PRIMARY KEY NOT NULL,
	"key_hash" text NOT NULL,
	"scopes" text[] NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	"revoked_at" timestamp with time zone,
	"last_used_at" timestamp with time zone,
	CONSTRAINT "api_keys_scopes_known" CHECK (cardinality("api_keys"."scopes") > 0 and "api_keys"."scopes" <@ array['enqueue', 'read', 'agent', 'admin']::text[])
);
--> statement-breakpoint
CREATE TABLE "signing_secrets" (
	"name" text PRIMARY KEY NOT NULL,
	"secret" text NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL
);
--> statement-breakpoint
CREATE TABLE "subscriptions" (
	"id" uuid PRIMARY KEY DEFAULT gen_random_uuid() NOT NULL,
	"queue" text NOT NULL,
	"url" text NOT NULL,
	"events" "webhook_event_type"[] NOT NULL,
	"secret" text NOT NULL,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	CONSTRAINT "subscriptions_events_not_empty" CHECK (cardinality("subscriptions"."events") > 0)
);
--> statement-breakpoint
CREATE TABLE "webhook_deliveries" (
	"id" bigint PRIMARY KEY GENERATED ALWAYS AS IDENTITY (sequence name "webhook_deliveries_id_seq" INCREMENT BY 1 MINVALUE 1 MAXVALUE 9223372036854775807 START WITH 1 CACHE 1),
	"event_id" uuid NOT NULL,
	"subscription_id" uuid,
	"url" text NOT NULL,
	"status" "delivery_status" DEFAULT 'pending' NOT NULL,
	"attempts" integer DEFAULT 0 NOT NULL,
	"next_attempt_at" timestamp with time zone DEFAULT now() NOT NULL,
	"claim_id" uuid,
	"claimed_until" timestamp with time zone,
	"last_status" integer,
	"last_error" text,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	"updated_at" timestamp with time zone DEFAULT now() NOT NULL,
	"delivered_at" timestamp with time zone,
	CONSTRAINT "webhook_deliveries_sending_has_claim" CHECK (("webhook_deliveries"."status" = 'sending') = ("webhook_deliveries"."claim_id" is not null and "webhook_deliveries"."claimed_until" is not null))
);
--> statement-breakpoint
CREATE TABLE "webhook_events" (
	"id" uuid PRIMARY KEY NOT NULL,
	"job_id" uuid NOT NULL,
	"type" "webhook_event_type" NOT NULL,
	"body" text NOT NULL,
	"created_at" timestamp with time zone NOT NULL,
	"alerted_at" timestamp with time zone
);
--> statement-breakpoint
ALTER TABLE "jobs" ADD COLUMN "notify_url" text;--> statement-breakpoint
ALTER TABLE "webhook_deliveries" ADD CONSTRAINT "webhook_deliveries_event_id_webhook_events_id_fk" FOREIGN KEY ("event_id") REFERENCES "public"."webhook_events"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "webhook_deliveries" ADD CONSTRAINT "webhook_deliveries_subscription_id_subscriptions_id_fk" FOREIGN KEY ("subscription_id") REFERENCES "public"."subscriptions"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "webhook_events" ADD CONSTRAINT "webhook_events_job_id_jobs_id_fk" FOREIGN KEY ("job_id") REFERENCES "public"."jobs"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
CREATE UNIQUE INDEX "api_keys_key_hash_uq" ON "api_keys" USING btree ("key_hash");--> statement-breakpoint
CREATE UNIQUE INDEX "subscriptions_queue_url_uq" ON "subscriptions" USING btree ("queue","url");--> statement-breakpoint
CREATE INDEX "webhook_deliveries_due_idx" ON "webhook_deliveries" USING btree ("next_attempt_at") WHERE "webhook_deliveries"."status" = 'pending';--> statement-breakpoint
CREATE INDEX "webhook_deliveries_sending_idx" ON "webhook_deliveries" USING btree ("claimed_until") WHERE "webhook_deliveries"."status" = 'sending';--> statement-breakpoint
CREATE INDEX "webhook_deliveries_event_idx" ON "webhook_deliveries" USING btree ("event_id");--> statement-breakpoint
CREATE INDEX "webhook_deliveries_failed_idx" ON "webhook_deliveries" USING btree ("updated_at") WHERE "webhook_deliveries"."status" = 'failed';--> statement-breakpoint
CREATE INDEX "webhook_events_unalerted_idx" ON "webhook_events" USING btree ("created_at") WHERE "webhook_events"."type" = 'job.dead' and "webhook_events"."alerted_at" is null;--> statement-breakpoint
CREATE INDEX "webhook_events_job_idx" ON "webhook_events" USING btree ("job_id");--> statement-breakpoint
-- rfc3339(t): a time as the API's JSON writes it (UTC, "Z"), whatever the session's TimeZone.
CREATE FUNCTION rfc3339(t timestamptz) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
  SELECT to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
$$;--> statement-breakpoint
-- webhook_event_body(...): the JSON body of a notification, rendered once by the statement that
-- makes the transition (so every delivery and retry sends the same bytes, and the signature
-- covers exactly what was stored). job and attempt are rows as jsonb (to_jsonb of jobs and
-- attempts rows); they are written the way the gateway's JSON writes a Job and an Attempt
-- (camelCase, JOB_STATUS_* / ATTEMPT_STATUS_*, UTC times), so a workflow reads both alike.
CREATE FUNCTION webhook_event_body(event_id uuid, event_type text, at timestamptz, job jsonb, attempt jsonb) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
  SELECT jsonb_build_object(
    'id', event_id,
    'type', event_type,
    'createdAt', rfc3339(at),
    'job', jsonb_build_object(
      'id', job -> 'id', 'queue', job -> 'queue', 'status', 'JOB_STATUS_' || upper(job ->> 'status'),
      'payload', job -> 'payload', 'priority', job -> 'priority', 'attemptNo', job -> 'attempt_no',
      'attemptsStarted', job -> 'attempts_started', 'maxAttempts', job -> 'max_attempts',
      'idempotencyKey', coalesce(job ->> 'idempotency_key', ''), 'labels', job -> 'labels',
      'result', job -> 'result', 'error', job -> 'error', 'notifyUrl', coalesce(job ->> 'notify_url', ''),
      'createdAt', rfc3339((job ->> 'created_at')::timestamptz), 'finishedAt', rfc3339((job ->> 'finished_at')::timestamptz)),
    'attempt', CASE WHEN attempt IS NULL THEN 'null'::jsonb ELSE jsonb_build_object(
      'id', attempt -> 'id', 'attemptNo', attempt -> 'attempt_no', 'agentId', attempt -> 'agent_id',
      'status', 'ATTEMPT_STATUS_' || upper(attempt ->> 'status'),
      'claimedAt', rfc3339((attempt ->> 'claimed_at')::timestamptz),
      'startedAt', rfc3339((attempt ->> 'started_at')::timestamptz),
      'endedAt', rfc3339((attempt ->> 'ended_at')::timestamptz)) END,
    'result', coalesce(job -> 'result', 'null'::jsonb),
    'error', coalesce(job -> 'error', 'null'::jsonb))::text
$$;--> statement-breakpoint
COMMENT ON INDEX "api_keys_key_hash_uq" IS 'Serves keyAuthenticate: a key is looked up by its SHA-256 hash.';--> statement-breakpoint
COMMENT ON INDEX "subscriptions_queue_url_uq" IS 'Serves the outbox CTE of every terminal transition (subscriptions of the job queue and of *); one URL per queue.';--> statement-breakpoint
COMMENT ON INDEX "webhook_deliveries_due_idx" IS 'Serves deliveryClaim: due pending deliveries, oldest first (FOR UPDATE SKIP LOCKED).';--> statement-breakpoint
COMMENT ON INDEX "webhook_deliveries_sending_idx" IS 'Serves deliveryReclaimExpired, the reconciliation sweep: claims whose deliverer died.';--> statement-breakpoint
COMMENT ON INDEX "webhook_deliveries_failed_idx" IS 'Serves listing deliveries that reached the attempt cap.';--> statement-breakpoint
COMMENT ON INDEX "webhook_events_unalerted_idx" IS 'Serves the deliverer alert scan: job.dead events whose alert was not raised yet.';
