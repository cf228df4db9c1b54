/**
 * The floor's agent (floor.ts): one HTTP/2 stream per token. A job assigned is reported started;
 * once the start is confirmed its handler runs; its result is appended to an outbox file and
 * fdatasync'd (one sync for every result written since the last, as the SDK's outbox does)
 * before it is reported; an ack ends it.
 */
import http2 from 'node:http2';
import { open } from 'node:fs/promises';
import path from 'node:path';
import { frame, reader, FLOOR_PATH, type FloorMessage } from './floor.js';

/** `streams` streams to the floor at `url`, `concurrency` slots among them. */
export async function floorAgent(url: string, streams: number, concurrency: number, outboxDir: string, onJob: (payload: Record<string, unknown>) => unknown): Promise<void> {
  const session = http2.connect(url);
  session.on('error', () => undefined);
  const outbox = await open(path.join(outboxDir, 'floor-outbox.log'), 'a');
  for (let k = 0; k < streams; k++) {
    const stream = session.request({ ':method': 'POST', ':path': FLOOR_PATH, 'content-type': 'application/grpc+json', 'floor-slots': String(Math.ceil(concurrency / streams)) });
    stream.on('error', () => undefined);
    await new Promise((r) => stream.once('response', r));
    const assigned = new Map<string, { id: string; payload: Record<string, unknown> }>();
    // Results written, waiting for their sync; a sync running.
    let unsynced: Array<{ id: string; att: string; result: unknown }> = [];
    let syncing = false;
    const sync = async () => {
      if (syncing || unsynced.length === 0) return;
      syncing = true;
      const batch = unsynced;
      unsynced = [];
      await outbox.write(batch.map((r) => `${JSON.stringify(r)}\n`).join(''));
      await outbox.datasync();
      for (const r of batch) stream.write(frame({ t: 'completed', ...r }));
      syncing = false;
      void sync();
    };
    const run = async (att: string) => {
      const job = assigned.get(att)!;
      assigned.delete(att);
      await onJob(job.payload);
      unsynced.push({ id: job.id, att, result: {} });
      void sync();
    };
    stream.on(
      'data',
      reader((m: FloorMessage) => {
        if (m.t === 'assign') {
          assigned.set(m.att, { id: m.id, payload: m.payload as Record<string, unknown> });
          stream.write(frame({ t: 'started', id: m.id, att: m.att }));
        } else if (m.t === 'renewed') {
          void run(m.att);
        }
      }),
    );
  }
}
