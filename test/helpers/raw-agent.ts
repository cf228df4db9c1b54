/**
 * A minimal agent written the way an outsider would: plain @grpc/grpc-js with the .proto files
 * loaded by @grpc/proto-loader (not our generated code), speaking AgentService.Connect.
 */
import path from 'node:path';
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';

const root = path.resolve(import.meta.dirname, '../../proto');
const definition = protoLoader.loadSync(['leasehold/v1/agent_service.proto', 'leasehold/v1/attempt_service.proto', 'leasehold/v1/job_service.proto'], {
  includeDirs: [root],
  keepCase: false,
  longs: String,
  enums: String,
  defaults: false,
  oneofs: true,
});
const pkg = grpc.loadPackageDefinition(definition) as unknown as {
  leasehold: { v1: Record<string, grpc.ServiceClientConstructor> };
};

type Struct = { fields?: Record<string, PbValue> };
type PbValue = {
  nullValue?: unknown;
  numberValue?: number;
  stringValue?: string;
  boolValue?: boolean;
  structValue?: Struct;
  listValue?: { values?: PbValue[] };
  kind?: string;
};

/** JSON → google.protobuf.Struct as protobufjs represents it. */
export function toStruct(o: Record<string, unknown>): Struct {
  return { fields: Object.fromEntries(Object.entries(o).map(([k, v]) => [k, toPbValue(v)])) };
}
function toPbValue(v: unknown): PbValue {
  if (v === null || v === undefined) return { nullValue: 'NULL_VALUE' };
  if (typeof v === 'number') return { numberValue: v };
  if (typeof v === 'string') return { stringValue: v };
  if (typeof v === 'boolean') return { boolValue: v };
  if (Array.isArray(v)) return { listValue: { values: v.map(toPbValue) } };
  return { structValue: toStruct(v as Record<string, unknown>) };
}
/** google.protobuf.Struct as protobufjs represents it → JSON. */
export function fromStruct(s: Struct | undefined | null): Record<string, unknown> | undefined {
  if (!s) return undefined;
  return Object.fromEntries(Object.entries(s.fields ?? {}).map(([k, v]) => [k, fromPbValue(v)]));
}
function fromPbValue(v: PbValue): unknown {
  switch (v.kind) {
    case 'numberValue':
      return v.numberValue;
    case 'stringValue':
      return v.stringValue;
    case 'boolValue':
      return v.boolValue;
    case 'structValue':
      return fromStruct(v.structValue);
    case 'listValue':
      return (v.listValue?.values ?? []).map(fromPbValue);
    default:
      return null;
  }
}

export interface HelloInit {
  agentId: string;
  token: string;
  queues: string[];
  slots: number;
  labels?: Record<string, string>;
  resume?: string[];
}

/** A message from the server: `kind` names the oneof case; the case's value is under that key. */
export type ServerMsg = { kind: string } & Record<string, any>;

/** One stream to the coordinator, with every message it received kept in order. */
export class RawAgent {
  readonly received: ServerMsg[] = [];
  private readonly consumed = new Set<number>();
  private waiters: Array<() => void> = [];
  readonly ended: Promise<{ code: number; details: string }>;
  private endedWith: { code: number; details: string } | undefined;

  private constructor(
    readonly client: grpc.Client,
    readonly call: grpc.ClientDuplexStream<unknown, ServerMsg>,
  ) {
    call.on('data', (m: ServerMsg) => {
      this.received.push(m);
      this.wake();
    });
    this.ended = new Promise((resolve) => {
      const done = (e: { code: number; details: string }) => {
        if (this.endedWith) return;
        this.endedWith = e;
        this.wake();
        resolve(e);
      };
      call.on('error', (err: grpc.ServiceError) => done({ code: err.code, details: err.details }));
      call.on('end', () => done({ code: grpc.status.OK, details: '' }));
    });
  }

  /** Opens a stream to `host:port` on a connection of its own; sends `hello` unless it is null. */
  static open(address: string, hello: HelloInit | null): RawAgent {
    const Ctor = pkg.leasehold.v1.AgentService!;
    const client = new Ctor(address, grpc.credentials.createInsecure(), { 'grpc.use_local_subchannel_pool': 1 });
    const call = (client as unknown as { connect(): grpc.ClientDuplexStream<unknown, ServerMsg> }).connect();
    const a = new RawAgent(client, call);
    if (hello) a.send({ hello: { resume: [], labels: {}, ...hello } });
    return a;
  }

  send(msg: Record<string, unknown>): void {
    this.call.write(msg);
  }

  /** The next message of `kind` not taken yet (waiting for it up to `ms`). */
  async next(kind: string, ms = 10_000): Promise<ServerMsg> {
    const deadline = Date.now() + ms;
    for (;;) {
      const i = this.received.findIndex((m, idx) => m.kind === kind && !this.consumed.has(idx));
      if (i >= 0) {
        this.consumed.add(i);
        return this.received[i]!;
      }
      if (this.endedWith) throw new Error(`stream ended (${this.endedWith.code} ${this.endedWith.details}) before a ${kind} message`);
      const left = deadline - Date.now();
      if (left <= 0) throw new Error(`no ${kind} message within ${ms} ms; got ${this.received.map((m) => m.kind).join(', ')}`);
      await new Promise<void>((resolve) => {
        const t = setTimeout(resolve, left);
        this.waiters.push(() => {
          clearTimeout(t);
          resolve();
        });
      });
    }
  }

  /** Messages of `kind` received so far. */
  all(kind: string): ServerMsg[] {
    return this.received.filter((m) => m.kind === kind);
  }

  /** Half-closes the stream (no more messages from the agent). */
  end(): void {
    this.call.end();
  }

  /** Cancels the call and closes the connection. */
  close(): void {
    this.call.cancel();
    this.client.close();
  }

  private wake() {
    const w = this.waiters;
    this.waiters = [];
    for (const f of w) f();
  }
}

/** A client of another service (JobService, AttemptService) over plain grpc-js. */
export function rawClient(
  service: 'JobService' | 'AttemptService',
  address: string,
  creds: grpc.ChannelCredentials = grpc.credentials.createInsecure(),
): grpc.Client & Record<string, any> {
  const Ctor = pkg.leasehold.v1[service]!;
  return new Ctor(address, creds) as grpc.Client & Record<string, any>;
}

/** Calls a unary method with a bearer token; resolves with the response or rejects with the ServiceError. */
export function unary<T = any>(client: grpc.Client & Record<string, any>, method: string, req: unknown, token: string): Promise<T> {
  const md = new grpc.Metadata();
  md.set('authorization', `Bearer ${token}`);
  return new Promise((resolve, reject) => {
    client[method](req, md, (err: grpc.ServiceError | null, res: T) => (err ? reject(err) : resolve(res)));
  });
}

/** The services as grpc-js loaded them from the .proto files (for a fake coordinator in a test). */
export const services = pkg.leasehold.v1;

export { grpc };
