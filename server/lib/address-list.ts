/**
 * Lists of IP addresses and networks, as the settings that take them write them
 * (`LEASEHOLD_WEBHOOK_DENY`, `LEASEHOLD_TRUST_PROXY`): addresses, separated by commas or spaces (`10.0.0.7`,
 * `fd00:ec2::254`) and networks in CIDR notation (`10.0.0.0/8`, `fc00::/7`), matched with
 * `net.BlockList`, which also matches an IPv4-mapped IPv6 address (`::ffff:10.0.0.7`) against
 * the IPv4 entries.
 */
import net from 'node:net';

/** `[address, prefix bits]` of an address or CIDR network, or undefined if it is neither. */
export function addressEntry(entry: string): [string, number | undefined] | undefined {
  const slash = entry.indexOf('/');
  const address = slash < 0 ? entry : entry.slice(0, slash);
  const family = net.isIP(address);
  // A zone (fe80::1%eth0) names an interface, not an address the list could match.
  if (!family || address.includes('%')) return undefined;
  if (slash < 0) return [address, undefined];
  const bitsText = entry.slice(slash + 1);
  const bits = Number(bitsText);
  if (!/^\d{1,3}$/.test(bitsText) || bits > (family === 4 ? 32 : 128)) return undefined;
  return [address, bits];
}

/** A list of entries each `addressEntry` reads (it throws on one it does not). */
export class AddressList {
  private readonly list = new net.BlockList();

  constructor(readonly entries: readonly string[]) {
    for (const e of entries) {
      const parsed = addressEntry(e);
      if (!parsed) throw new Error(`${JSON.stringify(e)} is not an IP address or a network in CIDR notation`);
      const [address, bits] = parsed;
      const family = net.isIPv4(address) ? 'ipv4' : 'ipv6';
      if (bits === undefined) this.list.addAddress(address, family);
      else this.list.addSubnet(address, bits, family);
    }
  }

  /** Whether `address` (IPv4 or IPv6, IPv4-mapped included) is in the list; false for anything that is not an address. */
  has(address: string): boolean {
    const family = net.isIP(address);
    if (!family) return false;
    return this.list.check(address, family === 4 ? 'ipv4' : 'ipv6');
  }
}
