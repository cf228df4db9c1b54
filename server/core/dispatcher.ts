/**
 * Dispatch: claims jobs on behalf of connected agents that have free slots and hands them out
 * as `Assign`. Sessions serving the same queues with the same labels are claimed for together,
 * in one statement, their slots interleaved so each gets a fair share. A round runs when woken
 * (NOTIFY for a queue, a session with new credit, the reaper giving jobs back) and on a slow
 * poll as the fallback (scheduled jobs coming due, a missed notification). Up to two rounds run
 * at once (a round takes the slots it claims for from their sessions' credit before its claim,
 * so the other round, and an enqueue's hand-off, see only what is left); a wake while both run
 * makes another round follow.
 *
 * A group whose last claim came back short (fewer jobs than free slots) found its queues empty:
 * new credit alone does not claim for it again (one job at a time, every completion would
 * otherwise cost a claim that finds nothing). What can put jobs there wakes it: a NOTIFY for one
 * of its queues (enqueue, requeue, the reaper), the poll, the listener reconnecting.
 */
import { EventEmitter } from 'node:events';
import type { Logger } from '../log.js';
import { jobClaimSlots, randomAttemptId, type Claimed, type Queryable } from '../store/index.js';
import type { AgentHub, Session } from './agent-hub.js';
import { limits } from '../domain/validation.js';

/** Rounds at once: while one waits for its claim, the slots freed meanwhile can be claimed. */
const MAX_ROUNDS = 2;

export interface DispatcherConfig {
  claimTtlMs: number;
  /** The fallback poll; default 1 s. */
  pollMs?: number;
}

export interface DispatcherEvents {
  'dispatch:round': [{ claimed: number; groups: number; ms: number }];
  'dispatch:error': [Error];
  /** A job was claimed by its enqueue for a waiting session here (`reserve` / `settle`). */
  'dispatch:handoff': [Claimed];
}

/** A slot reserved for a job being enqueued, and what the enqueue needs to claim it there. */
export interface HandOff {
  session: Session;
  agentId: string;
  agentLabels: Record<string, string>;
  /** The attempt id the enqueue gives the job if it claims it (`randomAttemptId`). */
  attemptId: string;
  claimTtlMs: number;
}

/** Claims for waiting sessions and assigns; `runOnce()` does one round now. */
export class Dispatcher extends EventEmitter<DispatcherEvents> {
  /** The round loops running (at most `MAX_ROUNDS`). */
  private readonly loops = new Set<Promise<void>>();
  private again = false;
  private poll: NodeJS.Timeout | undefined;
  private rotation = 0;
  /** Where the next enqueue hand-off starts looking among the sessions. */
  private turn = 0;
  private stopped = true;
  /** Groups (by key, with their queues) whose last claim found fewer jobs than slots. */
  private readonly drained = new Map<string, readonly string[]>();
  /**
   * Wakes so far, for any queue and per queue served by a waiting session: a claim that a wake
   * for one of its queues overtook may not have seen the jobs the wake announced.
   */
  private wakesAll = 0;
  private readonly wakesByQueue = new Map<string, number>();

  constructor(
    private readonly db: Queryable,
    private readonly hub: AgentHub,
    private readonly log: Logger,
    private readonly config: DispatcherConfig,
  ) {
    super();
  }

  start(): void {
    if (!this.stopped) return;
    this.stopped = false;
    const pollMs = this.config.pollMs ?? 1000;
    const loop = () => {
      this.poll = setTimeout(() => {
        if ([...this.hub.sessions].some((s) => s.available > 0)) this.wake();
        loop();
      }, pollMs);
    };
    loop();
  }

  async stop(): Promise<void> {
    this.stopped = true;
    clearTimeout(this.poll);
    await this.idle();
  }

  /**
   * Asks for a round, because jobs may have come: for `queue`, or anywhere (the poll, a
   * reconnect). Only if some waiting session serves it.
   */
  wake(queue?: string): void {
    if (this.stopped) return;
    if (queue === undefined) this.drained.clear();
    else for (const [key, queues] of this.drained) if (queues.includes(queue)) this.drained.delete(key);
    if (queue === undefined) this.wakesAll++;
    else {
      const serving = [...this.hub.sessions].filter((s) => s.queues.includes(queue));
      if (!serving.length) return;
      this.wakesByQueue.set(queue, (this.wakesByQueue.get(queue) ?? 0) + 1);
      if (!serving.some((s) => s.available > 0)) return;
    }
    this.schedule();
  }

  private wakesFor(queues: readonly string[]): number {
    let n = this.wakesAll;
    for (const q of queues) n += this.wakesByQueue.get(q) ?? 0;
    return n;
  }

  /** Asks for a round because a session has free slots (groups known to be empty are skipped). */
  credit(): void {
    if (this.stopped) return;
    this.schedule();
  }

  private schedule(): void {
    if (this.loops.size >= MAX_ROUNDS) {
      this.again = true;
      return;
    }
    const l: Promise<void> = this.loop().finally(() => this.loops.delete(l));
    this.loops.add(l);
  }

  /** Resolves when no round is running or asked for. */
  async idle(): Promise<void> {
    while (this.loops.size) await Promise.all(this.loops);
  }

  /**
   * One round now, for every group (tests, tools), after the rounds in progress: those may have
   * read the queues before the caller's last commits (their wakes not yet delivered), so a round
   * of its own reads them afresh.
   */
  async runOnce(): Promise<void> {
    await this.idle();
    this.drained.clear();
    await this.round();
  }

  private async loop(): Promise<void> {
    do {
      this.again = false;
      try {
        if (await this.round()) this.again = true; // a group was filled: there may be more
      } catch (err) {
        this.log.warn({ err }, 'dispatch round failed; the poll retries');
        this.emit('dispatch:error', err as Error);
        return;
      }
    } while (this.again && !this.stopped);
  }

  /** Claims for every group of waiting sessions; true if some group got every slot it asked for. */
  private async round(): Promise<boolean> {
    const t0 = performance.now();
    const groups = new Map<string, Session[]>();
    for (const s of this.hub.sessions) {
      if (s.available <= 0) continue;
      const key = (s.groupKey ??= JSON.stringify([[...s.queues].sort(), Object.entries(s.labels).sort()]));
      if (this.drained.has(key)) continue;
      const group = groups.get(key);
      if (group) group.push(s);
      else groups.set(key, [s]);
    }
    let full = false;
    let claimed = 0;
    for (const [key, sessions] of groups) {
      const slots = this.interleave(sessions);
      if (!slots.length) continue;
      const first = sessions[0]!;
      // The slots are taken from the sessions' credit while the claim runs (an enqueue hand-off
      // meanwhile finds them gone); those the claim did not fill are given back.
      for (const s of slots) s.reserve();
      const wakes = this.wakesFor(first.queues);
      let o: Awaited<ReturnType<typeof jobClaimSlots>>;
      try {
        o = await jobClaimSlots(this.db, {
          slots: slots.map((s) => s.agentId),
          queues: first.queues,
          labels: first.labels,
          claimTtlMs: this.config.claimTtlMs,
        });
        if (o.outcome !== 'ok') throw new Error(`jobClaimSlots refused: ${JSON.stringify(o)}`);
      } catch (err) {
        for (const s of slots) s.unreserve(false);
        throw err;
      }
      const filled = new Set<number>();
      const bySession = new Map<Session, Claimed[]>();
      for (const c of o.value) {
        filled.add(c.slot);
        const s = slots[c.slot]!;
        const jobs = bySession.get(s);
        if (jobs) jobs.push(c);
        else bySession.set(s, [c]);
      }
      slots.forEach((s, i) => s.unreserve(filled.has(i)));
      for (const [s, jobs] of bySession) {
        // A session that closed meanwhile never sees its jobs: they stay claimed until their
        // claim deadline and go back to the queue without counting as attempts.
        this.hub.assign(s, jobs);
        // Per job, so only built when it is written.
        if (this.log.isLevelEnabled('info')) for (const c of jobs) this.log.info({ jobId: c.job.id, attemptId: c.attemptId, attemptNo: c.attemptNo, agentId: s.agentId }, 'job assigned');
      }
      claimed += o.value.length;
      // Short: the group's queues are empty, unless a wake came while the claim ran (its jobs may
      // have committed after the claim's snapshot): then claim again rather than wait for the poll.
      if (o.value.length === slots.length || this.wakesFor(first.queues) !== wakes) full = true;
      else this.drained.set(key, first.queues);
    }
    if (groups.size) this.emit('dispatch:round', { claimed, groups: groups.size, ms: performance.now() - t0 });
    return full;
  }

  /**
   * For a job being enqueued on this coordinator: takes a free slot of a session here that
   * serves `queue` and carries `labels`, so the enqueue can claim the job for its agent in the
   * same statement (`jobEnqueue`'s hand-off) instead of a NOTIFY, a round and a claim after it.
   * Sessions take turns. `settle` must follow, whatever the enqueue did.
   */
  reserve(queue: string, labels: Record<string, string> | undefined): HandOff | undefined {
    if (this.stopped) return undefined;
    const sessions = [...this.hub.sessions];
    for (let i = 0; i < sessions.length; i++) {
      const s = sessions[(i + this.turn) % sessions.length]!;
      if (s.available <= 0 || !s.queues.includes(queue)) continue;
      if (labels && Object.entries(labels).some(([k, v]) => s.labels[k] !== v)) continue;
      this.turn = (i + this.turn + 1) % sessions.length;
      s.reserve();
      return { session: s, agentId: s.agentId, agentLabels: s.labels, attemptId: randomAttemptId(), claimTtlMs: this.config.claimTtlMs };
    }
    return undefined;
  }

  /** After the enqueue: the job the statement claimed for the session goes to it; else the slot is given back. */
  settle(h: HandOff, claimed: Claimed | undefined): void {
    const mine = claimed?.attemptId === h.attemptId ? claimed : undefined;
    h.session.unreserve(mine !== undefined);
    if (mine) {
      this.hub.assign(h.session, [mine]);
      this.emit('dispatch:handoff', mine);
      if (this.log.isLevelEnabled('info')) this.log.info({ jobId: mine.job.id, attemptId: mine.attemptId, agentId: h.agentId }, 'job assigned as enqueued');
      return;
    }
    this.hub.emit('credit', h.session);
  }

  /** Round-robin over the sessions' free slots, starting at a rotating offset, capped at one claim batch. */
  private interleave(sessions: Session[]): Session[] {
    const free = new Map(sessions.map((s) => [s, s.available]));
    const order = sessions.map((_, i) => sessions[(i + this.rotation) % sessions.length]!);
    this.rotation++;
    const slots: Session[] = [];
    while (slots.length < limits.claimBatch) {
      let added = false;
      for (const s of order) {
        const n = free.get(s)!;
        if (n <= 0 || slots.length >= limits.claimBatch) continue;
        slots.push(s);
        free.set(s, n - 1);
        added = true;
      }
      if (!added) break;
    }
    return slots;
  }
}
