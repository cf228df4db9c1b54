import { defineConfig } from 'vitest/config';

export default defineConfig({
  // The agent package's source, as the root tsconfig's `paths` says (an installed package
  // resolves to its compiled dist/; test/agent-package.test.ts tests that one).
  resolve: { alias: { '@leasehold/agent-client': new URL('../agent-client/src/index.ts', import.meta.url).pathname } },
  test: {
    root: new URL('..', import.meta.url).pathname,
    include: ['test/**/*.test.ts'],
    globalSetup: ['test/helpers/global-setup.ts'],
    // These machines have 2 cores; each test file has its own database.
    pool: 'forks',
    maxWorkers: 2,
    testTimeout: 60_000,
    hookTimeout: 120_000,
    reporters: ['default'],
  },
});
