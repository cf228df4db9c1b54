/**
 * The agent SDK's reporter (agent-client/src/reporter.ts) on its own, with a fake session (what
 * it sends) and a fake outbox: a turn's reports go out in one Completed and one Failed, a freed
 * slot rides with them only when the coordinator reads it there, nothing is given back while
 * draining or sent while disconnected, an attempt renewed but not run is given back once, and a
 * report queued for the turn goes once when a new session's resend comes in the same turn, and
 * while the outbox cannot be written no slot is given back (until it can) and assigned jobs are
 * declined.
 * Each turn is waited for with setImmediate, the reporter's own batching; no coordinator.
 */
import pino from 'pino';
import { describe, expect, it } from 'vitest';
import type { AgentMessageInit } from '../agent-client/src/codec.js';
import type { OutboxEntry, OutboxWatcher } from '../agent-client/src/outbox.js';
import { Reporter } from '../agent-client/src/reporter.js';

const ID = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;
const completed = (n: number): OutboxEntry => ({ attemptId: ID(n), jobId: `j${n}`, queue: 'q', attemptNo: 1, kind: 'completed', result: { n }, writtenAt: '' });
const failed = (n: number, retryable = true): OutboxEntry => ({ attemptId: ID(n), jobId: `j${n}`, queue: 'q', attemptNo: 1, kind: 'failed', error: { message: `e${n}`, details: { n } }, retryable, writtenAt: '' });
const turn = () => new Promise<void>((r) => setImmediate(r));

function setup(o: { connected?: boolean; draining?: boolean; failPut?: boolean } = {}) {
  const sent: AgentMessageInit[] = [];
  const kept = new Map<string, OutboxEntry>();
  const state = { connected: o.connected ?? true, draining: o.draining ?? false, seq: 0n };
  const watchers: OutboxWatcher[] = [];
  /** As the outbox does: watchers hear of a failing write before its puts are rejected. */
  const outboxFails = (fails: boolean) => {
    o.failPut = fails;
    for (const w of watchers) w(fails ? new Error('ENOSPC: no space left on device') : undefined);
  };
  const reporter = new Reporter({
    log: pino({ level: 'silent' }),
    outbox: {
      put: async (e) => {
        if (o.failPut) throw new Error('disk full');
        kept.set(e.attemptId, e);
      },
      has: (id) => kept.has(id),
      pending: () => [...kept.values()],
      watch: (w) => {
        watchers.push(w);
        return () => undefined;
      },
    },
    session: {
      send: (m) => (state.connected ? (sent.push(m), true) : false),
      get connected() {
        return state.connected;
      },
      nextSeq: () => ++state.seq,
    },
    draining: () => state.draining,
  });
  return { reporter, sent, kept, state, outboxFails };
}

/** What was sent, as [kind, value] with the values' interesting fields. */
function summary(sent: AgentMessageInit[]) {
  return sent.map((m) => {
    const k = m.kind!;
    switch (k.case) {
      case 'completed':
        return ['completed', k.value.results!.map((r) => r.attemptId), k.value.credit ?? 0];
      case 'failed':
        return ['failed', k.value.failures!.map((f) => [f.attemptId, f.retryable]), k.value.credit ?? 0];
      case 'credit':
        return ['credit', k.value.n];
      case 'started':
        return ['started', k.value.attemptIds, k.value.seq];
      default:
        return [k.case];
    }
  });
}

async function finish(r: Reporter, entries: OutboxEntry[]): Promise<void> {
  for (const e of entries) await r.write(e);
  for (const e of entries) r.finished(e);
}

describe('reporter', () => {
  it("batches a turn's reports into one Completed and one Failed, the freed slots riding with the first when the coordinator reads credit there", async () => {
    const { reporter, sent } = setup();
    reporter.welcomed(true);
    await finish(reporter, [completed(1), failed(2, false), completed(3)]);
    await turn();
    expect(summary(sent)).toEqual([
      ['completed', [ID(1), ID(3)], 3],
      ['failed', [[ID(2), false]], 0],
    ]);
    const f = sent[1]!.kind!.value as { failures: Array<{ error: unknown }> };
    expect(f.failures[0]!.error).toEqual({ message: 'e2', details: { n: 2 } });
  });

  it('sends the freed slots as a Credit of their own to a coordinator that does not read them with reports', async () => {
    const { reporter, sent } = setup();
    reporter.welcomed(false);
    await finish(reporter, [completed(1), completed(2)]);
    reporter.freeSlot(); // one given back without a report (revoked before it started)
    await turn();
    expect(summary(sent)).toEqual([
      ['completed', [ID(1), ID(2)], 0],
      ['credit', 3],
    ]);
  });

  it('gives no slot back while draining, and sends nothing while disconnected', async () => {
    const draining = setup({ draining: true });
    draining.reporter.welcomed(true);
    await finish(draining.reporter, [completed(1)]);
    draining.reporter.freeSlot();
    await turn();
    expect(summary(draining.sent)).toEqual([['completed', [ID(1)], 0]]);

    const away = setup({ connected: false });
    await finish(away.reporter, [completed(1)]);
    await turn();
    expect(away.sent).toEqual([]);
    away.state.connected = true;
    away.reporter.welcomed(true);
    away.reporter.resend();
    expect(summary(away.sent), 'sent again at the next session').toEqual([['completed', [ID(1)], 0]]);
  });

  it('while the outbox cannot be written: sends no report it could not write and withholds every freed slot, given back once it can', async () => {
    const { reporter, sent, outboxFails } = setup();
    reporter.welcomed(true);
    outboxFails(true);
    expect(reporter.paused).toBe(true);
    await finish(reporter, [completed(1)]); // the write fails: the report is lost (the job is redone)
    reporter.freeSlot(); // an attempt revoked before it started
    reporter.decline([ID(2), ID(3)]); // assigned anyway (Hello's slots, credit given before): not started
    await turn();
    expect(summary(sent), 'no work taken while the outbox fails').toEqual([]);
    outboxFails(false);
    expect(reporter.paused).toBe(false);
    await turn();
    expect(summary(sent)).toEqual([['credit', 4]]);
    // Writes work: a slot freed now goes at once, as before.
    await finish(reporter, [completed(5)]);
    await turn();
    expect(summary(sent).slice(1)).toEqual([['completed', [ID(5)], 1]]);
  });

  it('gives back only the slots declined since a new session, whose Hello offered the ones withheld before', async () => {
    const { reporter, sent, outboxFails } = setup();
    reporter.welcomed(true);
    outboxFails(true);
    reporter.freeSlot();
    reporter.freeSlot();
    reporter.welcomed(true); // a reconnect: Hello offers every slot not running, those two included
    reporter.decline([ID(7)]); // one of them assigned by the new session, declined
    outboxFails(false);
    await turn();
    expect(summary(sent), 'one slot back, not three: the agent would be offered more jobs than it has slots').toEqual([['credit', 1]]);
  });

  it('gives back no withheld slot when the outbox recovers during a drain', async () => {
    const { reporter, sent, state, outboxFails } = setup();
    reporter.welcomed(true);
    outboxFails(true);
    reporter.freeSlot();
    state.draining = true;
    outboxFails(false);
    await turn();
    expect(sent).toEqual([]);
  });

  it('sends a report once when a new session begins between its writing and the end of the turn', async () => {
    // The handler's report is written and queued for this turn; the Welcome of a new session
    // comes in the same turn and resends every report in the outbox, that one included.
    const { reporter, sent } = setup();
    await reporter.write(failed(1));
    reporter.finished(failed(1));
    reporter.welcomed(true);
    reporter.resend();
    await turn();
    // Once; the slot it freed goes on its own (no report is left in the turn to carry it).
    expect(summary(sent)).toEqual([
      ['failed', [[ID(1), true]], 0],
      ['credit', 1],
    ]);
  });

  it('asks for starts with a fresh seq', () => {
    const { reporter, sent } = setup();
    reporter.started([ID(1), ID(2)]);
    reporter.started([ID(3)]);
    expect(summary(sent)).toEqual([
      ['started', [ID(1), ID(2)], 1n],
      ['started', [ID(3)], 2n],
    ]);
  });

  it('gives back an attempt renewed but not run once, until its ack or a new session; never one it holds a report of', async () => {
    const { reporter, sent } = setup();
    reporter.welcomed(true);
    await reporter.write(completed(9));
    reporter.release([ID(1), ID(9)]);
    reporter.release([ID(1)]);
    expect(summary(sent)).toEqual([['failed', [[ID(1), true]], 0]]);
    expect(reporter.ackRelease(ID(1))).toBe(true);
    expect(reporter.ackRelease(ID(1)), 'forgotten once acknowledged').toBe(false);
    reporter.release([ID(1)]);
    reporter.welcomed(true);
    reporter.release([ID(1)]);
    expect(sent).toHaveLength(3);
  });
});
