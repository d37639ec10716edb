"""The ``approval`` plugin: approval presets (the votes) and a terminal approval channel.

Presets decide, from each tool's ``annotations``:

* ``read-only``: tools annotated ``read_only`` run; every other tool is denied.
* ``workspace-write``: tools annotated ``read_only`` or ``workspace_confined``
  run; every other tool (``bash``, a network tool...) asks a person.
* ``full``: everything runs.

Annotations are the tool author's word, and the presets take it: nothing checks
that a tool annotated ``read_only`` changes nothing, or that a ``workspace_confined``
one stays in its root. A plugin runs inside dsh with its user's rights, so
installing one is already the decision to trust it; ``deny`` a tool whose
annotations you doubt (a glob over its name, whatever it claims).

``allow`` and ``deny`` list tool names (``fnmatch`` globs) that are always
allowed or always denied, whatever the preset; they apply to ``run_code`` too.
They are read as the ``guards`` plugin reads its tool lists: brace groups
expand (``{bash,write}`` is ``bash`` and ``write``), and a glob no tool name
can match (``mcp.exec``, ``bash ``: names use A-Z, a-z, 0-9, ``_`` and ``-``)
is a config error rather than a deny that silently denies nothing.
Where the code runtime's isolation in force is L2 or above, the presets do not
vote on ``run_code`` itself: its program can reach nothing but through tool
calls, and every call it makes passes this policy on its own. Below L2 (or when
the level cannot be known) a program can touch files, the network and processes
directly, so ``run_code`` is voted on as an unconfined tool: denied under
``read-only``, asked under ``workspace-write``, run under ``full``. The level is
read only when ``run_code`` is called (a cap of ``L0``/``L1`` in the config
answers at once; otherwise the level is detected once, off the event loop).

An ask is answered on the controlling terminal (``/dev/tty``, or ``terminal``
in the config): a prompt names the tool and its arguments and reads ``y``/``n``
without blocking the event loop, one question at a time on each terminal,
whichever approval row asks (rows started in two agents' scopes too). Only keys typed once the terminal has sent the
whole question count: what was typed before (type-ahead, or while output was
stopped with Ctrl-S) is discarded. Nothing of the arguments is dropped unsaid:
short scalar arguments come first, in full, in the order the tool declares them;
a long value shows its head and tail around the count of characters not shown;
a run of 16 or more whitespace characters shows as its count (``[2,100 spaces]``),
so padding cannot push what follows it away; control characters, escape
sequences and bidi overrides show as ``\\u`` escapes. When something is not
shown the prompt says so, and the answer ``s`` shows every argument in full
before the question is asked again. Without a terminal the channel does not
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
import fcntl
import fnmatch
import json
import os
import re
import struct
import termios
import weakref
from collections import Counter
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, NamedTuple, cast

from dsh_core import (
    ApprovalOutcome,
    ApprovalRequest,
    PreDecision,
    Scope,
    ToolExecution,
    hookimpl,
    plugin,
)
from dsh_core.registry import judged_definition
from dsh_plugins.guards import tool_globs

__all__ = ["plugin", "ApprovalPolicy", "PRESETS", "describe_arguments"]

PRESETS = ("read-only", "workspace-write", "full")

#: The Code Mode transport: at isolation L2+ its nested calls are voted on one by one, and it is not.
TRANSPORT = "run_code"

#: The isolation level from which a program can only act through its (voted) tool calls.
CONFINED_LEVEL = 2

CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "preset": {"enum": list(PRESETS), "default": "workspace-write"},
        "allow": {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "description": "tool names (globs) always allowed",
        },
        "deny": {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "description": "tool names (globs) always denied",
        },
        "interactive": {
            "type": "boolean",
            "default": True,
            "description": "ask on the terminal (false: asks are unavailable, i.e. denied)",
        },
        "terminal": {
            "type": "string",
            "minLength": 1,
            "default": "/dev/tty",
            "description": "the terminal device asks are answered on",
        },
        "root": {"type": "string", "description": "the workspace root, named in prompts"},
    },
}

# How the prompt shows arguments, in characters of the display. A scalar argument of at most
# SHORT_CHARS is listed first (in the tool's declared order) and always in full; a longer value
# shows its first VALUE_HEAD and last VALUE_TAIL characters and counts what is cut between them;
# past PROMPT_CHARS the remaining arguments are counted, not listed. Whatever is cut is said, and
# the answer "s" shows every argument in full. Whitespace runs of WHITESPACE_RUN or more
# characters are shown as their count ("[2,100 spaces]"), so padding cannot push anything away.
SHORT_CHARS = 200
VALUE_CHARS, VALUE_HEAD, VALUE_TAIL = 1000, 500, 400
KEY_CHARS, KEY_HEAD, KEY_TAIL = 120, 60, 40
PROMPT_CHARS = 6000
WHITESPACE_RUN = 16


def _matches(name: str, globs: list[tuple[str, list[str]]]) -> str | None:
    """The first glob (as written) one of whose brace alternatives matches ``name``, or ``None``."""
    return next(
        (written for written, alternatives in globs if any(fnmatch.fnmatchcase(name, g) for g in alternatives)), None
    )


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
        # Read as the guards plugin reads its tool lists, configured beside these: brace groups expand, and a
        # glob no tool name can match ("{bash,write}" to fnmatch, "bash ") is refused, since in deny it would
        # silently deny nothing and let the tool run unasked under the preset "full".
        self._allow_globs = tool_globs(self.allow, "allow", self.row, "approval")
        self._deny_globs = tool_globs(self.deny, "deny", self.row, "approval")
        self.interactive: bool = config.get("interactive", True)
        self.terminal: str = config.get("terminal", "/dev/tty")
        self.root: str | None = config.get("root")
        # The code runtime whose isolation is being (or was) read, and the reading.
        self._isolation: tuple[object, asyncio.Future[str]] | None = None

    def _annotations(self, execution: ToolExecution) -> dict[str, Any] | None:
        definition = judged_definition(execution, self.scope.lookup("tools"))
        return None if definition is None else dict(definition.annotations)

    def _hint(self, name: str) -> str:
        return (
            f'to allow it, add "{name}" to allow in the config of plugin row "{self.row}" '
            f'([[plugins]] id = "{self.row}", config.allow = ["{name}"]) or set its preset to "full"'
        )

    @hookimpl
    def dsh_pre_execute(self, execution: ToolExecution) -> PreDecision | Awaitable[PreDecision | None] | None:
        """Vote by the preset and the allow/deny lists; abstain for unknown tools.

        ``run_code`` gets a coroutine: its vote depends on the code runtime's isolation.
        """
        name = execution.name
        denied_by = _matches(name, self._deny_globs)
        if denied_by is not None:
            return PreDecision.deny(
                f'tool "{name}" is denied by the approval config '
                f'(deny pattern "{denied_by}" in plugin row "{self.row}")'
            )
        if _matches(name, self._allow_globs) is not None or self.preset == "full":
            return PreDecision.allow()
        annotations = self._annotations(execution)
        if annotations is None:
            return None  # an unknown tool (run_code in native mode too) fails at dispatch with UNKNOWN_TOOL
        if name == TRANSPORT:
            return self._vote_on_transport(execution)
        read_only = annotations.get("read_only") is True
        if self.preset == "read-only":
            if read_only:
                return PreDecision.allow()
            return PreDecision.deny(
                f'tool "{name}" may change things and the approval preset is "read-only"; '
                + self._hint(name).replace(
                    ' or set its preset to "full"', ' or set its preset to "workspace-write" or "full"'
                )
            )
        if read_only or annotations.get("workspace_confined") is True:
            return PreDecision.allow()
        return PreDecision.ask(f'tool "{name}" is neither read-only nor confined to the workspace; ' + self._hint(name))

    async def _vote_on_transport(self, execution: ToolExecution) -> PreDecision | None:
        """Abstain where programs are confined (L2+); else vote on run_code as an unconfined tool."""
        level, described = await self._isolation_level(execution)
        if execution.signal.aborted:
            return None  # aborted while the level was read: the core settles it before dispatch, unrun
        if level is not None and level >= CONFINED_LEVEL:
            return None  # the program acts only through its calls, and each is voted on
        name = execution.name
        why = (
            f'tool "{name}" runs programs that can touch files, the network and processes directly: '
            f"the code runtime's isolation {described}, below L{CONFINED_LEVEL}"
        )
        if self.preset == "read-only":
            return PreDecision.deny(
                f'{why}, and the approval preset is "read-only"; '
                + self._hint(name).replace(
                    ' or set its preset to "full"', ' or set its preset to "workspace-write" or "full"'
                )
            )
        return PreDecision.ask(f"{why}; " + self._hint(name))

    async def _isolation_level(self, execution: ToolExecution) -> tuple[int | None, str]:
        """The code runtime's isolation level in force (``None``: not known) and how to name it.

        A configured cap below L2 answers without starting anything. Otherwise the
        runtime is started (its ``start()``, which detects the level with the worker its
        first run then uses) or, without one, its ``isolation`` descriptor is read in a
        thread; once per runtime and shared by concurrent calls; an abort stops the wait,
        not the reading.
        """
        runtime = self.scope.lookup("code_runtime")
        if runtime is None:
            return None, 'is not known (no "code_runtime" service)'
        cap = getattr(getattr(runtime, "config", None), "isolation", None)
        if isinstance(cap, str) and re.fullmatch(r"L[0-9]", cap) and int(cap[1]) < CONFINED_LEVEL:
            return int(cap[1]), f'is capped at {cap} (code_runtime.isolation = "{cap}")'
        known = self._isolation
        if known is None or known[0] is not runtime or _failed(known[1]):  # a failed reading is tried again
            start = getattr(runtime, "start", None)
            # A runtime that can start itself on the loop starts the worker its first run uses;
            # otherwise the (blocking) descriptor is read in a thread.
            started = asyncio.ensure_future(
                start() if callable(start) else asyncio.to_thread(lambda: str(runtime.isolation))
            )
            started.add_done_callback(_failed)  # its exception counts as retrieved
            known = self._isolation = (runtime, started)
        reading = known[1]
        if not await execution.signal.until(reading):
            return None, "is not known yet"
        if _failed(reading):
            return None, f"could not be read ({reading.exception() if not reading.cancelled() else 'cancelled'})"
        descriptor = reading.result()
        found = re.match(r"L([0-9])\b", descriptor)
        if found is None:
            return None, f"is {descriptor.partition(' (')[0] or 'not known'}"
        return int(found.group(1)), f"is L{found.group(1)}"

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
            # One question at a time on one terminal, even when parallel sub-calls ask together, or rows
            # started in two agents' scopes do: two questions on screen at once, read by two readers of one
            # terminal, and the answer typed under one could be read as the other's.
            async with _terminal_lock(self.terminal):
                if request.signal.aborted:
                    return ApprovalOutcome.CANCELLED
                full = False
                while True:
                    if not await _write_all(fd, self._prompt(request, full=full), request):
                        return ApprovalOutcome.CANCELLED
                    if not await _drain(fd, request):
                        return ApprovalOutcome.CANCELLED
                    # Keys typed before the question was on screen (a "y" meant for an earlier prompt,
                    # typed while the agent worked, or while output was stopped with Ctrl-S) must not
                    # answer it: only what is typed once it has been shown counts.
                    if not _background_job_of(fd):  # there tcflush would stop dsh (SIGTTOU) before it asks
                        with contextlib.suppress(termios.error):
                            termios.tcflush(fd, termios.TCIFLUSH)
                    answer = await _read_line(fd, request)
                    if answer is None:
                        with contextlib.suppress(OSError):
                            os.write(fd, b"\n(cancelled)\n")  # a courtesy: not waited for
                        return ApprovalOutcome.CANCELLED
                    answer = answer.strip().lower()
                    if answer not in ("s", "show"):
                        break
                    full = True  # every argument in full, then the same question again
                allowed = answer in ("y", "yes")
                return ApprovalOutcome.ALLOWED if allowed else ApprovalOutcome.REJECTED
        finally:
            os.close(fd)

    def _prompt(self, request: ApprovalRequest, *, full: bool = False) -> bytes:
        execution = request.execution
        lines, complete = describe_arguments(execution.arguments, self._declared_order(execution), full=full)
        where = f" in {self.root}" if self.root else ""
        # The name is the model's too: any plugin may ask about a call to a tool that does not exist.
        name = _escape(execution.name)
        if full:
            head = f'\ndsh: every argument of tool "{name}", in full:'
        else:
            head = f'\ndsh: the agent wants to run tool "{name}"{where} with arguments:'
        lines.insert(0, head)
        if execution.nested:
            lines.append("  (called from inside a run_code program)")
        if not complete:
            lines.append("  Not everything is shown: answer s to see every argument in full.")
        lines.append(f'Allow "{name}"? [y/N] ')
        return "\n".join(lines).encode("ascii", errors="replace")

    def _declared_order(self, execution: ToolExecution) -> list[str]:
        """The tool's parameters in the order its schema declares them (empty when unknown)."""
        definition = judged_definition(execution, self.scope.lookup("tools"))
        parameters = None if definition is None else definition.parameters
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        return [str(name) for name in properties] if isinstance(properties, Mapping) else []


#: Per event loop, the lock of each terminal (by its real path) that approval rows ask on: shared by every row.
_TERMINAL_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


def _terminal_lock(terminal: str) -> asyncio.Lock:
    """The lock of the terminal at ``terminal`` on the running loop, whichever approval row asks on it."""
    locks = _TERMINAL_LOCKS.setdefault(asyncio.get_running_loop(), {})
    return locks.setdefault(os.path.realpath(terminal), asyncio.Lock())


def _failed(future: asyncio.Future[Any]) -> bool:
    """True if ``future`` is done without a result (its exception, if any, is retrieved)."""
    return future.done() and (future.cancelled() or future.exception() is not None)


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
            view = view[os.write(fd, view) :]
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


def _queued_output(fd: int) -> int:
    """Bytes written to the terminal ``fd`` that it has not sent yet (0 when it cannot say)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    except OSError:
        return 0


async def _drain(fd: int, request: ApprovalRequest) -> bool:
    """Wait until the terminal has sent all that was written to it; False if the request is aborted first.

    What ``tcdrain`` waits for, polled instead: ``tcdrain`` blocks (on a stopped terminal, for
    ever) and no abort could end it; it would also stop a background dsh with SIGTTOU.
    """
    loop = asyncio.get_running_loop()
    pause = 0.005
    while _queued_output(fd) > 0:
        slept: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(pause, _settle, slept)
        try:
            if not await request.signal.until(slept):
                return False
        finally:
            timer.cancel()
        pause = min(pause * 2, 0.05)
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


# --------------------------------------------------------------------------- how arguments are shown
#
# A value becomes a list of chunks: LIT is text of a string argument (shown JSON-escaped, so
# control characters, escape sequences and bidi overrides show as \u escapes, and inside quotes),
# MARK a note outside the quotes (a whitespace run's count, or what a cut left out), SYN the
# JSON around them (brackets, separators, numbers). Every chunk knows how many characters of the
# value it stands for, so a cut can say exactly how many it hides.

LIT, MARK, SYN = "lit", "mark", "syn"

_WHITESPACE = re.compile(rf"\s{{{WHITESPACE_RUN},}}")
_BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_NAMES = {
    " ": ("space", "spaces"),
    "\n": ("newline", "newlines"),
    "\t": ("tab", "tabs"),
    "\r": ("carriage return", "carriage returns"),
}


class _Chunk(NamedTuple):
    kind: str
    shown: str  # what the terminal displays
    size: int  # characters of the value it stands for
    raw: str = ""  # LIT and SYN: the text itself (a cut may take part of it)


def _escape(text: str) -> str:
    return json.dumps(text, ensure_ascii=True)[1:-1]


def _lit(text: str) -> _Chunk:
    return _Chunk(LIT, _escape(text), len(text), text)


def _syn(text: str) -> _Chunk:
    return _Chunk(SYN, text, len(text), text)


def _run_marker(run: str) -> _Chunk:
    """``[2,100 spaces]``; a mixed run counts each kind: ``[12 whitespace characters: 10 spaces, 2 newlines]``."""
    parts = []
    for char, count in Counter(run).items():
        if char in _NAMES:
            parts.append(f"{count:,} {_NAMES[char][count != 1]}")
        else:
            parts.append(f"{count:,} x U+{ord(char):04X}")
    text = parts[0] if len(parts) == 1 else f"{len(run):,} whitespace characters: {', '.join(parts)}"
    return _Chunk(MARK, f"[{text}]", len(run))


def _string_chunks(text: str) -> list[_Chunk]:
    if not text:
        return [_Chunk(SYN, '""', 0)]
    chunks: list[_Chunk] = []
    start = 0
    for run in _WHITESPACE.finditer(text):
        if run.start() > start:
            chunks.append(_lit(text[start : run.start()]))
        chunks.append(_run_marker(run.group()))
        start = run.end()
    if start < len(text):
        chunks.append(_lit(text[start:]))
    return chunks


def _value_chunks(value: object) -> list[_Chunk]:
    """The chunks of a JSON value, walked without recursion (a deeply nested value is fine)."""
    chunks: list[_Chunk] = []
    stack: list[tuple[bool, object]] = [(False, value)]  # (is syntax, item)
    while stack:
        syntax, item = stack.pop()
        if syntax:
            chunks.append(_syn(cast(str, item)))
        elif isinstance(item, str):
            chunks.extend(_string_chunks(item))
        elif isinstance(item, Mapping):
            todo: list[tuple[bool, object]] = [(True, "{")]
            for index, (key, member) in enumerate(item.items()):
                if index:
                    todo.append((True, ", "))
                todo += [(False, str(key)), (True, ": "), (False, member)]
            todo.append((True, "}"))
            stack.extend(reversed(todo))
        elif isinstance(item, (list, tuple)):
            todo = [(True, "[")]
            for index, member in enumerate(item):
                if index:
                    todo.append((True, ", "))
                todo.append((False, member))
            todo.append((True, "]"))
            stack.extend(reversed(todo))
        else:  # a number, true, false, null: plain ASCII
            chunks.append(_syn(json.dumps(item, ensure_ascii=True, default=repr)))
    return chunks


def _width(chunks: list[_Chunk]) -> int:
    return sum(len(chunk.shown) for chunk in chunks)


def _part(chunk: _Chunk, room: int, from_end: bool) -> _Chunk | None:
    """As much of a LIT or SYN chunk as ``room`` display characters hold, from its start or end."""
    if chunk.kind == MARK or room <= 0:
        return None
    raw = chunk.raw[-room:] if from_end else chunk.raw[:room]  # each character shows as one or more
    if chunk.kind == SYN:
        return _syn(raw)
    used = taken = 0
    for char in reversed(raw) if from_end else raw:  # an escape (\u202e) is never split
        width = len(_escape(char))
        if used + width > room:
            break
        used += width
        taken += 1
    if not taken:
        return None
    return _lit(raw[len(raw) - taken :] if from_end else raw[:taken])


def _cut(chunks: list[_Chunk], limit: int, head: int, tail: int) -> tuple[list[_Chunk], int]:
    """``chunks`` if they show in ``limit`` characters; else their head and tail around a count of the rest."""
    if _width(chunks) <= limit:
        return chunks, 0
    ends: list[list[_Chunk]] = []
    for budget, from_end in ((head, False), (tail, True)):
        kept: list[_Chunk] = []
        room = budget
        for chunk in reversed(chunks) if from_end else chunks:
            if len(chunk.shown) > room:
                piece = _part(chunk, room, from_end)
                if piece is not None:
                    kept.append(piece)
                break
            kept.append(chunk)
            room -= len(chunk.shown)
        ends.append(kept)
    front, back = ends[0], ends[1][::-1]
    hidden = sum(c.size for c in chunks) - sum(c.size for c in front) - sum(c.size for c in back)
    return [*front, _Chunk(MARK, f"... [{hidden:,} characters not shown] ...", hidden), *back], hidden


def _join(chunks: list[_Chunk]) -> str:
    """The display: LIT text in quotes, MARK notes outside them (``"a" [2,100 spaces] "b"``)."""
    out: list[str] = []
    previous = ""
    for chunk in chunks:
        if chunk.kind == LIT and previous != LIT:
            out.append(' "' if previous == MARK else '"')
        elif chunk.kind != LIT and previous == LIT:
            out.append('"')
        if chunk.kind == MARK and previous in (LIT, MARK):
            out.append(" ")
        out.append(chunk.shown)
        previous = chunk.kind
    if previous == LIT:
        out.append('"')
    return "".join(out)


def describe_arguments(arguments: object, order: Sequence[str] = (), *, full: bool = False) -> tuple[list[str], bool]:
    """The prompt's lines for ``arguments``, and whether they show everything.

    Short scalar arguments come first, in ``order`` (the tool's declared
    properties; others after, as given), then the rest. Unless ``full``, a
    long key or value shows its head and tail and counts what is cut, and
    arguments past :data:`PROMPT_CHARS` are counted, not listed.
    """
    if not isinstance(arguments, Mapping):
        chunks, hidden = _value_chunks(arguments), 0
        if not full:
            chunks, hidden = _cut(chunks, VALUE_CHARS, VALUE_HEAD, VALUE_TAIL)
        return [f"  {_join(chunks)}"], not hidden
    if not arguments:
        return ["  (none)"], True
    rank = {name: index for index, name in enumerate(order)}
    entries = []
    for index, (key, value) in enumerate(arguments.items()):
        chunks = _value_chunks(value)
        short = not isinstance(value, (Mapping, list, tuple)) and _width(chunks) <= SHORT_CHARS
        entries.append(((not short, rank.get(key, len(rank)), index), str(key), chunks))
    entries.sort(key=lambda entry: entry[0])
    lines: list[str] = []
    complete = True
    used = 0
    for count, (_, key, value_chunks) in enumerate(entries):
        key_chunks, shown = [_syn(key)] if _BARE_KEY.fullmatch(key) else _string_chunks(key), value_chunks
        if not full:
            key_chunks, hidden_key = _cut(key_chunks, KEY_CHARS, KEY_HEAD, KEY_TAIL)
            shown, hidden_value = _cut(value_chunks, VALUE_CHARS, VALUE_HEAD, VALUE_TAIL)
            complete = complete and not hidden_key and not hidden_value
        line = f"  {_join(key_chunks)}: {_join(shown)}"
        if not full and lines and used + len(line) > PROMPT_CHARS:
            left = len(entries) - count
            lines.append(f"  ... [{left:,} more argument{'s' if left != 1 else ''} not shown]")
            return lines, False
        lines.append(line)
        used += len(line)
    return lines, complete


@plugin(config_schema=CONFIG_SCHEMA)
def approval_plugin(scope: Scope, config: Any) -> ApprovalPolicy:
    """Entry point ``approval``: presets ``read-only``, ``workspace-write`` (default) and ``full``."""
    return ApprovalPolicy(scope, dict(config))


plugin = approval_plugin  # the entry point names ``dsh_plugins.approval:plugin``
