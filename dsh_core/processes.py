"""Helpers for the child processes a tool body starts with :mod:`asyncio.subprocess`."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable
from typing import Final

import attrs

__all__ = [
    "child_pids",
    "kill_child",
    "signal_if",
    "ProcStat",
    "proc_stat",
    "is_child_subreaper",
    "set_child_subreaper",
]

#: prctl options (linux/prctl.h): a child subreaper adopts its descendants' orphans instead of init.
_PR_SET_CHILD_SUBREAPER: Final = 36
_PR_GET_CHILD_SUBREAPER: Final = 37


def kill_child(process: asyncio.subprocess.Process) -> None:
    """SIGKILL ``process`` unless asyncio has already seen it exit; never reap it here.

    Not ``process.kill()``: in Python 3.11 that polls (``waitpid``) first, so a child that
    had just exited is reaped there, before asyncio's child watcher, which then reports
    exit status 255 ("unknown child process") instead of the child's own, with a warning.
    Await ``process.wait()`` afterwards for the real status.
    """
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)


def child_pids(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` now, from ``/proc/<pid>/task/*/children`` (every thread's).

    Empty when ``pid`` has ended, or off Linux. A listed pid may end, and be reused, as soon as
    this returns: a caller that acts on one opens a pidfd and checks the parent again.
    """
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as listing:
                found.extend(int(child) for child in listing.read().split())
        except (OSError, ValueError):
            continue
    return found


@attrs.frozen
class ProcStat:
    """What dsh reads of a process in ``/proc/<pid>/stat``."""

    #: R, S, D..., Z (exited, awaiting its reaping), X (being reaped).
    state: str
    #: The parent's pid.
    parent: int
    #: The session id.
    session: int


def proc_stat(pid: int | str) -> ProcStat | None:
    """The state, parent pid and session id of ``pid`` from ``/proc/<pid>/stat`` (``None``: gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[-1].split()  # the name in parentheses may hold anything
        return ProcStat(fields[0].decode("ascii"), int(fields[1]), int(fields[3]))
    except (OSError, IndexError, ValueError):  # UnicodeDecodeError is a ValueError
        return None


def signal_if(pid: int, signum: int, still_ours: Callable[[int], bool]) -> None:
    """Send ``signum`` to ``pid`` if ``still_ours(pid)`` holds (it is still the process the caller found).

    Through a pidfd opened before ``still_ours`` is asked: the pidfd names that very process, so one that
    ended and whose pid was reused in between is never signalled. Where pidfds are refused (ENOSYS: a
    kernel before 5.3; EPERM: an older container seccomp profile; a Python built without them), asked and
    then signalled by number: a pid reused between the two could be signalled, the race every kill had
    before pidfds. A process that is gone, or that this one may not signal, is left alone.
    """
    pidfd_open = getattr(os, "pidfd_open", None)
    send = getattr(signal, "pidfd_send_signal", None)
    if pidfd_open is not None and send is not None:
        try:
            fd = pidfd_open(pid)
        except ProcessLookupError:  # gone already
            return
        except OSError:
            pass  # no pidfd to be had: by number, below
        else:
            try:
                if still_ours(pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        send(fd, signum)
            finally:
                os.close(fd)
            return
    if still_ours(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def _prctl(option: int, argument: int | ctypes.c_int) -> bool:
    """``prctl(option, argument)`` (an int, or a ``c_int`` passed by reference); whether it succeeded."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        value = ctypes.byref(argument) if isinstance(argument, ctypes.c_int) else ctypes.c_ulong(argument)
        return bool(libc.prctl(option, value, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) == 0)
    except (OSError, AttributeError):  # no libc prctl to call
        return False


def is_child_subreaper() -> bool:
    """Whether this process is a child subreaper: the orphans of its descendants are reparented to it.

    False off Linux and where prctl cannot be asked (the safe side for a caller that would wait for them).
    """
    flag = ctypes.c_int(0)
    return _prctl(_PR_GET_CHILD_SUBREAPER, flag) and flag.value != 0


def set_child_subreaper(enabled: bool) -> bool:
    """Make this process a child subreaper, or no longer one (Linux); whether prctl did it."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, int(enabled))
