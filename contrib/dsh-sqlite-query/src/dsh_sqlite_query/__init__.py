"""dsh-sqlite-query: one read-only ``sql_query`` tool over a configured SQLite database file.

Safety does not rest on parsing SQL. The database is opened read-only
(``mode=ro`` URI), ``PRAGMA query_only`` is set, and an authorizer allows only
reading (``SELECT``, reading columns, functions, recursive CTEs), so writes,
``ATTACH``, ``PRAGMA``, transactions and the pointer-handling ``fts3_tokenizer``
fail inside SQLite itself. Values are
always bound parameters (``?`` or ``:name``), never formatted into the SQL.
Each query runs in a child process with a memory cap (see :mod:`dsh_sqlite_query._worker`),
so what a query builds never weighs on the dsh process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import weakref
from collections.abc import Mapping
from typing import Any

from dsh_core import AbortedError, Scope, ToolContext, ToolError, define_tool, hookimpl, plugin
from dsh_core.processes import kill_child
from dsh_sqlite_query import _worker

__all__ = ["plugin", "SqliteQuery"]

CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["database"],
    "properties": {
        "database": {"type": "string", "minLength": 1, "description": "path of the SQLite database file"},
        "max_rows": {"type": "integer", "minimum": 1, "default": 200, "description": "rows returned at most"},
        "max_bytes": {
            "type": "integer",
            "minimum": 1024,
            "default": 1 << 20,
            "description": "bytes of rows (as JSON: text as UTF-8, BLOBs as base64) returned at most",
        },
        "timeout_s": {
            "type": "number",
            "exclusiveMinimum": 0,
            "default": 10,
            "description": "a query running (or waiting for a writer's lock) longer is interrupted",
        },
        "memory_mb": {
            "type": "integer",
            "minimum": 16,
            "default": 64,
            "description": "memory a query's worker process may use beyond its start (Linux); "
            "one value may take an eighth of it",
        },
        "max_concurrent": {
            "type": "integer",
            "minimum": 1,
            "default": 4,
            "description": "most queries (worker processes) running at once; more wait their turn, at most timeout_s",
        },
    },
}

_SCALAR = {"type": ["string", "number", "integer", "boolean", "null"]}

# One cell of a row. JSON has no BLOB nor infinity, dsh's JSON no -0.0, its strings only Unicode: such a
# value is an object whose one key names its SQLite type, never a string, which would read as
# TEXT. Within the schema subset dsh_core.schema.fast_check takes, so checking rows stays a plain loop.
_CELL = {
    "type": ["string", "number", "null", "object"],
    "description": "TEXT, INTEGER, REAL or NULL as JSON; a value JSON cannot hold as an object naming its type",
    "properties": {
        "blob_base64": {"type": "string", "description": "a BLOB: its bytes, base64"},
        "text_base64": {"type": "string", "description": "TEXT that is not valid UTF-8: its bytes, base64"},
        "real": {"type": "string", "description": "a REAL JSON cannot hold: Infinity, -Infinity or -0.0"},
    },
    "additionalProperties": False,
}

# Past timeout_s, a worker that has not answered (stuck in one SQLite step, or slow to start) is killed.
KILL_GRACE_S = 2.0


class SqliteQuery:
    """The plugin instance: the database path, limits and the ``sql_query`` tool."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.database = os.path.abspath(config["database"])
        self.max_rows: int = config.get("max_rows", 200)
        self.max_bytes: int = config.get("max_bytes", 1 << 20)
        self.timeout_s: float = config.get("timeout_s", 10)
        self.memory_mb: int = config.get("memory_mb", 64)
        self.max_concurrent: int = config.get("max_concurrent", 4)
        # One per event loop: a semaphore is bound to the loop it first waits on.
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    @hookimpl
    def dsh_register_tools(self, register: Any) -> None:
        """Register ``sql_query``."""
        register(
            define_tool(
                name="sql_query",
                description=(
                    f"Run one read-only SQL query (SQLite dialect) against {os.path.basename(self.database)} "
                    "and get rows as JSON. Pass values as params (a list for ?, an object for :name) — "
                    f"never inside the SQL text. At most {self.max_rows} rows (and about "
                    f"{self.max_bytes // 1024} KiB) are returned. List tables "
                    "with: SELECT name, sql FROM sqlite_schema. A value JSON cannot hold comes as an "
                    'object naming its type: a BLOB as {"blob_base64": "..."}, TEXT that is not valid UTF-8 '
                    'as its bytes, {"text_base64": "..."}, a REAL JSON cannot hold as {"real": "Infinity"}, '
                    '{"real": "-Infinity"} or {"real": "-0.0"}.'
                ),
                parameters={
                    "type": "object",
                    "properties": {
                        "sql": {"type": "string", "description": "one SELECT (or WITH ... SELECT) statement"},
                        "params": {
                            "oneOf": [
                                {"type": "array", "items": _SCALAR},
                                {"type": "object", "additionalProperties": _SCALAR},
                            ],
                            "description": "values bound to ? (list) or :name (object) placeholders",
                        },
                    },
                    "required": ["sql"],
                    "additionalProperties": False,
                },
                output_schema={
                    "type": "object",
                    "properties": {
                        "columns": {"type": "array", "items": {"type": "string"}},
                        "rows": {"type": "array", "items": {"type": "array", "items": _CELL}},
                        "row_count": {"type": "integer"},
                        "truncated": {"type": "boolean"},
                    },
                    "required": ["columns", "rows", "row_count", "truncated"],
                },
                execute=self.query,
                render=_render,
                is_concurrency_safe=True,
                examples=[
                    {"sql": "SELECT name, type FROM sqlite_schema ORDER BY name"},
                    {"sql": "SELECT ? + ? AS total", "params": [1, 2]},
                    {"sql": "SELECT upper(:word) AS shout", "params": {"word": "hello"}},
                ],
                annotations={"read_only": True},
            )
        )

    async def _spawn(self) -> asyncio.subprocess.Process:
        """Start a worker: this interpreter, isolated (``-I -S``), running :mod:`._worker` by its path."""
        try:
            return await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-S",
                _worker.__file__,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
        except OSError as error:
            raise ToolError(f"cannot start the query worker: {error.strerror or error}") from None

    async def _exchange(self, process: asyncio.subprocess.Process, request: dict[str, Any]) -> bytes:
        """Send the request, read the answer: at most what the worker may send (rows, names, message)."""
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(request).encode())
        with contextlib.suppress(ConnectionError):  # a worker that died at once: no answer, said below
            await process.stdin.drain()
        process.stdin.close()
        # The rows and the column names each take at most max_bytes; a message's character is at most
        # 6 bytes as JSON (\u001f).
        cap = 2 * self.max_bytes + 6 * _worker.MAX_MESSAGE_CHARS + 1024
        answer = bytearray()
        while chunk := await process.stdout.read(1 << 16):
            answer += chunk
            if len(answer) > cap:
                raise ToolError(f"the query worker's answer is longer than the {cap} bytes it may be")
        return bytes(answer)

    @staticmethod
    async def _reap(process: asyncio.subprocess.Process, exchange: asyncio.Future[bytes]) -> None:
        """Stop the exchange, kill the worker if it still runs, and wait for it to end."""
        exchange.cancel()
        await asyncio.wait({exchange})
        kill_child(process)
        # wait() returns only once the pipes are closed too, and an answer left unread (too long,
        # or the call ended) can keep the worker's stdout open: read it to the end.
        assert process.stdout is not None
        while await process.stdout.read(1 << 16):
            pass
        await process.wait()

    async def query(self, args: Any, ctx: ToolContext) -> Any:
        """Body of ``sql_query``: run in a worker process, killed on abort, cancellation or a stuck query."""
        ctx.signal.raise_if_aborted()
        if not os.path.isfile(self.database):
            raise ToolError(f"the database file {self.database} does not exist; check the plugin's database config")
        params = args.get("params", [])
        params = dict(params) if isinstance(params, Mapping) else list(params)
        request = {
            "database": self.database,
            "sql": args["sql"],
            "params": params,
            "max_rows": self.max_rows,
            "max_bytes": self.max_bytes,
            "timeout_s": self.timeout_s,
            "memory_mb": self.memory_mb,
        }
        # Each query is a process that may use memory_mb: a batch of parallel calls (or a Code Mode
        # program gathering a thousand) must not start one per call all at once.
        slots = await self._turn(ctx)
        try:
            return await self._run(request, ctx)
        finally:
            slots.release()

    async def _turn(self, ctx: ToolContext) -> asyncio.Semaphore:
        """Wait for one of the ``max_concurrent`` turns, at most ``timeout_s``; an abort ends the wait at once.

        The semaphore is returned acquired: the caller releases it once its worker is reaped (or, the call
        cancelled, is being reaped: killed at once).
        """
        slots = self._slots.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(self.max_concurrent))
        turn = asyncio.ensure_future(slots.acquire())
        granted = False
        try:
            async with asyncio.timeout(self.timeout_s):
                granted = await ctx.signal.until(turn)
        except TimeoutError:
            raise ToolError(
                f"the query could not start within {self.timeout_s:g} s: max_concurrent ({self.max_concurrent}) "
                "queries were running; try again later"
            ) from None
        finally:
            # Not taken (aborted, timed out, cancelled): a turn granted in the meantime is given back.
            if not granted and not turn.cancel() and not turn.cancelled():
                slots.release()
        if not granted:
            raise AbortedError(ctx.signal.reason)
        return slots

    async def _run(self, request: dict[str, Any], ctx: ToolContext) -> Any:
        """Run ``request`` in a worker process, killed on abort, cancellation or a stuck query."""
        process = await self._spawn()
        timed_out = False

        def on_timeout() -> None:
            nonlocal timed_out
            if process.returncode is None:
                timed_out = True
                kill_child(process)

        # The worker interrupts itself at timeout_s; this kills one that could not (one long step).
        timer = asyncio.get_running_loop().call_later(self.timeout_s + KILL_GRACE_S, on_timeout)
        exchange = asyncio.ensure_future(self._exchange(process, request))
        try:
            if not await ctx.signal.until(exchange):
                raise AbortedError(ctx.signal.reason)
            answer = exchange.result()
        finally:
            timer.cancel()
            await asyncio.shield(self._reap(process, exchange))  # no worker outlives the call
        if timed_out:
            raise ToolError(
                f"the query ran longer than {self.timeout_s:g} s and was interrupted; add a LIMIT or a narrower WHERE"
            )
        try:
            reply = json.loads(answer)
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or not ("result" in reply or "error" in reply):
            raise ToolError(
                f"the query worker ended without an answer (exit status {process.returncode}); the query "
                f"may have needed more than the {self.memory_mb} MiB of memory it may use"
            )
        if "error" in reply:
            raise ToolError(str(reply["error"]))
        return reply["result"]


def _render(_args: Any, value: Any) -> str:
    if not value["columns"]:
        return "(the statement returned no columns)"
    lines = ["\t".join(_render_name(name) for name in value["columns"])]
    lines += ["\t".join(_render_cell(v) for v in row) for row in value["rows"]]
    footer = f"({value['row_count']} row{'' if value['row_count'] == 1 else 's'}"
    footer += ", truncated: add a LIMIT or narrow the query)" if value["truncated"] else ")"
    return "\n".join([*lines, footer])


# What the model reads is this text, not the value: each cell is its JSON, so TEXT is quoted (TEXT
# 'NULL' is not NULL, '1' is not 1, nor does text spelling a tag read as one) and its tabs and
# newlines are escaped, never splitting a cell or a row.
_encode = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": ")).encode

# JSON escapes the C0 controls but leaves DEL and the C1 controls (U+007F-U+009F) as they are, and
# LINE SEPARATOR and PARAGRAPH SEPARATOR too. DEL is invisible; some terminals take a C1 control
# (U+009B is CSI) as the start of an escape sequence; str.splitlines (and many renderers) break lines
# at NEL (U+0085), U+2028 and U+2029. The format characters (Unicode category Cf) are invisible too:
# zero-width characters and the Unicode tags (U+E0000 block) can hide text from a person reading what
# the model read, and the bidirectional overrides reorder a row on screen. The reader must see each of
# them, so each is escaped. In JSON they can stand only inside a string, where their \u escapes (a
# surrogate pair beyond the BMP) mean the same text. The Cf ranges are Unicode 15.1's; a test checks
# them against the running Python's database.
_UNSEEN = re.compile(
    "[\u007f-\u009f\u2028\u2029"
    "\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e"
    "\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]"
)


def _json_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _render_cell(value: Any) -> str:
    """A cell as the model reads it: its JSON, with every character that breaks a line or hides escaped."""
    return _UNSEEN.sub(_json_escape, _encode(value))


def _render_name(name: str) -> str:
    """A column name in the header: bare where that is unambiguous, else its JSON, as a TEXT cell is shown.

    Bare, a tab or newline in a name split the header from its columns. Its JSON is used for a name
    :func:`_render_cell` escapes anything in (a C0, DEL or C1 control character or another line break,
    a backslash, a quote), an empty one, and one starting with ``{`` (which would read as a tag): so a
    header field starting with ``"`` is JSON.
    """
    quoted = _render_cell(name)
    return name if name and quoted[1:-1] == name and not name.startswith("{") else quoted


@plugin(config_schema=CONFIG_SCHEMA)
def sqlite_query_plugin(scope: Scope, config: Any) -> SqliteQuery:
    """Entry point ``sqlite-query``: the ``sql_query`` tool over ``config["database"]``."""
    return SqliteQuery(dict(config))


plugin = sqlite_query_plugin
