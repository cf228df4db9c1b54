/**
 * The address a call came from, for the limit on refused keys (key-gate.ts) and the logs. Behind
 * a reverse proxy every connection is the proxy's, so every caller shared one bucket: one
 * guesser behind Caddy held back every new key (and every key after a restart) with 429s. So
 * behind a proxy the caller is read from `X-Forwarded-For`, as `LEASEHOLD_TRUST_PROXY` says
 * (lib/proxy-trust.ts: `1`, the last entry; or a list of the proxies, for more than one hop).
 *
 * Without the setting the header is never read, from any peer: a loopback peer may be a
 * forwarder that passes headers through untouched (`ssh -L`, `kubectl port-forward`, a sidecar, a
 * TCP-mode proxy), and believing it would let anyone behind it pick a fresh address for every
 * guess. When nothing in the header is an address, the connection's address is the caller's.
 */
import type { ProxyTrust } from '../lib/proxy-trust.js';

/** `peer` (the socket's address) or, behind a proxy trusted (`trust`), the caller `X-Forwarded-For` names (`ProxyTrust.caller`). */
export function callerAddress(peer: string | undefined, forwardedFor: string | string[] | undefined, trust: ProxyTrust | undefined): string | undefined {
  if (forwardedFor === undefined || peer === undefined || !trust) return peer;
  return trust.caller(peer, Array.isArray(forwardedFor) ? forwardedFor.join(',') : forwardedFor);
}
