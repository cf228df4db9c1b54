-- jobs_finished_queue_idx and jobs_unsucceeded_idx (schema.ts) are built CONCURRENTLY by migrate.ts
-- after the migrations, not here: a migration runs in a transaction, and a plain CREATE INDEX would
-- stop every write to jobs while it reads a week of history.
SELECT 1;
