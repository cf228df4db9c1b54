-- attempts_created_missing_idx (schema.ts) is built CONCURRENTLY by migrate.ts, not here, like the
-- lists' indexes; migrate.ts then fills in `attempts.job_created_at` by batches through it.
SELECT 1;
