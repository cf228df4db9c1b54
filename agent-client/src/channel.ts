/**
 * The gRPC channel to the coordinator: the agent stream and the two step-ledger calls, on one
 * HTTP/2 connection written by hand (lane.ts); through @grpc/grpc-js when an HTTP proxy is
 * configured (grpc-js goes through it with CONNECT).
 */
import { readFileSync } from 'node:fs';
import { fromBinary, toBinary, type DescMessage, type MessageInitShape, type MessageShape, create } from '@bufbuild/protobuf';
import * as grpc from '@grpc/grpc-js';
import { decodeServerMessage, encodeAgentMessage } from './codec.js';
import { LaneConnection, proxyConfigured } from './lane.js';
import type { AgentStream } from './session.js';
import {
  RecordStepRequestSchema,
  RecordStepResponseSchema,
  ReserveStepRequestSchema,
  ReserveStepResponseSchema,
} from './gen/leasehold/v1/attempt_service_pb.js';

/** TLS for the channel: `true` for the system roots, or PEM file paths (mTLS with cert and key). */
export type TlsOption = boolean | { ca?: string; cert?: string; key?: string };

/** `http://host:port`, `https://host:port` or `host:port` → the grpc-js target and whether TLS is on. */
export function parseUrl(url: string, tls: TlsOption | undefined): { target: string; secure: boolean } {
  const m = /^(?:(https?):\/\/)?([^/]+?)\/?$/.exec(url.trim());
  if (!m) throw new Error(`url must be http://host:port, https://host:port or host:port, got ${JSON.stringify(url)}`);
  const secure = tls === undefined ? m[1] === 'https' : tls !== false;
  return { target: m[2]!, secure };
}

function credentials(secure: boolean, tls: TlsOption | undefined): grpc.ChannelCredentials {
  if (!secure) return grpc.credentials.createInsecure();
  const t = typeof tls === 'object' ? tls : {};
  const read = (f?: string) => (f ? readFileSync(f) : null);
  return grpc.credentials.createSsl(read(t.ca), read(t.key), read(t.cert));
}

const ser =
  <D extends DescMessage>(schema: D) =>
  (m: MessageShape<D>) =>
    Buffer.from(toBinary(schema, m));
const de =
  <D extends DescMessage>(schema: D) =>
  (b: Buffer) =>
    fromBinary(schema, b);

/** A connection to the coordinator; `close()` ends it. */
export class CoordinatorChannel {
  private readonly client: grpc.Client;
  /** The HTTP/2 connection of the agent stream and the ledger calls (lane.ts); none when a proxy is configured. */
  private readonly lane: LaneConnection | undefined;

  constructor(
    url: string,
    private readonly token: string,
    tls?: TlsOption,
  ) {
    const { target, secure } = parseUrl(url, tls);
    this.client = new grpc.Client(target, credentials(secure, tls), {
      // Notice a dead peer within seconds even when no message is due.
      'grpc.keepalive_time_ms': 10_000,
      'grpc.keepalive_timeout_ms': 5_000,
      'grpc.keepalive_permit_without_calls': 1,
      'grpc.max_receive_message_length': 16 * 1024 * 1024,
      // Our own reconnect loop decides when to retry.
      'grpc.enable_retries': 0,
    });
    this.lane = proxyConfigured() ? undefined : new LaneConnection(target, secure, tls);
  }

  /** Opens `AgentService.Connect`; its hot messages are encoded and decoded by hand (codec.ts). */
  connect(): AgentStream {
    if (this.lane) return this.lane.connect();
    return this.client.makeBidiStreamRequest('/leasehold.v1.AgentService/Connect', encodeAgentMessage, decodeServerMessage);
  }

  reserveStep(req: MessageInitShape<typeof ReserveStepRequestSchema>, signal?: AbortSignal) {
    return this.unary('/leasehold.v1.AttemptService/ReserveStep', ReserveStepRequestSchema, ReserveStepResponseSchema, req, signal);
  }

  recordStep(req: MessageInitShape<typeof RecordStepRequestSchema>, signal?: AbortSignal) {
    return this.unary('/leasehold.v1.AttemptService/RecordStep', RecordStepRequestSchema, RecordStepResponseSchema, req, signal);
  }

  close(): void {
    this.lane?.close();
    this.client.close();
  }

  private unary<I extends DescMessage, O extends DescMessage>(
    path: string,
    inSchema: I,
    outSchema: O,
    init: MessageInitShape<I>,
    signal?: AbortSignal,
  ): Promise<MessageShape<O>> {
    if (this.lane) return this.lane.unary(path, this.token, toBinary(inSchema, create(inSchema, init)), de(outSchema), signal);
    const md = new grpc.Metadata();
    md.set('authorization', `Bearer ${this.token}`);
    return new Promise((resolve, reject) => {
      const call = this.client.makeUnaryRequest(
        path,
        ser(inSchema),
        de(outSchema),
        create(inSchema, init),
        md,
        { deadline: Date.now() + 30_000 },
        (err, res) => (err ? reject(err) : resolve(res!)),
      );
      signal?.addEventListener('abort', () => call.cancel(), { once: true });
    });
  }
}

export { grpc };
