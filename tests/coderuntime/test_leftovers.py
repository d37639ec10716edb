"""Nothing a run or a pre-spawned worker holds outlives the runtime, whatever ends it.

Below L3 each worker has a private directory on the host (``/tmp/dsh-run-*``),
so a leaked worker shows as a leftover directory as well as a process.
"""

from __future__ import annotations

import asyncio
import errno
import os
from typing import Any

import pytest

from dsh_core.coderuntime import CodeRuntimeConfig, PythonCodeRuntime
from dsh_core.coderuntime import host as host_module

from .conftest import arun, zygote_processes


def _run_dirs() -> set[str]:
    return {name for name in os.listdir("/tmp") if name.startswith("dsh-run-")}


def _fds() -> set[str]:
    """This process's open descriptors (not the one the listing itself used)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
        except OSError:
            continue
        found.add(name)
    return found


def test_a_runtime_never_closed_still_tears_down_its_prespawned_workers() -> None:
    seen: dict[str, Any] = {}

    async def go() -> None:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        seen["runtime"] = runtime
        await runtime.start()
        assert (await runtime.run("return 1", [])).value == 1
        await asyncio.sleep(0.3)  # the refill's worker is up too
        seen["workers"] = [run.pid for run in runtime._warm]
        seen["dirs"] = [run.cwd for run in runtime._warm]
        # No aclose: asyncio.run ends by cancelling the pre-spawned workers' tasks.

    arun(go())
    runtime = seen["runtime"]
    try:
        assert len(seen["workers"]) == 2 and all(pid > 0 for pid in seen["workers"])
        assert [os.path.exists(path) for path in seen["dirs"]] == [False, False]
        assert [os.path.exists(f"/proc/{pid}") for pid in seen["workers"]] == [False, False]
    finally:
        zygote = runtime._zygote  # never closed: the test stops it
        if zygote is not None and zygote.proc is not None:
            zygote.proc.kill()
            zygote.proc.wait()
        if zygote is not None and zygote.ctrl is not None:
            zygote.ctrl.close()


def test_a_worker_that_cannot_be_started_is_a_result_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    failing = False
    spawn = host_module._Zygote.spawn

    def spawn_or_fail(self: Any, *args: Any, **kwargs: Any) -> Any:
        if failing:
            raise OSError(errno.EMFILE, "Too many open files")
        return spawn(self, *args, **kwargs)

    monkeypatch.setattr(host_module._Zygote, "spawn", spawn_or_fail)
    fds, dirs = _fds(), _run_dirs()
    unhandled: list[dict[str, Any]] = []

    async def go() -> list[object]:
        nonlocal failing
        asyncio.get_running_loop().set_exception_handler(lambda _, context: unhandled.append(context))
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        try:
            await runtime.start()
            failing = True
            outcomes: list[object] = []
            for _ in range(3):  # two pre-spawned workers, then one the run must spawn itself
                result = await runtime.run("return 1", [])
                outcomes.append(result.value if result.error is None else (result.error.kind, result.error.message))
            failing = False
            outcomes.append((await runtime.run("return 2", [])).value)
            return outcomes
        finally:
            await runtime.aclose()

    outcomes = arun(go())
    assert outcomes == [1, 1, ("worker-exit", "could not start a worker: [Errno 24] Too many open files"), 2]
    assert unhandled == []  # the refill's failures were not errors of the event loop
    assert _fds() == fds
    assert _run_dirs() == dirs
    assert zygote_processes() == set()


def test_aclose_awaits_the_teardown_of_a_run_cancelled_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = False
    until = host_module._until

    async def slow_until(future: Any, timeout: float) -> None:
        if slow:
            await asyncio.sleep(0.5)  # a reap that takes a while
        await until(future, timeout)

    monkeypatch.setattr(host_module, "_until", slow_until)
    fds, dirs = _fds(), _run_dirs()

    async def go() -> None:
        nonlocal slow
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        try:
            await runtime.start()
            task = asyncio.ensure_future(runtime.run("import time\ntime.sleep(30)\nreturn 1", []))
            await asyncio.sleep(0.3)
            slow = True
            task.cancel()
            await asyncio.sleep(0)  # its teardown has started
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            slow = False
        finally:
            await runtime.aclose()
        # Checked before the loop ends: asyncio.run's own shutdown would hide a teardown left running.
        assert zygote_processes() == set()
        loop: Any = asyncio.get_running_loop()
        own = {loop._selector.fileno(), loop._ssock.fileno(), loop._csock.fileno()}  # open until it closes
        assert _fds() - fds == {str(fd) for fd in own}
        assert _run_dirs() == dirs

    arun(go())
    assert _fds() == fds

