/**
 * `Revoker` alone (no database): which sessions lose which attempts, what each is told, and the
 * events the hub relies on (`lease:revoked` for metrics, `credit` for the dispatcher).
 */
import { EventEmitter } from 'node:events';
import pino from 'pino';
import { expect, it } from 'vitest';
import { Revoker } from '../server/core/revoker.js';
import { REVOKE_DETAIL, Session, type HubEvents } from '../server/core/session.js';
import { sentTo as sent } from './helpers/core.js';

const log = pino({ level: 'silent' });

/** A session holding `ids` (running), with progress kept for each. */
function holding(agentId: string, ids: string[]): Session {
  const s = new Session(agentId, ['q'], {}, 4);
  for (const id of ids) {
    s.held.set(id, { jobId: `job-${id}`, status: 'running' });
    s.progress.set(id, { pct: 50 });
  }
  return s;
}

function setup(...sessions: Session[]) {
  const events = new EventEmitter<HubEvents>();
  const revoked: HubEvents['lease:revoked'][0][] = [];
  const credited: Session[] = [];
  events.on('lease:revoked', (x) => revoked.push(x));
  events.on('credit', (s) => credited.push(s));
  return { revoker: new Revoker(new Set(sessions), log, events), revoked, credited };
}

it('revoke takes the attempts from the sessions that hold them: one Revoke per session with the reason, and the slot back', async () => {
  const a = holding('agent-a', ['a1', 'a2', 'a3']);
  const b = holding('agent-b', ['b1']);
  const idle = holding('agent-c', ['c1']);
  const { revoker, revoked, credited } = setup(a, b, idle);
  revoker.revoke(['a1', 'a3', 'b1', 'nobody-holds-this'], 'lease_expired');
  expect([...a.held.keys()]).toEqual(['a2']);
  expect([...a.progress.keys()]).toEqual(['a2']);
  expect(b.held.size).toBe(0);
  expect(b.progress.size).toBe(0);
  expect(idle.held.size).toBe(1);
  expect(await sent(a)).toEqual([{ type: 'revoke', attemptIds: ['a1', 'a3'], reason: 'lease_expired', detail: REVOKE_DETAIL.lease_expired }]);
  expect(await sent(b)).toEqual([{ type: 'revoke', attemptIds: ['b1'], reason: 'lease_expired', detail: REVOKE_DETAIL.lease_expired }]);
  expect(await sent(idle)).toEqual([]);
  expect(revoked).toEqual([
    { agentId: 'agent-a', attemptIds: ['a1', 'a3'], reason: 'lease_expired' },
    { agentId: 'agent-b', attemptIds: ['b1'], reason: 'lease_expired' },
  ]);
  expect(credited).toEqual([a, b]);
});

it('revoke of a canceled job sends Cancel, not Revoke', async () => {
  const a = holding('agent-a', ['a1']);
  const { revoker, revoked, credited } = setup(a);
  revoker.revoke(['a1'], 'canceled');
  expect(a.held.size).toBe(0);
  expect(await sent(a)).toEqual([{ type: 'cancel', attemptIds: ['a1'] }]);
  expect(revoked).toEqual([{ agentId: 'agent-a', attemptIds: ['a1'], reason: 'canceled' }]);
  expect(credited).toEqual([a]);
});

it('revoke of attempts nobody holds sends and announces nothing', async () => {
  const a = holding('agent-a', ['a1']);
  const { revoker, revoked, credited } = setup(a);
  revoker.revoke(['other'], 'not_current');
  expect(a.held.size).toBe(1);
  expect(await sent(a)).toEqual([]);
  expect(revoked).toEqual([]);
  expect(credited).toEqual([]);
});

it('supersede revokes the resumed attempts from the other streams of that agent only', async () => {
  const resumer = holding('agent-a', ['x', 'y']);
  const older = holding('agent-a', ['x', 'y', 'z']);
  const stranger = holding('agent-b', ['x']);
  const { revoker, revoked, credited } = setup(resumer, older, stranger);
  revoker.supersede('agent-a', ['x', 'y'], resumer.id);
  expect([...resumer.held.keys()]).toEqual(['x', 'y']);
  expect([...older.held.keys()]).toEqual(['z']);
  expect([...older.progress.keys()]).toEqual(['z']);
  expect([...stranger.held.keys()]).toEqual(['x']);
  expect(await sent(older)).toEqual([{ type: 'revoke', attemptIds: ['x', 'y'], reason: 'superseded', detail: REVOKE_DETAIL.superseded }]);
  expect(await sent(resumer)).toEqual([]);
  expect(await sent(stranger)).toEqual([]);
  expect(revoked).toEqual([{ agentId: 'agent-a', attemptIds: ['x', 'y'], reason: 'superseded' }]);
  expect(credited).toEqual([older]);
});
