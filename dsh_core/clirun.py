"""Running CLI commands: errors on stderr with an exit status, and signal-aware event loops.

Shared by every ``dsh`` command (the core ones, Code Mode's, agent runs and sessions)
so that all of them fail and shut down the same way.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar

import click

__all__ = ["DRAIN_SECONDS", "fail", "run_async"]

T = TypeVar("T")

#: Seconds the root scope gets to drain after SIGINT/SIGTERM before a forced exit.
DRAIN_SECONDS = 5.0


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``dsh: error: message`` to stderr and exit."""
    click.echo(f"dsh: error: {message}", err=True)
    sys.exit(code)


def run_async(main: Callable[[], Awaitable[T]], *,
              on_signal: Callable[[], Awaitable[None] | None] | None = None) -> T:
    """Run ``main`` with SIGINT/SIGTERM wired to a bounded, graceful shutdown.

    The first signal calls ``on_signal`` (abort the run, dispose the root
    scope; sync or async) and gives ``main`` :data:`DRAIN_SECONDS` in all to
    finish on its own before it is cancelled (without ``on_signal`` it is
    cancelled at once, and its ``finally`` blocks dispose what it started). A
    second signal exits at once. A cancelled ``main`` exits with status 130.
    """

    async def runner() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(main())
        state = {"signals": 0}
        shutdowns: set[asyncio.Task[None]] = set()

        def handle(signum: int) -> None:
            state["signals"] += 1
            if state["signals"] > 1:
                os._exit(128 + signum)
            click.echo(f"dsh: {signal.Signals(signum).name} received, shutting down "
                       "(again to exit at once)", err=True)

            async def shutdown() -> None:
                deadline = loop.time() + DRAIN_SECONDS
                try:
                    if on_signal is not None:
                        outcome = on_signal()
                        if outcome is not None:
                            await asyncio.wait_for(outcome, DRAIN_SECONDS)
                        await asyncio.wait({task}, timeout=max(0.0, deadline - loop.time()))
                except Exception:
                    pass
                task.cancel()

            shutdowns.add(loop.create_task(shutdown()))

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, handle, signum)
        try:
            return await task
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)

    try:
        return asyncio.run(runner())
    except asyncio.CancelledError:
        fail("interrupted", 130)
