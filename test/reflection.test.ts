/**
 * gRPC server reflection and health, checked the way operators use them: an independent
 * reflection client (`buf curl`, from the @bufbuild/buf package; grpcurl too when it is on
 * PATH) against a connect-node h2c server on a free port, plus an in-process client for what
 * those tools do not show (the exact descriptors, error responses, Watch). No database needed.
 */
import { execFile } from 'node:child_process';
import { existsSync } from 'node:fs';
import http2 from 'node:http2';
import type { AddressInfo } from 'node:net';
import path from 'node:path';
import { create, fromBinary } from '@bufbuild/protobuf';
import { FileDescriptorProtoSchema, type FileDescriptorProto } from '@bufbuild/protobuf/wkt';
import { Code, ConnectError, createClient } from '@connectrpc/connect';
import { connectNodeAdapter, createGrpcTransport, Http2SessionManager } from '@connectrpc/connect-node';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Health, HealthCheckResponse_ServingStatus as Wire } from '../gen/grpc/health/v1/health_pb.js';
import { ExtensionRequestSchema, ServerReflection, type ServerReflectionRequest } from '../gen/grpc/reflection/v1/reflection_pb.js';
import { AgentService } from '../gen/leasehold/v1/agent_service_pb.js';
import { AttemptService } from '../gen/leasehold/v1/attempt_service_pb.js';
import { JobService } from '../gen/leasehold/v1/job_service_pb.js';
import { createHealth, healthRoutes } from '../server/transport/health.js';
import { readDescriptorSet, reflectionRoutes } from '../server/transport/reflection.js';

const root = path.resolve(import.meta.dirname, '..');
const buf = path.join(root, 'node_modules', '.bin', process.platform === 'win32' ? 'buf.cmd' : 'buf');
const grpcurl = findOnPath('grpcurl');

function findOnPath(name: string): string | undefined {
  for (const dir of (process.env.PATH ?? '').split(path.delimiter)) {
    const p = path.join(dir, name);
    if (dir && existsSync(p)) return p;
  }
  return undefined;
}

interface Run {
  code: number;
  stdout: string;
  stderr: string;
}

/** Runs `file` with `args` (no shell), bounded in time; resolves with its exit code and output. */
function run(file: string, args: string[], timeoutMs = 30_000): Promise<Run> {
  return new Promise((resolve, reject) => {
    execFile(file, args, { cwd: root, timeout: timeoutMs, killSignal: 'SIGKILL' }, (err, stdout, stderr) => {
      if (err && typeof err.code !== 'number') {
        reject(new Error(`${path.basename(file)} ${args.join(' ')} did not finish: ${err.message}\n${stderr}`, { cause: err }));
        return;
      }
      resolve({ code: err ? Number(err.code) : 0, stdout, stderr });
    });
  });
}

const leaseholdServices = [AgentService.typeName, JobService.typeName, AttemptService.typeName];

describe('gRPC reflection and health on an h2c server', () => {
  const health = createHealth({ services: leaseholdServices });
  const serverSessions = new Set<http2.ServerHttp2Session>();
  let clientSessions: Http2SessionManager | undefined;
  let server: http2.Http2Server;
  let baseUrl = '';
  let client: ReturnType<typeof createClient<typeof ServerReflection>>;
  let healthClient: ReturnType<typeof createClient<typeof Health>>;

  beforeAll(async () => {
    const handler = connectNodeAdapter({
      routes: (router) => {
        reflectionRoutes({ sourceInfo: readDescriptorSet() })(router);
        healthRoutes({ health })(router);
        // Stubs: every method answers UNIMPLEMENTED, which is enough to be listed and described.
        router.service(AgentService, {});
        router.service(JobService, {});
        router.service(AttemptService, {});
      },
    });
    server = http2.createServer(handler);
    server.on('session', (s) => {
      serverSessions.add(s);
      s.once('close', () => serverSessions.delete(s));
    });
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen(0, '127.0.0.1', () => resolve());
    });
    baseUrl = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
    // One HTTP/2 session for both clients, closed in afterAll.
    clientSessions = new Http2SessionManager(baseUrl);
    const transport = createGrpcTransport({ baseUrl, sessionManager: clientSessions });
    client = createClient(ServerReflection, transport);
    healthClient = createClient(Health, transport);
  });

  afterAll(async () => {
    health.shutdown();
    clientSessions?.abort();
    // Sessions still open are closed gracefully, and awaited, before the listener.
    await Promise.all(
      [...serverSessions].map((s) => new Promise<void>((resolve) => (s.once('close', () => resolve()), s.close()))),
    );
    if (server?.listening) await new Promise<void>((resolve, reject) => server.close((err) => (err ? reject(err) : resolve())));
    expect(serverSessions.size).toBe(0);
  });

  describe('buf curl, an independent reflection client', () => {
    it('lists the services, over grpc.reflection.v1 and v1alpha', async () => {
      for (const protocol of ['grpc-v1', 'grpc-v1alpha']) {
        const r = await run(buf, ['curl', '--protocol', 'grpc', '--http2-prior-knowledge', '--reflect-protocol', protocol, '--list-services', baseUrl]);
        expect(r, r.stderr).toMatchObject({ code: 0 });
        const services = r.stdout.trim().split('\n');
        expect(services).toEqual(
          expect.arrayContaining([
            'leasehold.v1.AgentService',
            'leasehold.v1.JobService',
            'leasehold.v1.AttemptService',
            'grpc.health.v1.Health',
            'grpc.reflection.v1.ServerReflection',
            'grpc.reflection.v1alpha.ServerReflection',
          ]),
        );
      }
    });

    it('lists the methods (which needs every file and its dependencies)', async () => {
      const r = await run(buf, ['curl', '--protocol', 'grpc', '--http2-prior-knowledge', '--list-methods', baseUrl]);
      expect(r, r.stderr).toMatchObject({ code: 0 });
      const methods = r.stdout.trim().split('\n');
      expect(methods).toEqual(
        expect.arrayContaining([
          'leasehold.v1.AgentService/Connect',
          'leasehold.v1.JobService/EnqueueJob',
          'leasehold.v1.JobService/GetJob',
          'leasehold.v1.JobService/ListJobs',
          'leasehold.v1.JobService/CancelJob',
          'leasehold.v1.AttemptService/ClaimJobs',
          'leasehold.v1.AttemptService/ReserveStep',
          'leasehold.v1.AttemptService/RecordStep',
          'grpc.health.v1.Health/Check',
          'grpc.health.v1.Health/Watch',
        ]),
      );
    });

    it('calls Health/Check and gets SERVING', async () => {
      for (const service of ['', 'leasehold.v1.AgentService']) {
        const r = await run(buf, [
          'curl', '--protocol', 'grpc', '--http2-prior-knowledge',
          '-d', JSON.stringify({ service }),
          `${baseUrl}/grpc.health.v1.Health/Check`,
        ]);
        expect(r, r.stderr).toMatchObject({ code: 0 });
        expect(JSON.parse(r.stdout)).toEqual({ status: 'SERVING' });
      }
    });

    it('encodes a request from the reflected schema (Struct, Timestamp, Duration) and reaches the stub', async () => {
      const r = await run(buf, [
        'curl', '--protocol', 'grpc', '--http2-prior-knowledge',
        '-d', JSON.stringify({ queue: 'q', payload: { a: [1, 'b'] }, runAt: '2030-01-01T00:00:00Z', executionTimeout: '90s' }),
        `${baseUrl}/leasehold.v1.JobService/EnqueueJob`,
      ]);
      // buf curl exits with the gRPC code shifted three bits left: the stub is UNIMPLEMENTED.
      expect(r.code, r.stderr).toBe(Code.Unimplemented << 3);
      expect(r.stderr).toMatch(/unimplemented/i);
    });
  });

  describe('grpcurl, when it is installed', () => {
    if (!grpcurl) console.log('grpcurl is not on PATH: skipping the grpcurl checks (buf curl covers reflection)');

    it.skipIf(!grpcurl)('lists and describes with comments', async () => {
      const addr = baseUrl.replace('http://', '');
      const list = await run(grpcurl!, ['-plaintext', addr, 'list']);
      expect(list, list.stderr).toMatchObject({ code: 0 });
      expect(list.stdout).toContain('leasehold.v1.AgentService');
      const describe = await run(grpcurl!, ['-plaintext', addr, 'describe', 'leasehold.v1.AgentMessage.Hello']);
      expect(describe, describe.stderr).toMatchObject({ code: 0 });
      expect(describe.stdout).toContain('Opens the session');
    });
  });

  describe('the reflection answers, in-process', () => {
    /** Sends `requests` on one reflection stream and returns the answers in order. */
    async function ask(...requests: Array<ServerReflectionRequest['messageRequest']>) {
      async function* send() {
        for (const messageRequest of requests) yield { host: 'h', messageRequest };
      }
      const out = [];
      for await (const res of client.serverReflectionInfo(send(), { timeoutMs: 10_000 })) out.push(res);
      return out;
    }
    const files = (r: { messageResponse: { case?: string; value?: unknown } }): FileDescriptorProto[] => {
      expect(r.messageResponse.case).toBe('fileDescriptorResponse');
      const bytes = (r.messageResponse.value as { fileDescriptorProto: Uint8Array[] }).fileDescriptorProto;
      return bytes.map((b) => fromBinary(FileDescriptorProtoSchema, b));
    };

    it('sends a file with its transitive dependencies once per stream, with comments', async () => {
      const [bySymbol, byName, again] = await ask(
        { case: 'fileContainingSymbol', value: 'leasehold.v1.AgentService' },
        { case: 'fileByFilename', value: 'leasehold/v1/job_service.proto' },
        { case: 'fileByFilename', value: 'leasehold/v1/job.proto' },
      );
      const first = files(bySymbol!);
      expect(first.map((f) => f.name)).toEqual([
        'leasehold/v1/agent_service.proto',
        'google/protobuf/duration.proto',
        'google/protobuf/struct.proto',
        'leasehold/v1/job.proto',
        'google/protobuf/timestamp.proto',
      ]);
      const agent = first[0]!;
      expect(agent.service.map((s) => s.name)).toEqual(['AgentService']);
      expect(agent.dependency).toEqual(['google/protobuf/duration.proto', 'google/protobuf/struct.proto', 'leasehold/v1/job.proto']);
      const comments = agent.sourceCodeInfo?.location.map((l) => l.leadingComments).join('\n') ?? '';
      expect(comments).toContain('Opens the session');
      // Dependencies already sent on this stream are not sent again; the requested file always is.
      expect(files(byName!).map((f) => f.name)).toEqual(['leasehold/v1/job_service.proto']);
      expect(files(again!).map((f) => f.name)).toEqual(['leasehold/v1/job.proto']);
      expect(bySymbol!.validHost).toBe('h');
      expect(bySymbol!.originalRequest?.messageRequest).toEqual({ case: 'fileContainingSymbol', value: 'leasehold.v1.AgentService' });
    });

    it('finds nested types, methods, fields and enum values', async () => {
      const answers = await ask(
        { case: 'fileContainingSymbol', value: 'leasehold.v1.AgentMessage.Hello' },
        { case: 'fileContainingSymbol', value: 'leasehold.v1.JobService.EnqueueJob' },
        { case: 'fileContainingSymbol', value: 'leasehold.v1.Job.payload' },
        { case: 'fileContainingSymbol', value: 'leasehold.v1.JOB_STATUS_QUEUED' },
        { case: 'fileContainingSymbol', value: 'google.protobuf.Struct' },
      );
      expect(answers.map((a) => files(a)[0]!.name)).toEqual([
        'leasehold/v1/agent_service.proto',
        'leasehold/v1/job_service.proto',
        'leasehold/v1/job.proto',
        'leasehold/v1/job.proto',
        'google/protobuf/struct.proto',
      ]);
    });

    it('answers with an error response, and keeps the stream, for what it cannot answer', async () => {
      const answers = await ask(
        { case: 'fileContainingSymbol', value: 'leasehold.v1.Nope' },
        { case: 'fileByFilename', value: 'nope.proto' },
        { case: 'fileContainingExtension', value: create(ExtensionRequestSchema, { containingType: 'leasehold.v1.Job', extensionNumber: 1000 }) },
        { case: undefined },
        { case: 'allExtensionNumbersOfType', value: 'leasehold.v1.Job' },
        { case: 'listServices', value: '' },
      );
      expect(answers.slice(0, 4).map((a) => a.messageResponse)).toEqual([
        { case: 'errorResponse', value: expect.objectContaining({ errorCode: Code.NotFound, errorMessage: expect.stringContaining('leasehold.v1.Nope') }) },
        { case: 'errorResponse', value: expect.objectContaining({ errorCode: Code.NotFound }) },
        { case: 'errorResponse', value: expect.objectContaining({ errorCode: Code.NotFound }) },
        { case: 'errorResponse', value: expect.objectContaining({ errorCode: Code.Unimplemented }) },
      ]);
      expect(answers[4]!.messageResponse).toEqual({
        case: 'allExtensionNumbersResponse',
        value: expect.objectContaining({ baseTypeName: 'leasehold.v1.Job', extensionNumber: [] }),
      });
      expect(answers[5]!.messageResponse.case).toBe('listServicesResponse');
    });
  });

  describe('health', () => {
    it('Check answers NOT_FOUND for an unknown service', async () => {
      const err = await healthClient.check({ service: 'leasehold.v1.Nope' }, { timeoutMs: 5_000 }).catch((e: unknown) => e);
      expect(ConnectError.from(err).code).toBe(Code.NotFound);
    });

    it('Watch streams each change, and SERVICE_UNKNOWN until a service is known', async () => {
      const abort = new AbortController();
      const known = healthClient.watch({ service: 'leasehold.v1.JobService' }, { signal: abort.signal })[Symbol.asyncIterator]();
      const unknown = healthClient.watch({ service: 'leasehold.v1.Later' }, { signal: abort.signal })[Symbol.asyncIterator]();
      try {
        expect((await known.next()).value?.status).toBe(Wire.SERVING);
        expect((await unknown.next()).value?.status).toBe(Wire.SERVICE_UNKNOWN);
        health.setStatus('leasehold.v1.JobService', 'NOT_SERVING');
        health.setStatus('leasehold.v1.Later', 'SERVING');
        expect((await known.next()).value?.status).toBe(Wire.NOT_SERVING);
        expect((await unknown.next()).value?.status).toBe(Wire.SERVING);
        health.setStatus('leasehold.v1.JobService', 'SERVING');
        expect((await known.next()).value?.status).toBe(Wire.SERVING);
        const list = await healthClient.list({}, { timeoutMs: 5_000 });
        expect(list.statuses['leasehold.v1.Later']?.status).toBe(Wire.SERVING);
      } finally {
        abort.abort();
        await known.return?.();
        await unknown.return?.();
      }
    });

    it('shutdown flips every service to NOT_SERVING and ends the watches', async () => {
      const h = createHealth({ services: ['a.B'] });
      const seen: string[] = [];
      const watching = (async () => {
        for await (const s of h.watch('a.B', new AbortController().signal)) seen.push(s);
      })();
      await new Promise((r) => setImmediate(r));
      h.shutdown();
      await watching;
      expect(seen).toEqual(['SERVING', 'NOT_SERVING']);
      h.setStatus('a.B', 'SERVING');
      expect(h.status('a.B')).toBe('NOT_SERVING');
      expect(h.status('')).toBe('NOT_SERVING');
    });
  });
});
