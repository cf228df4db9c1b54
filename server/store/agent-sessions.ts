/**
 * The registry of open agent streams (`agent_sessions`), so that every replica can list the
 * streams of all of them. A coordinator inserts a row when a stream opens, deletes it when it
 * closes, and stamps `seen_at` on its rows periodically; rows whose coordinator stopped stamping
 * them (it was killed) are swept by any replica. The live state of a session (what it holds) is
 * read from `attempts`, which is the truth; only what does not change is kept here.
 */
import { z } from 'zod';
import { ok, type Outcome } from '../domain/outcomes.js';
import { check, checkAll, limits, schemas } from '../domain/validation.js';
import { run, statement, type Queryable } from './sql.js';

/** One open stream, as registered. */
export interface SessionRecord {
  id: string;
  agentId: string;
  coordinatorId: string;
  queues: string[];
  labels: Record<string, string>;
  slots: number;
  connectedAt: Date;
}

const registerSql = statement(
  'sessionRegister',
  `INSERT INTO agent_sessions (id, agent_id, coordinator_id, queues, labels, slots, connected_at)
   VALUES ($1, $2, $3, $4::text[], $5::jsonb, $6, $7)
   ON CONFLICT (id) DO NOTHING`,
);

// Built once (a zod schema costs tens of microseconds to build): every Hello is checked.
const queuesSchema = z.array(schemas.queue).max(limits.queuesPerClaim);
const slotsSchema = z.int().min(1);

/** Records an open stream (a repeat is ignored). */
export async function sessionRegister(db: Queryable, s: SessionRecord): Promise<Outcome<null>> {
  const bad = checkAll(
    check('id', schemas.id, s.id),
    check('agentId', schemas.agentId, s.agentId),
    check('coordinatorId', schemas.id, s.coordinatorId),
    check('queues', queuesSchema, s.queues),
    check('labels', schemas.labels, s.labels),
    check('slots', slotsSchema, s.slots),
  );
  if (bad) return bad;
  await run(db, registerSql, [s.id, s.agentId, s.coordinatorId, s.queues, JSON.stringify(s.labels), s.slots, s.connectedAt]);
  return ok(null);
}

const removeSql = statement('sessionRemove', `DELETE FROM agent_sessions WHERE id = $1`);

/** Forgets a stream that closed. */
export async function sessionRemove(db: Queryable, p: { id: string }): Promise<void> {
  await run(db, removeSql, [p.id]);
}

const touchSql = statement(
  'sessionsTouch',
  `UPDATE agent_sessions SET seen_at = now() WHERE coordinator_id = $1 AND id = ANY($2::uuid[]) RETURNING id`,
);

/**
 * Stamps `seen_at` on the streams a coordinator holds now; returns how many rows were there. A
 * row swept meanwhile (the coordinator stalled past the sweep) is not brought back here: the
 * caller registers it again.
 */
export async function sessionsTouch(db: Queryable, p: { coordinatorId: string; ids: string[] }): Promise<string[]> {
  if (p.ids.length === 0) return [];
  const rows = await run<{ id: string }>(db, touchSql, [p.coordinatorId, p.ids]);
  return rows.map((r) => r.id);
}

// Rows nobody stamped for staleAfter: their coordinator died. SKIP LOCKED, so replicas sweeping
// at once take different rows.
const sweepSql = statement(
  'sessionsSweep',
  `WITH s AS (
     SELECT id FROM agent_sessions WHERE seen_at < now() - make_interval(secs => $1::float8 / 1000.0)
     LIMIT 1000 FOR UPDATE SKIP LOCKED
   )
   DELETE FROM agent_sessions a USING s WHERE a.id = s.id RETURNING a.id, a.agent_id, a.coordinator_id`,
);

/** Deletes the rows of coordinators that stopped stamping them `staleAfterMs` ago. */
export async function sessionsSweep(db: Queryable, p: { staleAfterMs: number }): Promise<Array<{ id: string; agentId: string; coordinatorId: string }>> {
  const rows = await run<{ id: string; agent_id: string; coordinator_id: string }>(db, sweepSql, [p.staleAfterMs]);
  return rows.map((r) => ({ id: r.id, agentId: r.agent_id, coordinatorId: r.coordinator_id }));
}

const removeCoordinatorSql = statement('sessionsRemoveCoordinator', `DELETE FROM agent_sessions WHERE coordinator_id = $1`);

/** Forgets every stream of a coordinator that is stopping. */
export async function sessionsRemoveCoordinator(db: Queryable, p: { coordinatorId: string }): Promise<void> {
  await run(db, removeCoordinatorSql, [p.coordinatorId]);
}

const drainSql = statement(
  'sessionsDrain',
  `UPDATE agent_sessions SET draining_since = coalesce(draining_since, now())
   WHERE agent_id = $1 AND seen_at >= now() - make_interval(secs => $2::float8 / 1000.0)
   RETURNING id`,
);

/** Marks the live streams of an agent draining; returns their ids. */
export async function sessionsDrain(db: Queryable, p: { agentId: string; staleAfterMs: number }): Promise<Outcome<string[]>> {
  const bad = check('agentId', schemas.agentId, p.agentId);
  if (bad) return bad;
  const rows = await run<{ id: string }>(db, drainSql, [p.agentId, p.staleAfterMs]);
  return ok(rows.map((r) => r.id));
}
