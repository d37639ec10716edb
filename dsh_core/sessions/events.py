"""Session events: the append-only record of an agent run.

A session is an ordered log of :class:`SessionEvent` values keyed by
``(session_id, seq)``. ``seq`` is assigned by the store at commit time and is
the one true order. Each event carries a ``kind`` (see :class:`EventKind`), a
JSON ``payload`` and three correlation ids:

* ``root_call_id`` — the model-direct call an event belongs to (for a nested
  Code Mode call, the outer ``run_code`` call);
* ``parent_call_id`` — the call that made a nested call (the ``run_code``
  call id), ``None`` for model-direct calls;
* ``sub_call_id`` — the nested call's id inside its program, ``None`` for
  model-direct calls.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Final

from attrs import field, frozen

from dsh_core.lossless import JSON, NotLosslessError, snapshot
from dsh_core.sessions.lease import SessionLease

__all__ = ["EventKind", "NewEvent", "SessionEvent", "SessionInfo", "encode_payload", "decode_payload"]


class EventKind(StrEnum):
    """The event kinds dsh itself writes. Stores accept any non-empty kind string."""

    #: A run started: ``{"task", "agent", "provider", "model", "mode", "resumed"}``.
    RUN_START = "run/start"
    #: A user message: ``{"message": {"role": "user", "content"}}``; a tool result's context message
    #: (``root_call_id`` its call) adds ``"context_source"``, the whole text as ``"content"`` (``message`` is
    #: what the model saw) and, when it was cut to ``max_tool_result_chars``, ``"cut"``.
    USER_MESSAGE = "message/user"
    #: An assistant message: ``{"message": {...OpenAI shape...}, "step", "meta"?}``.
    ASSISTANT_MESSAGE = "message/assistant"
    #: A model-direct tool call before it runs: ``{"name", "tool_call_id", "arguments", "execution_mode"}``
    #: (the mode planned when its step began: written before anything runs, it cannot know the one it runs under).
    TOOL_CALL = "tool/call"
    #: Its result: ``{"name", "tool_call_id", "ok", "error", "content", "concludes_turn", "execution_mode",
    #: "duration_ms", "message"}``; ``execution_mode`` is the mode the call ran under (``exclusive`` if it ran
    #: alone, or its body did because its tool was replaced by one that is not concurrency-safe during its policy).
    TOOL_RESULT = "tool/result"
    #: A nested call inside a ``run_code`` program started (written by the Code Mode transport).
    CODE_DISPATCH_START = "tool/code-dispatch-start"
    #: A nested call settled (exactly one per start, aborted ones included).
    CODE_DISPATCH = "tool/code-dispatch"
    #: An approval request ended, answered or not (``unavailable`` when no channel could ask):
    #: ``{"name", "call_id", "reason", "outcome"}``.
    APPROVAL = "approval"
    #: The run ended: ``{"reason", "turns", "answer", "error"?}``.
    RUN_END = "run/end"


#: Kinds whose payload carries a conversation message (used to rebuild history on resume).
MESSAGE_KINDS: Final = frozenset({EventKind.USER_MESSAGE, EventKind.ASSISTANT_MESSAGE, EventKind.TOOL_RESULT})


def encode_payload(payload: JSON) -> str:
    """Canonical JSON text of a payload; raise :class:`TypeError` naming what is not lossless JSON."""
    try:
        plain = snapshot(payload)
    except NotLosslessError as error:
        raise TypeError(f"session event payload: {error}") from None
    text = json.dumps(plain, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates (a file name that is not UTF-8, through os.listdir): SQLite text must
            # be UTF-8, and as \\uXXXX escapes they load back exactly the same. Only a high one right
            # before a low one would not (a parser reads the two escapes as one character): snapshot()
            # above refused those.
            text = json.dumps(plain, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text


def decode_payload(text: str | bytes) -> JSON:
    """The payload value of stored JSON text; ``ValueError`` if it is not JSON.

    Python's json reads ``NaN``, ``Infinity`` and a number too large for a float (as ``inf``), which
    no JSON holds: :func:`encode_payload` never writes them, and a payload edited to hold one would be
    written out again as such (``dsh sessions show --json``: no JSON), so they are refused here.
    """
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


def _refuse_constant(constant: str) -> object:
    raise ValueError(f"{constant} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is too large for a float")
    return value


def _check_kind(_: object, attribute: object, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"session event kind must be a non-empty string, got {value!r}")


@frozen
class NewEvent:
    """An event to append; the store assigns ``seq`` and ``at``."""

    kind: str = field(validator=_check_kind)
    payload: JSON = field(factory=dict)
    root_call_id: str | None = None
    parent_call_id: str | None = None
    sub_call_id: str | None = None


@frozen
class SessionEvent:
    """A committed event."""

    session_id: str
    seq: int
    kind: str
    payload: JSON
    at: float
    root_call_id: str | None = None
    parent_call_id: str | None = None
    sub_call_id: str | None = None


@frozen
class SessionInfo:
    """A session's summary: id, creation time, last event time, event count and metadata.

    ``holder`` is the lease the store holds for the session, if any: the run continuing it, or
    one that is gone without releasing it (:func:`~dsh_core.sessions.lease.holder_alive` tells).
    A lease the store cannot read is ``None``: :meth:`~dsh_core.sessions.store.SessionStore.acquire`
    takes it over.

    ``unreadable`` says why the store could not read the session's own record (its ``meta`` is then
    empty, and ``id``, ``created_at``, ``updated_at`` or ``event_count`` is ``None`` where that is
    what could not be read), for a session :meth:`~dsh_core.sessions.store.SessionStore.list` lists
    all the same; ``None`` for one it could read (always, for one
    :meth:`~dsh_core.sessions.store.SessionStore.get` or ``create`` returns: they fail instead), whose
    fields are never ``None``.

    ``stored_events`` is how many events the store holds for the session, read with the record (in
    the same transaction), where ``event_count`` is what the record says: the two differ only if
    the record was written apart from the events (a crash mid-write by another program, a foreign
    writer, a hand edit). ``None`` where the store did not count them (``list``, or a store that
    does not): ``dsh sessions show`` then takes ``event_count`` for it.
    """

    id: str | None
    created_at: float | None
    updated_at: float | None
    event_count: int | None
    meta: Mapping[str, Any] = field(factory=dict)
    holder: SessionLease | None = None
    unreadable: str | None = None
    stored_events: int | None = None

    def __attrs_post_init__(self) -> None:
        # A field without its value is only ever one whose record says why; callers of get() rely on it.
        if self.unreadable is None and None in (self.id, self.created_at, self.updated_at, self.event_count):
            raise ValueError(f"SessionInfo: a readable session has every field, got {self!r}")
        if self.stored_events is not None and (type(self.stored_events) is not int or self.stored_events < 0):
            raise ValueError(f"SessionInfo: stored_events must be a count (an int of 0 or more), got {self!r}")

    @property
    def shown_events(self) -> int | None:
        """How many events the session has to show: :attr:`stored_events` where counted, else :attr:`event_count`."""
        return self.event_count if self.stored_events is None else self.stored_events

    @property
    def known_id(self) -> str:
        """:attr:`id` of a session the store could read (``get``, ``create``); ``ValueError`` if it has none."""
        if self.id is None:
            raise ValueError(f"session has no readable id: {self.unreadable}")
        return self.id
