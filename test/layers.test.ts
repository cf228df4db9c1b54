/**
 * The layers' direction (README, "Layout"): the rules of `.dependency-cruiser.cjs`, which
 * `npm run lint` applies, hold on the tree, and each of them does fail on a tree that breaks it.
 */
import { mkdtempSync, mkdirSync, rmSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { cruise, type ICruiseResult, type IForbiddenRuleType } from 'dependency-cruiser';
import { afterAll, describe, expect, it } from 'vitest';

const root = path.resolve(import.meta.dirname, '..');
const config = createRequire(import.meta.url)(path.join(root, '.dependency-cruiser.cjs')) as { forbidden: IForbiddenRuleType[] };

async function violations(baseDir: string): Promise<{ summary: ICruiseResult['summary']; broken: string[] }> {
  const { output } = await cruise(['server', 'agent-client/src'], {
    baseDir,
    ruleSet: { forbidden: config.forbidden },
    validate: true,
    tsPreCompilationDeps: true,
    doNotFollow: { path: 'node_modules' },
  });
  const { summary } = output as ICruiseResult;
  return { summary, broken: summary.violations.map((v) => `${v.rule.name}: ${v.from} → ${v.to}`).sort() };
}

describe('the layers import only downward', () => {
  it('holds on the tree', async () => {
    const { summary, broken } = await violations(root);
    expect(broken).toEqual([]);
    // Not vacuous: the cruise resolved the `.js` specifiers to our `.ts` files.
    expect(summary.totalCruised).toBeGreaterThan(100);
    expect(summary.totalDependenciesCruised).toBeGreaterThan(400);
  });

  const dir = mkdtempSync(path.join(tmpdir(), 'leasehold-layers-'));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  it('fails on each upward import', async () => {
    const files: Record<string, string> = {
      'server/log.ts': 'export type Logger = unknown;\n',
      'server/config.ts': 'export const config = 1;\n',
      'server/domain/outcomes.ts': "import '../store/schema.js';\nexport const ok = 1;\n",
      'server/lib/process.ts': "import '../domain/outcomes.js';\nexport const alive = 1;\n",
      'server/store/schema.ts': "import '../core/hub.js';\nimport '../domain/outcomes.js';\nimport '../lib/process.js';\nimport type { Logger } from '../log.js';\nexport type L = Logger;\n",
      'server/core/hub.ts': "import '../transport/routes.js';\nimport '../store/schema.js';\n",
      'server/transport/routes.ts': "import '../config.js';\nimport '../core/hub.js';\n",
      'agent-client/src/agent.ts': "import '../../server/domain/outcomes.js';\nimport '../../test/helpers/x.js';\n",
      'test/helpers/x.ts': 'export const x = 1;\n',
    };
    for (const [f, text] of Object.entries(files)) {
      mkdirSync(path.dirname(path.join(dir, f)), { recursive: true });
      writeFileSync(path.join(dir, f), text);
    }
    const { broken } = await violations(dir);
    expect(broken).toEqual(
      [
        'domain-imports-nothing-of-ours: server/domain/outcomes.ts → server/store/schema.ts',
        'lib-imports-nothing-of-ours: server/lib/process.ts → server/domain/outcomes.ts',
        'store-imports-only-domain: server/store/schema.ts → server/core/hub.ts',
        'core-imports-store-and-domain: server/core/hub.ts → server/transport/routes.ts',
        'transport-imports-no-composition: server/transport/routes.ts → server/config.ts',
        'sdk-imports-no-server: agent-client/src/agent.ts → server/domain/outcomes.ts',
        'sdk-imports-no-server: agent-client/src/agent.ts → test/helpers/x.ts',
        'code-imports-no-tests: agent-client/src/agent.ts → test/helpers/x.ts',
      ].sort(),
    );
  });
});
