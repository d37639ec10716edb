"""What a call's concurrency slot covers: the classification its body runs under, and its body's whole life.

Driven on the scheduler directly (native mode, so the requests are not collapsed), with
explicit synchronisation only: each test controls when bodies, approvals and cancels happen.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from codemode_kit import Env, tool

from dsh_core import PreDecision, hookimpl
from dsh_core.abort import AbortController, AbortSignal
from dsh_core.codemode.history import DispatchHistory
from dsh_core.codemode.scheduler import ProgramScheduler
from dsh_core.hooks import Hooks
from dsh_core.model import ApprovalOutcome, ToolExecutionInput, ToolResult


def scheduler_of(env: Env, signal: AbortSignal | None = None) -> ProgramScheduler:
    return ProgramScheduler(
        env.runtime,
        signal=signal or AbortSignal.never(),
        context=None,
        history=DispatchHistory(Hooks(), None, root_call_id="r", parent_call_id="p"),
    )


def submit(
    scheduler: ProgramScheduler, n: int, name: str, arguments: Any = None
) -> tuple[asyncio.Future[Any], AbortController]:
    controller = AbortController()
    request = ToolExecutionInput(call_id=f"r:code:{n}", name=name, arguments=arguments or {}, signal=controller.signal)
    return scheduler.submit(request, {}, controller), controller


class Flip:
    """``hold`` (parallel) runs while ``flip`` (parallel when it starts) waits on a person's answer.

    Meanwhile ``flip`` turns not concurrency-safe: its own ``is_concurrency_safe`` answers otherwise
    now, or (``replace``) a dynamic package redefines it as an exclusive tool."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.log: list[str] = []
        self.hold_started, self.hold_release = asyncio.Event(), asyncio.Event()
        self.asked, self.guarded = asyncio.Event(), asyncio.Event()
        self.answer: asyncio.Future[ApprovalOutcome] = asyncio.get_running_loop().create_future()
        self.results: dict[str, Any] = {}
        log = self.log
        flip_runs = self

        async def hold(args: Any, ctx: Any) -> Any:
            log.append("start hold")
            flip_runs.hold_started.set()
            await flip_runs.hold_release.wait()
            log.append("end hold")
            return "held"

        async def flip(args: Any, ctx: Any) -> Any:
            log.append("start flip")
            return "flipped"

        async def new_flip(args: Any, ctx: Any) -> Any:
            log.append("start new flip")
            return "new flip"

        self.flip = flip
        self.new_flip = new_flip
        self.turned = False

        class Policy:
            @hookimpl
            def dsh_pre_execute(self, execution: Any) -> Any:
                return PreDecision.ask("flip asks") if execution.name == "flip" else None

            @hookimpl
            def dsh_approve(self, request: Any) -> Any:
                flip_runs.asked.set()
                return flip_runs.answer

            @hookimpl
            def dsh_guard(self, execution: Any) -> None:
                if execution.name == "flip":
                    flip_runs.guarded.set()

            @hookimpl
            def dsh_tool_result(self, execution: Any, result: Any) -> None:
                flip_runs.results[execution.name] = result.code or result.value

            @hookimpl
            def dsh_around_dispatch(self, execution: Any) -> Any:
                async def note(call: Any, proceed: Any) -> Any:
                    if call.name == "flip":
                        log.append("dispatch flip")
                    return await proceed(call)

                return note

        env.add(tool("hold", hold, safe=True))
        self.unregister = env.registry.register(tool("flip", flip, safe=lambda args: not flip_runs.turned))
        env.plug(Policy())

    async def approve_after_the_tool_turned_exclusive(self, *, replace: bool = False) -> None:
        await self.asked.wait()
        # While the person decides, the tool turns not concurrency-safe.
        if replace:
            self.unregister()
            self.env.add(tool("flip", self.new_flip))
        else:
            self.turned = True
        self.answer.set_result(ApprovalOutcome.ALLOWED)
        await self.guarded.wait()  # its policy is over: a stale parallel slot dispatches it in this same step


async def test_a_call_whose_tool_turned_exclusive_during_its_approval_waits_for_the_bodies_in_flight() -> None:
    """Classified parallel when it started, its tool was replaced by an exclusive one while a person
    decided: the body that runs is the exclusive one, so it must not overlap the bodies in flight."""
    env = Env(mode="native")
    flip = Flip(env)
    scheduler = scheduler_of(env)
    held, _ = submit(scheduler, 1, "hold")
    await flip.hold_started.wait()
    flipped, _ = submit(scheduler, 2, "flip")
    await flip.approve_after_the_tool_turned_exclusive()
    flip.hold_release.set()
    assert await asyncio.gather(held, flipped) == ["held", "flipped"]
    await scheduler.drain()
    assert flip.log == ["start hold", "end hold", "dispatch flip", "start flip"]


async def test_a_call_whose_tool_was_replaced_during_its_approval_runs_no_body_and_does_not_wait() -> None:
    """Replaced by an exclusive tool while a person decided on the old one: neither body runs. The call is
    classified by the definition its policy judged (parallel, like its body, which is none now), so it is
    dispatched (and fails) beside the body in flight instead of holding a barrier for a body it never runs."""
    env = Env(mode="native")
    flip = Flip(env)
    scheduler = scheduler_of(env)
    held, _ = submit(scheduler, 1, "hold")
    await flip.hold_started.wait()
    flipped, _ = submit(scheduler, 2, "flip")
    await flip.approve_after_the_tool_turned_exclusive(replace=True)
    flip.hold_release.set()
    assert await held == "held"
    with pytest.raises(Exception, match='tool "flip" was replaced while the call waited'):
        await flipped
    await scheduler.drain()
    assert flip.log == ["start hold", "dispatch flip", "end hold"]
    assert flip.results == {"hold": "held", "flip": "ABORTED_BEFORE_DISPATCH"}


async def test_a_reclassified_call_the_program_cancels_while_it_waits_never_runs() -> None:
    env = Env(mode="native")
    flip = Flip(env)
    scheduler = scheduler_of(env)
    held, _ = submit(scheduler, 1, "hold")
    await flip.hold_started.wait()
    flipped, _ = submit(scheduler, 2, "flip")
    await flip.approve_after_the_tool_turned_exclusive()
    flipped.cancel()  # as the code runtime does when the program gives up on the call
    flip.hold_release.set()
    assert await held == "held"
    await scheduler.drain()
    assert flip.log == ["start hold", "end hold"]
    assert flip.results == {"hold": "held", "flip": "ABORTED_BEFORE_DISPATCH"}


@pytest.mark.parametrize("middleware", ["awaits-shielded", "answers-early"])
async def test_an_exclusive_call_a_middleware_detached_holds_its_barrier_until_its_body_ends(middleware: str) -> None:
    """A middleware runs ``proceed`` in a task of its own; the program then cancels the call. The cut
    reaches that body (as it reaches one run in the dispatch's own task), and the next exclusive
    call starts only once it really ended, not when the dispatch was cut."""
    env = Env(mode="native")
    log: list[str] = []
    started, cut, cleaned_up, next_started = (asyncio.Event() for _ in range(4))

    async def excl(args: Any, ctx: Any) -> Any:
        i = args["i"]
        log.append(f"start {i}")
        if i == 1:
            next_started.set()
            return i
        started.set()
        try:
            await asyncio.Event().wait()  # ignores its signal: only a cut stops it
        except asyncio.CancelledError:
            log.append(f"cut {i}")
            cut.set()
            await cleaned_up.wait()  # its cleanup takes a while
            log.append(f"end {i}")
            raise
        return i

    class Detaching:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def detach(call: Any, proceed: Any) -> Any:
                if call.arguments["i"] != 0:
                    return await proceed(call)
                body = asyncio.ensure_future(proceed(call))
                if middleware == "awaits-shielded":
                    return await asyncio.shield(body)
                await started.wait()
                return ToolResult(content="answered early", value=0)

            return detach

    env.add(tool("excl", excl))
    env.plug(Detaching())
    scheduler = scheduler_of(env)
    first, _ = submit(scheduler, 1, "excl", {"i": 0})
    await started.wait()
    second, _ = submit(scheduler, 2, "excl", {"i": 1})
    first.cancel()  # as the code runtime does when the program gives up on the call
    try:
        # Either the cut reached the body, or (the barrier freed early) the next body ran beside it.
        waits = [asyncio.ensure_future(event.wait()) for event in (cut, next_started)]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
    finally:
        cleaned_up.set()
    assert await second == 1
    await scheduler.drain()
    assert log == ["start 0", "cut 0", "end 0", "start 1"]


async def test_a_call_cut_in_its_middleware_before_the_body_is_aborted_before_dispatch() -> None:
    """The program gives up on a call whose middleware is still waiting (a rate limiter, say): the
    body never ran, so the call was aborted before dispatch, as a native call cancelled there is."""
    env = Env(mode="native")
    waiting = asyncio.Event()
    ran: list[str] = []
    results: list[Any] = []

    async def body(args: Any, ctx: Any) -> Any:
        ran.append("body")
        return "ran"

    class Limiter:
        @hookimpl
        def dsh_around_dispatch(self) -> Any:
            async def limit(call: Any, proceed: Any) -> Any:
                waiting.set()
                await asyncio.Event().wait()  # no slot ever frees up
                return await proceed(call)

            return limit

        @hookimpl
        def dsh_tool_result(self, execution: Any, result: Any) -> None:
            results.append(result.code)

    env.add(tool("limited", body))
    env.plug(Limiter())
    scheduler = scheduler_of(env)
    limited, _ = submit(scheduler, 1, "limited")
    await waiting.wait()
    limited.cancel()  # as the code runtime does when the program gives up on the call
    await scheduler.drain()
    assert ran == []
    assert results == ["ABORTED_BEFORE_DISPATCH"]


async def test_the_result_observers_of_a_cut_call_are_not_interrupted_by_a_cancelled_lane() -> None:
    """A cut call is finished on the lane; a foreign task-killer cancelling the lane meanwhile must
    not interrupt the observer hearing its one result (the session recorder among them)."""
    env = Env(mode="native")
    waiting, hearing, heard = asyncio.Event(), asyncio.Event(), asyncio.Event()
    log: list[str] = []

    async def body(args: Any, ctx: Any) -> Any:
        waiting.set()
        await asyncio.Event().wait()

    class Observer:
        @hookimpl
        def dsh_tool_result(self, execution: Any, result: Any) -> Any:
            async def hear() -> None:
                hearing.set()
                try:
                    await heard.wait()
                except asyncio.CancelledError:
                    log.append("interrupted")
                    raise
                log.append(f"heard {result.code}")

            return hear()

    env.add(tool("t", body))
    env.plug(Observer())
    scheduler = scheduler_of(env)
    cut, _ = submit(scheduler, 1, "t")
    await waiting.wait()
    cut.cancel()  # the program gives up: the call is cut, then finished on the lane
    await hearing.wait()
    lane = scheduler._holder
    assert lane is not None
    lane.cancel()  # a foreign task-killer (or loop teardown)
    await asyncio.sleep(0)
    heard.set()
    await scheduler.drain()
    assert log == ["heard ABORTED"]
