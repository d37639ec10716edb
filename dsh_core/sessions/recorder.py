"""The session sink: how the agent loop and the Code Mode transport write a session.

An agent run provides one :class:`SessionRecorder` on its run scope under the
service key :data:`SESSION_SERVICE`. Anything that holds the scope of a
model-direct execution made by the loop finds it with::

    recorder = execution.agent.lookup("session")   # None outside an agent run (e.g. `dsh tools call`)
    if recorder is not None:
        await recorder.append("tool/code-dispatch-start", {"name": ..., "args": ...},
                              root_call_id=execution.root_call_id,
                              parent_call_id=execution.call_id, sub_call_id="1")

Every ``append`` is committed (one transaction) before it returns, in the
order the appends were made.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final

from dsh_core.lossless import JSON
from dsh_core.sessions.events import NewEvent, SessionEvent
from dsh_core.sessions.lease import SessionLease
from dsh_core.sessions.store import SessionStore

__all__ = ["SessionRecorder", "SESSION_SERVICE"]

#: The scope service key under which a run's :class:`SessionRecorder` is provided.
SESSION_SERVICE: Final = "session"


class SessionRecorder:
    """Appends events to one session of one store, in call order.

    With ``lease`` (the run's), every append is checked against it: once the run has lost the
    session (released, or taken over by another run), appends fail with
    :class:`~dsh_core.sessions.store.SessionLeaseLostError` and write nothing.
    """

    def __init__(self, store: SessionStore, session_id: str, *, lease: SessionLease | None = None) -> None:
        self.store = store
        self.session_id = session_id
        self.lease = lease
        # One lock per session: concurrent appenders (the loop, nested Code Mode dispatch) commit in the
        # order they called, and a batch is never interleaved with another writer's events.
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"<SessionRecorder {self.session_id!r}>"

    async def append(
        self,
        kind: str,
        payload: JSON = None,
        *,
        root_call_id: str | None = None,
        parent_call_id: str | None = None,
        sub_call_id: str | None = None,
    ) -> SessionEvent:
        """Commit one event and return it with its ``seq``. ``payload`` must be lossless JSON."""
        event = NewEvent(kind, {} if payload is None else payload, root_call_id, parent_call_id, sub_call_id)
        (stored,) = await self.append_many([event])
        return stored

    async def append_many(self, events: Sequence[NewEvent]) -> list[SessionEvent]:
        """Commit a batch in one transaction (all or nothing), in order."""
        async with self._lock:
            if self.lease is None:  # a store written before append took a lease still records
                return await self.store.append(self.session_id, events)
            return await self.store.append(self.session_id, events, lease=self.lease)

    async def load(self) -> list[SessionEvent]:
        """Every committed event of this session."""
        return await self.store.load(self.session_id)
