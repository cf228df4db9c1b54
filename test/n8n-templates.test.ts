/**
 * The n8n workflow templates in examples/n8n/: each parses as an n8n workflow export, uses only
 * node types and typeVersions that n8n 1.x ships (so it imports into 1.x and 2.x), is wired
 * consistently, and has a Manual Trigger. Then their logic is run against a real coordinator by
 * a small interpreter of the n8n expressions and Code nodes they contain: the enqueue template
 * enqueues and branches on 409, the agent template claims, starts, heartbeats and completes,
 * and the webhook templates accept a real signed delivery and reject a tampered one.
 */
import { createHmac } from 'node:crypto';
import { readdirSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { keyCreate, signingSecretGet, subscriptionCreate } from '../server/store/index.js';
import { useTestDb } from './helpers/db.js';
import { ADMIN_KEY, useCoordinator } from './helpers/coordinator.js';
import { rpc, startReceiver, type Receiver } from './helpers/http.js';

/**
 * typeVersions of the n8n-nodes-base nodes the templates may use, as n8n 1.x declares them
 * (the `version` arrays / `nodeVersions` maps in packages/nodes-base/nodes/…). Every version
 * listed here is also accepted by n8n 2.x.
 */
const N8N_1X_VERSIONS: Record<string, number[]> = {
  'n8n-nodes-base.manualTrigger': [1],
  'n8n-nodes-base.scheduleTrigger': [1, 1.1, 1.2],
  'n8n-nodes-base.webhook': [1, 1.1, 2],
  'n8n-nodes-base.httpRequest': [1, 2, 3, 4, 4.1, 4.2],
  'n8n-nodes-base.crypto': [1],
  'n8n-nodes-base.if': [1, 2],
  'n8n-nodes-base.code': [1, 2],
  'n8n-nodes-base.respondToWebhook': [1, 1.1],
  'n8n-nodes-base.extractFromFile': [1],
  'n8n-nodes-base.noOp': [1],
  'n8n-nodes-base.stopAndError': [1],
  'n8n-nodes-base.stickyNote': [1],
  'n8n-nodes-base.set': [1, 2, 3, 3.1, 3.2, 3.3, 3.4],
  'n8n-nodes-base.splitOut': [1],
  'n8n-nodes-base.wait': [1, 1.1],
};
/** The versions the issue names for these node types. */
const REQUIRED_VERSIONS: Record<string, number> = {
  'n8n-nodes-base.httpRequest': 4.2,
  'n8n-nodes-base.webhook': 2,
  'n8n-nodes-base.scheduleTrigger': 1.2,
  'n8n-nodes-base.crypto': 1,
  'n8n-nodes-base.manualTrigger': 1,
  'n8n-nodes-base.wait': 1.1,
};

interface N8nNode {
  id: string;
  name: string;
  type: string;
  typeVersion: number;
  position: [number, number];
  parameters: Record<string, any>;
  credentials?: Record<string, { id: string; name: string }>;
  onError?: string;
}
interface Workflow {
  name: string;
  nodes: N8nNode[];
  connections: Record<string, { main: Array<Array<{ node: string; type: string; index: number }>> }>;
  settings: Record<string, unknown>;
}

const dir = path.resolve(import.meta.dirname, '../examples/n8n');
const files = readdirSync(dir).filter((f) => f.endsWith('.json')).sort();
const load = (f: string) => JSON.parse(readFileSync(path.join(dir, f), 'utf8')) as Workflow;
const node = (w: Workflow, name: string) => {
  const n = w.nodes.find((x) => x.name === name);
  if (!n) throw new Error(`${w.name}: no node ${name}`);
  return n;
};
/** The node `from` leads to on its output `output`. */
const next = (w: Workflow, from: string, output = 0) => w.connections[from]?.main[output]?.map((c) => c.node) ?? [];

describe('the templates as files', () => {
  it('has the five templates of the issues', () => {
    expect(files).toEqual(['a-enqueue-job.json', 'b-receive-notifications.json', 'c-dead-letter-alert.json', 'd-agent-loop.json', 'e-wait-for-job.json']);
  });

  it.each(files)('%s: parses, uses n8n 1.x node types and versions, and is wired consistently', (f) => {
    const w = load(f);
    expect(typeof w.name).toBe('string');
    expect(w.settings).toMatchObject({ executionOrder: 'v1' });
    const names = new Set(w.nodes.map((n) => n.name));
    expect(names.size).toBe(w.nodes.length);
    expect(new Set(w.nodes.map((n) => n.id)).size).toBe(w.nodes.length);
    for (const n of w.nodes) {
      expect(Object.keys(N8N_1X_VERSIONS), `${n.name}: ${n.type}`).toContain(n.type);
      expect(N8N_1X_VERSIONS[n.type], `${n.name}: ${n.type}@${n.typeVersion}`).toContain(n.typeVersion);
      if (REQUIRED_VERSIONS[n.type] !== undefined) expect(n.typeVersion, `${n.name}`).toBe(REQUIRED_VERSIONS[n.type]);
      expect(n.position).toHaveLength(2);
      expect(typeof n.parameters).toBe('object');
    }
    for (const [from, c] of Object.entries(w.connections)) {
      expect(names, `connection from ${from}`).toContain(from);
      for (const out of c.main) for (const to of out) expect(names, `connection ${from} → ${to.node}`).toContain(to.node);
    }
    expect(w.nodes.some((n) => n.type === 'n8n-nodes-base.manualTrigger')).toBe(true);
    // With task runners off (n8n 1.x's default), an expression reading a Code node's output
    // through $('…') gets null ($json is fine): expressions may only name other nodes.
    const codeNodes = new Set(w.nodes.filter((n) => n.type === 'n8n-nodes-base.code').map((n) => n.name));
    for (const n of w.nodes) {
      const exprs = JSON.stringify(n.parameters, (k, v) => (k === 'jsCode' ? undefined : v));
      for (const m of exprs.matchAll(/\$\(\\?['"](.+?)\\?['"]\)/g)) expect(codeNodes.has(m[1]!), `${n.name} reads the Code node ${m[1]} with $()`).toBe(false);
    }
    for (const n of w.nodes.filter((x) => x.type === 'n8n-nodes-base.httpRequest' && String(x.parameters.url).includes('leasehold.v1'))) {
      expect(n.parameters).toMatchObject({
        method: 'POST',
        authentication: 'genericCredentialType',
        genericAuthType: 'httpHeaderAuth',
        options: { response: { response: { fullResponse: true, neverError: true } } },
      });
      expect(n.credentials?.httpHeaderAuth).toBeDefined();
      expect(String(n.parameters.url)).toMatch(/\/leasehold\.v1\.(JobService|AttemptService)\/(EnqueueJob|GetJob|ListJobs|CancelJob|ClaimJobs|StartAttempt|Heartbeat|CompleteAttempt|FailAttempt)$/);
    }
  });

  it('the webhook templates read the raw body, HMAC it with the Crypto node, answer 401 on a bad signature and dedupe by event id', () => {
    for (const f of ['b-receive-notifications.json', 'c-dead-letter-alert.json']) {
      const w = load(f);
      const hook = w.nodes.find((n) => n.type === 'n8n-nodes-base.webhook')!;
      expect(hook.parameters).toMatchObject({ httpMethod: 'POST', responseMode: 'responseNode', options: { rawBody: true } });
      const crypto = w.nodes.find((n) => n.type === 'n8n-nodes-base.crypto')!;
      expect(crypto.parameters).toMatchObject({ action: 'hmac', type: 'SHA256', encoding: 'hex' });
      expect(crypto.parameters.value).toContain("headers['leasehold-timestamp']");
      const check = node(w, next(w, crypto.name)[0]!);
      expect(JSON.stringify(check.parameters)).toContain("headers['leasehold-signature']");
      const reject = node(w, next(w, check.name, 1)[0]!);
      expect(reject).toMatchObject({ type: 'n8n-nodes-base.respondToWebhook', parameters: { options: { responseCode: 401 } } });
      expect(node(w, next(w, check.name, 0)[0]!).parameters.jsCode).toContain('$getWorkflowStaticData');
    }
    const c = load('c-dead-letter-alert.json');
    expect(c.nodes.find((n) => n.type === 'n8n-nodes-base.scheduleTrigger')).toBeDefined();
    expect(node(c, 'List dead jobs').parameters.jsonBody).toContain('JOB_STATUS_DEAD');
  });

  it('the agent template goes claim → start → heartbeat → complete, with 409 branches and a fail path', () => {
    const w = load('d-agent-loop.json');
    const order: string[] = [];
    let at = 'Settings';
    while (at) {
      const n = node(w, at);
      const m = /AttemptService\/(\w+)$/.exec(String(n.parameters.url ?? ''));
      if (m) order.push(m[1]!);
      at = next(w, at, 0)[0]!;
    }
    expect(order).toEqual(['ClaimJobs', 'StartAttempt', 'Heartbeat', 'CompleteAttempt']);
    expect(next(w, 'Do the work (part 1)', 1)).toEqual(['Fail (FailAttempt)']);
    expect(next(w, 'Lease still ours?', 1)).toEqual(['Lease lost: stop here']);
  });

  it('the wait template enqueues with its resume URL and a header, waits on a Header Auth webhook (limited), and branches on the event type', () => {
    const w = load('e-wait-for-job.json');
    const enqueue = node(w, 'Enqueue job');
    expect(enqueue.credentials?.httpHeaderAuth?.name).toBe('Leasehold API key');
    expect(enqueue.parameters.jsonBody).toContain('notifyUrl: $execution.resumeUrl');
    expect(enqueue.parameters.jsonBody).toContain("notifyHeader: { name: 'X-Resume-Token', value: 'REPLACE_WITH_RESUME_TOKEN' }");
    expect(next(w, 'Enqueue job')).toEqual(['Enqueued?']);
    const wait = node(w, next(w, 'Enqueued?', 0)[0]!);
    expect(wait).toMatchObject({
      type: 'n8n-nodes-base.wait',
      parameters: { resume: 'webhook', httpMethod: 'POST', incomingAuthentication: 'headerAuth', limitWaitTime: true, limitType: 'afterTimeInterval' },
      credentials: { httpHeaderAuth: { name: 'Leasehold resume token' } },
    });
    expect(wait.parameters.responseMode ?? 'onReceived').toBe('onReceived');
    expect(node(w, next(w, 'Enqueued?', 1)[0]!).type).toBe('n8n-nodes-base.stopAndError');
    expect(next(w, wait.name)).toEqual(['Succeeded?']);
    expect(node(w, next(w, 'Succeeded?', 0)[0]!).type).toBe('n8n-nodes-base.set');
    expect(node(w, next(w, 'Succeeded?', 1)[0]!).type).toBe('n8n-nodes-base.stopAndError');
  });
});

// ─────────── running the templates' logic against a coordinator ───────────

type Item = { json: any };
/** A tiny evaluator of what the templates use of n8n: `={{ js }}` expressions and Code nodes. */
class MiniN8n {
  readonly outputs = new Map<string, Item[]>();
  readonly staticData: Record<string, any> = {};
  /** `execution`: what `$execution` holds (its id and resume URL). */
  constructor(
    readonly w: Workflow,
    readonly execution: { id: string; resumeUrl: string } = { id: '1', resumeUrl: 'http://127.0.0.1:5678/webhook-waiting/1' },
  ) {}
  private scope(current: Item) {
    const ref = (name: string) => {
      const items = this.outputs.get(name);
      if (!items) throw new Error(`no output of ${name} yet`);
      return { item: items[0]!, first: () => items[0]!, all: () => items };
    };
    return {
      $json: current.json,
      $: ref,
      $input: { first: () => current, all: () => [current] },
      $getWorkflowStaticData: () => this.staticData,
      $execution: this.execution,
    };
  }
  expr(value: unknown, current: Item): unknown {
    if (typeof value !== 'string' || !value.startsWith('=')) return value;
    const s = this.scope(current);
    const run = (js: string) => new Function(...Object.keys(s), `return (${js});`)(...Object.values(s));
    const whole = /^=\{\{([\s\S]*)\}\}$/.exec(value);
    if (whole && !whole[1]!.includes('}}')) return run(whole[1]!);
    return value.slice(1).replace(/\{\{([\s\S]*?)\}\}/g, (_, js: string) => String(run(js)));
  }
  code(name: string, input: Item): Item[] {
    const s = this.scope(input);
    const p = node(this.w, name).parameters;
    const ret = new Function(...Object.keys(s), p.jsCode)(...Object.values(s)) as Item[] | Item;
    const out = p.mode === 'runOnceForEachItem' ? [ret as Item] : (ret as Item[]);
    this.outputs.set(name, out);
    return out;
  }
  /** An Edit Fields (Set) 3.x node in manual mode: only the assigned fields. */
  setNode(name: string, input: Item): Item[] {
    const json: Record<string, unknown> = {};
    for (const a of node(this.w, name).parameters.assignments.assignments as Array<{ name: string; value: unknown; type: string }>) {
      const v = this.expr(a.value, input);
      json[a.name] = a.type === 'number' ? Number(v) : v;
    }
    const out = [{ json }];
    this.outputs.set(name, out);
    return out;
  }
  /** A Split Out node: one item per element of the (dotted) field. */
  splitOut(name: string, input: Item): Item[] {
    const field = String(node(this.w, name).parameters.fieldToSplitOut);
    const list = field.split('.').reduce((o: any, k) => o?.[k], input.json) as unknown[];
    const out = list.map((v) => ({ json: v }));
    this.outputs.set(name, out);
    return out;
  }
  set(name: string, items: Item[]) {
    this.outputs.set(name, items);
  }
  /** Evaluates an IF v2 node on `item`. */
  ifNode(name: string, item: Item): boolean {
    const { conditions, combinator } = node(this.w, name).parameters.conditions;
    const results = (conditions as Array<any>).map((c) => {
      const l = this.expr(c.leftValue, item) as any;
      const r = this.expr(c.rightValue, item) as any;
      switch (`${c.operator.type}:${c.operator.operation}`) {
        case 'number:equals':
          return Number(l) === Number(r);
        case 'number:gt':
          return Number(l) > Number(r);
        case 'number:lt':
          return Number(l) < Number(r);
        case 'string:equals':
          return String(l) === String(r);
        case 'boolean:false':
          return l === false;
        default:
          throw new Error(`operator ${JSON.stringify(c.operator)} not in the mini interpreter`);
      }
    });
    return combinator === 'or' ? results.some(Boolean) : results.every(Boolean);
  }
  /** Runs an HTTP Request node the way n8n does with full response + never error. */
  async http(name: string, item: Item, key: string, base: string): Promise<Item> {
    const p = node(this.w, name).parameters;
    const url = String(this.expr(p.url, item)).replace('http://127.0.0.1:8080', base);
    const res = await fetch(url, {
      method: p.method,
      headers: { 'content-type': 'application/json', authorization: `Bearer ${key}` },
      body: String(this.expr(p.jsonBody, item)),
    });
    const out = { json: { statusCode: res.status, headers: Object.fromEntries(res.headers), body: await res.json() } };
    this.outputs.set(name, [out]);
    return out;
  }
}

describe('the templates against a coordinator', () => {
  const t = useTestDb();
  const lh = useCoordinator(t, { LEASEHOLD_WEBHOOK_INTERVAL: '50ms' });
  let rx: Receiver;
  beforeAll(async () => {
    rx = await startReceiver();
  });
  afterAll(async () => {
    await rx.close();
  });

  it('a: enqueues with the idempotency key; a re-run is 200 duplicate; another payload under the key takes the 409 branch', async () => {
    const w = load('a-enqueue-job.json');
    const n = new MiniN8n(w);
    const [job] = n.code('Build the job', { json: {} });
    const first = await n.http('Enqueue job', job!, ADMIN_KEY, lh.httpUrl);
    expect(n.ifNode('Enqueued?', first)).toBe(true);
    expect(n.code('Job enqueued', first)[0]!.json).toMatchObject({ outcome: 'OUTCOME_OK', status: 'JOB_STATUS_QUEUED' });
    const again = await n.http('Enqueue job', job!, ADMIN_KEY, lh.httpUrl);
    expect(n.code('Job enqueued', again)[0]!.json).toMatchObject({ outcome: 'OUTCOME_DUPLICATE', jobId: first.json.body.job.id });
    const other = await n.http('Enqueue job', { json: { ...job!.json, payload: { reportId: 'R-9' } } }, ADMIN_KEY, lh.httpUrl);
    expect(n.ifNode('Enqueued?', other)).toBe(false);
    expect(n.ifNode('Key reused (409)?', other)).toBe(true);
    expect(other.json.body).toMatchObject({ outcome: 'conflict', status: 409 });
    // Out of the way of the agent template's run below (same queue).
    expect((await rpc(lh.httpUrl, 'leasehold.v1.JobService/CancelJob', { jobId: first.json.body.job.id }, ADMIN_KEY)).status).toBe(200);
  });

  it('d: claims, starts, heartbeats and completes a job; the repeat completion is a duplicate', async () => {
    const k = await keyCreate(t.pool, { name: 'n8n-worker', scopes: ['agent'] });
    if (k.outcome !== 'ok') throw new Error('key');
    const agentKey = k.value.key;
    expect((await rpc(lh.httpUrl, 'leasehold.v1.JobService/EnqueueJob', { queue: 'reports', payload: { reportId: 'R-2' } }, ADMIN_KEY)).status).toBe(200);
    const w = load('d-agent-loop.json');
    const n = new MiniN8n(w);
    const [settings] = n.setNode('Settings', { json: {} });
    const claim = await n.http('Claim (ClaimJobs)', settings!, agentKey, lh.httpUrl);
    expect(n.ifNode('Got a job?', claim)).toBe(true);
    const [claimed] = n.splitOut('Split the claimed jobs', claim);
    const [one] = n.setNode('One item per claimed job', claimed!);
    expect(one!.json).toMatchObject({ payload: { reportId: 'R-2' }, attemptNo: 1 });
    const start = await n.http('Start (StartAttempt)', one!, agentKey, lh.httpUrl);
    expect(n.ifNode('Started?', start)).toBe(true);
    const [part1] = n.code('Do the work (part 1)', start);
    const hb = await n.http('Heartbeat', part1!, agentKey, lh.httpUrl);
    expect(n.ifNode('Lease still ours?', hb)).toBe(true);
    const [part2] = n.code('Do the work (part 2)', hb);
    const done = await n.http('Complete (CompleteAttempt)', part2!, agentKey, lh.httpUrl);
    expect(n.ifNode('Completed?', done)).toBe(true);
    expect(done.json.body).toMatchObject({ outcome: 'OUTCOME_OK', job: { status: 'JOB_STATUS_SUCCEEDED', result: { part1: 'done', part2: 'done' } } });
    const repeat = await n.http('Complete (CompleteAttempt)', part2!, agentKey, lh.httpUrl);
    expect(repeat.json.body.outcome).toBe('OUTCOME_DUPLICATE');
    // Nothing left: the next scheduled run takes the "Nothing to do" branch.
    expect(n.ifNode('Got a job?', await n.http('Claim (ClaimJobs)', settings!, agentKey, lh.httpUrl))).toBe(false);
  });

  it('b and c: a real signed delivery passes the signature check once; a tampered body or a stale timestamp is refused', async () => {
    const sub = await subscriptionCreate(t.pool, { queue: '*', url: `${rx.url}/n8n`, events: ['job.dead'] });
    if (sub.outcome !== 'ok') throw new Error('sub');
    rx.secret('/n8n', sub.value.secret);
    const k = await keyCreate(t.pool, { name: 'doomed-worker', scopes: ['agent'] });
    if (k.outcome !== 'ok') throw new Error('key');
    await rpc(lh.httpUrl, 'leasehold.v1.JobService/EnqueueJob', { queue: 'doomed', payload: {}, maxAttempts: 1 }, ADMIN_KEY);
    const c = (await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/ClaimJobs', { queues: ['doomed'] }, k.value.key)).json.jobs[0];
    await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/FailAttempt', { attemptId: c.attemptId, error: { message: 'no disk' }, retryable: true }, k.value.key);
    await rx.waitFor('the job.dead delivery', (r) => r.received.length >= 1);
    const got = rx.received[0]!;

    for (const f of ['b-receive-notifications.json', 'c-dead-letter-alert.json']) {
      const w = load(f);
      const hook = w.nodes.find((x) => x.type === 'n8n-nodes-base.webhook')!.name;
      const crypto = w.nodes.find((x) => x.type === 'n8n-nodes-base.crypto')!;
      const check = next(w, crypto.name)[0]!;
      const verify = (headers: Record<string, unknown>, body: string) => {
        const n = new MiniN8n(w);
        n.set(hook, [{ json: { headers, body: JSON.parse(body) } }]);
        n.set('Raw body', [{ json: { rawBody: body } }]);
        const value = String(n.expr(crypto.parameters.value, { json: { rawBody: body } }));
        const signed = { json: { rawBody: body, expectedSignature: createHmac('sha256', sub.value.secret).update(value).digest('hex') } };
        return { n, ok: n.ifNode(check, signed) };
      };
      const good = verify(got.headers, got.body);
      expect(good.ok, f).toBe(true);
      const dedupe = next(w, check, 0)[0]!;
      const [first] = good.n.code(dedupe, { json: {} });
      expect(first!.json).toMatchObject({ duplicate: false, type: 'job.dead', eventId: got.eventId, job: { status: 'JOB_STATUS_DEAD' } });
      expect(good.n.code(dedupe, { json: {} })[0]!.json.duplicate).toBe(true);
      if (f === 'c-dead-letter-alert.json') {
        // One alert per dead job: the poll path does not alert again for the job the push path saw.
        const listed = { json: { statusCode: 200, body: { jobs: [first!.json.job, { id: 'other-dead-job' }] } } };
        expect(good.n.code('Dead jobs not alerted yet', listed).map((i) => i.json.job.id)).toEqual(['other-dead-job']);
      }
      expect(verify(got.headers, got.body.replace('no disk', 'no DISK')).ok, f).toBe(false);
      const old = String(Number(got.headers['leasehold-timestamp']) - 3600);
      const resigned = `sha256=${createHmac('sha256', sub.value.secret).update(`${old}.${got.body}`).digest('hex')}`;
      expect(verify({ ...got.headers, 'leasehold-timestamp': old, 'leasehold-signature': resigned }, got.body).ok, f).toBe(false);
    }
  });

  it('e: the job carries the resume URL and header; its notification takes the succeeded branch with the result, a failure or the wait limit the other', async () => {
    const w = load('e-wait-for-job.json');
    const token = 'resume-token-of-the-test';
    const resumeUrl = `${rx.url}/webhook-waiting/42`;
    rx.secret('/webhook-waiting/42', await signingSecretGet(t.pool));
    const n = new MiniN8n(JSON.parse(JSON.stringify(w).replaceAll('REPLACE_WITH_RESUME_TOKEN', token)) as Workflow, { id: '42', resumeUrl });
    const [job] = n.setNode('Build the job', { json: {} });
    expect(job!.json).toMatchObject({ queue: 'reports', payload: { reportId: 'R-3001' }, idempotencyKey: 'report-R-3001-42' });
    const enqueued = await n.http('Enqueue job', job!, ADMIN_KEY, lh.httpUrl);
    expect(n.ifNode('Enqueued?', enqueued)).toBe(true);
    expect(enqueued.json.body.job).toMatchObject({ notifyUrl: resumeUrl, status: 'JOB_STATUS_QUEUED' });
    // The wait limit passed: the Wait node passes the enqueue answer on.
    expect(n.ifNode('Succeeded?', enqueued)).toBe(false);
    const stop = node(w, 'The job did not succeed').parameters.errorMessage;
    expect(n.expr(stop, enqueued)).toBe(`job ${enqueued.json.body.job.id}: no notification within the wait limit`);

    const k = await keyCreate(t.pool, { name: 'e-worker', scopes: ['agent'] });
    if (k.outcome !== 'ok') throw new Error('key');
    const c = (await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/ClaimJobs', { queues: ['reports'] }, k.value.key)).json.jobs[0];
    expect(c.job.id).toBe(enqueued.json.body.job.id);
    await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/StartAttempt', { attemptId: c.attemptId }, k.value.key);
    await rpc(lh.httpUrl, 'leasehold.v1.AttemptService/CompleteAttempt', { attemptId: c.attemptId, result: { pages: 3 } }, k.value.key);
    await rx.waitFor('the delivery to the resume URL', (r) => r.received.some((x) => x.path === '/webhook-waiting/42'));
    const got = rx.received.find((x) => x.path === '/webhook-waiting/42')!;
    expect(got.headers['x-resume-token']).toBe(token);
    // What the Wait node resumes with: the request's headers, params, query and parsed body.
    const resumed = { json: { headers: got.headers, params: {}, query: {}, body: JSON.parse(got.body) } };
    expect(n.ifNode('Succeeded?', resumed)).toBe(true);
    expect(n.setNode('Job succeeded', resumed)[0]!.json).toEqual({ jobId: c.job.id, result: { pages: 3 } });
    const dead = { json: { ...resumed.json, body: { ...resumed.json.body, type: 'job.dead', error: { message: 'no disk' } } } };
    expect(n.ifNode('Succeeded?', dead)).toBe(false);
    expect(n.expr(stop, dead)).toBe(`job ${c.job.id} ended with job.dead: no disk`);
  });
});
