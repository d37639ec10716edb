"""Shared fixtures: the anyio backend for async tests, and ``dsh`` run on a terminal."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def anyio_backend() -> str:
    """Run ``@pytest.mark.anyio`` tests on asyncio (dsh is asyncio-based)."""
    return "asyncio"


def _dsh_on_terminal(*args: str, cwd: Path, stderr: bool = True) -> tuple[int, bytes]:
    """Run ``python -m dsh_core ARGS`` with stdout on a fresh pty (and stderr too, unless ``stderr`` is
    false: then it is discarded), with no ``DSH_`` variables; return its exit code and what the pty showed."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSH_")}
    leader, follower = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "dsh_core", *args],
            cwd=cwd,
            env=environ,
            stdout=follower,
            stderr=follower if stderr else subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
    finally:
        os.close(follower)
    shown = bytearray()
    try:
        while chunk := _read_until_closed(leader):
            shown += chunk
    finally:
        os.close(leader)
    return process.wait(timeout=60), bytes(shown)


def _read_until_closed(leader: int) -> bytes:
    try:
        return os.read(leader, 4096)
    except OSError:  # EIO: every holder of the follower end has closed it
        return b""


@pytest.fixture
def dsh_on_terminal() -> Callable[..., tuple[int, bytes]]:
    """``python -m dsh_core`` on a terminal, for tests of what a user's terminal is shown (and not made to do)."""
    return _dsh_on_terminal
