"""Shared helpers for the code runtime tests."""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import tempfile
import warnings
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

from dsh_core.coderuntime import BindingNamespace, CodeRunResult, CodeRuntimeConfig, PythonCodeRuntime
from dsh_core.coderuntime import isolation as iso

T = TypeVar("T")

HAS_BWRAP = shutil.which("bwrap") is not None and os.geteuid() == 0


@pytest.fixture(autouse=True, scope="package")
def _private_run_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Workers' run directories go to a directory of this test run's own.

    The leftover checks list what is there after a test: a dsh runtime used beside the
    suite (``dsh demo``, another test run) must not make them fail.
    """
    previous = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("run-dirs"))
    try:
        yield
    finally:
        tempfile.tempdir = previous


def run_dirs() -> set[str]:
    """The workers' run directories that exist now."""
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("dsh-run-")}


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


def collect_leftovers() -> None:
    """Collect now what earlier tests dropped, before a test takes a whole-process snapshot.

    A dropped transport, socket or subprocess is finalized whenever the collector next runs: in
    the middle of a test, that closes a descriptor or reaps a child the test counted as its own
    "before", and a before/after comparison fails for what another test left. Collected here,
    it is gone from the snapshot instead. (Not after the test: that would hide its own leaks.)
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def children_of(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (zombies included)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    if int(handle.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.add(int(entry))
            except (OSError, ValueError):
                continue
    return found


def zygote_processes() -> set[int]:
    """Every process on the machine running a zygote of this test process (zygotes and workers).

    Found by command line (the zygote script, and this process's pid in its
    configuration), so an orphaned worker counts too, and zygotes of another
    process using the same checkout (a benchmark, a second test run) do not.
    """
    script = os.path.join(iso.WORKER_DIR, "zygote.py").encode()
    host = f'"host": {os.getpid()},'.encode()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    command = handle.read()
            except OSError:
                continue
            if script in command and host in command:
                found.add(int(entry))
    return found


@pytest.fixture(autouse=True, scope="session")
def _shared_wire_markers_stay_intact() -> Iterator[None]:
    """Token lists share their short array markers: no consumer may ever change one."""
    from dsh_core.coderuntime.worker import wire

    yield
    assert tuple({"a": n} for n in range(64)) == wire._ARRAY_MARKERS
