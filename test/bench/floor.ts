/**
 * The floor: the fewest steps Leasehold's contract allows a job taken one at a time, written
 * with bare Node and bare SQL, to measure what that much costs on this machine beside Leasehold
 * and its peers (`npm run bench -- --systems floor,leasehold,graphile-on --scenarios latency`).
 *
 * The same journey as Leasehold's, each step durable where the contract makes it so, and nothing
 * else: a JSON POST over HTTP/1.1 inserts the job already claimed (an attempt id, the agent) for
 * an agent stream with a free slot, and is answered once committed; the job goes out on an HTTP/2
 * stream; the agent says it started; a fenced UPDATE (attempt id and status in the WHERE) makes
 * the start durable before the agent hears it may run; the handler runs; the agent appends the
 * result to a file and fdatasyncs it before it reports; the completion (a fenced DELETE moving
 * the job to `done` with its result) is committed before the agent hears its ack, completions
 * lingering up to 20 ms for company as Leasehold's do. Messages are JSON in gRPC's framing.
 *
 * What it leaves out is what Leasehold keeps besides: authentication, validation, the history of
 * attempts, counts, webhooks, heartbeats and leases that run out, reconnects, the protobuf
 * schema. So Leasehold can only cost more; the floor says how much of its cost the contract's
 * steps themselves take in Node and PostgreSQL here. It runs the latency scenario only.
 */
import http from 'node:http';
import http2 from 'node:http2';
import type { AddressInfo } from 'node:net';
import type pg from 'pg';
import { createPool } from '../../server/store/index.js';
import { createDb, type System } from './systems.js';

/** Messages on the stream: JSON in gRPC's 5-byte framing. */
export type FloorMessage =
  | { t: 'assign'; id: string; att: string; payload: unknown }
  | { t: 'started'; id: string; att: string }
  | { t: 'renewed'; att: string }
  | { t: 'completed'; id: string; att: string; result: unknown }
  | { t: 'ack'; att: string };

export const FLOOR_PATH = '/floor.Agent/Connect';
const LINGER_MS = 20;

export function frame(m: FloorMessage): Buffer {
  const body = Buffer.from(JSON.stringify(m));
  const f = Buffer.allocUnsafe(5 + body.length);
  f[0] = 0;
  f.writeUInt32BE(body.length, 1);
  body.copy(f, 5);
  return f;
}

/** Calls `on` with each message in the frames of a byte stream. */
export function reader(on: (m: FloorMessage) => void): (chunk: Buffer) => void {
  let pending: Buffer | undefined;
  return (chunk) => {
    const buf = pending ? Buffer.concat([pending, chunk]) : chunk;
    let pos = 0;
    while (buf.length - pos >= 5) {
      const n = buf.readUInt32BE(pos + 1);
      if (buf.length - pos - 5 < n) break;
      on(JSON.parse(buf.toString('utf8', pos + 5, pos + 5 + n)) as FloorMessage);
      pos += 5 + n;
    }
    pending = pos === buf.length ? undefined : buf.subarray(pos);
  };
}

const SCHEMA = `
  CREATE TABLE jobs (
    id bigserial PRIMARY KEY, queue text NOT NULL, payload jsonb NOT NULL, status text NOT NULL,
    attempt_id uuid, agent text, attempt_no int NOT NULL DEFAULT 0,
    claimed_at timestamptz, started_at timestamptz, lease_expires_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT now());
  CREATE UNIQUE INDEX jobs_attempt ON jobs (attempt_id);
  CREATE TABLE done (id bigint PRIMARY KEY, attempt_id uuid NOT NULL, result jsonb, finished_at timestamptz NOT NULL)`;

// The statements, prepared once per connection (named), as Leasehold's hot ones are.
const ENQUEUE = {
  name: 'floor_enqueue',
  text: `INSERT INTO jobs (queue, payload, status, attempt_id, agent, attempt_no, claimed_at)
         VALUES ($1, $2, 'claimed', gen_random_uuid(), $3, 1, now()) RETURNING id::text, attempt_id`,
};
const START = {
  name: 'floor_start',
  text: `UPDATE jobs SET status = 'running', started_at = now(), lease_expires_at = now() + interval '30 s'
         WHERE id = $1 AND attempt_id = $2 AND status = 'claimed'`,
};
const COMPLETE = {
  name: 'floor_complete',
  text: `WITH d AS (DELETE FROM jobs WHERE attempt_id = ANY($1::uuid[]) AND status = 'running' RETURNING id, attempt_id)
         INSERT INTO done (id, attempt_id, result, finished_at)
         SELECT d.id, d.attempt_id, r.result, now() FROM d JOIN unnest($1::uuid[], $2::jsonb[]) r(att, result) ON r.att = d.attempt_id
         RETURNING attempt_id`,
};

interface Stream {
  name: string;
  h2: http2.ServerHttp2Stream;
  free: number;
}

/** The floor's coordinator in this process: the HTTP gateway, the agent streams, the statements. */
export async function floor(adminUrl: string): Promise<System> {
  const url = await createDb(adminUrl, 'bench_floor');
  const pool: pg.Pool = createPool(url, 8);
  await pool.query(SCHEMA);
  const streams: Stream[] = [];
  let next = 0;
  // Enqueues that found every slot taken wait here for the next one freed, in order: Leasehold
  // keeps such a job queued. (Answering 503 made the benchmark's smoke test fail whenever the
  // machine, busy with the rest of the suite, held 32 jobs in flight at once.) In a measured run
  // at 200 jobs/s no enqueue waits.
  const waiting: Array<(s: Stream) => unknown> = [];
  const takeSlot = (): Stream | undefined => {
    for (let k = 0; k < streams.length; k++) {
      const c = streams[(next + k) % streams.length]!;
      if (c.free > 0) {
        next++;
        c.free--;
        return c;
      }
    }
    return undefined;
  };
  /** Gives free slots to the enqueues waiting for one, oldest first. */
  const serveWaiting = () => {
    while (waiting.length > 0) {
      const to = takeSlot();
      if (!to) return;
      waiting.shift()!(to);
    }
  };
  const freed = (s: Stream) => {
    s.free++;
    serveWaiting();
  };
  /** A statement that failed: the run stops on it (`drained`), not measured without its work. */
  let failed: Error | undefined;
  const fail = (err: Error) => {
    failed ??= err;
  };

  // Completions: one statement at a time; one that finds none running waits LINGER_MS for company.
  let batch: Array<{ att: string; result: unknown; s: Stream }> = [];
  let running = false;
  let timer: NodeJS.Timeout | undefined;
  const flush = () => {
    timer = undefined;
    if (running || batch.length === 0) return;
    const items = batch;
    batch = [];
    running = true;
    pool
      .query<{ attempt_id: string }>({ ...COMPLETE, values: [items.map((i) => i.att), items.map((i) => JSON.stringify(i.result))] })
      .then(
        (r) => {
          const acked = new Set(r.rows.map((x) => x.attempt_id));
          for (const i of items) {
            if (!acked.has(i.att)) continue;
            i.s.h2.write(frame({ t: 'ack', att: i.att }));
            freed(i.s);
          }
        },
        fail,
      )
      .finally(() => {
        running = false;
        if (batch.length > 0) flush();
      });
  };

  const onMessage = (s: Stream, m: FloorMessage) => {
    if (m.t === 'started') {
      void pool.query({ ...START, values: [m.id, m.att] }).then(
        (r) => {
          if (r.rowCount === 1) s.h2.write(frame({ t: 'renewed', att: m.att }));
        },
        fail,
      );
    } else if (m.t === 'completed') {
      batch.push({ att: m.att, result: m.result, s });
      if (!running && !timer) timer = setTimeout(flush, LINGER_MS);
    }
  };

  const h2 = http2.createServer();
  const sessions = new Set<http2.ServerHttp2Session>();
  h2.on('session', (x) => {
    sessions.add(x);
    x.on('close', () => sessions.delete(x));
  });
  h2.on('stream', (stream, headers) => {
    if (headers[':path'] !== FLOOR_PATH) {
      stream.respond({ ':status': 404 });
      stream.end();
      return;
    }
    stream.respond({ ':status': 200, 'content-type': 'application/grpc+json' });
    // The stream's slots, as a Hello gives them.
    const s: Stream = { name: `agent-${streams.length + 1}`, h2: stream, free: Number(headers['floor-slots']) || 1 };
    streams.push(s);
    serveWaiting();
    stream.on('data', reader((m) => onMessage(s, m)));
    stream.on('close', () => {
      const i = streams.indexOf(s);
      if (i >= 0) streams.splice(i, 1);
    });
    stream.on('error', () => undefined);
  });
  await new Promise<void>((r) => h2.listen(0, '127.0.0.1', r));

  // The gateway: a job goes to the next stream with a free slot, claimed by its own INSERT.
  const gateway = http.createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (c: Buffer) => chunks.push(c));
    req.on('end', () => {
      let body: { queue?: unknown; payload?: unknown };
      try {
        body = JSON.parse(Buffer.concat(chunks).toString('utf8')) as typeof body;
      } catch {
        res.writeHead(400).end();
        return;
      }
      if (typeof body.queue !== 'string') {
        res.writeHead(400).end();
        return;
      }
      const queue = body.queue;
      const payload = body.payload ?? {};
      const insert = (to: Stream) =>
        pool.query<{ id: string; attempt_id: string }>({ ...ENQUEUE, values: [queue, JSON.stringify(payload), to.name] }).then(
          (r) => {
            const row = r.rows[0]!;
            res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({ id: row.id }));
            to.h2.write(frame({ t: 'assign', id: row.id, att: row.attempt_id, payload }));
          },
          (err: Error) => {
            freed(to);
            res.writeHead(500).end(err.message);
          },
        );
      const to = takeSlot();
      if (to) void insert(to);
      else waiting.push(insert);
    });
  });
  await new Promise<void>((r) => gateway.listen(0, '127.0.0.1', r));

  // The client, as the benchmark's Leasehold client is: JSON over HTTP/1.1 with keep-alive.
  const agent = new http.Agent({ keepAlive: true, maxSockets: 64 });
  const port = (gateway.address() as AddressInfo).port;
  const enqueue = (body: string): Promise<void> =>
    new Promise<void>((resolve, reject) => {
      const req = http.request(
        { host: '127.0.0.1', port, method: 'POST', path: '/enqueue', agent, headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) } },
        (res) => {
          res.resume();
          res.on('end', () => (res.statusCode === 200 ? resolve() : reject(new Error(`floor enqueue: HTTP ${res.statusCode}`))));
          res.on('close', () => res.complete || reject(new Error('floor enqueue: the answer was cut off')));
        },
      );
      req.on('error', reject);
      req.end(body);
    });

  return {
    name: 'floor',
    key: 'floor',
    label: "the contract's floor (bare Node and SQL)",
    database: new URL(url).pathname.slice(1),
    pool,
    pools: [pool],
    async bulkEnqueue() {
      throw new Error('the floor runs the latency scenario only');
    },
    async enqueueOne(payload) {
      await enqueue(JSON.stringify({ queue: 'noop', payload }));
    },
    async drained() {
      if (failed) throw new Error(`the floor: a statement failed: ${failed.message}`, { cause: failed });
      return (await pool.query('SELECT NOT EXISTS (SELECT 1 FROM jobs) AS done')).rows[0].done as boolean;
    },
    async reset() {
      await pool.query('TRUNCATE jobs, done');
    },
    async worker(mode, concurrency) {
      if (mode !== 'latency') throw new Error('the floor runs the latency scenario only');
      return { system: 'floor', mode, concurrency, url: `http://127.0.0.1:${(h2.address() as AddressInfo).port}`, tokens: ['a', 'b'], queue: 'noop' };
    },
    async close() {
      clearTimeout(timer);
      agent.destroy();
      for (const x of sessions) x.destroy();
      await new Promise((r) => gateway.close(r));
      await new Promise((r) => h2.close(r));
      await pool.end();
    },
  };
}
