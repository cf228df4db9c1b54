CREATE TYPE "public"."attempt_status" AS ENUM('claimed', 'running', 'succeeded', 'failed', 'claim_expired', 'lease_expired', 'timed_out', 'canceled');--> statement-breakpoint
CREATE TYPE "public"."event_kind" AS ENUM('enqueued', 'claimed', 'started', 'completed', 'failed', 'retry_scheduled', 'claim_expired', 'lease_expired', 'timed_out', 'dead', 'canceled', 'requeued');--> statement-breakpoint
CREATE TYPE "public"."job_status" AS ENUM('queued', 'claimed', 'running', 'succeeded', 'failed', 'dead', 'canceled');--> statement-breakpoint
CREATE TYPE "public"."step_status" AS ENUM('started', 'done');--> statement-breakpoint
CREATE TABLE "attempts" (
	"id" uuid PRIMARY KEY NOT NULL,
	"job_id" uuid NOT NULL,
	"attempt_no" integer NOT NULL,
	"agent_id" text NOT NULL,
	"status" "attempt_status" DEFAULT 'claimed' NOT NULL,
	"claimed_at" timestamp with time zone NOT NULL,
	"claim_deadline" timestamp with time zone NOT NULL,
	"started_at" timestamp with time zone,
	"ended_at" timestamp with time zone
);
--> statement-breakpoint
CREATE TABLE "completions" (
	"attempt_id" uuid PRIMARY KEY NOT NULL,
	"job_id" uuid NOT NULL,
	"kind" text NOT NULL,
	"result" jsonb,
	"error" jsonb,
	"retryable" boolean,
	"created_at" timestamp with time zone NOT NULL
);
--> statement-breakpoint
CREATE TABLE "job_events" (
	"id" bigint PRIMARY KEY GENERATED ALWAYS AS IDENTITY (sequence name "job_events_id_seq" INCREMENT BY 1 MINVALUE 1 MAXVALUE 9223372036854775807 START WITH 1 CACHE 1),
	"job_id" uuid NOT NULL,
	"attempt_id" uuid,
	"kind" "event_kind" NOT NULL,
	"at" timestamp with time zone NOT NULL,
	"data" jsonb NOT NULL
);
--> statement-breakpoint
CREATE TABLE "jobs" (
	"id" uuid PRIMARY KEY DEFAULT gen_random_uuid() NOT NULL,
	"queue" text NOT NULL,
	"payload" jsonb NOT NULL,
	"priority" integer DEFAULT 0 NOT NULL,
	"status" "job_status" DEFAULT 'queued' NOT NULL,
	"run_at" timestamp with time zone DEFAULT now() NOT NULL,
	"max_attempts" integer DEFAULT 5 NOT NULL,
	"attempt_no" integer DEFAULT 0 NOT NULL,
	"attempts_started" integer DEFAULT 0 NOT NULL,
	"current_attempt_id" uuid,
	"last_attempt_id" uuid,
	"agent_id" text,
	"lease_expires_at" timestamp with time zone,
	"heartbeat_at" timestamp with time zone,
	"execution_timeout_ms" integer,
	"execution_deadline" timestamp with time zone,
	"idempotency_key" text,
	"result" jsonb,
	"error" jsonb,
	"created_at" timestamp with time zone DEFAULT now() NOT NULL,
	"updated_at" timestamp with time zone DEFAULT now() NOT NULL,
	"finished_at" timestamp with time zone,
	CONSTRAINT "jobs_payload_object" CHECK (jsonb_typeof("jobs"."payload") = 'object'),
	CONSTRAINT "jobs_max_attempts_positive" CHECK ("jobs"."max_attempts" > 0),
	CONSTRAINT "jobs_held_has_attempt" CHECK (("jobs"."status" in ('claimed', 'running')) = ("jobs"."current_attempt_id" is not null and "jobs"."lease_expires_at" is not null and "jobs"."agent_id" is not null))
);
--> statement-breakpoint
CREATE TABLE "stale_reports" (
	"id" bigint PRIMARY KEY GENERATED ALWAYS AS IDENTITY (sequence name "stale_reports_id_seq" INCREMENT BY 1 MINVALUE 1 MAXVALUE 9223372036854775807 START WITH 1 CACHE 1),
	"job_id" uuid NOT NULL,
	"attempt_id" uuid NOT NULL,
	"agent_id" text,
	"call" text NOT NULL,
	"current_attempt_id" uuid,
	"current_attempt_no" integer NOT NULL,
	"current_status" "job_status" NOT NULL,
	"at" timestamp with time zone NOT NULL
);
--> statement-breakpoint
CREATE TABLE "steps" (
	"job_id" uuid NOT NULL,
	"step" text NOT NULL,
	"status" "step_status" NOT NULL,
	"attempt_id" uuid NOT NULL,
	"previous_attempt_id" uuid,
	"output" jsonb,
	"reservations" integer DEFAULT 1 NOT NULL,
	"started_at" timestamp with time zone NOT NULL,
	"finished_at" timestamp with time zone,
	CONSTRAINT "steps_job_id_step_pk" PRIMARY KEY("job_id","step")
);
--> statement-breakpoint
ALTER TABLE "attempts" ADD CONSTRAINT "attempts_job_id_jobs_id_fk" FOREIGN KEY ("job_id") REFERENCES "public"."jobs"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "completions" ADD CONSTRAINT "completions_attempt_id_attempts_id_fk" FOREIGN KEY ("attempt_id") REFERENCES "public"."attempts"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "completions" ADD CONSTRAINT "completions_job_id_jobs_id_fk" FOREIGN KEY ("job_id") REFERENCES "public"."jobs"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "job_events" ADD CONSTRAINT "job_events_job_id_jobs_id_fk" FOREIGN KEY ("job_id") REFERENCES "public"."jobs"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "stale_reports" ADD CONSTRAINT "stale_reports_job_id_jobs_id_fk" FOREIGN KEY ("job_id") REFERENCES "public"."jobs"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
ALTER TABLE "steps" ADD CONSTRAINT "steps_job_id_jobs_id_fk" FOREIGN KEY ("job_id") REFERENCES "public"."jobs"("id") ON DELETE cascade ON UPDATE no action;--> statement-breakpoint
CREATE UNIQUE INDEX "attempts_job_attempt_no_uq" ON "attempts" USING btree ("job_id","attempt_no");--> statement-breakpoint
CREATE INDEX "job_events_job_idx" ON "job_events" USING btree ("job_id","id");--> statement-breakpoint
CREATE INDEX "jobs_claim_idx" ON "jobs" USING btree ("queue","priority" DESC NULLS LAST,"run_at","id") WHERE "jobs"."status" = 'queued';--> statement-breakpoint
CREATE INDEX "jobs_lease_idx" ON "jobs" USING btree ("lease_expires_at") WHERE "jobs"."status" in ('claimed', 'running');--> statement-breakpoint
CREATE UNIQUE INDEX "jobs_current_attempt_uq" ON "jobs" USING btree ("current_attempt_id") WHERE "jobs"."current_attempt_id" is not null;--> statement-breakpoint
CREATE UNIQUE INDEX "jobs_idempotency_key_uq" ON "jobs" USING btree ("idempotency_key") WHERE "jobs"."idempotency_key" is not null;--> statement-breakpoint
CREATE INDEX "jobs_finished_idx" ON "jobs" USING btree ("finished_at") WHERE "jobs"."finished_at" is not null;--> statement-breakpoint
CREATE INDEX "stale_reports_at_idx" ON "stale_reports" USING btree ("at");--> statement-breakpoint
CREATE INDEX "stale_reports_job_idx" ON "stale_reports" USING btree ("job_id");