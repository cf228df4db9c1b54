-- An attempt's row is written only by the statement that ends the attempt, which holds its job's
-- row as it writes, and jobPurge deletes it with its job: the foreign key checked what that
-- statement had just locked, a lookup per attempt (27 % of the completion statement's time).
ALTER TABLE "attempts" DROP CONSTRAINT "attempts_job_id_jobs_id_fk";
