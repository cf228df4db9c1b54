/**
 * The process logger (pino): JSON lines, pretty-printed when stdout is a terminal.
 * `LEASEHOLD_LOG_LEVEL` sets the level (default `info`), `LEASEHOLD_LOG_FORMAT=json` forces JSON.
 */
import pino from 'pino';

export type Logger = pino.Logger;

/**
 * Creates the root logger; components take children (`log.child({ component: 'reaper' })`).
 * With `stderr` it writes to stderr, so a command's stdout holds only its answer (`keys add`).
 */
export function createLogger(env: NodeJS.ProcessEnv = process.env, opts: { stderr?: boolean } = {}): Logger {
  const level = env.LEASEHOLD_LOG_LEVEL ?? 'info';
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
