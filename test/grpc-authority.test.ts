/**
 * The gRPC listener and a request whose `:authority` is no URL's host (`x:99999`, `[`): Connect's
 * Node adapter builds the request's URL from it synchronously, inside Node's 'request' event,
 * and the exception ended the coordinator's process (with every agent stream), unauthenticated.
 * Now the request is answered INVALID_ARGUMENT, logged, and the listener goes on serving.
 */
import http2 from 'node:http2';
import { describe, expect, it } from 'vitest';
import { useCoordinator } from './helpers/coordinator.js';
import { useTestDb } from './helpers/db.js';

const t = useTestDb();
const lh = useCoordinator(t);

/** One gRPC request with the `:authority` given, read to its end: its status, from the headers of a trailers-only answer or from the trailers. */
function request(authority: string): Promise<{ status: number; grpcStatus: string | undefined }> {
  return new Promise((resolve, reject) => {
    const session = http2.connect(lh.url);
    session.on('error', reject);
    const stream = session.request({
      ':method': 'POST',
      ':path': '/grpc.health.v1.Health/Check',
      ':authority': authority,
      'content-type': 'application/grpc',
      te: 'trailers',
    });
    let status = 0;
    let grpcStatus: string | undefined;
    stream.on('response', (h) => {
      status = Number(h[':status']);
      grpcStatus = h['grpc-status'] as string | undefined;
    });
    stream.on('trailers', (h) => (grpcStatus = h['grpc-status'] as string | undefined));
    stream.on('error', reject);
    stream.on('close', () => {
      session.close();
      resolve({ status, grpcStatus });
    });
    stream.resume();
    // An empty HealthCheckRequest: one uncompressed frame of zero bytes.
    stream.end(Buffer.from([0, 0, 0, 0, 0]));
  });
}

describe('the gRPC listener', () => {
  it.each(['x:99999', '[', 'a%zz'])('answers INVALID_ARGUMENT to :authority %j and keeps serving', async (authority) => {
    expect(await request(authority)).toEqual({ status: 200, grpcStatus: '3' });
    expect(await request(new URL(lh.url).host)).toEqual({ status: 200, grpcStatus: '0' });
  });
});
