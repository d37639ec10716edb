"""An approval ask nobody answers is denied after ``approval_timeout_s``, and withdrawn.

A withdrawn ask (timed out, aborted, or its caller cancelled) counts as ``cancelled`` whatever
its channel answers afterwards, and a channel that ignores the withdrawal is waited for at most
``approval_grace_s``, then left running and named in a warning.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import pytest

from dsh_core import hookimpl
from dsh_core.abort import AbortController
from dsh_core.model import ApprovalOutcome, ApprovalRequest, PreDecision, ToolExecution
from dsh_core.runtime import APPROVAL_GRACE_S, ToolRuntime

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


def _left_channels(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dsh" and "ignored its withdrawal" in r.getMessage()]


def _settle(person: Any) -> None:
    """Let a channel the runtime left running end, so that no task outlives the test."""
    if person.answer is not None and not person.answer.done():
        person.answer.set_result(ApprovalOutcome.REJECTED)


async def test_a_channel_that_ignores_its_withdrawal_on_timeout_is_left_after_the_grace_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stack = Stack(approval_timeout_s=0.05, approval_grace_s=0.05)
    echo = tool("echo")
    stack.registry.register(echo)
    person = register(stack.hooks, AwayPerson(swallow_cancel=True), name="deaf-channel")
    recorder = register(stack.hooks, Recorder())
    try:
        with caplog.at_level(logging.WARNING, logger="dsh"):
            result = await asyncio.wait_for(stack.call("echo"), 5)
        assert result.code == "DENIED" and result.error is not None and result.error.message == TIMED_OUT
        assert person.withdrawn.is_set() and person.resolved == [ApprovalOutcome.CANCELLED]  # type: ignore[attr-defined]
        (warning,) = _left_channels(caplog)
        assert "'deaf-channel'" in warning and '"echo"' in warning and "0.05 s" in warning
        assert body_calls(echo) == [] and [r.code for _, r in recorder.results] == ["DENIED"]  # type: ignore[attr-defined]
    finally:
        _settle(person)


async def test_a_channel_that_ignores_its_withdrawal_on_abort_is_left_after_the_grace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stack = Stack(approval_grace_s=0.05)
    echo = tool("echo")
    stack.registry.register(echo)
    person = register(stack.hooks, AwayPerson(swallow_cancel=True), name="deaf-channel")
    controller = AbortController()
    call = asyncio.ensure_future(stack.call("echo", signal=controller.signal))
    try:
        while person.answer is None:  # type: ignore[attr-defined]
            await asyncio.sleep(0)
        controller.abort("user pressed stop")
        with caplog.at_level(logging.WARNING, logger="dsh"):
            result = await asyncio.wait_for(call, 5)
        assert result.code == "ABORTED_BEFORE_DISPATCH"
        assert person.resolved == [ApprovalOutcome.CANCELLED]  # type: ignore[attr-defined]
        (warning,) = _left_channels(caplog)
        assert "'deaf-channel'" in warning
        assert body_calls(echo) == []
    finally:
        _settle(person)


async def test_a_cancelled_caller_is_not_held_by_a_channel_that_ignores_the_withdrawal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stack = Stack(approval_grace_s=0.05)
    echo = tool("echo")
    stack.registry.register(echo)
    person = register(stack.hooks, AwayPerson(swallow_cancel=True), name="deaf-channel")
    recorder = register(stack.hooks, Recorder())
    call = asyncio.ensure_future(stack.call("echo"))
    try:
        while person.answer is None:  # type: ignore[attr-defined]
            await asyncio.sleep(0)
        call.cancel()
        with caplog.at_level(logging.WARNING, logger="dsh"), pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 5)
        assert person.resolved == [ApprovalOutcome.CANCELLED]  # type: ignore[attr-defined]
        (warning,) = _left_channels(caplog)
        assert "'deaf-channel'" in warning
        await asyncio.sleep(0)  # the result event is emitted in a task of its own
        assert body_calls(echo) == []
        assert [r.code for _, r in recorder.results] == ["ABORTED_BEFORE_DISPATCH"]  # type: ignore[attr-defined]
    finally:
        _settle(person)


async def test_a_caller_cancelled_again_during_the_grace_leaves_at_once_and_still_names_the_channel(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The second cancellation cut the wait for the channel short, and the warning naming it was never logged."""
    stack = Stack(approval_grace_s=60)  # the wait_for below fails if the call waits out the grace
    echo = tool("echo")
    stack.registry.register(echo)
    person = register(stack.hooks, AwayPerson(swallow_cancel=True), name="deaf-channel")
    recorder = register(stack.hooks, Recorder())
    call = asyncio.ensure_future(stack.call("echo"))
    try:
        while person.answer is None:  # type: ignore[attr-defined]
            await asyncio.sleep(0)
        call.cancel()
        await asyncio.wait_for(person.withdrawn.wait(), 5)  # type: ignore[attr-defined]  # the grace has begun
        call.cancel()
        with caplog.at_level(logging.WARNING, logger="dsh"), pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 5)
        assert person.resolved == [ApprovalOutcome.CANCELLED]  # type: ignore[attr-defined]
        (warning,) = _left_channels(caplog)
        assert "'deaf-channel'" in warning and '"echo"' in warning
        await asyncio.sleep(0)  # the result event is emitted in a task of its own
        assert body_calls(echo) == []
        assert [r.code for _, r in recorder.results] == ["ABORTED_BEFORE_DISPATCH"]  # type: ignore[attr-defined]
    finally:
        _settle(person)


class Guarded:
    """A guard that records being consulted: a withdrawn ask must not reach the guards."""

    def __init__(self) -> None:
        self.consulted = 0

    @hookimpl
    def dsh_guard(self, execution: ToolExecution) -> None:
        self.consulted += 1


async def test_an_allow_given_while_the_ask_is_withdrawn_on_abort_counts_as_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    guard = register(stack.hooks, Guarded())
    person = register(stack.hooks, AwayPerson(swallow_cancel=True), name="late-channel")
    controller = AbortController()
    call = asyncio.ensure_future(stack.call("echo", signal=controller.signal))
    while person.answer is None:  # type: ignore[attr-defined]
        await asyncio.sleep(0)
    controller.abort("user pressed stop")
    await asyncio.wait_for(person.withdrawn.wait(), 5)  # type: ignore[attr-defined]
    person.answer.set_result(ApprovalOutcome.ALLOWED)  # type: ignore[attr-defined]
    result = await asyncio.wait_for(call, 5)
    assert result.code == "ABORTED_BEFORE_DISPATCH"
    assert person.resolved == [ApprovalOutcome.CANCELLED]  # type: ignore[attr-defined]
    assert body_calls(echo) == [] and guard.consulted == 0  # type: ignore[attr-defined]
    assert _left_channels(caplog) == []  # it did answer, within the grace


async def test_an_allow_given_after_the_caller_was_cancelled_counts_as_cancelled() -> None:
    stack = Stack()
    echo = tool("echo")
    stack.registry.register(echo)
    person = register(stack.hooks, AwayPerson(swallow_cancel=True), name="late-channel")
    call = asyncio.ensure_future(stack.call("echo"))
    while person.answer is None:  # type: ignore[attr-defined]
        await asyncio.sleep(0)
    call.cancel()
    await asyncio.wait_for(person.withdrawn.wait(), 5)  # type: ignore[attr-defined]
    person.answer.set_result(ApprovalOutcome.ALLOWED)  # type: ignore[attr-defined]
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(call, 5)
    assert person.resolved == [ApprovalOutcome.CANCELLED]  # type: ignore[attr-defined]
    assert body_calls(echo) == []


class Fallback:
    """A second approval channel, asked only when the first has no answer."""

    def __init__(self) -> None:
        self.asked = 0

    @hookimpl
    def dsh_approve(self, request: ApprovalRequest) -> ApprovalOutcome:
        self.asked += 1
        return ApprovalOutcome.ALLOWED


async def test_a_withdrawn_ask_goes_to_no_further_channel() -> None:
    """A channel that swallows its withdrawal and passes (``None``) must not hand the ask to the next one."""
    stack = Stack(approval_timeout_s=0.05)
    echo = tool("echo")
    stack.registry.register(echo)
    fallback = register(stack.hooks, Fallback())  # registered first: asked after the one below
    person = register(stack.hooks, AwayPerson(swallow_cancel=True))
    call = asyncio.ensure_future(stack.call("echo"))
    await asyncio.wait_for(person.withdrawn.wait(), 5)  # type: ignore[attr-defined]
    person.answer.set_result(None)  # type: ignore[attr-defined]
    result = await asyncio.wait_for(call, 5)
    assert result.code == "DENIED" and result.error is not None and result.error.message == TIMED_OUT
    assert fallback.asked == 0 and body_calls(echo) == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, True, "5", None])
def test_the_grace_must_be_a_positive_finite_number_of_seconds(value: object) -> None:
    stack = Stack()
    with pytest.raises(ValueError, match=r"approval_grace_s must be a positive, finite number of seconds"):
        ToolRuntime(stack.registry, stack.hooks, approval_grace_s=value)  # type: ignore[arg-type]
    assert ToolRuntime(stack.registry, stack.hooks).approval_grace_s == APPROVAL_GRACE_S == 5.0
