/**
 * The lease ticker: a `Heartbeat` only marks its session; every `tickMs` one UPDATE renews the
 * attempts held by all sessions that heartbeated since the last tick (claimed ones are checked
 * too, so a claim the reaper took back is revoked). Renewed leases are confirmed with `Renewed`,
 * which agents follow for their local deadlines; an attempt no longer current gets `Revoke`.
 * Ticks are chained with `setTimeout`, so two never overlap.
 */
import type { EventEmitter } from 'node:events';
import type { Logger } from '../log.js';
import { attemptHeartbeat, type LostReason, type Queryable } from '../store/index.js';
import type { Revoker } from './revoker.js';
import type { HubEvents, RevokeReason, Session } from './session.js';

export interface LeaseTickerConfig {
  leaseTtlMs: number;
  /** How often heartbeats are flushed to the database in one UPDATE. */
  tickMs: number;
  /** True while the coordinator is waking from a pause: a tick then renews nothing. */
  stalled: () => boolean;
}

export class LeaseTicker {
  private timer: NodeJS.Timeout | undefined;
  private ticking: Promise<void> | undefined;

  constructor(
    private readonly db: Queryable,
    private readonly log: Logger,
    /** The hub's open sessions (read at each tick). */
    private readonly sessions: ReadonlySet<Session>,
    private readonly revoker: Pick<Revoker, 'revoke'>,
    /** Where `lease:tick` is announced (the hub). */
    private readonly events: EventEmitter<HubEvents>,
    private readonly config: LeaseTickerConfig,
  ) {}

  /** Starts ticking (the first tick comes after `tickMs`). */
  start(): void {
    if (this.timer) return;
    const loop = () => {
      this.timer = setTimeout(() => {
        this.ticking = this.tick()
          .catch((err: unknown) => this.log.warn({ err }, 'heartbeat tick failed; retrying next tick'))
          .finally(() => {
            this.ticking = undefined;
            if (this.timer) loop();
          });
      }, this.config.tickMs);
    };
    loop();
  }

  /** Stops ticking and waits for a tick in progress. */
  async stop(): Promise<void> {
    clearTimeout(this.timer);
    this.timer = undefined;
    await this.ticking;
  }

  /** One UPDATE renews what every heartbeating session holds; the lost attempts are revoked. */
  async tick(): Promise<void> {
    // Waking from a pause: these heartbeats are old news (the watch ends the streams next).
    if (this.config.stalled()) return;
    const items: Array<{ attemptId: string; agentId: string; progress?: unknown }> = [];
    // What each session's renewal answers: the messages received before the UPDATE is written.
    const answers = new Map<Session, bigint>();
    for (const s of this.sessions) {
      if (!s.heartbeatPending) continue;
      s.heartbeatPending = false;
      answers.set(s, s.seq);
      for (const id of s.held.keys()) {
        const progress = s.progress.get(id);
        items.push(progress === undefined ? { attemptId: id, agentId: s.agentId } : { attemptId: id, agentId: s.agentId, progress });
      }
      s.progress.clear();
    }
    if (!items.length) return;
    const o = await attemptHeartbeat(this.db, { items, leaseTtlMs: this.config.leaseTtlMs });
    if (o.outcome !== 'ok') {
      this.log.warn({ outcome: o }, 'heartbeat batch refused');
      return;
    }
    // Tell each session which of its leases now run: the agents' local deadlines follow these.
    const renewed = new Set(o.value.renewed.map((r) => r.attemptId));
    for (const [s, seq] of answers) {
      const ids = [...s.held.keys()].filter((id) => renewed.has(id));
      if (ids.length) s.send({ type: 'renewed', attemptIds: ids, leaseTtlMs: this.config.leaseTtlMs, seq });
    }
    const lost = new Map<string, RevokeReason | 'canceled'>();
    for (const l of o.value.lost) lost.set(l.attemptId, lostReason(l.reason));
    for (const reason of new Set(lost.values())) {
      this.revoker.revoke([...lost].filter(([, r]) => r === reason).map(([id]) => id), reason);
    }
    this.events.emit('lease:tick', { renewed: o.value.renewed.length, lost: lost.size });
  }
}

/**
 * Why a heartbeat lost an attempt (the store's reason), as the agent is told: a canceled attempt
 * gets `Cancel`, as from the cancel itself; any other gets `Revoke` with its reason, the one the
 * reaper's own push gives for an attempt it took back.
 */
function lostReason(reason: LostReason): RevokeReason | 'canceled' {
  switch (reason) {
    case 'canceled':
    case 'claim_expired':
    case 'lease_expired':
    case 'timed_out':
      return reason;
    case 'stale':
      return 'not_current';
    case 'forbidden':
      return 'forbidden';
    default:
      return 'not_found';
  }
}
