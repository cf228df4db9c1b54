/**
 * The direction of the server's layers (README, "Layout"), checked by `npm run lint`:
 * domain ← store ← core ← transport ← the composition at server/'s top (cli, coordinator, config…).
 * A layer imports only the layers below it; `server/log.ts` (the logger's type) is the one file of
 * the top every layer may use, and `server/lib/` (small helpers, importing nothing of ours) is
 * below them all. The agent SDK is a package of its own and never imports the server.
 */
const LOG = '^server/log\\.ts$';
const TOP = '^server/[^/]+\\.(ts|mjs)$';

module.exports = {
  forbidden: [
    {
      name: 'domain-imports-nothing-of-ours',
      comment: 'server/domain is the shared vocabulary (outcomes, validation, status lists): it imports only npm packages.',
      severity: 'error',
      from: { path: '^server/domain/' },
      to: { path: '^(server|gen|agent-client|test)/', pathNot: '^server/domain/' },
    },
    {
      name: 'lib-imports-nothing-of-ours',
      comment: 'server/lib holds small helpers every layer and the launcher may use: it imports only Node and npm packages.',
      severity: 'error',
      from: { path: '^server/lib/' },
      to: { path: '^(server|gen|agent-client|test)/', pathNot: '^server/lib/' },
    },
    {
      name: 'store-imports-only-domain',
      comment: 'The store knows the vocabulary and PostgreSQL, not the core or the transports.',
      severity: 'error',
      from: { path: '^server/store/' },
      to: { path: ['^server/(core|transport)/', TOP], pathNot: LOG },
    },
    {
      name: 'core-imports-store-and-domain',
      comment: 'The core (hub, reaper, dispatcher…) does not know how it is reached.',
      severity: 'error',
      from: { path: '^server/core/' },
      to: { path: ['^server/transport/', TOP], pathNot: LOG },
    },
    {
      name: 'transport-imports-no-composition',
      comment: 'The transports are given what they need by server/coordinator.ts; they do not reach up for it.',
      severity: 'error',
      from: { path: '^server/transport/' },
      to: { path: TOP, pathNot: LOG },
    },
    {
      name: 'sdk-imports-no-server',
      comment: 'The agent SDK ships alone (npm run build:agent): nothing of the server may end up in it.',
      severity: 'error',
      from: { path: '^agent-client/' },
      to: { path: '^(server|test)/' },
    },
    {
      name: 'code-imports-no-tests',
      severity: 'error',
      from: { path: '^(server|agent-client|gen)/' },
      to: { path: '^test/' },
    },
  ],
  options: {
    doNotFollow: { path: 'node_modules' },
    tsPreCompilationDeps: true,
    tsConfig: { fileName: 'tsconfig.json' },
  },
};
