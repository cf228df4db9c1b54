/**
 * The standard gRPC health service (`grpc.health.v1.Health`: Check, Watch and List) for a
 * connect-node router, driven by a small controller the coordinator holds: it marks services
 * `SERVING` when they are ready and flips everything to `NOT_SERVING` on shutdown, so load
 * balancers and `grpcurl … grpc.health.v1.Health/Check` see the change before the listener
 * closes.
 *
 * Semantics follow grpc/doc/health-checking.md: the empty service name is the server as a
 * whole and is known from the start; Check of an unknown service fails with NOT_FOUND; Watch of
 * an unknown service answers SERVICE_UNKNOWN and keeps the stream open until it becomes known.
 */
import { create } from '@bufbuild/protobuf';
import { Code, ConnectError, type ConnectRouter } from '@connectrpc/connect';
import {
  Health,
  HealthCheckResponse_ServingStatus as Wire,
  HealthCheckResponseSchema,
  HealthListResponseSchema,
} from '../../gen/grpc/health/v1/health_pb.js';

/** The status of a service, as the coordinator sets it. */
export type ServingStatus = 'SERVING' | 'NOT_SERVING';

/** What Watch reports: a status, or that the service is not known (yet). */
export type WatchedStatus = ServingStatus | 'SERVICE_UNKNOWN';

/** List answers RESOURCE_EXHAUSTED past this many services (the protocol's bound). */
const LIST_LIMIT = 100;

/** The health state of one server, shared by its Health routes and the coordinator. */
export interface HealthController {
  /**
   * Sets the status of `service` (a fully-qualified service name, or `''` for the whole
   * server) and tells its watchers. Ignored after {@link HealthController.shutdown}.
   */
  setStatus(service: string, status: ServingStatus): void;
  /** The status of `service`, or `undefined` when it is not known. */
  status(service: string): ServingStatus | undefined;
  /** Every known service and its status. */
  statuses(): ReadonlyMap<string, ServingStatus>;
  /**
   * Flips every known service to NOT_SERVING, tells the watchers, then ends their streams (so
   * they cannot hold the server open while it closes). Later `setStatus` calls are ignored.
   * Safe to call twice.
   */
  shutdown(): void;
  /**
   * The statuses of `service` as they change: the current one first, then each change, until
   * `signal` aborts or the controller shuts down (after the final NOT_SERVING).
   */
  watch(service: string, signal: AbortSignal): AsyncIterable<WatchedStatus>;
}

/** Options of {@link createHealth}. */
export interface HealthOptions {
  /** Services known and SERVING from the start, besides `''` (the whole server). */
  services?: Iterable<string>;
}

/** Creates a health controller; `''` (the whole server) starts SERVING. */
export function createHealth(options: HealthOptions = {}): HealthController {
  const current = new Map<string, ServingStatus>([['', 'SERVING']]);
  for (const s of options.services ?? []) current.set(s, 'SERVING');
  const listeners = new Set<() => void>();
  let closed = false;
  const notify = () => listeners.forEach((l) => l());

  return {
    setStatus(service, status) {
      if (closed || current.get(service) === status) return;
      current.set(service, status);
      notify();
    },
    status: (service) => current.get(service),
    statuses: () => new Map(current),
    shutdown() {
      if (closed) return;
      closed = true;
      for (const s of current.keys()) current.set(s, 'NOT_SERVING');
      notify();
    },
    async *watch(service, signal) {
      let wake: (() => void) | undefined;
      const listener = () => wake?.();
      listeners.add(listener);
      signal.addEventListener('abort', listener);
      try {
        let last: WatchedStatus | undefined;
        while (!signal.aborted) {
          // Read the state after every wake-up (and after every yield): a change made while the
          // consumer was busy is never lost, and repeats of the same status are not sent.
          const now: WatchedStatus = current.get(service) ?? 'SERVICE_UNKNOWN';
          if (now !== last) {
            last = now;
            yield now;
            continue;
          }
          if (closed) return;
          await new Promise<void>((resolve) => (wake = resolve));
          wake = undefined;
        }
      } finally {
        listeners.delete(listener);
        signal.removeEventListener('abort', listener);
      }
    },
  };
}

/** What the health routes need: the controller they answer from. */
export interface HealthDeps {
  health: HealthController;
}

const toWire = (s: WatchedStatus): Wire =>
  s === 'SERVING' ? Wire.SERVING : s === 'NOT_SERVING' ? Wire.NOT_SERVING : Wire.SERVICE_UNKNOWN;

/** Routes for `grpc.health.v1.Health`, answering from `deps.health`. */
export function healthRoutes(deps: HealthDeps): (router: ConnectRouter) => void {
  const { health } = deps;
  return (router) =>
    router.service(Health, {
      check(req) {
        const status = health.status(req.service);
        if (status === undefined) throw new ConnectError(`unknown service: ${req.service}`, Code.NotFound);
        return create(HealthCheckResponseSchema, { status: toWire(status) });
      },
      async *watch(req, ctx) {
        for await (const status of health.watch(req.service, ctx.signal)) {
          yield create(HealthCheckResponseSchema, { status: toWire(status) });
        }
      },
      list() {
        const all = health.statuses();
        if (all.size > LIST_LIMIT) {
          throw new ConnectError(`${all.size} services exceed the limit of ${LIST_LIMIT}`, Code.ResourceExhausted);
        }
        const statuses: Record<string, { status: Wire }> = {};
        for (const [name, status] of all) statuses[name] = { status: toWire(status) };
        return create(HealthListResponseSchema, { statuses });
      },
    });
}
