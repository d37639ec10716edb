"""The session store seam: an append-only event log per session.

A store is registered by a plugin through ``dsh_register_session_stores`` as
a factory ``factory(home: pathlib.Path) -> SessionStore``; the deployment
picks one by name (``[sessions] store``, default ``sqlite``) and dsh keeps its
state under ``home`` (``[sessions] home``, ``DSH_HOME``, default ``~/.dsh``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeAlias, runtime_checkable

from dsh_core.errors import DshError
from dsh_core.sessions.events import NewEvent, SessionEvent, SessionInfo

__all__ = ["SessionStore", "SessionStoreFactory", "SessionNotFoundError", "SessionStoreError", "dsh_home"]


class SessionStoreError(DshError):
    """A session store could not do what was asked (the message names the store and the session)."""

    code = "SESSION_STORE_FAILED"


class SessionNotFoundError(SessionStoreError):
    """No session with that id exists in the store."""

    code = "SESSION_NOT_FOUND"


@runtime_checkable
class SessionStore(Protocol):
    """An append-only event log per session.

    Contract: :meth:`append` commits a batch atomically (all of it or none) and
    assigns consecutive ``seq`` numbers in batch order; once it returns, the
    events survive a crash of the process. Appends to one session are
    serialized. :meth:`close` is idempotent and leaves nothing running.
    """

    async def create(self, *, session_id: str | None = None, meta: Mapping[str, Any] | None = None) -> SessionInfo:
        """Create a session (a fresh id unless given) and return its summary; an existing id is an error."""
        ...

    async def append(self, session_id: str, events: Sequence[NewEvent]) -> list[SessionEvent]:
        """Commit ``events`` in one transaction and return them as stored."""
        ...

    async def load(self, session_id: str, *, root_call_id: str | None = None) -> list[SessionEvent]:
        """Every event of a session in ``seq`` order (only one call tree's with ``root_call_id``)."""
        ...

    async def get(self, session_id: str) -> SessionInfo:
        """The summary of one session; :class:`SessionNotFoundError` if it does not exist."""
        ...

    async def list(self, *, limit: int | None = None) -> list[SessionInfo]:
        """Sessions, most recently updated first."""
        ...

    async def close(self) -> None:
        """Release the store (idempotent)."""
        ...


#: ``factory(home)`` opens a store keeping its files under ``home``.
SessionStoreFactory: TypeAlias = Callable[[Path], SessionStore]


def dsh_home(configured: str | None = None, *, env: Mapping[str, str] | None = None) -> Path:
    """dsh's state directory: ``configured`` (``[sessions] home``), else ``$DSH_HOME``, else ``~/.dsh``."""
    env = os.environ if env is None else env
    chosen = configured or env.get("DSH_HOME") or "~/.dsh"
    return Path(chosen).expanduser()
