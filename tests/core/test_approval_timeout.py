"""An approval ask nobody answers is denied after ``approval_timeout_s``, and withdrawn."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from dsh_core import hookimpl
from dsh_core.model import ApprovalOutcome, ApprovalRequest, PreDecision, ToolExecution
from dsh_core.runtime import ToolRuntime

from .helpers import Recorder, Stack, body_calls, register, tool

pytestmark = pytest.mark.anyio

TIMED_OUT = 'the approval request for tool "echo" timed out after 0.05 s; the call is denied'


class AwayPerson:
    """Asks, and answers only when the test says so (``answer``): late, or never."""

    def __init__(self, *, swallow_cancel: bool = False) -> None:
        self.answer: asyncio.Future[ApprovalOutcome] | None = None
        self.withdrawn = asyncio.Event()
        self.resolved: list[ApprovalOutcome] = []
        self.swallow_cancel = swallow_cancel

    @hookimpl
    def dsh_pre_execute(self, execution: ToolExecution) -> PreDecision:
        return PreDecision.ask("check")

    @hookimpl
    def dsh_approve(self, request: ApprovalRequest) -> Any:
        self.answer = asyncio.get_running_loop().create_future()

        async def ask() -> ApprovalOutcome:
            assert self.answer is not None
            try:
                return await asyncio.shield(self.answer)
            except asyncio.CancelledError:
                self.withdrawn.set()
                if not self.swallow_cancel:
                    raise
                # A channel that ignores being withdrawn and answers anyway, late.
                return await self.answer

        return ask()

    @hookimpl
    def dsh_approval_resolved(self, request: ApprovalRequest, outcome: ApprovalOutcome) -> None:
        self.resolved.append(outcome)


async def test_an_unanswered_ask_is_denied_after_the_timeout_and_withdrawn() -> None:
    stack = Stack(approval_timeout_s=0.05)
    echo = tool("echo")
    stack.registry.register(echo)
    person = register(stack.hooks, AwayPerson())
    recorder = register(stack.hooks, Recorder())
    result = await asyncio.wait_for(stack.call("echo"), 5)
    assert result.code == "DENIED" and result.error is not None and result.error.message == TIMED_OUT
    assert person.withdrawn.is_set()  # type: ignore[attr-defined]
    assert person.resolved == [ApprovalOutcome.CANCELLED]  # type: ignore[attr-defined]
    # The late answer finds nobody waiting: no body, no second result.
    person.answer.set_result(ApprovalOutcome.ALLOWED)  # type: ignore[attr-defined]
    await asyncio.sleep(0.05)
    assert body_calls(echo) == []
    assert [r.code for _, r in recorder.results] == ["DENIED"]  # type: ignore[attr-defined]


async def test_a_late_allow_from_a_channel_that_ignores_the_withdrawal_is_still_denied() -> None:
    stack = Stack(approval_timeout_s=0.05)
    echo = tool("echo")
    stack.registry.register(echo)
    person = register(stack.hooks, AwayPerson(swallow_cancel=True))
    call = asyncio.ensure_future(stack.call("echo"))
    await asyncio.wait_for(person.withdrawn.wait(), 5)  # type: ignore[attr-defined]
    person.answer.set_result(ApprovalOutcome.ALLOWED)  # type: ignore[attr-defined]
    result = await asyncio.wait_for(call, 5)
    assert result.code == "DENIED" and result.error is not None and result.error.message == TIMED_OUT
    assert body_calls(echo) == []


async def test_an_answer_within_the_timeout_counts() -> None:
    stack = Stack(approval_timeout_s=5)
    echo = tool("echo")
    stack.registry.register(echo)
    register(stack.hooks, Recorder(pre=PreDecision.ask(), approval="allowed"))
    assert not (await stack.call("echo")).is_error
    assert len(body_calls(echo)) == 1


async def test_without_a_timeout_an_ask_waits_for_its_answer() -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    person = register(stack.hooks, AwayPerson())
    call = asyncio.ensure_future(stack.call("echo"))
    await asyncio.sleep(0.2)
    assert not call.done() and not person.withdrawn.is_set()  # type: ignore[attr-defined]
    person.answer.set_result(ApprovalOutcome.ALLOWED)  # type: ignore[attr-defined]
    assert not (await asyncio.wait_for(call, 5)).is_error


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, True, "5"])
def test_the_timeout_must_be_a_positive_finite_number_of_seconds(value: object) -> None:
    stack = Stack()
    with pytest.raises(ValueError, match=r"approval_timeout_s must be a positive, finite number of seconds"):
        ToolRuntime(stack.registry, stack.hooks, approval_timeout_s=value)  # type: ignore[arg-type]
