"""Security decisions of the executor pinned through ToolRuntime, each where no other test pinned it.

Aggregation of votes (an allow never outvotes an ask), guards after an allowed approval, an
around-dispatch hook handing back junk, the reserved transport reached as a nested call, and
approval channels and observers that raise.
"""

from __future__ import annotations

from typing import Any

import pytest

from dsh_core import hookimpl
from dsh_core.model import ExecutionToken, PreDecision, ToolExecution, ToolResult

from .helpers import Recorder, Stack, body_calls, register, tool

pytestmark = pytest.mark.anyio


async def test_an_allow_from_one_plugin_never_outvotes_an_ask_from_another() -> None:
    """Votes aggregate deny > ask > allow whatever the call order: an ask with no channel denies."""
    for order in ("allow-first", "ask-first"):
        stack = Stack()
        echo = tool("echo")
        stack.registry.register(echo)
        allow, ask = Recorder(pre=PreDecision.allow()), Recorder(pre=PreDecision.ask("a person decides"))
        for plugin in (allow, ask) if order == "allow-first" else (ask, allow):
            register(stack.hooks, plugin)
        result = await stack.call("echo")
        assert result.code == "DENIED", order
        assert result.error is not None and "no approval channel is available (a person decides)" in result.text
        assert body_calls(echo) == []


@pytest.mark.parametrize("guard_kind", ["registry", "hook"])
@pytest.mark.parametrize("nested", [False, True])
async def test_a_guard_denies_after_the_approval_allowed(guard_kind: str, nested: bool) -> None:
    """Guards run after approval: a person's yes does not get a call past a guard (direct or nested)."""
    stack = Stack(mode="code" if nested else "native")
    echo = tool("echo")
    stack.registry.register(echo)
    recorder = register(stack.hooks, Recorder(pre=PreDecision.ask("ask"), approval="allowed"))
    if guard_kind == "registry":
        stack.registry.guard(lambda execution: "frozen by the registry guard")
    else:
        register(stack.hooks, Recorder(guard="frozen by the hook guard"))
    token = ExecutionToken()
    close = stack.runtime.open_nesting(token, None) if nested else None
    try:
        result = await stack.call("echo", {"text": "x"}, parent=token if nested else None)
    finally:
        if close is not None:
            close()
    assert result.code == "DENIED" and f"frozen by the {guard_kind} guard" in result.text
    assert body_calls(echo) == []
    assert recorder.stages()[:2] == ["pre", "approve"]  # asked, and allowed ...
    assert "post" not in recorder.stages()  # ... then denied by the guard: never dispatched


class _JunkMiddleware:
    """An around-dispatch hook handing back something that is not usable middleware."""

    def __init__(self, junk: str) -> None:
        self.junk = junk

    @hookimpl
    def dsh_around_dispatch(self, execution: ToolExecution) -> Any:
        if self.junk == "not callable":
            return "please wrap"
        if self.junk == "sync function":

            def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                return ToolResult(content="forged", value={"echo": "forged"})

            return middleware
        if self.junk == "returns a dict":

            async def returns_dict(call: ToolExecution, proceed: Any) -> Any:
                return {"echo": "forged"}

            return returns_dict
        raise AssertionError(self.junk)


@pytest.mark.parametrize(
    ("junk", "message"),
    [
        ("not callable", "dsh_around_dispatch of plugin 'wrapper' failed: TypeError: "),
        ("sync function", "dsh_around_dispatch of plugin 'wrapper' failed: TypeError: "),
        ("returns a dict", "around-dispatch middleware returned dict, expected ToolResult"),
    ],
)
async def test_junk_from_around_dispatch_fails_the_call_closed(junk: str, message: str) -> None:
    """Unusable middleware runs no body, forges no value, and skips post-execute."""
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    recorder = register(stack.hooks, Recorder())
    register(stack.hooks, _JunkMiddleware(junk), name="wrapper")
    result = await stack.call("echo", {"text": "real"})
    assert result.code == "TOOL_FAILED" and result.value is None
    assert result.error is not None and result.error.message.startswith(message), result.error.message
    assert body_calls(echo) == []
    assert "post" not in recorder.stages() and recorder.stages()[-1] == "result"


@pytest.mark.parametrize("mode", ["code", "both"])
async def test_run_code_is_refused_as_a_nested_call_before_any_hook(mode: str) -> None:
    """A live parent token lets a call past the model-direct collapse only: the transport itself is
    never a nested call (a program must not start programs), whoever holds the token."""
    stack = Stack(mode=mode)
    recorder = register(stack.hooks, Recorder(pre=PreDecision.allow()))
    token = ExecutionToken()
    close = stack.runtime.open_nesting(token, None)
    try:
        result = await stack.call("run_code", {"text": "inner program"}, parent=token)
    finally:
        close()
    assert result.code == "UNKNOWN_TOOL"
    assert result.error is not None and "run_code" in result.error.message
    assert "cannot be called from inside a" in result.error.message
    assert body_calls(stack.transport) == []
    assert recorder.stages() == ["result"]  # refused at creation: no policy hook saw it
    assert recorder.results[-1][0].nested
    # The same name, model-direct, is still the transport.
    assert not (await stack.call("run_code", {"text": "outer program"})).is_error
    assert body_calls(stack.transport) == [{"text": "outer program"}]


class _RaisingChannel:
    @hookimpl
    def dsh_approve(self, request: Any) -> Any:
        raise RuntimeError("terminal gone")


async def test_a_raising_approval_channel_denies_and_no_later_channel_can_allow() -> None:
    """A channel that crashes is an unavailable answer: the call is denied, and the ask does not fall
    through to a more permissive channel later in call order."""
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    permissive = Recorder(approval="allowed")
    register(stack.hooks, permissive)  # registered first: asked last
    register(stack.hooks, _RaisingChannel(), name="crashing")
    register(stack.hooks, Recorder(pre=PreDecision.ask("why")))
    result = await stack.call("echo")
    assert result.code == "DENIED" and "no approval channel is available (why)" in result.text
    assert body_calls(echo) == []
    assert "approve" not in permissive.stages()


@pytest.mark.parametrize(("answer", "code"), [("allowed", None), ("rejected", "DENIED")])
async def test_a_raising_approval_observer_changes_no_outcome(answer: str, code: str | None) -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)

    class Observer:
        @hookimpl
        def dsh_approval_resolved(self, request: Any, outcome: Any) -> None:
            raise RuntimeError("audit log offline")

    register(stack.hooks, Observer())
    register(stack.hooks, Recorder(pre=PreDecision.ask("why"), approval=answer))
    result = await stack.call("echo")
    assert result.code == code
    assert body_calls(echo) == ([] if code else [{}])
