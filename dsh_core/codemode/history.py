"""The durable history of nested ``run_code`` calls (the second history layer).

The model sees only the outer ``run_code`` result. The session keeps every
nested call as a pair of events, correlated by ``root_call_id`` (the outer
call's root), ``parent_call_id`` (the ``run_code`` call id) and
``sub_call_id`` (``"<run_code call id>:code:<n>"``):

* ``tool/code-dispatch-start`` when the call actually starts (a queued call
  abandoned before it started logs nothing): ``{"name", "arguments"}``;
* ``tool/code-dispatch`` exactly once when a started call commits, aborted
  ones included: ``{"name", "arguments", "is_error", "error_code", "content"}``.

``arguments`` is a snapshot detached from the value that was dispatched, so a
tool cannot change the log. ``content`` is the sub-result's full model-facing
content, reshaped for the durable copy only by the ``dsh_code_dispatch_log``
hook (a raising implementation is contained and the original is logged).

The sink is whatever the owning agent's scope provides under ``"session"``
(see :class:`DispatchLog`); with no owning agent or no sink, nothing is
logged and dispatch works the same.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol, runtime_checkable

from attrs import frozen

from dsh_core.hooks import Hooks
from dsh_core.lossless import JSON
from dsh_core.model import ContentBlock, ImageBlock, TextBlock, ToolResult, converter
from dsh_core.scope import Scope

__all__ = [
    "CODE_DISPATCH_START",
    "CODE_DISPATCH",
    "SESSION_SERVICE",
    "CodeDispatchLog",
    "DispatchLog",
    "DispatchHistory",
    "find_sink",
    "unstructure_blocks",
]

log = logging.getLogger("dsh")

#: Event kind: a nested call started.
CODE_DISPATCH_START: Final = "tool/code-dispatch-start"
#: Event kind: a nested call settled (exactly one per start).
CODE_DISPATCH: Final = "tool/code-dispatch"
#: The scope service key under which an agent exposes its session sink.
SESSION_SERVICE: Final = "session"


@runtime_checkable
class DispatchLog(Protocol):
    """The session sink the transport appends to (looked up as ``scope.lookup("session")``)."""

    async def append(
        self,
        kind: str,
        payload: Mapping[str, JSON],
        *,
        root_call_id: str | None = None,
        parent_call_id: str | None = None,
        sub_call_id: str | None = None,
    ) -> object:
        """Append one event; may raise (the transport contains and logs the failure).

        Raising ``CancelledError`` must mean nothing was appended (as a cancelled
        :meth:`~dsh_core.sessions.store.SessionStore.append` commits nothing): a settle event
        whose append a cancellation interrupted is appended again.
        """
        ...


@frozen
class CodeDispatchLog:
    """One settled nested call, as the ``dsh_code_dispatch_log`` hook sees it (read-only)."""

    root_call_id: str
    parent_call_id: str
    sub_call_id: str
    name: str
    arguments: JSON
    is_error: bool
    error_code: str | None
    content: tuple[ContentBlock, ...]


def find_sink(agent: Scope | None) -> DispatchLog | None:
    """The session sink of ``agent``'s scope chain, or ``None`` (no agent, no sink, or not a sink)."""
    if agent is None:
        return None
    sink = agent.lookup(SESSION_SERVICE)
    if sink is None or not callable(getattr(sink, "append", None)):
        return None
    return sink  # type: ignore[no-any-return]


class DispatchHistory:
    """Writes the event pair of each nested call of one ``run_code`` execution.

    Every method contains its own failures: history never changes what the
    program or the model sees.
    """

    __slots__ = ("_agent", "_hooks", "_parent_call_id", "_root_call_id", "_sink", "enabled")

    def __init__(self, hooks: Hooks, agent: Scope | None, *, root_call_id: str, parent_call_id: str) -> None:
        self._hooks = hooks
        self._agent = agent
        self._sink = find_sink(agent)
        #: True when there is a sink to write to (read on every nested call: an attribute).
        self.enabled = self._sink is not None
        self._root_call_id = root_call_id
        self._parent_call_id = parent_call_id

    async def _append(self, kind: str, payload: Mapping[str, Any], sub_call_id: str) -> None:
        if self._sink is None:
            return
        try:
            await self._sink.append(
                kind,
                payload,
                root_call_id=self._root_call_id,
                parent_call_id=self._parent_call_id,
                sub_call_id=sub_call_id,
            )
        except Exception:
            log.warning("appending %s for %s failed", kind, sub_call_id, exc_info=True)

    async def started(self, sub_call_id: str, name: str, arguments: JSON) -> None:
        """Append ``tool/code-dispatch-start`` (called on the ordered lane when the call starts)."""
        # _append inlined: this runs on the ordered lane once per nested call.
        sink = self._sink
        if sink is None:
            return
        try:
            await sink.append(
                CODE_DISPATCH_START,
                {"name": name, "arguments": arguments},
                root_call_id=self._root_call_id,
                parent_call_id=self._parent_call_id,
                sub_call_id=sub_call_id,
            )
        except Exception:
            log.warning("appending %s for %s failed", CODE_DISPATCH_START, sub_call_id, exc_info=True)

    async def append_settle(self, sub_call_id: str, payload: Mapping[str, Any]) -> None:
        """Append ``tool/code-dispatch`` with ``payload`` from :meth:`settle_payload`.

        Separate so that a write redone after a cancellation appends the same record
        without running the hook again.
        """
        await self._append(CODE_DISPATCH, payload, sub_call_id)

    async def settle_payload(self, sub_call_id: str, name: str, arguments: JSON, result: ToolResult) -> dict[str, Any]:
        """The payload of the call's ``tool/code-dispatch`` event, its content shaped by the durable-copy hook."""
        content: Sequence[ContentBlock] = result.content
        # The read-only record is built only when some implementation will see it.
        if self._hooks.sees_any("dsh_code_dispatch_log", self._agent):
            record = CodeDispatchLog(
                root_call_id=self._root_call_id,
                parent_call_id=self._parent_call_id,
                sub_call_id=sub_call_id,
                name=name,
                arguments=arguments,
                is_error=result.is_error,
                error_code=result.code,
                content=tuple(result.content),
            )
            try:
                shaped = await self._hooks.code_dispatch_log(record, self._agent)
                if shaped is not None:
                    content = _checked_blocks(shaped)
            except Exception:
                # hooks.code_dispatch_log contains raising implementations; this also covers a
                # malformed return (not content blocks): the original content is logged.
                log.warning("dsh_code_dispatch_log returned unusable content for %s", sub_call_id, exc_info=True)
                content = result.content
        error = result.error
        return {
            "name": name,
            "arguments": arguments,
            "is_error": error is not None,
            "error_code": None if error is None else error.code,
            "content": unstructure_blocks(content),
        }


def unstructure_blocks(blocks: Sequence[ContentBlock]) -> list[dict[str, Any]]:
    """``converter.unstructure(list(blocks))``, with text blocks built directly (the common case).

    The same dicts, keys in the same order: the settle event of every nested call carries them.
    """
    out: list[dict[str, Any]] = []
    for block in blocks:
        if type(block) is TextBlock:
            out.append({"text": block.text, "type": block.type})
        else:
            out.append(converter.unstructure(block))
    return out


def _checked_blocks(blocks: Sequence[object]) -> tuple[ContentBlock, ...]:
    checked = tuple(blocks)
    for block in checked:
        if not isinstance(block, TextBlock | ImageBlock):
            raise TypeError(f"expected content blocks, got {type(block).__name__}")
    return checked  # type: ignore[return-value]
