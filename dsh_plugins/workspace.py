"""The ``workspace`` plugin: file tools confined to one directory.

Tools: ``read`` (line-numbered, ``offset``/``limit``), ``write``, ``edit``
(exact string replacement), ``list`` and ``search`` (a regex over files,
bounded). Every path argument is resolved against the configured ``root``;
an absolute path outside it, a ``..`` that climbs out of it, or a symlink
that leads out of it is refused before anything is read or written.

``write`` and ``edit`` replace a file through a new one beside it, ``.dsh-<12 hex>.tmp``, renamed over
it once complete and locked (``flock``) by its writer until then. One a dead writer left (a crash, a
SIGKILL), unlocked and a minute old (:data:`SWEEP_MIN_AGE_S`), is removed: in the root at load, and in
the directory ``write`` or ``edit`` goes to when it was not swept within :data:`SWEEP_INTERVAL_S` (a bounded
look, :data:`SWEEP_ENTRIES` entries, at most once a minute per directory; a locked one, whose writer lives, is
never touched). ``read``, ``list`` and
``search`` are read-only (annotated so, and run unasked by the ``read-only`` approval preset), so they sweep
nothing: ``list`` and ``search`` leave every file so named out by name (see
:data:`~dsh_plugins._search_worker.TEMPORARY`), and ``read`` or ``search`` of a path naming one reads it
as any file; ``write`` and ``edit`` refuse to make or change a file so named, which would be hidden, then swept.

With a ``guards`` row that has path rules (``deny_paths``, ``allowed_roots``),
``list`` and ``search`` also withhold what they reach that the path guard would
deny if a call named it: they look the rules the guards rows publish up at each
call (:meth:`WorkspaceTools.path_rules`), judge entries with the guard's own
code (:mod:`dsh_plugins._path_rules`), never open a denied file, and report how
many entries they withheld (``withheld``), never which.

Config::

    [[plugins]]
    id = "workspace"
    use = "workspace"
    config = { root = "/path/to/project" }   # max_read_bytes, max_file_bytes, ... optional

This module uses only the public plugin API (``dsh_core``); it doubles as an
example of a tool plugin.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import fcntl
import heapq
import io
import itertools
import json
import os
import re
import stat
import sys
import threading
import time
import unicodedata
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from dsh_core import Scope, ToolContext, ToolDefinition, ToolError, define_tool, hookimpl, plugin
from dsh_core.processes import kill_child
from dsh_plugins import _search_worker
from dsh_plugins._git_files import GitProtection, protected_git_paths
from dsh_plugins._path_rules import SERVICE as PATH_RULES_SERVICE
from dsh_plugins._path_rules import PathRules
from dsh_plugins._path_rules import lexical as _lexical
from dsh_plugins._path_rules import under as _under
from dsh_plugins._search_worker import LINE_SEARCH_CHARS
from dsh_plugins._search_worker import TEMPORARY as _TEMPORARY
from dsh_plugins._search_worker import looks_binary as _looks_binary

__all__ = ["plugin", "Workspace", "WorkspaceTools"]

DEFAULT_EXCLUDES = [".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", ".mypy_cache", ".tox"]
# Git runs what its directory holds (hooks, core.fsmonitor and aliases in config): a file written there
# is a command run later, outside any approval, by whoever next uses git in the workspace.
DEFAULT_PROTECTED = [".git"]

CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["root"],
    "properties": {
        "root": {"type": "string", "minLength": 1, "description": "the workspace directory (absolute)"},
        "max_read_bytes": {
            "type": "integer",
            "minimum": 1024,
            "default": 262144,
            "description": "most bytes of file text one read returns",
        },
        "max_file_bytes": {
            "type": "integer",
            "minimum": 1024,
            "default": 10485760,
            "description": "largest file write and edit handle",
        },
        "max_read_file_bytes": {
            "type": "integer",
            "minimum": 1024,
            "default": 268435456,
            "description": "largest file read opens (bigger ones: use bash head/tail)",
        },
        "max_list_entries": {"type": "integer", "minimum": 1, "default": 1000},
        "max_search_results": {"type": "integer", "minimum": 1, "default": 200},
        "max_search_file_bytes": {"type": "integer", "minimum": 1024, "default": 2097152},
        "search_timeout_s": {"type": "number", "exclusiveMinimum": 0, "default": 20},
        "search_exclude": {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "description": "directory names search skips",
            "default": DEFAULT_EXCLUDES,
        },
        "protected_dirs": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "pattern": "^[^/]+$"},
            "default": DEFAULT_PROTECTED,
            "description": "names of directories (and files) write and edit never change, "
            "at any depth, compared as git compares .git under core.protectHFS "
            "and core.protectNTFS (case, NFC/NFD, ignorable code points, trailing "
            "dots and spaces, :streams, short names); with .git, also any directory "
            "git takes for a repository (HEAD with objects/ and refs/)",
        },
    },
}

DEFAULT_READ_LIMIT = 2000
MAX_LINE_CHARS = 2000
# A line of MAX_LINE_CHARS characters takes at most this many UTF-8 bytes (plus "\r\n"); read never
# holds more of one line, and skips the rest of a longer line in SKIP_CHUNK_BYTES pieces.
MAX_LINE_BYTES = MAX_LINE_CHARS * 4 + 2
SKIP_CHUNK_BYTES = 1 << 16
SNIFF_BYTES = 8192
SCAN_CHUNK_BYTES = 1 << 16  # read looks for an LF in pieces this big (a file without one: all of it)
READ_CUT_NOTE = " [... line cut to fit the read limit]"  # ASCII: its length is its size in bytes
# One worker event (a line of JSON): a match's path is not bounded by PATH_MAX, since the walk opens
# each directory relative to the one above it (escaped, a deep path of long names is a few MiB at most).
SEARCH_EVENT_BYTES = 1 << 23
SEARCH_KILL_GRACE_S = 0.5  # past search_timeout_s, a search stuck inside one regex call is killed

_T = TypeVar("_T")
_Entries = list[dict[str, Any]]  # (named here: inside WorkspaceTools, "list" is the tool body)

#: Most directory entries one sweep for the temporary files of dead writers looks at (:func:`_sweep`).
SWEEP_ENTRIES = 10_000
#: Seconds since a temporary file was last written (its mtime) before a sweep may take it for a dead writer's:
#: a writer that holds no lock (an older dsh, a file system without a working flock) is spared meanwhile.
SWEEP_MIN_AGE_S = 60
#: Seconds before write or edit sweeps a directory this instance swept before, again: a writer that died there
#: since leaves a file a sweep may take only once it is :data:`SWEEP_MIN_AGE_S` old, so a file is removed within
#: about twice that of its writer's death, and each write pays a scan at most once this often per directory.
SWEEP_INTERVAL_S = SWEEP_MIN_AGE_S
#: The clock sweeps are spaced by (a module attribute, so tests can set the time).
_monotonic = time.monotonic
#: Most directories remembered as swept within :data:`SWEEP_INTERVAL_S` (see ``WorkspaceTools._sweep_if_due``):
#: past it, the one swept longest ago is forgotten, and only costs a write there an early sweep.
SWEPT_DIRECTORIES = 4096
#: Temporary names a write tries when a sweep (another dsh's) takes the one it created before it locked it.
_TEMPORARY_ATTEMPTS = 3
#: What fsync gives on a file system that does not sync (this kind of file): nothing to wait for, no failure.
_NO_SYNC = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})

READ_ONLY = {"read_only": True, "workspace_confined": True}
MUTATING = {"workspace_confined": True}


#: Extended attributes that hold POSIX ACLs: who may use the file beyond its mode bits.
_ACL_XATTRS = frozenset({"system.posix_acl_access", "system.posix_acl_default"})
#: Extended attributes that belong to the old bytes, never copied onto new ones: file capabilities
#: (which the kernel itself removes on any write; copied, a program the model wrote would run with
#: the privileges of the one it replaced) and IMA/EVM measurements of the old content.
_CONTENT_XATTRS = frozenset({"security.capability", "security.ima", "security.evm"})


#: Code points HFS+ ignores in a name (git's utf8.c, next_hfs_char): there ".git\u200c" is ".git".
_HFS_IGNORED = re.compile("[\u200c-\u200f\u202a-\u202e\u206a-\u206f\ufeff]")


def _protected_key(name: str) -> str:
    """``name`` as a file system that git guards against may read it, to compare with a protected name.

    git refuses to check out a path component such a file system would take for ``.git``
    (``core.protectHFS`` and ``core.protectNTFS``: ``is_hfs_dotgit`` in utf8.c, ``is_ntfs_dotgit`` in
    path.c), since writing through it writes the repository: HFS+ ignores the code points of
    :data:`_HFS_IGNORED`, and NTFS drops trailing dots and spaces and reads ``name:stream``
    (``.git::$INDEX_ALLOCATION``) as ``name``. Case is folded, and NFC and NFD spellings made one
    (macOS file systems do not tell them apart): Unicode's canonical caseless match, NFD(casefold(NFD)).
    Applied to the configured names and to the path's alike; NTFS short names (``GIT~1``) are added
    by :class:`WorkspaceTools`, as they follow from the name rather than spell it.
    """
    name = _HFS_IGNORED.sub("", name).split(":", 1)[0].rstrip(". ")
    return unicodedata.normalize("NFD", unicodedata.normalize("NFD", name).casefold())


#: A line break as read hides it: a line feed and the carriage returns before it.
_LINE_BREAK = re.compile(r"\r*\n")
#: A line break of old_string or new_string when edit changes a file whose lines end at CR: each is one.
_ANY_BREAK = re.compile(r"\r\n|\r|\n")


def _ends_lines_with_cr(handle: io.BufferedReader, stop: threading.Event) -> bool:
    """:func:`~dsh_plugins._search_worker.ends_lines_with_cr` of the file ``handle`` reads, from its start.

    Read in chunks, to the first ``\n`` (in the first chunk, for most files) or the end.
    """
    handle.seek(0)
    seen_cr = False
    while not stop.is_set() and (chunk := handle.read(SCAN_CHUNK_BYTES)):
        if b"\n" in chunk:
            return False
        seen_cr = seen_cr or b"\r" in chunk
    return seen_cr


def _read_line(handle: io.BufferedReader, limit: int, end: bytes) -> bytes:
    """The next line of ``handle``, with the ``end`` (``\n`` or ``\r``) that ends it: at most ``limit`` bytes."""
    if end == b"\n":
        return handle.readline(limit)
    parts: list[bytes] = []
    size = 0
    while size < limit:
        ahead = handle.peek(1)[: limit - size]  # what the buffer holds already: no read of its own
        if not ahead:
            break
        at = ahead.find(end)
        parts.append(handle.read(at + 1 if at != -1 else len(ahead)))
        size += len(parts[-1])
        if at != -1:
            break
    return b"".join(parts)


class _LineView:
    """A text as read shows it (the CRs before each LF left out), and the way back to the text's offsets.

    ``edit`` finds ``old_string`` in :attr:`view` with plain string search (linear, as in a file without
    CR), so text copied from read matches whatever ending, LF or CRLF, each of its lines has in the file.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        #: For each line break that had CRs: its LF's offset in the view, and the CRs left out up to it.
        self.breaks: list[int] = []
        self.removed: list[int] = []
        parts: list[str] = []
        last = removed = 0
        for match in _LINE_BREAK.finditer(text):
            crs = match.end() - match.start() - 1
            if crs:
                parts.append(text[last : match.start()])
                removed += crs
                self.breaks.append(match.end() - 1 - removed)
                self.removed.append(removed)
                last = match.end() - 1
        parts.append(text[last:])
        self.view = "".join(parts)

    def _left_out_before(self, index: int, *, including: bool) -> int:
        at = (bisect.bisect_right if including else bisect.bisect_left)(self.breaks, index)
        return self.removed[at - 1] if at else 0

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The text's offsets of the view's ``start:end`` (not empty): a break it starts or ends with
        comes whole, its CRs with its LF."""
        return (
            start + self._left_out_before(start, including=False),
            end + self._left_out_before(end - 1, including=True),
        )


def _ended_as_matched(new: str, text: str, start: int, end: int) -> str:
    """``new`` (an edit's new_string) with each of its line breaks ending as the one in its place in
    ``text[start:end]`` (the matched region), so an edit keeps the file's line endings, LF or CRLF, line by line.

    Breaks past the matched ones end as the last of those; with none matched, as the line the match
    ends in (on a last line without a break, as the one before it; in a file of one line, LF). A CR
    that ``new`` itself gives before an LF is kept as given.
    """
    breaks = _LINE_BREAK.findall(text, start, end)
    if not breaks:
        after = text.find("\n", end)
        at = after if after != -1 else text.rfind("\n", 0, start)
        breaks = ["\r\n" if at > 0 and text[at - 1] == "\r" else "\n"]
    lines = new.split("\n")
    ended = [lines[0]]
    for index, line in enumerate(lines[1:]):
        ended.append("\n" if lines[index].endswith("\r") else breaks[min(index, len(breaks) - 1)])
        ended.append(line)
    return "".join(ended)


def _refuse_hard_link(info: os.stat_result, given: str) -> None:
    """Refuse to replace ``given`` (whose stat is ``info``) if the file has other names (hard links).

    Neither way of changing it is safe: replaced (a new file renamed over this name), its other names
    keep the old content, silently; written in place, the change reaches every name, and one may lie
    outside the workspace (a link into a package store, a backup, any file on the same file system),
    where no other path of the workspace tools reaches. Where the other names are, nothing here can
    tell, so which one the user meant cannot be judged.
    """
    if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
        others = info.st_nlink - 1
        raise ToolError(
            f"cannot write {given!r}: it has {info.st_nlink} names (hard links), and write and edit "
            f"replace a file with a new one, which would leave the other {others} with the old content "
            "(writing through it instead would change a file that may lie outside the workspace); "
            "nothing was changed: to change every name, change it in place with bash; to give "
            f"{given!r} content of its own, remove it with bash first, then write it"
        )


def _refuse_temporary_name(real: str, given: str, verb: str) -> None:
    """Refuse to write or edit a file named as a writer's temporary file (:data:`_TEMPORARY`), ``real`` being
    where ``given`` leads: list and search leave such a file out, and a sweep removes it once it is a minute
    old and unlocked (:func:`_sweep`), so the model's file would be hidden, then lost."""
    if _TEMPORARY.fullmatch(os.path.basename(real)):
        raise ToolError(
            f"{verb} refused: {given!r} is named as write and edit name their temporary files "
            "(.dsh-<12 hex>.tmp), which list and search leave out and a later write removes; "
            "nothing was changed: choose another name"
        )


def _utf8(text: str, what: str) -> bytes:
    """``text`` as UTF-8; a lone surrogate (half of a broken character, which UTF-8 cannot hold) is named."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ToolError(
            f"{what} has a lone surrogate (U+{ord(text[error.start]):04X} at character "
            f"{error.start}), which UTF-8 text cannot hold; nothing was written"
        ) from None


def _temporary_name() -> str:
    """A fresh name that :data:`_TEMPORARY` matches: 48 random bits, so no two writers pick the same one."""
    return f".dsh-{os.urandom(6).hex()}.tmp"


def _sweep(directory: int) -> int:
    """Remove the temporary files that dead writers left in ``directory`` (a descriptor); how many went.

    A writer holds an exclusive ``flock`` on its temporary file from just after creating it until
    it is renamed over the file or removed (:meth:`WorkspaceTools._replace`); the kernel drops the
    lock when the writer dies, however it dies (a crash, SIGKILL, the OOM killer), which is when its
    file would otherwise stay for good. So a file named exactly as :data:`_TEMPORARY` says, regular,
    last written :data:`SWEEP_MIN_AGE_S` or more ago, whose lock can be taken at once, has no writer and
    goes; a locked one is never touched, nor a younger one, whose writer may hold no lock at all (an
    older dsh, a file system whose flock does not work across hosts). Symlinks
    are never followed, nothing else is ever removed, and at most :data:`SWEEP_ENTRIES` entries are
    looked at, so a huge directory costs a write no more than that. Failures are housekeeping's:
    an entry that cannot be judged is left alone, a directory that cannot be listed skipped.
    """
    try:
        # O_RDONLY, not the O_PATH ``directory`` may be: its entries are read.
        listed = os.open(os.curdir, os.O_RDONLY | os.O_DIRECTORY, dir_fd=directory)
    except OSError:
        return 0  # a drop box (search permission, no read): nothing in it can be seen
    removed = 0
    try:
        with os.scandir(listed) as scan:
            for entry in itertools.islice(scan, SWEEP_ENTRIES):
                if _TEMPORARY.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    removed += _remove_if_dead(listed, entry.name)
    except OSError:
        pass  # the directory went or broke while it was read: what was removed is removed
    finally:
        os.close(listed)
    return removed


def _remove_if_dead(directory: int, name: str) -> bool:
    """Remove the temporary file ``name`` of ``directory`` if no writer holds its lock (see :func:`_sweep`)."""
    # O_NOFOLLOW: a symlink put in its place is not followed; O_NONBLOCK: nor does a FIFO block the open.
    flags = os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(name, os.O_RDONLY | flags, dir_fd=directory)
    except PermissionError:
        # It copied the mode of the file it was to replace (fchmod), which may be write-only (0200): its owner
        # may still open it for writing, and flock takes a descriptor of either kind.
        try:
            fd = os.open(name, os.O_WRONLY | flags, dir_fd=directory)
        except OSError:
            return False
    except OSError:
        return False
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            return False
        if time.time() - opened.st_mtime < SWEEP_MIN_AGE_S:
            return False  # maybe written now by a writer that holds no lock: judged before its lock is probed
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its writer lives (or this file system has no flock: then none is known dead)
        # Held until the unlink: a writer that created the file just before cannot lock it meanwhile, and
        # finds its name gone once it can (see _create_temporary). The name must still be this file.
        named = os.stat(name, dir_fd=directory, follow_symlinks=False)
        if (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino):
            return False
        os.unlink(name, dir_fd=directory)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _create_temporary(parent: int) -> tuple[str, int]:
    """A new temporary file in ``parent``, locked for as long as the descriptor returned is open, and its name.

    Between the create and the lock, a sweep (of another dsh on the same directory) may take the file
    for a dead writer's: then the lock is refused while the sweep holds it, or taken on a file whose name
    is already gone; either way a new name is tried. Once locked with its name in place, no sweep
    removes it. Raises the :class:`OSError` of the create, or ``EAGAIN`` if every name tried was swept.
    """
    for _ in range(_TEMPORARY_ATTEMPTS):
        temporary = _temporary_name()
        # 0o666 less the umask, as any program's new file (a replaced file's mode is copied by the caller).
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=parent)
        try:
            if _lock_created(parent, temporary, fd):
                return temporary, fd
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=parent)
            raise
        os.close(fd)
        with contextlib.suppress(OSError):  # most likely gone already, removed by the sweep
            os.unlink(temporary, dir_fd=parent)
    raise OSError(errno.EAGAIN, "its temporary file was removed as soon as it was made, each time tried")


def _lock_created(parent: int, temporary: str, fd: int) -> bool:
    """Lock the temporary file ``fd`` just created as ``temporary`` in ``parent``; False if a sweep took it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # a sweep holds it, and removes it
    except OSError:
        pass  # no flock on this file system: no sweep can take a lock on it either, nor one younger than a minute
    try:
        named = os.stat(temporary, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return False  # a sweep removed it before the lock could be taken
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def _sync_directory(parent: int, given: str, what: str = "its directory") -> None:
    """Sync the directory ``parent`` to disk, after the rename in it that put ``given`` in place (or, ``what``
    says so, after a directory on its way was made in it).

    A rename is an entry of the directory: until the directory reaches the disk, a crash or power loss
    may bring back the old file (or none), whatever the new file's own sync did. A file system that does
    not sync directories (:data:`_NO_SYNC`) is skipped, as is a directory that cannot be opened to be
    synced (search permission only, no read); another failure is reported as what it is: the file is
    in place, but may not stay.
    """
    try:
        directory = os.open(os.curdir, os.O_RDONLY | os.O_DIRECTORY, dir_fd=parent)
    except OSError:
        return
    try:
        os.fsync(directory)
    except OSError as error:
        if error.errno not in _NO_SYNC:
            raise _not_durable(given, f"syncing {what} to disk failed ({error.strerror})") from None
    finally:
        os.close(directory)


def _not_durable(given: str, why: str) -> ToolError:
    """The error of a write whose new content is in place, but ``why`` (a failed sync or close) may not stay:
    not "cannot write", which would have the model write again what is there."""
    return ToolError(
        f"{given!r} was written, but it may not be durable: {why}; its new content is in place, but a "
        "crash or power loss could still lose it: check the disk"
    )


def _format_size(size: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


async def _in_thread(ctx: ToolContext, work: Callable[[threading.Event], _T]) -> _T:
    """Run ``work(stop)`` in a thread; ``stop`` is set on abort and on cancellation.

    ``work`` checks ``stop`` after each bounded step. A cancelled call waits for the
    thread to notice (one step), so no file work outlives the call.
    """
    stop = threading.Event()
    remove = ctx.signal.add_listener(lambda _reason: stop.set())
    worker = asyncio.ensure_future(asyncio.to_thread(work, stop))
    try:
        return await asyncio.shield(worker)
    finally:
        remove()
        stop.set()
        while not worker.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({worker})
        if not worker.cancelled():
            worker.exception()  # retrieved (re-raised above when the await was not cancelled)


# O_PATH (Linux): crossing a directory needs search permission only, as path lookup does, not read permission.
_DIRECTORY = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY


def _open_child(fd: int, name: str, create: bool, made: Callable[[], None] | None = None) -> int | None:
    """The directory ``name`` under ``fd``, not followed if it is a symlink (then ``None``); ``made`` is
    called if ``create`` made it."""
    try:
        return os.open(name, _DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(name, dir_fd=fd)
        except FileExistsError:
            pass  # made meanwhile by another program
        else:
            if made is not None:
                made()
        return _open_child(fd, name, False)
    except OSError:
        # O_NOFOLLOW|O_DIRECTORY on a symlink fails with ENOTDIR (or ELOOP); tell it from a plain file.
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                return None
        raise


def _loops(fd: int, name: str) -> bool:
    """True if the symlink ``name`` under ``fd`` cannot be followed because it loops."""
    try:
        os.stat(name, dir_fd=fd)
    except OSError as error:
        return error.errno == errno.ELOOP
    return False


def _holds(directory: str, below: list[str], name: str, as_directory: bool) -> bool:
    """True if ``directory`` holds ``name`` (a directory, or any entry) once a write adds ``below`` to it
    (the components of the written path under ``directory``, as :func:`_protected_key` gives them)."""
    if below[0] == _protected_key(name) and as_directory == (len(below) > 1):
        return True  # the file written, or a directory made on its way
    path = os.path.join(directory, name)
    return os.path.isdir(path) if as_directory else os.path.lexists(path)


class Workspace:
    """Path confinement and file access under one root directory."""

    def __init__(self, root: str) -> None:
        if not os.path.isabs(root):
            raise ToolError(f"workspace root must be an absolute path, got {root!r}")
        real = os.path.realpath(root)
        if not os.path.isdir(real):
            raise ToolError(f"workspace root {root!r} is not a directory")
        self.root = real
        #: The root as configured, when a symlink on the way makes it differ from the real one
        #: (/home -> /data/home): absolute paths spelled like it are inside too.
        self.alias = _lexical(root) if _lexical(root) != real else None

    def resolve(self, path: str, *, what: str = "path") -> str:
        """The real absolute path of ``path`` inside the root; :class:`ToolError` if it leads outside.

        Symlinks are resolved (for components that exist), so a link pointing
        out of the workspace is refused like a ``..`` or an outside absolute path.
        """
        if not path:
            raise ToolError(f"{what} must not be empty")
        if "\0" in path:
            raise ToolError(f"{what} contains a NUL character")
        try:
            os.fsencode(path)  # surrogateescape: a name that is not UTF-8 (U+DC80..U+DCFF) is a file name
        except UnicodeEncodeError as error:  # realpath and every open would raise it, a codec message
            raise ToolError(
                f"{what} {path!r} cannot be a file name: it has a lone surrogate "
                f"(U+{ord(path[error.start]):04X} at character {error.start}), which no "
                "encoding of a name holds"
            ) from None
        lexical = _lexical(path if os.path.isabs(path) else os.path.join(self.root, path))
        if self.alias is not None and not self._inside(lexical) and _under(lexical, self.alias):
            lexical = self.root + lexical[len(self.alias) :]  # the configured spelling of the root
        if not self._inside(lexical):
            raise ToolError(
                f"{what} {path!r} is outside the workspace {self.root}; use a path relative to the workspace root"
            )
        try:
            real = os.path.realpath(lexical)
        except RecursionError:  # realpath recurses once per link of a chain, which the kernel stops at 40
            raise ToolError(f"cannot resolve {what} {path!r}: too many levels of symbolic links") from None
        if not self._inside(real):
            raise ToolError(
                f"{what} {path!r} leads outside the workspace {self.root} through a symlink "
                f"(it resolves to {real}); refused"
            )
        return real

    def open_dir(
        self,
        real: str,
        given: str,
        *,
        create: bool = False,
        readable: bool = False,
        made: list[tuple[int, str]] | None = None,
    ) -> int:
        """A descriptor of the directory ``real`` (as :meth:`resolve` returned it), walked from the root.

        Each component is opened with ``O_NOFOLLOW`` relative to the one before, so a directory
        swapped for a symlink after :meth:`resolve` checked the path is refused instead of followed
        out of the workspace. ``create`` makes missing directories on the way (for write); ``readable``
        returns a descriptor its entries can be read from (for list; otherwise it may be an ``O_PATH``
        one, for the ``dir_fd`` of other calls only). Other failures raise the :class:`OSError` of the
        component (``FileNotFoundError``, ``NotADirectoryError``...). For each directory ``create`` makes,
        ``made`` (if given) gets a new descriptor of the one it was made in and its path from the root, for
        the caller to sync (the new entry is on disk only once its parent is) and close.
        """
        if not self._inside(real):
            raise ToolError(f"path {given!r} is outside the workspace {self.root}")
        relative = os.path.relpath(real, self.root)
        parts = [] if relative == os.curdir else relative.split(os.sep)
        fd = os.open(self.root, _DIRECTORY)
        try:
            for index, part in enumerate(parts):
                shown = "/".join(parts[: index + 1])
                # The callback is called by _open_child, before the loop goes on: the late binding is safe.
                record = None if made is None else (lambda: made.append((os.dup(fd), shown)))  # noqa: B023
                child = _open_child(fd, part, create, made=record)
                if child is None:
                    if _loops(fd, part):  # resolve() leaves a looping symlink unresolved: no race
                        raise ToolError(f"cannot access {given!r}: {shown!r} is a symlink loop")
                    raise ToolError(
                        f"{given!r} changed while it was being opened: {shown!r} was replaced by a symlink; refused"
                    )
                os.close(fd)
                fd = child
            if readable:
                child = os.open(os.curdir, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _inside(self, path: str) -> bool:
        return _under(path, self.root)

    def relative(self, real: str) -> str:
        """``real`` relative to the root, with ``/`` separators (``.`` for the root itself)."""
        rel = os.path.relpath(real, self.root)
        return rel.replace(os.sep, "/")


class WorkspaceTools:
    """The plugin instance: holds the config and registers the five tools.

    ``scope`` (the plugin row's) is where the path rules of the guards rows are looked up, at each
    ``list`` and ``search`` call: see :meth:`path_rules`.
    """

    def __init__(self, config: dict[str, Any], scope: Scope | None = None) -> None:
        self.scope = scope
        self.workspace = Workspace(config["root"])
        self.max_read_bytes: int = config.get("max_read_bytes", 262144)
        self.max_file_bytes: int = config.get("max_file_bytes", 10485760)
        self.max_read_file_bytes: int = config.get("max_read_file_bytes", 268435456)
        self.max_list_entries: int = config.get("max_list_entries", 1000)
        self.max_search_results: int = config.get("max_search_results", 200)
        self.max_search_file_bytes: int = config.get("max_search_file_bytes", 2097152)
        self.search_timeout_s: float = config.get("search_timeout_s", 20)
        self.search_exclude = frozenset(config.get("search_exclude", DEFAULT_EXCLUDES))
        #: The protected names by :func:`_protected_key`, each to the name as configured.
        self.protected_dirs: dict[str, str] = {}
        for name in config.get("protected_dirs", DEFAULT_PROTECTED):
            key = _protected_key(name)
            self.protected_dirs[key] = name
            stem = key.lstrip(".")
            if "." not in stem:  # NTFS's short name of it: its first six characters and ~N (git~1 is .git)
                for number in "1234":
                    self.protected_dirs.setdefault(f"{stem[:6]}~{number}", name)
        #: A lock per file name being replaced, (device, inode) of its directory and the name: see _name_lock.
        self._name_locks: weakref.WeakValueDictionary[tuple[int, int, str], threading.Lock] = (
            weakref.WeakValueDictionary()
        )
        self._name_locks_guard = threading.Lock()
        #: The directories (device, inode) swept for dead writers' temporary files less than SWEEP_INTERVAL_S
        #: ago, each to when (:data:`_monotonic`), oldest first: see :meth:`_sweep_if_due`.
        self._swept: OrderedDict[tuple[int, int], float] = OrderedDict()
        self._swept_guard = threading.Lock()  # writes sweep from threads of their own
        with contextlib.suppress(OSError):  # housekeeping: a root that cannot be swept still serves
            root = os.open(self.workspace.root, _DIRECTORY)
            try:
                self._sweep_if_due(root)
            finally:
                os.close(root)

    def _sweep_if_due(self, directory: int) -> None:
        """:func:`_sweep` ``directory`` (a descriptor) unless this instance swept it less than
        :data:`SWEEP_INTERVAL_S` ago.

        Called at load (the root) and by write and edit (the directory each goes to), never by read, list or
        search, which change nothing (their annotation says so, and the ``read-only`` approval preset runs them
        unasked). Not once per directory for good: a writer that died there after that sweep left its file
        until the next load. Not at every write either: a sweep looks at up to :data:`SWEEP_ENTRIES` entries,
        so a directory is looked at once per interval at most, however often it is written. A directory's entry
        is dropped once its sweep is that old (it would be swept again anyway), so the table holds only the
        directories swept within the interval, and at most :data:`SWEPT_DIRECTORIES` of them: writes to more
        directories than that within one interval forget the one swept longest ago, which a write there
        then sweeps early (a sweep never takes a live writer's file, so this costs a scan, nothing else).
        (The first call to find a directory due sweeps it; one in another thread meanwhile goes on without
        waiting for that sweep: harmless, a sweep removes only what no writer holds.)
        """
        info = os.fstat(directory)
        key = (info.st_dev, info.st_ino)
        with self._swept_guard:
            now = _monotonic()  # read under the lock, so entries go in in the clock's order
            # Entries go in as they are swept, and the clock never goes back: the oldest are first.
            while self._swept and now - next(iter(self._swept.values())) >= SWEEP_INTERVAL_S:
                self._swept.popitem(last=False)
            if key in self._swept:
                return
            self._swept[key] = now
            while len(self._swept) > SWEPT_DIRECTORIES:
                self._swept.popitem(last=False)
        _sweep(directory)

    def _name_lock(self, parent: int, name: str) -> threading.Lock:
        """The lock of the name ``name`` in the directory ``parent`` (a descriptor), the same for every call of
        this instance that replaces it, for as long as one holds it.

        An edit checks that the file is unchanged and then renames its copy over it; two edits of one file, each
        in its thread, could both pass the check before either renamed, and the second rename would undo the
        first edit unseen. Held from the check to the rename (:meth:`_replace`), it makes the second check see
        the first edit. (Other programs are not stopped by it: the check, by content, is what catches them.)
        """
        info = os.fstat(parent)
        key = (info.st_dev, info.st_ino, name)
        with self._name_locks_guard:
            lock = self._name_locks.get(key)
            if lock is None:  # gone with its last holder: the table keeps no entry per file ever written
                lock = self._name_locks[key] = threading.Lock()
            return lock

    @hookimpl
    def dsh_register_tools(self, register: Any) -> None:
        """Register read, write, edit, list and search (mutating tools first, as the examples build on each other)."""
        for definition in self.definitions():
            register(definition)

    def definitions(self) -> list[ToolDefinition]:
        """The five tool definitions bound to this workspace."""
        return [
            define_tool(
                name="write",
                description=(
                    "Write a text file in the workspace, replacing it if it exists and creating "
                    "parent directories. Paths are relative to the workspace root."
                ),
                parameters={
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "file path relative to the workspace root"},
                        "content": {"type": "string", "description": "the complete new file content"},
                    },
                    "required": ["path", "content"],
                    "additionalProperties": False,
                },
                output_schema={
                    "type": "object",
                    "properties": {
                        "path": {"type": "string"},
                        "bytes": {"type": "integer"},
                        "created": {"type": "boolean"},
                    },
                    "required": ["path", "bytes", "created"],
                },
                execute=self.write,
                render=lambda _a, v: f"{'Created' if v['created'] else 'Wrote'} {v['path']} ({v['bytes']} bytes)",
                is_concurrency_safe=False,
                examples=[{"path": "notes.txt", "content": "hello world\nsecond line\n"}],
                annotations=MUTATING,
            ),
            define_tool(
                name="edit",
                description=(
                    "Replace an exact string in a text file of the workspace. old_string must occur "
                    "exactly once unless replace_all is true; include surrounding lines to make it "
                    "unique. Whitespace and indentation must match exactly."
                ),
                parameters={
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "file path relative to the workspace root"},
                        "old_string": {"type": "string", "description": "the exact text to replace"},
                        "new_string": {"type": "string", "description": "the replacement text"},
                        "replace_all": {"type": "boolean", "default": False, "description": "replace every occurrence"},
                    },
                    "required": ["path", "old_string", "new_string"],
                    "additionalProperties": False,
                },
                output_schema={
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "replacements": {"type": "integer"}},
                    "required": ["path", "replacements"],
                },
                execute=self.edit,
                render=lambda _a, v: (
                    f"Edited {v['path']} ({v['replacements']} replacement{'' if v['replacements'] == 1 else 's'})"
                ),
                is_concurrency_safe=False,
                examples=[{"path": "notes.txt", "old_string": "hello", "new_string": "goodbye"}],
                annotations=MUTATING,
            ),
            define_tool(
                name="read",
                description=(
                    "Read a text file of the workspace with line numbers. offset is the first line "
                    f"(1-based), limit the number of lines (default {DEFAULT_READ_LIMIT}). Long "
                    "output is truncated; continue with the offset given in the notice."
                ),
                parameters={
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "file path relative to the workspace root"},
                        "offset": {"type": "integer", "minimum": 1, "description": "first line, 1-based"},
                        "limit": {"type": "integer", "minimum": 1, "description": "number of lines"},
                    },
                    "required": ["path"],
                    "additionalProperties": False,
                },
                output_schema={
                    "type": "object",
                    "properties": {
                        "path": {"type": "string"},
                        "content": {"type": "string"},
                        "start_line": {"type": "integer"},
                        "end_line": {"type": "integer"},
                        "next_offset": {"type": ["integer", "null"]},
                        "truncated": {"type": "boolean"},
                        "not_utf8_lines": {
                            "type": "array",
                            "items": {"type": "integer"},
                            "description": "shown lines holding bytes that are not UTF-8 "
                            "(shown as U+FFFD; edit refuses such a file)",
                        },
                    },
                    "required": [
                        "path",
                        "content",
                        "start_line",
                        "end_line",
                        "next_offset",
                        "truncated",
                        "not_utf8_lines",
                    ],
                },
                execute=self.read,
                render=_render_read,
                is_concurrency_safe=True,
                examples=[{"path": "notes.txt"}, {"path": "notes.txt", "offset": 2, "limit": 1}],
                annotations=READ_ONLY,
            ),
            define_tool(
                name="list",
                description="List the entries of a workspace directory (default: the workspace root).",
                parameters={
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "directory relative to the workspace root"}
                    },
                    "additionalProperties": False,
                },
                output_schema={
                    "type": "object",
                    "properties": {
                        "path": {"type": "string"},
                        "entries": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "name": {"type": "string"},
                                    "type": {"enum": ["file", "dir", "symlink", "other"]},
                                    "size": {"type": ["integer", "null"]},
                                },
                                "required": ["name", "type", "size"],
                            },
                        },
                        "truncated": {"type": "boolean"},
                        "withheld": {"type": "integer", "description": "entries the path guard withheld"},
                    },
                    "required": ["path", "entries", "truncated", "withheld"],
                },
                execute=self.list,
                render=_render_list,
                is_concurrency_safe=True,
                examples=[{}, {"path": "."}],
                annotations=READ_ONLY,
            ),
            define_tool(
                name="search",
                description=(
                    "Search text files of the workspace for a regular expression (Python syntax), "
                    "line by line. Returns matching lines as path:line: text, at most "
                    f"{self.max_search_results}; binary and very large files are skipped, and a line is "
                    f"searched in its first {LINE_SEARCH_CHARS} characters only (as if it ended there)."
                ),
                parameters={
                    "type": "object",
                    "properties": {
                        "pattern": {"type": "string", "minLength": 1, "description": "a regular expression"},
                        "path": {
                            "type": "string",
                            "description": "directory or file to search (default: the workspace root)",
                        },
                    },
                    "required": ["pattern"],
                    "additionalProperties": False,
                },
                output_schema={
                    "type": "object",
                    "properties": {
                        "matches": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "path": {"type": "string"},
                                    "line": {"type": "integer"},
                                    "text": {"type": "string"},
                                },
                                "required": ["path", "line", "text"],
                            },
                        },
                        "files_searched": {"type": "integer"},
                        "files_skipped": {"type": "integer"},
                        "withheld": {
                            "type": "integer",
                            "description": "files and directories the path guard withheld (not searched)",
                        },
                        "truncated": {"type": "boolean"},
                        "note": {"type": ["string", "null"]},
                    },
                    "required": ["matches", "files_searched", "files_skipped", "withheld", "truncated", "note"],
                },
                execute=self.search,
                render=_render_search,
                is_concurrency_safe=True,
                examples=[{"pattern": "good(bye)?"}, {"pattern": "line$", "path": "."}],
                annotations=READ_ONLY,
            ),
        ]

    # -- bodies -------------------------------------------------------------------------------------------

    def _open_parent(
        self, real: str, given: str, *, create: bool = False, made: list[tuple[int, str]] | None = None
    ) -> int:
        """:meth:`Workspace.open_dir` of the directory holding ``real``, its failures as :class:`ToolError`."""
        try:
            return self.workspace.open_dir(os.path.dirname(real), given, create=create, made=made)
        except FileNotFoundError:
            raise ToolError(f"file not found: {given!r} (use list to see what exists)") from None
        except NotADirectoryError:
            raise ToolError(
                f"cannot {'create' if create else 'access'} {given!r}: a parent path is not a directory"
            ) from None
        except OSError as error:
            raise ToolError(f"cannot access {given!r}: {error.strerror}") from None

    def _open_regular(self, real: str, given: str) -> tuple[int, os.stat_result]:
        """A read descriptor and the stat of the regular file ``real``, reached without following symlinks."""
        if real == self.workspace.root:
            raise ToolError(f"{given!r} is a directory, not a file (use list to see its entries)")
        parent = self._open_parent(real, given)
        name = os.path.basename(real)
        try:
            try:
                info = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                raise ToolError(f"file not found: {given!r} (use list to see what exists)") from None
            except OSError as error:
                raise ToolError(f"cannot access {given!r}: {error.strerror}") from None
            if stat.S_ISDIR(info.st_mode):
                raise ToolError(f"{given!r} is a directory, not a file (use list to see its entries)")
            if not stat.S_ISREG(info.st_mode):
                raise ToolError(f"{given!r} is not a regular file")
            try:
                # O_NONBLOCK: a FIFO swapped in after the check cannot block the open.
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
            except OSError as error:
                raise ToolError(f"cannot open {given!r}: {error.strerror}") from None
        finally:
            os.close(parent)
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            os.close(fd)
            raise ToolError(f"{given!r} changed while it was being opened; try again")
        return fd, opened

    def _read_text(self, real: str, given: str) -> tuple[os.stat_result, str]:
        """The stat and whole text of a file for edit, refusing binary and oversized files."""
        fd, info = self._open_regular(real, given)
        with open(fd, "rb") as handle:
            if info.st_size > self.max_file_bytes:
                raise ToolError(
                    f"{given!r} is {_format_size(info.st_size)}, larger than the "
                    f"{_format_size(self.max_file_bytes)} limit for editing; rewrite it with smaller "
                    "files or change it with bash"
                )
            data = handle.read(self.max_file_bytes + 1)
        if len(data) > self.max_file_bytes:
            raise ToolError(
                f"{given!r} grew past the {_format_size(self.max_file_bytes)} limit for editing while it was read"
            )
        if _looks_binary(data[:SNIFF_BYTES]):
            raise ToolError(f"{given!r} is a binary file ({_format_size(len(data))}); only text files can be edited")
        try:
            return info, data.decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError(f"{given!r} is not valid UTF-8 text; only UTF-8 text files can be edited") from None

    async def read(self, args: Any, ctx: ToolContext) -> Any:
        """Body of ``read``: a line range, numbered, bounded by ``max_read_bytes`` (file work in a thread)."""
        given: str = args["path"]
        real = self.workspace.resolve(given)
        offset = int(args.get("offset", 1))  # JSON Schema's integer admits 2.0: the numbers read reports are ints
        limit = int(args.get("limit", DEFAULT_READ_LIMIT))
        result = await _in_thread(ctx, lambda stop: self._read_lines(real, given, offset, limit, stop))
        ctx.signal.raise_if_aborted()
        return result

    def _read_lines(self, real: str, given: str, offset: int, limit: int, stop: threading.Event) -> dict[str, Any]:
        fd, info = self._open_regular(real, given)
        if info.st_size > self.max_read_file_bytes:
            os.close(fd)
            raise ToolError(
                f"{given!r} is {_format_size(info.st_size)}, larger than the "
                f"{_format_size(self.max_read_file_bytes)} limit for read; look at parts of it with "
                "bash (head, tail, sed -n) or search"
            )
        lines: list[str] = []
        used = 0
        truncated = False
        next_offset: int | None = None
        number = 0
        not_utf8: list[int] = []
        with open(fd, "rb") as handle:
            if _looks_binary(handle.read(SNIFF_BYTES)):
                raise ToolError(
                    f"{given!r} is a binary file ({_format_size(info.st_size)}); read only shows text files"
                )
            end = b"\r" if _ends_lines_with_cr(handle, stop) else b"\n"
            handle.seek(0)
            while not stop.is_set():
                # At most MAX_LINE_BYTES of a line are held; the rest of a longer line is skipped in chunks.
                raw = _read_line(handle, MAX_LINE_BYTES, end)
                if not raw:
                    break
                number += 1
                cut = len(raw) == MAX_LINE_BYTES and not raw.endswith(end)
                if cut:
                    rest = raw
                    while rest and not rest.endswith(end) and not stop.is_set():
                        rest = _read_line(handle, SKIP_CHUNK_BYTES, end)
                if number < offset:
                    continue
                if number >= offset + limit:
                    next_offset = number
                    break
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    # A character cut by MAX_LINE_BYTES is not the file's fault; any other bad byte is.
                    if not cut or error.start < len(raw) - 3:
                        not_utf8.append(number)
                    text = raw.decode("utf-8", errors="replace")
                text = text.rstrip("\r\n")
                if cut or len(text) > MAX_LINE_CHARS:
                    text = text[:MAX_LINE_CHARS] + f" [... line cut at {MAX_LINE_CHARS} characters]"
                entry = f"{number:>6}\t{text}"
                used += len(entry.encode("utf-8")) + 1
                if used > self.max_read_bytes and lines:
                    truncated, next_offset = True, number
                    break
                if used > self.max_read_bytes:  # the first line alone is too long: cut it to fit
                    room = self.max_read_bytes - len(READ_CUT_NOTE)
                    entry = entry.encode("utf-8")[:room].decode("utf-8", errors="ignore") + READ_CUT_NOTE
                    lines.append(entry)
                    # Read cannot show the rest of this line: go on after it, if anything follows.
                    truncated, next_offset = True, (number + 1 if handle.peek(1) else None)
                    break
                lines.append(entry)
        if number < offset and offset > 1 and not stop.is_set():
            raise ToolError(f"offset {offset} is past the end of {given!r}, which has {number} lines")
        start = offset if lines else 0
        return {
            "path": self.workspace.relative(real),
            "content": "\n".join(lines),
            "start_line": start,
            "end_line": start + len(lines) - 1 if lines else 0,
            "next_offset": next_offset,
            "truncated": truncated,
            # Only lines shown: one cut off by the read limit is not.
            "not_utf8_lines": [line for line in not_utf8 if line < start + len(lines)],
        }

    def _refuse_protected(self, real: str, given: str, verb: str) -> None:
        """Refuse to change a file in a protected directory (``.git``), wherever ``given``'s links lead."""
        # A backslash separates names on NTFS (git's is_ntfs_dotgit ends a name there too).
        for part in re.split(r"[/\\]", self.workspace.relative(real)):
            name = self.protected_dirs.get(_protected_key(part))
            if name is not None:
                where = (
                    ""
                    if self.workspace.relative(real) == given.strip("/")
                    else (f" (it resolves to {self.workspace.relative(real)!r})")
                )
                raise ToolError(
                    f"{verb} refused: {given!r}{where} is in {name!r}, which the workspace protects: "
                    "git runs what it holds (hooks, config); change git state with git itself, or "
                    f"remove {name!r} from protected_dirs in the workspace config"
                )
        if ".git" in self.protected_dirs:
            repository = self._repository_around(real)
            if repository is not None:
                raise ToolError(
                    f"{verb} refused: {given!r} is in {repository!r}, which git takes for a repository "
                    "(it holds HEAD, and objects/ and refs/ or commondir, or would with this file): "
                    "git runs what a repository holds (hooks, config) when used in that directory; "
                    "change git state with git itself, or remove '.git' from protected_dirs in the "
                    "workspace config"
                )
            git = protected_git_paths(self.workspace.root, real)
            target = [_protected_key(part) for part in self.workspace.relative(real).split("/")]
            hooks = self._hooks_directory_holding(target, git)
            if hooks is not None:
                directory, config = hooks
                raise ToolError(
                    f"{verb} refused: {given!r} is in {directory!r}, the hooks directory that "
                    f"core.hooksPath names in {self._shown(config)}: git runs the hooks there (at the "
                    "next commit, merge, checkout or push); change them outside dsh, or remove '.git' "
                    "from protected_dirs in the workspace config"
                )
            if git.unknown is not None:
                raise self._unknown_hooks(verb, *git.unknown)
            for named, includer in git.config_files:
                if (
                    _under(named, self.workspace.root)
                    and named != self.workspace.root
                    and target == [_protected_key(part) for part in self.workspace.relative(named).split("/")]
                ):
                    how = (
                        "git reads it in every repository"
                        if includer is None
                        else (f"included by {self._shown(includer)}")
                    )
                    raise ToolError(
                        f"{verb} refused: {given!r} is a git config file ({how}): git runs the "
                        "commands a config names (core.fsmonitor, core.hooksPath, core.sshCommand, "
                        "aliases) as it runs hooks; change it outside dsh, or remove '.git' from "
                        "protected_dirs in the workspace config"
                    )

    def _shown(self, path: str) -> str:
        """``path`` as a message shows it: from the root if it lies inside, else absolute."""
        real = os.path.realpath(path)
        return self.workspace.relative(real) if _under(real, self.workspace.root) else path

    def _hooks_directory_holding(self, target: list[str], git: GitProtection) -> tuple[str, str] | None:
        """The first of ``git``'s hooks directories in the workspace that holds the path whose names (as
        :func:`_protected_key` reads them) are ``target``, shown from the root, and the config file naming it;
        ``None`` if there is none. A file written there is a command git runs at the next commit."""
        for hooks, source in git.hooks_directories:
            if not _under(hooks, self.workspace.root):
                continue
            inside = [] if hooks == self.workspace.root else self.workspace.relative(hooks).split("/")
            if len(target) > len(inside) and target[: len(inside)] == [_protected_key(part) for part in inside]:
                return self.workspace.relative(hooks), source
        return None

    def _unknown_hooks(self, verb: str, config: str | None, problem: str) -> ToolError:
        """The refusal of a write when the git config file ``config`` (``None``: unknown, as an ``EIO`` from
        read leaves it) has ``problem``: it might set core.hooksPath, and guessing could miss it."""
        shown = "a git config" if config is None else self._shown(config)
        return ToolError(
            f"{verb} refused: cannot tell where git looks for hooks: {shown} {problem} and might set "
            "core.hooksPath; fix it, or remove '.git' from protected_dirs in the workspace config"
        )

    def _repository_around(self, real: str) -> str | None:
        """The directory holding ``real`` (or one above it, up to the root) that git would take for a git
        directory once ``real`` is written (shown relative to the root), or ``None``.

        A repository need not be called ``.git``: git run in (or under) a directory holding ``HEAD`` and
        ``objects/`` and ``refs/`` (or a ``commondir`` file naming where they are) uses it as a bare one, and
        runs its config's ``core.pager``, ``core.fsmonitor`` and hooks. Written one file at a time, such a
        directory is refused when the write would complete it (whatever ``HEAD`` holds), and every file in
        one is refused as in ``.git``.
        """
        relative = self.workspace.relative(real).split("/")
        for depth in range(len(relative) - 1, -1, -1):
            directory = os.path.join(self.workspace.root, *relative[:depth])
            below = [_protected_key(part) for part in relative[depth:]]  # what the write adds, from this directory
            if _holds(directory, below, "HEAD", False) and (
                _holds(directory, below, "commondir", False)
                or (_holds(directory, below, "objects", True) and _holds(directory, below, "refs", True))
            ):
                return self.workspace.relative(directory)
        return None

    async def write(self, args: Any, ctx: ToolContext) -> Any:
        """Body of ``write``: create or replace one text file inside the workspace."""
        given: str = args["path"]
        content: str = args["content"]
        data = _utf8(content, "content")
        if len(data) > self.max_file_bytes:
            raise ToolError(
                f"content is {_format_size(len(data))}, larger than the {_format_size(self.max_file_bytes)} write limit"
            )
        if given.endswith(("/", "/.", "/..")):
            raise ToolError(f"{given!r} names a directory; give a file path")
        real = self.workspace.resolve(given)
        _refuse_temporary_name(real, given, "write")
        self._refuse_protected(real, given, "write")
        if real == self.workspace.root or os.path.isdir(real):
            raise ToolError(f"{given!r} is a directory; give a file path")
        made: list[tuple[int, str]] = []  # where directories on the way were made: synced with the file
        try:
            parent = self._open_parent(real, given, create=True, made=made)
            name = os.path.basename(real)
            try:
                try:
                    info: os.stat_result | None = os.stat(name, dir_fd=parent, follow_symlinks=False)
                except FileNotFoundError:
                    info = None
                except OSError as error:
                    raise ToolError(f"cannot write {given!r}: {error.strerror}") from None
                if info is not None and stat.S_ISDIR(info.st_mode):
                    raise ToolError(f"{given!r} is a directory; give a file path")
                if info is not None and not stat.S_ISREG(info.st_mode):
                    # A FIFO would block the open (and the event loop) until a reader comes; a device is no file.
                    raise ToolError(f"{given!r} is not a regular file; write only replaces regular files")
                ctx.signal.raise_if_aborted()
                # In a thread: its syncs wait on the disk, which may take seconds, and the event loop serves
                # other calls meanwhile. Never stopped part-way (one bounded file): an abort waits for it, and
                # the file is replaced or left as it was, never half.
                await _in_thread(ctx, lambda _stop: self._replace(parent, real, given, data, info, made=made))
            finally:
                os.close(parent)
        finally:
            for directory, _ in made:
                os.close(directory)
        return {"path": self.workspace.relative(real), "bytes": len(data), "created": info is None}

    def _replace(
        self,
        parent: int,
        real: str,
        given: str,
        data: bytes,
        info: os.stat_result | None,
        before_rename: Callable[[], None] | None = None,
        made: Sequence[tuple[int, str]] = (),
    ) -> None:
        """Put ``data`` at ``real`` (``parent`` is its directory) atomically: a new file beside it, renamed
        over it (``info``: the stat of the file it replaces).

        Never written in place: a failed write (disk full) leaves the old content whole. The new file is
        synced to disk before the rename, and its directory after it, so a crash or power loss finds the
        old content or the new, never an empty or partial file (:func:`_sync_directory`); so is each
        directory a directory on its way was ``made`` in (descriptors, with the path made, as
        :meth:`Workspace.open_dir` gives them), whose new entry is on disk only once that directory is.
        Blocking on the disk: run it in a thread (:func:`_in_thread`). A file with
        several names (hard links) is refused, before anything is written and again just before the
        rename (a link made meanwhile): see :func:`_refuse_hard_link`. The new file is locked until it
        is renamed or removed, so a sweep never takes it for a dead writer's; a write to a
        directory not swept within :data:`SWEEP_INTERVAL_S` sweeps it (:meth:`_sweep_if_due`).
        """
        name = os.path.basename(real)
        if info is not None:
            _refuse_hard_link(info, given)
        if info is not None and not os.access(name, os.W_OK, dir_fd=parent):
            raise ToolError(f"cannot write {given!r}: Permission denied")
        with contextlib.suppress(OSError):  # housekeeping: never the reason a write fails
            self._sweep_if_due(parent)
        try:
            temporary, fd = _create_temporary(parent)
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                # The file itself may be writable: what is refused is a new file beside it.
                # The directory the new file goes in: the resolved one (``given`` may be a symlink
                # to a file elsewhere), shown as ``given`` is written (absolute, or from the root).
                folder = os.path.dirname(real)
                if not os.path.isabs(given):
                    folder = self.workspace.relative(folder)
                raise ToolError(
                    f"cannot write {given!r}: its directory {folder!r} does not take new files "
                    f"({error.strerror}); write and edit replace a file through a new one beside "
                    "it, so they need that directory writable"
                ) from None
            raise ToolError(f"cannot write {given!r}: {error.strerror}") from None
        renamed = False
        closing: OSError | None = None  # the failure of the close after the rename: the file is in place
        try:
            # Open (and so locked) until the rename is done: closed before it, the file could be swept.
            with os.fdopen(fd, "wb") as handle:
                if info is not None:
                    # Owner first: a chown clears S_ISUID and S_ISGID, which the fchmod then restores.
                    # Compared with the new file's, not dsh's ids: in a setgid directory it took the
                    # directory's group, which could give a 0640 file's content to that group.
                    created = os.fstat(fd)
                    if (info.st_uid, info.st_gid) != (created.st_uid, created.st_gid):
                        try:
                            os.fchown(fd, info.st_uid, info.st_gid)
                        except OSError:  # not ours to give away: keep at least the group (if we are in it)
                            with contextlib.suppress(OSError):
                                os.fchown(fd, -1, info.st_gid)
                    mode, now = stat.S_IMODE(info.st_mode), os.fstat(fd)
                    # A set-ID bit names the owner (group) it runs as: where that could not be kept, the
                    # bit would make the model's program run as dsh's user (group) for whoever starts it.
                    if now.st_uid != info.st_uid:
                        mode &= ~stat.S_ISUID
                    if now.st_gid != info.st_gid:
                        mode &= ~stat.S_ISGID
                    os.fchmod(fd, mode)
                    self._copy_xattrs(parent, name, fd, given)
                handle.write(data)
                handle.flush()  # all of it in the file before its name is
                # On the disk before the rename: else the rename may reach it first, and a power loss
                # leave an empty (or partial) file where the old one was.
                try:
                    os.fsync(fd)
                except OSError as error:
                    if error.errno not in _NO_SYNC:
                        raise
                # From the check to the rename, no other call of this instance replaces this name: a second
                # edit's check then sees the first edit (see _name_lock).
                with self._name_lock(parent, name):
                    if before_rename is not None:
                        before_rename()  # the last moment to refuse: nothing has replaced the file yet
                    with contextlib.suppress(FileNotFoundError):
                        _refuse_hard_link(os.stat(name, dir_fd=parent, follow_symlinks=False), given)
                    try:
                        os.replace(temporary, name, src_dir_fd=parent, dst_dir_fd=parent)
                    except OSError as error:
                        if error.errno not in (errno.EBUSY, errno.EXDEV):
                            raise
                        # Not written in place instead: that would give up all-or-nothing (a full disk leaves
                        # the file cut short) and write through to the mount's source, which may lie outside the
                        # workspace.
                        raise ToolError(
                            f"cannot write {given!r}: it cannot be replaced ({error.strerror}): it is "
                            "likely a mount point (a file bind-mounted into the workspace, as containers "
                            "do with config files), and write and edit replace a file by renaming a new "
                            "one over it; nothing was changed: change it in place with bash if that is "
                            "meant"
                        ) from None
                    renamed = True
        except BaseException as error:
            if renamed:  # only the close failed (the with's exit), after the rename put the file in place
                if not isinstance(error, OSError):
                    raise
                closing = error
            else:  # nothing replaced: the new file goes, whatever stopped it
                with contextlib.suppress(OSError):
                    os.unlink(temporary, dir_fd=parent)
                if isinstance(error, OSError):
                    raise ToolError(f"cannot write {given!r}: {error.strerror}") from None
                raise
        _sync_directory(parent, given)
        for directory, shown in made:
            _sync_directory(directory, given, f"the directory holding {shown!r} (made for it)")
        if closing is not None:
            raise _not_durable(given, f"closing it failed ({closing.strerror})")

    @staticmethod
    def _copy_xattrs(parent: int, name: str, fd: int, given: str) -> None:
        """Give the new file (``fd``) the extended attributes of the one it replaces, its ACL among them.

        An access ACL is an extended attribute: dropped, it would silently change who may read
        and write the file, so failing to copy it fails the write. Others (a ``user.*`` tag, a
        security label the kernel gives the new file anyway) are copied where the kernel lets us,
        except those of :data:`_CONTENT_XATTRS`, which a write in place would not keep either. A file
        without an access ACL stays without one, whatever default ACL its directory gives new files.
        """
        old = WorkspaceTools._old_xattrs(parent, name, given)
        if old is None:
            return  # none on this filesystem, or the file is gone: nothing to keep
        for attribute, value in old.items():
            try:
                os.setxattr(fd, attribute, value)
            except OSError as error:
                if attribute in _ACL_XATTRS:
                    raise ToolError(
                        f"cannot write {given!r}: its access control list could not be kept on "
                        f"the replacement ({error.strerror}); nothing was replaced"
                    ) from None
        if "system.posix_acl_access" not in old:
            # Created in the directory, the new file inherited its default ACL (if it has one): the
            # file it replaces had none, so nobody the mode bits leave out may use the new one either.
            try:
                os.removexattr(fd, "system.posix_acl_access")
            except OSError as error:
                if error.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise ToolError(
                        f"cannot write {given!r}: the replacement took its directory's default "
                        f"access control list, which could not be removed ({error.strerror}); "
                        "nothing was replaced"
                    ) from None

    @staticmethod
    def _old_xattrs(parent: int, name: str, given: str) -> dict[str, bytes] | None:
        """The extended attributes of ``name`` in ``parent`` worth keeping (ACL first in importance).

        ``None`` where there are none to keep: the filesystem has no extended attributes, or the
        file is gone. An attribute that cannot be read is left out, but an ACL refuses the write.
        """
        # By the directory's descriptor and the name, never following a link at the end; a path,
        # not a descriptor of the file, so a file dsh may write but not read keeps its ACL too.
        source: str | int = f"/proc/self/fd/{parent}/{name}"
        opened: int | None = None
        try:
            try:
                names = os.listxattr(source, follow_symlinks=False)
            except OSError as error:
                if error.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                    return None
                # No /proc (a chroot, a sandbox), or the file is gone: read them by a descriptor of it
                # (an ACL is not dropped for want of /proc: a file dsh cannot read is refused instead).
                try:
                    opened = source = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
                    names = os.listxattr(opened)
                except FileNotFoundError:
                    return None
                except OSError as error:
                    if error.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                        return None
                    raise ToolError(
                        f"cannot write {given!r}: its extended attributes (its access control list "
                        f"among them) could not be read ({error.strerror}); nothing was "
                        "replaced"
                    ) from None
            values: dict[str, bytes] = {}
            for attribute in names:
                if attribute in _CONTENT_XATTRS:
                    continue
                try:
                    values[attribute] = (
                        os.getxattr(source, attribute)
                        if isinstance(source, int)
                        else os.getxattr(source, attribute, follow_symlinks=False)
                    )
                except OSError as error:
                    if attribute in _ACL_XATTRS:
                        raise ToolError(
                            f"cannot write {given!r}: its access control list could not be kept on "
                            f"the replacement ({error.strerror}); nothing was replaced"
                        ) from None
            return values
        finally:
            if opened is not None:
                os.close(opened)

    async def edit(self, args: Any, ctx: ToolContext) -> Any:
        """Body of ``edit``: exact replacement that fails on zero or (without replace_all) several matches."""
        given: str = args["path"]
        old: str = args["old_string"]
        new: str = args["new_string"]
        replace_all: bool = args.get("replace_all", False)
        if not old:
            raise ToolError("old_string must not be empty (use write to create or replace a whole file)")
        if old == new:
            raise ToolError("old_string and new_string are identical; nothing would change")
        _utf8(new, "new_string")
        real = self.workspace.resolve(given)
        _refuse_temporary_name(real, given, "edit")
        self._refuse_protected(real, given, "edit")
        # In a thread: reading up to max_file_bytes and mapping the lines of a CRLF file (a Python step per break)
        # takes seconds for a large file (about 3 s for 10 MiB of short lines), which the event loop would wait.
        info, text, data, replacements = await _in_thread(
            ctx, lambda _stop: self._edited(real, given, old, new, replace_all)
        )
        ctx.signal.raise_if_aborted()
        original = text.encode("utf-8")
        parent = self._open_parent(real, given)
        try:
            await _in_thread(
                ctx,
                lambda _stop: self._replace(  # in a thread, as write's (see there)
                    parent,
                    real,
                    given,
                    data,
                    info,
                    before_rename=lambda: self._check_unchanged(real, given, info, original),
                ),
            )
        finally:
            os.close(parent)
        return {"path": self.workspace.relative(real), "replacements": replacements}

    def _edited(
        self, real: str, given: str, old: str, new: str, replace_all: bool
    ) -> tuple[os.stat_result, str, bytes, int]:
        """The file ``real``'s stat and text as read, its edited content and the number of replacements; the
        edit's refusals (not found, not unique, no change, too large) as :class:`ToolError`. Blocking on the
        file and linear in its size: run it in a thread (:func:`_in_thread`)."""
        info, text = self._read_text(real, given)
        # Lines copied from read end in LF alone, whatever ending (CRLF, LF) each has in the file: in a file
        # holding a CR, old_string is found in the text as read shows it, its own CRs before an LF left out too.
        # A classic Mac file, whose lines end at CR: decided by the rule read and search follow, so all three
        # count the same lines.
        cr_file = _search_worker.ends_lines_with_cr(text)
        lines = _LineView(text) if "\r" in text and not cr_file else None
        if cr_file:
            # Offset for offset the text with its CRs as LFs: old_string's breaks (LF, CRLF or CR) are found
            # there, and the result's LFs, new_string's among them, become the file's CRs again.
            haystack, needle = text.replace("\r", "\n"), _ANY_BREAK.sub("\n", old)
        else:
            haystack, needle = (lines.view, _LINE_BREAK.sub("\n", old)) if lines is not None else (text, old)
        count = haystack.count(needle)
        if count == 0:
            raise ToolError(
                f"old_string was not found in {given!r}; read the file and copy the text exactly, "
                "including whitespace and indentation"
            )
        if not replace_all and (count > 1 or haystack.find(needle, haystack.find(needle) + 1) != -1):
            where = f"{count} times in {given!r}" if count > 1 else f"more than once in {given!r} (overlapping)"
            raise ToolError(
                f"old_string occurs {where}; include more surrounding text to "
                "make it unique, or pass replace_all=true to replace every occurrence"
            )
        if lines is not None:
            pieces: list[str] = []
            last = found = 0
            for _ in range(count if replace_all else 1):
                found = haystack.find(needle, found)
                start, end = lines.span(found, found + len(needle))
                pieces += [text[last:start], _ended_as_matched(new, text, start, end)]
                last, found = end, found + len(needle)
            updated = "".join([*pieces, text[last:]])
        elif cr_file:
            replacement = _ANY_BREAK.sub("\n", new)
            updated = (
                haystack.replace(needle, replacement) if replace_all else haystack.replace(needle, replacement, 1)
            ).replace("\n", "\r")
        else:
            updated = text.replace(old, new) if replace_all else text.replace(old, new, 1)
        if updated == text:  # new_string differs from old_string in the CRs before its LFs alone
            raise ToolError(
                f"this edit would not change {given!r}: edit keeps each line's ending (LF, CRLF or CR) as "
                "the file has it, so old_string and new_string differing in line endings only change "
                "nothing; to change line endings, write the whole file"
            )
        data = updated.encode("utf-8")
        if len(data) > self.max_file_bytes:
            raise ToolError(
                f"the edited file would be {_format_size(len(data))}, larger than the "
                f"{_format_size(self.max_file_bytes)} limit"
            )
        return info, text, data, count if replace_all else 1

    def _check_unchanged(self, real: str, given: str, info: os.stat_result, original: bytes) -> None:
        """Refuse to replace a file that another program changed since the edit read it.

        The edit's new content is the old content it read plus the replacement: written over a
        newer version (an editor's save, a concurrent shell command), it would silently undo
        that change. Compared by content, not by timestamps, whose granularity can hide two
        writes in one tick; what is left is the moment between this read and the rename. The mode
        and owner too: the replacement is given those the edit read, so a ``chmod +x`` (or a
        ``chown``) made meanwhile, the content left alone, would be undone as silently.
        """
        fd, now = self._open_regular(real, given)
        with open(fd, "rb") as handle:
            current = handle.read(len(original) + 1)
        if (now.st_dev, now.st_ino, now.st_mode, now.st_uid, now.st_gid) != (
            info.st_dev,
            info.st_ino,
            info.st_mode,
            info.st_uid,
            info.st_gid,
        ) or current != original:
            raise ToolError(
                f"{given!r} changed while it was being edited (another program wrote it, or changed "
                "its mode or owner); nothing was replaced: read it again and redo the edit"
            )

    async def list(self, args: Any, ctx: ToolContext) -> Any:
        """Body of ``list``: one directory's entries, sorted, symlinks shown but not followed."""
        given: str = args.get("path", ".")
        real = self.workspace.resolve(given)
        try:
            fd = self.workspace.open_dir(real, given, readable=True)
        except FileNotFoundError:
            raise ToolError(f"directory not found: {given!r}") from None
        except NotADirectoryError:
            if not os.path.lexists(real):  # a parent is the file, not the path itself
                raise ToolError(f"directory not found: {given!r} (a parent path is not a directory)") from None
            raise ToolError(f"{given!r} is a file, not a directory (use read to see its content)") from None
        except OSError as error:
            raise ToolError(f"cannot list {given!r}: {error.strerror}") from None
        rules = self.path_rules(ctx.execution.agent)
        try:
            entries, truncated, withheld = await _in_thread(ctx, lambda stop: self._list_entries(fd, stop, real, rules))
        finally:
            os.close(fd)
        ctx.signal.raise_if_aborted()
        return {"path": self.workspace.relative(real), "entries": entries, "truncated": truncated, "withheld": withheld}

    def path_rules(self, agent: Scope | None = None) -> tuple[PathRules, ...]:
        """The path rules the guards rows publish now for a call of ``agent`` (none without a guards row with
        path rules that judges its calls).

        ``list`` and ``search`` reach paths no call names, which the path guard therefore never judged:
        they withhold every entry one of these rules denies, judged by the guard's own code
        (:class:`~dsh_plugins._path_rules.PathRules`), so what the guard would deny if a call named it is
        neither shown nor read.
        """
        published = None if self.scope is None else self.scope.lookup(PATH_RULES_SERVICE)
        return () if published is None else tuple(rules for rules in published.snapshot(agent) if rules.active)

    def _list_entries(
        self, fd: int, stop: threading.Event, real: str, rules: Sequence[PathRules] = ()
    ) -> tuple[_Entries, bool, int]:
        """The entries of the directory ``fd`` (the real directory ``real``), sorted and at most
        ``max_list_entries``; whether there were more; how many ``rules`` withheld. A symlink is judged as
        a call naming it would be (where it leads too), any other entry by its own path (which is real).
        A writer's temporary file is left out by its name alone, as search leaves it out
        (:data:`~dsh_plugins._search_worker.TEMPORARY`), counted nowhere: list removes nothing (see
        :meth:`_sweep_if_due`), and a probe of its lock could make a writer that has just created it start over."""
        entries: list[dict[str, Any]] = []
        scanned = withheld = 0

        def denied(item: os.DirEntry[str]) -> bool:
            path = os.path.join(real, item.name)
            return any((r.judge_link(path) if item.is_symlink() else r.judge_found(path)) is not None for r in rules)

        def until_stopped(scan: Iterator[os.DirEntry[str]]) -> Iterator[os.DirEntry[str]]:
            nonlocal scanned, withheld
            for item in scan:
                if stop.is_set():
                    return
                if _TEMPORARY.fullmatch(item.name) and not item.is_dir(follow_symlinks=False):
                    continue  # a dead writer's leftover or a live one's half-written copy: no file of the workspace
                if rules and denied(item):
                    withheld += 1
                    continue
                scanned += 1
                yield item

        with os.scandir(fd) as scan:
            # Only the entries shown (and one more) are held, not the whole directory: one of millions
            # of files (a cache) would take gigabytes to be sorted for its first max_list_entries.
            items = heapq.nsmallest(self.max_list_entries + 1, until_stopped(scan), key=lambda e: e.name)
        if stop.is_set():
            return entries, True, withheld
        truncated = scanned > len(items)  # entries beyond those held exist, whatever the loop below skips
        for item in items:
            if len(entries) >= self.max_list_entries or stop.is_set():
                truncated = True
                break
            kind, size = "other", None
            if item.is_symlink():
                kind = "symlink"
            elif item.is_dir(follow_symlinks=False):
                kind = "dir"
            elif item.is_file(follow_symlinks=False):
                kind = "file"
                try:
                    size = item.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue  # removed since the directory was read (a build's temporary file)
            entries.append({"name": item.name, "type": kind, "size": size})
        return entries, truncated, withheld

    def _search_request(self, pattern: str, given: str, rules: Sequence[PathRules] = ()) -> dict[str, Any]:
        """The worker's request for searching ``given``, with ``fd``: the start directory or file, opened
        here (the caller closes it) from the root without following symlinks, so a directory swapped
        for a symlink after :meth:`Workspace.resolve` is refused rather than searched. ``rules`` (the
        guards' :meth:`path_rules`) go with it: the worker judges each file before it opens it."""
        real = self.workspace.resolve(given)
        try:
            fd = self.workspace.open_dir(real, given, readable=True)
            kind = "dir"
        except FileNotFoundError:
            raise ToolError(f"path not found: {given!r}") from None
        except NotADirectoryError:
            if not os.path.lexists(real):  # a parent is the file, not the path itself
                raise ToolError(f"path not found: {given!r} (a parent path is not a directory)") from None
            fd, _ = self._open_regular(real, given)
            kind = "file"
        except OSError as error:
            raise ToolError(f"cannot search {given!r}: {error.strerror}") from None
        return {
            "pattern": pattern,
            "fd": fd,
            "kind": kind,
            "prefix": self.workspace.relative(real),
            "timeout_s": self.search_timeout_s,
            "max_results": self.max_search_results,
            "max_file_bytes": self.max_search_file_bytes,
            "exclude": sorted(self.search_exclude),
            "base": self.workspace.root,
            "rules": [row.to_wire() for row in rules],
        }

    async def search(self, args: Any, ctx: ToolContext) -> Any:
        """Body of ``search``: a regex over text files, in a child process killed on abort, timeout or cancel.

        A thread would not do: ``re`` holds the GIL while it backtracks, so a pathological
        pattern would stall the event loop and could not be stopped.
        """
        try:
            re.compile(args["pattern"])
        except re.error as error:
            raise ToolError(f"invalid regular expression {args['pattern']!r}: {error}") from None
        request = self._search_request(args["pattern"], args.get("path", "."), self.path_rules(ctx.execution.agent))
        try:
            ctx.signal.raise_if_aborted()
            try:
                process = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-I",
                    "-S",
                    _search_worker.__file__,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    pass_fds=(request["fd"],),
                    limit=SEARCH_EVENT_BYTES,
                )
            except OSError as error:
                raise ToolError(f"cannot start the search worker: {error.strerror or error}") from None
        finally:
            os.close(request["fd"])  # the worker has its own copy
        result: dict[str, Any] = {
            "matches": [],
            "files_searched": 0,
            "files_skipped": 0,
            "withheld": 0,
            "truncated": True,
            "note": None,
        }
        aborted = asyncio.ensure_future(ctx.signal.wait())
        collect = asyncio.ensure_future(self._collect(process, request, result))
        errors = asyncio.ensure_future(_tail(process.stderr))
        try:
            done, _ = await asyncio.wait(
                {collect, aborted},
                timeout=self.search_timeout_s + SEARCH_KILL_GRACE_S,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if collect in done:
                collect.result()
            elif aborted not in done:
                result["note"] = (
                    f"search stopped after {self.search_timeout_s:g} s; narrow it with path or simplify the pattern"
                )
        finally:
            aborted.cancel()
            collect.cancel()
            kill_child(process)
            await _reap(process, collect, errors)  # no worker outlives the call, even a cancelled one
        ctx.signal.raise_if_aborted()
        if result["note"] is None and result["truncated"]:
            status = process.returncode
            how = f"killed by signal {-status}" if status is not None and status < 0 else f"exit status {status}"
            last = errors.result().strip().splitlines()
            raise ToolError(f"the search worker ended unexpectedly ({how})" + (f": {last[-1]}" if last else ""))
        return result

    async def _collect(
        self, process: asyncio.subprocess.Process, request: dict[str, Any], result: dict[str, Any]
    ) -> None:
        """Send the request and fold the worker's events into ``result`` until it is done."""
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(request).encode())
        process.stdin.close()
        while line := await process.stdout.readline():
            event = json.loads(line)
            if "match" in event:
                result["matches"].append(event["match"])
            elif "file" in event:
                result[_FILE_EVENTS[event["file"]]] += 1
            elif event.get("done"):
                result["truncated"], result["note"] = event["truncated"], event["note"]
                return


#: The worker's ``{"file": ...}`` events, and the count of the result each adds to.
_FILE_EVENTS = {"searched": "files_searched", "skipped": "files_skipped", "withheld": "withheld"}


async def _tail(stream: asyncio.StreamReader | None, keep: int = 4096) -> str:
    """The last ``keep`` bytes ``stream`` gives until its end (read all along, so the pipe never fills)."""
    assert stream is not None
    tail = b""
    while chunk := await stream.read(65536):
        tail = (tail + chunk)[-keep:]
    return tail.decode("utf-8", errors="replace")


async def _reap(
    process: asyncio.subprocess.Process, collect: asyncio.Future[None], errors: asyncio.Future[str]
) -> None:
    """Wait until the (killed) worker has ended and its pipes are closed; a cancellation that comes
    meanwhile is held, and raised once it has.

    ``wait()`` returns only once stdout is closed too, and a reader paused on a full buffer (events
    ``collect`` had not taken when it stopped) never sees the end: stdout is read to its end.
    """

    async def settle() -> None:
        await asyncio.wait({collect})  # cancelled above: its read ends before another starts
        assert process.stdout is not None
        while await process.stdout.read(65536):
            pass
        await asyncio.wait({errors})
        await process.wait()

    settling = asyncio.ensure_future(settle())
    cancelled = False
    while not settling.done():
        try:
            await asyncio.wait({settling})
        except asyncio.CancelledError:
            cancelled = True
    settling.result()
    if cancelled:
        raise asyncio.CancelledError


#: How many line numbers the note on bytes that are not UTF-8 names before it says "and N more".
NOT_UTF8_NAMED = 10


def _render_read(_args: Any, value: Any) -> str:
    text = value["content"] or "(no lines in this range)"
    if value["truncated"] and value["next_offset"] is None:
        # A line cut to fit is the file's last: no offset shows the rest of it (read shows lines whole or cut).
        text += (
            "\n[output truncated to fit the read limit; the cut line is the file's last: see the rest of it with bash]"
        )
    elif value["truncated"]:
        text += f"\n[output truncated to fit the read limit; continue with offset={value['next_offset']}]"
    elif value["next_offset"] is not None:
        text += f"\n[more lines follow; continue with offset={value['next_offset']}]"
    bad = value.get("not_utf8_lines") or []
    if bad:
        named = ", ".join(map(str, bad[:NOT_UTF8_NAMED])) + (
            f" and {len(bad) - NOT_UTF8_NAMED} more" if len(bad) > NOT_UTF8_NAMED else ""
        )
        text += (
            f"\n[{'line' if len(bad) == 1 else 'lines'} {named} {'holds' if len(bad) == 1 else 'hold'} bytes "
            "that are not UTF-8, shown as U+FFFD: edit refuses this file, and writing the text back would "
            "replace those bytes]"
        )
    return text


def _withheld_note(count: int, what: str = "") -> str | None:
    """The line telling the model that the path guard withheld ``count`` entries (never which), or None."""
    if not count:
        return None
    return f"[{count} {'entry' if count == 1 else 'entries'} withheld by the path guard{what}]"


def _render_list(_args: Any, value: Any) -> str:
    lines = [
        e["name"] + ("/" if e["type"] == "dir" else "@" if e["type"] == "symlink" else "") for e in value["entries"]
    ]
    if value["truncated"]:
        lines.append("[listing truncated]")
    note = _withheld_note(value.get("withheld", 0))
    if note is not None:
        lines.append(note)
    return "\n".join(lines) if lines else f"(directory {value['path']} is empty)"


def _render_search(_args: Any, value: Any) -> str:
    lines = [f"{m['path']}:{m['line']}: {m['text']}" for m in value["matches"]]
    if not lines:
        lines.append(f"no matches ({value['files_searched']} files searched)")
    note = _withheld_note(value.get("withheld", 0), ": not searched")
    if note is not None:
        lines.append(note)
    if value["note"]:
        lines.append(f"[{value['note']}]")
    return "\n".join(lines)


@plugin(config_schema=CONFIG_SCHEMA)
def workspace_plugin(scope: Scope, config: Any) -> WorkspaceTools:
    """Entry point ``workspace``: file tools confined to ``config["root"]``."""
    return WorkspaceTools(dict(config), scope)


plugin = workspace_plugin  # the entry point names ``dsh_plugins.workspace:plugin``
