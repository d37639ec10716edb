"""The session store seam: an append-only event log per session.

A store is registered by a plugin through ``dsh_register_session_stores`` as
a factory ``factory(home: pathlib.Path) -> SessionStore``; the deployment
picks one by name (``[sessions] store``, default ``sqlite``) and dsh keeps its
state under ``home`` (``[sessions] home``, ``DSH_HOME``, default ``~/.dsh``).
A factory may also take a keyword ``create`` (:func:`open_store`):
``factory(home, create=False)`` opens the store for ``dsh sessions list``,
``show`` and ``release``, which must create no state where there is none yet:
such a store creates nothing, and reads as empty where nothing exists.

One run at a time continues a session: a run leases its session
(:class:`~dsh_core.sessions.lease.SessionLease`) before it loads the history
and releases it when it ends; every store keeps the leases beside the events,
so that runs of several processes sharing one home see each other's.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol, TypeAlias, runtime_checkable

from dsh_core.errors import DshError
from dsh_core.sessions.events import NewEvent, SessionEvent, SessionInfo
from dsh_core.sessions.lease import SessionLease

__all__ = [
    "SessionStore",
    "SessionStoreFactory",
    "SessionNotFoundError",
    "SessionStoreError",
    "SessionBusyError",
    "SessionLeaseLostError",
    "check_lease_aware",
    "dsh_home",
    "iter_events",
    "open_store",
    "PAGE_EVENTS",
]

#: How many events :func:`iter_events` asks a store's :meth:`SessionStore.load_page` for at a time.
PAGE_EVENTS: Final = 1000


class SessionStoreError(DshError):
    """A session store could not do what was asked (the message names the store and the session)."""

    code = "SESSION_STORE_FAILED"


class SessionNotFoundError(SessionStoreError):
    """No session with that id exists in the store."""

    code = "SESSION_NOT_FOUND"


class SessionBusyError(SessionStoreError):
    """Another run that is still running holds the session's lease (the message names the session and it)."""

    code = "SESSION_BUSY"

    def __init__(self, session_id: str, holder: SessionLease) -> None:
        super().__init__(
            f"session {session_id!r} is in use by another run ({holder.describe()}); "
            "one run at a time may continue a session: resume it once that run has ended (if it "
            "is gone from another host or container, where dsh cannot check, free the session "
            f"with: dsh sessions release {session_id})"
        )
        self.session_id = session_id
        self.holder = holder


class SessionLeaseLostError(SessionStoreError):
    """A run appended under a lease that no longer holds its session (``holder`` is the one that does, if any)."""

    code = "SESSION_LEASE_LOST"

    def __init__(self, session_id: str, holder: SessionLease | None) -> None:
        if holder is None:
            how = "its lease was released (dsh sessions release)"
        elif not holder.readable:
            how = "another run holds it, whose lease record is unreadable (which run cannot be told)"
        else:
            how = f"another run took it over ({holder.describe()})"
        super().__init__(
            f"session {session_id!r} is no longer held by this run: {how}; nothing more of this "
            "run is recorded in it, so that the two runs' events do not interleave"
        )
        self.session_id = session_id
        self.holder = holder


def check_lease_aware(store: object) -> None:
    """Raise :class:`SessionStoreError` naming ``store`` if its ``append`` takes no ``lease`` keyword.

    An agent run checks every write against its lease; a store written before ``append`` took
    one would otherwise fail the run's first write with a bare ``TypeError`` naming nobody, after
    the session was created or claimed. A signature that cannot be read is let through.
    """
    append = getattr(store, "append", None)
    try:
        parameters = inspect.signature(append).parameters if append is not None else {}
    except (TypeError, ValueError):
        return
    lease = parameters.get("lease")
    if lease is not None and lease.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return
    kind = type(store)
    raise SessionStoreError(
        f"session store {kind.__module__}.{kind.__qualname__}: append() takes no lease= keyword; an agent run "
        "passes its lease so that a run that lost its session writes nothing (add the keyword-only parameter "
        "'lease: SessionLease | None = None' and check it in the write's transaction; see "
        "dsh_core.sessions.store.SessionStore.append)"
    )


@runtime_checkable
class SessionStore(Protocol):
    """An append-only event log per session.

    Contract: :meth:`append` commits a batch atomically (all of it or none) and
    assigns consecutive ``seq`` numbers in batch order; once it returns, the
    events survive a crash of the process. Appends to one session are
    serialized. :meth:`close` is idempotent and leaves nothing running.

    Leases: at most one lease holds a session. :meth:`acquire` claims it
    atomically (two processes racing for it cannot both win) and takes over a
    lease whose holder is gone (:func:`~dsh_core.sessions.lease.holder_alive`
    says so); :meth:`release` drops it. An :meth:`append` made with a lease
    commits only while that lease holds the session (checked in the same
    transaction); one made without a lease, and the reads, are not restricted.
    """

    async def create(
        self, *, session_id: str | None = None, meta: Mapping[str, Any] | None = None, lease: SessionLease | None = None
    ) -> SessionInfo:
        """Create a session (a fresh id unless given) and return its summary; an existing id is an error.

        ``session_id=None`` asks for a fresh id; an empty one is no id to give a session, and is a
        ``ValueError`` naming it (nothing is created). With ``lease``, the session is created held
        by it (in the same transaction).
        """
        ...

    async def acquire(self, session_id: str, lease: SessionLease) -> None:
        """Claim the session for ``lease``'s run.

        :class:`SessionBusyError` if another lease holds it and its holder may
        still be running; :class:`SessionNotFoundError` if there is no such
        session. Acquiring again with the lease that holds it succeeds.
        """
        ...

    async def release(self, session_id: str, lease: SessionLease) -> None:
        """Drop ``lease``'s claim on the session; nothing happens if another lease (or none) holds it."""
        ...

    async def break_lease(self, session_id: str) -> SessionLease | None:
        """Drop whatever lease holds the session and return it (``None`` if none did).

        For a person who knows the holder is gone where dsh cannot check it (a run on
        another host or in another container that was killed). :class:`SessionNotFoundError`
        if there is no such session.
        """
        ...

    async def append(
        self, session_id: str, events: Sequence[NewEvent], *, lease: SessionLease | None = None
    ) -> list[SessionEvent]:
        """Commit ``events`` in one transaction and return them as stored.

        With ``lease``, :class:`SessionLeaseLostError` (and nothing written) unless that lease
        holds the session: a run that lost it (released, or taken over) must not write on.

        Cancelled, it commits nothing and raises ``CancelledError``; only if the commit was
        already under way does it return the events (they are stored) and leave the
        cancellation to the caller's next ``await``. Returning means committed, raising means not.
        """
        ...

    async def load(self, session_id: str, *, root_call_id: str | None = None) -> list[SessionEvent]:
        """Every event of a session in ``seq`` order (only one call tree's with ``root_call_id``)."""
        ...

    async def load_page(
        self, session_id: str, *, after: int = 0, limit: int = PAGE_EVENTS, root_call_id: str | None = None
    ) -> list[SessionEvent]:
        """The session's events with ``seq`` above ``after`` in ``seq`` order (only ``root_call_id``'s with it).

        At most ``limit`` of them (``limit`` is at least 1), and at least one while any is left: a store
        may return fewer than ``limit`` to keep a page of large events small, so only an empty page
        says there are no more. :class:`SessionNotFoundError` if there is no such session.

        How ``dsh sessions show`` reads a session (:func:`iter_events`), one page in memory at a time,
        however long the session; ``after`` the last ``seq`` of the page before asks for the next. A
        store without it is read whole with :meth:`load`.
        """
        ...

    async def get(self, session_id: str) -> SessionInfo:
        """The summary of one session; :class:`SessionNotFoundError` if it does not exist.

        Its ``holder`` is the lease held on it, if any (``None`` for one the store cannot read):
        ``dsh sessions list`` and ``show`` name the run using a session from it. A store that can
        should count the session's stored events as it reads the record (in the same transaction):
        :attr:`~dsh_core.sessions.events.SessionInfo.stored_events`, what ``show`` shows and checks
        the record's ``event_count`` against.
        """
        ...

    async def list(self, *, limit: int | None = None) -> list[SessionInfo]:
        """Sessions, most recently updated first, each with its ``holder`` as :meth:`get` gives it.

        A session whose record the store cannot read (damaged, or edited by hand) should not keep the
        others from being listed: a store may list it with
        :attr:`~dsh_core.sessions.events.SessionInfo.unreadable` saying why, where :meth:`get` fails. One
        whose last update cannot be read is listed after every session whose can (nothing says it is
        recent), so that ``limit`` leaves it out before those.
        """
        ...

    async def close(self) -> None:
        """Release the store (idempotent)."""
        ...


async def iter_events(
    store: SessionStore,
    session_id: str,
    *,
    root_call_id: str | None = None,
    page: int = PAGE_EVENTS,
    limit: int | None = None,
) -> AsyncIterator[SessionEvent]:
    """The session's events in ``seq`` order, read a page of at most ``page`` events at a time.

    Each page is asked for once the one before has been consumed, so a session of any length is
    read holding one page of it. A store without :meth:`SessionStore.load_page` (written before
    it) is read whole with :meth:`SessionStore.load`. A store whose page does not go past ``after``
    is a :class:`SessionStoreError` naming it, rather than a loop reading one page for ever.

    With ``limit``, only the first ``limit`` events, and no page asked for beyond them: a session is
    only ever appended to, so the first :attr:`SessionInfo.event_count` events are the session as that
    count was read, whatever runs append meanwhile.
    """
    if limit is not None and limit <= 0:
        return
    load_page = getattr(store, "load_page", None)
    if load_page is None:
        for given, event in enumerate(await store.load(session_id, root_call_id=root_call_id), start=1):
            yield event
            if given == limit:
                return
        return
    after = 0
    while True:
        asked = page if limit is None else min(page, limit)
        events: list[SessionEvent] = await load_page(session_id, after=after, limit=asked, root_call_id=root_call_id)
        if not events:
            return
        last = events[-1].seq
        if len(events) > asked or events[0].seq <= after or last < events[0].seq:
            kind = type(store)
            raise SessionStoreError(
                f"session store {kind.__module__}.{kind.__qualname__}: load_page({session_id!r}, after={after}, "
                f"limit={asked}) returned {len(events)} events, seq {events[0].seq} to {last}: not a page of at "
                "most limit events after 'after'"
            )
        for event in events:
            yield event
        if limit is not None:
            limit -= len(events)
            if limit <= 0:
                return
        events.clear()  # before the next page is read: one page in memory, not two
        after = last


#: ``factory(home)`` opens a store keeping its files under ``home`` (see :func:`open_store` for ``create``).
SessionStoreFactory: TypeAlias = Callable[[Path], SessionStore]


def open_store(factory: SessionStoreFactory, home: Path, *, create: bool = True) -> SessionStore:
    """``factory(home, create=create)`` when the factory names ``create``, else ``factory(home)``.

    The factory names it: a parameter ``create`` that can be passed by keyword (``**options``
    alone is not asked; a ``functools.partial``, a class, or an object's ``__call__`` is asked of
    the signature it is called with). It is passed whenever it is named, ``True`` too, so a
    factory whose ``create`` has no default still opens for an agent run.

    ``create=False`` asks the store to create no state (no directory, no database) where none
    exists yet, and to read as empty then; a factory that takes no ``create`` keyword is called
    as before (its store may create its state as it opens).
    """
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return factory(home)
    # Only a parameter named create: a factory's **options may go to something that knows no create.
    keyword = parameters.get("create")
    takes = keyword is not None and keyword.kind in (
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )
    return factory(home, create=create) if takes else factory(home)  # type: ignore[call-arg]


def dsh_home(configured: str | None = None, *, env: Mapping[str, str] | None = None) -> Path:
    """dsh's state directory: ``configured`` (``[sessions] home``), else ``$DSH_HOME``, else ``~/.dsh``."""
    env = os.environ if env is None else env
    chosen = configured or env.get("DSH_HOME") or "~/.dsh"
    return Path(chosen).expanduser()
