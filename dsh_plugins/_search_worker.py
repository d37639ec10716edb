"""The worker of the workspace ``search`` tool, run as a child process.

A regular expression cannot be interrupted once ``re`` runs it, and it holds
the GIL while it backtracks: a pathological pattern such as ``(a+)+$`` would
stall a worker thread *and* the event loop. So the workspace plugin runs the
search in this script (``python -I -S <this file>``, standard library only)
and kills it on abort, cancellation or timeout.

Protocol: one JSON request on stdin (``pattern``, ``fd``, ``kind``, ``prefix``,
``timeout_s``, ``max_results``, ``max_file_bytes``, ``exclude``, and optionally
``base`` and ``rules``); JSON lines on stdout, flushed as they are found:
``{"match": {...}}``, ``{"file": "searched"|"skipped"|"withheld"}``, and last
``{"done": true, "note": ..., "truncated": ...}``.

``rules`` are the path rules of the guards rows (:mod:`dsh_plugins._path_rules`,
as :meth:`~dsh_plugins._path_rules.PathRules.to_wire` writes them) and ``base``
the real workspace root ``prefix`` is relative to. Each file is judged before it
is opened, by the guard's own code (:meth:`PathRules.judge_found`: the walk
follows no symlink, so a path it reaches is real), and a denied one is reported
as ``withheld``, never read; a directory all under which a rule denies
(:meth:`PathRules.closes`, a ``secrets/`` or ``**/.git/**`` glob) is not entered,
and counts as one ``withheld``.

The worker is handed the place to search already open: ``fd`` (inherited) is the
start directory (``kind`` ``"dir"``) or file (``"file"``), which the parent
reached from the workspace root without following a symlink; ``prefix`` is its
path relative to the root, for the paths it reports. Nothing is looked up by
absolute path: the walk opens each directory relative to the one above it and
each file relative to its directory, never following a symlink, so a directory
swapped for a symlink during the search is not crossed out of the workspace.
A walk leaves out the temporary files of the plugin's writers (:data:`TEMPORARY`).

The deadline is checked per file and per line; lines are searched in their first
:data:`LINE_SEARCH_CHARS` characters only, so the work per line is bounded
for every pattern that does not backtrack exponentially (the parent's kill
covers the rest). Lines end at ``\n`` only (the ``\r`` before it dropped), or at
``\r`` in a file without ``\n`` (:func:`ends_lines_with_cr`), as the ``read`` tool
counts them, so a reported line number is the one read shows.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsh_plugins._path_rules import PathRules


def _load_path_rules() -> ModuleType:
    """:mod:`dsh_plugins._path_rules`: imported as such when this module is (by the workspace plugin), and
    loaded from the file beside this one when it runs as a script (``-I -S``: nothing is on ``sys.path``)."""
    if __package__:
        from dsh_plugins import _path_rules

        return _path_rules
    spec = importlib.util.spec_from_file_location(
        "_dsh_path_rules", os.path.join(os.path.dirname(__file__), "_path_rules.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while they build the classes
    spec.loader.exec_module(module)
    return module


SNIFF_BYTES = 8192
LINE_SEARCH_CHARS = 4096
#: The name of a replacement while write or edit prepares it beside the file (the workspace plugin's
#: ``WorkspaceTools._replace``). A walk leaves such files out, dead writers' leftovers and live writers'
#: half-written copies alike: neither is a file of the workspace, and each match in one would name a file
#: that is about to go (or should have gone). Judged by name only: probing a lock here could make a
#: writer that has just created its file take the probe for a sweep and start over.
TEMPORARY = re.compile(r"\.dsh-[0-9a-f]{12}\.tmp")
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


def _files(
    fd: int, exclude: frozenset[str], closed: Callable[[str], bool] = lambda _path: False
) -> Iterator[tuple[str, int, str | None]]:
    """``(directory, directory_fd, name)`` of every non-directory under the directory ``fd``, sorted, but
    for the temporary files of writers (:data:`TEMPORARY`).

    ``directory`` is relative to ``fd`` (``"."`` for it). :func:`_walk` opens each subdirectory
    relative to its parent and checks it is the one listed (a symlink to a directory is not walked).
    A subdirectory whose path (relative to ``fd``) is ``closed`` is not entered: it is yielded once,
    as ``(its path, directory_fd, None)``.
    """
    for directory, dirs, files, directory_fd in _walk(fd):
        kept = []
        for name in sorted(d for d in dirs if d not in exclude):
            if closed(os.path.join(directory, name)):
                yield os.path.join(directory, name), directory_fd, None
            else:
                kept.append(name)
        dirs[:] = kept
        for name in sorted(files):
            if not TEMPORARY.fullmatch(name):
                yield directory, directory_fd, name


def _walk(fd: int) -> Iterator[tuple[str, list[str], list[str], int]]:
    """:func:`os.fwalk` of the directory ``fd``, top-down and following no symlink, without recursion.

    ``os.fwalk`` (before Python 3.13) recurses once per level: a tree about a thousand levels deep, which
    one ``write`` of a 2 KB path makes, would end the worker with ``RecursionError``, and every search of
    the root with it. Here the open directories are a stack: ``(directory, dirs, files, directory_fd)``
    as ``os.fwalk`` gives them, the subdirectories entered being what is left in ``dirs`` once the
    caller resumes the walk; one that cannot be opened, or was swapped for another (a symlink) after it
    was listed, is skipped, as there.
    """
    top = os.open(os.curdir, os.O_RDONLY | os.O_NONBLOCK | os.O_DIRECTORY, dir_fd=fd)
    # Each: a directory's path, its descriptor, and its subdirectories still to enter (a mutable list,
    # since the caller prunes them only after seeing them).
    stack: list[tuple[str, int, list[str]]] = []
    try:
        current: tuple[str, int] | None = (os.curdir, top)
        while current is not None:
            directory, directory_fd = current
            dirs, files = _entries(directory_fd)
            stack.append((directory, directory_fd, dirs))
            yield directory, dirs, files, directory_fd
            dirs.reverse()  # popped from the end: entered in the order the caller left them in
            current = None
            while stack and current is None:
                parent, parent_fd, left = stack[-1]
                if not left:
                    stack.pop()
                    os.close(parent_fd)
                    continue
                name = left.pop()
                child = _open_directory(parent_fd, name)
                if child is not None:
                    current = (os.path.join(parent, name), child)
    finally:
        for _, open_fd, _ in stack:
            os.close(open_fd)


def _entries(directory_fd: int) -> tuple[list[str], list[str]]:
    """The names of the subdirectories and of the other entries of ``directory_fd``, as ``os.fwalk`` sorts
    them: a symlink to a directory among the subdirectories (:func:`_open_directory` then refuses it)."""
    dirs: list[str] = []
    files: list[str] = []
    try:
        with os.scandir(directory_fd) as scan:
            for entry in scan:
                try:
                    (dirs if entry.is_dir() else files).append(entry.name)
                except OSError:
                    files.append(entry.name)
    except OSError:
        pass  # listed as far as it could be, as os.fwalk does
    return dirs, files


def _open_directory(parent_fd: int, name: str) -> int | None:
    """The subdirectory ``name`` of ``parent_fd``, opened; ``None`` if it cannot be, or if what was opened is
    not the entry found there unfollowed (a symlink, or a directory swapped for one meanwhile)."""
    try:
        found = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        child = os.open(name, os.O_RDONLY | os.O_NONBLOCK, dir_fd=parent_fd)
    except OSError:
        return None
    try:
        opened = os.fstat(child)
    except OSError:
        opened = None
    if opened is None or (opened.st_dev, opened.st_ino) != (found.st_dev, found.st_ino):
        os.close(child)
        return None
    return child


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


def ends_lines_with_cr(data: str | bytes) -> bool:
    """True if the lines of the file ``data`` (the whole of it) end at ``\r``: it holds one and no ``\n``.

    A classic Mac OS file (and what some old tools still write). Judged on the whole file, never on a
    line: in a file with ``\n`` a lone ``\r`` stays part of its line (a terminal log's progress bar), so
    the numbers ``read``, ``search``, ``edit``, ``grep -n`` and ``sed -n`` give such a file stay one.

    The one rule for all of them: ``data`` is the file's bytes (search) or its UTF-8 text (``edit``, which
    holds it decoded), with one answer for both, since UTF-8 never uses the bytes of ``\r`` and ``\n``
    inside another character. (``read`` streams a file too large to hold, and applies it chunk by chunk.)
    """
    if isinstance(data, str):
        return "\n" not in data and "\r" in data
    return b"\n" not in data and b"\r" in data


def _lines(data: bytes) -> list[str]:
    """The lines of ``data`` as ``read`` numbers and shows them: ended by ``\n`` only, without it or the ``\r``
    before it (every one: ``\r\r\n`` is one break to read and ``edit`` too), or by ``\r`` in a file without
    ``\n`` (:func:`ends_lines_with_cr`).

    Not :meth:`str.splitlines`, which also ends a line at a form feed, a lone ``\r``, U+2028 and
    others: the numbers it gives would not be the ones read shows.
    """
    end = "\r" if ends_lines_with_cr(data) else "\n"
    lines = data.decode("utf-8", errors="replace").split(end)
    if lines[-1] == "":
        lines.pop()  # the break that ends the last line starts no line of its own
    return [line.rstrip("\r") for line in lines]


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
    timed_out = {
        "done": True,
        "truncated": True,
        "note": f"search stopped after {timeout_s:g} s; narrow it with path or simplify the pattern",
    }
    rules: Sequence[PathRules] = ()
    if request.get("rules"):
        path_rules = _load_path_rules()
        rules = [path_rules.PathRules.from_wire(wire) for wire in request["rules"]]
    base: str = request.get("base", "")

    def located(path: str) -> str:
        """The absolute path of ``path`` (relative to the start directory, the place the rules judge)."""
        return os.path.normpath(os.path.join(base, prefix, path))

    def closed(path: str) -> bool:
        return any(r.closes(located(path)) for r in rules)

    def withheld(path: str) -> bool:
        return any(r.judge_found(located(path)) is not None for r in rules)

    if request["kind"] == "file":  # the path the call named, which the guard judged
        try:
            data = _read_open(os.dup(request["fd"]), max_file_bytes)
        except OSError:
            data = None
        files: Iterator[tuple[str, bytes | None]] = iter([(prefix, data)])
    elif closed(os.curdir):  # "secrets" named (allowed), all under it denied ("secrets/**")
        emit({"file": "withheld"})
        files = iter([])
    else:

        def walked() -> Iterator[tuple[str, bytes | None]]:
            for directory, directory_fd, name in _files(request["fd"], frozenset(request["exclude"]), closed):
                path = directory if name is None else os.path.join(directory, name)
                if name is None or withheld(path):  # judged before it is opened: never read
                    emit({"file": "withheld"})
                    continue
                yield os.path.normpath(os.path.join(prefix, path)), _read_regular(name, directory_fd, max_file_bytes)

        files = walked()
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
                    emit(
                        {
                            "done": True,
                            "truncated": True,
                            "note": f"more than {max_results} matches; narrow the pattern or path",
                        }
                    )
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
