/**
 * `AgentHub` waking from a pause of its process, over real PostgreSQL: whichever it acts on first,
 * its stall watch's beat or the end of a stream read from its socket (the event loop's choice, as
 * replica-pause.test found on a busy machine), what that stream held is left as it is: not marked
 * suspect, its lease not touched (its agent may hold it through another replica by now). Without
 * a pause, the same end marks it suspect. The pause is `performance.now()` jumping ahead, the
 * clock the watch beats on.
 */
import { Code } from '@connectrpc/connect';
import pino from 'pino';
import { afterEach, expect, it, vi } from 'vitest';
import { AgentHub, type Session } from '../server/core/agent-hub.js';
import { agentCreate } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { makeJob } from './helpers/factories.js';

const t = useTestDb();
const hubs: AgentHub[] = [];

afterEach(async () => {
  vi.restoreAllMocks();
  await Promise.all(hubs.splice(0).map((h) => h.stop()));
});

/** A started hub (stall threshold 1 s), its log lines, and a session of a new agent resuming one running attempt. */
async function setup(agentId: string) {
  const lines: Array<Record<string, unknown>> = [];
  const log = pino({ level: 'info' }, { write: (s: string) => void lines.push(JSON.parse(s) as Record<string, unknown>) });
  const hub = new AgentHub(t.pool, log, { leaseTtlMs: 30_000, claimTtlMs: 30_000, heartbeatIntervalMs: 500, stallMs: 1_000 });
  hubs.push(hub);
  hub.start();
  const made = await agentCreate(t.pool, { agentId });
  if (made.outcome !== 'ok') throw new Error(JSON.stringify(made));
  const job = await makeJob(t.pool, { status: 'running', agentId });
  const o = await hub.open({ agentId, token: made.value.token, queues: ['q'], labels: {}, slots: 2, resume: [job.currentAttemptId!], seq: 0n });
  if (o.outcome !== 'ok') throw new Error(JSON.stringify(o));
  const s: Session = o.value;
  expect([...s.held.keys()]).toEqual([job.currentAttemptId]);
  const row = async () =>
    (await t.pool.query(`SELECT suspect_since, lease_expires_at, current_attempt_id FROM jobs WHERE id = $1`, [job.id])).rows[0] as {
      suspect_since: Date | null;
      lease_expires_at: Date;
      current_attempt_id: string;
    };
  return { hub, lines, s, job, row, lease: (await row()).lease_expires_at };
}

/** From now on `performance.now()` reads `ms` later than it is: to the stall watch, the process did not run for `ms`. */
function pause(ms: number) {
  const now = performance.now.bind(performance);
  vi.spyOn(performance, 'now').mockImplementation(() => now() + ms);
}

const closed = (hub: AgentHub) => new Promise<void>((resolve) => hub.once('session:close', () => resolve()));

it('the watch beats first: it ends the stream (GoAway) and leaves what it held alone', async () => {
  const { hub, lines, s, job, row, lease } = await setup('pause-beat');
  const gone = closed(hub);
  pause(8_000);
  await gone;
  const woke = lines.find((l) => l.pausedMs !== undefined);
  expect(woke).toMatchObject({ streams: 1, held: 1 });
  expect(woke!.pausedMs).toBeGreaterThanOrEqual(8_000);
  expect(lines.find((l) => l.paused === true)).toMatchObject({ held: [job.currentAttemptId] });
  // GoAway, then the stream ends with UNAVAILABLE (a status agents retry at once).
  const types: string[] = [];
  const ended = await (async () => {
    for await (const m of s.out) types.push(m.type);
  })().catch((e: unknown) => e);
  expect(types).toContain('goAway');
  expect(ended).toMatchObject({ code: Code.Unavailable });
  expect(await row()).toMatchObject({ suspect_since: null, lease_expires_at: lease, current_attempt_id: job.currentAttemptId });
});

it('the stream ends first: the end is read while the process is stalled, and what it held is left alone; the beat then finds no stream', async () => {
  const { hub, lines, s, job, row, lease } = await setup('pause-end');
  pause(8_000);
  // In the same turn as the wake, before the watch's next beat: as an end read from the socket.
  await hub.close(s, { lost: true });
  expect(lines.find((l) => l.paused === true)).toMatchObject({ held: [job.currentAttemptId] });
  expect(await row()).toMatchObject({ suspect_since: null, lease_expires_at: lease });
  // The beat comes within its 100 ms interval.
  await vi.waitUntil(() => lines.some((l) => l.pausedMs !== undefined), { timeout: 2_000, interval: 20 });
  expect(lines.find((l) => l.pausedMs !== undefined)).toMatchObject({ streams: 0, held: 0 });
  expect(await row()).toMatchObject({ suspect_since: null, lease_expires_at: lease });
});

it('without a pause, the same end marks what the stream held suspect', async () => {
  const { hub, lines, s, row } = await setup('pause-none');
  await hub.close(s, { lost: true });
  expect(lines.filter((l) => l.paused === true || l.pausedMs !== undefined)).toEqual([]);
  expect((await row()).suspect_since).toBeInstanceOf(Date);
});
