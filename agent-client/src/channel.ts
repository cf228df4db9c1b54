/**
 * The gRPC channel to the coordinator: the agent stream and the two step-ledger calls, on one
 * HTTP/2 connection written by hand (lane.ts); through @grpc/grpc-js when an HTTP proxy is
 * configured (grpc-js goes through it with CONNECT).
 */
import { readFileSync } from 'node:fs';
import { fromBinary, toBinary, type DescMessage, type MessageInitShape, type MessageShape, create } from '@bufbuild/protobuf';
import * as grpc from '@grpc/grpc-js';
import { decodeServerMessage, encodeAgentMessage } from './codec.js';
import { AGENT_CONNECT_PATH, KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS, LaneConnection, MAX_RECEIVE_BYTES, UNARY_DEADLINE_MS, proxyConfigured, serviceError } from './lane.js';
import type { AgentStream } from './session.js';
import {
  RecordStepRequestSchema,
  RecordStepResponseSchema,
  ReserveStepRequestSchema,
  ReserveStepResponseSchema,
} from './gen/leasehold/v1/attempt_service_pb.js';

/**
 * TLS for the channel: `true`, or PEM file paths (mTLS with cert and key). Without `ca` the
 * server is checked against Node's CA store: on Node 20 the Mozilla roots bundled with Node plus
 * the file `NODE_EXTRA_CA_CERTS` names, not the Windows or macOS certificate store. `ca` replaces
 * that store (then only it is trusted): to trust a corporate CA besides the public ones, set
 * `NODE_EXTRA_CA_CERTS`.
 */
export type TlsOption = boolean | { ca?: string; cert?: string; key?: string };
/** The PEM files of a `TlsOption`, read. */
export interface TlsFiles {
  ca: Buffer | undefined;
  cert: Buffer | undefined;
  key: Buffer | undefined;
}

/** `http://host:port`, `https://host:port` or `host:port` → the grpc-js target and whether TLS is on. */
export function parseUrl(url: string, tls: TlsOption | undefined): { target: string; secure: boolean } {
  const m = /^(?:(https?):\/\/)?([^/]+?)\/?$/.exec(url.trim());
  if (!m) throw new Error(`url must be http://host:port, https://host:port or host:port, got ${JSON.stringify(url)}`);
  const secure = tls === undefined ? m[1] === 'https' : tls !== false;
  return { target: m[2]!, secure };
}

/** The PEM files `tls` names, read (none for `true` or no object: Node's CA store, as `TlsOption` says). */
export function tlsFiles(tls: TlsOption | undefined): TlsFiles {
  const t = typeof tls === 'object' ? tls : {};
  const read = (f?: string) => (f ? readFileSync(f) : undefined);
  return { ca: read(t.ca), cert: read(t.cert), key: read(t.key) };
}

function credentials(secure: boolean, tls: TlsOption | undefined): grpc.ChannelCredentials {
  if (!secure) return grpc.credentials.createInsecure();
  const files = tlsFiles(tls);
  return grpc.credentials.createSsl(files.ca ?? null, files.key ?? null, files.cert ?? null);
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
  /** The HTTP/2 connection of the agent stream and the ledger calls (lane.ts), or grpc-js's client behind a proxy. */
  private readonly lane: LaneConnection | undefined;
  private readonly client: grpc.Client | undefined;

  constructor(
    url: string,
    private readonly token: string,
    tls?: TlsOption,
  ) {
    const { target, secure } = parseUrl(url, tls);
    if (!proxyConfigured()) {
      this.lane = new LaneConnection(target, secure, secure ? tlsFiles(tls) : undefined);
      return;
    }
    this.client = new grpc.Client(target, credentials(secure, tls), {
      // Notice a dead peer within seconds even when no message is due (as the lane does).
      'grpc.keepalive_time_ms': KEEPALIVE_MS,
      'grpc.keepalive_timeout_ms': KEEPALIVE_TIMEOUT_MS,
      'grpc.keepalive_permit_without_calls': 1,
      'grpc.max_receive_message_length': MAX_RECEIVE_BYTES,
      // Our own reconnect loop decides when to retry.
      'grpc.enable_retries': 0,
    });
  }

  /** Opens `AgentService.Connect`; its hot messages are encoded and decoded by hand (codec.ts). */
  connect(): AgentStream {
    if (this.lane) return this.lane.connect();
    return this.client!.makeBidiStreamRequest(AGENT_CONNECT_PATH, encodeAgentMessage, decodeServerMessage);
  }

  reserveStep(req: MessageInitShape<typeof ReserveStepRequestSchema>, signal?: AbortSignal) {
    return this.unary('/leasehold.v1.AttemptService/ReserveStep', ReserveStepRequestSchema, ReserveStepResponseSchema, req, signal);
  }

  recordStep(req: MessageInitShape<typeof RecordStepRequestSchema>, signal?: AbortSignal) {
    return this.unary('/leasehold.v1.AttemptService/RecordStep', RecordStepRequestSchema, RecordStepResponseSchema, req, signal);
  }

  close(): void {
    this.lane?.close();
    this.client?.close();
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
      // As the lane does: an aborted signal sends nothing, and the listener goes with the call
      // (a step retried every second while the coordinator is away would otherwise add one each time).
      if (signal?.aborted) return reject(serviceError(grpc.status.CANCELLED, 'Cancelled on client'));
      const onAbort = () => call.cancel();
      const call = this.client!.makeUnaryRequest(
        path,
        ser(inSchema),
        de(outSchema),
        create(inSchema, init),
        md,
        { deadline: Date.now() + UNARY_DEADLINE_MS },
        (err, res) => {
          signal?.removeEventListener('abort', onAbort);
          if (err) reject(err);
          else resolve(res!);
        },
      );
      signal?.addEventListener('abort', onAbort, { once: true });
    });
  }
}

export { grpc };
