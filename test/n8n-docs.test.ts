/**
 * docs/n8n.md's curl lines, run as pasted, in order, in one shell against a coordinator started
 * with LEASEHOLD_ADMIN_KEY=dev-admin-key (only the port differs: the test's coordinator listens
 * on a free one, and the `leasehold` command points at the test's database). Lines that copy an
 * id into a variable use jq, as the page says.
 */
import { execFile } from 'node:child_process';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';
import { useTestDb } from './helpers/db.js';
import { useCoordinator } from './helpers/coordinator.js';
import { checkInvariants } from './helpers/invariants.js';

const run = promisify(execFile);
const root = path.resolve(import.meta.dirname, '..');
const doc = readFileSync(path.join(root, 'docs/n8n.md'), 'utf8');
const t = useTestDb();
const lh = useCoordinator(t, { LEASEHOLD_ADMIN_KEY: 'dev-admin-key' });

/** The runnable lines of the page: curl calls, and assignments that capture a call's answer. */
const lines = doc.split('\n').filter((l) => l.startsWith('curl ') || /^[A-Z_]+=\$\((curl|npm) /.test(l));

describe('docs/n8n.md', () => {
  it('has a curl line for every gateway method', () => {
    for (const m of ['EnqueueJob', 'GetJob', 'ListJobs', 'CancelJob', 'ClaimJobs', 'StartAttempt', 'Heartbeat', 'CompleteAttempt', 'FailAttempt']) {
      expect(lines.some((l) => l.includes(`/${m} `)), m).toBe(true);
    }
    expect(lines.some((l) => l.includes('/healthz'))).toBe(true);
  });

  it('every line works as pasted against the coordinator', async () => {
    const port = new URL(lh.httpUrl).port;
    const script = ['set -euo pipefail'];
    lines.forEach((l, i) => {
      script.push(`printf '\\n@@${i}\\n'`, l.replaceAll('127.0.0.1:8080', `127.0.0.1:${port}`));
      const v = /^([A-Z_]+)=\$\(/.exec(l);
      if (v) script.push(`echo "$${v[1]}"`);
    });
    const { stdout } = await run('bash', ['-c', script.join('\n')], {
      cwd: root,
      env: { ...process.env, DATABASE_URL: t.url, LEASEHOLD_LOG_LEVEL: 'warn' },
      timeout: 60_000,
    });
    const out = stdout.split(/^@@\d+\n/m).slice(1).map((s) => s.trim());
    expect(out).toHaveLength(lines.length);
    const answer = (i: number) => {
      try {
        return JSON.parse(out[i]!) as Record<string, any>;
      } catch {
        throw new Error(`line ${i} did not answer JSON: ${lines[i]}\n${out[i]}`);
      }
    };
    const at = (fragment: string, nth = 0) => {
      const idx = lines.map((l, i) => (l.includes(fragment) ? i : -1)).filter((i) => i >= 0)[nth];
      if (idx === undefined) throw new Error(`no line with ${fragment} (#${nth})`);
      return idx;
    };

    expect(answer(at('/healthz'))).toEqual({ status: 'ok' });
    const jobId = out[at('JOB_ID=$(')]!;
    expect(jobId).toMatch(/^[0-9a-f-]{36}$/);
    expect(answer(at('/EnqueueJob', 1))).toMatchObject({ outcome: 'OUTCOME_DUPLICATE', job: { id: jobId, notifyUrl: 'http://127.0.0.1:5678/webhook/leasehold-events' } });
    expect(answer(at('R-9999'))).toMatchObject({ status: 409, outcome: 'conflict' });
    expect(answer(at('/GetJob'))).toMatchObject({ job: { id: jobId, status: 'JOB_STATUS_QUEUED' } });
    expect(answer(at('/ListJobs')).jobs.map((j: { id: string }) => j.id)).toEqual([jobId]);
    expect(out[at('AGENT_KEY=$(')]).toMatch(/^lh_key_/);
    expect(out[at('ATTEMPT_ID=$(')]).toMatch(/^[0-9a-f-]{36}$/);
    expect(answer(at('/StartAttempt'))).toMatchObject({ outcome: 'OUTCOME_OK', job: { status: 'JOB_STATUS_RUNNING', agentId: 'script-worker' } });
    expect(answer(at('/Heartbeat'))).toMatchObject({ outcome: 'OUTCOME_OK' });
    expect(answer(at('/CompleteAttempt', 0))).toMatchObject({ outcome: 'OUTCOME_OK', job: { status: 'JOB_STATUS_SUCCEEDED', result: { pages: 3 } } });
    expect(answer(at('/CompleteAttempt', 1))).toMatchObject({ outcome: 'OUTCOME_DUPLICATE', job: { result: { pages: 3 } } });
    expect(answer(at('/Heartbeat', 1))).toMatchObject({ status: 409, outcome: 'stale', current: { jobId, status: 'JOB_STATUS_SUCCEEDED', attemptNo: 1 } });
    expect(answer(at('/FailAttempt'))).toMatchObject({ outcome: 'OUTCOME_OK', job: { status: 'JOB_STATUS_DEAD', error: { message: 'printer on fire' } } });
    expect(answer(at('/CancelJob'))).toMatchObject({ outcome: 'OUTCOME_OK', job: { status: 'JOB_STATUS_CANCELED' } });
    expect(answer(at('has space'))).toMatchObject({ status: 400, outcome: 'invalid', field: 'queue' });
    expect(answer(at(`/ListJobs -H 'content-type: application/json' -d '{}'`))).toMatchObject({ status: 401, outcome: 'unauthenticated' });
    expect(answer(at(`"authorization: Bearer $AGENT_KEY" -d '{"queue":"reports","payload":{}}'`))).toMatchObject({ status: 403, outcome: 'forbidden' });
    await checkInvariants(t.pool);
  });
});
