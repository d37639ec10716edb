"""The worker's ``run_to_completion``: ``loop.run_until_complete`` minus the loop's cold start.

Each scenario runs once under ``run_to_completion`` and once under
``run_until_complete``, on fresh loops, and must leave the same trace and the
same outcome. A program that finishes in its first step must not start the
loop at all; one that does anything else must run exactly as before.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from dsh_core.coderuntime.worker.runner import run_to_completion

from .conftest import run_one, tools

Scenario = Callable[[asyncio.AbstractEventLoop, list[object]], Coroutine[Any, Any, object]]


async def returns_at_once(loop: asyncio.AbstractEventLoop, trace: list[object]) -> object:
    trace.append(("running", asyncio.get_running_loop() is loop, loop.is_running()))
    trace.append(("task", type(asyncio.current_task()).__name__))
    return [1]


async def awaits_a_sleep(loop: asyncio.AbstractEventLoop, trace: list[object]) -> object:
    trace.append("before")
    await asyncio.sleep(0)
    trace.append("after")
    return "slept"


async def uses_timeout_and_task_group(loop: asyncio.AbstractEventLoop, trace: list[object]) -> object:
    async def child(n: int) -> int:
        trace.append(("child", n))
        await asyncio.sleep(0)
        return n * 10

    async with asyncio.timeout(5):
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(child(n)) for n in range(3)]
    try:
        async with asyncio.timeout(0):
            await asyncio.sleep(1)
    except TimeoutError:
        trace.append("timed out")
    return [task.result() for task in tasks]


async def leaves_a_task_and_callbacks(loop: asyncio.AbstractEventLoop, trace: list[object]) -> object:
    async def background() -> None:
        trace.append("background step 1")
        await asyncio.sleep(0)
        trace.append("background step 2")  # never: the loop stops first

    left = asyncio.create_task(background())
    trace.append(("left pending", not left.done()))
    loop.call_soon(trace.append, "soon")
    loop.call_later(0, trace.append, "later")
    return "left"


async def raises(loop: asyncio.AbstractEventLoop, trace: list[object]) -> object:
    trace.append("raising")
    raise ValueError("from the first step")


async def cancels_itself_and_returns(loop: asyncio.AbstractEventLoop, trace: list[object]) -> object:
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    return "ignored"


async def cancels_itself_and_waits(loop: asyncio.AbstractEventLoop, trace: list[object]) -> object:
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    try:
        await asyncio.sleep(1)
    except asyncio.CancelledError:
        trace.append("cancelled at the await")
        return "caught"
    return "not cancelled"


async def leaves_an_async_generator(loop: asyncio.AbstractEventLoop, trace: list[object]) -> object:
    async def numbers() -> Any:
        try:
            yield 1
            yield 2
        finally:
            trace.append("generator closed")

    generator = numbers()
    trace.append(await generator.__anext__())
    tracked = loop._asyncgens  # type: ignore[attr-defined]  # the loop's own registry
    trace.append(("tracked", generator in tracked))
    del generator
    return "done"


async def exits(loop: asyncio.AbstractEventLoop, trace: list[object]) -> object:
    trace.append("exiting")
    sys.exit(3)


SCENARIOS = [
    returns_at_once,
    awaits_a_sleep,
    uses_timeout_and_task_group,
    leaves_a_task_and_callbacks,
    raises,
    cancels_itself_and_returns,
    cancels_itself_and_waits,
    leaves_an_async_generator,
    exits,
]


def _outcome(
    runner: Callable[[asyncio.AbstractEventLoop, Coroutine[Any, Any, object]], object], scenario: Scenario
) -> tuple[list[object], object, int]:
    loop = asyncio.new_event_loop()
    turns = 0
    run_once = loop._run_once  # type: ignore[attr-defined]

    def counted() -> None:
        nonlocal turns
        turns += 1
        run_once()

    loop._run_once = counted  # type: ignore[attr-defined]
    trace: list[object] = []
    hooks = sys.get_asyncgen_hooks()
    try:
        outcome: object = ("value", runner(loop, scenario(loop, trace)))
    except BaseException as error:  # the outcome under test
        outcome = ("raised", type(error).__name__, str(error))
    # The loop is left exactly as run_until_complete leaves it.
    assert not loop.is_running()
    assert sys.get_asyncgen_hooks() == hooks
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()
    loop.close()
    return trace, outcome, turns


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_same_trace_and_outcome_as_run_until_complete(scenario: Scenario) -> None:
    eager = _outcome(run_to_completion, scenario)
    classic = _outcome(lambda loop, coroutine: loop.run_until_complete(coroutine), scenario)
    assert eager[:2] == classic[:2]


def test_a_program_done_in_its_first_step_never_starts_the_loop() -> None:
    trace, outcome, turns = _outcome(run_to_completion, returns_at_once)
    assert outcome == ("value", [1])
    assert trace == [("running", True, True), ("task", "Task")]
    assert turns == 0
    assert _outcome(run_to_completion, raises)[2] == 0


def test_anything_left_scheduled_runs_the_loop_as_before() -> None:
    trace, outcome, turns = _outcome(run_to_completion, leaves_a_task_and_callbacks)
    assert outcome == ("value", "left")
    assert trace == [("left pending", True), "background step 1", "soon", "later"]
    assert turns == 1


def test_in_a_worker_the_program_runs_in_a_task_on_a_running_loop() -> None:
    program = (
        "import asyncio\n"
        "loop = asyncio.get_running_loop()\n"
        "task = asyncio.current_task()\n"
        "first = [loop.is_running(), task is not None]\n"
        "async with asyncio.timeout(5):\n"
        "    async with asyncio.TaskGroup() as group:\n"
        "        child = group.create_task(tools.echo({'n': 1}))\n"
        "    second = await tools.echo({'n': 2})\n"
        "return first + [child.result(), second, asyncio.current_task() is task]\n"
    )

    async def echo(args: Any) -> Any:
        return args

    result = run_one(program, tools(echo=echo), isolation="L2")
    assert result.error is None, result.error
    assert result.value == [True, True, {"n": 1}, {"n": 2}, True]


def test_an_exit_in_the_first_step_is_not_logged_as_never_retrieved(caplog: pytest.LogCaptureFixture) -> None:
    trace, outcome, _ = _outcome(run_to_completion, exits)
    assert trace == ["exiting"]
    assert outcome == ("raised", "SystemExit", "3")
    gc.collect()  # a task whose exception nobody retrieved says so as it is collected
    assert [record.getMessage() for record in caplog.records if record.name == "asyncio"] == []
