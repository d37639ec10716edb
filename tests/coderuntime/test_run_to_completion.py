"""The worker's ``run_to_completion``: ``loop.run_until_complete`` minus the loop's cold start.

Each scenario (``run_to_completion_scenarios.py``) runs under both on fresh
loops and must leave the same trace, outcome, asyncio log and loop state. A
program that finishes in its first step must not start the loop at all.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from dsh_core.coderuntime import isolation as iso
from dsh_core.coderuntime.worker.runner import run_to_completion

from . import run_to_completion_scenarios as scenarios
from .conftest import echo, run_one, tools

SCENARIOS = {name: (program, setup) for name, program, setup in scenarios.SCENARIOS}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_same_trace_outcome_log_and_loop_state_as_run_until_complete(name: str) -> None:
    program, setup = SCENARIOS[name]
    ours = scenarios.outcome(run_to_completion, program, setup)
    reference = scenarios.outcome(scenarios.classic, program, setup)
    assert ours.pop("turns") <= reference.pop("turns")  # type: ignore[operator]
    assert ours == reference


def test_a_program_done_in_its_first_step_never_starts_the_loop() -> None:
    ran = scenarios.outcome(run_to_completion, scenarios.returns_at_once, None)
    assert ran["result"] == ("value", [1])
    assert ran["trace"] == [("running", True, True), ("task", "Task")]
    assert ran["turns"] == 0
    assert scenarios.outcome(run_to_completion, scenarios.raises, None)["turns"] == 0


def test_what_the_first_step_leaves_runs_as_before() -> None:
    left = scenarios.outcome(run_to_completion, scenarios.leaves_a_task_and_callbacks, None)
    assert left["result"] == ("value", "left")
    assert left["trace"] == [("left pending", True), "background step 1", "soon", "later"]
    closed = scenarios.outcome(run_to_completion, scenarios.closes_an_async_generator, None)
    assert closed["trace"] == [1, ("tracked", True), "generator closed"]
    assert closed["log"] == []


def test_exits_are_not_logged_as_never_retrieved() -> None:
    for program, code in ((scenarios.exits, "3"), (scenarios.exits_after_an_await, "4")):
        ran = scenarios.outcome(run_to_completion, program, None)
        assert ran["result"] == ("raised", "SystemExit", code)
        assert ran["log"] == []


def test_a_stopped_loop_ends_the_run_as_run_until_complete_does() -> None:
    waited = scenarios.outcome(run_to_completion, scenarios.stops_the_loop_and_waits, None)
    assert waited["result"] == ("raised", "RuntimeError", "Event loop stopped before Future completed.")
    assert waited["trace"] == []
    returned = scenarios.outcome(run_to_completion, scenarios.stops_the_loop_and_returns, None)
    assert returned["result"] == ("value", 2)
    assert returned["state"]["stopping"] is False  # type: ignore[index]


def test_inside_another_running_loop_it_refuses_and_leaves_that_loop_running() -> None:
    inner = asyncio.new_event_loop()

    async def outer() -> tuple[str, bool]:
        ran = []

        async def program() -> None:
            ran.append("ran")

        coroutine = program()
        try:
            with pytest.raises(RuntimeError, match="another loop is running"):
                run_to_completion(inner, coroutine)
        finally:
            coroutine.close()
        return "".join(ran), asyncio.get_running_loop() is not inner

    try:
        assert asyncio.run(outer()) == ("", True)
    finally:
        inner.close()


def _other_interpreters() -> list[str]:
    """Every other CPython 3.11+ found on this machine (the function relies on asyncio's internals).

    Looked for on PATH (not through version-manager shims, which may not
    resolve) and beside this interpreter's own installation (pyenv's layout).
    """
    ours = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    found: dict[str, str] = {}
    for minor in range(11, 20):
        name = f"python3.{minor}"
        if name == ours:
            continue
        candidates = glob.glob(os.path.join(os.path.dirname(sys.base_prefix), "*", "bin", name))
        on_path = shutil.which(name)
        if on_path is not None and f"{os.sep}shims{os.sep}" not in on_path:
            candidates.append(on_path)
        for candidate in sorted(candidates):
            if os.access(candidate, os.X_OK):
                found.setdefault(name, candidate)
                break
    return sorted(found.values())


@pytest.mark.parametrize("python", _other_interpreters())
def test_the_scenarios_hold_on_other_pythons(python: str) -> None:
    script = os.path.join(os.path.dirname(__file__), "run_to_completion_scenarios.py")
    done = subprocess.run(
        [python, "-I", script, iso.WORKER_DIR], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["mismatches"] == {}, report


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
    result = run_one(program, tools(echo=echo), isolation="L2")
    assert result.error is None, result.error
    assert result.value == [True, True, {"n": 1}, {"n": 2}, True]
