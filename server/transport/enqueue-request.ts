/**
 * The JSON body of an `EnqueueJob` as n8n and scripts send it — `queue` and `payload`, perhaps
 * `priority`, `maxAttempts`, `idempotencyKey`, `notifyUrl` — read into the message protobuf-es's
 * `fromJson` makes of it, without walking the schema: protobuf-es creates the message and reads
 * each field by reflection, about 15 µs of the coordinator's CPU per enqueue taken one at a time
 * (docs/performance.md). Anything else is left to protobuf-es (undefined here), which reads it or
 * says what is wrong: another field or a field's other JSON name, a value of another type or
 * form (a number as a string, a null, a fraction, an object key `__proto__`), text that does
 * not decode as UTF-8 or does not parse. test/enqueue-request.test.ts holds the two equal on
 * arbitrary requests.
 *
 * One thing protobuf-es reads that is refused here: a `runAt` of a date or time that does not
 * exist (`2027-02-29`, `2026-02-31`, `T24:00:00`, `:60`). protobuf-es checks the pattern and hands
 * the text to `Date.parse`, which rolls it over to another day (`2027-03-01`, `2026-03-03`, the
 * next day), and the job would run then, answered 200: see `impossibleRunAt`.
 */
import type { JsonObject, JsonValue } from '@bufbuild/protobuf';
import { Code, ConnectError } from '@connectrpc/connect';
import type { EnqueueJobRequest } from '../../gen/leasehold/v1/job_service_pb.js';

const INT32_MIN = -(2 ** 31);
const INT32_MAX = 2 ** 31 - 1;

const isInt32 = (v: unknown): v is number => typeof v === 'number' && Number.isInteger(v) && v >= INT32_MIN && v <= INT32_MAX;

/** True for JSON protobuf-es reads into a Struct value unchanged (no key it would treat otherwise). */
function plainJson(v: JsonValue, depth: number): boolean {
  if (typeof v !== 'object' || v === null) return true;
  if (depth > 64) return false;
  if (Array.isArray(v)) {
    for (const x of v) if (!plainJson(x, depth + 1)) return false;
    return true;
  }
  for (const k in v) {
    if (k === '__proto__' || !plainJson(v[k]!, depth + 1)) return false;
  }
  return true;
}

// Timestamp's JSON form as protobuf-es matches it (from-json.ts, timestampFromJson), before Date.parse.
const RFC3339 = /^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:\.\d{1,9})?(?:Z|[+-](\d{2}):(\d{2}))$/;

const daysIn = (year: number, month: number) =>
  month === 2 ? (year % 4 === 0 && (year % 100 !== 0 || year % 400 === 0) ? 29 : 28) : [4, 6, 9, 11].includes(month) ? 30 : 31;

/** Why `text`, of Timestamp's JSON form, names no time that exists; undefined when it does (or is not of that form). */
function notATime(text: string): string | undefined {
  const m = RFC3339.exec(text);
  if (!m) return undefined; // protobuf-es refuses it itself
  const [year, month, day, hour, minute, second] = m.slice(1, 7).map(Number) as [number, number, number, number, number, number];
  if (month < 1 || month > 12) return `month ${m[2]} is not 01 to 12`;
  const days = daysIn(year, month);
  if (day < 1 || day > days) return `day ${m[3]} is not in ${m[1]}-${m[2]}, which has ${days} days`;
  if (hour > 23) return `hour ${m[4]} is not 00 to 23`;
  if (minute > 59) return `minute ${m[5]} is not 00 to 59`;
  if (second > 59) return `second ${m[6]} is not 00 to 59`;
  if (m[7] !== undefined && (Number(m[7]) > 23 || Number(m[8]) > 59)) return `the offset is not within ±23:59`;
  return undefined;
}

/**
 * The error for a request whose `runAt` (or `run_at`) is of Timestamp's JSON form but names a
 * date or time that does not exist: a day past its month's end, hour 24, minute or second 60
 * (protobuf-es would read it as another time); undefined for any other request. INVALID_ARGUMENT
 * (400), worded as protobuf-es words a field it cannot decode, so that the answer names `runAt`.
 * Any reading of an EnqueueJob's JSON goes through it (Connect's handler does not: its caller's).
 */
export function impossibleRunAt(json: unknown): ConnectError | undefined {
  if (typeof json !== 'object' || json === null || Array.isArray(json)) return undefined;
  for (const key of ['runAt', 'run_at']) {
    const v = (json as Record<string, unknown>)[key];
    if (typeof v !== 'string') continue;
    const why = notATime(v);
    if (why) return new ConnectError(`cannot decode field leasehold.v1.EnqueueJobRequest.runAt from JSON: ${JSON.stringify(v)} is no time: ${why}`, Code.InvalidArgument);
  }
  return undefined;
}

/**
 * The request of `body`, as protobuf-es would read it; undefined for what it is left to. Throws
 * INVALID_ARGUMENT for a `runAt` that names no time (`impossibleRunAt`), whoever would read the rest.
 */
export function readEnqueueRequest(body: Uint8Array): EnqueueJobRequest | undefined {
  const text = Buffer.from(body.buffer, body.byteOffset, body.byteLength).toString('utf8');
  // A byte-order mark, which Connect's TextDecoder drops.
  const bom = text.charCodeAt(0) === 0xfeff;
  let json: unknown;
  try {
    json = JSON.parse(bom ? text.slice(1) : text);
  } catch {
    return undefined;
  }
  if (typeof json !== 'object' || json === null || Array.isArray(json)) return undefined;
  // Before anything is left to protobuf-es, which would read such a runAt as another time.
  const badTime = impossibleRunAt(json);
  if (badTime) throw badTime;
  // A byte sequence that is not UTF-8 (decoded to U+FFFD), or a byte-order mark: Connect's own reading.
  if (bom || text.includes('\uFFFD')) return undefined;
  const m: EnqueueJobRequest = {
    $typeName: 'leasehold.v1.EnqueueJobRequest',
    queue: '',
    priority: 0,
    maxAttempts: 0,
    idempotencyKey: '',
    notifyUrl: '',
    labels: {},
  };
  for (const k in json) {
    const v = (json as Record<string, unknown>)[k];
    switch (k) {
      case 'queue':
        if (typeof v !== 'string') return undefined;
        m.queue = v;
        break;
      case 'payload':
        if (typeof v !== 'object' || v === null || Array.isArray(v) || !plainJson(v as JsonObject, 0)) return undefined;
        m.payload = v as JsonObject;
        break;
      case 'priority':
        if (!isInt32(v)) return undefined;
        m.priority = v;
        break;
      case 'maxAttempts':
        if (!isInt32(v)) return undefined;
        m.maxAttempts = v;
        break;
      case 'idempotencyKey':
        if (typeof v !== 'string') return undefined;
        m.idempotencyKey = v;
        break;
      case 'notifyUrl':
        if (typeof v !== 'string') return undefined;
        m.notifyUrl = v;
        break;
      default:
        return undefined;
    }
  }
  return m;
}
