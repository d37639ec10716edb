"""``kill_child``: SIGKILL a child of asyncio without reaping it behind the child watcher's back; the pidfd-checked
signal; the child subreaper flag."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys

import pytest

from dsh_core.processes import ProcStat, kill_child, proc_stat, signal_if

pytestmark = pytest.mark.anyio


async def test_a_running_child_is_killed_and_its_status_is_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(self: asyncio.subprocess.Process) -> None:
        raise AssertionError("Process.kill() polls waitpid first and may reap the child before the watcher")

    monkeypatch.setattr(asyncio.subprocess.Process, "kill", forbidden)
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
    kill_child(process)
    assert await asyncio.wait_for(process.wait(), 10) == -9


async def test_a_child_that_has_exited_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", "raise SystemExit(3)")
    assert await process.wait() == 3
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: signalled.append((pid, signum)))
    kill_child(process)
    assert signalled == []  # its pid may be another process's by now


@pytest.mark.parametrize("pidfds", ["usable", "ENOSYS", "EPERM"])
def test_signal_if_signals_only_what_is_still_ours_with_or_without_pidfds(
    monkeypatch: pytest.MonkeyPatch, pidfds: str
) -> None:
    """The check decides, through a pidfd or, where pidfds are refused (a kernel before 5.3, a seccomp
    profile), by number: a process not ours is never signalled, one that is is."""
    if pidfds != "usable":
        refused = getattr(errno, pidfds)

        def pidfd_open(pid: int, flags: int = 0) -> int:
            raise OSError(refused, os.strerror(refused))

        monkeypatch.setattr(os, "pidfd_open", pidfd_open, raising=False)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        asked: list[int] = []

        def not_ours(pid: int) -> bool:
            asked.append(pid)
            return False

        signal_if(child.pid, signal.SIGKILL, not_ours)
        assert asked == [child.pid] and child.poll() is None
        signal_if(child.pid, signal.SIGKILL, lambda pid: True)
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()


def test_signal_if_asks_nothing_of_a_process_that_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    def gone(pid: int, flags: int = 0) -> int:
        raise ProcessLookupError(errno.ESRCH, "No such process")

    monkeypatch.setattr(os, "pidfd_open", gone, raising=False)
    asked: list[int] = []

    def ours(pid: int) -> bool:
        asked.append(pid)
        return True

    signal_if(123456789, signal.SIGKILL, ours)
    assert asked == []  # never signalled by number: the number may be another process's by now


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")
def test_the_child_subreaper_flag_is_read_as_it_was_set() -> None:
    """In a process of its own: the flag set and cleared changes what is read back."""
    script = (
        "from dsh_core.processes import is_child_subreaper as get, set_child_subreaper as put; "
        "print([get(), put(True), get(), put(False), get()])"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert done.stdout.strip() == "[False, True, True, True, False]", done.stderr


def test_proc_stat_reads_a_process_whose_name_holds_parentheses_and_spaces(tmp_path) -> None:
    """The name in /proc/<pid>/stat is in parentheses and may hold anything, ") S 1 " included: the fields
    after it are read from the last parenthesis, for the bash tool's session scan and the kit alike."""
    tricky = tmp_path / "x) Z 1 2 3 (y"
    tricky.symlink_to("/bin/sleep")
    child = subprocess.Popen([str(tricky), "30"], start_new_session=True)
    try:
        stat = proc_stat(child.pid)
        assert stat is not None and stat.state in "RS", stat  # a naive split at the first ")" reads Z, 1, 3
        assert stat == ProcStat(stat.state, os.getpid(), child.pid)
        child.kill()
        child.wait()
        assert proc_stat(child.pid) is None
        assert proc_stat("not-a-pid") is None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
