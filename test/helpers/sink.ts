/**
 * A downstream system that counts effects by idempotency key, as a payment API or a mailer
 * would see them: `POST /apply {key, value}` applies (and counts every call, so a test can
 * assert each key was applied exactly once); `GET /status?key=` says whether a key was applied
 * and with what output (what `onUnknown` asks when a step's outcome is unknown).
 *
 * With `fence`, it also does what the docs tell a downstream system to do with
 * `ctx.attempt.number` (a fencing token): an apply from an attempt older than one that already
 * asked about or applied the key is refused (409) and kept in `late`. That is what absorbs the
 * one window no agent can close: frozen between its step's last lease check and its request
 * leaving. The caller tells those apart from a lease check that let an attempt through too late
 * by `delayMs` (how long the request took from its step's lease check to the sink, on the machine's
 * monotonic clock: the fixture sends the check's own clock reading, from the agent's `effect`
 * event, as `mono`, and what was left of the local lease then as `leaseLeftMs`; `at` is when it
 * came, on the same clock).
 */
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import type { Agent } from '@leasehold/agent-client';

/** This machine's monotonic clock in whole ms (CLOCK_MONOTONIC, the same in every process): what the agents' fixture writes as `mono`, and what `delayMs` and `at` are on. */
export const mono = (): number => Number(process.hrtime.bigint() / 1_000_000n);

export interface Sink {
  url: string;
  /** Apply calls per key (every call, duplicates included). */
  readonly applies: Map<string, number>;
  /** Per key, each apply call: the attempt that said it made it, and when it came (wall ms). */
  readonly history: Map<string, Array<{ attemptId: string | undefined; at: number }>>;
  readonly outputs: Map<string, unknown>;
  /** How many status queries came (reconciliations). */
  readonly statusQueries: number;
  /** With `fence`: the applies refused because a later attempt had asked about or applied the key. */
  readonly late: Array<{ key: string; attemptId: string | undefined; attemptNo: number; newest: number; delayMs: number | undefined; leaseLeftMs: number | undefined; at: number; wall: number }>;
  close(): Promise<void>;
}

/**
 * Starts a sink. `onApply` runs after a key is applied and before the answer: return `false` to
 * send no answer (the caller never learns the effect happened).
 */
export async function startSink(onApply?: (key: string) => boolean | void, opts: { fence?: boolean } = {}): Promise<Sink> {
  const applies = new Map<string, number>();
  const newest = new Map<string, number>(); // key → the highest attempt number that asked or applied
  const late: Sink['late'] = [];
  const seen = (key: string, attemptNo: number | undefined) => {
    if (attemptNo !== undefined) newest.set(key, Math.max(newest.get(key) ?? 0, attemptNo));
  };
  const history = new Map<string, Array<{ attemptId: string | undefined; at: number }>>();
  const outputs = new Map<string, unknown>();
  let statusQueries = 0;
  const server = http.createServer((req, res) => {
    const u = new URL(req.url!, 'http://sink');
    if (req.method === 'GET' && u.pathname === '/status') {
      statusQueries++;
      const key = u.searchParams.get('key')!;
      const asking = u.searchParams.get('attemptNo');
      seen(key, asking === null ? undefined : Number(asking));
      res.end(JSON.stringify({ applied: applies.has(key), output: outputs.get(key) ?? null }));
      return;
    }
    let body = '';
    req.on('data', (c) => (body += c));
    req.on('end', () => {
      const { key, value, attemptId, attemptNo, mono: sentAt, leaseLeftMs } = JSON.parse(body) as { key: string; value: number; attemptId?: string; attemptNo?: number; mono?: number; leaseLeftMs?: number };
      if (opts.fence && attemptNo !== undefined && attemptNo < (newest.get(key) ?? 0)) {
        const at = mono();
        late.push({ key, attemptId, attemptNo, newest: newest.get(key)!, delayMs: sentAt === undefined ? undefined : at - sentAt, leaseLeftMs, at, wall: Date.now() });
        res.writeHead(409).end(JSON.stringify({ refused: `attempt ${attemptNo} is older than attempt ${newest.get(key)}` }));
        return;
      }
      seen(key, attemptNo);
      applies.set(key, (applies.get(key) ?? 0) + 1);
      history.set(key, [...(history.get(key) ?? []), { attemptId, at: Date.now() }]);
      outputs.set(key, { applied: value, key });
      if (onApply?.(key) === false) return;
      res.end(JSON.stringify(outputs.get(key)));
    });
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', () => r()));
  return {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    applies,
    history,
    late,
    outputs,
    get statusQueries() {
      return statusQueries;
    },
    close: () =>
      new Promise((r) => {
        server.closeAllConnections();
        server.close(() => r());
      }),
  };
}

/**
 * The fixture's two steps (test/fixtures/sdk-agent.ts, modes `sink` and `pause`) as a handler of
 * an in-process agent: `charge` (n) then `email` (n × 10) against `sink`, answering
 * `{charge, email, by}`. What a second agent runs to finish a job the first one left.
 */
export function handleWithSteps(agent: Agent, queue: string, sink: Sink, by: string): void {
  const apply = async (key: string, value: number, signal: AbortSignal) =>
    (await fetch(`${sink.url}/apply`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ key, value }), signal })).json();
  // A step another attempt started and never recorded: ask the sink whether it happened.
  const onUnknown = async ({ idempotencyKey }: { idempotencyKey: string }) => {
    const s = (await (await fetch(`${sink.url}/status?key=${encodeURIComponent(idempotencyKey)}`)).json()) as { applied: boolean; output: unknown };
    return s.applied ? ({ done: true, output: s.output } as const) : ({ done: false } as const);
  };
  agent.handle(queue, async (j, ctx) => {
    const n = Number(j.payload.n);
    const charge = await ctx.step('charge', ({ idempotencyKey, signal }) => apply(idempotencyKey, n, signal), { onUnknown });
    const email = await ctx.step('email', ({ idempotencyKey, signal }) => apply(idempotencyKey, n * 10, signal), { onUnknown });
    return { charge, email, by };
  });
}
