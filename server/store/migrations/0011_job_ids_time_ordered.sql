-- Job ids in time order: a UUIDv7 (RFC 9562), 48 bits of milliseconds since the epoch, then the
-- version, the variant and 74 random bits (gen_random_uuid()'s, which come from the server's
-- strong random source). A random id lands anywhere in the primary key, and in every index
-- that carries a job id (attempts', steps'): with a week of history those indexes outgrow
-- memory and every enqueue, claim and completion touched a page of their cold middle. A
-- time-ordered id lands at their right edge, beside the other live jobs.
-- `at` is for tools that write history (seed-history); the default is the moment of the call.
CREATE OR REPLACE FUNCTION job_id_v7(at timestamptz DEFAULT clock_timestamp()) RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
  SELECT encode(
    set_bit(set_bit(
      overlay(uuid_send(gen_random_uuid())
              PLACING substring(int8send(floor(extract(epoch FROM at) * 1000)::int8) FROM 3)
              FROM 1 FOR 6),
      52, 1), 53, 1),
    'hex')::uuid
$$;--> statement-breakpoint
-- Existing jobs keep their ids; new ones are time-ordered. A catalog change: nothing rewritten.
ALTER TABLE "jobs" ALTER COLUMN "id" SET DEFAULT job_id_v7();
