"""The worker of ``sql_query``, run as a child process: ``python -I -S <this file>``, standard library only.

A query runs here and not in the dsh process because nothing inside one process bounds what a
query holds in memory. SQLite's length limit bounds each string or BLOB, not how many a query
holds at once: every result column is one, and so is every argument of every function call
still being evaluated (a 4 KB ``SELECT length(max(randomblob(1e6), ..., max(randomblob(1e6),
...)))`` holds 200 MB under a 1 MiB limit), and Python's ``sqlite3`` builds a whole row before
anything can look at its size. So this process gets an address-space limit (``RLIMIT_AS``: its
size once started plus ``memory_mb``; Linux), a query that needs more fails with an error, and
the parent kills it on abort, cancellation, or when it outlives its own deadline.

Protocol: one JSON request on stdin (``database``, ``sql``, ``params``, ``max_rows``,
``max_bytes``, ``timeout_s``, ``memory_mb``); one JSON answer on stdout, either ``{"result":
{"columns", "rows", "row_count", "truncated"}}`` or ``{"error": message}``. The rows and the
column names each take at most ``max_bytes`` of the answer, and a message at most
:data:`MAX_MESSAGE_CHARS`.
"""

from __future__ import annotations

import binascii
import json
import math
import os
import sqlite3
import sys
import time
from collections.abc import Callable

# Imports are kept few and cheap (no typing, base64, urllib): a worker starts for every query.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAX_MESSAGE_CHARS = 2000

# Everything else (writes, ATTACH, PRAGMA, transactions, DDL) is refused by SQLite.
_ALLOWED_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)

# Functions that reach past the data: fts3_tokenizer returns a raw C pointer (and with two arguments
# installs one as a tokenizer's code); load_extension loads native code.
_DENIED_FUNCTIONS = frozenset({"fts3_tokenizer", "load_extension"})

# PRAGMAs that only describe the schema, allowed as table-valued functions in a SELECT
# (``SELECT * FROM pragma_table_info('t')``): SQLite runs the PRAGMA itself while the SELECT
# runs, which the authorizer sees as SQLITE_PRAGMA with the pragma's name. Not database_list
# (the host's file paths), nor any PRAGMA that sets something.
_SCHEMA_PRAGMAS = frozenset(
    {"table_info", "table_xinfo", "index_list", "index_info", "index_xinfo", "foreign_key_list"}
)


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


class NotUtf8(bytes):
    """The bytes of a TEXT value that is not valid UTF-8 (SQLite stores whatever it is given)."""


def _text(data: bytes) -> object:
    """A TEXT value: a ``str``, or its bytes as :class:`NotUtf8` when they are not UTF-8.

    Never decoded with replacement characters: "\ufffd" would claim TEXT the database does not
    hold, and the bytes would be lost.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return NotUtf8(data)


def _json_value(value: object) -> object:
    """A cell as JSON: a value JSON cannot hold is an object whose one key names its SQLite type.

    Never a string: that would read as TEXT (the string "Infinity" for +inf did).
    """
    if isinstance(value, bytes):
        key = "text_base64" if type(value) is NotUtf8 else "blob_base64"
        return {key: binascii.b2a_base64(value, newline=False).decode("ascii")}
    if isinstance(value, float):
        if not math.isfinite(value):
            # NaN does not come out of SQLite (it reads one back as NULL), but stays explicit if it did.
            return {"real": "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"}
        if value == 0.0 and math.copysign(1.0, value) < 0:
            # A column without affinity keeps -0.0, and SQLite tells it from 0.0 (atan2); dsh's
            # lossless JSON refuses it, as not every reader keeps the sign.
            return {"real": "-0.0"}
    return value


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _floor_size(value: object) -> int:
    """At most the bytes ``value`` takes as JSON: exactly that but for text that needs escapes.

    Cheaper than encoding, so a row that cannot fit is never encoded.
    """
    if isinstance(value, str):
        return (len(value) if value.isascii() else _size(value)) + 2
    if isinstance(value, bytes):  # "text_base64" (NotUtf8) is as long as "blob_base64"
        return (len(value) + 2) // 3 * 4 + len('{"blob_base64":""}')
    if isinstance(value, float):
        return len(_dumps(_json_value(value)))
    return 4 if value is None else len(str(value))


def value_cap(max_bytes: int, memory_mb: int) -> int:
    """The most one value, stored or built, may take: SQLite's length limit.

    It is not ``max_bytes``, which bounds the answer: SQLite applies the limit to reading stored
    values as well, so a stored value larger than the answer could not even be read in part
    (``length(body)``, ``substr(body, 1, 10)``, ``body LIKE 'h%'``). An eighth of ``memory_mb``
    leaves room for the copies a value read whole takes (SQLite's, the bytes, the str).
    """
    return max(max_bytes, memory_mb << 17)


class Refused(Exception):
    """A query that ran but whose answer cannot be given; the message says what to change."""


def limit_memory(memory_mb: int) -> None:
    """Cap this process's address space at its present size plus ``memory_mb`` (where the OS allows)."""
    try:
        import resource

        with open("/proc/self/statm") as handle:
            size = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = size + memory_mb * (1 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, OSError, ValueError):  # no /proc or no RLIMIT_AS: isolated, not capped
        pass


def _percent(char: str) -> str:
    return "".join(f"%{byte:02X}" for byte in char.encode("utf-8", "surrogateescape"))


def connect(database: str, deadline: float) -> sqlite3.Connection:
    # "file://" and an empty authority: after a bare "file:", a path starting "//" (which POSIX keeps) would
    # begin an authority instead.
    uri = "file://" + "".join(c if c.isascii() and (c.isalnum() or c in "/-._~") else _percent(c) for c in database)
    uri += "?mode=ro"
    # timeout: how long to wait for a writer's lock; the progress handler does not run in that
    # wait, so sqlite3's default of 5 s would outlast a shorter timeout_s.
    connection = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=max(0.0, deadline - time.monotonic()))
    connection.text_factory = _text
    connection.execute("PRAGMA query_only = ON")
    # Sorts, DISTINCT, GROUP BY and materialized subqueries that outgrow the page cache spill to
    # temporary files, which the memory cap does not bound: a sort could fill the disk until
    # timeout_s. In memory they count against memory_mb like everything else.
    connection.execute("PRAGMA temp_store = MEMORY")
    connection.set_authorizer(_authorizer())
    connection.set_progress_handler(lambda: time.monotonic() > deadline, 1000)
    return connection


def run(connection: sqlite3.Connection, request: dict[str, Any]) -> str:
    """The ``result`` of the answer, as JSON: rows until ``max_rows`` or about ``max_bytes`` of them."""
    max_rows: int = request["max_rows"]
    max_bytes: int = request["max_bytes"]
    params = request["params"]
    # SQLite refuses to read or build a larger value ("string or blob too big").
    connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, value_cap(max_bytes, request["memory_mb"]))
    cursor = connection.execute(request["sql"], params if isinstance(params, dict) else tuple(params))
    names = [d[0] for d in cursor.description or ()]
    columns = _dumps(names)
    if _size(columns) > max_bytes:
        raise Refused(
            f"the column names alone are about {_size(columns)} bytes, more than the {max_bytes}-byte "
            "limit; name the columns with AS"
        )
    rows: list[str] = []
    used = 0
    truncated = False
    while cursor.description and not truncated:
        row = cursor.fetchone()
        if row is None:
            break
        if len(rows) == max_rows:
            truncated = True
            break
        floors = [_floor_size(v) for v in row]
        size = sum(floors) + len(row) + 2  # and the commas, the brackets, the comma after
        if size <= max_bytes and not (rows and used + size > max_bytes):
            encoded = _dumps([_json_value(v) for v in row])
            size = _size(encoded) + 1
        del row
        if rows and used + size > max_bytes:
            truncated = True
        elif size > max_bytes:
            widest = max(range(len(floors)), key=floors.__getitem__)
            # The name shortened: it may be up to max_bytes long, and a message is MAX_MESSAGE_CHARS at most.
            name = names[widest] if len(names[widest]) <= 80 else names[widest][:80] + "..."
            detail = f" (column {_dumps(name)} about {floors[widest]})" if len(floors) > 1 else ""
            raise Refused(
                f"the first row alone is about {size} bytes{detail}, more than the {max_bytes}-byte "
                "limit; select fewer or shorter columns (substr(), length())"
            )
        else:
            rows.append(encoded)
            used += size
    return (
        f'{{"columns":{columns},"rows":[{",".join(rows)}],"row_count":{len(rows)},'
        f'"truncated":{"true" if truncated else "false"}}}'
    )


def describe(error: BaseException, request: dict[str, Any], deadline: float) -> str:
    """The message for a failed query: what went wrong and what to change."""
    text = str(error)
    if isinstance(error, UnicodeDecodeError) and isinstance(error.object, bytes):
        # Python's sqlite3 decodes SQLite's text strictly: the names it hands the authorizer (which it then
        # refuses, never calling it), SQLite's message about that refusal, and the result's column names.
        # All of them come from the schema, which SQLite keeps as written, UTF-8 or not. The rows are lost
        # with the error, so the result cannot be given, tagged or replaced; the message can say why.
        shown = error.object[:300].decode("utf-8", "backslashreplace")
        return (
            f"SQL error: {shown} (SQLite's message holds bytes that are not UTF-8, shown as \\xNN: a name "
            "from the database's schema, most likely a column's, is not valid UTF-8; Python's sqlite3 cannot "
            "pass such a name to the plugin's read-only check, which therefore refuses to read that column, "
            "nor name a result column with it. Select the other columns; SELECT name FROM "
            "pragma_table_info('<table>') lists a table's column names, each that is not UTF-8 as "
            '{"text_base64": ...})'
        )
    if isinstance(error, MemoryError):
        return (
            f"the query needed more than the {request['memory_mb']} MiB of memory it may use; select "
            "fewer or smaller values, or aggregate in SQL"
        )
    # Told by SQLite's result code, not by words in the message: messages quote the query
    # ('no such table: database is locked'). Extended codes keep the primary one in the low byte.
    code = getattr(error, "sqlite_errorcode", None)
    code = code & 0xFF if isinstance(code, int) else None
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):  # the busy timeout (timeout_s) ran out
        return (
            f"the database is locked by another writer; it stayed locked for {request['timeout_s']:g} s, "
            "try again later"
        )
    if code == sqlite3.SQLITE_INTERRUPT and time.monotonic() >= deadline:
        return (
            f"the query ran longer than {request['timeout_s']:g} s and was interrupted; add a LIMIT or a narrower WHERE"
        )
    if code == sqlite3.SQLITE_TOOBIG:
        cap = value_cap(request["max_bytes"], request["memory_mb"])
        return (
            f"a value the query reads or builds is larger than {cap} bytes, the most one value may take "
            "(memory_mb / 8, or max_bytes if larger); a stored value that large cannot be read here, not "
            "even in part, and a built one must be made smaller"
        )
    # An extended READONLY code is the database's state, not the query: a hot journal left by a writer
    # that died mid-transaction (ROLLBACK), a WAL to recover (RECOVERY, CANTINIT), which a read-only
    # connection may not do.
    if code == sqlite3.SQLITE_READONLY and getattr(error, "sqlite_errorcode", None) != sqlite3.SQLITE_READONLY:
        return (
            f"the database cannot be read now ({getattr(error, 'sqlite_errorname', 'SQLITE_READONLY')}: "
            f"{text}): it needs a recovery, such as rolling back what a writer that stopped mid-transaction "
            "left, which this read-only connection may not do; the query is not at fault, retry once a "
            "writer has opened the database"
        )
    # SQLITE_AUTH: the authorizer said no ("authorization denied" for statements SQLite authorizes
    # as a whole, VACUUM INTO a new file); a denied function is a plain SQLITE_ERROR whose message
    # starts "not authorized to use function".
    if code in (sqlite3.SQLITE_AUTH, sqlite3.SQLITE_READONLY) or text.startswith("not authorized"):
        return f"only read-only queries are allowed (SELECT or WITH ... SELECT): {text}"
    return f"SQL error: {text}"


def main() -> None:
    """Read the request from stdin, answer on stdout."""
    request = json.loads(sys.stdin.buffer.read())
    deadline = time.monotonic() + request["timeout_s"]
    limit_memory(request["memory_mb"])
    reserve: bytearray | None = bytearray(1 << 20)  # given back to describe a MemoryError
    try:
        connection = connect(request["database"], deadline)
    except sqlite3.Error as error:
        answer = _dumps({"error": f"cannot open the database {request['database']}: {error}"[:MAX_MESSAGE_CHARS]})
    else:
        try:
            answer = '{"result":' + run(connection, request) + "}"
        except Refused as refusal:
            answer = _dumps({"error": str(refusal)})
        except (MemoryError, sqlite3.Error, ValueError, OverflowError) as error:
            # OperationalError (syntax, interrupted, locked), DatabaseError (not authorized),
            # ProgrammingError (two statements, wrong number of bindings), ValueError (a NUL in
            # the SQL), OverflowError (an integer parameter beyond 64 bits), MemoryError (past
            # memory_mb, in Python or in SQLite).
            reserve = None
            answer = _dumps({"error": describe(error, request, deadline)[:MAX_MESSAGE_CHARS]})
    del reserve
    sys.stdout.buffer.write(answer.encode("utf-8", "surrogatepass"))
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
