/**
 * What a coordinator agrees to listen on: cleartext only on loopback unless TLS is configured,
 * a TLS-terminating proxy is declared (LEASEHOLD_TRUST_PROXY) or the operator passes --insecure.
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { ConfigError, isLoopback, loadConfig } from '../server/config.js';

const dir = mkdtempSync(path.join(os.tmpdir(), 'leasehold-config-'));
const cert = path.join(dir, 'cert.pem');
const key = path.join(dir, 'key.pem');
// loadConfig checks that the files exist; the listeners read them.
writeFileSync(cert, 'cert');
writeFileSync(key, 'key');
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe('listening beyond loopback', () => {
  it('tells loopback addresses from the rest', () => {
    for (const a of ['127.0.0.1:8080', '127.1.2.3:1', 'localhost:50051', 'LOCALHOST:1', '[::1]:8080']) expect(isLoopback(a), a).toBe(true);
    for (const a of ['0.0.0.0:8080', '[::]:8080', '10.0.0.5:8080', '192.168.1.2:50051', 'leasehold.example.com:443', '128.0.0.1:80', '[::ffff:127.0.0.1]:80']) {
      expect(isLoopback(a), a).toBe(false);
    }
  });

  it('starts on loopback without TLS, as by default', () => {
    const c = loadConfig({}, {});
    expect([c.grpcAddr, c.httpAddr, c.insecure, c.trustProxy, c.tls]).toEqual(['127.0.0.1:50051', '127.0.0.1:8080', false, undefined, undefined]);
  });

  it('refuses a cleartext listener on a network address, naming the listener and the ways out', () => {
    for (const [flags, env, listener] of [
      [{ httpAddr: '0.0.0.0:8080' }, {}, 'HTTP on 0.0.0.0:8080 (--http-addr, LEASEHOLD_HTTP_ADDR)'],
      [{}, { LEASEHOLD_GRPC_ADDR: '[::]:50051' }, 'gRPC on [::]:50051 (--grpc-addr, LEASEHOLD_GRPC_ADDR)'],
      [{}, { LEASEHOLD_HTTP_ADDR: '192.168.1.10:8080', LEASEHOLD_INSECURE: '0' }, 'HTTP on 192.168.1.10:8080'],
    ] as const) {
      let err: unknown;
      try {
        loadConfig(flags, env);
      } catch (e) {
        err = e;
      }
      expect(err, listener).toBeInstanceOf(ConfigError);
      const m = (err as Error).message;
      expect(m).toContain(`refusing to listen for ${listener}`);
      for (const way of ['LEASEHOLD_TLS_CERT', 'LEASEHOLD_TRUST_PROXY=1', 'or the addresses of the proxies', '--insecure', 'LEASEHOLD_INSECURE=1']) expect(m).toContain(way);
    }
  });

  it('allows it with TLS, with a declared proxy, or when told to', () => {
    const open = { grpcAddr: '0.0.0.0:50051', httpAddr: '0.0.0.0:8080' };
    expect(loadConfig(open, { LEASEHOLD_TLS_CERT: cert, LEASEHOLD_TLS_KEY: key }).tls).toEqual({ certFile: cert, keyFile: key });
    expect(loadConfig(open, { LEASEHOLD_TRUST_PROXY: '1' }).trustProxy?.proxies).toBeUndefined();
    expect(loadConfig(open, { LEASEHOLD_TRUST_PROXY: '1' }).trustProxy?.text).toBe('1');
    // The proxies' addresses, for more than one hop: a proxy is the way in all the same.
    expect(loadConfig(open, { LEASEHOLD_TRUST_PROXY: '127.0.0.1,10.0.0.0/8' }).trustProxy?.proxies?.entries).toEqual(['127.0.0.1', '10.0.0.0/8']);
    expect(loadConfig(open, { LEASEHOLD_INSECURE: 'true' }).insecure).toBe(true);
    expect(loadConfig({ ...open, insecure: true }, {}).insecure).toBe(true);
  });

  it('refuses a switch that is neither on nor off', () => {
    expect(() => loadConfig({}, { LEASEHOLD_INSECURE: 'maybe' })).toThrow('LEASEHOLD_INSECURE="maybe" must be 1 or 0 (true or false)');
    expect(() => loadConfig({}, { LEASEHOLD_TRUST_PROXY: 'maybe' })).toThrow(ConfigError);
    expect(() => loadConfig({}, { LEASEHOLD_TRUST_PROXY: '127.0.0.1,proxy.internal' })).toThrow(
      'LEASEHOLD_TRUST_PROXY: "proxy.internal" is not an IP address or a network in CIDR notation',
    );
    expect(() => loadConfig({}, { LEASEHOLD_TRUST_PROXY: 'yes please' })).toThrow(/LEASEHOLD_TRUST_PROXY/);
  });
});

describe('the vacuumer setting', () => {
  it('defaults to 50,000 dead rows, takes a number, turns off with off or 0, and names a bad value', () => {
    expect(loadConfig({}, {}).purgeSweepShare).toBe(0.1);
    expect(loadConfig({}, { LEASEHOLD_PURGE_SWEEP_SHARE: '0.5' }).purgeSweepShare).toBe(0.5);
    expect(loadConfig({}, { LEASEHOLD_PURGE_SWEEP_SHARE: '1' }).purgeSweepShare).toBe(1);
    for (const bad of ['0', '-0.1', '1.5', 'half', 'NaN']) {
      expect(() => loadConfig({}, { LEASEHOLD_PURGE_SWEEP_SHARE: bad })).toThrow(
        new ConfigError(`LEASEHOLD_PURGE_SWEEP_SHARE=${JSON.stringify(bad)} must be a number above 0 and at most 1, e.g. 0.1`),
      );
    }
    expect(loadConfig({}, {}).vacuumDeadRows).toBe(50_000);
    expect(loadConfig({}, { LEASEHOLD_VACUUM_DEAD_ROWS: '2000' }).vacuumDeadRows).toBe(2000);
    expect(loadConfig({}, { LEASEHOLD_VACUUM_DEAD_ROWS: 'off' }).vacuumDeadRows).toBeUndefined();
    expect(loadConfig({}, { LEASEHOLD_VACUUM_DEAD_ROWS: '0' }).vacuumDeadRows).toBeUndefined();
    for (const bad of ['lots', '-1', '1.5']) {
      expect(() => loadConfig({}, { LEASEHOLD_VACUUM_DEAD_ROWS: bad })).toThrow(new ConfigError(`LEASEHOLD_VACUUM_DEAD_ROWS=${JSON.stringify(bad)} must be a whole number from 0 to 1000000000`));
    }
    expect(loadConfig({}, {}).agentKeepaliveMs).toBe(20_000);
    expect(loadConfig({}, { LEASEHOLD_AGENT_KEEPALIVE: '5s' }).agentKeepaliveMs).toBe(5_000);
    expect(loadConfig({}, { LEASEHOLD_AGENT_KEEPALIVE: 'off' }).agentKeepaliveMs).toBeUndefined();
    expect(() => loadConfig({}, { LEASEHOLD_AGENT_KEEPALIVE: 'soon' })).toThrow(new ConfigError('LEASEHOLD_AGENT_KEEPALIVE="soon" is not a duration: use e.g. 500ms, 2s, 1m'));
    expect(() => loadConfig({}, { LEASEHOLD_AGENT_KEEPALIVE: '10ms' })).toThrow(new ConfigError('LEASEHOLD_AGENT_KEEPALIVE=10ms is below the minimum of 100 ms'));
  });
});

describe('the completion linger', () => {
  it('defaults to 20 ms, less where a short lease leaves less room; takes 0 to turn it off; refuses more than the lease allows', () => {
    expect(loadConfig({}, {}).completionLingerMs).toBe(20);
    expect(loadConfig({}, { LEASEHOLD_COMPLETION_LINGER: '0' }).completionLingerMs).toBe(0);
    expect(loadConfig({}, { LEASEHOLD_COMPLETION_LINGER: '5ms' }).completionLingerMs).toBe(5);
    expect(loadConfig({}, { LEASEHOLD_COMPLETION_LINGER: '1s' }).completionLingerMs).toBe(1000);
    // A 200 ms lease renewed every 100 ms leaves 100 ms after a renewal: a tenth of it, 10 ms.
    const short = { LEASEHOLD_LEASE_TTL: '200ms', LEASEHOLD_CLAIM_TTL: '1s', LEASEHOLD_HEARTBEAT_INTERVAL: '100ms' };
    expect(loadConfig({}, short).completionLingerMs).toBe(10);
    expect(() => loadConfig({}, { ...short, LEASEHOLD_COMPLETION_LINGER: '20ms' })).toThrow(
      new ConfigError(
        'LEASEHOLD_COMPLETION_LINGER=20ms is above the maximum of 10 ms: at most 1s, and at most a tenth of what a lease or claim (200 ms) leaves after a heartbeat interval (100 ms)',
      ),
    );
    expect(() => loadConfig({}, { LEASEHOLD_COMPLETION_LINGER: '2s' })).toThrow(/LEASEHOLD_COMPLETION_LINGER=2s is above the maximum of 1000 ms/);
    // A retention past what PurgeJobs accepts made every purger run fail.
    expect(() => loadConfig({}, { LEASEHOLD_RETENTION: '400000d' })).toThrow(
      new ConfigError('LEASEHOLD_RETENTION=400000d is above the maximum of 365250d (31557600000000 ms): a purge reaches back at most 1000 years'),
    );
    expect(loadConfig({}, { LEASEHOLD_RETENTION: '365000d' }).retentionMs).toBe(365_000 * 86_400_000);
    expect(() => loadConfig({}, { LEASEHOLD_COMPLETION_LINGER: 'briefly' })).toThrow(
      new ConfigError('LEASEHOLD_COMPLETION_LINGER="briefly" is not a duration: use e.g. 500ms, 2s, 1m'),
    );
  });
});

describe('a database migrated by a newer release', () => {
  it('is refused by default; LEASEHOLD_ALLOW_NEWER_SCHEMA=1 allows it (a deliberate rollback); a bad value is refused', () => {
    expect(loadConfig({}, {}).allowNewerSchema).toBe(false);
    expect(loadConfig({}, { LEASEHOLD_ALLOW_NEWER_SCHEMA: '0' }).allowNewerSchema).toBe(false);
    expect(loadConfig({}, { LEASEHOLD_ALLOW_NEWER_SCHEMA: '1' }).allowNewerSchema).toBe(true);
    expect(() => loadConfig({}, { LEASEHOLD_ALLOW_NEWER_SCHEMA: 'please' })).toThrow(
      new ConfigError('LEASEHOLD_ALLOW_NEWER_SCHEMA="please" must be 1 or 0 (true or false)'),
    );
  });
});
