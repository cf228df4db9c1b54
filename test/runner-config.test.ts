/**
 * The `leasehold-agent` configuration as Windows users write it, and the mistakes that must stop
 * the agent with exit code 2 and a message naming the field, not a bare error and exit code 1:
 * - a file (or token file) saved as UTF-16 with a byte order mark, as Windows PowerShell 5.1's `>`
 *   and `Out-File` write it, is read; UTF-16 without one is named as such;
 * - a `tls` file that cannot be read names its field (the SDK reads it only when connecting);
 * - a `url` the SDK cannot connect to names `url`;
 * - a duration that rounds to 0 ms (meaning "no limit") is refused, and so is one over 2^31 − 1 ms
 *   (Node fires such a timer after 1 ms: every job would time out at once).
 */
import { execFile } from 'node:child_process';
import { chmod, mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ConfigError, loadConfig, secretsOpenToOthers } from '../agent-client/src/runner/config.js';

const run = promisify(execFile);
const root = path.resolve(import.meta.dirname, '..');
const bin = path.join(root, 'agent-client/bin/leasehold-agent.mjs');
let work = '';
beforeAll(async () => {
  work = await mkdtemp(path.join(os.tmpdir(), 'leasehold-runner-config-'));
});
afterAll(async () => {
  if (work) await rm(work, { recursive: true, force: true });
});

const valid = { url: 'http://127.0.0.1:50051', token: 'lh_agent_x', queues: { q: { command: ['x'] } } };
const noEnv = {};
let n = 0;
async function file(content: Buffer | string): Promise<string> {
  const f = path.join(work, `file-${++n}`);
  await writeFile(f, content);
  return f;
}
const utf16le = (s: string) => Buffer.concat([Buffer.from([0xff, 0xfe]), Buffer.from(s, 'utf16le')]);
const utf16be = (s: string) => Buffer.concat([Buffer.from([0xfe, 0xff]), Buffer.from(s, 'utf16le').swap16()]);
/** The ConfigError message `loadConfig` throws for this file, or undefined when it accepts it. */
const refusal = (f: string) => loadConfig(f, noEnv).then(
  () => undefined,
  (err: unknown) => (err instanceof ConfigError ? err.message : `not a ConfigError: ${String(err)}`),
);

describe('the runner configuration', () => {
  it('reads a file saved as UTF-16 LE or BE with a byte order mark (PowerShell 5.1 `>`, Out-File), CRLF and non-ASCII included', async () => {
    const text = JSON.stringify({ ...valid, labels: { site: 'Zürich' } }, null, 2).replaceAll('\n', '\r\n');
    for (const bytes of [utf16le(text), utf16be(text), Buffer.concat([Buffer.from([0xef, 0xbb, 0xbf]), Buffer.from(text)])]) {
      const c = await loadConfig(await file(bytes), noEnv);
      expect(c).toMatchObject({ url: valid.url, token: valid.token, labels: { site: 'Zürich' } });
    }
  });

  it('says a file is UTF-16 without a byte order mark instead of a cryptic JSON error', async () => {
    const f = await file(Buffer.from(JSON.stringify(valid), 'utf16le'));
    expect(await refusal(f)).toBe(`${f}: holds NUL bytes: UTF-16 without a byte order mark? Save it as UTF-8`);
  });

  it('reads a token file saved as UTF-16 with a byte order mark', async () => {
    const tokenFile = await file(utf16le('lh_agent_from_powershell\r\n'));
    const c = await loadConfig(await file(JSON.stringify({ ...valid, token: undefined, tokenFile })), noEnv);
    expect(c.token).toBe('lh_agent_from_powershell');
  });

  it('knows which files hold a secret, and warns of those other users can read, with the fix', async () => {
    const tokenFile = await file('lh_agent_in_a_file\n');
    const key = await file('-----BEGIN PRIVATE KEY-----\n');
    const pem = await file('-----BEGIN CERTIFICATE-----\n');
    const inline = await file(JSON.stringify(valid));
    const fromFile = await file(JSON.stringify({ ...valid, token: undefined, tokenFile, tls: { ca: pem, cert: pem, key } }));
    const fromEnv = await file(JSON.stringify({ ...valid, token: undefined, tokenFile }));
    expect((await loadConfig(inline, noEnv)).secretFiles.map((f) => f.file)).toEqual([inline]);
    expect((await loadConfig(fromFile, noEnv)).secretFiles.map((f) => f.file)).toEqual([tokenFile, key]);
    // LEASEHOLD_TOKEN wins over tokenFile, which is then not read: no file holds the token used.
    expect((await loadConfig(fromEnv, { LEASEHOLD_TOKEN: 'lh_agent_env' })).secretFiles).toEqual([]);

    const c = await loadConfig(fromFile, noEnv);
    for (const f of [tokenFile, key]) await chmod(f, 0o600);
    expect(await secretsOpenToOthers(c.secretFiles)).toEqual([]);
    await chmod(tokenFile, 0o644);
    await chmod(key, 0o640);
    const open = await secretsOpenToOthers(c.secretFiles);
    expect(open.map((o) => [o.file, o.mode])).toEqual([[tokenFile, '0644'], [key, '0640']]);
    expect(open[0]!.message).toBe(
      `tokenFile ${tokenFile} can be read by other users of this machine (mode 0644): whoever reads it can act as this agent (take its jobs, report their results). Make it yours alone: chmod 600 '${tokenFile}'`,
    );
    expect(open[1]!.message).toMatch(/^tls\.key .* \(mode 0640\): whoever reads it can present this agent's client certificate\./);
    // On Windows modes say nothing: ACLs decide.
    expect(await secretsOpenToOthers(c.secretFiles, 'win32')).toEqual([]);
    // The configuration itself, when it holds the token; a name with a quote, quoted for the shell.
    const odd = path.join(work, "it's agent.json");
    await writeFile(odd, JSON.stringify(valid), { mode: 0o604 });
    await chmod(odd, 0o604);
    const [w] = await secretsOpenToOthers((await loadConfig(odd, noEnv)).secretFiles);
    expect(w!.message).toBe(
      `the configuration, which holds the token, ${odd} can be read by other users of this machine (mode 0604): whoever reads it can act as this agent (take its jobs, report their results). Make it yours alone: chmod 600 '${odd.replace("'", "'\\''")}'`,
    );
  });

  it('names the tls field whose file cannot be read, and wants cert and key together', async () => {
    const pem = await file('-----BEGIN CERTIFICATE-----\n');
    const missing = path.join(work, 'no-such.pem');
    for (const field of ['ca', 'cert', 'key'] as const) {
      const tls = { ca: pem, cert: pem, key: pem, [field]: missing };
      expect(await refusal(await file(JSON.stringify({ ...valid, tls })))).toBe(`tls.${field}: cannot read ${missing}: ENOENT`);
    }
    expect(await refusal(await file(JSON.stringify({ ...valid, tls: { ca: pem, cert: pem } })))).toBe('tls: give "cert" and "key" together (mTLS), or neither');
    expect(await refusal(await file(JSON.stringify({ ...valid, tls: { ca: pem } })))).toBeUndefined();
  });

  it('refuses an address the agent cannot connect to, naming url', async () => {
    for (const [url, where] of [
      ['ftp://coordinator:50051', 'url'],
      ['http://coordinator:50051/leasehold', 'url'],
      ['coordinator:99999', 'url'],
      ['http://two words:1', 'url'],
      [['http://ok:1', 'http://user@bad:1'], 'url.1'],
    ] as const) {
      expect(await refusal(await file(JSON.stringify({ ...valid, url })))).toMatch(new RegExp(`^${where.replace('.', '\\.')}: ".*" is not an address: use http://host:port, https://host:port or host:port$`));
    }
    for (const url of ['http://127.0.0.1:50051', 'https://coordinator.example.com', 'coordinator:50051', 'https://[::1]:50051']) {
      expect(await refusal(await file(JSON.stringify({ ...valid, url }))), url).toBeUndefined();
    }
  });

  it('refuses labels the coordinator would refuse at every Hello, naming them', async () => {
    expect(await refusal(await file(JSON.stringify({ ...valid, labels: { site: 'a\tb' } })))).toMatch(/^labels\.site: label values must not contain control characters/);
    expect(await refusal(await file(JSON.stringify({ ...valid, labels: { ['x'.repeat(65)]: 'y' } })))).toMatch(/label names must be at most 64 characters/);
    expect(await refusal(await file(JSON.stringify({ ...valid, labels: Object.fromEntries(Array.from({ length: 33 }, (_, i) => [`l${i}`, 'v'])) })))).toMatch(/^labels: must hold at most 32 labels/);
  });

  it('refuses a duration that rounds to 0 ms (it would mean no timeout)', async () => {
    expect(await refusal(await file(JSON.stringify({ ...valid, queues: { q: { command: ['x'], timeout: '0.4ms' } } })))).toBe('queues.q.timeout: "0.4ms" is less than 1 ms');
    expect(await refusal(await file(JSON.stringify({ ...valid, grace: '0.0001s' })))).toBe('grace: "0.0001s" is less than 1 ms');
    const c = await loadConfig(await file(JSON.stringify({ ...valid, queues: { q: { command: ['x'], timeout: '0.5ms', killGrace: '1.5s' } } })), noEnv);
    expect(c.queues.q).toMatchObject({ timeout: 1, killGrace: 1500 });
  });

  it('refuses a duration over 2^31 − 1 ms (Node would fire it after 1 ms), naming the field', async () => {
    const over = (v: string | number) => `${JSON.stringify(v)} is over the longest duration, 2147483647 ms (about 24.8 days)`;
    expect(await refusal(await file(JSON.stringify({ ...valid, queues: { q: { command: ['x'], timeout: '720h' } } })))).toBe(`queues.q.timeout: ${over('720h')}`);
    expect(await refusal(await file(JSON.stringify({ ...valid, queues: { q: { command: ['x'], killGrace: 3e9 } } })))).toBe(`queues.q.killGrace: ${over(3e9)}`);
    expect(await refusal(await file(JSON.stringify({ ...valid, grace: '1000h' })))).toBe(`grace: ${over('1000h')}`);
    expect(await refusal(await file(JSON.stringify({ ...valid, grace: 2147483648 })))).toBe(`grace: ${over(2147483648)}`);
    const c = await loadConfig(await file(JSON.stringify({ ...valid, grace: 2147483647, queues: { q: { command: ['x'], timeout: '596h' } } })), noEnv);
    expect([c.grace, c.queues.q!.timeout]).toEqual([2147483647, 596 * 3_600_000]);
  });

  it('stops the agent with exit code 2 naming the field for a missing tls file and a bad url', async () => {
    const missing = path.join(work, 'missing-ca.pem');
    const outboxDir = path.join(work, 'outbox');
    for (const [cfg, message] of [
      [{ ...valid, outboxDir, tls: { ca: missing } }, `leasehold-agent: invalid configuration: tls.ca: cannot read ${missing}: ENOENT`],
      [{ ...valid, outboxDir, url: 'ftp://coordinator:50051' }, 'leasehold-agent: invalid configuration: url: "ftp://coordinator:50051" is not an address'],
    ] as const) {
      const err = await run(process.execPath, [bin, '--config', await file(JSON.stringify(cfg))], { cwd: root, timeout: 30_000 }).then(
        () => ({ code: 0, stderr: '' }),
        (e: { code: number; stderr: string }) => e,
      );
      expect(err.code).toBe(2);
      expect(err.stderr).toContain(message);
    }
  }, 60_000);
});
