/**
 * SIGINT and SIGTERM: the first drains the agent and exits (0 once drained, 1 if the drain
 * failed); a second one exits at once, for an operator who will not wait for the grace period.
 */
import type { Logger } from 'pino';

/** Where signals come from and how the process ends: `process` itself but in tests. */
export interface SignalTarget {
  on(signal: NodeJS.Signals, listener: () => void): unknown;
  off(signal: NodeJS.Signals, listener: () => void): unknown;
  exit(code: number): void;
}

/** Installs the handlers; returns the function that removes them. */
export function installSignals(opts: { log: Logger; drain: () => Promise<void>; target?: SignalTarget }): () => void {
  const { log, drain } = opts;
  const target: SignalTarget = opts.target ?? process;
  const installed: Array<[NodeJS.Signals, () => void]> = [];
  let count = 0;
  const onSignal = (sig: NodeJS.Signals) => () => {
    if (++count > 1) {
      log.warn({ signal: sig }, 'second signal: exiting now');
      target.exit(1);
      return;
    }
    log.info({ signal: sig }, 'shutting down: draining');
    drain().then(
      () => target.exit(0),
      (err: unknown) => {
        log.error({ err }, 'drain failed');
        target.exit(1);
      },
    );
  };
  for (const sig of ['SIGINT', 'SIGTERM'] as const) {
    const h = onSignal(sig);
    target.on(sig, h);
    installed.push([sig, h]);
  }
  return () => {
    for (const [sig, h] of installed.splice(0)) target.off(sig, h);
  };
}
