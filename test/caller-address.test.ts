/**
 * Whose address a call is counted against (server/transport/caller-address.ts,
 * server/lib/proxy-trust.ts): with LEASEHOLD_TRUST_PROXY=1 the last entry of X-Forwarded-For; with
 * a list of the proxies, the last entry that is not one of them, and only from a peer that is;
 * else, and for a header that holds no address, the connection's own.
 */
import { describe, expect, it } from 'vitest';
import { MAX_HOPS, ProxyTrust } from '../server/lib/proxy-trust.js';
import { callerAddress } from '../server/transport/caller-address.js';

const trust = (setting: string) => ProxyTrust.parse(setting, 'LEASEHOLD_TRUST_PROXY')!;
const one = trust('1');

describe('callerAddress', () => {
  it('takes the last X-Forwarded-For entry behind a trusted proxy, whatever came before it', () => {
    expect(callerAddress('127.0.0.1', '203.0.113.7', one)).toBe('203.0.113.7');
    expect(callerAddress('::1', '198.51.100.9, 203.0.113.7', one)).toBe('203.0.113.7');
    expect(callerAddress('192.0.2.10', ['198.51.100.9', '203.0.113.7'], one)).toBe('203.0.113.7');
    expect(callerAddress('127.0.0.1', '2001:db8::1', one)).toBe('2001:db8::1');
    expect(callerAddress('127.0.0.1', '[2001:db8::1]:4711', one)).toBe('2001:db8::1');
    expect(callerAddress('127.0.0.1', ' 203.0.113.7:4711 ', one)).toBe('203.0.113.7');
  });

  it('reads no header without LEASEHOLD_TRUST_PROXY, from loopback either (a forwarder there may pass it through)', () => {
    for (const off of ['', '0', 'off', 'false', 'no', ' ']) expect(ProxyTrust.parse(off, 'LEASEHOLD_TRUST_PROXY'), JSON.stringify(off)).toBeUndefined();
    expect(ProxyTrust.parse(undefined, 'LEASEHOLD_TRUST_PROXY')).toBeUndefined();
    expect(callerAddress('192.0.2.10', '203.0.113.7', undefined)).toBe('192.0.2.10');
    expect(callerAddress('127.0.0.1', '203.0.113.7', undefined)).toBe('127.0.0.1');
    expect(callerAddress('::1', '203.0.113.7', undefined)).toBe('::1');
  });

  it("keeps the connection's address when the header is missing, empty or not an address", () => {
    expect(callerAddress('127.0.0.1', undefined, one)).toBe('127.0.0.1');
    for (const junk of ['', ' ', 'unknown', '203.0.113.7, ', 'evil.example', '203.0.113.7:x', '[203.0.113.7]', '1.2.3.4.5']) {
      expect(callerAddress('127.0.0.1', junk, one), JSON.stringify(junk)).toBe('127.0.0.1');
    }
    expect(callerAddress(undefined, '203.0.113.7', one)).toBeUndefined();
  });
});

describe('LEASEHOLD_TRUST_PROXY as a list of proxies (more than one hop)', () => {
  // Caddy on this machine (127.0.0.1), a CDN's edges in 173.245.48.0/20 and 2400:cb00::/32 before it.
  const chain = trust('127.0.0.1, ::1, 173.245.48.0/20,2400:cb00::/32');

  it('walks the header back past every listed proxy to the first address that is not one', () => {
    expect(chain.proxies?.entries).toEqual(['127.0.0.1', '::1', '173.245.48.0/20', '2400:cb00::/32']);
    // Caddy kept what the CDN sent (the client) and appended the edge it came from.
    expect(callerAddress('127.0.0.1', '203.0.113.7, 173.245.48.9', chain)).toBe('203.0.113.7');
    expect(callerAddress('::1', '2001:db8::5, 2400:cb00::1', chain)).toBe('2001:db8::5');
    // What the client claimed before its own address is not believed.
    expect(callerAddress('127.0.0.1', '198.51.100.1, 203.0.113.7, 173.245.48.9', chain)).toBe('203.0.113.7');
    // A caller that reached Caddy directly: Caddy replaced what it claimed with its address.
    expect(callerAddress('127.0.0.1', '198.51.100.4', chain)).toBe('198.51.100.4');
    // A peer written IPv4-mapped (a listener on [::]) is matched against the IPv4 entries.
    expect(callerAddress('::ffff:127.0.0.1', '203.0.113.7, 173.245.48.9', chain)).toBe('203.0.113.7');
  });

  it("reads no header from a peer that is not listed: that peer is the caller", () => {
    expect(callerAddress('192.0.2.10', '203.0.113.7', chain)).toBe('192.0.2.10');
    expect(callerAddress('173.245.64.1', '203.0.113.7', chain)).toBe('173.245.64.1');
  });

  it('stops at an entry that is not an address: the proxy that passed it on is the caller', () => {
    expect(callerAddress('127.0.0.1', 'unknown, 173.245.48.9', chain)).toBe('173.245.48.9');
    expect(callerAddress('127.0.0.1', '203.0.113.7, , 173.245.48.9', chain)).toBe('173.245.48.9');
    expect(callerAddress('127.0.0.1', 'evil.example', chain)).toBe('127.0.0.1');
    // Nothing but proxies: the first of them is as far back as the header can be believed.
    expect(callerAddress('127.0.0.1', '173.245.48.7, 173.245.48.9', chain)).toBe('173.245.48.7');
  });

  it('reads at most MAX_HOPS entries from the end: past them the last proxy read is the caller', () => {
    const edges = Array.from({ length: 5_000 }, (_, i) => `173.245.${48 + ((i >> 8) % 16)}.${i % 256}`);
    // 5,000 listed entries: before the bound each was looked up (28 ms a call).
    expect(callerAddress('127.0.0.1', ['203.0.113.7', ...edges].join(', '), chain)).toBe(edges.at(-MAX_HOPS));
    expect(callerAddress('127.0.0.1', ['203.0.113.7', ...edges.slice(0, MAX_HOPS - 1)].join(','), chain)).toBe('203.0.113.7');
  });

  it('refuses an entry that is neither a switch nor an address, naming it and what it may be', () => {
    for (const bad of ['127.0.0.1,cdn.example', '10.0.0.0/33', 'maybe', '127.0.0.1,fe80::1%eth0']) {
      expect(() => ProxyTrust.parse(bad, 'LEASEHOLD_TRUST_PROXY'), bad).toThrow(/^LEASEHOLD_TRUST_PROXY: ".*" is not an IP address or a network in CIDR notation: give 1 \(a proxy is the only way in\), 0, or the proxies' addresses/);
    }
  });

  it('refuses a network wider than a /8 of IPv4 or a /16 of IPv6: it would take any client for a proxy', () => {
    for (const wide of ['0.0.0.0/0', '127.0.0.1 ::/0', '64.0.0.0/2', '2000::/3', '10.0.0.0/7']) {
      expect(() => ProxyTrust.parse(wide, 'LEASEHOLD_TRUST_PROXY'), wide).toThrow(/is wider than a proxy's network can be \(at most \/8 for IPv4, \/16 for IPv6\)/);
    }
    expect(trust('10.0.0.0/8 2a06:98c0::/29 fc00::/16').proxies?.entries).toHaveLength(3);
  });
});
