"""The ``approval`` plugin: approval presets (the votes) and a terminal approval channel.

Presets decide, from each tool's ``annotations``:

* ``read-only``: tools annotated ``read_only`` run; every other tool is denied.
* ``workspace-write``: tools annotated ``read_only`` or ``workspace_confined``
  run; every other tool (``bash``, a network tool...) asks a person.
* ``full``: everything runs.

``allow`` and ``deny`` list tool names (``fnmatch`` globs) that are always
allowed or always denied, whatever the preset. ``run_code`` itself is never
voted on: every call its program makes passes this policy on its own.

An ask is answered on the controlling terminal (``/dev/tty``, or ``terminal``
in the config): a prompt names the tool and its arguments and reads ``y``/``n``
without blocking the event loop. Without a terminal the channel does not
answer, the outcome is ``unavailable`` and the call is denied with a message
saying how to allow the tool in the config.

Config::

    [[plugins]]
    id = "approval"
    use = "approval"
    config = { preset = "workspace-write", allow = ["bash"] }
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import os
import termios
from collections.abc import Awaitable
from typing import Any

from dsh_core import ApprovalOutcome, ApprovalRequest, PreDecision, Scope, ToolExecution, hookimpl, plugin

__all__ = ["plugin", "ApprovalPolicy", "PRESETS"]

PRESETS = ("read-only", "workspace-write", "full")

#: The Code Mode transport: its nested calls are voted on one by one, so the transport itself is not.
TRANSPORT = "run_code"

CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "preset": {"enum": list(PRESETS), "default": "workspace-write"},
        "allow": {"type": "array", "items": {"type": "string", "minLength": 1},
                  "description": "tool names (globs) always allowed"},
        "deny": {"type": "array", "items": {"type": "string", "minLength": 1},
                 "description": "tool names (globs) always denied"},
        "interactive": {"type": "boolean", "default": True,
                        "description": "ask on the terminal (false: asks are unavailable, i.e. denied)"},
        "terminal": {"type": "string", "minLength": 1, "default": "/dev/tty",
                     "description": "the terminal device asks are answered on"},
        "root": {"type": "string", "description": "the workspace root, named in prompts"},
    },
}

MAX_ARGUMENT_CHARS = 2000


def _matches(name: str, patterns: list[str]) -> str | None:
    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def open_terminal(path: str) -> int | None:
    """A non-blocking read/write descriptor on the terminal at ``path``, or ``None`` when there is none."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:
        return None
    if not os.isatty(fd):
        os.close(fd)
        return None
    return fd


class ApprovalPolicy:
    """The plugin instance: the preset's votes and the terminal channel."""

    def __init__(self, scope: Scope, config: dict[str, Any]) -> None:
        self.scope = scope
        # The scope of a plugin row is named "plugin:<row id>"; the id goes into the config hints.
        self.row = scope.name.partition(":")[2] or "approval"
        self.preset: str = config.get("preset", "workspace-write")
        self.allow: list[str] = list(config.get("allow", []))
        self.deny: list[str] = list(config.get("deny", []))
        self.interactive: bool = config.get("interactive", True)
        self.terminal: str = config.get("terminal", "/dev/tty")
        self.root: str | None = config.get("root")
        self._lock: asyncio.Lock | None = None

    def _annotations(self, execution: ToolExecution) -> dict[str, Any] | None:
        registry = self.scope.lookup("tools")
        if registry is None:
            return None
        definition = registry.get(execution.name, execution.agent)
        return None if definition is None else dict(definition.annotations)

    def _hint(self, name: str) -> str:
        return (f'to allow it, add "{name}" to allow in the config of plugin row "{self.row}" '
                f'([[plugins]] id = "{self.row}", config.allow = ["{name}"]) or set its preset to "full"')

    @hookimpl
    def dsh_pre_execute(self, execution: ToolExecution) -> PreDecision | None:
        """Vote by the preset and the allow/deny lists; abstain for ``run_code`` and unknown tools."""
        name = execution.name
        if name == TRANSPORT:
            return None
        denied_by = _matches(name, self.deny)
        if denied_by is not None:
            return PreDecision.deny(f'tool "{name}" is denied by the approval config '
                                    f'(deny pattern "{denied_by}" in plugin row "{self.row}")')
        if _matches(name, self.allow) is not None or self.preset == "full":
            return PreDecision.allow()
        annotations = self._annotations(execution)
        if annotations is None:
            return None  # an unknown tool fails at dispatch with UNKNOWN_TOOL
        read_only = annotations.get("read_only") is True
        if self.preset == "read-only":
            if read_only:
                return PreDecision.allow()
            return PreDecision.deny(f'tool "{name}" may change things and the approval preset is "read-only"; '
                                    + self._hint(name).replace(' or set its preset to "full"',
                                                               ' or set its preset to "workspace-write" or "full"'))
        if read_only or annotations.get("workspace_confined") is True:
            return PreDecision.allow()
        return PreDecision.ask(f'tool "{name}" is neither read-only nor confined to the workspace; '
                               + self._hint(name))

    @hookimpl
    def dsh_approve(self, request: ApprovalRequest) -> Awaitable[ApprovalOutcome] | None:
        """Ask on the terminal; ``None`` (no answer from this channel) when there is no terminal.

        A plain function returning a coroutine: the hook is firstresult, and under
        pluggy's own first-result call an ``async def`` would answer (with a
        coroutine) even when it has nothing to say.
        """
        if not self.interactive:
            return None
        fd = open_terminal(self.terminal)
        if fd is None:
            return None
        # Closed now and opened again by _ask: a coroutine cancelled before its first step never
        # runs its ``finally``, and a descriptor opened here would then leak.
        os.close(fd)
        return self._ask(request)

    async def _ask(self, request: ApprovalRequest) -> ApprovalOutcome:
        fd = open_terminal(self.terminal)
        if fd is None:  # gone since dsh_approve looked: nobody can answer
            return ApprovalOutcome.CANCELLED
        try:
            if self._lock is None:
                self._lock = asyncio.Lock()
            # One question at a time on one terminal, even when parallel sub-calls ask together.
            async with self._lock:
                if request.signal.aborted:
                    return ApprovalOutcome.CANCELLED
                # Keys typed before the question (a "y" meant for an earlier prompt, or typed
                # while the agent worked) must not answer it: only what is typed after counts.
                if not _background_job_of(fd):  # there tcflush would stop dsh (SIGTTOU) before it asks
                    with contextlib.suppress(termios.error):
                        termios.tcflush(fd, termios.TCIFLUSH)
                if not await _write_all(fd, self._prompt(request), request):
                    return ApprovalOutcome.CANCELLED
                answer = await _read_line(fd, request)
                if answer is None:
                    with contextlib.suppress(OSError):
                        os.write(fd, b"\n(cancelled)\n")  # a courtesy: not waited for
                    return ApprovalOutcome.CANCELLED
                allowed = answer.strip().lower() in ("y", "yes")
                return ApprovalOutcome.ALLOWED if allowed else ApprovalOutcome.REJECTED
        finally:
            os.close(fd)

    def _prompt(self, request: ApprovalRequest) -> bytes:
        execution = request.execution
        # ensure_ascii escapes control characters: arguments cannot drive the terminal.
        arguments = json.dumps(execution.arguments, ensure_ascii=True, sort_keys=True)
        if len(arguments) > MAX_ARGUMENT_CHARS:
            arguments = arguments[:MAX_ARGUMENT_CHARS] + f"... ({len(arguments)} characters)"
        where = f" in {self.root}" if self.root else ""
        lines = [f"\ndsh: the agent wants to run tool \"{execution.name}\"{where} with arguments:",
                 f"  {arguments}"]
        if execution.nested:
            lines.append("  (called from inside a run_code program)")
        lines.append(f'Allow "{execution.name}"? [y/N] ')
        return "\n".join(lines).encode("ascii", errors="replace")


def _background_job_of(fd: int) -> bool:
    """True when ``fd`` is our controlling terminal and another process group holds its foreground."""
    try:
        return os.tcgetpgrp(fd) != os.getpgrp()
    except OSError:  # not our controlling terminal: job control does not apply
        return False


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _write_all(fd: int, data: bytes, request: ApprovalRequest) -> bool:
    """Write ``data`` to the non-blocking ``fd``; False if the request is aborted first.

    A terminal whose output is stopped (Ctrl-S) takes nothing until it is resumed:
    the loop waits for it to become writable (or for the abort) instead of spinning.
    """
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
            continue
        except BlockingIOError:
            pass
        writable: asyncio.Future[None] = loop.create_future()
        loop.add_writer(fd, _settle, writable)
        try:
            if not await request.signal.until(writable):
                return False
        finally:
            loop.remove_writer(fd)
    return True


async def _read_line(fd: int, request: ApprovalRequest) -> str | None:
    """One line from the non-blocking ``fd`` (``None`` if the request is aborted first)."""
    loop = asyncio.get_running_loop()
    line: asyncio.Future[str] = loop.create_future()
    buffer = bytearray()

    def readable() -> None:
        try:
            chunk = os.read(fd, 1024)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:  # the terminal hung up: no answer means no
            if not line.done():
                line.set_result("")
            return
        buffer.extend(chunk)
        if b"\n" in buffer and not line.done():
            line.set_result(buffer.split(b"\n", 1)[0].decode("utf-8", errors="replace"))

    loop.add_reader(fd, readable)
    try:
        return line.result() if await request.signal.until(line) else None
    finally:
        loop.remove_reader(fd)


@plugin(config_schema=CONFIG_SCHEMA)
def approval_plugin(scope: Scope, config: Any) -> ApprovalPolicy:
    """Entry point ``approval``: presets ``read-only``, ``workspace-write`` (default) and ``full``."""
    return ApprovalPolicy(scope, dict(config))


plugin = approval_plugin  # the entry point names ``dsh_plugins.approval:plugin``
