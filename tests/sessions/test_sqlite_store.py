"""The SQLite session store: the seam's contract, atomic batches, crash safety."""

from __future__ import annotations

import asyncio
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

import pytest

from dsh_core.sessions import (
    EventKind,
    NewEvent,
    SessionNotFoundError,
    SessionRecorder,
    SessionStore,
    SessionStoreError,
)
from dsh_core.sessions.lease import SessionLease
from dsh_core.sessions.sqlite import DB_FILENAME, SCHEMA_VERSION, SqliteSessionStore
from dsh_core.sessions.store import dsh_home

pytestmark = pytest.mark.anyio


async def test_create_append_load_list_get(tmp_path: Path) -> None:
    store = SqliteSessionStore.open(tmp_path / "home")
    try:
        assert isinstance(store, SessionStore)
        info = await store.create(meta={"agent": "main", "task": "t"})
        other = await store.create(session_id="fixed")
        stored = await store.append(
            info.id,
            [
                NewEvent(EventKind.USER_MESSAGE, {"message": {"role": "user", "content": "hi"}}),
                NewEvent(
                    EventKind.TOOL_CALL, {"name": "read", "big": 123456789012345678901234567890}, root_call_id="1.1"
                ),
            ],
        )
        assert [e.seq for e in stored] == [1, 2]
        more = await store.append(
            info.id,
            [
                NewEvent(
                    "tool/code-dispatch-start",
                    {"name": "x"},
                    root_call_id="1.1",
                    parent_call_id="1.1",
                    sub_call_id="1.1:code:1",
                )
            ],
        )
        assert more[0].seq == 3
        loaded = await store.load(info.id)
        assert [(e.seq, e.kind) for e in loaded] == [
            (1, "message/user"),
            (2, "tool/call"),
            (3, "tool/code-dispatch-start"),
        ]
        assert loaded[1].payload["big"] == 123456789012345678901234567890  # lossless through JSON text
        assert (loaded[2].root_call_id, loaded[2].parent_call_id, loaded[2].sub_call_id) == ("1.1", "1.1", "1.1:code:1")
        assert [e.seq for e in await store.load(info.id, root_call_id="1.1")] == [2, 3]
        summary = await store.get(info.id)
        assert summary.event_count == 3 and summary.meta == {"agent": "main", "task": "t"}
        listed = await store.list()
        assert [s.id for s in listed] == [info.id, other.id]  # most recently updated first
        assert [s.id for s in await store.list(limit=1)] == [info.id]
        with pytest.raises(SessionStoreError, match="session 'fixed' already exists"):
            await store.create(session_id="fixed")
        with pytest.raises(SessionNotFoundError, match="no session 'nope'"):
            await store.load("nope")
        with pytest.raises(SessionNotFoundError):
            await store.append("nope", [NewEvent("x")])
        with pytest.raises(SessionNotFoundError):
            await store.get("nope")
    finally:
        await store.close()
        await store.close()  # idempotent
    with pytest.raises(SessionStoreError, match="closed"):
        await store.list()
    conn = sqlite3.connect(tmp_path / "home" / DB_FILENAME)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_a_bad_payload_writes_nothing_of_its_batch(tmp_path: Path) -> None:
    store = SqliteSessionStore.open(tmp_path)
    try:
        info = await store.create()
        with pytest.raises(TypeError, match="session event payload: not lossless JSON at /bad"):
            await store.append(info.id, [NewEvent("ok", {"n": 1}), NewEvent("bad", {"bad": float("nan")})])
        assert await store.load(info.id) == []
        with pytest.raises(ValueError, match="non-empty string"):
            NewEvent("")
    finally:
        await store.close()


async def test_lone_surrogates_load_back_as_they_were_and_a_pair_written_as_two_is_refused(tmp_path: Path) -> None:
    # Stored as \\uXXXX escapes, lone surrogates (in any order) load back the same; a high one right
    # before a low one would load back as one character, U+1F600, so the payload is refused instead.
    store = SqliteSessionStore.open(tmp_path)
    try:
        info = await store.create()
        lone = {"caf\udce9.txt": ["\ud83d", "\ude00", "\ude00\ud83d", "\ud83d-\ude00", "\U0001f600 \udc80"]}
        await store.append(info.id, [NewEvent("ok", lone)])
        with pytest.raises(TypeError, match=r"session event payload: not lossless JSON at /name: a surrogate pair"):
            await store.append(info.id, [NewEvent("pair", {"name": "smile \ud83d\ude00"})])
        with pytest.raises(TypeError, match=r"not lossless JSON at the root: object key 'x\\udbff\\udfff' holds"):
            await store.append(info.id, [NewEvent("pair", {"x\udbff\udfff": 1})])
        assert [(event.kind, event.payload) for event in await store.load(info.id)] == [("ok", lone)]
    finally:
        await store.close()


async def test_concurrent_recorder_appends_keep_call_order_and_whole_batches(tmp_path: Path) -> None:
    store = SqliteSessionStore.open(tmp_path)
    try:
        info = await store.create()
        recorder = SessionRecorder(store, info.id)
        batch = [NewEvent("batch", {"i": i}) for i in range(5)]
        await asyncio.gather(*(recorder.append("one", {"n": n}) for n in range(20)), recorder.append_many(batch))
        events = await recorder.load()
        assert [e.seq for e in events] == list(range(1, 26))
        kinds = [e.kind for e in events]
        first = kinds.index("batch")
        assert kinds[first : first + 5] == ["batch"] * 5  # never interleaved
        assert [e.payload["n"] for e in events if e.kind == "one"] == list(range(20))
    finally:
        await store.close()


async def test_a_full_disk_is_a_store_error_and_the_store_stays_usable(tmp_path: Path) -> None:
    store = SqliteSessionStore.open(tmp_path)
    try:
        info = await store.create()
        # A database that may not grow stands in for a full disk (SQLITE_FULL either way).
        await store._run(lambda: store._db().execute("PRAGMA max_page_count = 1").fetchone())
        with pytest.raises(SessionStoreError) as caught:
            await store.append(info.id, [NewEvent("big", {"blob": "a" * 100_000})])
        message = caught.value.message
        assert str(tmp_path / DB_FILENAME) in message and repr(info.id) in message
        assert "database or disk is full" in message and "no transaction is active" not in message
        assert not await store._run(lambda: store._db().in_transaction)
        (stored,) = await store.append(info.id, [NewEvent("small", {})])
        assert stored.seq == 1  # the failed batch left nothing behind
    finally:
        await store.close()


async def test_a_locked_database_is_a_store_error_naming_the_session(tmp_path: Path) -> None:
    store = SqliteSessionStore(tmp_path / DB_FILENAME, busy_timeout_ms=50)
    other = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
    try:
        info = await store.create()
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        with pytest.raises(
            SessionStoreError,
            match=rf"cannot append to session '{info.id}': OperationalError: "
            "database is locked",
        ):
            await store.append(info.id, [NewEvent("x", {})])
        other.execute("ROLLBACK")
        assert [e.seq for e in await store.append(info.id, [NewEvent("x", {})])] == [1]
    finally:
        other.close()
        await store.close()


class _FailingCommit:
    """A connection whose next COMMIT fails (as one can on an I/O error)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __getattr__(self, name: str) -> object:
        return getattr(self.conn, name)

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        if sql == "COMMIT":
            raise sqlite3.OperationalError("disk I/O error")
        return self.conn.execute(sql, *args)


async def test_a_failed_commit_rolls_back_and_leaves_no_open_transaction(tmp_path: Path) -> None:
    store = SqliteSessionStore.open(tmp_path)
    try:
        info = await store.create()
        real = store._conn
        assert real is not None
        store._conn = _FailingCommit(real)  # type: ignore[assignment]
        with pytest.raises(SessionStoreError, match="disk I/O error"):
            await store.append(info.id, [NewEvent("x", {})])
        store._conn = real
        assert not await store._run(lambda: real.in_transaction)
        assert [e.seq for e in await store.append(info.id, [NewEvent("y", {})])] == [1]
    finally:
        await store.close()


def test_the_home_directory_follows_config_then_env_then_default(tmp_path: Path) -> None:
    assert dsh_home("/cfg", env={"DSH_HOME": "/env"}) == Path("/cfg")
    assert dsh_home(None, env={"DSH_HOME": "/env"}) == Path("/env")
    assert dsh_home(None, env={}) == Path("~/.dsh").expanduser()


def test_an_unusable_home_fails_naming_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SessionStoreError, match="cannot create dsh home"):
        SqliteSessionStore.open(blocker / "home")


async def test_opened_without_creating_a_missing_database_reads_as_empty_and_creates_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = SqliteSessionStore.open(home, create=False)
    try:
        assert await store.list() == []
        for read in (store.get("nope"), store.load("nope"), store.break_lease("nope")):
            with pytest.raises(SessionNotFoundError, match=f"no session 'nope' in .*{DB_FILENAME}"):
                await read
        with pytest.raises(SessionStoreError, match="opened without creating"):
            await store.create(session_id="s")
    finally:
        await store.close()
    assert not home.exists()
    home.mkdir()
    store = SqliteSessionStore.open(home, create=False)
    await store.close()
    assert list(home.iterdir()) == []
    # One that exists is opened as usual: what it holds is read, and written.
    store = SqliteSessionStore.open(home)
    try:
        await store.create(session_id="s")
    finally:
        await store.close()
    store = SqliteSessionStore.open(home, create=False)
    try:
        assert [info.id for info in await store.list()] == ["s"]
        await store.append("s", [NewEvent(EventKind.USER_MESSAGE, {"n": 1})])
        assert (await store.get("s")).event_count == 1
    finally:
        await store.close()


async def test_open_store_asks_a_factory_that_can_not_to_create_and_calls_an_older_one_as_before(
    tmp_path: Path,
) -> None:
    from dsh_core.sessions.store import open_store
    from dsh_plugins.stores.sqlite import SqliteSessionsPlugin

    factories = []
    SqliteSessionsPlugin("sqlite").dsh_register_session_stores(lambda name, factory: factories.append(factory))
    (factory,) = factories
    store = open_store(factory, tmp_path / "read", create=False)
    await store.close()
    assert not (tmp_path / "read").exists()
    store = open_store(factory, tmp_path / "run")  # an agent run's: creates the home and the database
    await store.close()
    assert (tmp_path / "run" / DB_FILENAME).is_file()

    called = []

    def older(home: Path) -> SessionStore:  # written before create=
        called.append(home)
        return SqliteSessionStore.open(home)

    await open_store(older, tmp_path / "older", create=False).close()
    assert called == [tmp_path / "older"]


@pytest.mark.skipif(
    sys.platform == "win32" or sys.getfilesystemencoding() != "utf-8",
    reason="needs a POSIX file system with UTF-8 names",
)
async def test_opened_without_creating_a_home_whose_name_is_not_utf8_reads_what_is_there(tmp_path: Path) -> None:
    # The mode=rw URI quoted str(path): a name with a byte that is not UTF-8 (a surrogate in str)
    # raised UnicodeEncodeError, where create=True opens the same database.
    import os

    for name in ("caf\udce9", "a?b#c%20d e%"):
        home = Path(os.fsdecode(os.fsencode(tmp_path)) + "/" + name)
        store = SqliteSessionStore.open(home)
        try:
            await store.create(session_id="s")
        finally:
            await store.close()
        store = SqliteSessionStore.open(home, create=False)
        try:
            assert not store.absent and [info.id for info in await store.list()] == ["s"]
        finally:
            await store.close()
        assert sorted(path.name for path in home.iterdir())[0] == DB_FILENAME


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX paths")
async def test_opened_without_creating_a_home_spelled_with_a_leading_double_slash(tmp_path: Path) -> None:
    # `file://tmp/...?mode=rw`: SQLite read the first component as the URI's authority and failed
    # ("invalid uri authority"), where create=True opens //tmp/... (the same file as /tmp/...).
    home = Path("/" + str(tmp_path.absolute()) + "/home")
    assert str(home).startswith("//")
    store = SqliteSessionStore.open(home)
    try:
        await store.create(session_id="s")
    finally:
        await store.close()
    store = SqliteSessionStore.open(home, create=False)
    try:
        assert not store.absent and [info.id for info in await store.list()] == ["s"]
    finally:
        await store.close()


async def test_opened_without_creating_a_database_that_cannot_be_looked_at_fails_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whether the database was missing was asked of Path.exists(), which raises on EACCES (a home
    # that is not searchable): a bare PermissionError, not the store's error naming the file. Only
    # a database known to be missing reads as empty; anything else fails as opening it does.
    import os

    home = tmp_path / "home"
    home.mkdir()
    target = home / DB_FILENAME
    real_stat = os.stat

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if os.fspath(path) == os.fspath(target):  # type: ignore[arg-type]
            raise PermissionError(13, "Permission denied", os.fspath(target))  # type: ignore[arg-type]
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(SessionStoreError, match=f"cannot open session database .*{DB_FILENAME}"):
        SqliteSessionStore.open(home, create=False)


async def test_open_store_passes_create_only_to_a_factory_that_names_it(tmp_path: Path) -> None:
    # A factory taking **options was handed create=False too: one that forwards its options to a
    # store of its own (which knows no create) failed `sessions list` with a TypeError, where it had
    # worked before create= existed. Only a factory that names the keyword has said what it means.
    import functools
    from typing import Any

    from dsh_core.sessions.store import open_store

    def older_open(home: Path, *, busy_timeout_ms: int = 5000) -> SessionStore:
        return SqliteSessionStore.open(home)

    called: list[tuple[str, Any]] = []

    def forwarding(home: Path, **options: Any) -> SessionStore:
        called.append(("forwarding", options))
        return older_open(home, **options)

    def positional_only(home: Path, create: bool = True, /, **options: Any) -> SessionStore:
        called.append(("positional_only", (create, options)))
        return older_open(home, **options)

    class Factory:
        def __call__(self, home: Path, *, create: bool = True) -> SessionStore:
            called.append(("callable", create))
            return SqliteSessionStore.open(home, create=create)

    for factory in (forwarding, positional_only):
        await open_store(factory, tmp_path / "a", create=False).close()
    assert called == [("forwarding", {}), ("positional_only", (True, {}))]
    called.clear()
    # What names it is asked: a callable object, a partial, a class, a bound method.
    opened = [Factory(), functools.partial(SqliteSessionStore.open), SqliteSessionStore.open]
    for n, factory in enumerate(opened):
        await open_store(factory, tmp_path / f"r{n}", create=False).close()
        assert not (tmp_path / f"r{n}").exists(), factory
    assert called == [("callable", False)]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
def test_a_database_that_fails_to_open_is_not_left_open(tmp_path: Path) -> None:
    path = tmp_path / DB_FILENAME
    path.write_bytes(b"this is no SQLite database, and it is longer than a header would be" * 20)

    def open_here() -> list[Path]:
        return [fd for fd in Path("/proc/self/fd").iterdir() if fd.resolve() == path]

    failing = f"cannot open session database .*{DB_FILENAME}.*not a database"
    with pytest.raises(SessionStoreError, match=failing) as failed:
        SqliteSessionStore(path)
    # While the error lives (a caller keeps it, or its traceback's cycle awaits the collector), the
    # connection it failed in must not: it was opened, and nobody else could close it.
    assert open_here() == [], failed.value


CHILD = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from dsh_core.sessions import NewEvent
    from dsh_core.sessions.sqlite import SqliteSessionStore

    async def main():
        store = SqliteSessionStore.open(Path(sys.argv[1]))
        info = await store.create(session_id="crash")
        payload = {"text": "x" * 2000}
        while True:
            stored = await store.append(info.id, [NewEvent("tick", payload) for _ in range(10)])
            print(stored[-1].seq, flush=True)

    asyncio.run(main())
""")


def test_a_child_killed_mid_write_loses_no_committed_event(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        committed = 0
        for _ in range(60):
            line = child.stdout.readline()
            assert line, "the child stopped writing"
            committed = int(line)
        child.send_signal(signal.SIGKILL)  # while it keeps appending: most likely inside a transaction
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert committed >= 600
    conn = sqlite3.connect(tmp_path / DB_FILENAME)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        seqs = [row[0] for row in conn.execute("SELECT seq FROM events WHERE session_id='crash' ORDER BY seq")]
    finally:
        conn.close()
    assert len(seqs) >= committed  # every acknowledged event survived
    assert seqs == list(range(1, len(seqs) + 1))  # no gaps
    assert len(seqs) % 10 == 0  # batches are all-or-nothing

    async def reopen() -> int:
        store = SqliteSessionStore.open(tmp_path)
        try:
            await store.append("crash", [NewEvent("after", {})])
            return (await store.get("crash")).event_count
        finally:
            await store.close()

    assert asyncio.run(reopen()) == len(seqs) + 1


async def _cancel_once_waiting(task: asyncio.Task[object]) -> None:
    await asyncio.sleep(0.1)  # the write is on the database thread, waiting for the lock
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancelled_append_commits_nothing(tmp_path: Path) -> None:
    """CancelledError out of append means the batch is not in the log, whenever the cancellation came."""
    store = SqliteSessionStore(tmp_path / DB_FILENAME)
    other = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
    try:
        info = await store.create()
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock for a while
        writing = asyncio.ensure_future(store.append(info.id, [NewEvent("running")]))
        await _cancel_once_waiting(writing)
        queued = asyncio.ensure_future(store.append(info.id, [NewEvent("queued")]))  # behind a cancelled one
        await _cancel_once_waiting(queued)
        created = asyncio.ensure_future(store.create(session_id="cancelled"))
        await _cancel_once_waiting(created)
        other.execute("ROLLBACK")
        (kept,) = await store.append(info.id, [NewEvent("kept")])
        assert kept.seq == 1 and [e.kind for e in await store.load(info.id)] == ["kept"]
        assert [s.id for s in await store.list()] == [info.id]
    finally:
        other.close()
        await store.close()


async def test_an_append_cancelled_while_it_commits_returns_and_then_is_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancellation that comes too late to stop the COMMIT: append says it happened, the task still ends."""
    store = SqliteSessionStore.open(tmp_path)
    try:
        info = await store.create()
        committed = store._transaction

        in_commit, cancel_sent = threading.Event(), threading.Event()

        def slow_to_return(*args: object, **kwargs: object) -> object:
            result = committed(*args, **kwargs)  # type: ignore[arg-type]
            in_commit.set()
            cancel_sent.wait(5)  # committed, not yet handed back: the cancellation lands here
            return result

        monkeypatch.setattr(store, "_transaction", slow_to_return)
        seen: list[object] = []

        async def appender() -> None:
            seen.extend(await store.append(info.id, [NewEvent("committed")]))
            await asyncio.sleep(0)
            seen.append("not cancelled")

        task = asyncio.ensure_future(appender())
        while not in_commit.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        cancel_sent.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        monkeypatch.undo()
        assert [getattr(e, "kind", e) for e in seen] == ["committed"]
        assert [e.kind for e in await store.load(info.id)] == ["committed"]
    finally:
        await store.close()


async def test_open_store_passes_create_true_to_a_factory_whose_create_has_no_default(tmp_path: Path) -> None:
    """An agent run opened with factory(home) alone: a factory requiring create failed with a TypeError."""
    from dsh_core.sessions.store import open_store

    seen: list[bool] = []

    def strict(home: Path, *, create: bool) -> SessionStore:
        seen.append(create)
        return SqliteSessionStore.open(home, create=create)

    await open_store(strict, tmp_path / "run").close()
    await open_store(strict, tmp_path / "read", create=False).close()
    assert seen == [True, False]
    assert (tmp_path / "run").is_dir() and not (tmp_path / "read").exists()


async def test_a_corrupt_payload_or_meta_is_a_store_error_naming_the_session_and_event(tmp_path: Path) -> None:
    # A row edited by hand or damaged on disk failed `sessions show`, `list` and a resume with a bare
    # JSONDecodeError (or an AttributeError for a meta that is no object) naming no session, no event.
    store = SqliteSessionStore.open(tmp_path)
    try:
        await store.create(session_id="a", meta={"agent": "x"})
        await store.append("a", [NewEvent("run/start", {"task": "t"}), NewEvent("tool/call", {"name": "n"})])
        await store.create(session_id="b", meta={"agent": "x"})
    finally:
        await store.close()
    _execute(
        tmp_path / DB_FILENAME,
        "UPDATE events SET payload = '{broken' WHERE session_id = 'a' AND seq = 2",
        "UPDATE sessions SET meta = '[1]' WHERE id = 'b'",
    )
    store = SqliteSessionStore.open(tmp_path)
    try:
        event = rf"session store '{tmp_path / DB_FILENAME}': session 'a' event 2: payload is not JSON: Expecting"
        with pytest.raises(SessionStoreError, match=event):
            await store.load("a")
        with pytest.raises(SessionStoreError, match=event):
            await store.load_page("a", after=1)
        assert [e.seq for e in await store.load_page("a", limit=1)] == [1]
        meta = rf"session store '{tmp_path / DB_FILENAME}': session 'b': meta is not a JSON object: '\[1\]'"
        with pytest.raises(SessionStoreError, match=meta):
            await store.get("b")
        assert (await store.get("a")).meta == {"agent": "x"}
    finally:
        await store.close()


@pytest.mark.parametrize("create", [True, False])
def test_a_foreign_database_is_named_and_left_as_it_was(tmp_path: Path, create: bool) -> None:
    # Another program's database at sessions.db (its own `sessions` table): even `dsh sessions list`
    # switched it to WAL and added dsh's `events` table and index before failing on "no such column".
    _execute(tmp_path / DB_FILENAME, "CREATE TABLE sessions (id INTEGER PRIMARY KEY, name TEXT)")
    with pytest.raises(
        SessionStoreError,
        match=rf"'{tmp_path / DB_FILENAME}'.*is not a dsh session database: "
        r"its table 'sessions' has no column\(s\) created_at, ",
    ):
        SqliteSessionStore.open(tmp_path, create=create)
    conn = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
    try:
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [("sessions",)]
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    finally:
        conn.close()


@pytest.mark.parametrize("create", [True, False])
def test_a_database_of_tables_without_a_sessions_table_is_named_and_left_as_it_was(
    tmp_path: Path, create: bool
) -> None:
    # Another program's database without a `sessions` table of its own (every dsh's database has one):
    # opened to read it was taken for an empty store (`dsh sessions release ID` said there is no
    # such session), and opened to write dsh added its tables to it.
    path = tmp_path / DB_FILENAME
    _execute(path, "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
    before = path.read_bytes()
    with pytest.raises(
        SessionStoreError,
        match=rf"^cannot open session database '{path}': it is not a dsh session "
        r"database: it has no table 'sessions' \(another program's ",
    ):
        SqliteSessionStore.open(tmp_path, create=create)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [DB_FILENAME]


def test_tables_another_program_adds_while_a_run_opens_the_file_are_not_completed_with_dsh_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Opening looks at the tables, then takes the write lock to add dsh's: another program that made
    # the (empty) file its own in between had dsh's tables added to it and its version stamped, and
    # from then on it passed for dsh's. Under the lock the tables are looked at again.
    path = tmp_path / DB_FILENAME
    _execute(path)
    complete = SqliteSessionStore._complete_schema

    def taken_over_first(store: SqliteSessionStore, conn: sqlite3.Connection) -> None:
        _execute(path, "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
        complete(store, conn)

    monkeypatch.setattr(SqliteSessionStore, "_complete_schema", taken_over_first)
    with pytest.raises(SessionStoreError) as refused:
        SqliteSessionStore.open(tmp_path)
    assert str(refused.value) == _refused_as_foreign(path, "it has no table 'sessions'")
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [("notes",)]
        assert conn.execute("PRAGMA user_version").fetchone() == (0,)
    finally:
        conn.close()


async def test_table_names_are_matched_as_sqlite_matches_them_ignoring_case(tmp_path: Path) -> None:
    # SQLite's table names ignore case: a dsh database whose tables a person renamed to "Sessions" and
    # "Leases" is still dsh's, and its session and lease are read from the file's tables, not from empty
    # stand-ins (nor is it refused as another program's database).
    store = SqliteSessionStore.open(tmp_path)
    lease = SessionLease.for_this_run()
    try:
        await store.create(session_id="s")
        await store.acquire("s", lease)
    finally:
        await store.close()
    _execute(
        tmp_path / DB_FILENAME,
        "ALTER TABLE sessions RENAME TO renamed_sessions",
        "ALTER TABLE renamed_sessions RENAME TO Sessions",
        "ALTER TABLE leases RENAME TO renamed_leases",
        "ALTER TABLE renamed_leases RENAME TO Leases",
    )
    store = SqliteSessionStore.open(tmp_path, create=False)
    try:
        (listed,) = await store.list()
        assert listed.id == "s" and listed.holder is not None and listed.holder.token == lease.token, listed
    finally:
        await store.close()


async def test_a_database_without_any_table_yet_is_an_empty_store(tmp_path: Path) -> None:
    # What sqlite3 makes before dsh's schema is in it: no session in it, and a run makes it dsh's.
    (tmp_path / DB_FILENAME).write_bytes(b"")
    store = SqliteSessionStore.open(tmp_path, create=False)
    try:
        assert await store.list() == []
        with pytest.raises(SessionNotFoundError, match=r"^no session 's' in "):
            await store.break_lease("s")
    finally:
        await store.close()
    store = SqliteSessionStore.open(tmp_path)
    try:
        await store.create(session_id="s")
        assert [info.id for info in await store.list()] == ["s"]
    finally:
        await store.close()


def test_a_schema_that_cannot_be_completed_is_not_left_half_made(tmp_path: Path) -> None:
    # The schema was created statement by statement: one that failed left the ones before it behind.
    _execute(tmp_path / DB_FILENAME, "CREATE TABLE sessions_updated (x)")  # the name of one of dsh's indexes
    with pytest.raises(SessionStoreError, match=rf"cannot open session database '{tmp_path / DB_FILENAME}': "):
        SqliteSessionStore.open(tmp_path)
    conn = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
    try:
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [("sessions_updated",)]
        assert conn.execute("PRAGMA user_version").fetchone() == (0,)  # nor its version
    finally:
        conn.close()


def _user_version(path: Path) -> int:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])
    finally:
        conn.close()


def _execute(path: Path, *statements: str) -> None:
    """Run ``statements`` on the database at ``path`` as another program would (autocommit), then close it."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in statements:
            conn.execute(statement)
    finally:
        conn.close()


def _set_user_version(path: Path, version: int) -> None:
    _execute(path, f"PRAGMA user_version={version}")


def _refused_as_newer(path: Path, version: int) -> str:
    """What opening the database at ``path`` says once a newer dsh stamped ``version`` on it."""
    return (
        f"cannot open session database {str(path)!r}: it was written by a newer dsh (schema version "
        f"{version}; this dsh supports version {SCHEMA_VERSION}); upgrade dsh"
    )


def _refused_as_foreign(path: Path, reason: str) -> str:
    """What opening the database at ``path`` says once another program made it its own (``reason``: how)."""
    return (
        f"cannot open session database {str(path)!r}: it is not a dsh session database: {reason} "
        "(another program's database? [sessions] home, or DSH_HOME, names where dsh keeps its own)"
    )


async def _leased_session(home: Path, lease: SessionLease, run: SqliteSessionStore | None = None) -> None:
    """Session ``s``, leased by ``lease``, with one event, as a run writes it (through ``run``, else a run's store of
    ``home``, closed again)."""
    store = run if run is not None else SqliteSessionStore.open(home)
    try:
        await store.create(session_id="s", lease=lease)
        await store.append("s", [NewEvent(EventKind.USER_MESSAGE, {"n": 1})], lease=lease)
    finally:
        if run is None:
            await store.close()


async def test_a_new_database_is_stamped_with_the_schema_version(tmp_path: Path) -> None:
    # The schema had no version: a database written by a later dsh, with another schema, could not be
    # told from one of this dsh's, and failed with raw SQLite messages (or at the first write).
    store = SqliteSessionStore.open(tmp_path)
    await store.close()
    assert SCHEMA_VERSION == 1 and _user_version(tmp_path / DB_FILENAME) == SCHEMA_VERSION


async def test_an_unversioned_dsh_database_is_read_as_it_is_and_stamped_only_when_opened_to_write(
    tmp_path: Path,
) -> None:
    # What dsh wrote before the schema had a version: user_version 0, with dsh's tables.
    path = tmp_path / DB_FILENAME
    store = SqliteSessionStore.open(tmp_path)
    try:
        await store.create(session_id="s", meta={"agent": "a"})
        await store.append("s", [NewEvent(EventKind.USER_MESSAGE, {"n": 1})])
    finally:
        await store.close()
    _set_user_version(path, 0)
    before, stat = path.read_bytes(), path.stat()
    store = SqliteSessionStore.open(tmp_path, create=False)  # `dsh sessions list` and `show`
    try:
        assert [info.id for info in await store.list()] == ["s"]
        assert [event.seq for event in await store.load("s")] == [1]
    finally:
        await store.close()
    # Read, not written: not a byte, and no WAL left to be checkpointed into it later.
    assert path.read_bytes() == before and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == [DB_FILENAME]
    store = SqliteSessionStore.open(tmp_path)  # an agent run's
    try:
        assert (await store.get("s")).event_count == 1
    finally:
        await store.close()
    assert _user_version(path) == SCHEMA_VERSION


@pytest.mark.parametrize("create", [True, False])
def test_a_database_of_a_newer_schema_is_refused_before_anything_is_read_or_written(
    tmp_path: Path, create: bool
) -> None:
    # A later dsh's database, whose schema this dsh does not know: here it lacks a column this dsh
    # reads and has no leases table, which this dsh failed on as another program's database, or
    # (opened to write) went on to add its own tables to.
    path = tmp_path / DB_FILENAME
    _execute(
        path,
        "PRAGMA journal_mode=WAL",
        "CREATE TABLE sessions (id TEXT PRIMARY KEY, created_at REAL NOT NULL, updated_at REAL NOT NULL, "
        "event_count INTEGER NOT NULL DEFAULT 0, metadata TEXT NOT NULL)",
        f"PRAGMA user_version={SCHEMA_VERSION + 1}",
    )
    before = path.read_bytes()
    newer = (
        rf"cannot open session database '{path}': it was written by a newer dsh \(schema version "
        rf"{SCHEMA_VERSION + 1}; this dsh supports version {SCHEMA_VERSION}\); upgrade dsh"
    )
    with pytest.raises(SessionStoreError, match=newer):
        SqliteSessionStore.open(tmp_path, create=create)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [DB_FILENAME]
    assert _user_version(path) == SCHEMA_VERSION + 1


def test_sessions_list_and_show_name_a_database_of_a_newer_schema(tmp_path: Path) -> None:
    import os

    from click.testing import CliRunner

    from dsh_core.cli import main

    home = Path(os.environ["DSH_HOME"])

    async def create() -> None:
        store = SqliteSessionStore.open(home)
        try:
            await store.create(session_id="s")
        finally:
            await store.close()

    asyncio.run(create())
    _set_user_version(home / DB_FILENAME, SCHEMA_VERSION + 1)
    for args in (["list"], ["list", "--json"], ["show", "s"], ["show", "s", "--json"]):
        result = CliRunner().invoke(main, ["sessions", *args])
        assert result.exit_code == 1 and result.stdout == "", (args, result.output, result.exception)
        assert result.stderr == (
            f"dsh: error: cannot open session database {str(home / DB_FILENAME)!r}: it was "
            f"written by a newer dsh (schema version {SCHEMA_VERSION + 1}; this dsh supports "
            f"version {SCHEMA_VERSION}); upgrade dsh\n"
        ), args


@pytest.mark.parametrize("create", [True, False])
def test_a_database_of_a_negative_schema_version_is_no_dsh_database(tmp_path: Path, create: bool) -> None:
    # No dsh writes one; opened to write, it was taken for one from before the version and stamped.
    path = tmp_path / DB_FILENAME
    _set_user_version(path, -1)
    with pytest.raises(
        SessionStoreError,
        match=rf"'{path}': it is not a dsh session database: its schema "
        r"version is -1 \(dsh's are 0 to 1\)",
    ):
        SqliteSessionStore.open(tmp_path, create=create)
    assert _user_version(path) == -1


async def test_a_session_whose_meta_cannot_be_read_is_listed_as_unreadable_among_the_rest(tmp_path: Path) -> None:
    # One damaged row made list() fail for every session: `dsh sessions list` showed none of them.
    store = SqliteSessionStore.open(tmp_path)
    try:
        for session_id in ("a", "b", "c"):
            await store.create(session_id=session_id, meta={"agent": session_id})
    finally:
        await store.close()
    _execute(tmp_path / DB_FILENAME, "UPDATE sessions SET meta = '[1]' WHERE id = 'b'")
    store = SqliteSessionStore.open(tmp_path, create=False)
    try:
        listed = {info.id: info for info in await store.list()}
        assert sorted(listed) == ["a", "b", "c"]
        assert listed["b"].unreadable == "meta is not a JSON object: '[1]'" and listed["b"].meta == {}
        assert [(listed[i].unreadable, listed[i].meta) for i in "ac"] == [
            (None, {"agent": "a"}),
            (None, {"agent": "c"}),
        ]
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("column", "value", "reason"),
    [
        ("updated_at", "'yesterday'", "updated_at is not a time: 'yesterday'"),
        ("created_at", "x'00'", "created_at is not a time: b'\\x00'"),
        ("created_at", "1e300", "created_at is not a time: 1e+300"),
        ("event_count", "'many'", "event_count is not an integer: 'many'"),
        ("event_count", "2.5", "event_count is not an integer: 2.5"),
        ("id", "x'62'", "id is not text: b'b'"),
    ],
)
async def test_a_session_whose_columns_cannot_be_read_is_listed_as_unreadable_among_the_rest(
    tmp_path: Path, column: str, value: str, reason: str
) -> None:
    # A column of the wrong type (edited by hand) came out of list() as it was: `dsh sessions list`
    # then failed for every session with a TypeError, and `show` with one or showed a wrong value.
    store = SqliteSessionStore.open(tmp_path)
    try:
        for session_id in ("a", "b", "c"):
            await store.create(session_id=session_id, meta={"agent": session_id})
    finally:
        await store.close()
    _execute(tmp_path / DB_FILENAME, f"UPDATE sessions SET {column} = {value} WHERE id = 'b'")
    store = SqliteSessionStore.open(tmp_path, create=False)
    try:
        listed = await store.list()
        assert len(listed) == 3
        (bad,) = [info for info in listed if info.unreadable is not None]
        assert bad.unreadable == reason and bad.meta == {}
        assert getattr(bad, column) is None  # what could not be read is not given a value it does not have
        readable = {info.id: info for info in listed if info.unreadable is None}
        assert sorted(readable) == ["a", "c"] and readable["a"].meta == {"agent": "a"}
        if column != "id":
            with pytest.raises(SessionStoreError, match=rf"^session store .*: session 'b': {re.escape(reason)}$"):
                await store.get("b")
    finally:
        await store.close()


async def test_a_session_id_sqlite_cannot_hold_is_no_session_and_cannot_be_created(tmp_path: Path) -> None:
    # An id with a lone surrogate (a command-line argument that is not UTF-8) cannot be UTF-8 text:
    # every method failed with a UnicodeEncodeError from sqlite3 instead of saying there is no such session.
    lease = SessionLease.for_this_run()
    store = SqliteSessionStore.open(tmp_path)
    try:
        await store.create(session_id="a")
        for call in (
            lambda: store.get("a\udcff"),
            lambda: store.load("a\udcff"),
            lambda: store.load_page("a\udcff"),
            lambda: store.acquire("a\udcff", lease),
            lambda: store.break_lease("a\udcff"),
            lambda: store.append("a\udcff", [NewEvent(EventKind.RUN_START, {})]),
        ):
            with pytest.raises(SessionNotFoundError, match=r"^no session 'a\\udcff' in "):
                await call()
        await store.release("a\udcff", lease)  # holds nothing: nothing to release
        with pytest.raises(ValueError, match=r"^create: session_id 'a\\udcff' is not UTF-8 text"):
            await store.create(session_id="a\udcff")
        assert [info.id for info in await store.list()] == ["a"]
    finally:
        await store.close()


async def test_create_refuses_an_empty_session_id_instead_of_choosing_one(tmp_path: Path) -> None:
    # session_id="" was taken for no id: a caller that named its session "" got another id, silently.
    store = SqliteSessionStore.open(tmp_path)
    try:
        with pytest.raises(ValueError, match=r"^create: session_id must not be empty, got ''; pass None for a fresh"):
            await store.create(session_id="")
        assert await store.list() == []
    finally:
        await store.close()


def _older_database(path: Path, *, journal_mode: str) -> None:
    """A database of a dsh from before the ``leases`` table: unversioned, with one session of one event."""
    from dsh_core.sessions.sqlite import _SCHEMA_STATEMENTS

    _execute(
        path,
        f"PRAGMA journal_mode={journal_mode}",
        *(statement for statement in _SCHEMA_STATEMENTS if "leases" not in statement),
        "INSERT INTO sessions (id, created_at, updated_at, event_count, meta) "
        "VALUES ('s', 1.0, 2.0, 1, '{\"agent\": \"a\"}')",
        "INSERT INTO events (session_id, seq, kind, at, payload) VALUES ('s', 1, 'message/user', 2.0, '{\"n\": 1}')",
    )


@pytest.mark.parametrize("journal_mode", ["wal", "delete"])
async def test_opened_without_creating_an_older_database_lacking_a_table_reads_it_and_writes_nothing(
    tmp_path: Path, journal_mode: str
) -> None:
    # `dsh sessions list` and `show` of a database from before the leases table added that table
    # (and stamped the schema version, and switched a rollback-journal database to WAL): a read wrote.
    path = tmp_path / DB_FILENAME
    _older_database(path, journal_mode=journal_mode)
    before, stat = path.read_bytes(), path.stat()
    store = SqliteSessionStore.open(tmp_path, create=False)
    try:
        (info,) = await store.list()
        assert (info.id, info.event_count, info.meta, info.holder) == ("s", 1, {"agent": "a"}, None)
        assert (await store.get("s")).holder is None
        assert [event.payload for event in await store.load("s")] == [{"n": 1}]
        assert [event.seq for event in await store.load_page("s")] == [1]
        # Without a leases table no lease holds a session: nothing to break, and nothing written.
        assert await store.break_lease("s") is None
        with pytest.raises(SessionNotFoundError, match=rf"^no session 'nope' in {re.escape(str(path))}$"):
            await store.break_lease("nope")
        # A write that would need what the database lacks is refused, naming the database and the table.
        with pytest.raises(
            SessionStoreError,
            match=rf"^session store '{path}': cannot lease session "
            r"'s': the database lacks dsh's table\(s\) leases ",
        ):
            await store.acquire("s", SessionLease.for_this_run())
    finally:
        await store.close()
    assert path.read_bytes() == before and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == [DB_FILENAME]
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert "leases" not in {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        assert conn.execute("PRAGMA journal_mode").fetchone() == (journal_mode,)
    finally:
        conn.close()
    store = SqliteSessionStore.open(tmp_path)  # an agent run's completes it
    try:
        assert await store.break_lease("s") is None
    finally:
        await store.close()
    assert _user_version(path) == 1


@pytest.mark.parametrize("journal_mode", ["wal", "delete"])
async def test_breaking_a_lease_taken_after_an_older_database_was_opened_breaks_it(
    tmp_path: Path, journal_mode: str
) -> None:
    # Whether the database had a leases table was decided when the store opened it: a run that added
    # the table and took the session's lease after that was not seen, and `dsh sessions release` said
    # the session was not held by any run (and exited 0) while that run held it.
    _older_database(tmp_path / DB_FILENAME, journal_mode=journal_mode)
    store = SqliteSessionStore.open(tmp_path, create=False)
    try:
        run = SqliteSessionStore.open(tmp_path)  # a run: it adds the leases table, and takes the lease
        lease = SessionLease.for_this_run()
        try:
            await run.acquire("s", lease)
        finally:
            await run.close()
        broken = await store.break_lease("s")
        assert broken is not None and broken.token == lease.token, broken
        assert await store.break_lease("s") is None  # broken: no lease holds it now
    finally:
        await store.close()
    run = SqliteSessionStore.open(tmp_path)
    try:  # the lease was removed from the database, not from a stand-in of it
        assert (await run.get("s")).holder is None
    finally:
        await run.close()


@pytest.mark.parametrize("journal_mode", ["wal", "delete"])
async def test_list_and_get_see_a_lease_taken_after_an_older_database_was_opened(
    tmp_path: Path, journal_mode: str
) -> None:
    # The empty stand-in for the leases table, made when the store opened a database without one,
    # shadowed the table a run added since: `dsh sessions list` and `show` said no run held a
    # session that a live run held (only release looked again).
    _older_database(tmp_path / DB_FILENAME, journal_mode=journal_mode)
    store = SqliteSessionStore.open(tmp_path, create=False)
    try:
        assert (await store.get("s")).holder is None
        run = SqliteSessionStore.open(tmp_path)  # a run: it adds the leases table, and takes the lease
        lease = SessionLease.for_this_run()
        try:
            await run.acquire("s", lease)
        finally:
            await run.close()
        (listed,) = await store.list()
        assert listed.holder is not None and listed.holder.token == lease.token, listed
        got = await store.get("s")
        assert got.holder is not None and got.holder.token == lease.token, got
        assert [event.seq for event in await store.load("s")] == [1]
        broken = await store.break_lease("s")  # and the lease is the file's, as before
        assert broken is not None and broken.token == lease.token, broken
        assert (await store.get("s")).holder is None
        # Nor is a write refused for lacking the table the file has now.
        mine = SessionLease.for_this_run()
        await store.acquire("s", mine)
        held = (await store.get("s")).holder
        assert held is not None and held.token == mine.token, held
    finally:
        await store.close()


async def test_reads_see_the_tables_a_run_made_in_an_empty_database_after_it_was_opened(tmp_path: Path) -> None:
    # An empty database (no table yet) opened to read has a stand-in for every table of dsh's: a run
    # that made the schema and a session since was not seen by the store opened before it.
    (tmp_path / DB_FILENAME).write_bytes(b"")
    store = SqliteSessionStore.open(tmp_path, create=False)
    try:
        assert await store.list() == []
        run = SqliteSessionStore.open(tmp_path)
        lease = SessionLease.for_this_run()
        try:
            await run.create(session_id="s", meta={"agent": "a"}, lease=lease)
            await run.append("s", [NewEvent(EventKind.USER_MESSAGE, {"n": 1})], lease=lease)
        finally:
            await run.close()
        (listed,) = await store.list()
        assert (listed.id, listed.event_count, listed.meta) == ("s", 1, {"agent": "a"})
        assert listed.holder is not None and listed.holder.token == lease.token, listed
        assert (await store.get("s")).stored_events == 1
        assert [event.payload for event in await store.load("s")] == [{"n": 1}]
        assert [event.seq for event in await store.load_page("s")] == [1]
    finally:
        await store.close()


#: The reads a read-only store serves ``dsh sessions list`` and ``show`` with, and the one write
#: ``dsh sessions release`` makes with it, each of session "s".
_READS_AND_RELEASE: dict[str, Callable[[SqliteSessionStore], Awaitable[object]]] = {
    "list": lambda store: store.list(),
    "get": lambda store: store.get("s"),
    "load": lambda store: store.load("s"),
    "load_page": lambda store: store.load_page("s"),
    "break_lease": lambda store: store.break_lease("s"),
}


@pytest.mark.parametrize("older", [False, True], ids=["complete", "without-leases"])
async def test_a_read_only_store_refuses_a_newer_schema_stamped_after_it_opened(tmp_path: Path, older: bool) -> None:
    # The schema's version was checked only when the store opened the database: a newer dsh that took
    # it over while `dsh sessions show` read it page by page (its schema may be anything) was read as
    # this dsh's, and `dsh sessions release` broke a lease in it.
    path = tmp_path / DB_FILENAME
    lease = SessionLease.for_this_run()
    if older:  # stand-ins: a read-only store of it reads (and refreshes) in a transaction of its own
        _older_database(path, journal_mode="wal")
    else:
        await _leased_session(tmp_path, lease)
    store = SqliteSessionStore.open(tmp_path, create=False)
    try:
        assert [info.id for info in await store.list()] == ["s"]
        _set_user_version(path, SCHEMA_VERSION + 1)
        newer = _refused_as_newer(path, SCHEMA_VERSION + 1)
        for name, call in _READS_AND_RELEASE.items():
            with pytest.raises(SessionStoreError) as caught:
                await call(store)
            assert str(caught.value) == newer, name
        # Looked at by each read, not decided once: the database a dsh of this version writes again is read.
        _set_user_version(path, SCHEMA_VERSION)
        assert [info.id for info in await store.list()] == ["s"]
    finally:
        await store.close()
    if not older:  # the refused release wrote nothing: the run's lease holds the session still
        run = SqliteSessionStore.open(tmp_path)
        try:
            holder = (await run.get("s")).holder
            assert holder is not None and holder.token == lease.token, holder
        finally:
            await run.close()


@pytest.mark.parametrize(
    ("opened", "statements", "reason"),
    [
        (
            "complete",
            [
                "DROP TABLE leases",
                "DROP TABLE events",
                "DROP TABLE sessions",
                "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)",
            ],
            "it has no table 'sessions'",
        ),
        (
            "complete",
            ["DROP TABLE sessions", "CREATE TABLE sessions (id INTEGER PRIMARY KEY, name TEXT)"],
            "its table 'sessions' has no column(s) created_at, updated_at, event_count, meta",
        ),
        ("empty", ["CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)"], "it has no table 'sessions'"),
        # Its own table, not the stand-in of its name, looked at: the stand-in has dsh's columns.
        (
            "without-leases",
            ["CREATE TABLE leases (id INTEGER PRIMARY KEY, text TEXT)"],
            "its table 'leases' has no column(s) session_id, token, holder, acquired_at",
        ),
    ],
    ids=["tables-replaced", "sessions-reshaped", "empty-then-taken", "without-leases-then-another-leases"],
)
async def test_a_read_only_store_refuses_a_database_another_program_made_of_it_after_it_opened(
    tmp_path: Path, opened: str, statements: list[str], reason: str
) -> None:
    # Whether the database was dsh's was decided when the store opened it: another program's tables put
    # in it since were read as dsh's (an empty database's stand-ins went on reading as an empty store),
    # or failed with a bare "no such table"/"no such column" naming no cause.
    path = tmp_path / DB_FILENAME
    if opened == "empty":
        path.write_bytes(b"")
    elif opened == "without-leases":
        _older_database(path, journal_mode="wal")
    else:
        run = SqliteSessionStore.open(tmp_path)
        try:
            await run.create(session_id="s")
        finally:
            await run.close()
    store = SqliteSessionStore.open(tmp_path, create=False)
    try:
        assert len(await store.list()) == (opened != "empty")
        _execute(path, *statements)
        foreign = _refused_as_foreign(path, reason)
        for name, call in _READS_AND_RELEASE.items():
            with pytest.raises(SessionStoreError) as caught:
                await call(store)
            assert str(caught.value) == foreign, name
    finally:
        await store.close()


#: The writes a run's store (``create=True``) makes for an agent run, each of session "s" (held by ``lease``).
_RUN_WRITES: dict[str, Callable[[SqliteSessionStore, SessionLease], Awaitable[object]]] = {
    "append": lambda store, lease: store.append("s", [NewEvent(EventKind.TOOL_CALL, {"n": 2})], lease=lease),
    "create": lambda store, lease: store.create(session_id="t", lease=lease),
    "acquire": lambda store, lease: store.acquire("s", lease),
    "release": lambda store, lease: store.release("s", lease),
}


async def test_a_run_store_refuses_to_write_a_newer_schema_stamped_after_it_opened(tmp_path: Path) -> None:
    # A run's store checked the schema's version only when it opened the database: a newer dsh that
    # took it over while the run went on appending (its schema may be anything) got rows of this
    # dsh's shape written into it.
    path = tmp_path / DB_FILENAME
    lease = SessionLease.for_this_run()
    run = SqliteSessionStore.open(tmp_path)
    try:
        await _leased_session(tmp_path, lease, run)
        _set_user_version(path, SCHEMA_VERSION + 1)
        before = _dump(path)
        newer = _refused_as_newer(path, SCHEMA_VERSION + 1)
        for name, call in _RUN_WRITES.items():
            with pytest.raises(SessionStoreError) as caught:
                await call(run, lease)
            assert str(caught.value) == newer, name
        assert _dump(path) == before  # nothing written to the newer dsh's database
        # Looked at by each write, not decided once: the database a dsh of this version writes again is written.
        _set_user_version(path, SCHEMA_VERSION)
        # The refused writes wrote nothing: one event, no session "t", and the lease still held.
        assert [(event.seq, event.payload) for event in await run.load("s")] == [(1, {"n": 1})]
        assert [info.id for info in await run.list()] == ["s"]
        holder = (await run.get("s")).holder
        assert holder is not None and holder.token == lease.token, holder
        (stored,) = await run.append("s", [NewEvent(EventKind.TOOL_CALL, {"n": 2})], lease=lease)
        assert stored.seq == 2
    finally:
        await run.close()


#: Another program's changes to a dsh database after a store opened it, each with how opening it then is refused.
#: "column-renamed" leaves the version and the table names as they were, so that SQLite's schema cookie (``PRAGMA
#: schema_version``) moving is the only sign of it the store can cheaply read.
_TAKEOVERS: Final[dict[str, tuple[list[str], str]]] = {
    "tables-replaced": (
        [
            "DROP TABLE leases",
            "DROP TABLE events",
            "DROP TABLE sessions",
            "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)",
        ],
        "it has no table 'sessions'",
    ),
    "sessions-reshaped": (
        [
            "DROP TABLE leases",
            "DROP TABLE events",
            "DROP TABLE sessions",
            "CREATE TABLE sessions (id INTEGER PRIMARY KEY, name TEXT)",
        ],
        "its table 'sessions' has no column(s) created_at, updated_at, event_count, meta",
    ),
    "leases-reshaped": (
        ["DROP TABLE leases", "CREATE TABLE leases (id INTEGER PRIMARY KEY, text TEXT)"],
        "its table 'leases' has no column(s) session_id, token, holder, acquired_at",
    ),
    "column-renamed": (
        ["ALTER TABLE events RENAME COLUMN payload TO body"],
        "its table 'events' has no column(s) payload",
    ),
}


def _takeovers(*names: str) -> list[object]:
    """The takeovers ``names`` of :data:`_TAKEOVERS`, as ``(statements, reason)`` parameters named by them."""
    return [pytest.param(*_TAKEOVERS[name], id=name) for name in names]


@pytest.mark.parametrize(
    ("statements", "reason"), _takeovers("tables-replaced", "sessions-reshaped", "leases-reshaped")
)
async def test_a_run_store_refuses_to_write_a_database_another_program_made_of_it_after_it_opened(
    tmp_path: Path, statements: list[str], reason: str
) -> None:
    # Whether the database was dsh's was decided when the run's store opened it: another program's
    # tables put in it since were written as dsh's, or failed with a bare "no such table"/"no such column".
    path = tmp_path / DB_FILENAME
    lease = SessionLease.for_this_run()
    run = SqliteSessionStore.open(tmp_path)
    try:
        await _leased_session(tmp_path, lease, run)
        _execute(path, *statements)
        before = _dump(path)  # what the other program left, to be left as it is
        foreign = _refused_as_foreign(path, reason)
        for name, call in _RUN_WRITES.items():
            with pytest.raises(SessionStoreError) as caught:
                await call(run, lease)
            assert str(caught.value) == foreign, name
    finally:
        await run.close()
    assert _dump(path) == before  # nothing written: neither a row nor a table


def _table_names(path: Path) -> list[str]:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        return sorted(row[0] for row in conn.execute("SELECT name FROM sqlite_master"))
    finally:
        conn.close()


@pytest.mark.parametrize(("statements", "reason"), _takeovers("tables-replaced", "column-renamed"))
async def test_a_read_only_store_refuses_a_file_taken_over_between_two_of_its_reads(
    tmp_path: Path, statements: list[str], reason: str
) -> None:
    # The tables are looked at again only when the schema cookie has moved since the last look: a change
    # between two reads of the same store, each of which found the file dsh's, must still be seen.
    path = tmp_path / DB_FILENAME
    lease = SessionLease.for_this_run()
    await _leased_session(tmp_path, lease)
    store = SqliteSessionStore.open(tmp_path, create=False)
    try:
        assert [info.id for info in await store.list()] == ["s"]
        assert [event.payload for event in await store.load("s")] == [{"n": 1}]
        version, names = _user_version(path), _table_names(path)
        _execute(path, *statements)
        if len(statements) == 1:  # neither the version nor a table's name tells: only the cookie
            assert (_user_version(path), _table_names(path)) == (version, names)
        foreign = _refused_as_foreign(path, reason)
        for name, call in _READS_AND_RELEASE.items():
            with pytest.raises(SessionStoreError) as caught:
                await call(store)
            assert str(caught.value) == foreign, name
    finally:
        await store.close()


@pytest.mark.parametrize("create", [False, True], ids=["read-only", "run"])
async def test_a_store_reading_an_unchanged_file_again_does_not_look_at_its_tables_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, create: bool
) -> None:
    # Looking at the tables (sqlite_master and each table's columns) at every read and write of a
    # read-only store cost as much as the read; a run's store did not look at its reads at all.
    path = tmp_path / DB_FILENAME
    lease = SessionLease.for_this_run()
    await _leased_session(tmp_path, lease)
    looked: list[SqliteSessionStore] = []
    check_tables = SqliteSessionStore._check_tables

    def spy(self: SqliteSessionStore, conn: sqlite3.Connection) -> set[str]:
        looked.append(self)
        return check_tables(self, conn)

    monkeypatch.setattr(SqliteSessionStore, "_check_tables", spy)
    store = SqliteSessionStore.open(tmp_path, create=create)
    other = SqliteSessionStore.open(tmp_path)  # another run's, writing to the file meanwhile
    try:
        await store.list()
        looked.clear()
        for _ in range(2):
            assert [info.id for info in await store.list()] == ["s"]
            assert (await store.get("s")).stored_events >= 1
            assert (await store.load("s"))[0].seq == 1
            assert (await store.load_page("s"))[0].seq == 1
        # Rows written, by another run or by this one, change no table: still not looked at.
        await other.append("s", [NewEvent(EventKind.TOOL_CALL, {"n": 2})], lease=lease)
        if create:
            await store.append("s", [NewEvent(EventKind.TOOL_CALL, {"n": 3})], lease=lease)
        events = 3 if create else 2
        assert (await store.get("s")).stored_events == events
        assert looked.count(store) == 0
        # A table created (not one of dsh's, which are left as they are) moves the cookie: looked at once.
        _execute(path, "CREATE TABLE notes (id INTEGER PRIMARY KEY)")
        assert (await store.get("s")).stored_events == events
        assert (await store.load("s"))[-1].seq == events
        assert looked.count(store) == 1
    finally:
        await other.close()
        await store.close()


async def test_a_read_only_store_looks_again_after_a_read_that_rolled_back(tmp_path: Path) -> None:
    # The stand-in of a table the file has gained is dropped in the read's own transaction: a read that
    # fails rolls it back, and the store must not then take the file's tables as already looked at (the
    # stand-in, back, would hide the run's lease for as long as the store is open); nor may a change
    # after such a read go unseen.
    path = tmp_path / DB_FILENAME
    _older_database(path, journal_mode="wal")
    store = SqliteSessionStore.open(tmp_path, create=False)
    try:
        assert (await store.get("s")).holder is None
        lease = SessionLease.for_this_run()
        run = SqliteSessionStore.open(tmp_path)  # adds the leases table the older dsh's database lacks
        try:
            await run.acquire("s", lease)
        finally:
            await run.close()
        with pytest.raises(SessionNotFoundError):
            await store.get("nope")  # looks at the changed file, drops the stand-in, and rolls back
        holder = (await store.get("s")).holder
        assert holder is not None and holder.token == lease.token, holder
        with pytest.raises(SessionNotFoundError):
            await store.load("nope")
        statements, reason = _TAKEOVERS["leases-reshaped"]
        _execute(path, *statements)
        foreign = _refused_as_foreign(path, reason)
        for name, call in _READS_AND_RELEASE.items():
            with pytest.raises(SessionStoreError) as caught:
                await call(store)
            assert str(caught.value) == foreign, name
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("statements", "reason"),
    [
        pytest.param([f"PRAGMA user_version={SCHEMA_VERSION + 1}"], None, id="newer"),
        *_takeovers("tables-replaced", "column-renamed"),
    ],
)
async def test_a_run_store_refuses_to_read_a_database_taken_over_after_it_opened(
    tmp_path: Path, statements: list[str], reason: str | None
) -> None:
    # A run's store looked at the file again only as it wrote: a run reading its session as it starts
    # (resumed) read a newer dsh's schema, or another program's tables, as this dsh's.
    path = tmp_path / DB_FILENAME
    lease = SessionLease.for_this_run()
    run = SqliteSessionStore.open(tmp_path)
    try:
        await _leased_session(tmp_path, lease, run)
        assert [event.payload for event in await run.load("s")] == [{"n": 1}]
        _execute(path, *statements)
        refused = _refused_as_newer(path, SCHEMA_VERSION + 1) if reason is None else _refused_as_foreign(path, reason)
        reads: dict[str, Callable[[], Awaitable[object]]] = {
            "load": lambda: run.load("s"),
            "load_page": lambda: run.load_page("s"),
            "get": lambda: run.get("s"),
            "list": run.list,
        }
        for name, read in reads.items():
            with pytest.raises(SessionStoreError) as caught:
                await read()
            assert str(caught.value) == refused, name
        if reason is None:  # looked at by each read: the database a dsh of this version writes again is read
            _set_user_version(path, SCHEMA_VERSION)
            assert [event.payload for event in await run.load("s")] == [{"n": 1}]
    finally:
        await run.close()


def _dump(path: Path) -> list[str]:
    """The database at ``path`` as SQL text: its schema and every row."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


@pytest.mark.parametrize("journal_mode", ["wal", "delete"])
def test_sessions_release_on_a_database_without_leases_says_not_held_and_writes_nothing(journal_mode: str) -> None:
    # An older or foreign store (or one no run has used since leases came) has no leases table:
    # `dsh sessions release` failed saying the database lacks it, where no run can hold the session.
    from click.testing import CliRunner

    from dsh_core.cli import main

    home = dsh_home()
    home.mkdir()
    path = home / DB_FILENAME
    _older_database(path, journal_mode=journal_mode)
    before, stat = path.read_bytes(), path.stat()
    result = CliRunner().invoke(main, ["sessions", "release", "s"])
    assert result.exit_code == 0 and result.exception is None, (result.output, result.exception)
    assert (result.stdout, result.stderr) == ("session s was not held by any run\n", "")
    result = CliRunner().invoke(main, ["sessions", "release", "nope"])  # no such session: as anywhere
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == f"dsh: error: no session 'nope' in {path}\n"
    assert path.read_bytes() == before and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert sorted(p.name for p in home.iterdir()) == [DB_FILENAME]
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert "leases" not in {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
        assert conn.execute("PRAGMA user_version").fetchone() == (0,)
    finally:
        conn.close()


def test_sessions_commands_name_a_database_without_a_sessions_table() -> None:
    # `dsh sessions release ID` (and `show ID`) said "no session ID" of another program's database.
    from click.testing import CliRunner

    from dsh_core.cli import main

    home = dsh_home()
    home.mkdir()
    path = home / DB_FILENAME
    _execute(path, "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
    before = path.read_bytes()
    for args in (["release", "s"], ["show", "s"], ["show", "s", "--json"], ["list"], ["list", "--json"]):
        result = CliRunner().invoke(main, ["sessions", *args])
        assert (result.exit_code, result.stdout) == (1, ""), (args, result.output, result.exception)
        assert result.stderr == (
            f"dsh: error: cannot open session database {str(path)!r}: it is not a dsh session "
            "database: it has no table 'sessions' (another program's database? [sessions] "
            "home, or DSH_HOME, names where dsh keeps its own)\n"
        ), args
    assert path.read_bytes() == before


@pytest.mark.parametrize("value", ["'yesterday'", "x'00'", "1e300", "-1e300"])
async def test_a_session_whose_update_time_cannot_be_read_is_listed_after_the_rest(tmp_path: Path, value: str) -> None:
    # ORDER BY updated_at DESC put a text, a BLOB or a far-future number before every time: a damaged
    # session was listed as the most recently updated, and `list --limit N` showed it before recent ones.
    store = SqliteSessionStore.open(tmp_path)
    try:
        for session_id in ("20250101-a", "20250102-b", "20250103-c", "20250104-d"):
            await store.create(session_id=session_id)
    finally:
        await store.close()
    _execute(
        tmp_path / DB_FILENAME,
        "UPDATE sessions SET updated_at = CASE id WHEN '20250101-a' THEN 1.0 WHEN '20250103-c' THEN 3 ELSE 2.0 END",
        # Of two whose times cannot be read, the newer id first: dsh's ids sort as the time they were made.
        f"UPDATE sessions SET updated_at = {value} WHERE id IN ('20250102-b', '20250104-d')",
    )
    store = SqliteSessionStore.open(tmp_path, create=False)
    try:
        listed = await store.list()
        assert [info.id for info in listed] == ["20250103-c", "20250101-a", "20250104-d", "20250102-b"]
        assert [info.unreadable is None for info in listed] == [True, True, False, False]
        assert [info.id for info in await store.list(limit=2)] == ["20250103-c", "20250101-a"]
    finally:
        await store.close()


async def test_get_reads_how_many_events_are_stored_with_the_record(tmp_path: Path) -> None:
    store = SqliteSessionStore.open(tmp_path)
    try:
        created = await store.create(session_id="a")
        assert created.stored_events == 0
        await store.append("a", [NewEvent("one"), NewEvent("two")])
        info = await store.get("a")
        assert (info.event_count, info.stored_events) == (2, 2)
        _execute(tmp_path / DB_FILENAME, "UPDATE sessions SET event_count = 5 WHERE id = 'a'")
        info = await store.get("a")
        assert (info.event_count, info.stored_events) == (5, 2)
        # list() reads no count of events (it would read every session's): it does not know them.
        assert [listed.stored_events for listed in await store.list()] == [None]
    finally:
        await store.close()
