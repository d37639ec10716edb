"""Scenarios that ``run_to_completion`` must run exactly as ``loop.run_until_complete`` does.

Standard library only, like the worker: the tests run it in process, and as a
script under every other CPython 3.11+ on the machine, since the function
relies on the loop's internals (``python run_to_completion_scenarios.py
WORKER_DIR`` prints the mismatches as JSON).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import Any

Loop = asyncio.AbstractEventLoop
Trace = list[object]
Program = Callable[[Loop, Trace], Coroutine[Any, Any, object]]
Runner = Callable[[Loop, Coroutine[Any, Any, object]], object]


async def returns_at_once(loop: Loop, trace: Trace) -> object:
    trace.append(("running", asyncio.get_running_loop() is loop, loop.is_running()))
    trace.append(("task", type(asyncio.current_task()).__name__))
    return [1]


async def awaits_a_sleep(loop: Loop, trace: Trace) -> object:
    trace.append("before")
    await asyncio.sleep(0)
    trace.append("after")
    return "slept"


async def uses_timeout_and_task_group(loop: Loop, trace: Trace) -> object:
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


async def leaves_a_task_and_callbacks(loop: Loop, trace: Trace) -> object:
    async def background() -> None:
        trace.append("background step 1")
        await asyncio.sleep(0)
        trace.append("background step 2")  # never: the loop stops first

    left = asyncio.create_task(background())
    trace.append(("left pending", not left.done()))
    loop.call_soon(trace.append, "soon")
    loop.call_later(0, trace.append, "later")
    return "left"


async def raises(loop: Loop, trace: Trace) -> object:
    trace.append("raising")
    raise ValueError("from the first step")


async def cancels_itself_and_returns(loop: Loop, trace: Trace) -> object:
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    return "ignored"


async def cancels_itself_and_waits(loop: Loop, trace: Trace) -> object:
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    try:
        await asyncio.sleep(1)
    except asyncio.CancelledError:
        trace.append("cancelled at the await")
        return "caught"
    return "not cancelled"


async def closes_an_async_generator(loop: Loop, trace: Trace) -> object:
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
    del generator  # the loop's finalizer hook schedules its aclose()
    for _ in range(3):
        await asyncio.sleep(0)
    return "done"


async def exits(loop: Loop, trace: Trace) -> object:
    trace.append("exiting")
    sys.exit(3)


async def exits_after_an_await(loop: Loop, trace: Trace) -> object:
    await asyncio.sleep(0)
    trace.append("exiting")
    sys.exit(4)


async def is_interrupted(loop: Loop, trace: Trace) -> object:
    raise KeyboardInterrupt


async def stops_the_loop_and_waits(loop: Loop, trace: Trace) -> object:
    loop.stop()
    await asyncio.sleep(0)
    trace.append("second step")
    return 1


async def stops_the_loop_and_returns(loop: Loop, trace: Trace) -> object:
    loop.stop()
    return 2


async def notes_origin_tracking(loop: Loop, trace: Trace) -> object:
    trace.append(("origin tracking", sys.get_coroutine_origin_tracking_depth()))
    return "noted"


def _debug(loop: Loop, trace: Trace) -> None:
    loop.set_debug(True)


def _readable_descriptor(loop: Loop, trace: Trace) -> None:
    ours, theirs = socket.socketpair()
    theirs.send(b"x")

    def on_readable() -> None:
        trace.append("reader")
        loop.remove_reader(ours.fileno())

    loop.add_reader(ours.fileno(), on_readable)
    trace.append(("sockets", ours, theirs))  # kept open until the loop is closed


async def schedules_then_waits(loop: Loop, trace: Trace) -> object:
    loop.call_soon(trace.append, "soon from the step")
    await asyncio.sleep(0)
    return "waited"


#: (name, program, set-up of the fresh loop before the run)
SCENARIOS: list[tuple[str, Program, Callable[[Loop, Trace], None] | None]] = [
    ("returns_at_once", returns_at_once, None),
    ("awaits_a_sleep", awaits_a_sleep, None),
    ("uses_timeout_and_task_group", uses_timeout_and_task_group, None),
    ("leaves_a_task_and_callbacks", leaves_a_task_and_callbacks, None),
    ("raises", raises, None),
    ("cancels_itself_and_returns", cancels_itself_and_returns, None),
    ("cancels_itself_and_waits", cancels_itself_and_waits, None),
    ("closes_an_async_generator", closes_an_async_generator, None),
    ("exits", exits, None),
    ("exits_after_an_await", exits_after_an_await, None),
    ("is_interrupted", is_interrupted, None),
    ("stops_the_loop_and_waits", stops_the_loop_and_waits, None),
    ("stops_the_loop_and_returns", stops_the_loop_and_returns, None),
    ("debug_mode", notes_origin_tracking, _debug),
    ("descriptor_ready_at_start_then_finishes", returns_at_once, _readable_descriptor),
    ("descriptor_ready_at_start_then_waits", schedules_then_waits, _readable_descriptor),
]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        first = record.getMessage().splitlines()[0]
        self.lines.append(re.sub(r"Task-\d+|0x[0-9a-f]+", "_", first))


def outcome(runner: Runner, program: Program, setup: Callable[[Loop, Trace], None] | None) -> dict[str, object]:
    """Trace, outcome, asyncio log lines and loop turns of one run, on a fresh loop."""
    loop = asyncio.new_event_loop()
    turns = 0
    run_once = loop._run_once  # type: ignore[attr-defined]

    def counted() -> None:
        nonlocal turns
        turns += 1
        run_once()

    loop._run_once = counted  # type: ignore[attr-defined]
    trace: Trace = []
    if setup is not None:
        setup(loop, trace)
    records = _Records()
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addHandler(records)
    asyncio_log.propagate = False
    hooks = sys.get_asyncgen_hooks()
    try:
        result: object = ("value", runner(loop, program(loop, trace)))
    except BaseException as error:  # the outcome under test
        result = ("raised", type(error).__name__, str(error))
    # The loop is left as run_until_complete leaves it.
    state = {
        "running": loop.is_running(),
        "hooks restored": sys.get_asyncgen_hooks() == hooks,
        "stopping": loop._stopping,  # type: ignore[attr-defined]
        "origin tracking": sys.get_coroutine_origin_tracking_depth(),
        "a loop running": asyncio._get_running_loop() is not None,
    }
    for item in trace:
        if isinstance(item, tuple) and item[0] == "sockets":
            for sock in item[1:]:
                sock.close()
    loop.close()
    gc.collect()  # a task that logs as it is collected does it now
    asyncio_log.removeHandler(records)
    asyncio_log.propagate = True
    shown = [item for item in trace if not (isinstance(item, tuple) and item[0] == "sockets")]
    return {"trace": shown, "result": result, "log": records.lines, "state": state, "turns": turns}


def classic(loop: Loop, coroutine: Coroutine[Any, Any, object]) -> object:
    """The reference: ``loop.run_until_complete``."""
    return loop.run_until_complete(coroutine)


def mismatches(runner: Runner) -> dict[str, list[dict[str, object]]]:
    """Every scenario whose trace, result, log or loop state differs between ``runner`` and the reference.

    Also reported: a run of ``runner`` that took more turns of the loop than the reference.
    """
    found = {}
    for name, program, setup in SCENARIOS:
        ours, reference = outcome(runner, program, setup), outcome(classic, program, setup)
        turns_ours, turns_reference = ours.pop("turns"), reference.pop("turns")
        assert isinstance(turns_ours, int) and isinstance(turns_reference, int)
        if ours != reference or turns_ours > turns_reference:
            found[name] = [ours | {"turns": turns_ours}, reference | {"turns": turns_reference}]
    return found


if __name__ == "__main__":
    import importlib.util
    import json
    import os

    worker_dir = sys.argv[1]
    spec = importlib.util.spec_from_file_location(
        "_dsh_worker", os.path.join(worker_dir, "__init__.py"), submodule_search_locations=[worker_dir]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules["_dsh_worker"] = package
    spec.loader.exec_module(package)
    runner_module: Any = importlib.import_module("_dsh_worker.runner")
    print(
        json.dumps(
            {"python": sys.version.split()[0], "mismatches": mismatches(runner_module.run_to_completion)}, default=repr
        )
    )
