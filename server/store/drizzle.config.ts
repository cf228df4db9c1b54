import { defineConfig } from 'drizzle-kit';

/** drizzle-kit's view of the schema: `npm run db:generate` writes a new migration after a schema change. */
export default defineConfig({
  dialect: 'postgresql',
  schema: './server/store/schema.ts',
  out: './server/store/migrations',
});
