/**
 * A named statement's execution as node-postgres' client runs a query object of its own (a
 * "submittable", as pg-cursor is), without what its `Query` does on every execution that the
 * store does not need.
 *
 * node-postgres (pinned at 8.23.1) runs a named statement as Bind, Describe (portal), Execute,
 * Sync. PostgreSQL answers the Describe with the row's description, and node-postgres rebuilds the
 * row's parsers and its empty row from it, on every execution; its `Query` also copies its config
 * property by property and is an event emitter that emits each row. For a statement returning the
 * 30 columns of a job, taken one at a time, that was about a fifth of the store's client-side CPU
 * (docs/performance.md, "The row's description, once a connection").
 *
 * Here the first execution of a statement on a connection is sent as node-postgres sends it, and
 * the description it gets back is kept for that connection with the parsers built from it (by the
 * client's type parsers, as node-postgres builds them). The next ones send Bind, Execute, Sync and
 * read their rows with what was kept. A row's shape cannot change under a prepared statement
 * unnoticed: PostgreSQL refuses to execute a prepared statement whose result would change
 * (SQLSTATE 0A000, "cached plan must not change result type"), and any error of an execution
 * drops what its connection kept for the statement, so the next one describes it again.
 */
import pg from 'pg';

interface PgField {
  name: string;
  dataTypeID: number;
  format: string;
}

type Parser = (value: string) => unknown;

/** What one statement's rows look like on one connection. */
interface Shape {
  names: string[];
  parsers: Parser[];
  /** A row of nulls with every column, copied for each row (an object V8 keeps in fast mode). */
  empty: Record<string, null>;
}

/** The part of node-postgres' `Connection` this module calls (pg/lib/connection.js). */
interface PgConnection {
  parsedStatements: Record<string, string>;
  submittedNamedStatements: Record<string, string>;
  stream: { cork?: () => void; uncork?: () => void };
  parse(config: { text: string; name: string }): void;
  bind(config: object): void;
  describe(config: { type: 'P'; name: string }): void;
  execute(config: { portal: string }): void;
  sync(): void;
  sendCopyFail(message: string): void;
}

const { prepareValue } = (pg as unknown as { utils: { prepareValue: (v: unknown) => unknown } }).utils;

/**
 * What a call gives its callback: its rows, and the command and row count of PostgreSQL's
 * CommandComplete, as in node-postgres' `Result` (code that watches a pool's queries reads them).
 */
export interface ShapedResult<R> {
  command: string | null;
  rowCount: number | null;
  rows: R[];
}

/** Per connection: each statement's shape, by statement name. */
const shapes = new WeakMap<PgConnection, Map<string, Shape>>();

/**
 * One execution of a named statement, in the interface node-postgres' client drives (the
 * `handle*` methods, `submit`, `name`, `text`, `callback`; pg/lib/client.js).
 */
class ShapedQuery<R> {
  /** Set by the client (or by `queryShaped`): called once, with the result or the error. */
  callback: ((err: Error | null, res?: ShapedResult<R>) => void) | undefined;
  /** The client's type parsers: the client sets `_result._types` on a query that has `_result`. */
  readonly _result: { _types?: { getTypeParser(oid: number, format: string): Parser } } = {};
  binary: boolean | undefined;
  private readonly result: ShapedResult<R> = { command: null, rowCount: null, rows: [] };
  private shape: Shape | undefined;
  private connection: PgConnection | undefined;
  private failed: Error | undefined;
  private done = false;

  constructor(
    readonly name: string,
    readonly text: string,
    private readonly values: unknown[],
  ) {}

  submit(connection: PgConnection): Error | null {
    // node-postgres' own check: one name on a connection is one statement (the client fails the
    // call with this error, and goes on with the next).
    const previous = connection.parsedStatements[this.name] ?? connection.submittedNamedStatements[this.name];
    if (previous !== undefined && previous !== this.text) {
      return new Error(`Prepared statements must be unique - '${this.name}' was used for a different statement`);
    }
    this.connection = connection;
    const parsed = connection.parsedStatements[this.name] === this.text;
    this.shape = parsed ? shapes.get(connection)?.get(this.name) : undefined;
    connection.stream.cork?.();
    try {
      if (!parsed && connection.submittedNamedStatements[this.name] === undefined) {
        connection.parse({ text: this.text, name: this.name });
        connection.submittedNamedStatements[this.name] = this.text;
      }
      try {
        connection.bind({ portal: '', statement: this.name, values: this.values, binary: this.binary, valueMapper: prepareValue });
      } catch (err) {
        // A value that cannot be sent: nothing of this execution went out but a Parse, which may
        // stand (the statement is the same for every execution).
        connection.sync();
        this.handleError(err as Error);
        return null;
      }
      if (!this.shape) connection.describe({ type: 'P', name: '' });
      connection.execute({ portal: '' });
      connection.sync();
    } finally {
      connection.stream.uncork?.();
    }
    return null;
  }

  handleRowDescription(msg: { fields: PgField[] }): void {
    const types = this._result._types ?? pg.types;
    const names = msg.fields.map((f) => f.name);
    this.shape = {
      names,
      parsers: msg.fields.map((f) => types.getTypeParser(f.dataTypeID, (f.format || 'text') as 'text') as Parser),
      empty: Object.fromEntries(names.map((n) => [n, null])),
    };
    if (!this.connection) return;
    let kept = shapes.get(this.connection);
    if (!kept) shapes.set(this.connection, (kept = new Map()));
    kept.set(this.name, this.shape);
  }

  handleDataRow(msg: { fields: Array<string | null> }): void {
    if (this.failed) return;
    const { names, parsers, empty } = this.shape!;
    const row: Record<string, unknown> = { ...empty };
    const values = msg.fields;
    try {
      // Every column assigned in order, nulls too: of two columns of one name the last one
      // stands, as in node-postgres' rows.
      for (let i = 0; i < values.length; i++) {
        const v = values[i];
        row[names[i]!] = v === null || v === undefined ? null : parsers[i]!(v);
      }
    } catch (err) {
      // A value its parser refuses: the call fails when PostgreSQL is done answering it.
      this.failed = err as Error;
      return;
    }
    this.result.rows.push(row as R);
  }

  handleCommandComplete(msg: { text: string }): void {
    // As node-postgres reads it: "INSERT 0 3", "UPDATE 3", "SELECT 3".
    const m = /^([A-Za-z]+)(?: (\d+))?(?: (\d+))?/.exec(msg.text);
    if (!m) return;
    this.result.command = m[1]!;
    const n = m[3] ?? m[2];
    if (n !== undefined) this.result.rowCount = Number(n);
  }

  handleEmptyQuery(): void {}

  handlePortalSuspended(): void {}

  handleCopyInResponse(connection: PgConnection): void {
    connection.sendCopyFail('No source stream defined');
  }

  handleCopyData(): void {}

  handleError(err: Error): void {
    if (this.connection) shapes.get(this.connection)?.delete(this.name);
    // The client drops a query at PostgreSQL's error: no ReadyForQuery comes to it after.
    this.failed = err;
    this.finish();
  }

  handleReadyForQuery(): void {
    this.finish();
  }

  private finish(): void {
    if (this.done) return;
    this.done = true;
    if (this.failed) this.callback?.(this.failed);
    else this.callback?.(null, this.result);
  }
}

/** Runs the named statement `name` (`text`) on `db` and returns its rows. */
export function queryShaped<R>(db: pg.Pool | pg.PoolClient | pg.Client, name: string, text: string, values: unknown[]): Promise<R[]> {
  const q = new ShapedQuery<R>(name, text, values);
  // A pool checks a client out and gives the query its own callback; a client given a query
  // object returns it, so the promise is made here.
  if (db instanceof pg.Pool) return (db.query(q as never) as unknown as Promise<ShapedResult<R>>).then((r) => r.rows);
  return new Promise<R[]>((resolve, reject) => {
    q.callback = (err, res) => (err ? reject(err) : resolve(res!.rows));
    db.query(q as never);
  });
}
