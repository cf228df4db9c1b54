/**
 * What a test watches an SDK agent do across restarts of what it talks to: the sessions it
 * opened, the attempts it aborted, and how many times each job's handler ran.
 */
import type { Agent } from '@leasehold/agent-client';

export interface AgentWatch {
  /** Session ids, one per `connected`. */
  connected: string[];
  /** Every `aborted` event. */
  aborted: unknown[];
  /** Handler runs per job id; count one with `ran`. */
  runs: Map<string, number>;
  ran(jobId: string): void;
}

export function watchAgent(agent: Agent): AgentWatch {
  const w: AgentWatch = {
    connected: [],
    aborted: [],
    runs: new Map(),
    ran: (jobId) => void w.runs.set(jobId, (w.runs.get(jobId) ?? 0) + 1),
  };
  agent.on('aborted', (a) => w.aborted.push(a));
  agent.on('connected', (c) => w.connected.push(c.sessionId));
  return w;
}

/**
 * Holds handlers while a test restarts what the agent talks to, so that the stream that moves
 * has running jobs whatever the machine's speed: `close()` before, `open()` after; handlers
 * `await gate.passed()`. Open until first closed.
 */
export function handlerGate(): { close(): void; open(): void; passed(): Promise<void> } {
  let held: Promise<void> = Promise.resolve();
  let release = () => {};
  return {
    close: () => void (held = new Promise<void>((r) => (release = r))),
    open: () => release(),
    passed: () => held,
  };
}
