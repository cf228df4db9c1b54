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
 */
import type { JsonObject, JsonValue } from '@bufbuild/protobuf';
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

/** The request of `body`, as protobuf-es would read it; undefined for what it is left to. */
export function readEnqueueRequest(body: Uint8Array): EnqueueJobRequest | undefined {
  const text = Buffer.from(body.buffer, body.byteOffset, body.byteLength).toString('utf8');
  // A byte sequence that is not UTF-8 (decoded to U+FFFD), or a byte-order mark (which
  // Connect's TextDecoder drops): Connect's own reading.
  if (text.includes('\uFFFD') || text.charCodeAt(0) === 0xfeff) return undefined;
  let json: unknown;
  try {
    json = JSON.parse(text);
  } catch {
    return undefined;
  }
  if (typeof json !== 'object' || json === null || Array.isArray(json)) return undefined;
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
