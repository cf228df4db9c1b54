/**
 * The gateway's command line and keys: `leasehold keys add|list|revoke` (through the running
 * coordinator's AdminService) make keys that work on the HTTP gateway at once and stop at once;
 * `subscriptions add|list|remove|rotate`, `deliveries list|retry` and `webhooks secret` manage
 * notifications through the same API (no database access: they work against a remote
 * coordinator); the bootstrap admin key follows `LEASEHOLD_ADMIN_KEY`.
 */
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';
import { keyAuthenticate, keyBootstrap, keyCreate, keyRevoke, signingSecretGet, subscriptionCreate, subscriptionList } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, useCoordinator } from './helpers/coordinator.js';
import { rpc } from './helpers/http.js';
import { root } from './helpers/serve.js';

const exec = promisify(execFile);
const t = useTestDb();
const lh = useCoordinator(t);

/** Runs `leasehold <args>` against this file's coordinator and database; resolves with stdout, code and stderr. */
async function cli(...args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  return cliWith({}, ...args);
}
async function cliWith(extra: Record<string, string>, ...args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  const env = {
    ...process.env,
    // The commands go through the API: a database they could reach would hide a shortcut.
    DATABASE_URL: 'postgres://nobody:nothing@127.0.0.1:1/none',
    LEASEHOLD_DATA_DIR: '/nonexistent',
    LEASEHOLD_URL: lh.httpUrl,
    LEASEHOLD_KEY: ADMIN_KEY,
    LEASEHOLD_LOG_LEVEL: 'info',
    LEASEHOLD_LOG_FORMAT: 'json',
    ...extra,
  };
  try {
    const { stdout, stderr } = await exec(process.execPath, ['--import', 'tsx', 'server/cli.ts', ...args], { cwd: root, env });
    return { code: 0, stdout, stderr };
  } catch (e) {
    const err = e as { code: number; stdout: string; stderr: string };
    return { code: err.code, stdout: err.stdout, stderr: err.stderr };
  }
}

describe('leasehold keys', () => {
  it('adds a key that works on the gateway with its scopes, lists it without the secret, and revokes it at once', async () => {
    const [add, quiet] = await Promise.all([
      cli('keys', 'add', 'n8n-prod', '--scope', 'enqueue,read', '--json'),
      cli('keys', 'add', 'n8n-worker', '--scope', 'agent', '--quiet'),
    ]);
    expect(add.code).toBe(0);
    const made = JSON.parse(add.stdout) as { name: string; key: string; scopes: string[] };
    expect(made).toMatchObject({ name: 'n8n-prod', scopes: ['enqueue', 'read'] });
    // stdout holds only the answer.
    expect(add.stderr).toBe('');
    expect(quiet.stdout.trim()).toMatch(/^lh_key_[A-Za-z0-9_-]{43}$/);
    expect(await keyCreate(t.pool, { name: 'admin', scopes: ['admin'] })).toMatchObject({ outcome: 'invalid', field: 'name', message: expect.stringMatching(/kept for LEASEHOLD_ADMIN_KEY/) });
    expect(await keyCreate(t.pool, { name: 'nope', scopes: ['enqueue', 'root'] })).toMatchObject({ outcome: 'invalid', field: 'scopes.1', message: 'must be one of enqueue, read, agent, admin' });
    expect(await keyCreate(t.pool, { name: 'n8n-prod', scopes: ['read'] })).toMatchObject({ outcome: 'conflict' });

    const enq = await rpc(lh.httpUrl, 'leasehold.v1.JobService/EnqueueJob', { queue: 'cli', payload: {} }, made.key);
    expect(enq.status).toBe(200);
    expect((await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/ClaimJobs', { queues: ['cli'] }, quiet.stdout.trim())).json.jobs[0].job.agentId).toBe(
      'n8n-worker',
    );

    const list = await cli('keys', 'list', '--json');
    const rows = JSON.parse(list.stdout) as Array<Record<string, unknown>>;
    expect(rows.map((r) => r.name)).toEqual(expect.arrayContaining(['admin', 'n8n-prod', 'n8n-worker']));
    expect(list.stdout).not.toContain(made.key);
    expect(list.stdout).not.toMatch(/key_?hash/i);
    const stored = (await t.pool.query(`SELECT key_hash FROM api_keys WHERE name = 'n8n-prod'`)).rows[0].key_hash;
    expect(stored).toMatch(/^[0-9a-f]{64}$/);

    expect((await cli('keys', 'revoke', 'n8n-prod')).stdout).toMatch(/key n8n-prod revoked/);
    expect((await rpc(lh.httpUrl, 'leasehold.v1.JobService/ListJobs', {}, made.key)).status).toBe(401);
    expect((await keyRevoke(t.pool, { name: 'never-was' })).outcome).toBe('not_found');
  });

  it('makes LEASEHOLD_ADMIN_KEY the key named admin: created if absent, replaced when it changes, revoked stays revoked', async () => {
    // useCoordinator started with LEASEHOLD_ADMIN_KEY=test-admin-key.
    expect(await keyAuthenticate(t.pool, { key: 'test-admin-key' })).toMatchObject({ outcome: 'ok', value: { name: 'admin', scopes: ['admin'] } });
    expect(await keyBootstrap(t.pool, { key: 'test-admin-key' })).toEqual({ outcome: 'ok', value: { created: false, replaced: false } });
    expect(await keyBootstrap(t.pool, { key: 'rotated-admin-key' })).toEqual({ outcome: 'ok', value: { created: true, replaced: true } });
    expect((await keyAuthenticate(t.pool, { key: 'test-admin-key' })).outcome).toBe('not_found');
    await keyRevoke(t.pool, { name: 'admin' });
    expect(await keyBootstrap(t.pool, { key: 'rotated-admin-key' })).toEqual({ outcome: 'ok', value: { created: false, replaced: false } });
    expect((await keyAuthenticate(t.pool, { key: 'rotated-admin-key' })).outcome).toBe('forbidden');
    expect(await keyBootstrap(t.pool, { key: 'test-admin-key' })).toEqual({ outcome: 'ok', value: { created: true, replaced: true } });
    expect((await keyAuthenticate(t.pool, { key: 'test-admin-key' })).outcome).toBe('ok');
  });
});

describe('leasehold subscriptions, deliveries and webhooks', () => {
  it('adds a subscription with its secret, lists it, rotates it, retries failed deliveries, prints the notify secret, removes it — all through the API', async () => {
    const add = await cli('subscriptions', 'add', '*', 'http://127.0.0.1:1/hook', '--events', 'job.dead', '--json');
    expect(add.code).toBe(0);
    const sub = (JSON.parse(add.stdout) as { subscription: { id: string; secret: string; events: string[]; queue: string } }).subscription;
    expect(sub).toMatchObject({ queue: '*', events: ['job.dead'] });
    expect(sub.secret).toMatch(/^whsec_/);
    // A second subscription of the same URL shares its secret (one secret per URL).
    const other = JSON.parse((await cli('subscriptions', 'add', 'reports', 'http://127.0.0.1:1/hook', '--json')).stdout).subscription;
    expect(other.secret).toBe(sub.secret);
    const [withSecrets, secret, plain] = await Promise.all([cli('subscriptions', 'list', '--json', '--show-secrets'), cli('webhooks', 'secret'), cli('subscriptions', 'list')]);
    expect(await subscriptionCreate(t.pool, { queue: '*', url: 'http://127.0.0.1:1/hook' })).toMatchObject({ outcome: 'conflict' });
    expect(await subscriptionCreate(t.pool, { queue: 'q', url: 'https://x.example/', events: ['job.done'] })).toMatchObject({ outcome: 'invalid', field: 'events.0' });
    expect(await subscriptionList(t.pool)).toEqual([expect.not.objectContaining({ secret: expect.anything() }), expect.anything()]);
    expect(JSON.parse(withSecrets.stdout)).toMatchObject([{ id: sub.id, secret: sub.secret }, { id: other.id, secret: sub.secret }]);
    expect(plain.stdout).not.toContain(sub.secret);
    expect(secret.stdout.trim()).toBe(await signingSecretGet(t.pool));
    // Bad input is refused by the API, named, exit code 2; the same URL twice is 1.
    const bad = await cli('subscriptions', 'add', 'q', 'file:///etc/passwd');
    expect(bad).toMatchObject({ code: 2, stderr: expect.stringMatching(/url/) });
    expect((await cli('subscriptions', 'add', '*', 'http://127.0.0.1:1/hook')).code).toBe(1);

    // Rotating gives the URL (both subscriptions) a new secret.
    const rotated = JSON.parse((await cli('subscriptions', 'rotate', sub.id, '--json')).stdout);
    expect(rotated).toMatchObject({ subscription: { id: sub.id }, alsoRotated: [other.id] });
    expect(rotated.subscription.secret).not.toBe(sub.secret);
    expect((await t.pool.query(`SELECT DISTINCT secret FROM subscriptions`)).rows).toEqual([{ secret: rotated.subscription.secret }]);

    // A failed delivery, as the deliverer leaves one at the cap.
    const job = (await rpc(lh.httpUrl, 'leasehold.v1.JobService/EnqueueJob', { queue: 'subs', payload: {}, maxAttempts: 1 }, 'test-admin-key')).json.job;
    const { rows } = await t.pool.query(
      `WITH e AS (INSERT INTO webhook_events (id, job_id, type, body, created_at, alerted_at)
                  VALUES (gen_random_uuid(), $1, 'job.dead', '{}', now(), now()) RETURNING id)
       INSERT INTO webhook_deliveries (event_id, subscription_id, url, status, attempts, next_attempt_at)
       SELECT e.id, $2, 'http://127.0.0.1:1/hook', 'failed', 12, now() + interval '1 hour' FROM e RETURNING id`,
      [job.id, sub.id],
    );
    const failed = await cli('deliveries', 'list', '--status', 'failed', '--json');
    expect(JSON.parse(failed.stdout)).toMatchObject([{ id: String(rows[0].id), status: 'failed', attempts: 12, type: 'job.dead', jobId: job.id }]);
    expect((await cli('deliveries', 'list', '--status', 'lost')).code).toBe(2);
    expect((await cli('deliveries', 'retry')).code).toBe(2);
    expect((await cli('deliveries', 'retry', '--all-failed')).stdout).toMatch(new RegExp(`1 delivery queued again: ${rows[0].id}`));
    const after = (await t.pool.query(`SELECT status::text, attempts FROM webhook_deliveries WHERE id = $1`, [rows[0].id])).rows[0];
    expect(after.status).not.toBe('failed');
    expect((await cli('deliveries', 'retry', String(rows[0].id))).code).toBe(1); // not failed any more

    // Only with the admin scope.
    const reader = (await keyCreate(t.pool, { name: 'subs-reader', scopes: ['read'] })) as { value: { key: string } };
    const denied = await cliWith({ LEASEHOLD_KEY: reader.value.key }, 'subscriptions', 'list');
    expect(denied.code).toBe(4);

    expect((await cli('subscriptions', 'remove', sub.id)).stdout).toMatch(/removed/);
    expect((await cli('subscriptions', 'remove', sub.id)).code).toBe(1);
    expect((await t.pool.query(`SELECT count(*)::int AS n FROM webhook_deliveries`)).rows[0].n).toBe(0);
  });
});
