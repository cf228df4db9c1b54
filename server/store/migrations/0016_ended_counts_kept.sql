-- What ended per minute (GetStats' per-minute counts), kept rather than counted on every read
-- (server/store/counts.ts): the statements that end attempts and cancel jobs append here. The
-- last day's counts are written after the migrations (migrate.ts, a recount of that day).
CREATE TABLE "ended_counts" (
	"minute" timestamp with time zone NOT NULL,
	"kind" text NOT NULL,
	"n" bigint NOT NULL
);
