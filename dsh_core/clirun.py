"""Running CLI commands: errors on stderr with an exit status, and signal-aware event loops.

Shared by every ``dsh`` command (the core ones, Code Mode's, agent runs and sessions)
so that all of them fail and shut down the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import IO, Final, NoReturn, TypeVar

import click

from dsh_core.terminal import visible

__all__ = ["DRAIN_SECONDS", "USAGE_ERROR_CODES", "echo_json", "fail", "run_async"]

T = TypeVar("T")

#: Seconds the root scope gets to drain after SIGINT/SIGTERM before a forced exit.
DRAIN_SECONDS = 5.0

#: Error codes that mean "fix your command or config" (exit 2) rather than "the run failed" (exit 1),
#: the same for every command that boots a deployment.
USAGE_ERROR_CODES: Final = frozenset({"INVALID_CONFIG", "PLUGIN_LOAD_FAILED", "SESSION_NOT_FOUND"})


_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def echo_json(text: str, *, nl: bool = True, file: IO[str] | None = None) -> None:
    """Write JSON text to stdout (or ``file``), still valid JSON whatever its encoding.

    The CLI writes what stdout cannot encode as a backslash escape, but ``\\xe9`` and
    ``\\U0001f600`` are not JSON: such characters (they only occur inside strings) are
    written as their JSON ``\\uXXXX`` escapes instead, which read back as the same string.
    """
    encoding = getattr(sys.stdout if file is None else file, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        text = _NON_ASCII.sub(lambda match: _json_char(match.group(), encoding), text)
    click.echo(text, nl=nl, file=file)


def _json_char(char: str, encoding: str) -> str:
    try:
        char.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return json.dumps(char)[1:-1]
    return char


def echo_outside_text(text: str, *, err: bool = False) -> None:
    """Print text a model or a tool wrote (an answer, a command's output, a fetched page).

    On a terminal, what would drive it (a carriage return, a title or clipboard sequence)
    is shown escaped; into a pipe the text is data, written exactly as is (``color=True``:
    click would otherwise strip only some of the sequences, which is neither safe nor faithful).
    """
    if (sys.stderr if err else sys.stdout).isatty():
        click.echo(visible(text, lines=True), err=err)
    else:
        click.echo(text, err=err, color=True)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``dsh: error: message`` to stderr and exit.

    The message may quote what a model, a server or a file wrote, so what would drive
    the terminal is shown escaped (newlines and tabs are kept).
    """
    click.echo(f"dsh: error: {visible(message, lines=True)}", err=True)
    sys.exit(code)


def run_async(
    main: Callable[[], Awaitable[T]],
    *,
    on_signal: Callable[[], Awaitable[None] | None] | None = None,
    stdout_to_stderr: bool = False,
) -> T:
    """Run ``main`` with SIGINT/SIGTERM wired to a bounded, graceful shutdown.

    The first signal calls ``on_signal`` (abort the run, dispose the root
    scope; sync or async) and gives ``main`` :data:`DRAIN_SECONDS` in all to
    finish on its own before it is cancelled. The next signal cancels
    ``main`` at once (its ``finally`` blocks still run: an agent run records
    why it ended), and one more exits the process at once. Without
    ``on_signal`` the first signal already cancels. A cancelled ``main``
    exits with status 130, as does a SIGINT that comes while the process
    waits for worker threads after ``main`` ended (at once, without them; a
    SIGTERM then ends it by its default action).

    With ``stdout_to_stderr``, what anything prints to stdout while ``main``
    runs (a plugin's factory, a tool body, a disposer, a task it spawned) goes
    to stderr: for commands whose stdout is their own output alone, printed
    after ``main`` returns (``--json``, a piped answer).
    """
    import asyncio  # here, not at the top: `dsh --help` imports this module

    async def runner() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(main())
        # Escalation: abort (only with on_signal), then cancel, then exit.
        stages = (["abort"] if on_signal is not None else []) + ["cancel", "exit"]
        state = {"signals": 0, "cancelled": False}
        shutdowns: set[asyncio.Task[None]] = set()

        def cancel() -> None:
            # Once only: a second cancel would interrupt main's finally blocks (the run/end record).
            if not state["cancelled"]:
                state["cancelled"] = True
                task.cancel()

        async def drain() -> None:
            assert on_signal is not None
            deadline = loop.time() + DRAIN_SECONDS
            try:
                outcome = on_signal()
                if outcome is not None:
                    await asyncio.wait_for(outcome, DRAIN_SECONDS)
                await asyncio.wait({task}, timeout=max(0.0, deadline - loop.time()))
            except Exception:
                pass
            cancel()

        def handle(signum: int) -> None:
            stage = stages[min(state["signals"], len(stages) - 1)]
            state["signals"] += 1
            name = signal.Signals(signum).name
            if stage == "exit":
                os._exit(128 + signum)
            if stage == "abort":
                click.echo(
                    f"dsh: {name} received, shutting down (again to cancel, a third time to exit at once)", err=True
                )
                shutdowns.add(loop.create_task(drain()))
                return
            if task.done():  # main ended; what is left is the drain's bounded wait
                click.echo(
                    f"dsh: {name} received, waiting for the shutdown to finish (again to exit at once)", err=True
                )
                return
            click.echo(f"dsh: {name} received, cancelling (again to exit at once)", err=True)
            # The drain is left running: cancelling it could stop on_signal before it even
            # started (two signals in one loop turn) or halfway through disposing the root.
            cancel()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, handle, signum)
        try:
            return await task
        finally:
            # A drain still disposing gets the rest of its bound (a further signal still exits at once);
            # asyncio.run would otherwise cancel it halfway.
            if shutdowns:
                await asyncio.wait(shutdowns, timeout=DRAIN_SECONDS)
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)

    try:
        with contextlib.redirect_stdout(sys.stderr) if stdout_to_stderr else contextlib.nullcontext():
            return asyncio.run(runner())
    except asyncio.CancelledError:
        fail("interrupted", 130)
    except KeyboardInterrupt:
        # A signal after main ended, while asyncio.run waits for worker threads (a tool's blocking
        # call): exit now, as sys.exit would join those same threads first.
        click.echo("dsh: error: interrupted", err=True)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(130)
