"""Sessions: append-only event logs of agent runs, behind a store seam (SQLite by default)."""

from typing import TYPE_CHECKING

from dsh_core.lazy import lazy_exports

if TYPE_CHECKING:
    from dsh_core.sessions.events import EventKind, NewEvent, SessionEvent, SessionInfo
    from dsh_core.sessions.lease import SessionLease, holder_alive
    from dsh_core.sessions.recorder import SESSION_SERVICE, SessionRecorder
    from dsh_core.sessions.store import (
        SessionBusyError,
        SessionLeaseLostError,
        SessionNotFoundError,
        SessionStore,
        SessionStoreError,
        SessionStoreFactory,
        dsh_home,
    )

__all__ = [
    "EventKind",
    "NewEvent",
    "SessionEvent",
    "SessionInfo",
    "SessionLease",
    "holder_alive",
    "SESSION_SERVICE",
    "SessionRecorder",
    "SessionBusyError",
    "SessionLeaseLostError",
    "SessionNotFoundError",
    "SessionStore",
    "SessionStoreError",
    "SessionStoreFactory",
    "dsh_home",
]

# Imported on first use (see dsh_core.lazy): importing a module of this package, as `dsh --help`
# does, must not load the recorder (asyncio).
if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            "dsh_core.sessions.events": ["EventKind", "NewEvent", "SessionEvent", "SessionInfo"],
            "dsh_core.sessions.lease": ["SessionLease", "holder_alive"],
            "dsh_core.sessions.recorder": ["SESSION_SERVICE", "SessionRecorder"],
            "dsh_core.sessions.store": [
                "SessionBusyError",
                "SessionLeaseLostError",
                "SessionNotFoundError",
                "SessionStore",
                "SessionStoreError",
                "SessionStoreFactory",
                "dsh_home",
            ],
        },
    )
