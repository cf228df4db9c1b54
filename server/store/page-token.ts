/**
 * Pages of the lists (jobs, stale reports): the page size every list takes, and the tokens that
 * carry where the next page starts. A token is base64url of a text the list wrote; each list has
 * its own text (a job list's `<created µs>.<job id>`, the stale reports' `s<id>`), and reads back
 * only what it writes. One codec encodes and decodes them all, and one function cuts a page and
 * its next token from the rows read (a page's rows plus one, which says whether more follow).
 */
import { z } from 'zod';
import { invalid, type Failure } from '../domain/outcomes.js';

/** How many rows a page holds, when the caller says: 1 to 500. */
export const pageSizeSchema = z.int().min(1).max(500);

/** How many rows a page holds when the caller does not say. */
export const DEFAULT_PAGE_SIZE = 50;

/** A list's position after a page, as the text inside its tokens. */
export interface PageTokenFormat<P> {
  write(position: P): string;
  /** The position a text names, or undefined for a text this list does not write. */
  read(text: string): P | undefined;
}

/** The token of `position`. */
export const pageTokenEncode = <P>(format: PageTokenFormat<P>, position: P): string => Buffer.from(format.write(position)).toString('base64url');

/**
 * Where the page a request asks for starts: `after` undefined without a token (the first page),
 * `invalid` for a token this server did not issue.
 */
export function pageTokenDecode<P>(format: PageTokenFormat<P>, token: string | undefined): { after: P | undefined } | { failure: Failure } {
  if (!token) return { after: undefined };
  const after = format.read(Buffer.from(token, 'base64url').toString('utf8'));
  return after === undefined ? { failure: invalid('pageToken', 'is not a token this server issued') } : { after };
}

/**
 * The page of `rows` (read as `size` + 1, newest first) and the next page's token: the position
 * after its last row when more rows follow, empty at the end.
 */
export function pageOf<R, P>(format: PageTokenFormat<P>, rows: R[], size: number, positionOf: (last: R) => P): { page: R[]; nextPageToken: string } {
  const page = rows.slice(0, size);
  const last = page.at(-1);
  return { page, nextPageToken: rows.length > size && last !== undefined ? pageTokenEncode(format, positionOf(last)) : '' };
}
