"""``kill_child``: SIGKILL a child of asyncio without reaping it behind the child watcher's back."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from dsh_core.processes import kill_child

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
