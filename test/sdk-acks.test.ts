/**
 * The agent SDK's ack policy (agent-client/src/acks.ts) on its own, against a real outbox in a
 * temporary directory and a fake reporter: ok and duplicate forget the report, stale and other
 * refusals set it aside, an invalid result becomes a final failure that is reported in its place,
 * an ack for an attempt given back only ends that, and the drain's wait for an empty outbox ends
 * at the last ack. No coordinator.
 */
import { EventEmitter } from 'node:events';
import { existsSync, readFileSync } from 'node:fs';
import { mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { create } from '@bufbuild/protobuf';
import pino from 'pino';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { Outbox, readOutbox, type OutboxEntry } from '@leasehold/agent-client';
import { Acks } from '../agent-client/src/acks.js';
import type { AgentEvents } from '../agent-client/src/events.js';
import { ServerMessage_Ack_ItemSchema } from '../agent-client/src/gen/leasehold/v1/agent_service_pb.js';
import { Outcome } from '../agent-client/src/gen/leasehold/v1/job_pb.js';

const ID = (n: number) => `00000000-0000-4000-8000-${String(n).padStart(12, '0')}`;
const completed = (n: number): OutboxEntry => ({ attemptId: ID(n), jobId: `j${n}`, queue: 'q', attemptNo: 1, kind: 'completed', result: { n }, writtenAt: new Date().toISOString() });
const failed = (n: number): OutboxEntry => ({ attemptId: ID(n), jobId: `j${n}`, queue: 'q', attemptNo: 1, kind: 'failed', error: { message: 'no' }, retryable: true, writtenAt: new Date().toISOString() });
const ack = (n: number, outcome: Outcome, message = '') => create(ServerMessage_Ack_ItemSchema, { attemptId: ID(n), outcome, message });

const dirs: string[] = [];
const open: Outbox[] = [];

async function setup(entries: OutboxEntry[], released: string[] = [], onLine: (l: Record<string, unknown>) => void = () => undefined) {
  const dir = await mkdtemp(path.join(os.tmpdir(), 'leasehold-acks-'));
  dirs.push(dir);
  const outbox = new Outbox(dir, pino({ level: 'silent' }));
  await outbox.open();
  open.push(outbox);
  for (const e of entries) await outbox.put(e);
  const events = new EventEmitter<AgentEvents>();
  const acked: Array<AgentEvents['acked'][0]> = [];
  events.on('acked', (a) => acked.push(a));
  const reported: OutboxEntry[] = [];
  const givenBack = new Set(released);
  const acks = new Acks({
    // The log lines, parsed: what an operator reads about each ack.
    log: pino({ level: 'info' }, { write: (l: string) => onLine(JSON.parse(l) as Record<string, unknown>) }),
    events,
    outbox,
    reporter: { report: (e) => void reported.push(e), ackRelease: (id) => givenBack.delete(id) },
  });
  return { dir, outbox, acks, acked, reported };
}

afterEach(async () => {
  for (const o of open.splice(0)) await o.close();
});
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

describe('acks', () => {
  it('forgets a report acknowledged ok or duplicate', async () => {
    const { dir, outbox, acks, acked } = await setup([completed(1), completed(2)]);
    await acks.onAck(ack(1, Outcome.OK));
    await acks.onAck(ack(2, Outcome.DUPLICATE));
    expect(outbox.pending()).toEqual([]);
    expect(acked).toEqual([
      { attemptId: ID(1), outcome: 'OK' },
      { attemptId: ID(2), outcome: 'DUPLICATE' },
    ]);
    await outbox.close();
    expect(await readOutbox(dir)).toEqual({ pending: [], superseded: [] });
  });

  it('sets aside a report refused as stale, or refused otherwise, and never sends it again', async () => {
    const { dir, outbox, acks, acked, reported } = await setup([completed(1), failed(2), failed(3)]);
    await acks.onAck(ack(1, Outcome.STALE));
    await acks.onAck(ack(2, Outcome.FORBIDDEN));
    await acks.onAck(ack(3, Outcome.INVALID, 'too big'));
    expect(outbox.pending()).toEqual([]);
    expect(reported).toEqual([]);
    expect(acked.map((a) => a.outcome)).toEqual(['STALE', 'FORBIDDEN', 'INVALID']);
    await outbox.close();
    const { superseded } = await readOutbox(dir);
    expect(superseded.map((s) => [s.attemptId, s.reason])).toEqual([
      [ID(1), 'STALE'],
      [ID(2), 'FORBIDDEN'],
      [ID(3), 'INVALID'],
    ]);
  });

  it('says a report is kept aside only when the ack set it aside (a second ack of it, after the report was sent again, does not)', async () => {
    const lines: Array<Record<string, unknown>> = [];
    const { dir, acks, acked } = await setup([failed(1)], [], (l) => lines.push(l));
    await acks.onAck(ack(1, Outcome.STALE));
    await acks.onAck(ack(1, Outcome.STALE));
    const stale = lines.filter((l) => l.attemptId === ID(1) && l.outcome === 'STALE');
    expect(stale.map((l) => [l.setAside, l.msg])).toEqual([
      ['superseded', 'report refused as stale: the attempt was superseded; kept aside as superseded'],
      [undefined, 'report refused as stale: the attempt was superseded (already set aside)'],
    ]);
    expect(acked.map((a) => a.outcome)).toEqual(['STALE', 'STALE']);
    expect((await readOutbox(dir)).superseded.map((s) => s.attemptId)).toEqual([ID(1)]);
  });

  it('says a report is kept aside only once it is on disk, even when a second ack of it comes while the first is being written', async () => {
    // A report can be sent twice (again at a new session's Welcome) and refused twice; the
    // agent applies acks as they come, without waiting for the one before. An operator (or a
    // test) who reads the outbox when the log says "kept aside" must find it there.
    let dir = '';
    // For each line saying "kept aside": was it in superseded.jsonl when the line was written?
    const onDiskWhenLogged: boolean[] = [];
    const copy = () => path.join(dir, 'superseded.jsonl');
    const { dir: d, acks } = await setup([failed(1)], [], (l) => {
      if (l.setAside) onDiskWhenLogged.push(existsSync(copy()) && readFileSync(copy(), 'utf8').includes(ID(1)));
    });
    dir = d;
    await Promise.all([acks.onAck(ack(1, Outcome.STALE)), acks.onAck(ack(1, Outcome.STALE))]);
    expect(onDiskWhenLogged).toEqual([true]);
    expect(await readOutbox(dir)).toMatchObject({ pending: [], superseded: [expect.objectContaining({ attemptId: ID(1), reason: 'STALE' })] });
  });

  it('replaces a result refused as invalid by a final failure, durable and reported in its place', async () => {
    const { outbox, acks, acked, reported } = await setup([completed(1)]);
    await acks.onAck(ack(1, Outcome.INVALID, 'result too large'));
    const [e] = outbox.pending();
    expect(e).toMatchObject({ attemptId: ID(1), kind: 'failed', retryable: false, error: { message: expect.stringContaining('result too large') } });
    expect(e).not.toHaveProperty('result');
    expect(reported).toEqual([e]);
    expect(acked, 'acknowledged only when the failure is').toEqual([]);
  });

  it('an ack for an attempt it gave back only ends that', async () => {
    const { outbox, acks, acked } = await setup([completed(2)], [ID(1), ID(2)]);
    await acks.onAck(ack(1, Outcome.OK));
    expect(acked).toEqual([]);
    await acks.onAck(ack(2, Outcome.OK));
    expect(acked, 'given back, but its report is in the outbox: the ack is for the report').toEqual([{ attemptId: ID(2), outcome: 'OK' }]);
    expect(outbox.pending()).toEqual([]);
  });

  it('the wait for an empty outbox ends at the last ack, or when its time is up', async () => {
    const { outbox, acks } = await setup([completed(1), completed(2)]);
    const flushed = acks.flush(60_000);
    let done = false;
    void flushed.then(() => (done = true));
    await acks.onAck(ack(1, Outcome.OK));
    await new Promise((r) => setImmediate(r));
    expect(done, 'one report still unacknowledged').toBe(false);
    await acks.onAck(ack(2, Outcome.OK));
    await flushed;
    expect(outbox.pending()).toEqual([]);

    await outbox.put(completed(3));
    const t0 = performance.now();
    await acks.flush(50);
    expect(performance.now() - t0).toBeGreaterThanOrEqual(49);
    expect(outbox.pending()).toHaveLength(1);
  });
});
