/**
 * The `leasehold` command where its output or its connection ends early, as a real process (the
 * package's bin): a reader that stops before the answer ends (`jobs ls | head -1`, `stats |
 * head -4`) ends the command quietly with exit code 0; a coordinator behind a TLS certificate of a
 * private CA is "cannot reach" (exit code 3) with the way to trust the CA, and with
 * `NODE_EXTRA_CA_CERTS` the same call goes through. The coordinator is a stand-in AdminService
 * (Connect's node adapter, HTTP/1.1 or HTTPS) answering what the test gives: what is tested is the
 * command's end, not the answers, and 500 jobs need no database.
 */
import { spawn } from 'node:child_process';
import http from 'node:http';
import https from 'node:https';
import type { AddressInfo } from 'node:net';
import { rm } from 'node:fs/promises';
import { create } from '@bufbuild/protobuf';
import { timestampFromDate } from '@bufbuild/protobuf/wkt';
import { Code, ConnectError } from '@connectrpc/connect';
import { connectNodeAdapter } from '@connectrpc/connect-node';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { AdminService } from '../gen/leasehold/v1/admin_service_pb.js';
import { JobSchema, JobStatus } from '../gen/leasehold/v1/job_pb.js';
import { createApiClients, EXIT, explainFailure } from '../server/transport/admin-client.js';
import { makePrivateCa, type PrivateCa } from './helpers/private-ca.js';
import { root } from './helpers/serve.js';

const jobs = Array.from({ length: 500 }, (_, i) =>
  create(JobSchema, { id: `01J${String(i).padStart(23, '0')}`, queue: 'pipe', status: JobStatus.QUEUED, attemptNo: 0, maxAttempts: 3, createdAt: timestampFromDate(new Date()) }),
);
const adapter = connectNodeAdapter({
  routes: (router) =>
    router.service(AdminService, {
      listJobs: () => ({ jobs }),
      getStats: () => ({
        windowMinutes: 15,
        depths: Array.from({ length: 200 }, (_, i) => ({ queue: `q${i}`, status: JobStatus.QUEUED, count: BigInt(i) })),
      }),
    }),
});

let plain: http.Server;
let secure: https.Server;
let ca: PrivateCa;
const url = (s: http.Server | https.Server, scheme: string, host = '127.0.0.1') => `${scheme}://${host}:${(s.address() as AddressInfo).port}`;

beforeAll(async () => {
  ca = await makePrivateCa();
  plain = http.createServer(adapter);
  secure = https.createServer(ca.pem, adapter);
  await Promise.all([plain, secure].map((s) => new Promise<void>((r) => s.listen(0, '127.0.0.1', () => r()))));
});
afterAll(async () => {
  for (const s of [plain, secure]) {
    s.closeAllConnections();
    await new Promise((r) => s.close(r));
  }
  await rm(ca.dir, { recursive: true, force: true });
});

interface Ended {
  code: number | null;
  stdout: string;
  stderr: string;
}

/**
 * Runs the bin; with `closeStdout` the reading end of its stdout is closed at once, as `head`
 * does once it has its lines: every write of the answer meets a closed pipe (EPIPE).
 */
function leasehold(args: string[], opts: { closeStdout?: boolean; env?: Record<string, string> } = {}): Promise<Ended> {
  const child = spawn(process.execPath, ['server/leasehold.mjs', ...args], {
    cwd: root,
    env: { ...process.env, LEASEHOLD_KEY: 'any-key', LEASEHOLD_LOG_LEVEL: 'warn', ...opts.env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let stdout = '';
  let stderr = '';
  if (opts.closeStdout) child.stdout.destroy();
  else child.stdout.on('data', (d: Buffer) => (stdout += d));
  child.stderr.on('data', (d: Buffer) => (stderr += d));
  return new Promise((resolve) => child.on('close', (code) => resolve({ code, stdout, stderr })));
}

describe('leasehold with its stdout closed early', () => {
  it('jobs ls | head -1: ends quietly, exit code 0, no stack trace', async () => {
    const whole = await leasehold(['jobs', 'ls', '--limit', '500', '--url', url(plain, 'http')]);
    expect(whole.code, whole.stderr).toBe(0);
    expect(whole.stdout.trim().split('\n')).toHaveLength(501);

    const cut = await leasehold(['jobs', 'ls', '--limit', '500', '--url', url(plain, 'http')], { closeStdout: true });
    expect(cut).toMatchObject({ code: 0, stderr: '' });
  });

  it('stats | head -4 and --json alike', async () => {
    const [table, json] = await Promise.all([
      leasehold(['stats', '--url', url(plain, 'http')], { closeStdout: true }),
      leasehold(['jobs', 'ls', '--json', '--url', url(plain, 'http')], { closeStdout: true }),
    ]);
    expect(table).toMatchObject({ code: 0, stderr: '' });
    expect(json).toMatchObject({ code: 0, stderr: '' });
  });
});

describe('leasehold against a TLS certificate of a private CA', () => {
  it('cannot reach it (exit code 3) and says how to trust the CA; with NODE_EXTRA_CA_CERTS it answers', async () => {
    const refused = await leasehold(['stats', '--url', url(secure, 'https', 'localhost')]);
    expect(refused.code, refused.stderr).toBe(3);
    expect(refused.stderr).toBe(
      `error: cannot reach the coordinator at ${url(secure, 'https', 'localhost')}: unable to verify the first certificate (its TLS certificate is not trusted here: if a private CA signed it, trust that CA with NODE_EXTRA_CA_CERTS=ca.pem)\n`,
    );

    const trusted = await leasehold(['stats', '--url', url(secure, 'https', 'localhost')], { env: { NODE_EXTRA_CA_CERTS: ca.ca } });
    expect(trusted.code, trusted.stderr).toBe(0);
    expect(trusted.stdout).toMatch(/^q199\s+199\s/m);
  });
});

describe('explainFailure: the TLS failures of a connection are "cannot reach" (exit code 3), each with what to change', () => {
  const failure = async (target: string) => {
    const api = createApiClients({ url: target, key: 'k' });
    const err = await api.admin.getStats({}).then(() => undefined, (e: unknown) => e);
    return explainFailure(err, { url: target, key: 'k' });
  };

  it('an https:// URL to a listener without TLS, an http:// URL to one with TLS', async () => {
    const noTls = await failure(url(plain, 'https'));
    expect(noTls.exitCode).toBe(EXIT.unreachable);
    expect(noTls.message).toMatch(/: the TLS handshake failed \(wrong version number\) \(an https:\/\/ --url to a listener without TLS\? use http:\/\/\)$/);
    const tlsOnly = await failure(url(secure, 'http'));
    expect(tlsOnly.exitCode).toBe(EXIT.unreachable);
    expect(tlsOnly.message).toMatch(/with TLS on, https:\/\/\)$/);
  });

  it('a certificate for another host, or out of date', () => {
    const target = { url: 'https://leasehold.example:8080', key: 'k' };
    const cause = Object.assign(new Error("Hostname/IP does not match certificate's altnames: Host: leasehold.example. is not in the cert's altnames: DNS:localhost"), {
      code: 'ERR_TLS_CERT_ALTNAME_INVALID',
    });
    const f = explainFailure(new ConnectError(cause.message, Code.Internal, undefined, undefined, cause), target);
    expect(f).toEqual({
      exitCode: EXIT.unreachable,
      message: `cannot reach the coordinator at https://leasehold.example:8080: ${cause.message} (its TLS certificate is refused: check its dates, and that it names the host of --url)`,
    });
    // What the server says is never taken for the client's own failure: no code on a cause.
    expect(explainFailure(new ConnectError('certificate has expired', Code.Internal), target).exitCode).toBe(EXIT.failed);
  });
});
