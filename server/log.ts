/**
 * The process logger (pino): JSON lines, pretty-printed when stdout is a terminal.
 * `LEASEHOLD_LOG_LEVEL` sets the level (default `info`; empty is the default too; any other
 * value than pino's level names stops the process, as any bad setting does: exit code 2 and one
 * line naming it), `LEASEHOLD_LOG_FORMAT=json` forces JSON.
 */
import { writeSync } from 'node:fs';
import pino from 'pino';

export type Logger = pino.Logger;

/** The levels `LEASEHOLD_LOG_LEVEL` takes, most verbose first (`silent`: nothing). */
export const LOG_LEVELS = ['trace', 'debug', 'info', 'warn', 'error', 'fatal', 'silent'] as const;
export type LogLevel = (typeof LOG_LEVELS)[number];

/** `LEASEHOLD_LOG_LEVEL` is not a level: named `ConfigError`, as the other bad settings. */
export class LogLevelError extends Error {
  override readonly name = 'ConfigError';
}

/**
 * The level `LEASEHOLD_LOG_LEVEL` sets: `info` when unset or empty, a level name in any case
 * (`DEBUG` is `debug`); anything else throws `LogLevelError` naming the setting and the levels.
 */
export function logLevel(env: NodeJS.ProcessEnv = process.env): LogLevel {
  const raw = env.LEASEHOLD_LOG_LEVEL;
  const name = raw?.trim().toLowerCase();
  if (!name) return 'info';
  if ((LOG_LEVELS as readonly string[]).includes(name)) return name as LogLevel;
  throw new LogLevelError(`LEASEHOLD_LOG_LEVEL=${JSON.stringify(raw)} is not a log level: use ${LOG_LEVELS.join(', ')} (default info)`);
}

/**
 * Creates the root logger; components take children (`log.child({ component: 'reaper' })`).
 * With `stderr` it writes to stderr, so a command's stdout holds only its answer (`keys add`).
 * A bad `LEASEHOLD_LOG_LEVEL` ends the process here, with exit code 2 and one line on stderr:
 * there is no logger to report it with, and the programs make theirs before anything else.
 */
export function createLogger(env: NodeJS.ProcessEnv = process.env, opts: { stderr?: boolean } = {}): Logger {
  let level: LogLevel;
  try {
    level = logLevel(env);
  } catch (err) {
    if (!(err instanceof LogLevelError)) throw err;
    // Written at once: process.exit() does not wait for a pipe's pending write.
    writeSync(2, `${err.message}\n`);
    process.exit(2);
  }
  const out = opts.stderr ? process.stderr : process.stdout;
  const pretty = env.LEASEHOLD_LOG_FORMAT !== 'json' && out.isTTY === true;
  const options = { level, base: { pid: process.pid } };
  if (pretty) {
    return pino({
      ...options,
      transport: { target: 'pino-pretty', options: { colorize: true, translateTime: 'SYS:HH:MM:ss.l', destination: opts.stderr ? 2 : 1 } },
    });
  }
  return opts.stderr ? pino(options, pino.destination({ dest: 2, sync: true })) : pino(options);
}
