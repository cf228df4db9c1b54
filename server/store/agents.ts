/**
 * Agent identities: created with a random token that is shown once and stored as its SHA-256
 * hash (tokens are 256 random bits, so a fast hash is enough), authenticated by that hash,
 * revoked by stamping `revoked_at` and, in the same statement, a `credentials` NOTIFY that makes
 * every coordinator forget the token it verified (`core/credential-cache.ts`).
 */
import { createHash, randomBytes, timingSafeEqual } from 'node:crypto';
import { asc } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/node-postgres';
import type pg from 'pg';
import { conflict, forbidden, notFound, ok, type Outcome } from '../domain/outcomes.js';
import { check, schemas } from '../domain/validation.js';
import { credentialsNotifySql } from './notify.js';
import { agents, type AgentRow } from './schema.js';
import { run, statement, type Queryable } from './sql.js';

/** SHA-256 of a secret, hex: what is stored and looked up. */
export const hashSecret = (secret: string) => createHash('sha256').update(secret, 'utf8').digest('hex');

/** Compares two secrets in constant time (through their hashes, so lengths do not leak). */
export function secretsEqual(a: string, b: string): boolean {
  return timingSafeEqual(createHash('sha256').update(a).digest(), createHash('sha256').update(b).digest());
}

const createSql = statement(
  'agentCreate',
  `INSERT INTO agents (id, token_hash) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING RETURNING id, created_at`,
);

/** Creates an agent and returns its token, which is not stored and cannot be shown again. */
export async function agentCreate(db: Queryable, p: { agentId: string }): Promise<Outcome<{ agentId: string; token: string }>> {
  const bad = check('agentId', schemas.agentId, p.agentId);
  if (bad) return bad;
  const token = `lh_agent_${randomBytes(32).toString('base64url')}`;
  const [row] = await run(db, createSql, [p.agentId, hashSecret(token)]);
  if (!row) return conflict(`agent ${p.agentId} already exists (revoke it and pick another name)`);
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

/** All agents, oldest first. */
export async function agentList(db: Queryable): Promise<AgentRow[]> {
  return drizzle(db as pg.Pool).select().from(agents).orderBy(asc(agents.createdAt));
}
