import { fileURLToPath } from 'node:url';
import { defineConfig } from 'vitest/config';

export default defineConfig({
  // The agent package's source, as the root tsconfig's `paths` says (an installed package
  // resolves to its compiled dist/; test/agent-package.test.ts tests that one).
  resolve: { alias: { '@leasehold/agent-client': fileURLToPath(new URL('../agent-client/src/index.ts', import.meta.url)) } },
  test: {
    // fileURLToPath, not `.pathname`: on Windows the latter is `/C:/…`, which is no path there.
    root: fileURLToPath(new URL('..', import.meta.url)),
    include: ['test/**/*.test.ts'],
    globalSetup: ['test/helpers/global-setup.ts'],
    setupFiles: ['test/helpers/leak-check.ts'],
    // These machines have 2 cores; each test file has its own database.
    pool: 'forks',
    maxWorkers: 2,
    testTimeout: 60_000,
    hookTimeout: 120_000,
    reporters: ['default'],
  },
});
