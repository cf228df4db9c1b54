/**
 * The address a call came from, for the limit on refused keys (key-gate.ts) and the logs. Behind
 * a reverse proxy every connection is the proxy's, so every caller shared one bucket: one
 * guesser behind Caddy held back every new key (and every key after a restart) with 429s.
 *
 * With `LEASEHOLD_TRUST_PROXY=1` (a proxy is the only way to the listeners) the caller is the last
 * address of `X-Forwarded-For`, the one the proxy next to the coordinator wrote: Caddy replaces
 * what a client it does not trust sent, and nginx's `$proxy_add_x_forwarded_for` appends the
 * address it saw (deploy/Caddyfile, deploy/nginx.conf). Earlier entries are whatever the client
 * claimed, and are not read. Without the setting the header is never read, from any peer: a
 * loopback peer may be a forwarder that passes headers through untouched (`ssh -L`, `kubectl
 * port-forward`, a sidecar, a TCP-mode proxy), and believing it would let anyone behind it pick
 * a fresh address for every guess. When the last entry is not an address, the connection's
 * address is the caller's.
 */
import net from 'node:net';

/** `peer` (the socket's address) or, behind a proxy trusted (`trustProxy`), the last address of `forwardedFor`. */
export function callerAddress(peer: string | undefined, forwardedFor: string | string[] | undefined, trustProxy: boolean): string | undefined {
  if (forwardedFor === undefined || peer === undefined || !trustProxy) return peer;
  const last = (Array.isArray(forwardedFor) ? forwardedFor.join(',') : forwardedFor).split(',').at(-1)?.trim();
  return (last ? bareAddress(last) : undefined) ?? peer;
}

/** An address as proxies write it (`203.0.113.7`, `2001:db8::1`, `[2001:db8::1]:4711`, `203.0.113.7:4711`), bare; undefined for anything else. */
function bareAddress(s: string): string | undefined {
  if (net.isIP(s)) return s;
  const bracketed = /^\[([^\]]+)\](?::\d+)?$/.exec(s);
  if (bracketed && net.isIPv6(bracketed[1]!)) return bracketed[1];
  const v4port = /^(\d+\.\d+\.\d+\.\d+):\d+$/.exec(s);
  if (v4port && net.isIPv4(v4port[1]!)) return v4port[1];
  return undefined;
}
