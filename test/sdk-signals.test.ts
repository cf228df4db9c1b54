/**
 * The agent SDK's signal handling (agent-client/src/signals.ts) on its own, with an event emitter
 * standing in for the process (its signals and its exit): the first SIGINT or SIGTERM drains and
 * exits 0 (1 if the drain fails), a second one exits 1 at once, and the remover takes the
 * handlers away. No real signal is sent.
 */
import { EventEmitter } from 'node:events';
import pino from 'pino';
import { describe, expect, it } from 'vitest';
import { installSignals, type SignalTarget } from '../agent-client/src/signals.js';

function fakeProcess(): SignalTarget & EventEmitter & { exits: number[] } {
  const p = Object.assign(new EventEmitter(), { exits: [] as number[] });
  return Object.assign(p, { exit: (code: number) => void p.exits.push(code) });
}

function drainer() {
  let calls = 0;
  let settle!: { resolve: () => void; reject: (e: Error) => void };
  const drain = () => {
    calls++;
    return new Promise<void>((resolve, reject) => (settle = { resolve, reject }));
  };
  return { drain, calls: () => calls, settle: () => settle };
}

const log = pino({ level: 'silent' });
const tick = () => new Promise((r) => setImmediate(r));

describe('signals', () => {
  it.each(['SIGINT', 'SIGTERM'] as const)('%s drains, then exits 0', async (sig) => {
    const p = fakeProcess();
    const d = drainer();
    installSignals({ log, drain: d.drain, target: p });
    p.emit(sig);
    expect(d.calls()).toBe(1);
    await tick();
    expect(p.exits, 'not before the drain ends').toEqual([]);
    d.settle().resolve();
    await tick();
    expect(p.exits).toEqual([0]);
  });

  it('exits 1 when the drain fails', async () => {
    const p = fakeProcess();
    const d = drainer();
    installSignals({ log, drain: d.drain, target: p });
    p.emit('SIGTERM');
    d.settle().reject(new Error('stuck'));
    await tick();
    expect(p.exits).toEqual([1]);
  });

  it('a second signal exits 1 at once, without draining again', () => {
    const p = fakeProcess();
    const d = drainer();
    installSignals({ log, drain: d.drain, target: p });
    p.emit('SIGTERM');
    p.emit('SIGINT');
    expect(p.exits).toEqual([1]);
    expect(d.calls()).toBe(1);
  });

  it('the remover takes its handlers away', () => {
    const p = fakeProcess();
    const remove = installSignals({ log, drain: drainer().drain, target: p });
    expect([p.listenerCount('SIGINT'), p.listenerCount('SIGTERM')]).toEqual([1, 1]);
    remove();
    remove();
    expect([p.listenerCount('SIGINT'), p.listenerCount('SIGTERM')]).toEqual([0, 0]);
  });
});
