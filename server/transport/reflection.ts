/**
 * gRPC server reflection (`grpc.reflection.v1.ServerReflection` and the older
 * `grpc.reflection.v1alpha.ServerReflection`) for a connect-node router, so that grpcurl and
 * `buf curl` list, describe and call every service with no .proto files at hand.
 *
 * The descriptors served are the real ones: the `FileDescriptorProto` each generated `file_*`
 * descriptor of `gen/` was built from, serialized with `toBinary`, together with its
 * transitive dependencies (`google/protobuf/struct.proto`, …). protoc-gen-es drops comments
 * from what it embeds, so `npm run gen` also writes `gen/descriptors.binpb` (a
 * FileDescriptorSet with source info, from `buf build`); when it is given and a file in it is
 * the same descriptor as the generated one, that file is served with its comments, which is
 * what makes `grpcurl describe` show the contract's documentation.
 *
 * The services listed are the ones registered on the router, read when a stream starts, so
 * routes registered after these ones are listed too.
 */
import { readFileSync } from 'node:fs';
import { clone, create, equals, fromBinary, toBinary, type DescFile } from '@bufbuild/protobuf';
import { nestedTypes } from '@bufbuild/protobuf/reflect';
import { FileDescriptorProtoSchema, FileDescriptorSetSchema, type FileDescriptorProto } from '@bufbuild/protobuf/wkt';
import { Code, type ConnectRouter } from '@connectrpc/connect';
import * as v1 from '../../gen/grpc/reflection/v1/reflection_pb.js';
import * as v1alpha from '../../gen/grpc/reflection/v1alpha/reflection_pb.js';

/** Where `npm run gen` writes the FileDescriptorSet with source info (comments). */
export const GENERATED_DESCRIPTOR_SET = new URL('../../gen/descriptors.binpb', import.meta.url);

/** What the reflection routes need besides the router they are registered on. */
export interface ReflectionDeps {
  /**
   * A serialized `google.protobuf.FileDescriptorSet` with source info, used only for the
   * comments of files that match the generated descriptors exactly (see
   * {@link readDescriptorSet}). Without it, descriptors are served without comments.
   */
  sourceInfo?: Uint8Array | undefined;
  /** Files to serve besides those of the router's services and their dependencies. */
  extraFiles?: readonly DescFile[];
}

/**
 * Reads the descriptor set `npm run gen` writes (or the one at `path`); `undefined` when the
 * file does not exist, so a server without it still serves reflection, without comments.
 */
export function readDescriptorSet(path: URL | string = GENERATED_DESCRIPTOR_SET): Uint8Array | undefined {
  try {
    return readFileSync(path);
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return undefined;
    throw new Error(`cannot read the descriptor set ${String(path)}`, { cause: err });
  }
}

/**
 * Routes for both reflection services: `(router) => …` registers them on `router`, and they
 * answer for every service registered on that router.
 */
export function reflectionRoutes(deps: ReflectionDeps = {}): (router: ConnectRouter) => void {
  const withSource = parseSourceInfo(deps.sourceInfo);
  return (router) => {
    const index = createIndexCache(router, deps.extraFiles ?? [], withSource);
    router.service(v1.ServerReflection, {
      serverReflectionInfo: (requests) =>
        serve(requests, index, (req, messageResponse) =>
          create(v1.ServerReflectionResponseSchema, { validHost: req.host, originalRequest: req, messageResponse }),
        ),
    });
    router.service(v1alpha.ServerReflection, {
      serverReflectionInfo: (requests) =>
        serve(requests, index, (req, messageResponse) =>
          create(v1alpha.ServerReflectionResponseSchema, { validHost: req.host, originalRequest: req, messageResponse }),
        ),
    });
  };
}

/** The request oneof, shared by v1 and v1alpha (their messages are identical but for the package). */
type ReflectionRequest = {
  host: string;
  messageRequest:
    | { case: 'fileByFilename' | 'fileContainingSymbol' | 'allExtensionNumbersOfType' | 'listServices'; value: string }
    | { case: 'fileContainingExtension'; value: { containingType: string; extensionNumber: number } }
    | { case: undefined; value?: undefined };
};

/** The response oneof as plain values, turned into either version's message by `create`. */
type Answer =
  | { case: 'fileDescriptorResponse'; value: { fileDescriptorProto: Uint8Array[] } }
  | { case: 'allExtensionNumbersResponse'; value: { baseTypeName: string; extensionNumber: number[] } }
  | { case: 'listServicesResponse'; value: { service: Array<{ name: string }> } }
  | { case: 'errorResponse'; value: { errorCode: number; errorMessage: string } };

/** What the reflection service knows, built from the router's services. */
interface Index {
  services: string[];
  /** Every served file by name (`leasehold/v1/job.proto`). */
  files: Map<string, DescFile>;
  /** Every fully-qualified symbol (types, fields, enum values, services, methods) → its file. */
  symbols: Map<string, DescFile>;
  /** Every fully-qualified message name. */
  messages: Set<string>;
  /** Extensions by `extendee:number` → their file; and the numbers of each extendee. */
  extensions: Map<string, DescFile>;
  extensionNumbers: Map<string, number[]>;
  /** The bytes to send for a file. */
  bytes(file: DescFile): Uint8Array;
}

async function* serve<Req extends ReflectionRequest, Res>(
  requests: AsyncIterable<Req>,
  index: () => Index,
  respond: (req: Req, answer: Answer) => Res,
): AsyncIterable<Res> {
  // Files already sent on this stream are not sent again as dependencies (the protocol allows
  // it, and grpc-go does the same); the requested file itself is always sent.
  const sent = new Set<string>();
  for await (const req of requests) {
    yield respond(req, answer(index(), req, sent));
  }
}

function answer(index: Index, req: ReflectionRequest, sent: Set<string>): Answer {
  const r = req.messageRequest;
  switch (r.case) {
    case 'listServices':
      return { case: 'listServicesResponse', value: { service: index.services.map((name) => ({ name })) } };
    case 'fileByFilename': {
      const file = index.files.get(r.value);
      return file ? filesFor(index, file, sent) : error(Code.NotFound, `file not found: ${r.value}`);
    }
    case 'fileContainingSymbol': {
      const file = index.symbols.get(r.value.replace(/^\./, ''));
      return file ? filesFor(index, file, sent) : error(Code.NotFound, `symbol not found: ${r.value}`);
    }
    case 'fileContainingExtension': {
      const { containingType, extensionNumber } = r.value;
      const file = index.extensions.get(`${containingType.replace(/^\./, '')}:${extensionNumber}`);
      return file
        ? filesFor(index, file, sent)
        : error(Code.NotFound, `extension not found: ${containingType} field ${extensionNumber}`);
    }
    case 'allExtensionNumbersOfType': {
      const type = r.value.replace(/^\./, '');
      if (!index.messages.has(type)) return error(Code.NotFound, `message type not found: ${r.value}`);
      return {
        case: 'allExtensionNumbersResponse',
        value: { baseTypeName: type, extensionNumber: index.extensionNumbers.get(type) ?? [] },
      };
    }
    default:
      return error(Code.Unimplemented, 'unsupported reflection request: none of the known message_request fields is set');
  }
}

/** `file` and its transitive dependencies, breadth first, minus dependencies already sent. */
function filesFor(index: Index, file: DescFile, sent: Set<string>): Answer {
  const out: Uint8Array[] = [];
  const queue: DescFile[] = [file];
  const seen = new Set<string>();
  for (let f = queue.shift(); f; f = queue.shift()) {
    const name = f.proto.name;
    if (seen.has(name)) continue;
    seen.add(name);
    if (out.length === 0 || !sent.has(name)) {
      out.push(index.bytes(f));
      sent.add(name);
    }
    queue.push(...f.dependencies);
  }
  return { case: 'fileDescriptorResponse', value: { fileDescriptorProto: out } };
}

function error(code: Code, errorMessage: string): Answer {
  return { case: 'errorResponse', value: { errorCode: code, errorMessage } };
}

function parseSourceInfo(bytes: Uint8Array | undefined): Map<string, FileDescriptorProto> {
  const byName = new Map<string, FileDescriptorProto>();
  if (!bytes) return byName;
  let set;
  try {
    set = fromBinary(FileDescriptorSetSchema, bytes);
  } catch (err) {
    throw new Error('the reflection source info is not a serialized FileDescriptorSet', { cause: err });
  }
  for (const f of set.file) byName.set(f.name, f);
  return byName;
}

/**
 * The index for `router`, rebuilt when services were added since the last build (handlers are
 * only ever added), so building happens once in practice.
 */
function createIndexCache(
  router: ConnectRouter,
  extraFiles: readonly DescFile[],
  withSource: Map<string, FileDescriptorProto>,
): () => Index {
  let built: { handlers: number; index: Index } | undefined;
  const bytes = new Map<DescFile, Uint8Array>();
  const serialize = (file: DescFile): Uint8Array => {
    let b = bytes.get(file);
    if (!b) {
      b = toBinary(FileDescriptorProtoSchema, withComments(file.proto, withSource.get(file.proto.name)));
      bytes.set(file, b);
    }
    return b;
  };
  return () => {
    if (built?.handlers !== router.handlers.length) {
      built = { handlers: router.handlers.length, index: buildIndex(router, extraFiles, serialize) };
    }
    return built.index;
  };
}

/**
 * The generated descriptor, or the one from the descriptor set when it is the same descriptor
 * plus source info. A set that does not match (a stale `gen/descriptors.binpb`) is ignored, so
 * comments can never describe a different schema than the one served.
 */
function withComments(generated: FileDescriptorProto, fromSet: FileDescriptorProto | undefined): FileDescriptorProto {
  if (!fromSet?.sourceCodeInfo) return generated;
  const stripped = clone(FileDescriptorProtoSchema, fromSet);
  stripped.sourceCodeInfo = undefined;
  return equals(FileDescriptorProtoSchema, stripped, generated) ? fromSet : generated;
}

function buildIndex(router: ConnectRouter, extraFiles: readonly DescFile[], bytes: (f: DescFile) => Uint8Array): Index {
  const services = [...new Set(router.handlers.map((h) => h.service.typeName))].sort();
  const files = new Map<string, DescFile>();
  const addFile = (f: DescFile): void => {
    if (files.has(f.proto.name)) return;
    files.set(f.proto.name, f);
    f.dependencies.forEach(addFile);
  };
  router.handlers.forEach((h) => addFile(h.service.file));
  extraFiles.forEach(addFile);

  const symbols = new Map<string, DescFile>();
  const messages = new Set<string>();
  const extensions = new Map<string, DescFile>();
  const extensionNumbers = new Map<string, number[]>();
  for (const file of files.values()) {
    for (const t of nestedTypes(file)) {
      symbols.set(t.typeName, file);
      switch (t.kind) {
        case 'message':
          messages.add(t.typeName);
          for (const f of t.fields) symbols.set(`${t.typeName}.${f.name}`, file);
          for (const o of t.oneofs) symbols.set(`${t.typeName}.${o.name}`, file);
          break;
        case 'enum': {
          // Enum values are scoped like C++ enumerators: siblings of the enum, not its children.
          const scope = t.typeName.slice(0, Math.max(0, t.typeName.lastIndexOf('.')));
          for (const v of t.values) symbols.set(scope ? `${scope}.${v.name}` : v.name, file);
          break;
        }
        case 'service':
          for (const m of t.methods) symbols.set(`${t.typeName}.${m.name}`, file);
          break;
        case 'extension': {
          const extendee = t.extendee.typeName;
          extensions.set(`${extendee}:${t.number}`, file);
          extensionNumbers.set(extendee, [...(extensionNumbers.get(extendee) ?? []), t.number]);
          break;
        }
      }
    }
  }
  return { services, files, symbols, messages, extensions, extensionNumbers, bytes };
}
