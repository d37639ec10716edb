"""What each nested body may rely on from the scheduler, whichever way it starts bodies.

``asyncio.current_task()`` and ``asyncio.timeout`` target the task that runs the
body to its end, context variables a body sets do not reach the calls a program
makes after it, and a failing or cancelled body is contained with its start and
settle events still paired. (Not promised: bodies the ordered lane runs back to
back in one task, as it does for a gather of exclusive calls, or of safe ones past
``max_parallel_sub_calls``, may see what an earlier one set; so do model-direct
exclusive calls, which the agent loop runs inline.)
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

from codemode_kit import Env, MemorySink, tool

MARK: contextvars.ContextVar[str | None] = contextvars.ContextVar("dsh_test_mark", default=None)


def gather(calls: str) -> str:
    return f"import asyncio\nreturn await asyncio.gather({calls})"


async def test_a_suspending_parallel_body_keeps_one_task_and_its_timeout(env: Env) -> None:
    seen: list[bool] = []

    async def body(args: Any, ctx: Any) -> Any:
        before = asyncio.current_task()
        try:
            async with asyncio.timeout(0.01):
                await asyncio.sleep(1)
        except TimeoutError:
            seen.append(asyncio.current_task() is before)
            return "timed out"
        return "not timed out"

    env.add(tool("slow", body, safe=True), tool("echo", safe=True))
    result = await env.run(gather("tools.slow({}), tools.echo({'i': 1}), tools.slow({})"))
    assert not result.is_error, result.content
    assert result.value["result"] == ["timed out", {"i": 1}, "timed out"]
    assert seen == [True, True]


async def test_context_variables_do_not_leak_between_bodies(env: Env) -> None:
    seen: list[str | None] = []

    async def body(args: Any, ctx: Any) -> Any:
        seen.append(MARK.get())
        MARK.set(f"set by {args['i']}")
        if args.get("suspend"):
            await asyncio.sleep(0)
            seen.append(MARK.get())
        return args["i"]

    env.add(tool("mark", body, safe=True))
    program = (
        "a = await tools.mark({'i': 1})\nb = await tools.mark({'i': 2, 'suspend': True})\n"
        "c = await tools.mark({'i': 3})\nreturn [a, b, c]"
    )
    result = await env.run(program)
    assert result.value["result"] == [1, 2, 3]
    assert seen == [None, None, "set by 2", None]
    assert MARK.get() is None


async def test_a_body_raising_cancelled_error_is_contained(env: Env) -> None:
    async def body(args: Any, ctx: Any) -> Any:
        if args.get("suspend"):
            await asyncio.sleep(0)
        raise asyncio.CancelledError

    env.add(tool("cancels", body, safe=True), tool("echo", safe=True))
    program = (
        "out = []\nfor args in ({}, {'suspend': True}):\n    try:\n        await tools.cancels(args)\n"
        "    except ToolCallError as error:\n        out.append(str(error))\n"
        "out.append(await tools.echo({'i': 1}))\nreturn out"
    )
    result = await env.run(program)
    assert not result.is_error, result.content
    # Nobody cancelled these calls: each is the tool's failure (the runtime says so), and the program goes on.
    failed = 'tool "cancels" raised CancelledError, but its call was not cancelled'
    first, second, echoed = result.value["result"]
    assert first.startswith(failed) and second.startswith(failed) and echoed == {"i": 1}, result.value
    assert env.sink is not None and isinstance(env.sink, MemorySink)
    kinds = [kind for kind, _ in env.sink.kinds()]
    assert kinds.count("tool/code-dispatch-start") == kinds.count("tool/code-dispatch") == 3


async def test_a_suspending_sink_hands_the_lane_off_and_keeps_commit_order() -> None:
    env = Env(sink=MemorySink(settle_delay=0.005))
    env.add(tool("echo", safe=True))
    result = await env.run("out = []\nfor i in range(4):\n    out.append(await tools.echo({'i': i}))\nreturn out")
    assert [value["i"] for value in result.value["result"]] == [0, 1, 2, 3]
    assert env.sink is not None and isinstance(env.sink, MemorySink)
    settles = [sub for kind, sub in env.sink.kinds() if kind == "tool/code-dispatch"]
    assert settles == [f"call-1:code:{n}" for n in range(1, 5)]
