/**
 * The process logger (pino): JSON lines, pretty-printed when stdout is a terminal.
 * `LEASEHOLD_LOG_LEVEL` sets the level (default `info`), `LEASEHOLD_LOG_FORMAT=json` forces JSON.
 */
import pino from 'pino';

export type Logger = pino.Logger;

/** Creates the root logger; components take children (`log.child({ component: 'reaper' })`). */
export function createLogger(env: NodeJS.ProcessEnv = process.env): Logger {
  const level = env.LEASEHOLD_LOG_LEVEL ?? 'info';
  const pretty = env.LEASEHOLD_LOG_FORMAT !== 'json' && process.stdout.isTTY === true;
  return pino({
    level,
    base: { pid: process.pid },
    ...(pretty ? { transport: { target: 'pino-pretty', options: { colorize: true, translateTime: 'SYS:HH:MM:ss.l' } } } : {}),
  });
}
