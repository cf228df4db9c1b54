/**
 * HTTP as an outsider speaks it: `rpc()` POSTs Connect JSON to the gateway with a bearer key, and
 * `startReceiver()` is a webhook receiver that checks signatures the way the docs tell n8n users
 * to (HMAC-SHA256 over `<timestamp>.<raw body>`, compared in constant time), dedupes by event
 * id, and can be told to fail or to hang.
 */
import { createHmac, timingSafeEqual } from 'node:crypto';
import http from 'node:http';
import type { AddressInfo } from 'node:net';

export interface RpcAnswer<T = any> {
  status: number;
  json: T;
  headers: Headers;
}

/** POSTs `body` as JSON to `<base>/<path>` (e.g. `leasehold.v1.JobService/EnqueueJob`). */
export async function rpc<T = any>(base: string, path: string, body: unknown, key?: string): Promise<RpcAnswer<T>> {
  const res = await fetch(`${base}/${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...(key ? { authorization: `Bearer ${key}` } : {}) },
    body: typeof body === 'string' ? body : JSON.stringify(body),
  });
  const text = await res.text();
  let json: any;
  try {
    json = JSON.parse(text);
  } catch {
    throw new Error(`${path} answered ${res.status} with a body that is not JSON: ${text.slice(0, 200)}`);
  }
  return { status: res.status, json, headers: res.headers };
}

/** One request the receiver got. */
export interface Received {
  path: string;
  headers: http.IncomingHttpHeaders;
  body: string;
  /** The signature matched the secret of this path and the body. */
  valid: boolean;
  eventId: string;
}

/**
 * `fail`: 500; a number: that status (after verifying); `hang`: no answer; a function: it
 * answers (or not), whatever the signature, given the request and how many came to this path.
 */
export type Policy = 'ok' | 'fail' | 'hang' | number | ((res: http.ServerResponse, got: Received, n: number) => void);

export interface Receiver {
  url: string;
  /** Every request, in arrival order (duplicates included). */
  readonly received: Received[];
  /** Valid events by id, each once: the receiver's view after dedupe. */
  readonly events: Map<string, Record<string, any>>;
  /** Sets the secret that `path` verifies with. */
  secret(path: string, secret: string): void;
  /** What to answer on `path` (default `ok`: 200 after verifying, 401 on a bad signature). */
  policy(path: string, p: Policy): void;
  /** Resolves once `check` holds for what was received. */
  waitFor(what: string, check: (r: Receiver) => boolean, ms?: number): Promise<void>;
  close(): Promise<void>;
}

/** Verifies a delivery: `sha256=<hex>` of HMAC-SHA256(secret, `${timestamp}.${body}`). */
export function verifySignature(secret: string, timestamp: string | undefined, body: string, signature: string | undefined): boolean {
  if (!timestamp || !signature) return false;
  const want = Buffer.from(`sha256=${createHmac('sha256', secret).update(`${timestamp}.${body}`).digest('hex')}`);
  const got = Buffer.from(signature);
  return want.length === got.length && timingSafeEqual(want, got);
}

export async function startReceiver(): Promise<Receiver> {
  const secrets = new Map<string, string>();
  const policies = new Map<string, Policy>();
  const received: Received[] = [];
  const events = new Map<string, Record<string, any>>();
  const waiters = new Set<() => void>();
  const hanging = new Set<http.ServerResponse>();
  const server = http.createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (c: Buffer) => chunks.push(c));
    req.on('end', () => {
      const path = (req.url ?? '/').split('?')[0]!;
      const body = Buffer.concat(chunks).toString('utf8');
      const secret = secrets.get(path);
      const valid = secret !== undefined && verifySignature(secret, req.headers['leasehold-timestamp'] as string, body, req.headers['leasehold-signature'] as string);
      const eventId = String(req.headers['leasehold-event-id'] ?? '');
      received.push({ path, headers: req.headers, body, valid, eventId });
      const policy = policies.get(path) ?? 'ok';
      if (typeof policy === 'function') {
        hanging.add(res);
        res.on('close', () => hanging.delete(res));
        policy(res, received.at(-1)!, received.filter((r) => r.path === path).length);
      } else if (policy === 'hang') {
        hanging.add(res);
        res.on('close', () => hanging.delete(res));
      } else if (!valid) {
        res.writeHead(401).end('bad signature');
      } else if (policy === 'fail') {
        res.writeHead(500).end('try again');
      } else if (typeof policy === 'number') {
        res.writeHead(policy).end();
      } else {
        if (!events.has(eventId)) events.set(eventId, JSON.parse(body) as Record<string, any>);
        res.writeHead(200, { 'content-type': 'application/json' }).end('{"ok":true}');
      }
      for (const w of [...waiters]) w();
    });
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', () => r()));
  const port = (server.address() as AddressInfo).port;
  const self: Receiver = {
    url: `http://127.0.0.1:${port}`,
    received,
    events,
    secret: (path, s) => void secrets.set(path, s),
    policy: (path, p) => void policies.set(path, p),
    waitFor: (what, check, ms = 15_000) =>
      new Promise((resolve, reject) => {
        const test = () => {
          if (!check(self)) return;
          clearTimeout(timer);
          waiters.delete(test);
          resolve();
        };
        const timer = setTimeout(() => {
          waiters.delete(test);
          reject(new Error(`receiver: timed out after ${ms} ms waiting for ${what}; got ${received.length} requests`));
        }, ms);
        waiters.add(test);
        test();
      }),
    close: () =>
      new Promise((resolve) => {
        for (const r of hanging) r.destroy();
        server.closeAllConnections();
        server.close(() => resolve());
      }),
  };
  return self;
}
