/**
 * The batched fence: what the statements of start, heartbeat and complete share to act on many
 * attempts (of any agents) in one statement, each row checked against its own entries. An item
 * that matches nothing is explained afterwards, on its own (explain.ts). The fence itself, and the
 * state machine it guards: README.md.
 */
import type { Failure, Outcome } from '../domain/outcomes.js';
import { check, checkAll, schemas, valid } from '../domain/validation.js';

export interface AttemptRef {
  attemptId: string;
  agentId: string;
  /** When given, the attempt must belong to this job (else `not_found`). */
  jobId?: string;
  now?: Date;
}

/** Validates an attempt reference: the well-formed case without zod (it runs per batch item). */
export function checkRef(p: AttemptRef): Failure | undefined {
  if (valid.id(p.attemptId) && valid.agentId(p.agentId) && (p.jobId === undefined || valid.id(p.jobId))) return undefined;
  return checkAll(
    check('attemptId', schemas.id, p.attemptId),
    check('agentId', schemas.agentId, p.agentId),
    p.jobId === undefined ? undefined : check('jobId', schemas.id, p.jobId),
  );
}

/** Indexes of the items to put in a batch: valid ones, each attempt once (repeats are explained). */
export function firstOfEach(items: AttemptRef[], out: Array<Outcome<unknown> | undefined>): number[] {
  const seen = new Set<string>();
  const batch: number[] = [];
  for (const [k, item] of items.entries()) {
    const key = item.attemptId.toLowerCase();
    if (out[k] || seen.has(key)) continue;
    seen.add(key);
    batch.push(k);
  }
  return batch;
}

/**
 * A JSON object `{attempt id: value}` for the batched statements, which look each row's own
 * value up by its attempt (`$n::jsonb ->> j.current_attempt_id::text`: keys as PostgreSQL
 * writes a uuid). `json` gives each value as JSON text; items without one are left out.
 */
export function byAttempt(ids: string[], json: (k: number) => string | undefined): string {
  const parts: string[] = [];
  for (const [k, id] of ids.entries()) {
    const v = json(k);
    if (v !== undefined) parts.push(`"${id.toLowerCase()}":${v}`);
  }
  return `{${parts.join(',')}}`;
}

/**
 * The fence of the batched statements, for the `jobs` row `j`: its current attempt is one of
 * `$1` (found through jobs_current_attempt_uq, in index order, which is also the order rows are
 * locked in when the plan is that index scan; a plan that reads them in another order can
 * deadlock with another batch, and PostgreSQL then fails one of the two: seen once in a
 * benchmark, a renewal; on the pool `run` runs the victim again), held by the agent the call named for it (`$2`, a map),
 * and of the job the call named, if it named one (`$3`, a map, or NULL). No join: each row is
 * checked against its own entries, so the plan is an index scan whatever the statistics say.
 */
export const batchFence = `j.current_attempt_id = ANY($1::uuid[]) AND j.agent_id = ($2::jsonb ->> j.current_attempt_id::text)
       AND coalesce(($3::jsonb ->> j.current_attempt_id::text)::uuid = j.id, true)`;

/** The fence parameters `$1`–`$3` of `batchFence` for a batch. */
export function fenceParams(items: AttemptRef[]): [string[], string, string | null] {
  const ids = items.map((i) => i.attemptId);
  const jobs = items.some((i) => i.jobId !== undefined) ? byAttempt(ids, (k) => (items[k]!.jobId === undefined ? undefined : JSON.stringify(items[k]!.jobId))) : null;
  return [ids, byAttempt(ids, (k) => JSON.stringify(items[k]!.agentId)), jobs];
}

/**
 * The two shapes a batched transition answers in: the whole job (the unary API, which returns
 * it), or a summary (the agent stream, which needs only an ack).
 */
export type Shape = 'job' | 'summary';
