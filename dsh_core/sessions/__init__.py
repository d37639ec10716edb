"""Sessions: append-only event logs of agent runs, behind a store seam (SQLite by default)."""

from dsh_core.sessions.events import EventKind, NewEvent, SessionEvent, SessionInfo
from dsh_core.sessions.recorder import SESSION_SERVICE, SessionRecorder
from dsh_core.sessions.store import (
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
    "SESSION_SERVICE",
    "SessionRecorder",
    "SessionNotFoundError",
    "SessionStore",
    "SessionStoreError",
    "SessionStoreFactory",
    "dsh_home",
]
