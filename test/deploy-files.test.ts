/**
 * The deployment files of deploy/ and the Dockerfile, checked by the tools that judge them where
 * they can be run here: `systemd-analyze verify` for the unit, `dockerfile-utils lint` for the
 * Dockerfile (no container runtime on these machines: the image is not built), `caddy adapt` for
 * the Caddyfile. test/proxies.test.ts runs Caddy and nginx with them.
 */
import { execFile } from 'node:child_process';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';
import { missing } from './helpers/proxies.js';

const root = path.resolve(import.meta.dirname, '..');
const run = promisify(execFile);

describe('deploy/leasehold.service', () => {
  it('passes systemd-analyze verify without a warning', async (ctx) => {
    if (missing('systemd-analyze')) {
      if (process.env.LEASEHOLD_REQUIRE_DEPLOY_TOOLS === '1') throw new Error('systemd-analyze is missing (apt-get install systemd)');
      return ctx.skip('systemd-analyze is not installed');
    }
    const { stdout, stderr } = await run('systemd-analyze', ['verify', path.join(root, 'deploy/leasehold.service')]);
    // A value systemd cannot parse is only a warning on stderr (exit code 0): none may appear.
    expect(stderr.trim()).toBe('');
    expect(stdout.trim()).toBe('');
  });

  it('stops the coordinator alone with SIGTERM, gives it time, restarts it on failure', () => {
    const unit = readFileSync(path.join(root, 'deploy/leasehold.service'), 'utf8');
    const set = (k: string) => [...unit.matchAll(new RegExp(`^${k}=(.*)$`, 'gm'))].map((m) => m[1]);
    expect(set('KillSignal')).toEqual(['SIGTERM']);
    expect(set('KillMode')).toEqual(['mixed']);
    expect(Number(/^(\d+)/.exec(set('TimeoutStopSec')[0] ?? '')?.[1])).toBeGreaterThanOrEqual(30);
    expect(set('Restart')).toEqual(['on-failure']);
    expect(set('User')).toEqual(['leasehold']);
    expect(set('ExecStart')[0]).toMatch(/node --import tsx server\/cli\.ts serve$/);
  });
});

describe('Dockerfile', () => {
  it('passes dockerfile-utils lint', async () => {
    const { stdout } = await run(process.execPath, [path.join(root, 'node_modules/dockerfile-utils/bin/dockerfile-utils'), 'lint', path.join(root, 'Dockerfile')]).catch(
      (err: { stdout?: string }) => {
        throw new Error(`dockerfile-utils lint failed:\n${err.stdout ?? String(err)}`);
      },
    );
    expect(stdout.trim()).toBe('');
  });

  it('builds in two stages, installs without dev dependencies, runs node itself as a non-root user with a health check', () => {
    const text = readFileSync(path.join(root, 'Dockerfile'), 'utf8');
    const lines = text.split('\n').filter((l) => !l.startsWith('#'));
    expect(lines.filter((l) => l.startsWith('FROM ')).length).toBe(2);
    expect(text).toMatch(/^RUN npm ci --omit=dev/m);
    expect(text).toMatch(/^USER node$/m);
    expect(text).toMatch(/HEALTHCHECK[\s\S]*127\.0\.0\.1:8080\/healthz/);
    // Exec form with node as PID 1: SIGTERM reaches the coordinator (npm or a shell would stand between).
    expect(text).toMatch(/^CMD \["node", "--import", "tsx", "server\/cli\.ts", "serve"\]$/m);
    expect(text).toMatch(/^STOPSIGNAL SIGTERM$/m);
  });
});

describe('deploy/Caddyfile', () => {
  it('adapts to a valid Caddy configuration', async (ctx) => {
    if (missing('caddy')) {
      if (process.env.LEASEHOLD_REQUIRE_DEPLOY_TOOLS === '1') throw new Error('caddy is missing (apt-get install caddy)');
      return ctx.skip('caddy is not installed');
    }
    const { stdout } = await run('caddy', ['adapt', '--config', path.join(root, 'deploy/Caddyfile'), '--adapter', 'caddyfile', '--validate']);
    const config = JSON.parse(stdout) as { apps: { http: { servers: Record<string, { routes: unknown[] }> } } };
    // Two upstreams: gRPC in h2c for agents, the HTTP gateway for the rest.
    expect(JSON.stringify(config)).toContain('"h2c"');
    expect(JSON.stringify(config)).toContain('127.0.0.1:8080');
    // Its admin API on a socket, not on localhost:2019 where a webhook to a loopback URL could
    // POST /stop (docs/decisions.md, "Where webhooks may go"); compose.yaml gives the image that directory.
    expect((config as { admin?: { listen?: string } }).admin?.listen).toBe('unix//var/lib/caddy/admin.sock');
    expect(readFileSync(path.join(root, 'deploy/compose.yaml'), 'utf8')).toMatch(/^ {4}tmpfs:\n {6}- \/var\/lib\/caddy$/m);
    // No proxy in front trusted unless LEASEHOLD_OUTER_PROXIES names some: then both upstreams keep
    // what those send in X-Forwarded-For (docs/deploy.md, "Behind a CDN or a load balancer").
    expect(stdout).not.toContain('trusted_proxies');
    const env = { ...process.env, LEASEHOLD_OUTER_PROXIES: '198.51.100.0/24 2001:db8:100::/48' };
    const outer = await run('caddy', ['adapt', '--config', path.join(root, 'deploy/Caddyfile'), '--adapter', 'caddyfile', '--validate'], { env });
    expect(outer.stdout.match(/"trusted_proxies":\["198\.51\.100\.0\/24","2001:db8:100::\/48"\]/g)).toHaveLength(2);
    expect(readFileSync(path.join(root, 'deploy/compose.yaml'), 'utf8')).toContain('LEASEHOLD_OUTER_PROXIES: ${LEASEHOLD_OUTER_PROXIES:-}');
  });
});
