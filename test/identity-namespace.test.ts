/**
 * Agent ids and API key names are one namespace: a key with the `agent` scope acts as the agent
 * its name names (`requireAgent`), so
 * - `keyCreate` refuses an agent's id and `agentCreate` a key's name (revoked ones too), and
 *   nothing is written: through the store verbs and AdminService;
 * - two creates of one name race safely: the second waits for the first's transaction (the
 *   advisory lock on the name) and then sees its row; a burst of racing pairs makes one of each;
 * - a key with the `agent` scope that shares its name with an agent anyway (a pair made before
 *   the rule, written here in SQL) is refused: it cannot start or complete the agent's attempts,
 *   nor claim as it, before or after the agent's revocation. A key without the agent scope keeps
 *   its other scopes.
 * Before the fix the key was made, and it started and completed the agent's attempt (with a
 * forged result), and went on claiming as the agent after its revocation.
 */
import { randomBytes } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import { agentCreate, hashSecret, jobEnqueue, keyCreate, keyRevoke, agentRevoke, withTransaction } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, useCoordinator, waitFor } from './helpers/coordinator.js';
import { rpc } from './helpers/http.js';

const t = useTestDb();
const lh = useCoordinator(t);
const ATTEMPTS = 'leasehold.v1.AttemptService';
const admin = (method: string, body: unknown) => rpc(lh.httpUrl, `leasehold.v1.AdminService/${method}`, body, ADMIN_KEY);

const count = async (table: 'agents' | 'api_keys', name: string) =>
  (await t.pool.query(`SELECT count(*)::int AS n FROM ${table} WHERE ${table === 'agents' ? 'id' : 'name'} = $1`, [name])).rows[0].n as number;

/** A key written in SQL, as a database made before the rule may hold one: returns the key. */
async function legacyKey(name: string, scopes: string[]): Promise<string> {
  const key = `lh_key_${randomBytes(32).toString('base64url')}`;
  await t.pool.query(`INSERT INTO api_keys (name, key_hash, scopes) VALUES ($1, $2, $3::text[])`, [name, hashSecret(key), scopes]);
  return key;
}

describe('one namespace for agent ids and key names', () => {
  it('keyCreate refuses an agent id and agentCreate a key name, revoked ones included; nothing is written', async () => {
    expect((await agentCreate(t.pool, { agentId: 'ns-agent' })).outcome).toBe('ok');
    const k = await keyCreate(t.pool, { name: 'ns-agent', scopes: ['agent'] });
    expect(k).toMatchObject({ outcome: 'conflict', message: expect.stringMatching(/^ns-agent is an agent's id/) });
    expect(await keyCreate(t.pool, { name: 'ns-agent', scopes: ['read'] })).toMatchObject({ outcome: 'conflict' });
    expect(await count('api_keys', 'ns-agent')).toBe(0);

    expect((await keyCreate(t.pool, { name: 'ns-key', scopes: ['enqueue'] })).outcome).toBe('ok');
    const a = await agentCreate(t.pool, { agentId: 'ns-key' });
    expect(a).toMatchObject({ outcome: 'conflict', message: expect.stringMatching(/^ns-key is the name of an API key/) });
    expect(await count('agents', 'ns-key')).toBe(0);

    // Revoked names stay taken (as they do within each table).
    expect((await agentCreate(t.pool, { agentId: 'ns-gone-agent' })).outcome).toBe('ok');
    expect((await agentRevoke(t.pool, { agentId: 'ns-gone-agent' })).outcome).toBe('ok');
    expect(await keyCreate(t.pool, { name: 'ns-gone-agent', scopes: ['agent'] })).toMatchObject({ outcome: 'conflict' });
    expect((await keyCreate(t.pool, { name: 'ns-gone-key', scopes: ['agent'] })).outcome).toBe('ok');
    expect((await keyRevoke(t.pool, { name: 'ns-gone-key' })).outcome).toBe('ok');
    expect(await agentCreate(t.pool, { agentId: 'ns-gone-key' })).toMatchObject({ outcome: 'conflict' });

    // The same names within a table: as before.
    expect(await agentCreate(t.pool, { agentId: 'ns-agent' })).toMatchObject({ outcome: 'conflict', message: 'agent ns-agent already exists (revoke it and pick another name)' });
    expect(await keyCreate(t.pool, { name: 'ns-key', scopes: ['read'] })).toMatchObject({ outcome: 'conflict', message: 'key ns-key already exists (revoke it and pick another name)' });
  });

  it('AdminService answers CreateKey and CreateAgent on a name the other holds with 409, naming why', async () => {
    expect((await admin('CreateAgent', { agentId: 'ns-admin-agent' })).status).toBe(200);
    const k = await admin('CreateKey', { name: 'ns-admin-agent', scopes: ['agent'] });
    expect(k).toMatchObject({ status: 409, json: { outcome: 'conflict', message: expect.stringContaining("ns-admin-agent is an agent's id") } });
    expect((await admin('CreateKey', { name: 'ns-admin-key', scopes: ['agent'] })).status).toBe(200);
    const a = await admin('CreateAgent', { agentId: 'ns-admin-key' });
    expect(a).toMatchObject({ status: 409, json: { outcome: 'conflict', message: expect.stringContaining('ns-admin-key is the name of an API key') } });
  });

  it('a create waits for a racing create of the same name to commit, then sees its row', async () => {
    for (const [first, second] of [
      ['agent', 'key'],
      ['key', 'agent'],
    ] as const) {
      const name = `ns-race-${first}`;
      const create = (kind: 'agent' | 'key', db: Parameters<typeof agentCreate>[0]) =>
        kind === 'agent' ? agentCreate(db, { agentId: name }) : keyCreate(db, { name, scopes: ['agent'] });
      let release!: () => void;
      const gate = new Promise<void>((r) => (release = r));
      let made!: () => void;
      const inserted = new Promise<void>((r) => (made = r));
      // The first create runs inside a transaction that stays open: its row is not committed yet.
      const holder = withTransaction(t.pool, async (tx) => {
        expect((await create(first, tx)).outcome).toBe('ok');
        made();
        await gate;
      });
      await inserted;
      const racing = create(second, t.pool);
      await waitFor(`the ${second} create to wait for the name's lock`, async () => {
        const { rows } = await t.pool.query(`SELECT count(*)::int AS n FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`);
        return rows[0].n > 0;
      }, 5000).finally(release);
      await holder;
      expect(await racing, `${second} after ${first}`).toMatchObject({ outcome: 'conflict' });
      expect(await count('agents', name) + (await count('api_keys', name))).toBe(1);
    }
  });

  it('of racing creates of one name on separate connections, one wins', async () => {
    const [p1, p2] = [t.newPool(10), t.newPool(10)];
    const names = Array.from({ length: 40 }, (_, i) => `ns-burst-${i}`);
    const results = await Promise.all(
      names.map(async (name, i) => {
        const a = () => agentCreate(p1, { agentId: name });
        const k = () => keyCreate(p2, { name, scopes: ['agent'] });
        const [x, y] = i % 2 ? await Promise.all([a(), k()]) : (await Promise.all([k(), a()])).reverse();
        return [x!.outcome, y!.outcome];
      }),
    );
    for (const [i, r] of results.entries()) expect(r.filter((o) => o === 'ok'), names[i]).toHaveLength(1);
    const { rows } = await t.pool.query(
      `SELECT count(*)::int AS n FROM agents a JOIN api_keys k ON k.name = a.id WHERE a.id LIKE 'ns-burst-%'`,
    );
    expect(rows[0].n).toBe(0);
  });
});

describe('a key with the agent scope named like an agent (made before the rule)', () => {
  it("cannot start or complete the agent's attempt, nor claim as it, before or after the agent's revocation", async () => {
    const token = await lh.agent('ns-twin');
    const key = await legacyKey('ns-twin', ['agent']);
    const enq = await jobEnqueue(t.pool, { queue: 'ns-twin-q', payload: {} });
    if (enq.outcome !== 'ok') throw new Error(JSON.stringify(enq));
    const claimed = await rpc(lh.httpUrl, `${ATTEMPTS}/ClaimJobs`, { queues: ['ns-twin-q'], maxJobs: 1 }, token);
    expect(claimed.status).toBe(200);
    const attemptId = claimed.json.jobs[0].attemptId as string;
    const jobId = enq.value.id;

    for (const [method, body] of [
      ['StartAttempt', { jobId, attemptId }],
      ['CompleteAttempt', { jobId, attemptId, result: { forged: true } }],
      ['ClaimJobs', { queues: ['ns-twin-q'] }],
    ] as const) {
      const r = await rpc(lh.httpUrl, `${ATTEMPTS}/${method}`, body, key);
      expect({ method, status: r.status }).toEqual({ method, status: 401 });
      expect(r.json.message).toBe('key ns-twin has the agent scope and ns-twin is the id of an agent: it cannot act as that agent (revoke the key and make one with another name)');
    }
    const row = (await t.pool.query(`SELECT status::text, result FROM jobs WHERE id = $1`, [jobId])).rows[0];
    expect(row).toEqual({ status: 'claimed', result: null });
    // The agent's own token is unaffected.
    expect((await rpc(lh.httpUrl, `${ATTEMPTS}/StartAttempt`, { jobId, attemptId }, token)).status).toBe(200);

    expect((await admin('RevokeAgent', { agentId: 'ns-twin' })).status).toBe(200);
    expect((await rpc(lh.httpUrl, `${ATTEMPTS}/ClaimJobs`, { queues: ['ns-twin-q'] }, token)).status).toBe(401);
    const after = await rpc(lh.httpUrl, `${ATTEMPTS}/ClaimJobs`, { queues: ['ns-twin-q'] }, key);
    expect(after).toMatchObject({ status: 401, json: { message: expect.stringContaining('ns-twin is the id of an agent that was revoked') } });
  });

  it("is refused when the agent was revoked before the key was made; a key without the agent scope keeps its scopes", async () => {
    expect((await agentCreate(t.pool, { agentId: 'ns-late' })).outcome).toBe('ok');
    expect((await agentRevoke(t.pool, { agentId: 'ns-late' })).outcome).toBe('ok');
    const key = await legacyKey('ns-late', ['agent', 'read']);
    for (let i = 0; i < 2; i++) {
      // Twice: a refusal is never cached.
      const r = await rpc(lh.httpUrl, `${ATTEMPTS}/ClaimJobs`, { queues: ['ns-late-q'] }, key);
      expect(r).toMatchObject({ status: 401, json: { message: expect.stringContaining('ns-late is the id of an agent that was revoked') } });
    }
    expect((await rpc(lh.httpUrl, 'leasehold.v1.JobService/ListJobs', {}, key)).status).toBe(401);

    expect((await agentCreate(t.pool, { agentId: 'ns-reader' })).outcome).toBe('ok');
    const reader = await legacyKey('ns-reader', ['read']);
    expect((await rpc(lh.httpUrl, 'leasehold.v1.JobService/ListJobs', {}, reader)).status).toBe(200);
  });
});
