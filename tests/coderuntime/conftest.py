"""Shared helpers for the code runtime tests."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from dsh_core.coderuntime import BindingNamespace, CodeRunResult, CodeRuntimeConfig, PythonCodeRuntime
from dsh_core.coderuntime import isolation as iso

T = TypeVar("T")

HAS_BWRAP = shutil.which("bwrap") is not None and os.geteuid() == 0


def arun(coro: Awaitable[T]) -> T:
    """Run one coroutine in a fresh event loop."""
    return asyncio.run(coro)  # type: ignore[arg-type]


async def with_runtime(fn: Callable[[PythonCodeRuntime], Awaitable[T]], **config: Any) -> T:
    """Create a runtime, call ``fn`` with it, always dispose it."""
    runtime = PythonCodeRuntime(CodeRuntimeConfig(**config))
    try:
        return await fn(runtime)
    finally:
        await runtime.aclose()


def run_one(program: str, bindings: list[BindingNamespace] | None = None, **config: Any) -> CodeRunResult:
    """Run one program on a fresh runtime (``config`` for :class:`CodeRuntimeConfig`) and dispose it."""

    async def go(runtime: PythonCodeRuntime) -> CodeRunResult:
        return await runtime.run(program, bindings or [])

    return arun(with_runtime(go, **config))


def tools(**functions: Any) -> list[BindingNamespace]:
    """A ``tools`` namespace of the given async functions."""
    return [BindingNamespace("tools", functions)]


async def echo(args: Any) -> Any:
    """A trivial binding that returns its arguments."""
    return args


#: Program prelude that writes raw protocol frames to descriptor 3 (a forger).
FORGE = (
    "import os, json, struct\n"
    "def send(m):\n"
    "    b = json.dumps(m).encode()\n"
    "    os.write(3, struct.pack('>I', len(b)) + b)\n"
)

LEVELS = ["L0", "L1", "L2"] + (["L3"] if HAS_BWRAP else [])


@pytest.fixture(params=LEVELS)
def level(request: pytest.FixtureRequest) -> str:
    """Every isolation level that this host can run."""
    return str(request.param)


def zygote_processes() -> set[int]:
    """Every process on the machine running this checkout's zygote script (zygotes and workers)."""
    script = os.path.join(iso.WORKER_DIR, "zygote.py").encode()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if script in handle.read():
                        found.add(int(entry))
            except OSError:
                continue
    return found
