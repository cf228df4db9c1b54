/**
 * Takes attempts away from the sessions that hold them: `Cancel` for a canceled job, `Revoke`
 * with a reason otherwise (the reaper took them back, a heartbeat found them lost, another stream
 * of the agent resumed them). A session that loses an attempt loses it at once (no longer held,
 * its progress forgotten), and its slot is free again (`credit`).
 */
import type { EventEmitter } from 'node:events';
import type { Logger } from '../log.js';
import { REVOKE_DETAIL, type HubEvents, type RevokeReason, type Session } from './session.js';

export class Revoker {
  constructor(
    /** The hub's open sessions (read at each call). */
    private readonly sessions: ReadonlySet<Session>,
    private readonly log: Logger,
    /** Where `lease:revoked` and `credit` are announced (the hub). */
    private readonly events: EventEmitter<HubEvents>,
  ) {}

  /**
   * Tells the sessions holding these attempts to stop them: `Cancel` for a canceled job,
   * `Revoke` with `reason` otherwise (the reaper took them, a heartbeat found them lost).
   */
  revoke(attemptIds: string[], reason: RevokeReason | 'canceled'): void {
    const bySession = new Map<Session, string[]>();
    for (const id of attemptIds) {
      for (const s of this.sessions) {
        if (!s.held.has(id)) continue;
        s.held.delete(id);
        s.progress.delete(id);
        bySession.set(s, [...(bySession.get(s) ?? []), id]);
      }
    }
    for (const [s, ids] of bySession) {
      s.send(reason === 'canceled' ? { type: 'cancel', attemptIds: ids } : { type: 'revoke', attemptIds: ids, reason, detail: REVOKE_DETAIL[reason] });
      this.log.info({ agentId: s.agentId, attemptIds: ids, reason }, reason === 'canceled' ? 'attempts canceled' : 'attempts revoked');
      this.events.emit('lease:revoked', { agentId: s.agentId, attemptIds: ids, reason });
      this.events.emit('credit', s);
    }
  }

  /**
   * Attempts another stream of `agentId` (session `by`) resumed: every other session of that
   * agent here that holds one gets `Revoke` (superseded) and the slot back.
   */
  supersede(agentId: string, attemptIds: readonly string[], by: string): void {
    for (const s of this.sessions) {
      if (s.agentId !== agentId || s.id === by) continue;
      const ids = attemptIds.filter((id) => s.held.has(id));
      if (!ids.length) continue;
      for (const id of ids) {
        s.held.delete(id);
        s.progress.delete(id);
      }
      s.send({ type: 'revoke', attemptIds: ids, reason: 'superseded', detail: REVOKE_DETAIL.superseded });
      this.log.info({ agentId, sessionId: s.id, attemptIds: ids, by }, 'attempts revoked: resumed by another stream');
      this.events.emit('lease:revoked', { agentId, attemptIds: ids, reason: 'superseded' });
      this.events.emit('credit', s);
    }
  }
}
