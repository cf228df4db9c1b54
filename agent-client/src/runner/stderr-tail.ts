/**
 * The end of a command's stderr, made fit for a failure report: the coordinator keeps an error
 * of at most 16 KiB of JSON and refuses the NUL character and lone surrogates in it, while a
 * command's stderr may be anything (CJK text at 3 bytes a character, colours, a Windows tool
 * writing UTF-16LE: a NUL every other byte). So the tail is decoded (UTF-16LE when the bytes say
 * so, else UTF-8), cleaned (ANSI escapes stripped, other control characters replaced) and cut by
 * bytes, both as UTF-8 and as escaped in JSON.
 */

/** The tail's size: at most this many bytes of UTF-8, and twice that once escaped in JSON. */
export const STDERR_TAIL_BYTES = 4096;

/**
 * ANSI escape sequences: CSI (colours, cursor moves: `ESC [ … m`), OSC (a terminal title:
 * `ESC ] … BEL` or `ESC ] … ESC \`) and the two-character ones (`ESC c`, `ESC 7`…).
 */
const ANSI = /\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_0-9=>c])/g;
/** Control characters other than tab and newline (NUL, a lone ESC, BEL, backspace…) and DEL. */
const CONTROL = /[\x00-\x08\x0b-\x1f\x7f]/g;

/**
 * The last bytes of a byte stream, read as text when asked: at most `maxBytes` of UTF-8 (and
 * `2 × maxBytes` escaped in JSON, which the cleaning bounds already: what is left escapes to at
 * most two bytes a byte), ANSI escapes stripped, `\r\n` and a lone `\r` made `\n`, other control
 * characters and lone surrogates replaced with U+FFFD. The bytes are decoded only when read, so
 * a character split between two writes stays whole. Sixteen times `maxBytes` of the stream's
 * end are kept, so colours and UTF-16 leave enough text.
 */
export class TextTail {
  private chunks: Buffer[] = [];
  private held = 0;
  private total = 0;
  /** The stream's first two bytes, for a UTF-16LE byte order mark (FF FE). */
  private head = Buffer.alloc(0);

  constructor(private readonly maxBytes = STDERR_TAIL_BYTES) {}

  private get window(): number {
    return this.maxBytes * 16;
  }

  write(chunk: Buffer): void {
    if (!chunk.length) return;
    if (this.head.length < 2) this.head = Buffer.concat([this.head, chunk.subarray(0, 2 - this.head.length)]);
    this.chunks.push(chunk);
    this.held += chunk.length;
    this.total += chunk.length;
    while (this.held - this.chunks[0]!.length >= this.window) this.held -= this.chunks.shift()!.length;
  }

  /** The stream ended: nothing is held back (the bytes are decoded when `text` is read). */
  end(): void {}

  /** The tail as text, cleaned and cut (see the class). */
  get text(): string {
    const all = Buffer.concat(this.chunks, this.held);
    const raw = all.subarray(Math.max(0, all.length - this.window));
    const bom = this.head[0] === 0xff && this.head[1] === 0xfe;
    return lastBytes(cleanText(decodeStderr(raw, this.total - raw.length, bom)), this.maxBytes);
  }
}

/**
 * Whether bytes are UTF-16LE text without a byte order mark, as Windows tools write it to a pipe
 * (`wsl.exe`, some .NET and SQL Server tools): a NUL at a quarter or more of the odd offsets (the
 * high byte of ASCII and Latin characters) and few at even ones. `bytes` starts at an even offset
 * of the stream.
 */
export function looksLikeUtf16le(bytes: Buffer): boolean {
  let odd = 0;
  let even = 0;
  const pairs = bytes.length >> 1;
  for (let i = 0; i < pairs * 2; i += 2) {
    if (bytes[i] === 0) even++;
    if (bytes[i + 1] === 0) odd++;
  }
  return pairs > 0 && odd * 4 >= pairs && even * 8 <= odd;
}

/**
 * Decodes the end of a stream that starts `offset` bytes into it: as UTF-16LE after a byte order
 * mark or when `looksLikeUtf16le`, else as UTF-8 (invalid bytes become U+FFFD). A character cut
 * off at the start is dropped.
 */
export function decodeStderr(raw: Buffer, offset: number, bom: boolean): string {
  const aligned = offset % 2 ? raw.subarray(1) : raw;
  if ((bom && offset === 0) || looksLikeUtf16le(aligned)) {
    const text = aligned.subarray(bom && offset === 0 ? 2 : 0);
    return text.subarray(0, text.length & ~1).toString('utf16le');
  }
  let from = 0;
  if (offset > 0) while (from < 3 && from < raw.length && (raw[from]! & 0xc0) === 0x80) from++; // the rest of a cut character
  return raw.subarray(from).toString('utf8');
}

/** Text a report can carry: no ANSI escapes, `\n` line ends, no control characters but tab and newline, well-formed. */
export function cleanText(s: string): string {
  return s.toWellFormed().replace(ANSI, '').replace(/\r\n?/g, '\n').replace(CONTROL, '\uFFFD');
}

/**
 * The longest end of `s` within `maxBytes` of UTF-8 and `2 × maxBytes` escaped in JSON, never
 * splitting a surrogate pair.
 */
export function lastBytes(s: string, maxBytes: number): string {
  const maxJson = 2 * maxBytes;
  let bytes = 0;
  let json = 0;
  let i = s.length;
  while (i > 0) {
    let j = i - 1;
    const low = s.charCodeAt(j);
    if (low >= 0xdc00 && low <= 0xdfff && j > 0) {
      const high = s.charCodeAt(j - 1);
      if (high >= 0xd800 && high <= 0xdbff) j--;
    }
    const cp = s.codePointAt(j)!;
    const b = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
    const e = cp === 0x22 || cp === 0x5c || cp === 0x0a || cp === 0x09 || cp === 0x0d || cp === 0x08 || cp === 0x0c ? 2 : cp < 0x20 || (cp >= 0xd800 && cp <= 0xdfff) ? 6 : b;
    if (bytes + b > maxBytes || json + e > maxJson) break;
    bytes += b;
    json += e;
    i = j;
  }
  return s.slice(i);
}
