#!/usr/bin/env node
// The `leasehold-agent` command: runs src/runner/cli.ts through the tsx loader.
import { register } from 'tsx/esm/api';

register();
await import('../src/runner/cli.ts');
