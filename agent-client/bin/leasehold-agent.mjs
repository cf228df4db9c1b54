#!/usr/bin/env node
// The `leasehold-agent` command. Installed from the package, it runs the compiled runner (dist/,
// built by `npm pack` through prepack). In a checkout of the Leasehold repository, where src/ is
// present (the package does not ship it), it runs the source through the repository's tsx, so
// that nothing needs building first.
import { existsSync } from 'node:fs';

const source = new URL('../src/runner/cli.ts', import.meta.url);
if (existsSync(source)) {
  const { register } = await import('tsx/esm/api');
  register();
  await import(source.href);
} else {
  await import('../dist/runner/cli.js');
}
