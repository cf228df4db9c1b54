/**
 * `POST /leasehold.v1.JobService/EnqueueJob` with a JSON body, as n8n sends it, without Connect's
 * per-call machinery: the same interceptors (the failure capture, the auth check), the same
 * implementation (`enqueueJobCall`), the same JSON serialization and options, the same error
 * bytes and HTTP status; but no handler context, whose abort signal Connect aborts after every
 * call (a `DOMException`, with its stack, per request), no protocol negotiation, URL parse or
 * async-iterable body; and the answer is written from the row (job-json.ts), not through
 * protobuf messages. Measured in one process (test/bench/gateway-enqueue.ts): 0.71 × the CPU
 * per enqueue of Connect's path (docs/performance.md, "The speed work, measured").
 *
 * Only requests Connect would take down its plain path come here: JSON as Connect spells it, no
 * `content-encoding`, no `connect-timeout-ms`. Anything else goes to Connect's handler, which
 * answers it as it always has. test/gateway-enqueue.test.ts sends the same requests both ways and
 * compares the answers byte for byte.
 */
import { create, type JsonReadOptions, type JsonWriteOptions } from '@bufbuild/protobuf';
import { Code, ConnectError, type ContextValues, type Interceptor, type UnaryRequest, type UnaryResponse } from '@connectrpc/connect';
import { createMethodSerializationLookup, validateUniversalHandlerOptions } from '@connectrpc/connect/protocol';
import { codeToHttpStatus, errorToJsonBytes } from '@connectrpc/connect/protocol-connect';
import { EnqueueJobResponseSchema, JobService, type EnqueueJobRequest, type EnqueueJobResponse } from '../../gen/leasehold/v1/job_service_pb.js';
import { toPbJob } from './codec.js';
import { enqueueAnswerJson } from './job-json.js';
import { readEnqueueRequest } from './enqueue-request.js';
import type { EnqueueResult } from './job-routes.js';

export const ENQUEUE_PATH = '/leasehold.v1.JobService/EnqueueJob';

/** What Connect's unary handler reads as JSON (its `contentTypeUnaryRegExp`, JSON arm). */
const JSON_UNARY = /^application\/json(?:; ?charset=utf-?8)?$/i;

/** An answer as the listener writes it. */
export interface DirectAnswer {
  status: number;
  header: Headers;
  body: Uint8Array;
}

/** The direct path's entry (see `directEnqueue`). */
export type DirectEnqueue = (url: string, header: Headers, body: Uint8Array, contextValues: ContextValues) => Promise<DirectAnswer>;

/** Whether a request to `ENQUEUE_PATH` takes the direct path (else Connect's handler). */
export function takesDirectPath(method: string | undefined, header: Headers): boolean {
  return (
    method === 'POST' &&
    JSON_UNARY.test(header.get('content-type') ?? '') &&
    !header.has('content-encoding') &&
    !header.has('connect-timeout-ms')
  );
}

type AnyFn = Parameters<Interceptor>[0];

const encoder = new TextEncoder();

/** No call on this path is canceled: the enqueue runs to its end once begun, as under Connect. */
const NEVER = new AbortController().signal;

/**
 * The direct path, given what the router is given (`interceptors`, `jsonOptions`,
 * `readMaxBytes`) and JobService's `enqueueJob` implementation.
 */
export function directEnqueue(opts: {
  interceptors: Interceptor[];
  jsonOptions: Partial<JsonReadOptions & JsonWriteOptions>;
  readMaxBytes: number;
  impl: (req: EnqueueJobRequest) => Promise<EnqueueResult>;
}): DirectEnqueue {
  const method = JobService.method.enqueueJob;
  // The serializers Connect's handler makes for the method, from the same options.
  const handlerOptions = validateUniversalHandlerOptions({ jsonOptions: opts.jsonOptions, readMaxBytes: opts.readMaxBytes, acceptCompression: [] });
  const serialization = createMethodSerializationLookup(method, handlerOptions.binaryOptions, handlerOptions.jsonOptions, handlerOptions);
  const input = serialization.getI(false);
  const output = serialization.getO(false);
  const empty = create(EnqueueJobResponseSchema);
  return async (url, requestHeader, body, contextValues) => {
    // The interceptors wrap the implementation in the order given, the first outermost (as
    // Connect's applyInterceptors does). The answer passes them as an empty message, the job
    // beside it: it is written below straight from the row.
    let result: EnqueueResult | undefined;
    let call: AnyFn = async (req): Promise<UnaryResponse> => {
      result = await opts.impl((req as UnaryRequest).message as EnqueueJobRequest);
      return { stream: false, service: JobService, method, message: empty, header: new Headers(), trailer: new Headers() };
    };
    for (const i of opts.interceptors.toReversed()) call = i(call);
    const header = new Headers({ 'content-type': 'application/json' });
    let status = 200;
    let bytes: Uint8Array;
    try {
      // The usual body read by hand (enqueue-request.ts); anything else as Connect reads it.
      const message = readEnqueueRequest(body) ?? input.parse(body);
      const res = (await call({ stream: false, service: JobService, method, requestMethod: 'POST', url, signal: NEVER, header: requestHeader, contextValues, message })) as UnaryResponse;
      res.header.forEach((v, k) => header.set(k, v));
      res.trailer.forEach((v, k) => header.append(`trailer-${k}`, v));
      // protobuf-es writes what the row cannot be written as by hand, and the answer of an
      // interceptor that answered without calling the implementation.
      const text = result && enqueueAnswerJson(result.job, result.outcome);
      if (text !== undefined) bytes = encoder.encode(text);
      else bytes = output.serialize(result ? create(EnqueueJobResponseSchema, { job: toPbJob(result.job), outcome: result.outcome }) : (res.message as EnqueueJobResponse));
    } catch (e) {
      const error = e instanceof ConnectError ? e : new ConnectError('internal error', Code.Internal, undefined, undefined, e);
      status = codeToHttpStatus(error.code);
      header.set('content-type', 'application/json');
      error.metadata.forEach((v, k) => header.set(k, v));
      bytes = errorToJsonBytes(error, opts.jsonOptions);
    }
    header.set('content-length', String(bytes.byteLength));
    return { status, header, body: bytes };
  };
}
