/**
 * The store: every SQL statement of Leasehold, as verbs taking `(db | tx, params)`. The state
 * machine, the fence, and which file and statement serve each transition: README.md here.
 */
export * from './claim.js';
export * from './start.js';
export * from './heartbeat.js';
export * from './complete.js';
export * from './fail.js';
export * from './backoff.js';
export { attemptEndSql, attemptJson, endedColumn, movedRowSql, notifiedJob } from './ends.js';
export { attemptWhere, explain, type Lookup } from './explain.js';
export { reportStale, staleReportList } from './stale-reports.js';
export * from './enqueue.js';
export { randomAttemptId } from './ids.js';
export * from './cancel.js';
export * from './requeue.js';
export * from './job-get.js';
export { jobList, jobSearch, type JobSearchParams, type ListParams } from './job-list.js';
export * from './rescue.js';
export * from './steps.js';
export * from './agents.js';
export * from './suspect-resume.js';
export * from './notify.js';
export { type Job, type JobSummary, toJob } from './rows.js';
export { StoreError, withTransaction, type Queryable } from './sql.js';
export { openDatabase, createPool, redact, type Database } from './database.js';
export { migrateDatabase, migrationsFolder } from './migrate.js';
export { compatInfo, schemaCompatGet, schemaCompatRaise, schemaTooNewMessage, type CompatInfo, type CompatMark } from './schema-compat.js';
export * from './keys.js';
export * from './deliveries.js';
export * from './ping.js';
export * from './purge.js';
export * from './stats.js';
export { endedCountsReconcile, jobCounts, jobCountsCompact, jobCountsReconcile, type CountDrift } from './counts.js';
export * from './agent-sessions.js';
export { liveChurn, liveVacuum, type LiveChurn } from './vacuum.js';
