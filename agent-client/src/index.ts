/**
 * The Leasehold agent SDK. `createAgent({ url, token, outboxDir, slots })`, then
 * `agent.handle(queue, async (job, ctx) => result)` and `await agent.start()`.
 */
export { Agent, createAgent, type AgentEvents, type AgentOptions, type Handler } from './agent.js';
export {
  JobError,
  LeaseLostError,
  StepOutcomeUnknownError,
  type JobContext,
  type JobInfo,
  type Reconciled,
  type StepOptions,
} from './context.js';
export { Outbox, readOutbox, type OutboxEntry, type OutboxOptions, type OutboxStats, type OutboxWatcher, type SupersededEntry } from './outbox.js';
export type { TlsOption } from './channel.js';
