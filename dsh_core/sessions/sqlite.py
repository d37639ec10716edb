"""The embedded default session store: one SQLite database under dsh's home.

Layout: ``<home>/sessions.db`` in WAL mode with ``synchronous=NORMAL``: a
committed transaction survives the process being killed (SIGKILL included);
only an operating-system crash may lose the last commits. Each
:meth:`SqliteSessionStore.append` is one ``BEGIN IMMEDIATE`` transaction, so a
batch is committed whole or not at all and ``seq`` numbers never have gaps.
Leases live in the ``leases`` table (one row per held session, the holder as
JSON); :meth:`SqliteSessionStore.acquire` reads and claims one in one
``BEGIN IMMEDIATE`` transaction, so of two processes racing for a session one
wins and the other sees its lease.

All database work runs on one dedicated thread: the event loop never blocks
on disk, the connection is only ever used by the thread that opened it, and
writers are serialized without a lock (the thread takes jobs in order).

A cancelled write commits nothing: the cancellation and the database thread's
``COMMIT`` race for one decision (:class:`_Fate`). If the cancellation wins,
the job is dropped or rolls back and the caller gets ``CancelledError``; if
the ``COMMIT`` was already under way, the write completes and returns (the
caller is told it happened) and the cancellation takes effect at the
caller's next ``await``.

Opened with ``create=False`` (``dsh sessions list``, ``show``, ``release``: commands
that only read, or change an existing session), the store creates neither the home
nor the database: where none exists yet, it reads as an empty one (an empty
database in memory stands in for it) and :meth:`SqliteSessionStore.create` fails.

The schema's version is the database's ``PRAGMA user_version``, :data:`SCHEMA_VERSION`. A change
that a dsh of the version before would misread or fail on bumps it (a table, column or index
removed, renamed or given another meaning; a column added that such a dsh's writes would not fill,
as a ``NOT NULL`` one without a default), together with a migration from each older version; a
table or index only added, which an older dsh neither reads nor needs, does not. A new database
gets the version in the transaction that creates its schema. A database written before there was a
version (``user_version`` 0, with dsh's tables) is read as it is, and stamped when it is opened to
write (``create=True``, an agent run), in the transaction that adds what its schema lacks. A database
of a newer version is refused, opened to read or to write, before anything else of it is read or
anything written, naming the file, its version and this dsh's: its schema may be anything. So is
another program's database, one with tables but no ``sessions`` table (every dsh's has one) or with a
table of dsh's name but not its columns: refused, naming the file, before anything of it is changed.
Either store, opened to read or to write, looks at both again in each read's and write's own transaction
(a write's ``BEGIN IMMEDIATE``), before anything else of the file is read or written there: a newer dsh,
or another program, may have taken the file over since it was opened (``dsh sessions show`` reads a long
session a page at a time; a run appends for as long as it runs, and an older dsh's rows must not go into
a newer dsh's schema, nor into another program's tables; nor may a run resumed read them as its
session). The read or write is refused as opening the file then would have been, with the same error;
nothing of a refused write is written, and a run fails with it. (A table of dsh's that another program
drops meanwhile is not stood in for, as opening would: the read fails, naming the store and the table.
dsh never drops one.) The version is read each time (a header field). The tables are read again only
when SQLite's schema cookie (``PRAGMA main.schema_version``, another header field, which every table or
index created, dropped or altered in the file changes, and the connection's temporary tables do not) has
moved since the store last found them dsh's in a transaction that committed: reading them costs about a
sixth of an append, the two header fields a fiftieth.

Opened with ``create=False``, an existing database is never written to by opening it: neither its
schema, its version nor its journal mode is changed. A table of dsh's that it lacks (one an older dsh
did not have yet) reads as empty: an empty temporary table of the connection, which is not in the
file, stands in for it; a write to such a database is refused, naming it and the tables it lacks
(:meth:`SqliteSessionStore.release` and the other writes would otherwise write to the stand-in, and
be lost), until a dsh opens it to write and adds them. Only breaking a lease where there is no
``leases`` table is no write: no lease holds a session there, so there is none to break. What the
database lacks is looked at again with its tables, not only when it was opened: a run may have added
them since (which moves the schema cookie), and the stand-in of one the file now has is dropped, in the
read's own transaction, so that the read sees the file's table (a stand-in shadows the file's table of
its name). A read that fails rolls the drop back, and the stand-in with it: the cookie it read is then
not taken as looked at, and the next read looks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, TypeVar

from dsh_core.sessions.events import NewEvent, SessionEvent, SessionInfo, decode_payload, encode_payload
from dsh_core.sessions.lease import SessionLease, holder_alive
from dsh_core.sessions.store import (
    PAGE_EVENTS,
    SessionBusyError,
    SessionLeaseLostError,
    SessionNotFoundError,
    SessionStoreError,
)

__all__ = ["SqliteSessionStore", "DB_FILENAME", "PAGE_CHARS", "SCHEMA_VERSION", "new_session_id"]

T = TypeVar("T")

#: What :meth:`SqliteSessionStore._check_again` found: the file's schema cookie, and the tables of dsh's it lacks.
_Looked = tuple[int, tuple[str, ...]]

#: The database file name inside dsh's home.
DB_FILENAME: Final = "sessions.db"

#: About how many characters of payload text a page of :meth:`SqliteSessionStore.load_page` holds at most
#: (it ends after the event that reaches it): a thousand events of a megabyte each are not one page.
PAGE_CHARS: Final = 1 << 20

#: SQLite's largest INTEGER: no seq is larger.
_LARGEST_SEQ: Final = 2**63 - 1

#: The version of :data:`_SCHEMA`, kept as the database's ``PRAGMA user_version`` (see the module docstring).
SCHEMA_VERSION: Final = 1

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    event_count INTEGER NOT NULL DEFAULT 0,
    meta TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS events (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    kind TEXT NOT NULL,
    root_call_id TEXT,
    parent_call_id TEXT,
    sub_call_id TEXT,
    at REAL NOT NULL,
    payload TEXT NOT NULL,
    PRIMARY KEY (session_id, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS events_root ON events(session_id, root_call_id);
CREATE INDEX IF NOT EXISTS sessions_updated ON sessions(updated_at);
CREATE TABLE IF NOT EXISTS leases (
    session_id TEXT PRIMARY KEY REFERENCES sessions(id) ON DELETE CASCADE,
    token TEXT NOT NULL,
    holder TEXT NOT NULL,
    acquired_at REAL NOT NULL
);
"""


#: The columns dsh reads of each table of :data:`_SCHEMA`.
_COLUMNS: Final = {
    "sessions": ("id", "created_at", "updated_at", "event_count", "meta"),
    "events": ("session_id", "seq", "kind", "root_call_id", "parent_call_id", "sub_call_id", "at", "payload"),
    "leases": ("session_id", "token", "holder", "acquired_at"),
}


#: The tables and indexes :data:`_SCHEMA` creates.
_SCHEMA_NAMES: Final = frozenset({"sessions", "events", "events_root", "sessions_updated", "leases"})

#: :data:`_SCHEMA` a statement at a time (no statement of it holds a ``;``), to run in a transaction
#: of the store's own: ``executescript`` would first commit any transaction open.
_SCHEMA_STATEMENTS: Final = tuple(statement.strip() for statement in _SCHEMA.split(";") if statement.strip())


def new_session_id() -> str:
    """A fresh, time-sortable session id: ``20250101-120000-a1b2c3``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


_SELECT_INFO: Final = (
    "SELECT id, created_at, updated_at, event_count, meta, leases.holder "
    "FROM sessions LEFT JOIN leases ON leases.session_id = sessions.id"
)

#: :data:`_SELECT_INFO` and how many events are stored (``get``): one statement reads one snapshot of
#: the database, so the count is of the same state as the record, whatever a writer commits meanwhile.
_SELECT_INFO_COUNTED: Final = (
    "SELECT id, created_at, updated_at, event_count, meta, leases.holder, "
    "(SELECT COUNT(*) FROM events WHERE events.session_id = sessions.id) "
    "FROM sessions LEFT JOIN leases ON leases.session_id = sessions.id"
)


#: How an unreadable stored lease is named where one must be: it is not this run's, and holds nothing.
_UNREADABLE_LEASE: Final = SessionLease.unreadable()


def _stored_lease(text: str) -> SessionLease | None:
    """The lease a ``leases.holder`` column holds; ``None`` if it cannot be read (acquire takes such a lease over)."""
    try:
        return SessionLease.from_json(json.loads(text))
    except ValueError:
        return None


def _shown(value: object) -> str:
    """A stored value as a reason names it: its repr, cut to about 80 characters (a text's first 80)."""
    if value is None:
        return "NULL"
    return repr(value[:80]) if isinstance(value, str) else repr(value)[:80]


#: The times a stored ``created_at``/``updated_at`` may be: seconds since the epoch of years 1 to 9999 (UTC).
_EARLIEST: Final = -62_135_596_800
_LATEST: Final = 253_402_300_799

#: Whether a row's ``updated_at`` is a time, as :func:`_is_time` asks it (but for what the platform can
#: show): ``list`` orders by it in SQL, so that ``LIMIT`` leaves out the right sessions.
_UPDATED_IS_TIME: Final = (
    f"(typeof(updated_at) IN ('integer', 'real') AND updated_at BETWEEN {_EARLIEST} AND {_LATEST})"
)


def _is_time(value: object) -> bool:
    """Whether a stored ``created_at``/``updated_at`` is seconds since the epoch that can be shown as a date."""
    if not isinstance(value, int | float) or not math.isfinite(value) or not _EARLIEST <= value <= _LATEST:
        return False
    try:
        time.localtime(value)
    except (OverflowError, OSError, ValueError):  # past what the platform's time_t holds
        return False
    return True


def _info(path: Path, row: tuple[Any, ...], *, listed: bool = False) -> SessionInfo:
    """The :class:`SessionInfo` of a row of ``_SELECT_INFO`` or ``_SELECT_INFO_COUNTED`` (of the database at ``path``).

    A row that cannot be read is a :class:`SessionStoreError` naming it and each column that cannot
    be; ``listed``, it is a :class:`SessionInfo` saying why it is ``unreadable``, those columns ``None``.
    """
    session_id, created_at, updated_at, event_count = row[:4]
    stored_events = row[6] if len(row) > 6 else None
    holder = None if row[5] is None else _stored_lease(row[5])
    # A row edited by hand, or damaged: each column of the wrong type named, rather than failing
    # later (a TypeError drawing a date) or being shown as what it is not. SQLite's column types
    # are affinities: a column holds whatever was written to it.
    problems = []
    if not isinstance(session_id, str):
        problems.append(f"id is not text: {_shown(session_id)}")
        session_id = None
    if not _is_time(created_at):
        problems.append(f"created_at is not a time: {_shown(created_at)}")
        created_at = None
    if not _is_time(updated_at):
        problems.append(f"updated_at is not a time: {_shown(updated_at)}")
        updated_at = None
    if not isinstance(event_count, int):
        problems.append(f"event_count is not an integer: {_shown(event_count)}")
        event_count = None
    try:
        meta = decode_payload(row[4])  # as strict as a payload: no NaN, which `list --json` would write out
    except (ValueError, TypeError, RecursionError):  # TypeError: a NULL (a table without dsh's NOT NULL)
        meta = None
    if not isinstance(meta, dict):
        problems.append(f"meta is not a JSON object: {_shown(row[4] if row[4] is None else str(row[4]))}")
    if problems:
        reason = "; ".join(problems)
        if listed:  # one damaged session does not keep the others from being listed
            return SessionInfo(session_id, created_at, updated_at, event_count, {}, holder, unreadable=reason)
        raise SessionStoreError(f"session store {str(path)!r}: session {row[0]!r}: {reason}")
    return SessionInfo(session_id, created_at, updated_at, event_count, meta, holder, stored_events=stored_events)


def _event(path: Path, session_id: str, row: tuple[Any, ...]) -> SessionEvent:
    """The :class:`SessionEvent` of a row ``(seq, kind, at, payload, root, parent, sub)`` of session ``session_id``."""
    seq, kind, at, payload, root, parent, sub = row
    # A row edited by hand, or damaged: a column of the wrong type named here, not written out as
    # it is (a BLOB is no JSON: `show --json` failed with a TypeError) or failing further on.
    problems = []
    if not isinstance(seq, int):
        problems.append(f"seq is not an integer: {_shown(seq)}")
    if not isinstance(kind, str):
        problems.append(f"kind is not text: {_shown(kind)}")
    elif not kind:
        problems.append("kind is empty")
    if not _is_time(at):
        problems.append(f"at is not a time: {_shown(at)}")
    for name, value in (("root_call_id", root), ("parent_call_id", parent), ("sub_call_id", sub)):
        if value is not None and not isinstance(value, str):
            problems.append(f"{name} is not text: {_shown(value)}")
    if problems:
        raise SessionStoreError(
            f"session store {str(path)!r}: session {session_id!r} event {_shown(seq)}: {'; '.join(problems)}"
        )
    try:
        value = decode_payload(payload)
    except (ValueError, TypeError, RecursionError) as error:
        raise SessionStoreError(
            f"session store {str(path)!r}: session {session_id!r} event {seq}: payload is not JSON: {error}"
        ) from None
    return SessionEvent(session_id, seq, kind, value, at, root, parent, sub)


def _is_utf8(text: str) -> bool:
    """Whether SQLite can hold ``text``: not if it has a lone surrogate (a command-line argument that was not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Abandoned(Exception):
    """A write whose caller was cancelled before it committed: rolled back, and nobody waits for it."""


class _Fate:
    """Whether one write commits: decided once, by its ``COMMIT`` or by its caller's cancellation, whichever first."""

    __slots__ = ("_lock", "_decided")

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the database thread and the event loop decide
        self._decided: str | None = None

    def _decide(self, outcome: str) -> bool:
        with self._lock:
            if self._decided is None:
                self._decided = outcome
            return self._decided == outcome

    def commit(self) -> bool:
        """Claim the write for ``COMMIT`` (database thread); ``False`` if its caller has given it up."""
        return self._decide("commit")

    def abandon(self) -> bool:
        """Give the write up (cancelled caller); ``False`` if its ``COMMIT`` is already under way."""
        return self._decide("abandon")


def _schema_cookie(conn: sqlite3.Connection) -> int:
    """The database file's schema cookie: SQLite changes it with every table or index created, dropped or
    altered in the file, by any connection; the connection's temporary tables (the stand-ins) leave it be."""
    return int(conn.execute("PRAGMA main.schema_version").fetchone()[0])


def _file_tables(conn: sqlite3.Connection) -> set[str]:
    """The tables of the database file (not the connection's temporary ones), lower-cased.

    SQLite's table names ignore case (a file's table "Leases" is the table leases), and its own
    tables (``sqlite_sequence``, ``sqlite_stat1``, ...) are no program's, so they are left out.
    """
    rows = conn.execute(
        "SELECT name FROM main.sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'"
    )
    return {row[0].lower() for row in rows}


class SqliteSessionStore:
    """:class:`~dsh_core.sessions.store.SessionStore` on SQLite (stdlib ``sqlite3``)."""

    def __init__(self, path: Path, *, busy_timeout_ms: int = 5000, create: bool = True) -> None:
        self.path = path
        self._busy_timeout_ms = busy_timeout_ms
        self._create = create
        #: Opened with ``create=False`` where there was no database: an empty one in memory stands in.
        self.absent = False
        #: Opened with ``create=False``, the tables of dsh's the database lacks (empty temporary ones stand in).
        self._lacking: tuple[str, ...] = ()
        #: The file's schema cookie (:func:`_schema_cookie`) when the store last found its tables dsh's (and,
        #: opened to read, dropped the stand-ins of those it has gained) in a transaction that committed.
        self._checked_at: int | None = None
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsh-sqlite")
        self._conn: sqlite3.Connection | None = None
        try:
            # Opened synchronously so that a bad path fails at boot, naming the file.
            self._executor.submit(self._connect).result()
        except BaseException:
            self._executor.shutdown(wait=True)
            self._executor = None
            raise

    @classmethod
    def open(cls, home: Path, *, create: bool = True) -> SqliteSessionStore:
        """Open (creating it and ``home`` if needed, unless ``create`` is false) ``<home>/sessions.db``.

        The factory registered as store ``sqlite``. With ``create=False`` nothing is created:
        a database that does not exist yet reads as an empty one.
        """
        home = Path(home).expanduser()
        if not create:
            return cls(home / DB_FILENAME, create=False)
        try:
            home.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as error:
            raise SessionStoreError(f"cannot create dsh home {str(home)!r}: {error.strerror or error}") from None
        return cls(home / DB_FILENAME)

    def __repr__(self) -> str:
        return f"<SqliteSessionStore {str(self.path)!r}{' closed' if self._executor is None else ''}>"

    # -- the database thread ---------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        """The database's connection; without ``create``, never one that creates the file (``mode=rw``).

        Where there is no database to open then, an empty one in memory (:attr:`absent`).
        """
        if self._create:
            return sqlite3.connect(self.path, isolation_level=None, check_same_thread=True)
        # The file name's bytes, %-escaped: its str may hold surrogates (a name that is not UTF-8).
        # After an empty authority (file://), so that a path spelled //x/... is not read as host x.
        uri = f"file://{urllib.parse.quote(os.fsencode(self.path.absolute()))}?mode=rw"
        try:
            return sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=True)
        except sqlite3.OperationalError:
            # Only a database known to be missing reads as empty; one that could not be looked at
            # (EACCES, which Path.exists() raises) or failed to open fails as such, naming the file.
            if not self._missing():
                raise
        self.absent = True
        return sqlite3.connect(":memory:", isolation_level=None, check_same_thread=True)

    def _missing(self) -> bool:
        try:
            os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return True
        except OSError:
            return False
        return False

    def _connect(self) -> None:
        try:
            conn = self._open()
            try:
                conn.execute(f"PRAGMA busy_timeout={int(self._busy_timeout_ms)}")
                # First of all: a newer dsh's schema may be anything, and another program's database is
                # left as it is. The cookie is read before the tables it vouches for: each statement
                # here is a snapshot of its own, and a change after it moves it again, to be looked at.
                version = self._check_version(conn)
                cookie = _schema_cookie(conn)
                self._check_tables(conn)
                if self._create or self.absent:
                    # Switching the journal mode writes the file's header: not for a database only read.
                    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                    if str(mode).lower() != "wal" and not self.absent:
                        raise SessionStoreError(f"{self.path}: cannot switch to WAL journal mode (got {mode!r})")
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute("PRAGMA foreign_keys=ON")
                have = {row[0].lower() for row in conn.execute("SELECT name FROM sqlite_master")}  # names ignore case
                if self._create or self.absent:
                    # A complete database of this version is not written to (nor locked).
                    if not _SCHEMA_NAMES.issubset(have) or version < SCHEMA_VERSION:
                        self._complete_schema(conn)
                else:
                    self._stand_in(conn, [table for table in _COLUMNS if table not in have])
            except BaseException:
                # Never handed to the store, so close() cannot close it; the error's traceback
                # would otherwise keep the file open for as long as anyone holds the error.
                conn.close()
                raise
        except sqlite3.Error as error:
            raise SessionStoreError(f"cannot open session database {str(self.path)!r}: {error}") from None
        self._conn = conn
        # Where _complete_schema ran, the cookie has moved since: the first transaction looks again.
        self._checked_at = cookie

    def _check_again(self, conn: sqlite3.Connection) -> _Looked:
        """Look at the file again, at the start of a read's or write's transaction (either store): a newer dsh,
        or another program, may have taken it over since it was opened. :class:`SessionStoreError` naming
        the file, as opening it now would give, if this dsh must not read it; otherwise what the caller
        hands :meth:`_looked_at` once the transaction commits, and not before.

        The version is read each time (one header field; of a newer version first: a newer dsh's schema
        may be anything, so nothing else of it is read). The tables (:meth:`_check_tables`, a read of
        ``sqlite_master`` and of each table's columns: about a sixth of an append) only when the file's
        schema cookie (:func:`_schema_cookie`, another header field) has moved since they were last found
        dsh's; with them, opened to read, the stand-ins of the tables the file has gained are dropped
        (:meth:`_forget_stand_ins`) in this transaction. A rollback brings those back: had the cookie been
        taken as looked at here, the next read would skip the drop and read the stand-ins again, empty.
        """
        self._check_version(conn)
        cookie = _schema_cookie(conn)
        if cookie == self._checked_at:
            return cookie, self._lacking
        have = self._check_tables(conn)
        return cookie, self._forget_stand_ins(conn, have) if self._lacking else ()

    def _looked_at(self, looked: _Looked) -> None:
        """Keep what :meth:`_check_again` found, once the transaction it looked in has committed."""
        self._checked_at, self._lacking = looked

    def _check_version(self, conn: sqlite3.Connection) -> int:
        """The database's schema version; :class:`SessionStoreError` naming the file for one this dsh does not know."""
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise SessionStoreError(
                f"cannot open session database {str(self.path)!r}: it was written by a newer dsh "
                f"(schema version {version}; this dsh supports version {SCHEMA_VERSION}); "
                "upgrade dsh"
            )
        if version < 0:  # no dsh ever wrote one
            raise SessionStoreError(
                f"cannot open session database {str(self.path)!r}: it is not a dsh session "
                f"database: its schema version is {version} (dsh's are 0 to {SCHEMA_VERSION})"
            )
        return version

    def _complete_schema(self, conn: sqlite3.Connection) -> None:
        """Create what the database lacks of :data:`_SCHEMA` and stamp :data:`SCHEMA_VERSION`, in one transaction.

        A statement that fails leaves no part of the schema behind, and no version (the caller closes
        the connection, which rolls the transaction back).
        """
        conn.execute("BEGIN IMMEDIATE")
        # Again, under the write lock: a newer dsh, or another program, may have taken the database over
        # since it was read; dsh's tables added to another program's would make it pass for dsh's.
        self._check_version(conn)
        self._check_tables(conn)
        for statement in _SCHEMA_STATEMENTS:  # IF NOT EXISTS: what the database has is left as it is
            conn.execute(statement)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")

    def _stand_in(self, conn: sqlite3.Connection, lacking: Sequence[str]) -> None:
        """An empty temporary table for each of dsh's tables in ``lacking``: read, it is the empty table the
        database would have; it lives in the connection, never in the file (see the module docstring)."""
        for table in lacking:
            (statement,) = [s for s in _SCHEMA_STATEMENTS if s.startswith(f"CREATE TABLE IF NOT EXISTS {table} ")]
            conn.execute(statement.replace("CREATE TABLE IF NOT EXISTS ", "CREATE TEMP TABLE ", 1))
        self._lacking = tuple(lacking)

    def _forget_stand_ins(self, conn: sqlite3.Connection, have: set[str]) -> tuple[str, ...]:
        """Drop the stand-in of each table in :attr:`_lacking` that the file has now (``have``, its
        :func:`_file_tables`); the tables it still lacks.

        A run (``create=True``) may have added dsh's tables since the store opened the database, and a
        stand-in shadows the file's table of its name: the store would read it, empty, for as long as it
        is open. Run in the caller's transaction (:meth:`_check_again`); :attr:`_lacking` is set once it commits.
        """
        for table in self._lacking:
            if table in have:
                # IF EXISTS: should a ROLLBACK that brings the stand-in back ever fail, the next read still works.
                conn.execute(f"DROP TABLE IF EXISTS temp.{table}")
        return tuple(table for table in self._lacking if table not in have)

    def _check_tables(self, conn: sqlite3.Connection) -> set[str]:
        """The file's tables (:func:`_file_tables`); :class:`SessionStoreError` naming the file if it is not a dsh
        session database: it has tables but no ``sessions`` table (every dsh's database has one), or a table
        of dsh's schema lacks dsh's columns.

        A database without any table yet (what ``sqlite3.connect`` made before a dsh put its schema in it)
        is an empty store.
        """
        foreign = (
            f"cannot open session database {str(self.path)!r}: it is not a dsh session database: {{}} "
            "(another program's database? [sessions] home, or DSH_HOME, names where dsh keeps its own)"
        )
        tables = _file_tables(conn)
        if tables and "sessions" not in tables:
            raise SessionStoreError(foreign.format("it has no table 'sessions'"))
        for table, columns in _COLUMNS.items():
            # main.: the file's table; unqualified, a stand-in of its name (a temporary table) is found first.
            found = {row[1] for row in conn.execute(f"PRAGMA main.table_info({table})")}
            lacking = [column for column in columns if column not in found]
            if found and lacking:
                raise SessionStoreError(foreign.format(f"its table {table!r} has no column(s) {', '.join(lacking)}"))
        return tables

    def _db(self) -> sqlite3.Connection:
        assert self._conn is not None
        return self._conn

    def _check_findable(self, session_id: str) -> None:
        """:class:`SessionNotFoundError` for an id no session can have, which sqlite3 would refuse to look up.

        Every stored id is UTF-8 text; one with a lone surrogate failed with a ``UnicodeEncodeError``.
        """
        if not _is_utf8(session_id):
            raise SessionNotFoundError(f"no session {session_id!r} in {self.path}")

    async def _run(self, job: Callable[[], T]) -> T:
        executor = self._executor
        if executor is None:
            raise SessionStoreError(f"session store {str(self.path)!r} is closed")
        return await asyncio.get_running_loop().run_in_executor(executor, job)

    async def _write(
        self, work: Callable[[sqlite3.Connection], T], *, session_id: str, doing: str, lacking_ok: bool = False
    ) -> T:
        """Run ``work`` as one transaction on the database thread; a cancelled call commits nothing.

        ``lacking_ok``: ``work`` writes only to tables of the file, named ``main.``, so a database that
        lacks some (:meth:`_stand_in`) may be written to all the same.

        Unless the ``COMMIT`` had begun when the cancellation came: then the write is done, so it is
        returned, and the cancellation is raised again at the caller's next ``await`` (never lost).
        """
        executor = self._executor
        if executor is None:
            raise SessionStoreError(f"session store {str(self.path)!r} is closed")
        fate = _Fate()
        future = asyncio.get_running_loop().run_in_executor(
            executor,
            lambda: self._transaction(work, session_id=session_id, doing=doing, fate=fate, lacking_ok=lacking_ok),
        )
        try:
            # Shielded: a cancellation must not detach the job before it is known whether it commits.
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if fate.abandon():
                future.cancel()  # not started: it never runs; started: it rolls back at its COMMIT
                raise
        while True:
            try:
                result = await asyncio.shield(future)
                break
            except asyncio.CancelledError:
                continue  # a second cancellation changes nothing: the COMMIT is under way
            except Exception:
                raise asyncio.CancelledError from None  # the COMMIT failed: nothing written, the cancellation stands
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # Re-deliver the cancellation caught above without counting it twice.
            task.uncancel()
            task.cancel()
        return result

    def _transaction(
        self,
        work: Callable[[sqlite3.Connection], T],
        *,
        session_id: str,
        doing: str,
        fate: _Fate | None = None,
        lacking_ok: bool = False,
    ) -> T:
        """Run ``work`` in one ``BEGIN IMMEDIATE`` transaction; an SQLite failure is a :class:`SessionStoreError`.

        A failed statement or ``COMMIT`` rolls back (only if a transaction is still open: SQLite ends one
        itself on a full disk, and a blind ``ROLLBACK`` would then replace the real error with "no
        transaction is active"), so the connection is never left inside a transaction.

        With ``fate``, the transaction commits only if :meth:`_Fate.commit` says so, and otherwise
        raises :class:`_Abandoned` after rolling back. A database opened to read that lacks a table of
        dsh's is not written to at all (:meth:`_stand_in`): a :class:`SessionStoreError` naming it, unless
        ``lacking_ok`` (``work`` writes only to the file's own tables, as ``main.``). What it lacks is
        looked at again first: a table the file has now stays (dsh never drops one). The file is looked at
        again in the transaction before ``work`` writes to it (:meth:`_check_again`): refused as opening it
        then would have been, nothing is written.
        """
        if self._lacking:
            self._read(lambda conn: None, doing=f"{doing} session {session_id!r}")
        if self._lacking and not lacking_ok:
            raise SessionStoreError(
                f"session store {str(self.path)!r}: cannot {doing} session {session_id!r}: the "
                f"database lacks dsh's table(s) {', '.join(self._lacking)} (an older dsh wrote "
                "it), and was opened only to read; a dsh run that records a session adds them"
            )
        conn = self._db()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                # Under the write lock: no other program changes the file until COMMIT.
                looked = self._check_again(conn)
                result = work(conn)
                if fate is not None and not fate.commit():
                    raise _Abandoned
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                raise
            self._looked_at(looked)
        except sqlite3.Error as error:
            raise SessionStoreError(
                f"session store {str(self.path)!r}: cannot {doing} session {session_id!r}: "
                f"{type(error).__name__}: {error}"
            ) from error
        return result

    def _read(self, work: Callable[[sqlite3.Connection], T], *, doing: str) -> T:
        """Run a read; an SQLite failure is a :class:`SessionStoreError` naming the store and what was read.

        In one transaction that first looks at the file again (:meth:`_check_again`: the same error as
        opening it now would give; opened to read, the stand-ins of the tables the file has gained are
        dropped): what ``work`` reads is of the same moment as what was checked and found. A run's store
        too: a run resumed reads its session as it starts, from a file that may have been taken over since
        the store opened it (the look costs two header fields while the schema holds still).
        """
        try:
            conn = self._db()
            conn.execute("BEGIN")
            try:
                looked = self._check_again(conn)
                result = work(conn)
                # Keeps the stand-ins dropped; only temporary tables were changed, nothing of the file.
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")  # the stand-ins dropped are back, as _lacking says
                raise
            self._looked_at(looked)
            return result
        except sqlite3.Error as error:
            raise SessionStoreError(
                f"session store {str(self.path)!r}: cannot {doing}: {type(error).__name__}: {error}"
            ) from error

    # -- the SessionStore API ----------------------------------------------------------------------------

    async def create(
        self, *, session_id: str | None = None, meta: Mapping[str, Any] | None = None, lease: SessionLease | None = None
    ) -> SessionInfo:
        """Create a session (held by ``lease`` if given); an id that already exists is a :class:`SessionStoreError`.

        An empty ``session_id`` is a ``ValueError``: only ``None`` asks for a fresh id.
        """
        if session_id is not None and not session_id:
            # Taken for "no id" before: the caller got a session under another id than the one it named.
            raise ValueError(f"create: session_id must not be empty, got {session_id!r}; pass None for a fresh id")
        if session_id is not None and not _is_utf8(session_id):
            raise ValueError(f"create: session_id {session_id!r} is not UTF-8 text (it holds a lone surrogate)")
        if self.absent:
            raise SessionStoreError(
                f"cannot create a session: session store {str(self.path)!r} was opened "
                "without creating it, and it does not exist"
            )
        chosen = new_session_id() if session_id is None else session_id
        meta_text = encode_payload(dict(meta or {}))
        now = time.time()

        def work(conn: sqlite3.Connection) -> None:
            try:
                conn.execute(
                    "INSERT INTO sessions (id, created_at, updated_at, meta) VALUES (?, ?, ?, ?)",
                    (chosen, now, now, meta_text),
                )
            except sqlite3.IntegrityError:
                raise SessionStoreError(f"session {chosen!r} already exists in {self.path}") from None
            if lease is not None:
                self._claim(conn, chosen, lease)

        await self._write(work, session_id=chosen, doing="create")
        return SessionInfo(chosen, now, now, 0, json.loads(meta_text), lease, stored_events=0)

    async def append(
        self, session_id: str, events: Sequence[NewEvent], *, lease: SessionLease | None = None
    ) -> list[SessionEvent]:
        """Commit ``events`` in one transaction; ``seq`` continues the session's order.

        With ``lease``: :class:`SessionLeaseLostError` unless it holds the session (read in the
        same ``BEGIN IMMEDIATE`` transaction, so no takeover can slip between check and write).
        """
        if not events:
            return []
        self._check_findable(session_id)
        # Encoded here, on the caller's side, so a bad payload fails before anything is written.
        rows = [(event, encode_payload(event.payload)) for event in events]

        def work(conn: sqlite3.Connection) -> list[SessionEvent]:
            found = conn.execute("SELECT event_count FROM sessions WHERE id = ?", (session_id,)).fetchone()
            if found is None:
                raise SessionNotFoundError(f"no session {session_id!r} in {self.path}")
            if lease is not None:
                self._check_held(conn, session_id, lease)
            (last,) = conn.execute(
                "SELECT COALESCE(MAX(seq), 0) FROM events WHERE session_id = ?", (session_id,)
            ).fetchone()
            now = time.time()
            stored: list[SessionEvent] = []
            params = []
            for offset, (event, text) in enumerate(rows, start=1):
                seq = last + offset
                params.append(
                    (
                        session_id,
                        seq,
                        event.kind,
                        event.root_call_id,
                        event.parent_call_id,
                        event.sub_call_id,
                        now,
                        text,
                    )
                )
                stored.append(
                    SessionEvent(
                        session_id,
                        seq,
                        event.kind,
                        decode_payload(text),
                        now,
                        event.root_call_id,
                        event.parent_call_id,
                        event.sub_call_id,
                    )
                )
            conn.executemany(
                "INSERT INTO events (session_id, seq, kind, root_call_id, parent_call_id, sub_call_id, at, payload)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                params,
            )
            conn.execute(
                "UPDATE sessions SET updated_at = ?, event_count = event_count + ? WHERE id = ?",
                (now, len(params), session_id),
            )
            return stored

        return await self._write(work, session_id=session_id, doing="append to")

    @staticmethod
    def _check_held(conn: sqlite3.Connection, session_id: str, lease: SessionLease) -> None:
        """:class:`SessionLeaseLostError` unless ``lease`` holds the session."""
        row = conn.execute("SELECT token, holder FROM leases WHERE session_id = ?", (session_id,)).fetchone()
        if row is not None and row[0] == lease.token:
            return
        holder = None if row is None else _stored_lease(row[1]) or _UNREADABLE_LEASE
        raise SessionLeaseLostError(session_id, holder)

    @staticmethod
    def _claim(conn: sqlite3.Connection, session_id: str, lease: SessionLease) -> None:
        conn.execute(
            "INSERT OR REPLACE INTO leases (session_id, token, holder, acquired_at) VALUES (?, ?, ?, ?)",
            (session_id, lease.token, json.dumps(lease.to_json()), time.time()),
        )

    async def acquire(self, session_id: str, lease: SessionLease) -> None:
        """Claim the session for ``lease``: :class:`SessionBusyError` while another live run holds it."""
        self._check_findable(session_id)

        def work(conn: sqlite3.Connection) -> None:
            if conn.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is None:
                raise SessionNotFoundError(f"no session {session_id!r} in {self.path}")
            row = conn.execute("SELECT token, holder FROM leases WHERE session_id = ?", (session_id,)).fetchone()
            if row is not None and row[0] != lease.token:
                holder = _stored_lease(row[1])  # unreadable: nobody can be told to wait for it, so it is taken over
                if holder is not None and holder_alive(holder):
                    raise SessionBusyError(session_id, holder)
            self._claim(conn, session_id, lease)

        await self._write(work, session_id=session_id, doing="lease")

    async def release(self, session_id: str, lease: SessionLease) -> None:
        """Drop ``lease``'s claim on the session (if it still holds it)."""
        if not _is_utf8(session_id):
            return  # no session has that id: no lease of it to drop

        def work(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM leases WHERE session_id = ? AND token = ?", (session_id, lease.token))

        await self._write(work, session_id=session_id, doing="release the lease of")

    async def break_lease(self, session_id: str) -> SessionLease | None:
        """Drop whatever lease holds the session and return it (``None`` if none did).

        A database without a ``leases`` table (opened to read: an older dsh's, or another's) holds no
        lease: ``None``, the session looked up and nothing written (no table is added to break nothing).
        Whether it has none is read when the lease is asked for, not when the store was opened: a run may
        have added the table, and taken the lease, since; that lease is broken in the file's table.
        """
        self._check_findable(session_id)
        if self._lacking:

            def find(conn: sqlite3.Connection) -> None:
                if conn.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is None:
                    raise SessionNotFoundError(f"no session {session_id!r} in {self.path}")

            # One snapshot (_read's transaction): the session and whether the file has a leases table
            # (the stand-in of one it has now is dropped) are of one moment.
            await self._run(lambda: self._read(find, doing=f"read session {session_id!r}"))
            if "leases" in self._lacking:
                return None

        def work(conn: sqlite3.Connection) -> SessionLease | None:
            if conn.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is None:
                raise SessionNotFoundError(f"no session {session_id!r} in {self.path}")
            row = conn.execute("SELECT holder FROM main.leases WHERE session_id = ?", (session_id,)).fetchone()
            if row is None:
                return None
            conn.execute("DELETE FROM main.leases WHERE session_id = ?", (session_id,))
            return _stored_lease(row[0]) or _UNREADABLE_LEASE  # an unreadable holder: broken all the same

        # Into main.leases, the file's own table: a write the stand-ins of others do not keep from being made.
        return await self._write(work, session_id=session_id, doing="break the lease of", lacking_ok=True)

    async def load(self, session_id: str, *, root_call_id: str | None = None) -> list[SessionEvent]:
        """Every event of a session in ``seq`` order (one call tree's with ``root_call_id``)."""
        self._check_findable(session_id)

        def work(conn: sqlite3.Connection) -> list[SessionEvent]:
            if conn.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is None:
                raise SessionNotFoundError(f"no session {session_id!r} in {self.path}")
            query = (
                "SELECT seq, kind, at, payload, root_call_id, parent_call_id, sub_call_id FROM events "
                "WHERE session_id = ?"
            )
            args: tuple[str, ...] = (session_id,)
            if root_call_id is not None:
                query += " AND root_call_id = ?"
                args = (session_id, root_call_id)
            rows = conn.execute(query + " ORDER BY seq", args).fetchall()
            return [_event(self.path, session_id, row) for row in rows]

        return await self._run(lambda: self._read(work, doing=f"load session {session_id!r}"))

    async def load_page(
        self, session_id: str, *, after: int = 0, limit: int = PAGE_EVENTS, root_call_id: str | None = None
    ) -> list[SessionEvent]:
        """The events after ``seq`` ``after``: at most ``limit``, and no more than about :data:`PAGE_CHARS`
        characters of payload (at least one event while any is left)."""
        self._check_findable(session_id)
        if limit < 1:
            raise ValueError(f"load_page: limit must be at least 1, got {limit}")
        # Seqs run from 1 to SQLite's largest INTEGER; beyond either end an int is no SQLite INTEGER.
        after = max(0, min(_LARGEST_SEQ, after))

        def work(conn: sqlite3.Connection) -> list[SessionEvent]:
            if conn.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is None:
                raise SessionNotFoundError(f"no session {session_id!r} in {self.path}")
            query = (
                "SELECT seq, kind, at, payload, root_call_id, parent_call_id, sub_call_id FROM events "
                "WHERE session_id = ? AND seq > ?"
            )
            args: tuple[object, ...] = (session_id, after)
            if root_call_id is not None:
                query += " AND root_call_id = ?"
                args = (*args, root_call_id)
            page: list[SessionEvent] = []
            size = 0
            # Rows are stepped one at a time: a page of large events stops at its size, not its count.
            cursor = conn.execute(query + " ORDER BY seq LIMIT ?", (*args, min(limit, _LARGEST_SEQ)))
            try:
                for row in cursor:
                    page.append(_event(self.path, session_id, row))
                    size += len(row[3])
                    if size >= PAGE_CHARS:
                        break
            finally:
                cursor.close()
            return page

        return await self._run(lambda: self._read(work, doing=f"load session {session_id!r}"))

    async def get(self, session_id: str) -> SessionInfo:
        """The summary of one session."""
        self._check_findable(session_id)

        def work(conn: sqlite3.Connection) -> SessionInfo:
            row = conn.execute(_SELECT_INFO_COUNTED + " WHERE id = ?", (session_id,)).fetchone()
            if row is None:
                raise SessionNotFoundError(f"no session {session_id!r} in {self.path}")
            return _info(self.path, row)

        return await self._run(lambda: self._read(work, doing=f"read session {session_id!r}"))

    async def list(self, *, limit: int | None = None) -> list[SessionInfo]:
        """Sessions, most recently updated first (at most ``limit``); one that cannot be read as ``unreadable``.

        A session whose ``updated_at`` is no time (a damaged or hand-edited row) comes after every
        session whose is, where nothing says it is recent; among such sessions the greatest id comes
        first (dsh's ids begin with the time they were made). Otherwise an unreadable session is
        ordered by its ``updated_at`` like any other.
        """

        def work(conn: sqlite3.Connection) -> list[SessionInfo]:
            # SQLite orders text and BLOBs after every number: by updated_at alone, DESC put them first.
            rows = conn.execute(
                _SELECT_INFO + f" ORDER BY {_UPDATED_IS_TIME} DESC, "
                f"CASE WHEN {_UPDATED_IS_TIME} THEN updated_at END DESC, id DESC LIMIT ?",
                (-1 if limit is None else int(limit),),
            ).fetchall()
            return [_info(self.path, row, listed=True) for row in rows]

        return await self._run(lambda: self._read(work, doing="list sessions"))

    async def close(self) -> None:
        """Close the connection and stop the database thread (idempotent)."""
        executor, self._executor = self._executor, None
        if executor is None:
            return

        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        try:
            await asyncio.get_running_loop().run_in_executor(executor, shut)
        finally:
            executor.shutdown(wait=True)
