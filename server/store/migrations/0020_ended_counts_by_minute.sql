-- GetStats reads its window's minutes of the day kept through this, not every row of the day
-- (docs/performance.md, "Cost as the work grows"). ended_counts holds at most a day's minutes
-- per kind, so the index is built in moments.
CREATE INDEX "ended_counts_minute_idx" ON "ended_counts" USING btree ("minute");