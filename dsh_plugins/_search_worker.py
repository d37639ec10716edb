"""The worker of the workspace ``search`` tool, run as a child process.

A regular expression cannot be interrupted once ``re`` runs it, and it holds
the GIL while it backtracks: a pathological pattern such as ``(a+)+$`` would
stall a worker thread *and* the event loop. So the workspace plugin runs the
search in this script (``python -I -S <this file>``, standard library only)
and kills it on abort, cancellation or timeout.

Protocol: one JSON request on stdin (``pattern``, ``start``, ``root``,
``timeout_s``, ``max_results``, ``max_file_bytes``, ``exclude``); JSON lines on
stdout, flushed as they are found: ``{"match": {...}}``, ``{"file":
"searched"|"skipped"}``, and last ``{"done": true, "note": ..., "truncated": ...}``.
The deadline is checked per line; lines are searched in their first
:data:`LINE_SEARCH_CHARS` characters only, so the work per line is bounded
for every pattern that does not backtrack exponentially (the parent's kill
covers the rest).
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

SNIFF_BYTES = 8192
LINE_SEARCH_CHARS = 4096
SHOWN_CHARS = 500


def looks_binary(chunk: bytes) -> bool:
    """True for a chunk with NUL bytes or invalid UTF-8 (a multi-byte character cut at its end is text)."""
    if b"\0" in chunk:
        return True
    try:
        chunk.decode("utf-8")
    except UnicodeDecodeError as error:
        return error.start < len(chunk) - 3
    return False


def _files(start: str, exclude: frozenset[str]) -> Iterator[str]:
    if os.path.isfile(start):
        yield start
        return
    for directory, dirs, files in os.walk(start, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in exclude)
        for name in sorted(files):
            yield os.path.join(directory, name)


def _read_regular(path: str, max_bytes: int) -> bytes | None:
    """The content of ``path`` if it is a regular file of at most ``max_bytes`` (``None`` otherwise).

    Opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked again once open: a file swapped for a
    symlink (leading out of the workspace) or a FIFO after the ``lstat`` is skipped, not followed.
    """
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with open(fd, "rb") as handle:
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
                return None
            data = handle.read(max_bytes + 1)
    except OSError:
        return None
    return data if len(data) <= max_bytes else None


def search(request: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> None:
    """Search as ``request`` says, reporting through ``emit``; the last event has ``done``."""
    regex = re.compile(request["pattern"])
    timeout_s = request["timeout_s"]
    deadline = time.monotonic() + timeout_s
    max_results: int = request["max_results"]
    found = 0
    timed_out = {"done": True, "truncated": True,
                 "note": f"search stopped after {timeout_s:g} s; narrow it with path or simplify the pattern"}
    for path in _files(request["start"], frozenset(request["exclude"])):
        if time.monotonic() > deadline:
            emit(timed_out)
            return
        data = _read_regular(path, request["max_file_bytes"])
        if data is None:
            emit({"file": "skipped"})
            continue
        if looks_binary(data[:SNIFF_BYTES]):
            emit({"file": "skipped"})
            continue
        emit({"file": "searched"})
        rel = os.path.relpath(path, request["root"]).replace(os.sep, "/")
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
            if time.monotonic() > deadline:
                emit(timed_out)
                return
            if regex.search(line, 0, LINE_SEARCH_CHARS):
                if found >= max_results:
                    emit({"done": True, "truncated": True,
                          "note": f"more than {max_results} matches; narrow the pattern or path"})
                    return
                found += 1
                text = line if len(line) <= SHOWN_CHARS else line[:SHOWN_CHARS] + " [...]"
                emit({"match": {"path": rel, "line": number, "text": text}})
    emit({"done": True, "truncated": False, "note": None})


def main() -> None:
    """Read the request from stdin, write events to stdout."""
    request = json.loads(sys.stdin.buffer.read())
    out = sys.stdout

    def emit(event: dict[str, Any]) -> None:
        out.write(json.dumps(event) + "\n")
        out.flush()

    search(request, emit)


if __name__ == "__main__":
    main()
