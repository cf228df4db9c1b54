-- rfc3339(t): a time as the API shows it (protobuf JSON of a Timestamp with millisecond
-- precision): UTC, milliseconds, none when they are zero. Notification bodies used microseconds,
-- which the API never shows, so a receiver comparing an event's times with GetJob's saw them differ.
CREATE OR REPLACE FUNCTION rfc3339(t timestamptz) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
  SELECT CASE WHEN t IS NULL THEN NULL
    WHEN floor(extract(milliseconds FROM t))::bigint % 1000 = 0 THEN to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
    ELSE to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') END
$$;
