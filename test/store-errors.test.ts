/**
 * The interceptor every call passes (server/transport/store-errors.ts): a thrown error is logged
 * once; one from a database that cannot take the call now answers UNAVAILABLE with `retry-after`
 * (HTTP 503, which callers retry), anything else INTERNAL; outcomes (ConnectErrors) pass as they are.
 */
import { Code, ConnectError } from '@connectrpc/connect';
import pino from 'pino';
import { expect, it } from 'vitest';
import { JobService } from '../gen/leasehold/v1/job_service_pb.js';
import { StoreError } from '../server/store/sql.js';
import { databaseUnavailable, storeErrors, unavailableMessage } from '../server/transport/store-errors.js';

const pgError = (code: string, message = 'x') => Object.assign(new Error(message), { code });

it('tells a database that cannot take the call from other failures', () => {
  for (const e of [pgError('25006', 'cannot execute INSERT in a read-only transaction'), pgError('57P01'), pgError('53300'), pgError('08006'), pgError('57014'), new Error('Query read timeout'), new Error('timeout exceeded when trying to connect'), new Error('connect ECONNREFUSED 127.0.0.1:5432')]) {
    expect(databaseUnavailable(new StoreError('jobEnqueue failed', { cause: e })), String(e.message)).toBe(true);
  }
  for (const e of [pgError('23505'), pgError('42P01'), new TypeError('x is undefined')]) {
    expect(databaseUnavailable(new StoreError('jobEnqueue failed', { cause: e }))).toBe(false);
  }
});

it('answers UNAVAILABLE with retry-after, or INTERNAL, and logs each failure once; ConnectErrors pass', async () => {
  const lines: Array<Record<string, unknown>> = [];
  const log = pino({ level: 'warn' }, { write: (l: string) => void lines.push(JSON.parse(l) as Record<string, unknown>) });
  const method = JobService.method.enqueueJob;
  const through = (err: Error) =>
    storeErrors(log)(async () => {
      throw err;
    })({ service: JobService, method } as never).then(
      () => undefined,
      (e: unknown) => e as ConnectError,
    );
  const down = await through(new StoreError('jobEnqueue failed', { cause: pgError('25006') }));
  expect([down?.code, down?.metadata.get('retry-after')]).toEqual([Code.Unavailable, '1']);
  const bug = await through(new TypeError('x is undefined'));
  expect(bug?.code).toBe(Code.Internal);
  const outcome = new ConnectError('no such job', Code.NotFound);
  expect(await through(outcome)).toBe(outcome);
  expect(lines.map((l) => [l.level, l.msg, l.method])).toEqual([
    [40, 'call failed: the database is unavailable', 'leasehold.v1.JobService/EnqueueJob'],
    [50, 'call failed', 'leasehold.v1.JobService/EnqueueJob'],
  ]);
});

it('says when the database is out of connections, not down, and logs a run of unavailable calls as one line with a count', async () => {
  expect(unavailableMessage(new StoreError('jobEnqueue failed', { cause: pgError('53300', 'sorry, too many clients already') }))).toBe(
    'the coordinator has no free database connection (PostgreSQL max_connections reached): retry later',
  );
  expect(unavailableMessage(new StoreError('jobEnqueue failed', { cause: pgError('57P01') }))).toBe('the database is unavailable: retry later');
  const lines: Array<Record<string, unknown>> = [];
  const log = pino({ level: 'warn' }, { write: (l: string) => void lines.push(JSON.parse(l) as Record<string, unknown>) });
  const interceptor = storeErrors(log);
  const method = JobService.method.enqueueJob;
  for (let i = 0; i < 100; i++) {
    const e = await interceptor(async () => {
      throw new StoreError('jobEnqueue failed', { cause: pgError('53300', 'sorry, too many clients already') });
    })({ service: JobService, method } as never).then(
      () => undefined,
      (err: unknown) => err as ConnectError,
    );
    expect(e?.rawMessage).toBe('the coordinator has no free database connection (PostgreSQL max_connections reached): retry later');
  }
  // The first whole; the other 99 are counted into one line when its 10 s end (not waited for here).
  expect(lines.map((l) => l.msg)).toEqual(['call failed: the database is unavailable']);
});
