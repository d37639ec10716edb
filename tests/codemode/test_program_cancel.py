"""A call the program cancels (``asyncio.wait_for``, ``asyncio.timeout``, ``task.cancel()``) stops on the host.

Through the in-process fake runtime: cancelling the program's await cancels the
scheduler's future, as the worker host does on the worker's ``cancel`` message
(``test_e2e_worker.py`` covers the real worker).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from codemode_kit import Env, tool

from dsh_core import PreDecision, ToolError, hookimpl
from dsh_core.codemode.scheduler import PROGRAM_CANCELLED
from dsh_core.model import ApprovalOutcome

#: Ways a program gives up on ``tools.NAME(ARGS)``; each prints "gave up" and goes on.
CANCEL_FORMS = {
    "wait_for": "try:\n    await asyncio.wait_for(tools.NAME(ARGS), 0.05)\n"
    "except TimeoutError:\n    print('gave up')\n",
    "timeout": "try:\n    async with asyncio.timeout(0.05):\n        await tools.NAME(ARGS)\n"
    "except TimeoutError:\n    print('gave up')\n",
    "task.cancel": "task = asyncio.ensure_future(tools.NAME(ARGS))\nawait asyncio.sleep(0.05)\ntask.cancel()\n"
    "try:\n    await task\nexcept asyncio.CancelledError:\n    print('gave up')\n",
}


def give_up(form: str, name: str, args: str = "{}") -> str:
    return CANCEL_FORMS[form].replace("NAME", name).replace("ARGS", args)


def settles(env: Env) -> list[tuple[str | None, str, bool, str | None]]:
    return [
        (e["sub_call_id"], e["payload"]["name"], e["payload"]["is_error"], e["payload"]["error_code"])
        for e in env.sink.events
        if e["kind"] == "tool/code-dispatch"
    ]  # type: ignore[union-attr]


def started(env: Env) -> list[str | None]:
    return [e["sub_call_id"] for e in env.sink.events if e["kind"] == "tool/code-dispatch-start"]  # type: ignore[union-attr]


def status_tool() -> Any:
    async def status(args: Any, ctx: Any) -> Any:
        return "ok"

    return tool("status", status)


@pytest.mark.parametrize("form", sorted(CANCEL_FORMS))
@pytest.mark.parametrize("listens", [True, False], ids=["body-listens", "body-ignores-signal"])
async def test_a_cancelled_exclusive_call_is_aborted_and_frees_the_barrier(form: str, listens: bool) -> None:
    # Its signal is aborted first (listeners run at once: a subprocess is killed there), then
    # its body is cut where it waits, seeing the abort, as a cancelled native call's body is.
    env = Env()
    seen: list[Any] = []

    async def deploy(args: Any, ctx: Any) -> Any:
        if listens:
            ctx.signal.add_listener(lambda reason: seen.append(["listener", reason]))
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append(["cut", ctx.signal.aborted, ctx.signal.reason])
            raise
        return "deployed"

    env.add(tool("deploy", deploy), status_tool())  # exclusive: status waits for its barrier
    result = await env.run("import asyncio\n" + give_up(form, "deploy") + "return await tools.status({})")
    # The body was cut, not left to its 30 s sleep: "cut" below is only seen by a cancelled body.
    assert result.value == {"logs": ["gave up"], "result": "ok"}, result.text
    assert seen == [["listener", PROGRAM_CANCELLED]] * listens + [["cut", True, PROGRAM_CANCELLED]]
    assert settles(env) == [("call-1:code:1", "deploy", True, "ABORTED"), ("call-1:code:2", "status", False, None)]


async def test_a_retry_loop_runs_one_body_per_attempt_each_after_the_last_was_cut() -> None:
    env = Env()
    events: list[str] = []

    async def deploy(args: Any, ctx: Any) -> Any:
        attempt = args["attempt"]
        events.append(f"start {attempt}")
        try:
            await asyncio.sleep(0 if attempt == 2 else 30)
        except asyncio.CancelledError:
            events.append(f"cut {attempt}")
            raise
        events.append(f"done {attempt}")
        return "deployed"

    env.add(tool("deploy", deploy), status_tool())
    program = (
        "import asyncio\nfor attempt in range(3):\n    try:\n"
        "        await asyncio.wait_for(tools.deploy({'attempt': attempt}), 0.05)\n"
        "        print('deployed on attempt', attempt)\n        break\n"
        "    except TimeoutError:\n        print('attempt', attempt, 'timed out')\n"
        "return await tools.status({})"
    )
    result = await env.run(program)
    assert result.value == {
        "logs": ["attempt 0 timed out", "attempt 1 timed out", "deployed on attempt 2"],
        "result": "ok",
    }, result.text
    assert events == ["start 0", "cut 0", "start 1", "cut 1", "start 2", "done 2"]
    assert settles(env) == [
        ("call-1:code:1", "deploy", True, "ABORTED"),
        ("call-1:code:2", "deploy", True, "ABORTED"),
        ("call-1:code:3", "deploy", False, None),
        ("call-1:code:4", "status", False, None),
    ]


@pytest.mark.parametrize("cap", [1, 10])
async def test_a_queued_call_the_program_cancels_never_starts_and_logs_nothing(cap: int) -> None:
    # Queued behind an exclusive call (cap 10), or behind a full pool of parallel ones (cap 1).
    env = Env(cap=cap)
    ran: list[Any] = []

    async def hold(args: Any, ctx: Any) -> Any:
        ran.append("hold")
        await asyncio.sleep(0.2)  # the program gives up on the queued call meanwhile
        return "held"

    async def queued(args: Any, ctx: Any) -> Any:
        ran.append("queued")
        return "queued ran"

    safe = cap == 1
    env.add(tool("hold", hold, safe=safe), tool("queued", queued, safe=safe), status_tool())
    program = (
        "import asyncio\nheld = asyncio.ensure_future(tools.hold({}))\nawait asyncio.sleep(0.02)\n"
        + give_up("task.cancel", "queued")
        + "return [await held, await tools.status({})]"
    )
    result = await env.run(program)
    assert result.value == {"logs": ["gave up"], "result": ["held", "ok"]}, result.text
    assert ran == ["hold"]
    assert started(env) == ["call-1:code:1", "call-1:code:3"]  # nothing for the cancelled call 2
    assert settles(env) == [("call-1:code:1", "hold", False, None), ("call-1:code:3", "status", False, None)]


class Asks:
    """Asks a person about ``danger``, who never answers; records how the prompt ended."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.resolved: list[ApprovalOutcome] = []

    @hookimpl
    def dsh_pre_execute(self, execution: Any) -> Any:
        return PreDecision.ask("dangerous") if execution.name == "danger" else None

    @hookimpl
    def dsh_approve(self, request: Any) -> Any:
        async def person() -> ApprovalOutcome:
            self.prompts.append("asked")
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.prompts.append("prompt withdrawn")
                raise
            return ApprovalOutcome.ALLOWED

        return person()

    @hookimpl
    def dsh_approval_resolved(self, request: Any, outcome: ApprovalOutcome) -> None:
        self.resolved.append(outcome)


async def test_the_approval_prompt_of_a_cancelled_call_is_withdrawn() -> None:
    env = Env()
    asks = Asks()
    env.plug(asks)
    bodies: list[str] = []

    async def danger(args: Any, ctx: Any) -> Any:
        bodies.append("danger")
        return "did it"

    env.add(tool("danger", danger), status_tool())
    result = await env.run("import asyncio\n" + give_up("wait_for", "danger") + "return await tools.status({})")
    assert result.value == {"logs": ["gave up"], "result": "ok"}, result.text
    assert asks.prompts == ["asked", "prompt withdrawn"] and asks.resolved == [ApprovalOutcome.CANCELLED]
    assert bodies == []
    assert settles(env) == [
        ("call-1:code:1", "danger", True, "ABORTED_BEFORE_DISPATCH"),
        ("call-1:code:2", "status", False, None),
    ]


async def test_a_parallel_call_cancelled_among_others_stops_alone() -> None:
    env = Env()
    events: list[str] = []

    async def work(args: Any, ctx: Any) -> Any:
        name = args["n"]
        try:
            await asyncio.sleep(30 if name == "slow" else 0.1)
        except asyncio.CancelledError:
            events.append(f"cut {name}: {ctx.signal.reason}")
            raise
        events.append(f"done {name}")
        return name

    env.add(tool("work", work, safe=True))
    program = (
        "import asyncio\nothers = asyncio.gather(tools.work({'n': 'a'}), tools.work({'n': 'b'}))\n"
        + give_up("wait_for", "work", "{'n': 'slow'}")
        + "return await others"
    )
    result = await env.run(program)
    assert result.value == {"logs": ["gave up"], "result": ["a", "b"]}, result.text
    assert events == [f"cut slow: {PROGRAM_CANCELLED}", "done a", "done b"]
    assert settles(env) == [
        ("call-1:code:1", "work", False, None),
        ("call-1:code:2", "work", False, None),
        ("call-1:code:3", "work", True, "ABORTED"),
    ]


async def test_a_body_that_swallows_the_cut_commits_as_aborted_and_the_lane_goes_on() -> None:
    env = Env()
    seen: list[Any] = []

    async def stubborn(args: Any, ctx: Any) -> Any:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("swallowed")
        return "finished anyway"

    async def check(args: Any, ctx: Any) -> Any:
        task = asyncio.current_task()
        assert task is not None
        seen.append(["next body's task cancelling()", task.cancelling()])
        return "checked"

    async def converts(args: Any, ctx: Any) -> Any:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise ToolError("stopped: " + str(ctx.signal.reason)) from None
        return "never"

    env.add(tool("stubborn", stubborn), tool("check", check), tool("converts", converts))
    program = (
        "import asyncio\n"
        + give_up("wait_for", "stubborn")
        + "await tools.check({})\n"
        + give_up("wait_for", "converts")
        + "return await tools.check({})"
    )
    result = await env.run(program)
    assert result.value == {"logs": ["gave up", "gave up"], "result": "checked"}, result.text
    assert seen == ["swallowed", ["next body's task cancelling()", 0], ["next body's task cancelling()", 0]]
    assert settles(env) == [
        ("call-1:code:1", "stubborn", True, "ABORTED"),
        ("call-1:code:2", "check", False, None),
        ("call-1:code:3", "converts", True, "TOOL_FAILED"),
        ("call-1:code:4", "check", False, None),
    ]


async def test_a_call_whose_body_ended_before_the_cancel_commits_as_it_ended() -> None:
    # Its body returned at once, but it commits in submission order, after a slower call:
    # the program gives up meanwhile. The tool did run: recorded as it ended, its signal quiet.
    env = Env()
    signals: list[Any] = []

    async def work(args: Any, ctx: Any) -> Any:
        signals.append(ctx.signal)
        await asyncio.sleep(args["s"])
        return args["s"]

    env.add(tool("work", work, safe=True))
    program = (
        "import asyncio\nfirst = asyncio.ensure_future(tools.work({'s': 0.15}))\n"
        + give_up("wait_for", "work", "{'s': 0}")
        + "return await first"
    )
    result = await env.run(program)
    assert result.value == {"logs": ["gave up"], "result": 0.15}, result.text
    assert settles(env) == [("call-1:code:1", "work", False, None), ("call-1:code:2", "work", False, None)]
    assert not signals[1].aborted  # nor by the run's end: it let go of the run's signal at its commit


async def test_calls_still_running_when_the_program_ends_are_not_cut_as_cancelled() -> None:
    # The run's end aborts them with its own reason; their bodies finish (as before).
    env = Env()
    events: list[Any] = []

    async def slow(args: Any, ctx: Any) -> Any:
        await asyncio.sleep(0.1)
        events.append(["finished", ctx.signal.reason])
        return "late"

    env.add(tool("slow", slow))
    result = await env.run(
        "import asyncio\nasyncio.ensure_future(tools.slow({}))\nawait asyncio.sleep(0.02)\nreturn 'done'"
    )
    assert result.value == {"logs": [], "result": "done"}, result.text
    assert events == [["finished", "run_code settled"]]
    assert settles(env) == [("call-1:code:1", "slow", True, "ABORTED")]
