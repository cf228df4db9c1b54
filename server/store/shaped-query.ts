/**
 * A named statement's execution without the Describe that node-postgres sends with every one.
 *
 * node-postgres (pinned at 8.23.1, whose `Query` and `Result` this subclasses) runs a named
 * statement as Bind, Describe (portal), Execute, Sync. PostgreSQL answers the Describe with the
 * row's description, and node-postgres rebuilds the row's parsers and its empty row from it, on
 * every execution: for a statement returning the 30 columns of a job, a fifth of the client
 * side's CPU for a job taken one at a time (docs/performance.md, "The row's description, once a
 * connection").
 *
 * The first execution of a statement on a connection goes as node-postgres sends it, and keeps
 * the description it gets back, with the parsers built from it, for that connection. The next
 * ones send Bind, Execute, Sync and read their rows with what was kept. A row's shape cannot
 * change under a prepared statement unnoticed: PostgreSQL refuses to execute a prepared statement
 * whose result would change (SQLSTATE 0A000, "cached plan must not change result type"), and any
 * error of an execution drops what its connection kept for the statement, so the next one
 * describes again.
 */
import pg from 'pg';

interface PgField {
  name: string;
  dataTypeID: number;
  format: string;
}

/** What one statement's rows look like on one connection. */
interface Shape {
  fields: PgField[];
  parsers: unknown[];
  empty: object;
}

/** The part of node-postgres' `Connection` this module calls (pg/lib/connection.js). */
interface PgConnection {
  parsedStatements: Record<string, string>;
  bind(config: object): void;
  sync(): void;
}

/** The part of node-postgres' `Query` this module extends (pg/lib/query.js). */
interface PgQuery {
  name: string;
  text: string;
  values: unknown[];
  portal: string;
  binary: boolean | undefined;
  callback: ((err: Error | null, res?: { rows: unknown[] }) => void) | undefined;
  _result: { fields: PgField[]; _parsers: unknown[] | undefined; _prebuiltEmptyResultObject: object | null };
  _accumulateRows: boolean;
  prepare(connection: PgConnection): void;
  handleRowDescription(msg: { fields: PgField[] }): void;
  handleError(err: Error, connection: PgConnection): void;
  _getRows(connection: PgConnection, rows: number | undefined): void;
}

const Query = (pg as unknown as { Query: new (config: { name: string; text: string; values: unknown[] }) => PgQuery }).Query;
const { prepareValue } = (pg as unknown as { utils: { prepareValue: (v: unknown) => unknown } }).utils;

/** Per connection: each statement's shape, by statement name. */
const shapes = new WeakMap<PgConnection, Map<string, Shape>>();

class ShapedQuery extends Query {
  /** The connection it was sent on, once sent. */
  private connection: PgConnection | undefined;

  override prepare(connection: PgConnection): void {
    this.connection = connection;
    // Known only once PostgreSQL has parsed the statement on this connection and described it.
    const shape = connection.parsedStatements[this.name] === this.text ? shapes.get(connection)?.get(this.name) : undefined;
    if (!shape) return super.prepare(connection);
    try {
      connection.bind({ portal: this.portal, statement: this.name, values: this.values, binary: this.binary, valueMapper: prepareValue });
    } catch (err) {
      // A value that cannot be sent (node-postgres' own handling of this, without its Close: the
      // statement stays prepared).
      connection.sync();
      this.handleError(err as Error, connection);
      return;
    }
    this._result.fields = shape.fields;
    this._result._parsers = shape.parsers;
    this._result._prebuiltEmptyResultObject = shape.empty;
    this._accumulateRows = true;
    this._getRows(connection, undefined);
  }

  override handleRowDescription(msg: { fields: PgField[] }): void {
    super.handleRowDescription(msg);
    if (!this.connection) return;
    let kept = shapes.get(this.connection);
    if (!kept) shapes.set(this.connection, (kept = new Map()));
    const r = this._result;
    kept.set(this.name, { fields: r.fields, parsers: r._parsers ?? [], empty: r._prebuiltEmptyResultObject ?? {} });
  }

  override handleError(err: Error, connection: PgConnection): void {
    if (this.connection) shapes.get(this.connection)?.delete(this.name);
    super.handleError(err, connection);
  }
}

/** Runs the named statement `name` (`text`) on `db` and returns its rows. */
export function queryShaped<R>(db: pg.Pool | pg.PoolClient | pg.Client, name: string, text: string, values: unknown[]): Promise<R[]> {
  const q = new ShapedQuery({ name, text, values });
  // A pool checks a client out and gives the query its own callback; a client given a query
  // object returns it, so the promise is made here.
  if (db instanceof pg.Pool) return (db.query(q as never) as unknown as Promise<{ rows: R[] }>).then((r) => r.rows);
  return new Promise<R[]>((resolve, reject) => {
    q.callback = (err, res) => (err ? reject(err) : resolve((res?.rows ?? []) as R[]));
    db.query(q as never);
  });
}
