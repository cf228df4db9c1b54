/**
 * Agent identities: created with a random token that is shown once and stored as its SHA-256
 * hash (tokens are 256 random bits, so a fast hash is enough), authenticated by that hash,
 * revoked by stamping `revoked_at` and, in the same statement, a `credentials` NOTIFY that makes
 * every coordinator forget the token it verified (`core/credential-cache.ts`); and what operators
 * see of them (`agentOverview`: each agent's open streams and the attempts it holds).
 *
 * Agent ids and API key names are one namespace: a key with the `agent` scope acts as the agent
 * its name names (`transport/auth.ts`, `requireAgent`), so a key may not take an agent's id nor an
 * agent a key's name, revoked ones included (`agentCreate`, `keyCreate`, under `identityNameLock`),
 * and a key that shares its name with an agent anyway (made before this rule) is refused as an
 * agent (`keyAuthenticate`).
 */
import { createHash, randomBytes } from 'node:crypto';
import { conflict, forbidden, notFound, ok, type Outcome } from '../domain/outcomes.js';
import type { AttemptStatus } from '../domain/statuses.js';
import { check, schemas } from '../domain/validation.js';
import { credentialsNotifySql } from './notify.js';
import { camelRow } from './rows.js';
import type { AgentSessionRow } from './schema.js';
import { run, statement, withTransaction, type Queryable } from './sql.js';

/** SHA-256 of a secret, hex: what is stored and looked up. */
export const hashSecret = (secret: string) => createHash('sha256').update(secret, 'utf8').digest('hex');

// Agent ids and key names are one namespace, and no unique index spans two tables. So both
// creates take a transaction-scoped advisory lock on the name first (`identityNameLock`), then
// insert in a statement of their own unless the other table holds the name. Under READ COMMITTED
// each statement reads what had committed when it began: a create that waited for the lock sees
// the row of the one that held it, committed with the lock's release. (One statement that took
// the lock and checked would not: its snapshot predates the wait. SERIALIZABLE would refuse one
// of two racing creates with a serialization failure to retry, where the lock just orders them.)
// Two names whose hashes collide only wait for each other.
const NAME_LOCK = 0x6c68_6964; // "lhid": an arbitrary key, used for nothing else
const nameLockSql = statement('identityNameLock', `SELECT pg_advisory_xact_lock(${NAME_LOCK}, hashtext($1))`);

/**
 * Takes the lock under which agents and keys are created with `name` (until the transaction
 * ends): `agentCreate` and `keyCreate` call it in their transaction, before checking the other
 * table in a statement of their own.
 */
export async function identityNameLock(tx: Queryable, p: { name: string }): Promise<void> {
  await run(tx, nameLockSql, [p.name]);
}

const createSql = statement(
  'agentCreate',
  `WITH taken AS (SELECT EXISTS (SELECT 1 FROM api_keys WHERE name = $1) AS by_key),
   ins AS (
     INSERT INTO agents (id, token_hash) SELECT $1, $2 FROM taken WHERE NOT taken.by_key
     ON CONFLICT (id) DO NOTHING RETURNING id
   )
   SELECT taken.by_key, (SELECT id FROM ins) AS id FROM taken`,
);

/**
 * Creates an agent and returns its token, which is not stored and cannot be shown again. An id
 * taken by an agent, or by an API key (revoked ones too: they share one namespace), is `conflict`.
 */
export async function agentCreate(db: Queryable, p: { agentId: string }): Promise<Outcome<{ agentId: string; token: string }>> {
  const bad = check('agentId', schemas.agentId, p.agentId);
  if (bad) return bad;
  const token = `lh_agent_${randomBytes(32).toString('base64url')}`;
  const [row] = await withTransaction(db, async (tx) => {
    await identityNameLock(tx, { name: p.agentId });
    return run<{ by_key: boolean; id: string | null }>(tx, createSql, [p.agentId, hashSecret(token)]);
  });
  if (row?.by_key) {
    return conflict(`${p.agentId} is the name of an API key: an agent cannot take it, since a key with the agent scope acts as the agent of its name (pick another)`);
  }
  if (!row?.id) return conflict(`agent ${p.agentId} already exists (revoke it and pick another name)`);
  return ok({ agentId: p.agentId, token });
}

const authSql = statement(
  'agentAuthenticate',
  `UPDATE agents SET last_seen_at = now() WHERE token_hash = $1 RETURNING id, revoked_at`,
);

/**
 * Who holds this token: the agent, `forbidden` if it was revoked, `not_found` if it is unknown
 * (or names another agent than `agentId`, when given).
 */
export async function agentAuthenticate(db: Queryable, p: { token: string; agentId?: string }): Promise<Outcome<{ agentId: string }>> {
  if (typeof p.token !== 'string' || p.token.length === 0 || p.token.length > 512) return notFound('unknown agent token');
  const [row] = await run<{ id: string; revoked_at: Date | null }>(db, authSql, [hashSecret(p.token)]);
  if (!row || (p.agentId !== undefined && row.id !== p.agentId)) return notFound('unknown agent token');
  if (row.revoked_at) return forbidden(`agent ${row.id} was revoked`);
  return ok({ agentId: row.id });
}

const revokeSql = statement(
  'agentRevoke',
  `WITH r AS (UPDATE agents SET revoked_at = coalesce(revoked_at, now()) WHERE id = $1 RETURNING id, revoked_at)
   SELECT r.id, r.revoked_at, ${credentialsNotifySql('agent', 'r.id')} FROM r`,
);

/**
 * Revokes an agent: the database refuses its token from now on, and every coordinator forgets
 * the token when the NOTIFY this sends arrives (within a second; AdminService.RevokeAgent also
 * tells every coordinator to end the agent's open streams). `revokedAt` is the first
 * revocation's time.
 */
export async function agentRevoke(db: Queryable, p: { agentId: string }): Promise<Outcome<{ agentId: string; revokedAt: Date }>> {
  const bad = check('agentId', schemas.agentId, p.agentId);
  if (bad) return bad;
  const [row] = await run<{ id: string; revoked_at: Date }>(db, revokeSql, [p.agentId]);
  return row ? ok({ agentId: p.agentId, revokedAt: row.revoked_at }) : notFound(`agent ${p.agentId} not found`);
}

/** An attempt an agent holds now. */
export interface HeldAttempt {
  attemptId: string;
  jobId: string;
  queue: string;
  agentId: string;
  attemptNo: number;
  status: Extract<AttemptStatus, 'claimed' | 'running'>;
  claimedAt: Date;
  startedAt: Date | null;
  leaseExpiresAt: Date | null;
  suspectSince: Date | null;
}

/** An agent, its open streams and what it holds. */
export interface AgentOverview {
  agentId: string;
  /** False: a key with the agent scope holding attempts (no agents row). */
  registered: boolean;
  createdAt: Date | null;
  revokedAt: Date | null;
  lastSeenAt: Date | null;
  sessions: AgentSessionRow[];
  attempts: HeldAttempt[];
}

const agentsSql = statement('adminAgents', `SELECT * FROM agents WHERE ($1::text IS NULL OR id = $1) ORDER BY created_at, id`);
const sessionsSql = statement(
  'adminAgentSessions',
  `SELECT * FROM agent_sessions
   WHERE ($1::text IS NULL OR agent_id = $1) AND seen_at >= now() - make_interval(secs => $2::float8 / 1000.0)
   ORDER BY connected_at, id`,
);
// Live attempts are held jobs' rows; jobs_current_attempt_uq holds exactly those.
const heldSql = statement(
  'adminHeldAttempts',
  `SELECT j.current_attempt_id AS attempt_id, j.id AS job_id, j.queue, j.agent_id, j.attempt_no, j.status::text AS status,
     j.claimed_at, j.started_at, j.lease_expires_at, j.suspect_since
   FROM jobs_live j
   WHERE j.current_attempt_id IS NOT NULL AND ($1::text IS NULL OR j.agent_id = $1)
   ORDER BY j.claimed_at, j.current_attempt_id`,
);

/**
 * Every agent (or one) with its live streams (rows stamped within `staleAfterMs`) and the
 * attempts it holds; revoked agents that hold nothing only with `includeRevoked`. Agents that
 * hold attempts through an API key (no agents row) come last.
 */
export async function agentOverview(
  db: Queryable,
  p: { agentId?: string; includeRevoked?: boolean; staleAfterMs: number },
): Promise<Outcome<AgentOverview[]>> {
  const bad = p.agentId === undefined ? undefined : check('agentId', schemas.agentId, p.agentId);
  if (bad) return bad;
  return withTransaction(
    db,
    async (tx) => {
      const id = p.agentId ?? null;
      const agents = await run<Record<string, unknown>>(tx, agentsSql, [id]);
      const sessions = (await run<Record<string, unknown>>(tx, sessionsSql, [id, p.staleAfterMs])).map((r) => camelRow<AgentSessionRow>(r));
      const held = (await run<Record<string, unknown>>(tx, heldSql, [id])).map((r) => camelRow<HeldAttempt>(r));
      const out = new Map<string, AgentOverview>();
      for (const a of agents) {
        out.set(a.id as string, {
          agentId: a.id as string,
          registered: true,
          createdAt: a.created_at as Date,
          revokedAt: (a.revoked_at as Date | null) ?? null,
          lastSeenAt: (a.last_seen_at as Date | null) ?? null,
          sessions: [],
          attempts: [],
        });
      }
      const entry = (agentId: string) => {
        let e = out.get(agentId);
        if (!e) {
          e = { agentId, registered: false, createdAt: null, revokedAt: null, lastSeenAt: null, sessions: [], attempts: [] };
          out.set(agentId, e);
        }
        return e;
      };
      for (const s of sessions) entry(s.agentId).sessions.push(s);
      for (const h of held) entry(h.agentId).attempts.push(h);
      return ok(
        [...out.values()].filter((a) => p.includeRevoked || !a.revokedAt || a.attempts.length > 0 || a.sessions.length > 0),
      );
    },
    { mode: 'REPEATABLE READ, READ ONLY' },
  );
}
