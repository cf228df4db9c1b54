/**
 * The session registry: keeps `agent_sessions` in step with the streams this coordinator holds,
 * so that ListAgents on any replica shows every replica's streams, and carries out the operator
 * commands that reach this coordinator through NOTIFY (drain an agent, end a revoked agent's
 * streams) on the sessions it holds.
 *
 * It follows the hub's `session:open` / `session:close` events (a row per stream, written in
 * order per session), stamps `seen_at` on its rows every `intervalMs` (re-registering any that a
 * sweep took while this process stalled), and sweeps rows no coordinator stamped for
 * `staleAfterMs` (a coordinator that was killed). `stop()` deletes this coordinator's rows.
 */
import { randomUUID } from 'node:crypto';
import { EventEmitter } from 'node:events';
import { Code, ConnectError } from '@connectrpc/connect';
import { z } from 'zod';
import type { Logger } from '../log.js';
import {
  sessionRegister,
  sessionRemove,
  sessionsRemoveCoordinator,
  sessionsSweep,
  sessionsTouch,
  type Queryable,
} from '../store/index.js';
import type { AgentHub, Session } from './agent-hub.js';

export interface SessionRegistryConfig {
  /** This coordinator's id (random per start by default). */
  coordinatorId?: string;
  /** Time between stamps and sweeps; default 5 s. */
  intervalMs?: number;
  /** Rows not stamped for this long are swept; default 4 intervals. */
  staleAfterMs?: number;
  /** Fraction of the interval added or removed at random; default 0.1. */
  jitter?: number;
}

/** Counts of one run. */
export interface RegistryRun {
  touched: number;
  /** Rows of this coordinator that were gone and were written again. */
  restored: number;
  /** Rows of dead coordinators deleted. */
  swept: number;
}

export interface RegistryEvents {
  'registry:run': [RegistryRun];
  'registry:error': [Error];
}

const configSchema = z.object({
  coordinatorId: z.uuid().optional(),
  intervalMs: z.int().min(10).default(5000),
  staleAfterMs: z.int().min(10).optional(),
  jitter: z.number().min(0).max(0.9).default(0.1),
});

/** Records this coordinator's agent streams in the database and acts on drain and revoke commands. */
export class SessionRegistry extends EventEmitter<RegistryEvents> {
  readonly coordinatorId: string;
  readonly intervalMs: number;
  readonly staleAfterMs: number;
  private readonly jitter: number;
  /** The write in progress of each session, so its delete follows its insert. */
  private readonly writes = new Map<string, Promise<void>>();
  private timer: NodeJS.Timeout | undefined;
  private running: Promise<RegistryRun> | undefined;
  private started = false;
  private readonly onOpen = (s: Session) => this.track(s.id, () => this.register(s));
  private readonly onClose = (s: Session) => this.track(s.id, () => sessionRemove(this.db, { id: s.id }));

  constructor(
    private readonly db: Queryable,
    private readonly hub: AgentHub,
    private readonly log: Logger,
    config: SessionRegistryConfig = {},
  ) {
    super();
    const c = configSchema.parse(config);
    this.coordinatorId = c.coordinatorId ?? randomUUID();
    this.intervalMs = c.intervalMs;
    this.staleAfterMs = c.staleAfterMs ?? 4 * c.intervalMs;
    this.jitter = c.jitter;
  }

  /** Follows the hub's sessions and starts stamping. Calling it twice is harmless. */
  start(): void {
    if (this.started) return;
    this.started = true;
    this.hub.on('session:open', this.onOpen);
    this.hub.on('session:close', this.onClose);
    for (const s of this.hub.sessions) this.onOpen(s);
    this.schedule();
  }

  /** Stops following, waits for pending writes and deletes this coordinator's rows. Safe twice. */
  async stop(): Promise<void> {
    if (!this.started) return;
    this.started = false;
    this.hub.off('session:open', this.onOpen);
    this.hub.off('session:close', this.onClose);
    clearTimeout(this.timer);
    this.timer = undefined;
    await this.running?.catch(() => undefined);
    await Promise.all(this.writes.values());
    this.writes.clear();
    await sessionsRemoveCoordinator(this.db, { coordinatorId: this.coordinatorId }).catch((err: unknown) =>
      this.log.warn({ err }, 'could not remove this coordinator\'s sessions (they are swept later)'),
    );
  }

  /** Stamps this coordinator's rows, restores missing ones and sweeps dead coordinators' rows. */
  runOnce(): Promise<RegistryRun> {
    this.running ??= this.pass().finally(() => {
      this.running = undefined;
    });
    return this.running;
  }

  /**
   * Tells this coordinator's streams of `agentId` to drain (no more assignments; the agent
   * finishes what it holds and leaves). Returns how many streams were told.
   */
  drain(agentId: string): number {
    let n = 0;
    for (const s of this.hub.sessions) {
      if (s.agentId !== agentId || s.closed) continue;
      n++;
      if (s.draining) continue;
      s.draining = true;
      s.send({ type: 'drain' });
      this.log.info({ agentId, sessionId: s.id, held: s.held.size }, 'agent told to drain');
    }
    return n;
  }

  /** Ends this coordinator's streams of a revoked agent (UNAUTHENTICATED); returns how many. */
  disconnect(agentId: string, reason: string): number {
    let n = 0;
    for (const s of this.hub.sessions) {
      if (s.agentId !== agentId || s.closed) continue;
      n++;
      s.out.fail(new ConnectError(reason, Code.Unauthenticated));
      this.log.warn({ agentId, sessionId: s.id, held: s.held.size, reason }, 'agent stream ended');
    }
    return n;
  }

  private async register(s: Session): Promise<void> {
    await sessionRegister(this.db, {
      id: s.id,
      agentId: s.agentId,
      coordinatorId: this.coordinatorId,
      queues: s.queues,
      labels: s.labels,
      slots: s.slots,
      connectedAt: s.connectedAt,
    });
  }

  /** Chains a write after the session's previous one; failures are logged (the next run repairs). */
  private track(id: string, write: () => Promise<unknown>): void {
    const prev = this.writes.get(id) ?? Promise.resolve();
    const next: Promise<void> = prev
      .then(write)
      .then(
        () => undefined,
        (err: unknown) => this.log.warn({ err, sessionId: id }, 'session registry write failed; the next run repairs it'),
      )
      .finally(() => {
        if (this.writes.get(id) === next) this.writes.delete(id);
      });
    this.writes.set(id, next);
  }

  private async pass(): Promise<RegistryRun> {
    const open = [...this.hub.sessions].filter((s) => !s.closed);
    const touched = new Set(await sessionsTouch(this.db, { coordinatorId: this.coordinatorId, ids: open.map((s) => s.id) }));
    let restored = 0;
    for (const s of open) {
      // Missing: swept while this process stalled, or its insert failed. Written again unless it
      // is still being written.
      if (s.closed || touched.has(s.id) || this.writes.has(s.id)) continue;
      restored++;
      this.onOpen(s);
    }
    const swept = await sessionsSweep(this.db, { staleAfterMs: this.staleAfterMs });
    if (swept.length) this.log.info({ swept: swept.length, coordinators: [...new Set(swept.map((s) => s.coordinatorId))] }, 'sessions of stopped coordinators removed');
    const run = { touched: touched.size, restored, swept: swept.length };
    this.emit('registry:run', run);
    return run;
  }

  private schedule(): void {
    if (!this.started) {
      this.timer = undefined;
      return;
    }
    const delay = this.intervalMs * (1 - this.jitter + Math.random() * 2 * this.jitter);
    this.timer = setTimeout(() => {
      this.runOnce()
        .catch((err: Error) => {
          this.log.warn({ err }, 'session registry run failed; retrying next interval');
          this.emit('registry:error', err);
        })
        .finally(() => this.schedule());
    }, delay);
  }
}
