/**
 * Whose `X-Forwarded-For` the coordinator believes (`LEASEHOLD_TRUST_PROXY`), and the caller it
 * names; why the header is read at all: transport/caller-address.ts.
 * - `1`: a proxy is the only way to the listeners, so whatever peer sends the header is that
 *   proxy, and the caller is the header's last address, the one the proxy wrote: Caddy replaces
 *   what a client it does not trust sent, and nginx's `$proxy_add_x_forwarded_for` appends the
 *   address it saw (deploy/Caddyfile, deploy/nginx.conf). Earlier entries are whatever the
 *   client claimed, and are not read.
 * - a list of the proxies' addresses and networks (`127.0.0.1,173.245.48.0/20`), for more than one
 *   hop (a CDN or a cloud load balancer in front of Caddy, which then keeps what those send and
 *   appends their address): the header is read only from a peer in the list, and from its end
 *   back, past every address in the list; the first address not in it is the caller. An entry
 *   that is not an address stops the walk: the proxy that passed it on is then the caller.
 */
import net from 'node:net';
import { AddressList, addressEntry } from './address-list.js';

/** The widest networks a list may name: a /8 of IPv4 (10.0.0.0/8), a /16 of IPv6. */
const MIN_BITS = { v4: 8, v6: 16 };
/** The most entries of a header read: a chain of proxies is a few; a header of thousands is not one. */
export const MAX_HOPS = 32;

/** Whose `X-Forwarded-For` is believed: any peer's last entry (`1`), or the listed proxies'. */
export class ProxyTrust {
  private constructor(
    /** The setting as written, for the logs. */
    readonly text: string,
    /** The proxies; undefined for `1` (the peer is the proxy, whatever its address, and only it). */
    readonly proxies: AddressList | undefined,
  ) {}

  /**
   * The trust of `LEASEHOLD_TRUST_PROXY`: undefined (no header is read) for unset, empty, `0`,
   * `false`, `no` or `off`; the peer's last entry for `1`, `true`, `yes` or `on`; else a list of
   * addresses and CIDR networks, separated by commas or spaces (as Caddy's `trusted_proxies`
   * takes them). Throws an Error naming the entry that is
   * none of those.
   */
  static parse(raw: string | undefined, setting: string): ProxyTrust | undefined {
    const text = raw?.trim() ?? '';
    const flag = text.toLowerCase();
    if (['', '0', 'false', 'no', 'off'].includes(flag)) return undefined;
    if (['1', 'true', 'yes', 'on'].includes(flag)) return new ProxyTrust(text, undefined);
    const items = text.split(/[\s,]+/).filter(Boolean);
    const usage = "give 1 (a proxy is the only way in), 0, or the proxies' addresses and networks, separated by commas or spaces (127.0.0.1,10.0.0.0/8)";
    let list: AddressList;
    try {
      list = new AddressList(items);
    } catch (err) {
      throw new Error(`${setting}: ${(err as Error).message}: ${usage}`);
    }
    // A network that wide takes almost any client for a proxy, and every entry a client writes
    // before its own address would then be believed: worse than `1`.
    const wide = items.find((i) => {
      const [address, bits] = addressEntry(i)!;
      return bits !== undefined && bits < (net.isIPv4(address) ? MIN_BITS.v4 : MIN_BITS.v6);
    });
    if (wide) throw new Error(`${setting}: ${JSON.stringify(wide)} is wider than a proxy's network can be (at most /${MIN_BITS.v4} for IPv4, /${MIN_BITS.v6} for IPv6): ${usage}`);
    return new ProxyTrust(text, list);
  }

  /**
   * The caller of a call from `peer` (the socket's address) carrying `forwardedFor`. The header is
   * read from its end, at most `MAX_HOPS` entries: past them the last proxy read is the caller.
   */
  caller(peer: string, forwardedFor: string): string {
    if (this.proxies && !this.proxies.has(peer)) return peer;
    let caller = peer;
    let end = forwardedFor.length;
    for (let hop = 0; hop < MAX_HOPS && end >= 0; hop++) {
      const comma = forwardedFor.lastIndexOf(',', end - 1);
      const address = bareAddress(forwardedFor.slice(comma + 1, end).trim());
      if (address === undefined) return caller;
      caller = address;
      if (!this.proxies?.has(address)) return address;
      end = comma;
    }
    return caller;
  }
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
