"""Who reaps a worker, and how the host learns how it ended.

At L2 and above the kernel reaps workers (the zygote ignores SIGCHLD) where it
reports their status through a pidfd; below L2, or where it does not, the
zygote reaps and reports. Both paths are pinned here, at the levels that use
them and, with kernel reaping turned off, at the levels that would not.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from dsh_core.coderuntime import CodeRuntimeConfig, PythonCodeRuntime
from dsh_core.coderuntime.host import _Run
from dsh_core.coderuntime.worker import pidfd as pidfds

from .conftest import arun, tools


def _kernel_reports_exit_status() -> bool:
    child = subprocess.Popen([sys.executable, "-I", "-S", "-c", "raise SystemExit(5)"])
    handle = os.pidfd_open(child.pid)
    try:
        child.wait()
        return pidfds.exit_status(handle) == 5 << 8
    finally:
        os.close(handle)


KERNEL_REPORTS = _kernel_reports_exit_status()


def _descendants(root: int) -> dict[int, str]:
    """pid -> state letter of every live or zombie descendant of ``root``."""
    found: dict[int, str] = {}
    pending = [root]
    while pending:
        pid = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as handle:
                    children = [int(c) for c in handle.read().split()]
            except OSError:
                continue
            for child in children:
                try:
                    with open(f"/proc/{child}/stat") as handle:
                        found[child] = handle.read().rsplit(")", 1)[1].split()[0]
                except OSError:
                    continue
                pending.append(child)
    return found


def _runtime(level: str, kernel_reap: bool, **config: Any) -> PythonCodeRuntime:
    runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation=level, **config))
    runtime._let_kernel_reap = kernel_reap
    return runtime


MODES = [
    pytest.param("L1", True, False, id="L1-zygote-reaps"),
    pytest.param("L2", True, KERNEL_REPORTS, id="L2-kernel-reaps"),
    pytest.param("L2", False, False, id="L2-zygote-reaps"),
    pytest.param("auto", True, KERNEL_REPORTS, id="strongest-kernel-reaps"),
    pytest.param("auto", False, False, id="strongest-zygote-reaps"),
]


@pytest.mark.parametrize(("level", "allow", "kernel_reaps"), MODES)
def test_every_ending_is_reported_and_no_zombie_outlives_its_run(level: str, allow: bool, kernel_reaps: bool) -> None:
    async def echo(args: Any) -> Any:
        return args

    endings = [
        ("return 1", None),
        ("import os\nos._exit(3)", ("worker-exit", "worker exited with code 3 before completing")),
        ("import os\nos.kill(os.getpid(), 15)", ("worker-exit", "worker killed by signal SIGTERM")),
        ("1/0", ("exception", "Traceback")),
        ("while True: pass", ("timeout", "CPU budget exhausted")),
    ]

    async def go() -> None:
        runtime = _runtime(level, allow, cpu_s=0.5)
        try:
            for program, expected in endings:
                result = await runtime.run(program, tools(echo=echo))
                assert runtime._zygote is not None and runtime._zygote.kernel_reaps is kernel_reaps
                if expected is None:
                    assert result.error is None and result.value == 1
                else:
                    assert result.error is not None, program
                    assert (result.error.kind, result.error.message[: len(expected[1])]) == expected, program
                # Resolved means reaped: nothing under this process is a zombie now.
                zombies = [pid for pid, state in _descendants(os.getpid()).items() if state == "Z"]
                assert zombies == [], program
        finally:
            await runtime.aclose()
        assert _descendants(os.getpid()) == {}

    arun(go())


@pytest.mark.parametrize(("level", "allow", "kernel_reaps"), [m for m in MODES if m.id != "L1-zygote-reaps"])
def test_a_zygote_that_dies_ends_its_live_runs(level: str, allow: bool, kernel_reaps: bool) -> None:
    # Its workers die with it (PDEATHSIG); each live run settles as worker-exit,
    # and the next run starts a new zygote.
    async def go() -> None:
        runtime = _runtime(level, allow)
        try:
            assert (await runtime.run("return 1", [])).value == 1
            zygote = runtime._zygote
            assert zygote is not None and zygote.kernel_reaps is kernel_reaps
            live = asyncio.ensure_future(runtime.run("import time\ntime.sleep(30)", []))
            await asyncio.sleep(0.3)
            assert not live.done()
            inner = [pid for pid in _descendants(os.getpid()) if _is_zygote(pid)]
            assert len(inner) == 1
            os.kill(inner[0], signal.SIGKILL)
            result = await asyncio.wait_for(live, 10)
            assert result.error is not None and result.error.kind == "worker-exit", result
            assert (await runtime.run("return 2", [])).value == 2
        finally:
            await runtime.aclose()
        assert _descendants(os.getpid()) == {}

    arun(go())


def _is_zygote(pid: int) -> bool:
    # The zygote runs zygote.py under python; so do its forked workers, whose parent
    # is the zygote (at L3 the zygote's parent is bubblewrap, whose arguments name it too).
    def runs_zygote(p: int) -> bool:
        try:
            with open(f"/proc/{p}/comm") as handle:
                comm = handle.read().strip()
            with open(f"/proc/{p}/cmdline", "rb") as handle:
                return comm.startswith("python") and b"zygote.py" in handle.read()
        except OSError:
            return False

    try:
        with open(f"/proc/{pid}/stat") as handle:
            parent = int(handle.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return False
    return runs_zygote(pid) and not runs_zygote(parent)


def test_a_worker_whose_pid_differs_from_its_pidfd_is_refused() -> None:
    # The pid the kernel attests on the worker's first message must be the one
    # behind the zygote's pidfd; anything else is refused before the program is sent.
    async def go() -> Any:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L0"))
        run = _Run(runtime)
        run.pid, run.cred_pid = os.getpid(), os.getpid() + 1
        run._verify("L0")
        return run.outcome

    assert arun(go()) == ("error", ("worker-exit", "the worker's pid could not be verified"))


def test_the_exit_status_is_read_again_until_the_kernel_has_recorded_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # A pidfd polls readable as its process exits; the status is recorded as the
    # kernel reaps it, a moment later. The host looks again instead of giving up.
    answers = [None, None, 3 << 8]
    monkeypatch.setattr(pidfds, "exit_status", lambda fd: answers.pop(0))

    async def go() -> Any:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L0"))
        run = _Run(runtime)
        run.kernel_reaps = True
        run.pidfd = os.pidfd_open(os.getpid())
        try:
            run.exit_future = asyncio.get_running_loop().create_future()
            run._on_pidfd()
            return await asyncio.wait_for(run.exit_future, 5), answers
        finally:
            os.close(run.pidfd)

    assert arun(go()) == (3 << 8, [])


def test_exit_status_of_a_live_process_is_none() -> None:
    handle = os.pidfd_open(os.getpid())
    try:
        assert pidfds.exit_status(handle) is None
        assert pidfds.pid_of(handle) == os.getpid()
    finally:
        os.close(handle)
