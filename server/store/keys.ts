/**
 * API keys of gateway callers, with scopes (`enqueue`, `read`, `agent`, `admin`). A key is 256
 * random bits shown once at creation and stored as its SHA-256 hash, like an agent token; it is
 * authenticated by that hash and revoked by stamping `revoked_at`. Coordinators keep verified
 * keys in memory for a while (`core/credential-cache.ts`), so revoking one, and replacing the
 * bootstrap key, also sends a `credentials` NOTIFY in the same statement: every coordinator
 * forgets the key when it commits. `LEASEHOLD_ADMIN_KEY` becomes the key named `admin` at start.
 *
 * A key's name shares one namespace with agent ids (agents.ts): a key with the `agent` scope acts
 * as the agent its name names, so `keyCreate` refuses an agent's id, and `keyAuthenticate` refuses
 * a key with the `agent` scope whose name an agent has anyway (a pair made before that rule): it
 * would act for that agent, and go on doing so after the agent's revocation.
 */
import { randomBytes, timingSafeEqual } from 'node:crypto';
import { asc } from 'drizzle-orm';
import { drizzle } from 'drizzle-orm/node-postgres';
import type pg from 'pg';
import { z } from 'zod';
import { conflict, forbidden, invalid, notFound, ok, type Outcome } from '../domain/outcomes.js';
import { check, checkAll, schemas } from '../domain/validation.js';
import { hashSecret, identityNameLock } from './agents.js';
import { credentialsNotifySql } from './notify.js';
import { apiKeys, type ApiKeyRow } from './schema.js';
import { API_KEY_SCOPES, type ApiKeyScope } from '../domain/statuses.js';
import { run, statement, withTransaction, type Queryable } from './sql.js';

/** The name of the key made from `LEASEHOLD_ADMIN_KEY`; `keyCreate` refuses it. */
export const BOOTSTRAP_KEY_NAME = 'admin';

const scopesSchema = z
  .array(z.enum(API_KEY_SCOPES, `must be one of ${API_KEY_SCOPES.join(', ')}`))
  .min(1, 'must name at least one scope');

// Run after `identityNameLock` in the same transaction, so an agent created under the lock
// meanwhile is seen (agents.ts says why a lock and a statement of its own).
const createSql = statement(
  'keyCreate',
  `WITH taken AS (SELECT EXISTS (SELECT 1 FROM agents WHERE id = $1) AS by_agent),
   ins AS (
     INSERT INTO api_keys (name, key_hash, scopes) SELECT $1, $2, $3::text[] FROM taken WHERE NOT taken.by_agent
     ON CONFLICT (name) DO NOTHING RETURNING name
   )
   SELECT taken.by_agent, (SELECT name FROM ins) AS name FROM taken`,
);

/**
 * Creates a key; returns it once (only its hash is stored). A name taken by a key, or by an agent
 * (revoked ones too: agent ids and key names are one namespace), is `conflict`.
 */
export async function keyCreate(
  db: Queryable,
  p: { name: string; scopes: string[] },
): Promise<Outcome<{ name: string; key: string; scopes: ApiKeyScope[] }>> {
  const bad = checkAll(check('name', schemas.agentId, p.name), check('scopes', scopesSchema, p.scopes));
  if (bad) return bad;
  if (p.name === BOOTSTRAP_KEY_NAME) return invalid('name', `"${BOOTSTRAP_KEY_NAME}" is kept for LEASEHOLD_ADMIN_KEY`);
  const scopes = [...new Set(p.scopes)] as ApiKeyScope[];
  const key = `lh_key_${randomBytes(32).toString('base64url')}`;
  const [row] = await withTransaction(db, async (tx) => {
    await identityNameLock(tx, { name: p.name });
    return run<{ by_agent: boolean; name: string | null }>(tx, createSql, [p.name, hashSecret(key), scopes]);
  });
  if (row?.by_agent) {
    return conflict(`${p.name} is an agent's id: a key cannot take it, since a key with the agent scope would act as that agent (pick another name)`);
  }
  if (!row?.name) return conflict(`key ${p.name} already exists (revoke it and pick another name)`);
  return ok({ name: p.name, key, scopes });
}

// Created if no key has this hash. The name `admin` belongs to the bootstrap key: when the
// variable changed, the row is replaced (the old bootstrap key stops working, and coordinators
// that hold it verified are told to forget it). A bootstrap key an operator revoked stays
// revoked while the variable is unchanged.
const bootstrapSql = statement(
  'keyBootstrap',
  `WITH b AS (
     INSERT INTO api_keys (name, key_hash, scopes)
     SELECT $1, $2, '{admin}' WHERE NOT EXISTS (SELECT 1 FROM api_keys WHERE key_hash = $2)
     ON CONFLICT (name) DO UPDATE SET key_hash = EXCLUDED.key_hash, scopes = EXCLUDED.scopes, revoked_at = NULL,
       created_at = now(), last_used_at = NULL
     RETURNING name, (xmax = 0) AS inserted
   )
   SELECT b.inserted FROM b LEFT JOIN LATERAL (SELECT ${credentialsNotifySql('key', 'b.name')} WHERE NOT b.inserted) n ON true`,
);

/** Makes `key` the bootstrap admin key (`LEASEHOLD_ADMIN_KEY`) unless it is one already. */
export async function keyBootstrap(db: Queryable, p: { key: string }): Promise<Outcome<{ created: boolean; replaced: boolean }>> {
  const bad = check('key', z.string().min(1, 'must not be empty').max(512, 'must be at most 512 characters'), p.key);
  if (bad) return bad;
  const [row] = await run<{ inserted: boolean }>(db, bootstrapSql, [BOOTSTRAP_KEY_NAME, hashSecret(p.key)]);
  return ok({ created: Boolean(row), replaced: Boolean(row && !row.inserted) });
}

// One read by the key's hash (with the agent of the key's name, for a key with the agent scope);
// last_used_at is stamped at most once a minute.
const authSql = statement(
  'keyAuthenticate',
  `WITH k AS (
     SELECT k.name, k.key_hash, k.scopes, k.revoked_at, a.id IS NOT NULL AS agent_named, a.revoked_at AS agent_revoked_at
     FROM api_keys k LEFT JOIN agents a ON a.id = k.name AND 'agent' = ANY (k.scopes)
     WHERE k.key_hash = $1
   ), t AS (
     UPDATE api_keys SET last_used_at = now()
     WHERE key_hash = $1 AND revoked_at IS NULL AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute')
   )
   SELECT * FROM k`,
);

/**
 * Who holds this key: its name and scopes; `forbidden` if it was revoked, or if it has the
 * `agent` scope and its name is an agent's id (revoked or not: such a key would act as that
 * agent, `keyCreate` no longer makes one, and the agent's revocation must stop it too);
 * `not_found` if it is unknown. The lookup is by SHA-256 of the key, so its timing depends only
 * on the hash of what was presented; the stored hash is then compared in constant time.
 */
export async function keyAuthenticate(db: Queryable, p: { key: string }): Promise<Outcome<{ name: string; scopes: ApiKeyScope[] }>> {
  if (typeof p.key !== 'string' || p.key.length === 0 || p.key.length > 512) return notFound('unknown key');
  const hash = hashSecret(p.key);
  const [row] = await run<{ name: string; key_hash: string; scopes: ApiKeyScope[]; revoked_at: Date | null; agent_named: boolean; agent_revoked_at: Date | null }>(
    db,
    authSql,
    [hash],
  );
  if (!row || !timingSafeEqual(Buffer.from(row.key_hash, 'hex'), Buffer.from(hash, 'hex'))) return notFound('unknown key');
  if (row.revoked_at) return forbidden(`key ${row.name} was revoked`);
  if (row.agent_named) {
    return forbidden(
      `key ${row.name} has the agent scope and ${row.name} is the id of an agent${row.agent_revoked_at ? ' that was revoked' : ''}: ` +
        'it cannot act as that agent (revoke the key and make one with another name)',
    );
  }
  return ok({ name: row.name, scopes: row.scopes });
}

// The NOTIFY rides in the same statement, so it is sent exactly when the revocation commits.
const revokeSql = statement(
  'keyRevoke',
  `WITH r AS (UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()) WHERE name = $1 RETURNING name)
   SELECT r.name, ${credentialsNotifySql('key', 'r.name')} FROM r`,
);

/**
 * Revokes a key: the database refuses it from now on, and every coordinator forgets it when the
 * NOTIFY this sends arrives (within a second; the one that revoked it, at once).
 */
export async function keyRevoke(db: Queryable, p: { name: string }): Promise<Outcome<{ name: string }>> {
  const bad = check('name', schemas.agentId, p.name);
  if (bad) return bad;
  const [row] = await run(db, revokeSql, [p.name]);
  return row ? ok({ name: p.name }) : notFound(`key ${p.name} not found`);
}

/** All keys, oldest first, without their hashes. */
export async function keyList(db: Queryable): Promise<Array<Omit<ApiKeyRow, 'keyHash'>>> {
  const rows = await drizzle(db as pg.Pool).select().from(apiKeys).orderBy(asc(apiKeys.createdAt), asc(apiKeys.name));
  return rows.map(({ keyHash: _, ...r }) => r);
}
