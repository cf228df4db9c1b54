/**
 * Whose address a call is counted against (server/transport/caller-address.ts): with
 * LEASEHOLD_TRUST_PROXY=1 the last entry of X-Forwarded-For; else, and for a header that holds no
 * address, the connection's own.
 */
import { describe, expect, it } from 'vitest';
import { callerAddress } from '../server/transport/caller-address.js';

describe('callerAddress', () => {
  it('takes the last X-Forwarded-For entry behind a trusted proxy, whatever came before it', () => {
    expect(callerAddress('127.0.0.1', '203.0.113.7', true)).toBe('203.0.113.7');
    expect(callerAddress('::1', '198.51.100.9, 203.0.113.7', true)).toBe('203.0.113.7');
    expect(callerAddress('192.0.2.10', ['198.51.100.9', '203.0.113.7'], true)).toBe('203.0.113.7');
    expect(callerAddress('127.0.0.1', '2001:db8::1', true)).toBe('2001:db8::1');
    expect(callerAddress('127.0.0.1', '[2001:db8::1]:4711', true)).toBe('2001:db8::1');
    expect(callerAddress('127.0.0.1', ' 203.0.113.7:4711 ', true)).toBe('203.0.113.7');
  });

  it('reads no header without LEASEHOLD_TRUST_PROXY=1, from loopback either (a forwarder there may pass it through)', () => {
    expect(callerAddress('192.0.2.10', '203.0.113.7', false)).toBe('192.0.2.10');
    expect(callerAddress('127.0.0.1', '203.0.113.7', false)).toBe('127.0.0.1');
    expect(callerAddress('::1', '203.0.113.7', false)).toBe('::1');
  });

  it("keeps the connection's address when the header is missing, empty or not an address", () => {
    expect(callerAddress('127.0.0.1', undefined, true)).toBe('127.0.0.1');
    for (const junk of ['', ' ', 'unknown', '203.0.113.7, ', 'evil.example', '203.0.113.7:x', '[203.0.113.7]', '1.2.3.4.5']) {
      expect(callerAddress('127.0.0.1', junk, true), JSON.stringify(junk)).toBe('127.0.0.1');
    }
    expect(callerAddress(undefined, '203.0.113.7', true)).toBeUndefined();
  });
});
