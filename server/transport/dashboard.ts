/**
 * The dashboard's files: plain HTML, JavaScript and CSS from `server/transport/dashboard/`,
 * served by the HTTP listener at `/` and `/dashboard/*` with no build step and nothing from a
 * CDN. The page holds no secret: the operator types the admin key into it, and the page sends it
 * as the bearer key of its AdminService calls (same origin, Connect JSON). A strict
 * Content-Security-Policy allows only this origin's scripts, styles and calls.
 */
import { readFile } from 'node:fs/promises';
import type http from 'node:http';

const DIR = new URL('./dashboard/', import.meta.url);

/** Path → file and content type. Nothing else is served. */
const ASSETS: Record<string, { file: string; type: string }> = {
  '/': { file: 'index.html', type: 'text/html; charset=utf-8' },
  '/dashboard/app.js': { file: 'app.js', type: 'text/javascript; charset=utf-8' },
  '/dashboard/timeline.js': { file: 'timeline.js', type: 'text/javascript; charset=utf-8' },
  '/dashboard/style.css': { file: 'style.css', type: 'text/css; charset=utf-8' },
  '/favicon.ico': { file: 'favicon.svg', type: 'image/svg+xml' },
};

const HEADERS = {
  'content-security-policy':
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'",
  'x-content-type-options': 'nosniff',
  'referrer-policy': 'no-referrer',
  'cache-control': 'no-cache',
};

const cache = new Map<string, Buffer>();

/** Whether `path` is one of the dashboard's files. */
export const isDashboardPath = (path: string): boolean => Object.hasOwn(ASSETS, path);

/** Answers a GET (or HEAD) for one of the dashboard's files. */
export async function serveDashboard(path: string, req: http.IncomingMessage, res: http.ServerResponse): Promise<void> {
  const asset = ASSETS[path]!;
  if (req.method !== 'GET' && req.method !== 'HEAD') {
    res.writeHead(405, { allow: 'GET', 'content-type': 'text/plain' }).end('use GET');
    return;
  }
  let body = cache.get(asset.file);
  if (!body) {
    body = await readFile(new URL(asset.file, DIR));
    cache.set(asset.file, body);
  }
  res.writeHead(200, { ...HEADERS, 'content-type': asset.type, 'content-length': body.length });
  res.end(req.method === 'HEAD' ? undefined : body);
}
