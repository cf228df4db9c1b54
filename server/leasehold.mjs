#!/usr/bin/env node
// The `leasehold` command (package bin): runs server/cli.ts through the tsx loader.
import { register } from 'tsx/esm/api';

register();
await import('./cli.ts');
