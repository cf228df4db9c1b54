-- The lowest reader level a release must have to run on this database (schema.ts, schemaCompat;
-- docs/deploy.md, "Which releases can run on one database"). A release's reader level is the
-- number of migrations it ships. Every database this runs on has 0000 to 0020 applied (drizzle
-- applies them in order), and the last of those that an earlier release cannot run beside is 0019
-- (migrations/compat.json): a reader must ship at least 20 migrations, 0000 to 0019. migrate.ts
-- raises the value after later migrations (and sends NOTIFY leasehold_schema), never lowers it.
CREATE TABLE "schema_compat" (
	"one" boolean PRIMARY KEY DEFAULT true NOT NULL,
	"min_reader" integer NOT NULL,
	CONSTRAINT "schema_compat_one_row" CHECK ("schema_compat"."one")
);
--> statement-breakpoint
INSERT INTO "schema_compat" ("min_reader") VALUES (20);
