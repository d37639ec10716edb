"""dsh-sqlite-query: one read-only ``sql_query`` tool over a configured SQLite database file.

Safety does not rest on parsing SQL. The database is opened read-only
(``mode=ro`` URI), ``PRAGMA query_only`` is set, and an authorizer allows only
reading (``SELECT``, reading columns, functions, recursive CTEs), so writes,
``ATTACH``, ``PRAGMA``, transactions and the pointer-handling ``fts3_tokenizer``
fail inside SQLite itself. Values are
always bound parameters (``?`` or ``:name``), never formatted into the SQL.
"""

from __future__ import annotations

import asyncio
import base64
import math
import os
import sqlite3
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

from dsh_core import AbortedError, Scope, ToolContext, ToolError, define_tool, hookimpl, plugin

__all__ = ["plugin", "SqliteQuery"]

CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["database"],
    "properties": {
        "database": {"type": "string", "minLength": 1, "description": "path of the SQLite database file"},
        "max_rows": {"type": "integer", "minimum": 1, "default": 200, "description": "rows returned at most"},
        "max_bytes": {"type": "integer", "minimum": 1024, "default": 1 << 20,
                      "description": "bytes of row data returned at most (text as UTF-8, BLOBs as base64)"},
        "timeout_s": {"type": "number", "exclusiveMinimum": 0, "default": 10,
                      "description": "a query running (or waiting for a writer's lock) longer is interrupted"},
    },
}

_SCALAR = {"type": ["string", "number", "integer", "boolean", "null"]}

# Everything else (writes, ATTACH, PRAGMA, transactions, DDL) is refused by SQLite.
_ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                              sqlite3.SQLITE_RECURSIVE})

# Functions that reach past the data: fts3_tokenizer returns a raw C pointer (and with two arguments
# installs one as a tokenizer's code); load_extension loads native code.
_DENIED_FUNCTIONS = frozenset({"fts3_tokenizer", "load_extension"})

# PRAGMAs that only describe the schema, allowed as table-valued functions in a SELECT
# (``SELECT * FROM pragma_table_info('t')``): SQLite runs the PRAGMA itself while the SELECT
# runs, which the authorizer sees as SQLITE_PRAGMA with the pragma's name. Not database_list
# (the host's file paths), nor any PRAGMA that sets something.
_SCHEMA_PRAGMAS = frozenset({"table_info", "table_xinfo", "index_list", "index_info", "index_xinfo",
                             "foreign_key_list"})


def _authorizer() -> Callable[..., int]:
    """The authorizer of one connection, which runs one statement.

    A table-valued function such as ``json_each`` or ``json_tree`` is an eponymous virtual
    table: the first time a connection uses one, SQLite sets it up through what the
    authorizer sees as ``SQLITE_UPDATE`` of ``sqlite_master`` columns, in the middle of
    compiling the SELECT. Only that is let through: in a statement whose first action is not
    SQLITE_SELECT, an update of ``sqlite_master`` is refused like any other write (SQLite
    itself refuses ``UPDATE sqlite_master`` before asking, and the connection is read-only
    and ``query_only`` besides). The schema-describing PRAGMAs of :data:`_SCHEMA_PRAGMAS` are let
    through the same way: as ``pragma_table_info(...)`` inside a SELECT, not as PRAGMA statements.
    """
    first_action: int | None = None

    def authorize(action: int, arg1: object, arg2: object, *_: object) -> int:
        nonlocal first_action
        if first_action is None:
            first_action = action
        if action == sqlite3.SQLITE_FUNCTION and isinstance(arg2, str) and arg2.lower() in _DENIED_FUNCTIONS:
            return sqlite3.SQLITE_DENY
        if action == sqlite3.SQLITE_UPDATE and arg1 == "sqlite_master" and first_action == sqlite3.SQLITE_SELECT:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA and arg1 in _SCHEMA_PRAGMAS and first_action == sqlite3.SQLITE_SELECT:
            return sqlite3.SQLITE_OK
        return sqlite3.SQLITE_OK if action in _ALLOWED_ACTIONS else sqlite3.SQLITE_DENY

    return authorize


def _value_size(value: object) -> int:
    """About the bytes a value takes in the result: UTF-8 text, base64 BLOBs, a number's digits."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, bytes):
        return (len(value) + 2) // 3 * 4
    return 8


def _json_value(value: object) -> object:
    if isinstance(value, bytes):
        return {"blob_base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value + 0.0  # -0.0 becomes 0.0: JSON cannot tell them apart
    return value


class SqliteQuery:
    """The plugin instance: the database path, limits and the ``sql_query`` tool."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.database = os.path.abspath(config["database"])
        self.max_rows: int = config.get("max_rows", 200)
        self.max_bytes: int = config.get("max_bytes", 1 << 20)
        self.timeout_s: float = config.get("timeout_s", 10)

    @hookimpl
    def dsh_register_tools(self, register: Any) -> None:
        """Register ``sql_query``."""
        register(define_tool(
            name="sql_query",
            description=(f"Run one read-only SQL query (SQLite dialect) against {os.path.basename(self.database)} "
                         "and get rows as JSON. Pass values as params (a list for ?, an object for :name) — "
                         f"never inside the SQL text. At most {self.max_rows} rows (and about "
                         f"{self.max_bytes // 1024} KiB) are returned. List tables "
                         "with: SELECT name, sql FROM sqlite_schema."),
            parameters={
                "type": "object",
                "properties": {
                    "sql": {"type": "string", "description": "one SELECT (or WITH ... SELECT) statement"},
                    "params": {"oneOf": [{"type": "array", "items": _SCALAR},
                                         {"type": "object", "additionalProperties": _SCALAR}],
                               "description": "values bound to ? (list) or :name (object) placeholders"},
                },
                "required": ["sql"],
                "additionalProperties": False,
            },
            output_schema={
                "type": "object",
                "properties": {
                    "columns": {"type": "array", "items": {"type": "string"}},
                    "rows": {"type": "array", "items": {"type": "array"}},
                    "row_count": {"type": "integer"},
                    "truncated": {"type": "boolean"},
                },
                "required": ["columns", "rows", "row_count", "truncated"],
            },
            execute=self.query,
            render=_render,
            is_concurrency_safe=True,
            examples=[{"sql": "SELECT name, type FROM sqlite_schema ORDER BY name"},
                      {"sql": "SELECT ? + ? AS total", "params": [1, 2]},
                      {"sql": "SELECT upper(:word) AS shout", "params": {"word": "hello"}}],
            annotations={"read_only": True},
        ))

    def _connect(self) -> sqlite3.Connection:
        if not os.path.isfile(self.database):
            raise ToolError(f"the database file {self.database} does not exist; check the plugin's database config")
        uri = "file:" + urllib.parse.quote(self.database) + "?mode=ro"
        try:
            # check_same_thread=False: the query runs in a worker thread, interrupt() comes from the loop.
            # timeout: how long to wait for a writer's lock; interrupt() does not end that wait, so
            # sqlite3's default of 5 s would outlast a shorter timeout_s.
            connection = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None,
                                         timeout=self.timeout_s)
        except sqlite3.Error as error:
            raise ToolError(f"cannot open the database {self.database}: {error}") from None
        connection.text_factory = lambda data: data.decode("utf-8", errors="replace")
        connection.execute("PRAGMA query_only = ON")
        # No single value larger than the whole result may be: SQLite refuses to build it
        # ("string or blob too big"), so zeroblob(10**9) never reaches this process's memory.
        connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, self.max_bytes)
        connection.set_authorizer(_authorizer())
        return connection

    def _run(self, connection: sqlite3.Connection, sql: str, params: Any, stop: threading.Event) -> dict[str, Any]:
        if stop.is_set():  # aborted (or timed out) before this thread got to run
            raise sqlite3.OperationalError("interrupted")
        cursor = connection.execute(sql, params)
        columns = [d[0] for d in cursor.description or ()]
        rows: list[list[object]] = []
        used = 0
        truncated = False
        while cursor.description and not truncated:
            row = cursor.fetchone()
            if row is None:
                break
            size = sum(map(_value_size, row))
            if len(rows) == self.max_rows or (rows and used + size > self.max_bytes):
                truncated = True
            elif size > self.max_bytes:
                raise ToolError(f"the first row alone is about {size} bytes, more than the {self.max_bytes}-byte "
                                "limit; select fewer or shorter columns (substr(), length())")
            else:
                rows.append([_json_value(v) for v in row])
                used += size
        return {"columns": columns, "rows": rows, "row_count": len(rows), "truncated": truncated}

    async def query(self, args: Any, ctx: ToolContext) -> Any:
        """Body of ``sql_query``: run in a worker thread, interrupted on abort or timeout."""
        params = args.get("params", [])
        params = dict(params) if isinstance(params, dict) else list(params)
        if ctx.signal.aborted:
            raise AbortedError(ctx.signal.reason)
        connection = self._connect()
        loop = asyncio.get_running_loop()
        timed_out = False
        # Set on abort, timeout and cancellation: interrupt() is a no-op while no statement runs
        # yet, so the worker checks ``stop`` before executing and the progress handler stops a
        # statement that starts after the interrupt().
        stop = threading.Event()

        def interrupt() -> None:
            stop.set()
            connection.interrupt()

        def on_timeout() -> None:
            nonlocal timed_out
            timed_out = True
            interrupt()

        connection.set_progress_handler(stop.is_set, 1000)
        timer = loop.call_later(self.timeout_s, on_timeout)
        remove = ctx.signal.add_listener(lambda _reason: interrupt())
        worker = asyncio.ensure_future(asyncio.to_thread(self._run, connection, args["sql"], params, stop))
        try:
            return await asyncio.shield(worker)
        except (sqlite3.Error, ValueError, OverflowError) as error:
            # OperationalError (syntax, interrupted), DatabaseError (not authorized), ProgrammingError
            # (two statements, wrong number of bindings), ValueError (a NUL in the SQL)...
            if ctx.signal.aborted:
                raise AbortedError(ctx.signal.reason) from None
            text = str(error)
            if "database is locked" in text:  # the busy timeout (timeout_s) ran out, maybe with the timer
                raise ToolError(f"the database is locked by another writer; it stayed locked for "
                                f"{self.timeout_s:g} s, try again later") from None
            if timed_out:
                raise ToolError(f"the query ran longer than {self.timeout_s:g} s and was interrupted; "
                                "add a LIMIT or a narrower WHERE") from None
            if "string or blob too big" in text:
                raise ToolError(f"a value in the result is larger than the {self.max_bytes}-byte limit; select "
                                "part of it (substr(), length())") from None
            # "authorization denied": statements SQLite authorizes as a whole (VACUUM INTO a new file).
            if "not authorized" in text or "authorization denied" in text or "readonly" in text \
                    or "query_only" in text:
                raise ToolError(f"only read-only queries are allowed (SELECT or WITH ... SELECT): {text}") from None
            raise ToolError(f"SQL error: {text}") from None
        finally:
            timer.cancel()
            remove()
            if not worker.done():
                # Cancelled while the worker thread steps the statement: stop it, and wait for the
                # thread to leave SQLite before closing the connection under it.
                interrupt()
                while not worker.done():
                    try:
                        await asyncio.wait({worker})
                    except asyncio.CancelledError:
                        connection.interrupt()  # cancelled again: keep waiting, closing now is unsafe
                if not worker.cancelled():
                    worker.exception()  # retrieved: the interruption is expected
            connection.close()


def _render(_args: Any, value: Any) -> str:
    if not value["columns"]:
        return "(the statement returned no columns)"
    lines = ["\t".join(value["columns"])]
    lines += ["\t".join("NULL" if v is None else str(v) for v in row) for row in value["rows"]]
    footer = f"({value['row_count']} row{'' if value['row_count'] == 1 else 's'}"
    footer += ", truncated: add a LIMIT or narrow the query)" if value["truncated"] else ")"
    return "\n".join([*lines, footer])


@plugin(config_schema=CONFIG_SCHEMA)
def sqlite_query_plugin(scope: Scope, config: Any) -> SqliteQuery:
    """Entry point ``sqlite-query``: the ``sql_query`` tool over ``config["database"]``."""
    return SqliteQuery(dict(config))


plugin = sqlite_query_plugin
