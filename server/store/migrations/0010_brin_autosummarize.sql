-- BRIN indexes summarize a page range as soon as it fills (an autovacuum work item), not only at
-- VACUUM: reads of recent minutes (GetStats) no longer scan every page written since the last one.
-- ALTER, not drop and create: no rebuild, and nothing waits on a build of a large table.
ALTER INDEX "attempts_ended_brin" SET (autosummarize = on);--> statement-breakpoint
ALTER INDEX "job_events_at_brin" SET (autosummarize = on);
