"""Nothing a run or a pre-spawned worker holds outlives the runtime, whatever ends it.

Below L3 each worker has a private directory on the host (``/tmp/dsh-run-*``),
so a leaked worker shows as a leftover directory as well as a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import select
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import pytest

from dsh_core.coderuntime import CodeRuntimeConfig, PythonCodeRuntime
from dsh_core.coderuntime import host as host_module
from dsh_core.coderuntime import isolation as iso
from dsh_core.coderuntime.isolation import CgroupPool

from .conftest import arun, children_of, run_dirs, tools, zygote_processes

HOT_LOOP = "while True:\n    pass"  # never reads its channel: only a kill ends it


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


async def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def _stop_unclosed(runtime: PythonCodeRuntime) -> None:
    """Stop the zygote of a runtime a test left unclosed on purpose (its loop is gone)."""
    zygote = runtime._zygote
    if zygote is not None and zygote.proc is not None:
        zygote.proc.kill()
        zygote.proc.wait()
    if zygote is not None and zygote.ctrl is not None:
        zygote.ctrl.close()
    # Now, not when the runtime is collected in some later test: what it still holds (its cgroups'
    # descriptors) would otherwise vanish in the middle of that test's accounting.
    runtime._abandoned.end()


def _assert_an_unclosed_runtime_left_nothing(runtime: PythonCodeRuntime, dirs: set[str]) -> None:
    """After its loop ended: no run directory, no run pending, no worker but the zygote's own spare; then stop it."""
    try:
        assert run_dirs() == dirs
        assert [run.finished.done() for run in runtime._runs] == []
        zygote = runtime._zygote
        assert zygote is not None and zygote.proc is not None
        time.sleep(0.2)  # let the killed workers be reaped
        assert len(children_of(zygote.proc.pid)) <= 1  # the zygote's own unassigned spare, if any
    finally:
        _stop_unclosed(runtime)


def test_a_runtime_never_closed_still_tears_down_its_prespawned_workers() -> None:
    seen: dict[str, Any] = {}

    async def go() -> None:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        seen["runtime"] = runtime
        await runtime.start()
        assert (await runtime.run("return 1", [])).value == 1
        await _until(lambda: len(runtime._warm) == 2 and all(run.ready for run in runtime._warm))
        seen["workers"] = [run.pid for run in runtime._warm]
        seen["dirs"] = [run.cwd for run in runtime._warm]
        # No aclose: asyncio.run ends by cancelling the pre-spawned workers' tasks.

    arun(go())
    try:
        assert all(pid > 0 for pid in seen["workers"])
        assert [os.path.exists(path) for path in seen["dirs"]] == [False, False]
        assert [_gone(pid) for pid in seen["workers"]] == [True, True]
    finally:
        _stop_unclosed(seen["runtime"])


def test_a_runtime_never_closed_with_a_run_in_flight_spawns_nothing_as_the_loop_ends() -> None:
    seen: dict[str, Any] = {}
    dirs = run_dirs()

    async def go() -> None:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        seen["runtime"] = runtime
        await runtime.start()
        seen["task"] = asyncio.ensure_future(runtime.run(HOT_LOOP, []))  # left running on purpose
        await _until(lambda: bool(runtime._live) and all(run.pid > 0 for run in runtime._live))
        seen["worker"] = next(iter(runtime._live)).pid
        # No aclose: asyncio.run cancels the run, which must not refill the pool as it ends.

    arun(go())
    _assert_an_unclosed_runtime_left_nothing(seen["runtime"], dirs)
    assert _gone(seen["worker"])


def test_a_worker_that_cannot_be_started_is_a_result_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    failing = False
    dup = os.dup

    def dup_or_fail(fd: int) -> int:
        # Fails the zygote's second dup of a spawn request: the first must be closed again.
        caller = sys._getframe(1)
        if failing and caller.f_code.co_name == "spawn" and "proto" in caller.f_locals:
            raise OSError(errno.EMFILE, "Too many open files")
        return dup(fd)

    monkeypatch.setattr(os, "dup", dup_or_fail)
    fds, dirs = _fds(), run_dirs()
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
            zygote = runtime._zygote
            assert zygote is not None
            known = {run.run_id for run in runtime._runs}
            assert set(zygote.exits) <= known and set(zygote.spawned) <= known  # no record of a failed spawn
            failing = False
            outcomes.append((await runtime.run("return 2", [])).value)
            return outcomes
        finally:
            await runtime.aclose()

    outcomes = arun(go())
    assert outcomes == [1, 1, ("worker-exit", "could not start a worker: [Errno 24] Too many open files"), 2]
    assert unhandled == []  # the refill's failures were not errors of the event loop
    assert _fds() == fds
    assert run_dirs() == dirs
    assert zygote_processes() == set()


def test_a_probe_that_cannot_be_started_does_not_lower_the_level(monkeypatch: pytest.MonkeyPatch) -> None:
    spawn = host_module._Run._spawn
    failures = [OSError(errno.EMFILE, "Too many open files")]

    def spawn_or_fail(self: Any, zygote: Any) -> None:
        if failures and self.owner._probe_only:
            raise failures.pop()
        spawn(self, zygote)

    monkeypatch.setattr(host_module._Run, "_spawn", spawn_or_fail)
    monkeypatch.setattr(host_module, "_DETECTED", {})
    dirs = run_dirs()

    async def go() -> tuple[str, bool, object, str]:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        try:
            first = await runtime.start()
            cached = bool(host_module._DETECTED)
            assert runtime.level == -1  # none in force, not the level that was being probed
            result = await runtime.run("return 1", [])  # tries again, at the configured level
            return first, cached, result.value, runtime.isolation
        finally:
            await runtime.aclose()

    first, cached, value, isolation = arun(go())
    assert first == "unavailable (could not start a probe worker: [Errno 24] Too many open files)"
    assert not cached
    assert value == 1 and isolation.startswith("L2 ")
    assert run_dirs() == dirs
    assert zygote_processes() == set()


def test_aclose_awaits_the_teardown_of_a_run_cancelled_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = False
    until = host_module._until

    async def slow_until(future: Any, timeout: float) -> None:
        if slow:
            await asyncio.sleep(0.5)  # a reap that takes a while
        await until(future, timeout)

    monkeypatch.setattr(host_module, "_until", slow_until)
    fds, dirs = _fds(), run_dirs()

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
            for warm in list(runtime._warm_tasks):  # and the pre-spawned workers' tasks, twice too
                warm.cancel()
            await asyncio.sleep(0)
            for warm in list(runtime._warm_tasks):
                warm.cancel()
            slow = False
        finally:
            await runtime.aclose()
        # Checked before the loop ends: asyncio.run's own shutdown would hide a teardown left running.
        assert zygote_processes() == set()
        loop: Any = asyncio.get_running_loop()
        own = {loop._selector.fileno(), loop._ssock.fileno(), loop._csock.fileno()}  # open until it closes
        assert _fds() - fds == {str(fd) for fd in own}
        assert run_dirs() == dirs

    arun(go())
    assert _fds() == fds


def test_a_teardown_cancelled_before_its_kill_still_kills_the_worker() -> None:
    async def go() -> bool:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2", timeout_s=60, cpu_s=60))
        try:
            await runtime.start()
            task = asyncio.ensure_future(runtime.run(HOT_LOOP, []))
            await _until(lambda: bool(runtime._live) and all(run.pid > 0 for run in runtime._live))
            run = next(iter(runtime._live))
            task.cancel()
            await asyncio.sleep(0)  # the run settles and schedules its teardown
            await asyncio.sleep(0)  # which starts, up to its first await
            assert run.teardown is not None and not run.teardown.done() and not run.killed
            run.teardown.cancel()  # as a loop shutting down cancels every task
            with pytest.raises(asyncio.CancelledError):
                await task
            await _until(lambda: _gone(run.pid), timeout=5.0)  # killed, not left spinning for a minute
            return True
        finally:
            await runtime.aclose()

    assert arun(go())


def test_a_zygote_that_cannot_be_started_for_want_of_processes_does_not_lower_the_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    popen = subprocess.Popen
    failures = [OSError(errno.EAGAIN, "Resource temporarily unavailable")]

    def popen_or_fail(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen_or_fail)
    monkeypatch.setattr(host_module, "_DETECTED", {})

    async def go() -> tuple[str, bool, object, str]:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        try:
            first = await runtime.start()
            cached = bool(host_module._DETECTED)
            result = await runtime.run("return 1", [])
            return first, cached, result.value, runtime.isolation
        finally:
            await runtime.aclose()

    first, cached, value, isolation = arun(go())
    assert first == "unavailable (cannot start the zygote: [Errno 11] Resource temporarily unavailable)"
    assert not cached
    assert value == 1 and isolation.startswith("L2 ")
    assert zygote_processes() == set()


def test_a_teardown_cancelled_before_its_first_step_still_ends_the_worker() -> None:
    from dsh_core.abort import AbortController

    dirs = run_dirs()

    async def go() -> tuple[bool, int]:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2", timeout_s=60, cpu_s=60))
        try:
            await runtime.start()
            controller = AbortController()
            task = asyncio.ensure_future(runtime.run(HOT_LOOP, [], controller.signal))
            await _until(lambda: bool(runtime._live) and all(run.pid > 0 for run in runtime._live))
            run = next(iter(runtime._live))
            controller.abort("stop")
            await asyncio.sleep(0)  # the run settles and schedules its teardown, not yet started
            assert run.teardown is not None and not run.teardown.done() and not run.killed
            run.teardown.cancel()  # as a loop shutting down cancels every task
            with pytest.raises(asyncio.CancelledError):  # cut short: no result before the reap
                await task
            await _until(lambda: _gone(run.pid), timeout=5.0)  # killed, not left spinning for a minute
            return run.finished.done(), run.pid
        finally:
            await runtime.aclose()  # and this does not raise

    finished, _ = arun(go())
    assert finished
    assert run_dirs() == dirs
    assert zygote_processes() == set()


def test_a_runtime_never_closed_right_after_a_run_leaves_no_prespawned_worker() -> None:
    seen: dict[str, Any] = {}
    dirs = run_dirs()

    async def go() -> None:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        seen["runtime"] = runtime
        await runtime.start()
        assert (await runtime.run("return 1", [])).value == 1
        # Returns at once: the refill after this run spawns as asyncio.run begins to end.

    arun(go())
    _assert_an_unclosed_runtime_left_nothing(seen["runtime"], dirs)


def test_the_pool_refills_after_timeouts_and_in_a_task_that_was_cancelled_before() -> None:
    async def go() -> list[int]:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        sizes = []
        try:
            await runtime.start()
            await _until(lambda: len(runtime._warm) == 2)
            for _ in range(2):  # runs cut short by a timeout cancel their task: no refill then
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.3):
                        await runtime.run(HOT_LOOP, [])
                await asyncio.sleep(0.05)
                sizes.append(len(runtime._warm))
            # A cancellation this task swallowed long ago does not stop later refills.
            current = asyncio.current_task()
            assert current is not None
            current.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(1)
            assert current.cancelling() == 1
            assert (await runtime.run("return 1", [])).value == 1
            await asyncio.sleep(0.05)
            sizes.append(len(runtime._warm))
            return sizes
        finally:
            await runtime.aclose()

    assert arun(go()) == [1, 0, 2]


def test_a_runtime_dropped_without_aclose_ends_its_zygote_and_directories_when_collected() -> None:
    seen: dict[str, Any] = {}
    dirs = run_dirs()

    async def go() -> None:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        await runtime.start()
        zygote = runtime._zygote
        assert zygote is not None
        seen["proc"] = zygote.proc

        async def background() -> None:
            try:
                await asyncio.sleep(3600)
            finally:  # a run in clean-up, as asyncio.run ends: it refills a pool nobody will end
                await runtime.run("return 1", [])

        seen["task"] = asyncio.ensure_future(background())
        await asyncio.sleep(0)
        seen["runtime"] = weakref.ref(runtime)

    arun(go())
    del seen["task"]
    gc.collect()  # the runtime (and the tasks destroyed with the loop) are garbage now
    assert seen["runtime"]() is None
    proc = seen["proc"]
    assert proc.returncode is not None  # the finalizer closed and reaped the zygote
    assert children_of(proc.pid) == set()
    assert run_dirs() == dirs
    assert proc.pid not in zygote_processes()
    # Its warm workers die with it (PDEATHSIG): signalled as the zygote exited, one may still be
    # tearing down a moment later on a loaded machine.
    deadline = time.monotonic() + 10.0
    while zygote_processes():
        assert time.monotonic() < deadline, zygote_processes()
        time.sleep(0.01)


def test_a_raising_abort_listener_does_not_cut_the_teardown_short() -> None:
    from dsh_core.coderuntime import current_run

    seen: dict[str, Any] = {}

    def listener(reason: object) -> None:
        raise ZeroDivisionError("a binding's listener")

    async def register(args: Any) -> Any:
        control = current_run()
        assert control is not None
        control.signal.add_listener(listener)
        seen["run"] = next(iter(seen["runtime"]._live))
        return "registered"

    reported: list[BaseException | None] = []

    async def go() -> tuple[object, bool, bool]:
        asyncio.get_running_loop().set_exception_handler(lambda _, context: reported.append(context.get("exception")))
        runtime = seen["runtime"] = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        try:
            result = await runtime.run("return await tools.register({})", tools(register=register))
            run = seen["run"]
            return result.value, run.finished.done(), _gone(run.pid)  # the worker reaped before the result
        finally:
            await runtime.aclose()

    assert arun(go()) == ("registered", True, True)
    assert [type(error).__name__ for error in reported] == ["ZeroDivisionError"]  # reported, not swallowed
    assert zygote_processes() == set()


def test_a_runtime_collected_while_its_loop_runs_on_leaves_that_loop_working() -> None:
    async def go() -> tuple[bool, bool, object]:
        loop: Any = asyncio.get_running_loop()
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        await runtime.start()
        zygote = runtime._zygote
        assert zygote is not None and zygote.ctrl is not None
        fd, proc = zygote.ctrl.fileno(), zygote.proc
        for _ in range(2):  # runs cut short by a timeout: the pool is left empty, nothing holds the runtime
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await runtime.run(HOT_LOOP, [])
        await asyncio.sleep(0.1)
        collected = weakref.ref(runtime)
        del runtime, zygote
        gc.collect()  # the finalizer runs inside the loop, which goes on
        assert collected() is None and proc is not None and proc.returncode is not None
        watched = fd in loop._selector.get_map()
        second = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        try:
            await asyncio.wait_for(second.start(), 10)  # its control socket may get the same number
            value = (await asyncio.wait_for(second.run("return 1", []), 10)).value
        finally:
            await second.aclose()
        return watched, True, value

    assert arun(go()) == (False, True, 1)
    assert zygote_processes() == set()


@pytest.mark.skipif(not CgroupPool.available(), reason="writable v1 memory and pids cgroups are needed")
def test_a_runtime_never_closed_removes_its_cgroups_when_it_is_collected() -> None:
    seen: dict[str, Any] = {}

    async def go() -> None:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        assert (await runtime.run("return 1", [])).value == 1
        assert runtime._cgroups is not None and runtime._cgroups.all
        seen["prefix"] = runtime._cgroups.prefix
        seen["ref"] = weakref.ref(runtime)
        # No aclose: the runtime is dropped with its pool of cgroups.

    arun(go())
    gc.collect()
    assert seen["ref"]() is None
    groups = CgroupPool.own_groups()  # where the pool made them: in dsh's own groups
    assert groups is not None
    left = [name for group in groups for name in os.listdir(group) if name.startswith(seen["prefix"] + "-")]
    assert left == []


@pytest.mark.skipif(not CgroupPool.available(), reason="needs a writable v1 pids hierarchy")
def test_a_zygote_that_cannot_fork_its_probe_worker_for_want_of_processes_does_not_lower_the_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # This process in a pids group with room for one more task: the zygote starts, its forks fail
    # (EAGAIN), until the first level's start has failed. The next level would then work: a
    # moment's process limit must not settle the level for the whole process.
    group = f"/sys/fs/cgroup/pids/dsh-test-probe-nofork-{os.getpid()}"
    os.mkdir(group)
    start_level = PythonCodeRuntime._start_level

    def write(name: str, text: str) -> None:
        with open(
            os.path.join(
                group if name != "root" else "/sys/fs/cgroup/pids",
                "cgroup.procs" if name in ("procs", "root") else name,
            ),
            "w",
        ) as handle:
            handle.write(text)

    async def start_level_then_lift(self: PythonCodeRuntime, level: int) -> Any:
        try:
            return await start_level(self, level)
        finally:
            write("pids.max", "max")

    monkeypatch.setattr(PythonCodeRuntime, "_start_level", start_level_then_lift)
    monkeypatch.setattr(host_module, "_DETECTED", {})

    async def go() -> tuple[str, bool, object, str]:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L2"))
        try:
            write("procs", str(os.getpid()))
            with open(os.path.join(group, "pids.current")) as handle:
                write("pids.max", str(int(handle.read()) + 1))
            first = await runtime.start()
            cached = bool(host_module._DETECTED)
            result = await runtime.run("return 1", [])
            return first, cached, result.value, runtime.isolation
        finally:
            write("root", str(os.getpid()))
            await runtime.aclose()

    try:
        first, cached, value, isolation = arun(go())
    finally:
        os.rmdir(group)
    assert first.startswith("unavailable (probe worker failed: the zygote could not fork a worker: [Errno 11]"), first
    assert not cached
    assert value == 1 and isolation.startswith("L2 ")
    assert zygote_processes() == set()


# A launcher that, like bubblewrap with --unshare-pid, runs the zygote under an init of its own
# and exits as soon as the zygote has: bubblewrap's init ends a moment later, reparented to the
# machine's init by then (killed by --die-with-parent). This one ends only when killed, so that
# moment cannot pass unnoticed.
_LINGERING_INIT_LAUNCHER = """\
import os, signal, sys
command = sys.argv[sys.argv.index("--") + 1:]
told, tell = os.pipe()
if os.fork() == 0:
    os.close(told)
    zygote = os.fork()
    if zygote == 0:
        os.close(tell)
        os.execv(command[0], command)
    os.waitpid(zygote, 0)
    os.write(tell, b"x")
    while True:
        signal.pause()
os.close(tell)
os.read(told, 1)
"""


def _launched_by(tmp_path: Any, script: str) -> iso.ZygotePlan:
    """An L0 plan whose zygote runs under ``script``, a launcher standing in for bubblewrap."""
    launcher = tmp_path / "launcher.py"
    launcher.write_text(script)
    return attrs.evolve(iso.plan_for(0, ()), argv_prefix=(sys.executable, "-I", "-S", str(launcher), "--"))


async def _started_with_its_init(plan: iso.ZygotePlan) -> tuple[Any, int]:
    """A started zygote of ``plan``, and the pid of the init its launcher left running."""
    zygote = host_module._Zygote(plan, asyncio.get_running_loop())
    await zygote.start(CodeRuntimeConfig(isolation="L0"))
    assert zygote.proc is not None
    (init,) = children_of(zygote.proc.pid)
    return zygote, init


def test_closing_a_zygote_ends_the_init_its_sandbox_launcher_left_behind(tmp_path: Any) -> None:
    plan = _launched_by(tmp_path, _LINGERING_INIT_LAUNCHER)

    async def go() -> bool:
        zygote, init = await _started_with_its_init(plan)
        handle = os.pidfd_open(init)
        try:
            await zygote.close()
            return bool(select.select([handle], [], [], 0)[0])  # readable: it has exited
        finally:
            host_module.descriptors.kill(handle)  # were it left running
            os.close(handle)

    assert arun(go()), "the sandbox's init outlived the zygote's close"


def test_a_sandbox_init_that_does_not_end_when_killed_is_left_named_not_waited_for(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A killed process ends at once unless one of its namespace's tasks sleeps uninterruptibly (a
    # hung mount); such an init stands in here as one whose kill does nothing.
    plan = _launched_by(tmp_path, _LINGERING_INIT_LAUNCHER)
    real_kill = host_module.descriptors.kill
    monkeypatch.setattr(host_module, "SANDBOX_END_S", 0.2)

    async def go() -> tuple[int, bool]:
        zygote, init = await _started_with_its_init(plan)
        handle = os.pidfd_open(init)
        try:
            with monkeypatch.context() as patch:
                patch.setattr(host_module.descriptors, "kill", lambda pidfd: None)
                await zygote.close()  # returns: the bound, not the init, ends the wait
            return init, bool(select.select([handle], [], [], 0)[0])
        finally:
            real_kill(handle)
            select.select([handle], [], [], 30)
            os.close(handle)

    with caplog.at_level(logging.WARNING, logger="dsh"):
        init, exited = arun(go())
    assert not exited
    assert f"sandbox init (pid {init}) was killed but did not exit within 0.2 s" in caplog.text


def test_a_zygote_that_fails_to_start_ends_the_init_its_sandbox_launcher_left_behind(tmp_path: Any) -> None:
    # The zygote waits for the test (a FIFO it opens before it is executed), so the start fails
    # while the sandbox's init is surely up and the zygote has surely not said hello.
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    held = _LINGERING_INIT_LAUNCHER.replace(
        "        os.close(tell)\n", f"        os.close(tell)\n        open({str(gate)!r}, 'rb').close()\n", 1
    )
    plan = _launched_by(tmp_path, held)

    async def go() -> bool:
        zygote = host_module._Zygote(plan, asyncio.get_running_loop())
        starting = asyncio.ensure_future(zygote.start(CodeRuntimeConfig(isolation="L0")))
        deadline = time.monotonic() + 30
        while zygote.proc is None or not children_of(zygote.proc.pid):
            assert time.monotonic() < deadline, "the launcher never started its init"
            await asyncio.sleep(0.01)
        (init,) = children_of(zygote.proc.pid)
        handle = os.pidfd_open(init)
        try:
            zygote.abort_start("the test gave up on it")
            await asyncio.sleep(0)  # the start takes its failure and closes the zygote's socket
            os.close(os.open(gate, os.O_WRONLY))  # the zygote may go on now: to its closed socket
            with pytest.raises(host_module.ZygoteError, match="the test gave up on it"):
                await starting
            return bool(select.select([handle], [], [], 0)[0])  # readable: it has exited
        finally:
            host_module.descriptors.kill(handle)  # were it left running
            os.close(handle)

    assert arun(go()), "the sandbox's init outlived a zygote that failed to start"
