/**
 * What the unary transports did, as events: stream-less agents' claims, starts and reports
 * (AttemptService), and the job verbs callers and operators use (enqueue, cancel, requeue,
 * purge). The agent stream's own events are the hub's; together they are what metrics count.
 * One emitter per coordinator, handed to the routes; nothing here decides anything.
 */
import { EventEmitter } from 'node:events';
import type { Job } from '../store/index.js';
import type { HubEvents } from './agent-hub.js';

export interface ActivityEvents {
  /** A stream-less agent claimed jobs (AttemptService.ClaimJobs). */
  'attempt:claim': [{ agentId: string; jobs: Job[] }];
  /** A stream-less StartAttempt was answered. */
  'attempt:start': HubEvents['attempt:start'];
  /** A stream-less CompleteAttempt / FailAttempt was answered. */
  'attempt:report': HubEvents['attempt:report'];
  'job:enqueued': [Job];
  'job:canceled': [Job];
  /** An operator put a dead, failed or canceled job back in its queue. */
  'job:requeued': [Job];
  /** An operator purged finished jobs. */
  'jobs:purged': [{ purged: number }];
}

/** The activity of one coordinator's unary routes. */
export class Activity extends EventEmitter<ActivityEvents> {}
