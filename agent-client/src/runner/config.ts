/**
 * The `leasehold-agent` configuration file: validated with zod, every error naming the field
 * (`queues.resize.timeout: …`). Durations are milliseconds or strings like `90s`, `10m`. The
 * file and the token file may be UTF-8 or, with a byte order mark, UTF-16 (what Windows
 * PowerShell 5.1's `>` and `Out-File` write); the TLS files named must be readable.
 */
import { readFile, stat } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { z } from 'zod';
import { parseUrl } from '../channel.js';

/** A bad configuration: the message names the field. The CLI exits with code 2. */
export class ConfigError extends Error {
  override readonly name = 'ConfigError';
}

const units: Record<string, number> = { ms: 1, s: 1000, m: 60_000, h: 3_600_000 };
/**
 * The longest duration: 2^31 − 1 ms, about 24.8 days, the most a Node timer waits. Past it Node
 * warns (TimeoutOverflowWarning) and fires after 1 ms: every job would time out at once.
 */
export const MAX_DURATION_MS = 2 ** 31 - 1;
const tooLong = (v: number | string) => `${JSON.stringify(v)} is over the longest duration, ${MAX_DURATION_MS} ms (about 24.8 days)`;
const duration = z.union([z.number(), z.string()], 'must be milliseconds or a duration like 90s').transform((v, ctx) => {
  if (typeof v === 'number') {
    if (Number.isInteger(v) && v > 0 && v <= MAX_DURATION_MS) return v;
    ctx.addIssue({ code: 'custom', message: Number.isInteger(v) && v > 0 ? tooLong(v) : `${v} is not a positive whole number of milliseconds` });
    return z.NEVER;
  }
  const m = /^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$/.exec(v);
  if (!m || Number(m[1]) <= 0) {
    ctx.addIssue({ code: 'custom', message: `${JSON.stringify(v)} is not a duration: use e.g. 500ms, 90s, 10m, 1h` });
    return z.NEVER;
  }
  const ms = Math.round(Number(m[1]) * units[m[2]!]!);
  // Rounded to nothing it would mean "no limit" where a limit was asked for.
  if (ms < 1) {
    ctx.addIssue({ code: 'custom', message: `${JSON.stringify(v)} is less than 1 ms` });
    return z.NEVER;
  }
  if (ms > MAX_DURATION_MS) {
    ctx.addIssue({ code: 'custom', message: tooLong(v) });
    return z.NEVER;
  }
  return ms;
});

/** A coordinator address in a form the SDK connects to (channel.ts `parseUrl`). */
const address = z.string().superRefine((v, ctx) => {
  if (!v.trim()) return void ctx.addIssue({ code: 'custom', message: 'is required: the coordinator address, e.g. http://127.0.0.1:50051' });
  const bad = () => ctx.addIssue({ code: 'custom', message: `${JSON.stringify(v)} is not an address: use http://host:port, https://host:port or host:port` });
  let target: string;
  try {
    target = parseUrl(v, undefined).target;
  } catch {
    return void bad();
  }
  let u: URL;
  try {
    u = new URL(`http://${target}`);
  } catch {
    return void bad();
  }
  if (!u.hostname || u.username || u.password || u.search || u.hash) bad();
});

// As the coordinator checks them at Hello, so that a bad label stops the agent at start, naming
// it, rather than at every connection: at most 32, printable (no control characters, no lone
// surrogates), names 1–64 and values up to 256 characters.
const labelText = (what: string) =>
  z
    .string()
    .refine((s) => s.isWellFormed(), `${what} must be well-formed Unicode`)
    .refine((s) => !/[\u0000-\u001f\u007f]/.test(s), `${what} must not contain control characters`);
const labels = z
  .record(
    labelText('label names').min(1, 'label names must not be empty').max(64, 'label names must be at most 64 characters'),
    labelText('label values').max(256, 'label values must be at most 256 characters'),
  )
  .refine((r) => Object.keys(r).length <= 32, 'must hold at most 32 labels');

const queueName = z.string().regex(/^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$/, 'queue names are letters, digits and _ . : - (starting with a letter or digit)');

const command = z
  .object({
    /** The executable and its arguments: `["C:\\Tools\\resize.exe", "--fast"]`. Spaces inside an element are kept. */
    command: z.array(z.string().min(1, 'must not be empty')).min(1, 'must name the executable'),
    /** Run through the shell (cmd.exe on Windows, /bin/sh elsewhere); the command is then one string. */
    shell: z.boolean().default(false),
    cwd: z.string().min(1).optional(),
    /** Extra environment variables for the command. */
    env: z.record(z.string(), z.string()).default({}),
    /** Killed (with its children) when it runs longer. Default: no limit. */
    timeout: duration.optional(),
    /**
     * Exit codes that mean "try again later"; any other non-zero code fails the job for good.
     * 1 to 4294967295: Windows exit codes are unsigned 32-bit numbers (elsewhere they stop at 255).
     */
    retryableExitCodes: z.array(z.int().min(1).max(0xffffffff)).default([]),
    /** Time between the polite stop (SIGTERM / taskkill) and the forced one. Default 5 s. */
    killGrace: duration.default(5000),
  })
  .strict();

export const configSchema = z
  .object({
    /** The coordinator's gRPC address, or a list of replicas to fail over between. */
    url: z.union([address, z.array(address).min(1, 'must list at least one address')], 'must be an address or a list of addresses'),
    /** The agent token, or `tokenFile`, or the LEASEHOLD_TOKEN environment variable. */
    token: z.string().min(1).optional(),
    tokenFile: z.string().min(1).optional(),
    slots: z.int().min(1).max(1000).default(1),
    outboxDir: z.string().min(1).optional(),
    labels: labels.default({}),
    /** Per queue, the command that runs its jobs. */
    queues: z.record(queueName, command).refine((q) => Object.keys(q).length > 0, 'must configure at least one queue'),
    /** How long running commands may take to finish on shutdown. Default 30 s. */
    grace: duration.default(30_000),
    tls: z.union([z.boolean(), z.object({ ca: z.string().optional(), cert: z.string().optional(), key: z.string().optional() }).strict()]).optional(),
  })
  .strict();

export type AgentConfig = z.output<typeof configSchema> & {
  token: string;
  outboxDir: string;
  /** The files that hold a secret: the token's (this configuration's own, or `tokenFile`) and `tls.key`. */
  secretFiles: SecretFile[];
};

/** A file holding a secret, and what the secret lets whoever reads it do. */
export interface SecretFile {
  what: string;
  file: string;
  grants: string;
}
const AS_AGENT = 'act as this agent (take its jobs, report their results)';
export type CommandConfig = z.output<typeof command>;

/** Where the outbox goes by default: `%ProgramData%\leasehold\outbox` on Windows, `~/.leasehold/outbox` elsewhere. */
export function defaultOutboxDir(platform = process.platform, env = process.env, home = os.homedir()): string {
  if (platform === 'win32') return path.win32.join(env.ProgramData ?? 'C:\\ProgramData', 'leasehold', 'outbox');
  return path.join(home, '.leasehold', 'outbox');
}

/**
 * A text file's bytes as text: UTF-8 (a byte order mark dropped) or, with a byte order mark,
 * UTF-16 LE or BE (Windows PowerShell 5.1's `>` and `Out-File` write UTF-16 LE). Throws a
 * `ConfigError` naming `what` for UTF-16 without a byte order mark (NUL bytes), which no JSON
 * or token holds.
 */
export function decodeText(b: Buffer, what: string): string {
  if (b[0] === 0xff && b[1] === 0xfe) return b.subarray(2).toString('utf16le');
  if (b[0] === 0xfe && b[1] === 0xff) {
    const le = Buffer.from(b.subarray(2, b.length - (b.length % 2)));
    return le.swap16().toString('utf16le');
  }
  if (b.includes(0)) throw new ConfigError(`${what}: holds NUL bytes: UTF-16 without a byte order mark? Save it as UTF-8`);
  return b.toString('utf8').replace(/^\uFEFF/, ''); // Notepad writes a byte order mark
}

/** Reads a file named by the configuration; a `ConfigError` naming `field` when it cannot. */
async function readNamed(field: string, file: string): Promise<Buffer> {
  return readFile(file).catch((err: NodeJS.ErrnoException) => {
    throw new ConfigError(`${field}: cannot read ${file}: ${err.code ?? err.message}`);
  });
}

/** Validates a parsed configuration; throws `ConfigError` naming the first bad field. */
export async function parseConfig(raw: unknown, env = process.env): Promise<AgentConfig> {
  const r = configSchema.safeParse(raw);
  if (!r.success) {
    const issue = r.error.issues[0]!;
    const where = issue.path.length ? issue.path.join('.') : '(the file)';
    // A record's bad key (a label name): zod says only "Invalid key in record"; the key's schema says why.
    const msg =
      issue.code === 'unrecognized_keys'
        ? `unknown field(s) ${issue.keys.map((k) => JSON.stringify(k)).join(', ')}`
        : issue.code === 'invalid_key'
          ? (issue.issues[0]?.message ?? issue.message)
          : issue.message;
    throw new ConfigError(`${where}: ${msg}`);
  }
  const c = r.data;
  let token = c.token ?? env.LEASEHOLD_TOKEN;
  const secretFiles: SecretFile[] = [];
  if (!token && c.tokenFile) {
    token = decodeText(await readNamed('tokenFile', c.tokenFile), `tokenFile ${c.tokenFile}`).trim();
    secretFiles.push({ what: 'tokenFile', file: c.tokenFile, grants: AS_AGENT });
  }
  if (!token) throw new ConfigError('token: is required (in the file, as tokenFile, or in LEASEHOLD_TOKEN)');
  // The SDK reads them when it connects, where a missing one would stop the agent with a bare ENOENT.
  if (typeof c.tls === 'object') {
    for (const field of ['ca', 'cert', 'key'] as const) {
      const f = c.tls[field];
      if (f !== undefined) await readNamed(`tls.${field}`, f);
    }
    if ((c.tls.cert === undefined) !== (c.tls.key === undefined)) throw new ConfigError(`tls: give "cert" and "key" together (mTLS), or neither`);
  }
  for (const [q, cmd] of Object.entries(c.queues)) {
    if (cmd.shell && cmd.command.length !== 1) throw new ConfigError(`queues.${q}.command: with "shell": true, give the command line as one string`);
  }
  if (typeof c.tls === 'object' && c.tls.key !== undefined) secretFiles.push({ what: 'tls.key', file: c.tls.key, grants: "present this agent's client certificate" });
  return { ...c, token, outboxDir: c.outboxDir ?? defaultOutboxDir(), secretFiles };
}

/** Reads and validates a configuration file. */
export async function loadConfig(file: string, env = process.env): Promise<AgentConfig> {
  let bytes: Buffer;
  try {
    bytes = await readFile(file);
  } catch (err) {
    throw new ConfigError(`${file}: cannot read the configuration: ${(err as NodeJS.ErrnoException).code ?? (err as Error).message}`);
  }
  const text = decodeText(bytes, file);
  let raw: unknown;
  try {
    raw = JSON.parse(text);
  } catch (err) {
    throw new ConfigError(`${file}: not valid JSON: ${(err as Error).message}`);
  }
  const config = await parseConfig(raw, env);
  if (raw && typeof raw === 'object' && 'token' in raw) config.secretFiles.unshift({ what: 'the configuration, which holds the token,', file, grants: AS_AGENT });
  return config;
}

/**
 * The secret files other users of this machine can read, each as a warning naming the fix: read
 * by group or others in POSIX modes. On Windows modes say nothing (ACLs decide: docs/agent.md).
 */
export async function secretsOpenToOthers(files: SecretFile[], platform = process.platform): Promise<Array<{ file: string; mode: string; message: string }>> {
  if (platform === 'win32') return [];
  const open: Array<{ file: string; mode: string; message: string }> = [];
  for (const f of files) {
    const st = await stat(f.file).catch(() => undefined);
    if (!st || (st.mode & 0o044) === 0) continue;
    const mode = (st.mode & 0o7777).toString(8).padStart(4, '0');
    open.push({
      file: f.file,
      mode,
      message: `${f.what} ${f.file} can be read by other users of this machine (mode ${mode}): whoever reads it can ${f.grants}. Make it yours alone: chmod 600 '${f.file.replaceAll("'", "'\\''")}'`,
    });
  }
  return open;
}
