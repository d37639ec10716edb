"""``dsh sessions list`` and ``dsh sessions show ID``: read recorded sessions.

``show`` renders a session's trajectory as a tree: each run, its messages,
its model-direct tool calls with outcome and duration, and under each
``run_code`` call the nested calls its program made (matched start/settle
pairs by ``sub_call_id``), with approvals where they were asked. A call
without its result and a run without its ``run/end`` are marked interrupted
(the process was killed), or running while a live run holds the session's
lease; ``list`` and ``show`` name that run.

``show`` draws the tree from SQLite's private temporary database (:class:`SessionRenderer`): a
session of any length is drawn holding a page of its events and a few rows of its tree, never
all of either, and its file is unlinked as soon as SQLite opens it, so that nothing of the
session is left on disk however the process ends.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Final, TypeVar

import click

from dsh_core.clirun import USAGE_ERROR_CODES, echo_json, fail, run_async
from dsh_core.errors import DshError
from dsh_core.lossless import dumps
from dsh_core.terminal import visible

# `dsh --help` imports this module: what the commands and renderers use is imported where used.
if TYPE_CHECKING:
    import sqlite3

    from dsh_core.config import Deployment
    from dsh_core.sessions.events import SessionEvent, SessionInfo
    from dsh_core.sessions.lease import SessionLease
    from dsh_core.sessions.store import SessionStore

__all__ = ["sessions_group", "render_session", "render_list", "SessionRenderer"]

T = TypeVar("T")


def _short(value: object, limit: int = 80) -> str:
    text = value if isinstance(value, str) else dumps(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _when(at: float | None) -> str:
    # None: a time the store could not read (an unreadable session's).
    return "?" if at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def _ms(value: object) -> str:
    return f"{float(value):.1f} ms" if isinstance(value, int | float) else "? ms"


def _cut_note(payload: Mapping[str, Any]) -> str:
    """`` · the model saw it cut to …`` for a result (or context message) cut to ``max_tool_result_chars``."""
    cut = payload.get("cut")
    if not isinstance(cut, Mapping):
        return ""
    cap, left_out = cut.get("max_tool_result_chars"), cut.get("left_out")
    if type(cap) is not int or type(left_out) is not int:
        return ""
    return f" · the model saw it cut to fit {cap:,} characters ({left_out:,} left out)"


def _outcome(payload: Mapping[str, Any]) -> str:
    """``ok`` or the error code (+ message) of a result payload, whatever its exact shape."""
    if payload.get("ok") is True or payload.get("is_error") is False:
        return "ok"
    error = payload.get("error")
    code = payload.get("error_code")
    message = None
    if isinstance(error, Mapping):
        code = code or error.get("code")
        message = error.get("message")
    elif isinstance(error, str):
        message = error
    text = str(code or "failed")
    return f"{text}: {_short(message, 100)}" if message else text


def _call_summary(arguments: object) -> str:
    """A call's arguments in one line; a ``run_code`` call by its description, not its program text."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):  # a model may send arguments nested deeper than json recurses
            parsed = None
        if isinstance(parsed, Mapping) and isinstance(parsed.get("description"), str) and "code" in parsed:
            return repr(_short(parsed["description"], 60))
    return _short(arguments, 60)


def _message(payload: Mapping[str, Any]) -> Mapping[str, Any]:
    """A message event's message; one that is not an object is taken for its content."""
    message = payload.get("message")
    if isinstance(message, Mapping):
        return message
    return {} if message is None else {"content": message}


def _tool_call_names(tool_calls: object) -> list[str]:
    """The function names of an assistant message's tool calls, ``?`` for a call of another shape."""
    if not isinstance(tool_calls, list | tuple):
        return []
    names = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        names.append("?" if name is None else str(name))
    return names


def _sub(sub_call_id: str | None) -> str:
    # Code Mode ids read "<run_code call id>:code:<n>"; under their run_code call, "#<n>" says it all.
    text = str(sub_call_id)
    head, sep, tail = text.rpartition(":code:")
    return f"#{tail}" if sep and head else f"sub {text}"


def _running_holder(info: SessionInfo) -> SessionLease | None:
    """The run holding ``info``'s session, unless it surely is gone (then the next run takes the lease over)."""
    from dsh_core.sessions.lease import holder_alive

    return info.holder if info.holder is not None and holder_alive(info.holder) else None


def render_session(info: SessionInfo, events: Iterable[SessionEvent]) -> str:
    """The trajectory of a session as a text tree (see the module docstring).

    ``events`` is iterated once, and no event is kept once it has been drawn: only the tree's rows are
    (in :class:`SessionRenderer`'s temporary database, closed before this returns).
    """
    with SessionRenderer(info) as renderer:
        for event in events:
            renderer.add(event)
        return renderer.text()


def _stored(text: str) -> bytes:
    # A label or an id may hold lone surrogates (a name that was not UTF-8): sqlite3 binds text as
    # strict UTF-8, so they are kept as bytes that hold them (and read back the same by _label).
    return text.encode("utf-8", "surrogatepass")


def _label(stored: bytes) -> str:
    return stored.decode("utf-8", "surrogatepass")


def _nested_key(key: tuple[str | None, str]) -> bytes:
    """A nested call's key ``(root_call_id, str(sub_call_id))`` in the database: no root and an empty one differ."""
    root, sub = key
    stored = b"-" if root is None else b"%d:%b" % (len(_stored(root)), _stored(root))
    return stored + b":" + _stored(sub)


def _sqlite_temporary_directory() -> str:
    """The directory SQLite's unix VFS makes temporary files in: the first of ``SQLITE_TMPDIR``, ``TMPDIR``,
    ``/var/tmp``, ``/usr/tmp``, ``/tmp`` and ``.`` that is a directory this process can write to and enter
    (``.`` if none is: where SQLite tries last)."""
    for directory in (os.environ.get("SQLITE_TMPDIR"), os.environ.get("TMPDIR"), "/var/tmp", "/usr/tmp", "/tmp"):
        if directory and os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK):
            return directory
    return "."


#: The id of the tree's first line (the session's); each run's line is a child of it.
_ROOT: Final = 0

#: The tree (``nodes``: a line each, under its ``parent``, in ``id`` order, ``parent_of`` saying whether any
#: line is under it, so that the walk looks for none under the most), the model-direct calls by
#: ``root_call_id`` (``unsettled`` until their result) and the nested calls not settled yet (past
#: :data:`_BUFFERED` of them). ``start`` has no type: an event's time stays the int or float it was.
_TREE_SCHEMA: Final = (
    "CREATE TABLE nodes (id INTEGER PRIMARY KEY, parent INTEGER, label BLOB NOT NULL, parent_of INTEGER NOT NULL)",
    "CREATE TABLE calls (key BLOB PRIMARY KEY, node INTEGER NOT NULL, start, run INTEGER NOT NULL, "
    "unsettled INTEGER NOT NULL) WITHOUT ROWID",
    "CREATE TABLE nested (key BLOB PRIMARY KEY, node INTEGER NOT NULL, start, run INTEGER NOT NULL) WITHOUT ROWID",
)


#: How many lines, and calls, :class:`SessionRenderer` holds before it writes them to its database in
#: one statement (a statement each cost more than drawing the line), and how many nested calls not
#: settled yet it holds before it writes those (Code Mode settles a program's nested calls soon).
_BUFFERED: Final = 2048


class SessionRenderer:
    """:func:`render_session` one event at a time: :meth:`add` each in ``seq`` order, then :meth:`lines`.

    For events read a page at a time (:func:`~dsh_core.sessions.store.iter_events`): the renderer keeps
    neither the events nor the tree's lines in memory, but the tree as rows of SQLite's private temporary
    database (``sqlite3.connect("")``), and :meth:`lines` walks it a line at a time. SQLite keeps it in its
    cache and writes what overflows to a file in its temporary directory (:func:`_sqlite_temporary_directory`:
    TMPDIR), which it unlinks as soon as it opens it: nothing is left of it however the process ends, even
    killed. :meth:`close` (or leaving the ``with`` block) closes it, whatever happened before.

    A failure of that database (a full disk) is a :class:`~dsh_core.errors.DshError` naming its directory.
    """

    def __init__(self, info: SessionInfo) -> None:
        import sqlite3

        self._session = info.id
        self._conn: sqlite3.Connection | None = None
        self._run: int | None = None
        self._runs = 0
        self._started_at: float | None = None  # when the last run started (its run/start), if it said
        self._finished = False
        # What is not in the database yet (see _BUFFERED); a line's id is given here, in drawing order.
        self._next_node = _ROOT + 1
        self._nodes: dict[int, list[Any]] = {}  # id: [parent, label, parent_of]
        self._calls: dict[str, list[Any]] = {}  # root_call_id: [node, start, run, unsettled]
        self._nested: dict[tuple[str | None, str], tuple[int, Any, int]] = {}  # its key: (node, start, run)
        self._nested_spilled = False  # whether the nested table holds any
        self._parent_of = _ROOT  # the line written out last known to have a line under it
        self._user = user = _running_holder(info)
        try:
            # "": private and temporary. Its file, made only once the tree overflows SQLite's cache (the first
            # write may fail, not the opening), is unlinked as soon as it is opened: a file of our own
            # (the tree is the session's text) was left behind by a process killed while it printed.
            self._conn = conn = sqlite3.connect("", isolation_level=None)
            conn.text_factory = bytes  # a label appended to (label || ?) is text of the bytes _stored wrote
            # Thrown away once drawn: nothing is worth a journal or a sync, and one transaction holds it all.
            conn.execute("PRAGMA journal_mode=OFF")
            conn.execute("PRAGMA synchronous=OFF")
            for statement in _TREE_SCHEMA:
                conn.execute(statement)
            conn.execute("BEGIN")
            agent = info.meta.get("agent", "?")
            in_use = f" · in use by {visible(user.describe())}" if user is not None else ""
            conn.execute(
                "INSERT INTO nodes (id, parent, label, parent_of) VALUES (?, NULL, ?, 1)",
                (
                    _ROOT,
                    _stored(
                        f"session {info.id} · agent {agent} · {info.shown_events} events · "
                        f"created {_when(info.created_at)}{in_use}"
                    ),
                ),
            )
        except BaseException as error:
            self.close()
            if isinstance(error, sqlite3.Error):
                raise self._failed(error) from None
            raise

    def __enter__(self) -> SessionRenderer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the temporary database, which SQLite then frees (idempotent)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _failed(self, error: Exception) -> DshError:
        return DshError(
            f"cannot show session {self._session!r}: cannot draw its tree in a temporary database in "
            f"{_sqlite_temporary_directory()!r} (SQLite's temporary directory: TMPDIR, or SQLITE_TMPDIR "
            f"if set): {type(error).__name__}: {error}"
        )

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise DshError(f"cannot show session {self._session!r}: its renderer was closed")
        return self._conn

    # -- the tree's rows ------------------------------------------------------------------------------------

    def _add_node(self, parent: int, label: str) -> int:
        """Add a line under ``parent`` (after its lines so far) and return its id."""
        node = self._next_node
        self._next_node += 1
        self._nodes[node] = [parent, label, 0]
        held = self._nodes.get(parent)
        if held is not None:
            held[2] = 1
        elif parent != self._parent_of:  # the lines of a run come one after the other: marked once
            self._db().execute("UPDATE nodes SET parent_of = 1 WHERE id = ?", (parent,))
            self._parent_of = parent
        if len(self._nodes) >= _BUFFERED:
            self._flush()
        return node

    def _append(self, node: int, text: str) -> None:
        """Add ``text`` at the end of a line."""
        held = self._nodes.get(node)
        if held is not None:
            held[1] += text
        else:
            self._db().execute("UPDATE nodes SET label = label || ? WHERE id = ?", (_stored(text), node))

    def _flush(self) -> None:
        """Write the lines and calls held to the database (a call's row replaces one of the same id)."""
        db = self._db()
        db.executemany(
            "INSERT INTO nodes (id, parent, label, parent_of) VALUES (?, ?, ?, ?)",
            [(node, parent, _stored(label), parent_of) for node, (parent, label, parent_of) in self._nodes.items()],
        )
        db.executemany(
            "INSERT OR REPLACE INTO calls (key, node, start, run, unsettled) VALUES (?, ?, ?, ?, ?)",
            [(_stored(key), *call) for key, call in self._calls.items()],
        )
        self._nodes.clear()
        self._calls.clear()

    def _spill_nested(self) -> None:
        self._db().executemany(
            "INSERT OR REPLACE INTO nested (key, node, start, run) VALUES (?, ?, ?, ?)",
            [(_nested_key(key), *call) for key, call in self._nested.items()],
        )
        self._nested.clear()
        self._nested_spilled = True

    def _call(self, root_call_id: str) -> tuple[int, Any] | None:
        """The line and start of the model-direct call ``root_call_id``, if it was drawn."""
        held = self._calls.get(root_call_id)
        if held is not None:
            return held[0], held[1]
        row = self._db().execute("SELECT node, start FROM calls WHERE key = ?", (_stored(root_call_id),)).fetchone()
        return None if row is None else (row[0], row[1])

    def _settle_nested(self, key: tuple[str | None, str]) -> tuple[int, Any] | None:
        """The line and start of the nested call ``key`` not settled yet, which it no longer is; else ``None``."""
        held = self._nested.pop(key, None)
        if held is not None:
            return held[0], held[1]
        if not self._nested_spilled:
            return None
        db, stored = self._db(), _nested_key(key)
        row = db.execute("SELECT node, start FROM nested WHERE key = ?", (stored,)).fetchone()
        if row is None:
            return None
        db.execute("DELETE FROM nested WHERE key = ?", (stored,))
        return row[0], row[1]

    def _holder(self, root_call_id: str | None) -> int:
        """The line a nested call or approval of ``root_call_id`` goes under: its call's, else the run's."""
        call = self._call(root_call_id or "")
        return call[0] if call is not None else self._current_run()

    def _unended(self, node: int) -> None:
        self._add_node(node, "end: none recorded (interrupted)")

    def _current_run(self) -> int:
        if self._run is None:
            self._runs += 1
            self._run = self._add_node(_ROOT, f"run {self._runs}")
        return self._run

    def add(self, event: SessionEvent) -> None:
        """Draw the next event."""
        import sqlite3

        try:
            self._draw(event)
        except sqlite3.Error as error:
            raise self._failed(error) from None

    def _draw(self, event: SessionEvent) -> None:
        from dsh_core.sessions.events import EventKind

        payload: Mapping[str, Any] = event.payload if isinstance(event.payload, Mapping) else {}
        kind = event.kind
        add, current_run = self._add_node, self._current_run
        if kind == EventKind.RUN_START:
            if self._run is not None:
                self._unended(self._run)
            self._runs += 1
            self._started_at = event.at
            resumed = " (resumed)" if payload.get("resumed") else ""
            self._run = add(
                _ROOT,
                f"run {self._runs}{resumed}: {_short(payload.get('task', ''), 60)!s} · "
                f"provider {payload.get('provider')} · mode {payload.get('mode')}",
            )
        elif kind == EventKind.USER_MESSAGE:
            message = _message(payload)
            if payload.get("context_source") is not None or event.root_call_id is not None:
                source = payload.get("context_source") or event.root_call_id
                add(current_run(), f"context ({source}): {_short(message.get('content', ''))}{_cut_note(payload)}")
            else:
                add(current_run(), f"user: {_short(message.get('content', ''))}")
        elif kind == EventKind.ASSISTANT_MESSAGE:
            message = _message(payload)
            names = _tool_call_names(message.get("tool_calls"))
            content = message.get("content")
            if names:
                said = f" ({_short(content, 60)})" if content else ""
                add(current_run(), f"assistant → {', '.join(str(n) for n in names)}{said}")
            else:
                add(current_run(), f"assistant: {_short(content or '')}")
        elif kind == EventKind.TOOL_CALL and event.root_call_id is not None:
            node = add(
                current_run(),
                f"{payload.get('name')} [{event.root_call_id}] {_call_summary(payload.get('arguments', ''))}",
            )
            # A second call of the same id takes the first's place: that one is no longer looked for.
            self._calls[event.root_call_id] = [node, event.at, self._runs, 1]
            if len(self._calls) >= _BUFFERED:
                self._flush()
        elif kind == EventKind.TOOL_RESULT and event.root_call_id is not None:
            held = self._calls.get(event.root_call_id)
            if held is not None:
                held[3] = 0
            else:
                self._db().execute("UPDATE calls SET unsettled = 0 WHERE key = ?", (_stored(event.root_call_id),))
            call = self._call(event.root_call_id)
            node = call[0] if call is not None else add(current_run(), f"{payload.get('name')} [{event.root_call_id}]")
            self._append(node, f" — {_outcome(payload)} · {_ms(payload.get('duration_ms'))}{_cut_note(payload)}")
        elif kind == EventKind.CODE_DISPATCH_START:
            holder = self._holder(event.root_call_id)
            args = payload.get("args", payload.get("arguments", ""))
            node = add(holder, f"{payload.get('name')} [{_sub(event.sub_call_id)}] {_short(args, 60)}")
            key = (event.root_call_id, str(event.sub_call_id))
            if self._nested_spilled:  # one of the same id in the table is no longer looked for
                self._db().execute("DELETE FROM nested WHERE key = ?", (_nested_key(key),))
            self._nested[key] = (node, event.at, self._runs)
            if len(self._nested) >= _BUFFERED:
                self._spill_nested()
        elif kind == EventKind.CODE_DISPATCH:
            settled = self._settle_nested((event.root_call_id, str(event.sub_call_id)))
            if settled is not None:
                node, start = settled
            else:
                node = add(self._holder(event.root_call_id), f"{payload.get('name')} [{_sub(event.sub_call_id)}]")
                start = event.at
            duration = payload.get("duration_ms")
            if not isinstance(duration, int | float):
                duration = (event.at - start) * 1000
            self._append(node, f" — {_outcome(payload)} · {_ms(duration)}")
        elif kind == EventKind.APPROVAL:
            reason = f" ({_short(payload.get('reason'), 60)})" if payload.get("reason") else ""
            add(
                self._holder(event.root_call_id),
                f"approval for {payload.get('name')}: {payload.get('outcome')}{reason}",
            )
        elif kind == EventKind.RUN_END:
            error = f": {_short(payload.get('error'), 100)}" if payload.get("error") else ""
            add(current_run(), f"end: {payload.get('reason')} after {payload.get('turns')} turn(s){error}")
            self._run = None
        else:
            add(current_run(), f"{kind}: {_short(payload, 80)}")

    def finish(self) -> None:
        """Mark the unfinished run and calls, once every event is added (:meth:`lines` does, if not done yet)."""
        import sqlite3

        if self._finished:
            return
        try:
            self._mark_unfinished()
            self._flush()
            db = self._db()
            db.execute("COMMIT")
            # Made once the rows are in, in one sort, rather than kept up as each was added.
            db.execute("CREATE INDEX nodes_parent ON nodes (parent)")
        except sqlite3.Error as error:
            raise self._failed(error) from None
        self._finished = True

    def _mark_unfinished(self) -> None:
        user = self._user
        # The holder's run is the last one only if that started under its lease: a run that has just
        # taken the lease over is loading the history, and the unfinished run before it was killed.
        holders_run = user is not None and (self._started_at is None or self._started_at >= user.since)
        if self._run is not None:
            if holders_run:
                self._add_node(self._run, "end: none yet (running)")
            else:
                self._unended(self._run)
        # Only the last run's calls may be running: those of the runs before it were cut off with them.
        running_run = self._runs if holders_run else None
        self._flush()
        self._spill_nested()
        unsettled = self._db().execute(
            "SELECT node, run FROM calls WHERE unsettled UNION ALL SELECT node, run FROM nested"
        )
        for node, run in unsettled:  # stepped a row at a time, however many were left unsettled
            self._append(node, " — running" if run == running_run else " — no result (interrupted)")

    def lines(self) -> Iterator[str]:
        """The tree's lines, drawn with box characters, every label made :func:`visible`, one at a time.

        Walked without recursion, holding one open query per level of the tree: a long session must
        neither hit the recursion limit nor be held whole.
        """
        import sqlite3

        self.finish()
        try:
            db = self._db()
            (root,) = db.execute("SELECT label FROM nodes WHERE id = ?", (_ROOT,)).fetchone()
            yield visible(_label(root))

            def children(node: int) -> sqlite3.Cursor:
                return db.execute("SELECT id, label, parent_of FROM nodes WHERE parent = ? ORDER BY id", (node,))

            # A level each: the query of its lines, its next line, and the prefix its lines are drawn after.
            levels: list[tuple[sqlite3.Cursor, tuple[int, bytes, int], str]] = []
            below = children(_ROOT)
            first = below.fetchone()
            if first is not None:
                levels.append((below, first, ""))
            while levels:
                cursor, (node, label, parent_of), prefix = levels.pop()
                following = cursor.fetchone()
                last = following is None
                if last:
                    cursor.close()
                else:
                    levels.append((cursor, following, prefix))
                yield f"{prefix}{'└─ ' if last else '├─ '}{visible(_label(label))}"
                if not parent_of:
                    continue
                below = children(node)
                first = below.fetchone()
                if first is None:
                    below.close()
                else:
                    levels.append((below, first, prefix + ("   " if last else "│  ")))
        except sqlite3.Error as error:
            raise self._failed(error) from None

    def text(self) -> str:
        """The whole tree as one text (:meth:`lines` joined): for a tree that is known to be small."""
        return "\n".join(self.lines())


def _agent_cell(info: SessionInfo) -> str:
    return "?" if info.unreadable is not None else visible(str(info.meta.get("agent", "")))


def _task_cell(info: SessionInfo) -> str:
    # An unreadable session says why where its task would be: its meta, which holds the task, is what failed.
    if info.unreadable is not None:
        return visible(f"(unreadable: {info.unreadable})")
    return visible(_short(str(info.meta.get("task", "")), 50))


def _unknown_or(value: object) -> str:
    return "?" if value is None else visible(str(value))


def render_list(sessions: Sequence[SessionInfo]) -> str:
    """A table of sessions: id, last update, event count, agent, the run using it (if any does) and first task.

    A session the store could not read (:attr:`SessionInfo.unreadable`) has agent ``?`` and says why as its task;
    what of it could not be read (its id, last update or event count: ``None``) is ``?`` too.
    """
    if not sessions:
        return "no sessions"
    holders = [_running_holder(s) for s in sessions]
    using = any(holder is not None for holder in holders)
    rows = [("ID", "UPDATED", "EVENTS", "AGENT", *(("IN USE BY",) if using else ()), "TASK")]
    rows += [
        (
            _unknown_or(s.id),
            _when(s.updated_at),
            _unknown_or(s.event_count),
            _agent_cell(s),
            *((visible(f"pid {h.pid} on {h.host}") if h is not None else "",) if using else ()),
            _task_cell(s),
        )
        for s, h in zip(sessions, holders, strict=True)
    ]
    last = len(rows[0]) - 1  # the task: not padded
    widths = [max(len(row[i]) for row in rows) for i in range(last)]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) if i < last else cell for i, cell in enumerate(row)).rstrip() for row in rows
    )


# -- commands ------------------------------------------------------------------------------------------------


def _deployment(ctx: click.Context, local: Sequence[str]) -> Deployment:
    from dsh_core.cli import load_config

    inherited: Sequence[str] = ctx.find_root().params.get("configs") or ()
    return load_config([*inherited, *local])


def _with_store(deployment: Deployment, work: Callable[[SessionStore], Awaitable[T]]) -> T:
    """``work(store)`` on the deployment's store, opened creating nothing: these commands only read
    sessions or change one that exists, so where there is no store yet they find no session."""
    from dsh_core.agent.loop import open_session_store
    from dsh_core.boot import start_harness

    async def main() -> T:
        harness = await start_harness(deployment)
        try:
            store = open_session_store(harness, create=False)
            try:
                return await work(store)
            finally:
                await store.close()
        finally:
            await harness.aclose()

    try:
        # The command prints once the harness is closed. run_async: SIGINT/SIGTERM cancel main,
        # so the store and the harness still close.
        return run_async(main, stdout_to_stderr=True)
    except DshError as error:
        fail(error.message, 2 if error.code in USAGE_ERROR_CODES else 1)


_config_option = click.option(
    "--config",
    "configs",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Deployment TOML file; repeat to overlay (later files patch earlier ones).",
)


@click.group("sessions")
def sessions_group() -> None:
    """List, inspect and release recorded agent sessions (under DSH_HOME, default ~/.dsh)."""


#: The most sessions `list` asks a store for (SQLite's largest INTEGER).
_LARGEST_LIMIT = 2**63 - 1


@sessions_group.command("list")
@_config_option
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="At most this many.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of sessions.")
@click.pass_context
def sessions_list(ctx: click.Context, configs: tuple[str, ...], limit: int, as_json: bool) -> None:
    """Sessions, most recently updated first.

    A session whose record is damaged is listed as unreadable, saying why; if its last update
    is what cannot be read, after all the others (newest id first among such).

    When more exist than --limit lets through, a note on stderr says so (stdout, table or
    JSON list, is the same either way).
    """

    async def work(store: SessionStore) -> list[SessionInfo]:
        # One more than shown: whether more exist is known without counting them all. At most
        # 2**63 - 1, SQLite's largest INTEGER (no store holds more sessions than that).
        return await store.list(limit=min(limit, _LARGEST_LIMIT - 1) + 1)

    found = _with_store(_deployment(ctx, configs), work)
    more = len(found) > limit
    found = found[:limit]
    if as_json:
        # UTF-8 as `show --json` writes it (echo_json escapes what stdout cannot encode, as JSON escapes).
        # A session the store could not read: meta null (not {}, which would say it has none) and why.
        echo_json(
            dumps(
                [
                    {
                        "id": s.id,
                        "created_at": s.created_at,
                        "updated_at": s.updated_at,
                        "event_count": s.event_count,
                        "meta": None if s.unreadable is not None else dict(s.meta),
                        "in_use_by": _holder_json(s),
                        "unreadable": s.unreadable,
                    }
                    for s in found
                ],
                indent=2,
            )
        )
    else:
        click.echo(render_list(found))
    if more:
        shown = "the most recently updated session" if limit == 1 else f"the {limit} most recently updated sessions"
        click.echo(f"(showing {shown}; more exist: --limit N to see more)", err=True)


def _holder_json(info: SessionInfo) -> dict[str, Any] | None:
    holder = _running_holder(info)
    return None if holder is None else {"pid": holder.pid, "host": holder.host, "since": holder.since}


@sessions_group.command("show")
@click.argument("session_id")
@_config_option
@click.option("--json", "as_json", is_flag=True, help="Print the events as a JSON list.")
@click.pass_context
def sessions_show(ctx: click.Context, session_id: str, configs: tuple[str, ...], as_json: bool) -> None:
    """A session's trajectory: runs, messages, calls with their nested calls, outcomes, durations.

    As the session was when it was read: what a run still recording it appends meanwhile is left
    for the next show. With --json, the list is written once it is whole (spooled meanwhile,
    past a little memory in a temporary file): an error part-way writes none of it.
    """
    from dsh_core.sessions.store import iter_events

    # The events are read a page at a time and drawn (or written) as they come: a session of
    # millions of events is shown holding one page of them. The JSON is written to a spool (on
    # disk past _SPOOL_CHARS) while the store is open, and to stdout only once it is whole: an
    # event that cannot be read part-way (or a signal) must not leave half a JSON list on stdout.
    # Only the events the session had when its record was read: the pages are read after it, in
    # other statements, and a run still recording the session may append between them; the
    # header's count and user would then not be those of the events shown. As many as are stored
    # (counted with the record), not as the record counts: one written apart from its events (a
    # crash mid-write, a foreign writer) hid the events past its count; it is warned of on stderr.
    # The tree is drawn into the renderer's temporary database while the store is open, and walked
    # onto stdout once it is closed; its file was unlinked as it was opened: a process killed while
    # it prints leaves nothing. The renderer is kept in `drawn` as soon as it is made, and closed by
    # the caller whatever happens: once the tree is written, and if the events cannot be read, or
    # closing the store or the harness fails (or a signal comes meanwhile) after it was drawn, when
    # `tree` has returned it to no one.
    drawn: list[SessionRenderer] = []

    async def tree(store: SessionStore) -> SessionInfo:
        info = await store.get(session_id)
        drawn.append(renderer := SessionRenderer(info))
        async for event in iter_events(store, session_id, limit=info.shown_events):
            renderer.add(event)
        renderer.finish()
        return info

    if as_json:
        # Lone surrogates (a name that was not UTF-8) pass through the spool as they are: echo_json
        # writes them out as JSON escapes, as it does whatever stdout cannot encode.
        with tempfile.SpooledTemporaryFile(_SPOOL_CHARS, mode="w+", encoding="utf-8", errors="surrogatepass") as spool:

            async def document(store: SessionStore) -> SessionInfo:
                info = await store.get(session_id)
                writer = _JsonEvents(spool)
                try:
                    async for event in iter_events(store, session_id, limit=info.shown_events):
                        writer.add(event)
                    writer.end()
                except OSError as error:  # the spool's: the store's own are SessionStoreErrors
                    raise DshError(
                        f"cannot show session {session_id!r} as JSON: cannot spool it to a temporary "
                        f"file in {tempfile.gettempdir()!r} (TMPDIR): {error.strerror or error}"
                    ) from None
                return info

            info = _with_store(_deployment(ctx, configs), document)
            _warn_if_miscounted(info)
            spool.seek(0)
            while chunk := spool.read(_SPOOL_CHARS):
                echo_json(chunk, nl=False)
    else:
        try:
            info = _with_store(_deployment(ctx, configs), tree)
            (renderer,) = drawn
            _warn_if_miscounted(info)
            try:
                _echo_lines(renderer.lines())
            except DshError as error:
                fail(error.message)
        finally:
            for renderer in drawn:
                renderer.close()


def _echo_lines(lines: Iterable[str]) -> None:
    """Write ``lines`` to stdout, each ended by a newline, about :data:`_SPOOL_CHARS` characters at a time."""
    pieces: list[str] = []
    size = 0
    for line in lines:
        pieces.append(line)
        size += len(line) + 1
        if size >= _SPOOL_CHARS:
            click.echo("\n".join(pieces))
            pieces, size = [], 0
    if pieces:
        click.echo("\n".join(pieces))


def _warn_if_miscounted(info: SessionInfo) -> None:
    """On stderr (stdout is the tree, or a JSON document), that the record's event count is not what is stored."""
    if info.stored_events is not None and info.stored_events != info.event_count:
        click.echo(
            f"dsh: warning: session {visible(repr(info.id))}: its record counts {info.event_count} events, "
            f"but {info.stored_events} are stored; showing the {info.stored_events} stored",
            err=True,
        )


#: About how many characters of ``show --json``'s document are held in memory (the rest spooled on disk).
_SPOOL_CHARS = 1 << 16


class _JsonEvents:
    """The events as one JSON list, ``json.dumps(..., indent=2)``'s text, written about ``chunk`` characters at a time.

    The document of a long session is several times the size of its events in memory; built whole
    (and its pieces before that), it took several times the memory the events did.
    """

    def __init__(self, out: IO[str], *, chunk: int = 1 << 16) -> None:
        self._out = out
        self._chunk = chunk
        self._pieces: list[str] = []
        self._size = 0
        self._count = 0

    def add(self, e: SessionEvent) -> None:
        """Write (or buffer, up to ``chunk``) the next event."""
        item = dumps(
            {
                "seq": e.seq,
                "kind": e.kind,
                "at": e.at,
                "root_call_id": e.root_call_id,
                "parent_call_id": e.parent_call_id,
                "sub_call_id": e.sub_call_id,
                "payload": e.payload,
            },
            indent=2,
        )
        # A JSON text breaks lines only between tokens: one level deeper is two more spaces after each break.
        self._pieces.append(("[\n  " if self._count == 0 else ",\n  ") + item.replace("\n", "\n  "))
        self._count += 1
        self._size += len(self._pieces[-1])
        if self._size >= self._chunk:
            self._out.write("".join(self._pieces))
            self._pieces, self._size = [], 0

    def end(self) -> None:
        """Close the list (``[]`` if no event was added)."""
        self._pieces.append("\n]\n" if self._count else "[]\n")
        self._out.write("".join(self._pieces))
        self._pieces, self._size = [], 0


@sessions_group.command("release")
@click.argument("session_id")
@_config_option
@click.pass_context
def sessions_release(ctx: click.Context, session_id: str, configs: tuple[str, ...]) -> None:
    """Free a session whose run is gone where dsh cannot check (another host or container).

    A run holds its session while it runs, so that no second run continues it at once; a
    run killed on this host frees it by itself. A live run whose session is released
    stops at its next write (its work since then is not recorded).
    """

    async def work(store: SessionStore) -> SessionLease | None:
        return await store.break_lease(session_id)

    holder = _with_store(_deployment(ctx, configs), work)
    if holder is None:
        click.echo(f"session {visible(session_id)} was not held by any run")
    elif not holder.readable:
        click.echo(
            f"released session {visible(session_id)} (held by a lease whose record is unreadable, so which "
            "run it was is unknown)"
        )
    else:
        click.echo(f"released session {visible(session_id)} (held by {visible(holder.describe())})")
