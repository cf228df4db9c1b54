#!/usr/bin/env node
/**
 * `npm run build:agent [-- OUTFILE]`: `leasehold-agent` as one JavaScript file (default
 * dist/leasehold-agent.mjs at the repository's root) with every dependency inside, for a PC
 * that has Node.js and nothing else: `node leasehold-agent.mjs --config agent.json`.
 */
import { mkdirSync } from 'node:fs';
import path from 'node:path';
import { build } from 'esbuild';

const here = path.dirname(new URL(import.meta.url).pathname);
const outfile = path.resolve(process.argv[2] ?? path.join(here, '..', 'dist', 'leasehold-agent.mjs'));
const { version } = (await import('./package.json', { with: { type: 'json' } })).default;
mkdirSync(path.dirname(outfile), { recursive: true });
await build({
  entryPoints: [path.join(here, 'src/runner/cli.ts')],
  bundle: true,
  platform: 'node',
  format: 'esm',
  target: 'node20',
  outfile,
  // CommonJS dependencies (grpc-js, pino) call require(): give the ES module one.
  banner: {
    js: [
      '#!/usr/bin/env node',
      `// leasehold-agent ${version}, bundled: run with \`node leasehold-agent.mjs --config agent.json\` (docs/agent.md).`,
      "import { createRequire as __lhRequire } from 'node:module'; const require = __lhRequire(import.meta.url);",
    ].join('\n'),
  },
  legalComments: 'eof',
  logLevel: 'warning',
});
console.log(outfile);
