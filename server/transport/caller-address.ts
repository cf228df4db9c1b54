/**
 * The address a call came from, for the limit on refused keys (key-gate.ts) and the logs. Behind
 * a reverse proxy every connection is the proxy's, so every caller shared one bucket: one
 * guesser behind Caddy held back every new key (and every key after a restart) with 429s.
 *
 * The last address of `X-Forwarded-For` is the one the proxy nearest the coordinator wrote: Caddy
 * replaces what a client it does not trust sent, and nginx's `$proxy_add_x_forwarded_for` appends
 * the address it saw (deploy/Caddyfile, deploy/nginx.conf). Only that last one is read; earlier
 * entries are whatever the client claimed. It is believed from a peer on loopback (a proxy on the
 * same machine, as docs/deploy.md sets one up) and, with `LEASEHOLD_TRUST_PROXY=1` (a proxy is the
 * only way to the listeners: a container behind one), from any peer. Otherwise, or when the last
 * entry is not an address, the connection's address is the caller's.
 */
import net from 'node:net';

/** `peer` (the socket's address) or, from a proxy believed, the last address of `forwardedFor`. */
export function callerAddress(peer: string | undefined, forwardedFor: string | string[] | undefined, trustProxy: boolean): string | undefined {
  if (forwardedFor === undefined || peer === undefined || !(trustProxy || isLoopback(peer))) return peer;
  const last = (Array.isArray(forwardedFor) ? forwardedFor.join(',') : forwardedFor).split(',').at(-1)?.trim();
  return (last ? bareAddress(last) : undefined) ?? peer;
}

function isLoopback(addr: string): boolean {
  return addr === '::1' || /^(::ffff:)?127\./i.test(addr);
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
