"""An approval ask nobody answers is denied after ``approval_timeout_s``, and withdrawn.

A withdrawn ask (timed out, aborted, or its caller cancelled) counts as ``cancelled`` whatever
its channel answers afterwards, and a channel that ignores the withdrawal is waited for at most
``approval_grace_s``, then left running and named in a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from dsh_core import hookimpl
from dsh_core.abort import AbortController
from dsh_core.model import ApprovalOutcome, ApprovalRequest, PreDecision, ToolDefinition, ToolExecution
from dsh_core.runtime import APPROVAL_GRACE_S, ToolRuntime

from .helpers import Recorder, Stack, body_calls, register, tool

pytestmark = pytest.mark.anyio

TIMED_OUT = 'the approval request for tool "echo" timed out after 0.05 s; the call is denied'
#: Seconds a test waits for what must come promptly: far below any grace a test waits out (60 s).
PROMPT = 20


class AwayPerson:
    """Asks, and answers only when the test says so (``answer``): late, or never."""

    def __init__(self, *, swallow_cancel: bool = False) -> None:
        self.answer: asyncio.Future[ApprovalOutcome] | None = None
        self.asked = asyncio.Event()
        self.withdrawn = asyncio.Event()
        self.resolved: list[ApprovalOutcome] = []
        self.swallow_cancel = swallow_cancel

    @hookimpl
    def dsh_pre_execute(self, execution: ToolExecution) -> PreDecision:
        return PreDecision.ask("check")

    @hookimpl
    def dsh_approve(self, request: ApprovalRequest) -> Any:
        self.answer = asyncio.get_running_loop().create_future()
        self.asked.set()

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


def _left_channels(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dsh" and "ignored its withdrawal" in r.getMessage()]


def _settle(person: AwayPerson) -> None:
    """Let a channel the runtime left running end, so that no task outlives the test."""
    if person.answer is not None and not person.answer.done():
        person.answer.set_result(ApprovalOutcome.REJECTED)


@dataclass
class Deaf:
    """A deaf-channel test's set-up: the stack, its ``echo`` tool, the channel, and a recorder of results."""

    stack: Stack
    echo: ToolDefinition
    person: AwayPerson
    recorder: Recorder

    @property
    def answer(self) -> asyncio.Future[ApprovalOutcome]:
        """The channel's pending answer: set it to answer late (the channel must have been asked)."""
        assert self.person.answer is not None, "the channel was not asked yet"
        return self.person.answer


@contextlib.asynccontextmanager
async def deaf_channel(
    *,
    approval_timeout_s: float | None = None,
    approval_grace_s: float | None = None,
    name: str = "deaf-channel",
    first: tuple[object, ...] = (),
) -> AsyncIterator[Deaf]:
    """A :class:`Stack` with an ``echo`` tool and an approval channel ``name`` that ignores its withdrawal.

    ``first`` are plugins registered before the channel (pluggy asks them after it); a :class:`Recorder`
    is registered after it. On the way out a channel still waiting is answered, so no task outlives the test.
    """
    stack = Stack(approval_timeout_s=approval_timeout_s, approval_grace_s=approval_grace_s)
    echo = tool("echo")
    stack.registry.register(echo)
    for plugin in first:
        register(stack.hooks, plugin)
    person = AwayPerson(swallow_cancel=True)
    register(stack.hooks, person, name=name)
    recorder = Recorder()
    register(stack.hooks, recorder)
    try:
        yield Deaf(stack, echo, person, recorder)
    finally:
        _settle(person)


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
    async with deaf_channel(approval_timeout_s=0.05) as deaf:
        call = asyncio.ensure_future(deaf.stack.call("echo"))
        await asyncio.wait_for(deaf.person.withdrawn.wait(), PROMPT)
        deaf.answer.set_result(ApprovalOutcome.ALLOWED)
        result = await asyncio.wait_for(call, PROMPT)
        assert result.code == "DENIED" and result.error is not None and result.error.message == TIMED_OUT
        assert body_calls(deaf.echo) == []


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


async def test_a_channel_that_ignores_its_withdrawal_on_timeout_is_left_after_the_grace_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with deaf_channel(approval_timeout_s=0.05, approval_grace_s=0.05) as deaf:
        with caplog.at_level(logging.WARNING, logger="dsh"):
            result = await asyncio.wait_for(deaf.stack.call("echo"), PROMPT)
        assert result.code == "DENIED" and result.error is not None and result.error.message == TIMED_OUT
        assert deaf.person.withdrawn.is_set() and deaf.person.resolved == [ApprovalOutcome.CANCELLED]
        (warning,) = _left_channels(caplog)
        assert "'deaf-channel'" in warning and '"echo"' in warning and "0.05 s" in warning
        assert body_calls(deaf.echo) == [] and [r.code for _, r in deaf.recorder.results] == ["DENIED"]


async def test_a_channel_that_ignores_its_withdrawal_on_abort_is_left_after_the_grace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with deaf_channel(approval_grace_s=0.05) as deaf:
        controller = AbortController()
        call = asyncio.ensure_future(deaf.stack.call("echo", signal=controller.signal))
        await asyncio.wait_for(deaf.person.asked.wait(), PROMPT)
        controller.abort("user pressed stop")
        with caplog.at_level(logging.WARNING, logger="dsh"):
            result = await asyncio.wait_for(call, PROMPT)
        assert result.code == "ABORTED_BEFORE_DISPATCH"
        assert deaf.person.resolved == [ApprovalOutcome.CANCELLED]
        (warning,) = _left_channels(caplog)
        assert "'deaf-channel'" in warning
        assert body_calls(deaf.echo) == []


async def test_a_cancelled_caller_is_not_held_by_a_channel_that_ignores_the_withdrawal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with deaf_channel(approval_grace_s=0.05) as deaf:
        call = asyncio.ensure_future(deaf.stack.call("echo"))
        await asyncio.wait_for(deaf.person.asked.wait(), PROMPT)
        call.cancel()
        with caplog.at_level(logging.WARNING, logger="dsh"), pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, PROMPT)
        assert deaf.person.resolved == [ApprovalOutcome.CANCELLED]
        (warning,) = _left_channels(caplog)
        assert "'deaf-channel'" in warning
        await asyncio.sleep(0)  # the result event is emitted in a task of its own
        assert body_calls(deaf.echo) == []
        assert [r.code for _, r in deaf.recorder.results] == ["ABORTED_BEFORE_DISPATCH"]


async def test_a_caller_cancelled_again_during_the_grace_leaves_at_once_and_still_names_the_channel(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The second cancellation cut the wait for the channel short, and the warning naming it was never logged."""
    # The grace is three times PROMPT: the wait_for below fails if the call waits out the grace.
    async with deaf_channel(approval_grace_s=3 * PROMPT) as deaf:
        call = asyncio.ensure_future(deaf.stack.call("echo"))
        await asyncio.wait_for(deaf.person.asked.wait(), PROMPT)
        call.cancel()
        await asyncio.wait_for(deaf.person.withdrawn.wait(), PROMPT)  # the grace has begun
        call.cancel()
        with caplog.at_level(logging.WARNING, logger="dsh"), pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, PROMPT)
        assert deaf.person.resolved == [ApprovalOutcome.CANCELLED]
        (warning,) = _left_channels(caplog)
        assert "'deaf-channel'" in warning and '"echo"' in warning
        await asyncio.sleep(0)  # the result event is emitted in a task of its own
        assert body_calls(deaf.echo) == []
        assert [r.code for _, r in deaf.recorder.results] == ["ABORTED_BEFORE_DISPATCH"]


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
    guard = Guarded()
    async with deaf_channel(name="late-channel", first=(guard,)) as deaf:
        controller = AbortController()
        call = asyncio.ensure_future(deaf.stack.call("echo", signal=controller.signal))
        await asyncio.wait_for(deaf.person.asked.wait(), PROMPT)
        controller.abort("user pressed stop")
        await asyncio.wait_for(deaf.person.withdrawn.wait(), PROMPT)
        deaf.answer.set_result(ApprovalOutcome.ALLOWED)
        result = await asyncio.wait_for(call, PROMPT)
        assert result.code == "ABORTED_BEFORE_DISPATCH"
        assert deaf.person.resolved == [ApprovalOutcome.CANCELLED]
        assert body_calls(deaf.echo) == [] and guard.consulted == 0
        assert _left_channels(caplog) == []  # it did answer, within the grace


async def test_an_allow_given_after_the_caller_was_cancelled_counts_as_cancelled() -> None:
    async with deaf_channel(name="late-channel") as deaf:
        call = asyncio.ensure_future(deaf.stack.call("echo"))
        await asyncio.wait_for(deaf.person.asked.wait(), PROMPT)
        call.cancel()
        await asyncio.wait_for(deaf.person.withdrawn.wait(), PROMPT)
        deaf.answer.set_result(ApprovalOutcome.ALLOWED)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, PROMPT)
        assert deaf.person.resolved == [ApprovalOutcome.CANCELLED]
        assert body_calls(deaf.echo) == []


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
    fallback = Fallback()
    async with deaf_channel(approval_timeout_s=0.05, first=(fallback,)) as deaf:  # first: asked after the channel
        call = asyncio.ensure_future(deaf.stack.call("echo"))
        await asyncio.wait_for(deaf.person.withdrawn.wait(), PROMPT)
        deaf.answer.set_result(None)  # type: ignore[arg-type]  # the channel passes, late
        result = await asyncio.wait_for(call, PROMPT)
        assert result.code == "DENIED" and result.error is not None and result.error.message == TIMED_OUT
        assert fallback.asked == 0 and body_calls(deaf.echo) == []


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, True, "5", None])
def test_the_grace_must_be_a_positive_finite_number_of_seconds(value: object) -> None:
    stack = Stack()
    with pytest.raises(ValueError, match=r"approval_grace_s must be a positive, finite number of seconds"):
        ToolRuntime(stack.registry, stack.hooks, approval_grace_s=value)  # type: ignore[arg-type]
    assert ToolRuntime(stack.registry, stack.hooks).approval_grace_s == APPROVAL_GRACE_S == 5.0
