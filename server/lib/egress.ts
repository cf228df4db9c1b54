/**
 * Where the coordinator's own HTTP requests may connect (the webhook deliverer's: a job's
 * notify_url, subscriptions, the alert URL). A list of denied addresses and networks, checked
 * against the address each connection is made to: the URL's own address when its host is one,
 * else every address its name resolves to, inside the connection's own lookup. So a name that
 * resolves to a denied address is refused, and so is a DNS answer that changes between a check
 * and the connection (rebinding): the address checked is the one connected to.
 *
 * The default denies the link-local networks and the clouds' metadata services, which answer
 * the instance's credentials to whoever asks from it and are no place for a webhook: an
 * `enqueue` key would otherwise make the coordinator POST there. Loopback and private networks
 * stay allowed (n8n often runs beside the coordinator).
 */
import dns from 'node:dns';
import { AddressList, addressEntry } from './address-list.js';

/** The networks denied unless configured otherwise (docs/decisions.md, "Where webhooks may go"). */
export const DEFAULT_DENIED = [
  '169.254.0.0/16', // IPv4 link-local: AWS, GCP, Azure, Oracle, DigitalOcean metadata at 169.254.169.254, EKS Pod Identity at .170.23
  'fe80::/10', // IPv6 link-local
  'fd00:ec2::/64', // AWS over IPv6: metadata (::254), DNS, time, EKS Pod Identity (::23)
  'fd20:ce::254', // GCP metadata over IPv6
  '168.63.129.16', // Azure's WireServer (the VM agent's configuration)
  '100.100.100.200', // Alibaba Cloud metadata
  '192.0.0.192', // Oracle Cloud Classic metadata
  'fd00:42::42', // Scaleway metadata over IPv6
] as const;

/**
 * Denied whatever the list says, `none` included: a connection to the unspecified address
 * reaches this machine itself (Linux), so it would go round a list that denies loopback, and no
 * receiver is ever there.
 */
export const ALWAYS_DENIED = ['0.0.0.0/8', '::'] as const;

/** A connection refused by the policy: `address` is denied (`host` resolved to it). */
export class DeniedAddressError extends Error {
  readonly code = 'LEASEHOLD_EGRESS_DENIED';
  constructor(
    readonly host: string,
    readonly address: string,
    readonly setting: string,
  ) {
    super(
      host === address
        ? `the address ${address} is denied by ${setting}`
        : `${host} resolves to ${address}, an address denied by ${setting}`,
    );
    this.name = 'DeniedAddressError';
  }
}

type LookupCallback = (err: NodeJS.ErrnoException | null, address: string | dns.LookupAddress[], family?: number) => void;

/** The denied list, and a lookup for connections that keeps to it. */
export class EgressPolicy {
  private readonly list: AddressList;

  /**
   * @param entries addresses (`169.254.169.254`, `fd00:ec2::254`) and networks in CIDR notation
   *   (`10.0.0.0/8`, `fc00::/7`); `parse` checks them.
   * @param setting what the errors name as the source of the list (an environment variable).
   */
  private constructor(
    readonly entries: readonly string[],
    readonly setting: string,
  ) {
    this.list = new AddressList([...entries, ...ALWAYS_DENIED]);
  }

  /**
   * The policy of a list separated by commas or spaces: addresses, CIDR networks, `default` (DEFAULT_DENIED)
   * and `none` (alone: nothing denied but ALWAYS_DENIED, as with any list). Unset or blank: the
   * default. Throws an Error naming the entry that is none of those.
   */
  static parse(text: string | undefined, setting: string): EgressPolicy {
    const items = (text ?? '').split(/[\s,]+/).filter(Boolean);
    if (!items.length) return new EgressPolicy([...DEFAULT_DENIED], setting);
    if (items.some((i) => i.toLowerCase() === 'none')) {
      if (items.length > 1) throw new Error(`${setting}: "none" denies nothing and cannot be combined with other entries`);
      return new EgressPolicy([], setting);
    }
    const entries: string[] = [];
    for (const item of items) {
      if (item.toLowerCase() === 'default') entries.push(...DEFAULT_DENIED);
      else if (addressEntry(item)) entries.push(item);
      else throw new Error(`${setting}: ${JSON.stringify(item)} is not an IP address, a network in CIDR notation (10.0.0.0/8, fc00::/7), "default" or "none"`);
    }
    return new EgressPolicy([...new Set(entries)], setting);
  }

  /** Whether a connection to `address` (IPv4 or IPv6, IPv4-mapped included) is refused. */
  denies(address: string): boolean {
    return this.list.has(address);
  }

  /**
   * The refusal for a URL whose host is itself a denied address (a connection to an address
   * looks nothing up, so the dispatcher's lookup never sees it), else undefined. A URL that does
   * not parse is left to the request to refuse.
   */
  refusal(url: string): DeniedAddressError | undefined {
    let host: string;
    try {
      host = new URL(url).hostname; // WHATWG: 0xA9FEA9FE and 2852039166 read as 169.254.169.254
    } catch {
      return undefined;
    }
    const address = host.startsWith('[') ? host.slice(1, -1) : host;
    return this.denies(address) ? new DeniedAddressError(address, address, this.setting) : undefined;
  }

  /**
   * `dns.lookup` keeping to the policy: the denied addresses are left out of the answer, and a
   * name with only denied addresses fails with DeniedAddressError.
   */
  readonly lookup = (hostname: string, options: dns.LookupOptions, callback: LookupCallback): void => {
    dns.lookup(hostname, { ...options, all: true }, (err, addresses) => {
      if (err) return callback(err, []);
      const allowed = addresses.filter((a) => !this.denies(a.address));
      if (!allowed.length) return callback(new DeniedAddressError(hostname, addresses[0]?.address ?? hostname, this.setting), []);
      if (options.all) callback(null, allowed);
      else callback(null, allowed[0]!.address, allowed[0]!.family);
    });
  };
}
