/**
 * What happens to attempts when an agent's stream drops and comes back: they are marked
 * suspect (visible to operators; their leases run down untouched), and a reconnect that lists
 * them in `Hello.resume` re-binds those still current and learns which are gone.
 */
import { z } from 'zod';
import { ok, type Outcome } from '../domain/outcomes.js';
import { check, checkAll, limits, schemas } from '../domain/validation.js';
import { run, statement, type Queryable } from './sql.js';

const ids = z.array(schemas.id).max(limits.heartbeatBatch, `must hold at most ${limits.heartbeatBatch} attempts`);

// Live attempts are their jobs rows (found by jobs_current_attempt_uq); suspect_since is not
// indexed, so marking is a HOT update.
const suspectSql = statement(
  'attemptsMarkSuspect',
  `UPDATE jobs_live SET suspect_since = coalesce(suspect_since, coalesce($2::timestamptz, now()))
   WHERE current_attempt_id = ANY($1::uuid[])
   RETURNING current_attempt_id AS id`,
);

/** Marks the live ones among `attemptIds` suspect; returns those marked. */
export async function attemptsMarkSuspect(db: Queryable, p: { attemptIds: string[]; now?: Date }): Promise<Outcome<string[]>> {
  const bad = check('attemptIds', ids, p.attemptIds);
  if (bad) return bad;
  if (p.attemptIds.length === 0) return ok([]);
  const rows = await run<{ id: string }>(db, suspectSql, [p.attemptIds, p.now ?? null]);
  return ok(rows.map((r) => r.id));
}

const resumeSql = statement(
  'attemptsResume',
  `UPDATE jobs_live SET suspect_since = NULL
   WHERE current_attempt_id = ANY($1::uuid[]) AND agent_id = $2
   RETURNING current_attempt_id AS id, status::text, id AS job_id`,
);

/** What a resume found. */
export interface Resumed {
  /** Still current and this agent's: bound again (claimed ones still need `start`). */
  resumed: Array<{ attemptId: string; jobId: string; status: 'claimed' | 'running' }>;
  /** Superseded, ended, unknown or another agent's: the agent must stop them. */
  gone: string[];
}

/** Re-binds the attempts an agent still runs after a reconnect; the rest are `gone`. */
export async function attemptsResume(db: Queryable, p: { agentId: string; attemptIds: string[] }): Promise<Outcome<Resumed>> {
  const bad = checkAll(check('agentId', schemas.agentId, p.agentId), check('attemptIds', ids, p.attemptIds));
  if (bad) return bad;
  if (p.attemptIds.length === 0) return ok({ resumed: [], gone: [] });
  const rows = await run<{ id: string; status: 'claimed' | 'running'; job_id: string }>(db, resumeSql, [p.attemptIds, p.agentId]);
  const live = new Set(rows.map((r) => r.id));
  return ok({
    resumed: rows.map((r) => ({ attemptId: r.id, jobId: r.job_id, status: r.status })),
    gone: p.attemptIds.filter((id) => !live.has(id)),
  });
}
