"""The body runs the definition the call's policy judged, or none: a tool replaced or removed while the
call waited (an approval a person answers, a middleware that pauses) never runs a body it was not judged by."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from dsh_core import hookimpl
from dsh_core.abort import AbortSignal
from dsh_core.model import ApprovalOutcome, PreDecision, ToolExecution, ToolExecutionInput, ToolResult

from .helpers import Recorder, Stack, body_calls, register, tool

pytestmark = pytest.mark.anyio


class AskThenWait(Recorder):
    """Asks for every call; the approval waits on a future the test resolves."""

    def __init__(self) -> None:
        super().__init__(pre=PreDecision.ask("a person decides"))
        self.asked = asyncio.Event()
        self.answer: asyncio.Future[ApprovalOutcome] = asyncio.get_running_loop().create_future()

    @hookimpl
    def dsh_approve(self, request: Any) -> Any:
        self.seen.append(("approve", request.execution.name))
        self.asked.set()
        return self.answer


async def _while_approval_waits(
    stack: Stack, change: Callable[[], object], *, agent: Any = None
) -> tuple[ToolResult, AskThenWait]:
    """Call ``echo``; while its approval waits, ``change()`` the registry; then allow it."""
    recorder = register(stack.hooks, AskThenWait())
    assert isinstance(recorder, AskThenWait)
    call = asyncio.ensure_future(stack.call("echo", {"text": "hi"}, agent=agent))
    await recorder.asked.wait()
    change()
    recorder.answer.set_result(ApprovalOutcome.ALLOWED)
    return await call, recorder


def _replaced_message(name: str) -> str:
    return (
        f'tool call aborted before dispatch: tool "{name}" was replaced while the call waited, and its new '
        "definition was not judged by this call's policy; call it again"
    )


async def test_a_tool_replaced_during_its_approval_runs_neither_body() -> None:
    stack = Stack()
    old = tool("echo")
    unregister = stack.registry.register(old)
    new = tool("echo")

    def replace() -> None:
        unregister()
        stack.registry.register(new)

    result, recorder = await _while_approval_waits(stack, replace)
    assert result.code == "ABORTED_BEFORE_DISPATCH"
    assert result.error is not None and result.error.message == _replaced_message("echo")
    assert body_calls(old) == [] and body_calls(new) == []
    # Never dispatched: post-execute neither sees nor rewrites it (as any abort before dispatch).
    assert recorder.stages() == ["pre", "approve", "guard", "result"]


async def test_a_tool_shadowed_in_the_agents_layer_during_its_approval_runs_neither_body() -> None:
    stack = Stack()
    old = tool("echo")
    stack.registry.register(old)
    agent = stack.agent()
    new = tool("echo")
    result, _ = await _while_approval_waits(stack, lambda: stack.registry.register(new, scope=agent), agent=agent)
    assert result.code == "ABORTED_BEFORE_DISPATCH"
    assert body_calls(old) == [] and body_calls(new) == []


async def test_a_tool_removed_during_its_approval_is_unknown_and_never_runs() -> None:
    stack = Stack()
    old = tool("echo")
    unregister = stack.registry.register(old)
    result, _ = await _while_approval_waits(stack, unregister)
    assert result.code == "UNKNOWN_TOOL"
    assert result.error is not None
    assert result.error.message == 'unknown tool "echo": it was removed while the call waited'
    assert body_calls(old) == []


async def test_a_tool_registered_under_an_unknown_name_during_its_approval_never_runs() -> None:
    """Policy judged a call to no tool at all: a tool registered meanwhile was judged by nobody."""
    stack = Stack()
    recorder = register(stack.hooks, AskThenWait())
    assert isinstance(recorder, AskThenWait)
    new = tool("late")
    call = asyncio.ensure_future(stack.call("late", {}))
    await recorder.asked.wait()
    stack.registry.register(new)
    recorder.answer.set_result(ApprovalOutcome.ALLOWED)
    result = await call
    assert result.code == "ABORTED_BEFORE_DISPATCH"
    assert result.error is not None and result.error.message == _replaced_message("late").replace(
        "was replaced", "was registered"
    )
    assert body_calls(new) == []


async def test_the_same_definition_registered_again_during_its_approval_still_runs() -> None:
    """No false positive: unregistered and registered again, the very definition policy judged runs."""
    stack = Stack()
    echo = tool("echo")
    unregister = stack.registry.register(echo)

    def again() -> None:
        unregister()
        stack.registry.register(echo)

    result, _ = await _while_approval_waits(stack, again)
    assert not result.is_error and result.value == {"echo": "hi"}
    assert body_calls(echo) == [{"text": "hi"}]


async def test_an_unrelated_registry_change_during_its_approval_does_not_stop_the_call() -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    result, _ = await _while_approval_waits(stack, lambda: stack.registry.register(tool("other")))
    assert not result.is_error and body_calls(echo) == [{"text": "hi"}]


async def test_a_tool_replaced_while_a_middleware_pauses_before_proceed_runs_neither_body() -> None:
    stack = Stack()
    old = tool("echo")
    unregister = stack.registry.register(old)
    new = tool("echo")
    paused = asyncio.Event()
    resume = asyncio.Event()
    seen: list[ToolResult] = []

    class Pausing:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def middleware(call: ToolExecution, proceed: Any) -> ToolResult:
                paused.set()
                await resume.wait()  # a rate limiter, say
                result: ToolResult = await proceed(call)
                seen.append(result)
                return result

            return middleware

    register(stack.hooks, Pausing())
    recorder = register(stack.hooks, Recorder())
    assert isinstance(recorder, Recorder)
    call = asyncio.ensure_future(stack.call("echo", {"text": "hi"}))
    await paused.wait()
    unregister()
    stack.registry.register(new)
    resume.set()
    result = await call
    assert result.code == "ABORTED_BEFORE_DISPATCH"
    assert result.error is not None and result.error.message == _replaced_message("echo")
    assert [r.code for r in seen] == ["ABORTED_BEFORE_DISPATCH"]  # the middleware is told, as of any abort
    assert body_calls(old) == [] and body_calls(new) == []
    assert recorder.stages() == ["pre", "guard", "result"]


async def test_a_staged_call_is_classified_by_the_definition_its_policy_judged() -> None:
    """Classification and body never disagree: once prepared, the call's mode is its pinned definition's,
    whatever the registry holds under the name now."""
    stack = Stack()
    unregister = stack.registry.register(tool("echo", safe=True))
    request = ToolExecutionInput(call_id="c", name="echo", arguments={}, signal=AbortSignal.never())
    staged = await stack.runtime.prepare(request)
    assert staged.kind == "dispatch" and stack.runtime.staged_execution_mode(staged) == "parallel"
    unregister()
    stack.registry.register(tool("echo"))
    assert stack.runtime.execution_mode(request) == "exclusive"  # a new call would be exclusive ...
    assert stack.runtime.staged_execution_mode(staged) == "parallel"  # ... this one runs no exclusive body
    staged = await stack.runtime.dispatch(staged)
    assert staged.result is not None and staged.result.code == "ABORTED_BEFORE_DISPATCH"
    await stack.runtime.finalize(staged)
