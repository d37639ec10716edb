"""The worker of the workspace ``search`` tool, run as a child process.

A regular expression cannot be interrupted once ``re`` runs it, and it holds
the GIL while it backtracks: a pathological pattern such as ``(a+)+$`` would
stall a worker thread *and* the event loop. So the workspace plugin runs the
search in this script (``python -I -S <this file>``, standard library only)
and kills it on abort, cancellation or timeout.

Protocol: one JSON request on stdin (``pattern``, ``fd``, ``kind``, ``prefix``,
``timeout_s``, ``max_results``, ``max_file_bytes``, ``exclude``); JSON lines on
stdout, flushed as they are found: ``{"match": {...}}``, ``{"file":
"searched"|"skipped"}``, and last ``{"done": true, "note": ..., "truncated": ...}``.

The worker is handed the place to search already open: ``fd`` (inherited) is the
start directory (``kind`` ``"dir"``) or file (``"file"``), which the parent
reached from the workspace root without following a symlink; ``prefix`` is its
path relative to the root, for the paths it reports. Nothing is looked up by
absolute path: the walk opens each directory relative to the one above it and
each file relative to its directory, never following a symlink, so a directory
swapped for a symlink during the search is not crossed out of the workspace.

The deadline is checked per file and per line; lines are searched in their first
:data:`LINE_SEARCH_CHARS` characters only, so the work per line is bounded
for every pattern that does not backtrack exponentially (the parent's kill
covers the rest). Lines end at ``\n`` only (a ``\r`` before it is dropped), as
the ``read`` tool counts them, so a reported line number is the one read shows.
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


def _files(fd: int, exclude: frozenset[str]) -> Iterator[tuple[str, int, str]]:
    """``(directory, directory_fd, name)`` of every non-directory under the directory ``fd``, sorted.

    ``directory`` is relative to ``fd`` (``"."`` for it). :func:`os.fwalk` opens each subdirectory
    relative to its parent and checks it is the one listed (a symlink to a directory is not walked).
    """
    walk = os.fwalk(os.curdir, dir_fd=fd, follow_symlinks=False)
    for directory, dirs, files, directory_fd in walk:
        dirs[:] = sorted(d for d in dirs if d not in exclude)
        for name in sorted(files):
            yield directory, directory_fd, name


def _read_regular(name: str, dir_fd: int, max_bytes: int) -> bytes | None:
    """The content of ``name`` in ``dir_fd`` if it is a regular file of at most ``max_bytes`` (else ``None``).

    Opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked again once open: a file swapped for a
    symlink (leading out of the workspace) or a FIFO after the check is skipped, not followed.
    """
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
            return None
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        return _read_open(fd, max_bytes, (info.st_dev, info.st_ino))
    except OSError:
        return None


def _read_open(fd: int, max_bytes: int, expected: tuple[int, int] | None = None) -> bytes | None:
    """The content of the open file ``fd`` (closed here) if it is regular, at most ``max_bytes``, and
    (with ``expected``) the file of that device and inode."""
    with open(fd, "rb") as handle:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or opened.st_size > max_bytes:
            return None
        if expected is not None and (opened.st_dev, opened.st_ino) != expected:
            return None
        data = handle.read(max_bytes + 1)
    return data if len(data) <= max_bytes else None


def _lines(data: bytes) -> list[str]:
    """The lines of ``data`` as ``read`` numbers them: ended by ``\n`` only, without it or a ``\r`` before it.

    Not :meth:`str.splitlines`, which also ends a line at a form feed, a lone ``\r``, U+2028 and
    others: the numbers it gives would not be the ones read shows.
    """
    lines = data.decode("utf-8", errors="replace").split("\n")
    if lines[-1] == "":
        lines.pop()  # the newline that ends the last line starts no line of its own
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def search(request: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> None:
    """Search as ``request`` says, reporting through ``emit``; the last event has ``done``.

    ``request["fd"]`` is not closed here (the caller owns it).
    """
    regex = re.compile(request["pattern"])
    timeout_s = request["timeout_s"]
    deadline = time.monotonic() + timeout_s
    max_results: int = request["max_results"]
    max_file_bytes: int = request["max_file_bytes"]
    prefix: str = request["prefix"]
    found = 0
    timed_out = {"done": True, "truncated": True,
                 "note": f"search stopped after {timeout_s:g} s; narrow it with path or simplify the pattern"}
    if request["kind"] == "file":
        try:
            data = _read_open(os.dup(request["fd"]), max_file_bytes)
        except OSError:
            data = None
        files: Iterator[tuple[str, bytes | None]] = iter([(prefix, data)])
    else:
        files = ((os.path.normpath(os.path.join(prefix, directory, name)),
                  _read_regular(name, directory_fd, max_file_bytes))
                 for directory, directory_fd, name in _files(request["fd"], frozenset(request["exclude"])))
    for path, data in files:
        if time.monotonic() > deadline:
            emit(timed_out)
            return
        if data is None or looks_binary(data[:SNIFF_BYTES]):
            emit({"file": "skipped"})
            continue
        emit({"file": "searched"})
        rel = path.replace(os.sep, "/")
        for number, line in enumerate(_lines(data), start=1):
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
