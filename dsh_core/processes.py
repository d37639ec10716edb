"""Helpers for the child processes a tool body starts with :mod:`asyncio.subprocess`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

__all__ = ["child_pids", "kill_child"]


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
