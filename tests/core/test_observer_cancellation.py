"""Cancelled while observers are notified, the call still reaches every observer exactly once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dsh_core import hookimpl
from dsh_core.model import ApprovalOutcome, ApprovalRequest, PreDecision, ToolExecution, ToolResult

from .helpers import Recorder, Stack, body_calls, register, tool

pytestmark = pytest.mark.anyio


class _SlowResultObserver:
    """An async observer (an audit store write) the caller is cancelled during."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.interrupted = False

    @hookimpl
    def dsh_tool_result(self, execution: ToolExecution, result: ToolResult) -> Any:
        async def write() -> None:
            self.started.set()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                self.interrupted = True
                raise

        return write()


async def test_cancelled_during_an_async_result_observer_the_later_observers_still_hear_the_result() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    session = register(stack.hooks, Recorder(), name="session")  # registered first: called last
    audit = register(stack.hooks, _SlowResultObserver(), name="audit")
    task = asyncio.ensure_future(stack.call("echo"))
    await audit.started.wait()  # type: ignore[attr-defined]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert audit.interrupted  # type: ignore[attr-defined]
    assert [stage for stage in session.stages() if stage == "result"] == ["result"]  # type: ignore[attr-defined]
    assert not session.results[0][1].is_error  # type: ignore[attr-defined]


async def test_an_observer_raising_cancelled_error_of_its_own_is_contained(caplog: pytest.LogCaptureFixture) -> None:
    # Not a cancellation of the call: an observer that awaited something cancelled elsewhere.
    stack = Stack()
    stack.registry.register(tool("echo"))
    later = register(stack.hooks, Recorder())

    class Gone:
        @hookimpl
        def dsh_tool_result(self) -> Any:
            async def write() -> None:
                future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                future.cancel()
                await future

            return write()

    register(stack.hooks, Gone(), name="gone")
    with caplog.at_level("WARNING", logger="dsh"):
        result = await stack.call("echo")
    assert not result.is_error and later.results[-1][1] is result  # type: ignore[attr-defined]
    assert "tool result observer of plugin 'gone' failed" in caplog.text


async def test_cancelled_during_an_async_approval_observer_the_later_ones_still_hear_the_outcome() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    heard: list[tuple[str, ApprovalOutcome]] = []
    started = asyncio.Event()

    class Journal:
        @hookimpl
        def dsh_approval_resolved(self, request: ApprovalRequest, outcome: ApprovalOutcome) -> None:
            heard.append(("journal", outcome))

    class SlowAudit:
        @hookimpl
        def dsh_approval_resolved(self, request: ApprovalRequest, outcome: ApprovalOutcome) -> Any:
            async def write() -> None:
                started.set()
                await asyncio.sleep(10)

            return write()

    register(stack.hooks, Journal())
    register(stack.hooks, SlowAudit())
    recorder = register(stack.hooks, Recorder(pre=PreDecision.ask("why"), approval="allowed"))
    task = asyncio.ensure_future(stack.call("echo"))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert heard == [("journal", ApprovalOutcome.ALLOWED)]
    assert recorder.results[-1][1].code == "ABORTED_BEFORE_DISPATCH"  # type: ignore[attr-defined]


async def test_cancelled_while_a_person_is_asked_the_approval_observers_still_hear_it_was_cancelled() -> None:
    # One dsh_approval_resolved per ask: a run cancelled at the approval prompt (Ctrl-C) must still
    # record how the ask ended, or the session holds an ask that was never resolved.
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    heard: list[ApprovalOutcome] = []
    asking = asyncio.Event()

    class Journal:
        @hookimpl
        def dsh_approval_resolved(self, request: ApprovalRequest, outcome: ApprovalOutcome) -> None:
            heard.append(outcome)

    class Person:
        @hookimpl
        def dsh_pre_execute(self, execution: ToolExecution) -> PreDecision:
            return PreDecision.ask("why")

        @hookimpl
        def dsh_approve(self, request: ApprovalRequest) -> Any:
            async def prompt() -> ApprovalOutcome:
                asking.set()
                await asyncio.sleep(10)
                return ApprovalOutcome.ALLOWED  # pragma: no cover - never answered

            return prompt()

    register(stack.hooks, Journal())
    register(stack.hooks, Person())
    recorder = register(stack.hooks, Recorder())
    task = asyncio.ensure_future(stack.call("echo"))
    await asking.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert heard == [ApprovalOutcome.CANCELLED]
    assert [r.code for _, r in recorder.results] == ["ABORTED_BEFORE_DISPATCH"]  # type: ignore[attr-defined]
    assert body_calls(echo) == []
