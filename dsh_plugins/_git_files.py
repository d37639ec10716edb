"""Where git looks for hooks and which config files it reads, for a file the workspace plugin would write.

Finds the repositories git may use around a path (a ``.git`` directory, or a ``.git`` file naming one with
``gitdir:``; a worktree's ``commondir``), reads their config files (``config``, the common directory's,
``config.worktree``), the system's and the user's, and every file they include, each at most
:data:`MAX_GIT_CONFIG_BYTES`, and collects the ``core.hooksPath`` directories they name and the config
files git reads. :mod:`dsh_plugins._git_config` parses each file; this module does the file system side
(kept apart, the parser stays a pure port of git's, testable against git byte for byte). What may be
written follows from :func:`protected_git_paths`; comparing paths is the caller's.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from dsh_plugins import _git_config

__all__ = ["GitProtection", "MAX_GIT_CONFIG_BYTES", "MAX_GIT_INCLUDE_DEPTH", "protected_git_paths"]

#: The most of a git config file (or a .git file) read to find where git looks for hooks.
MAX_GIT_CONFIG_BYTES = 1 << 20
#: How deep git follows include.path (its MAX_INCLUDE_DEPTH).
MAX_GIT_INCLUDE_DEPTH = 10


@dataclass(frozen=True)
class GitProtection:
    """What git would run from, for one path: see :func:`protected_git_paths`.

    ``hooks_directories``: each directory a ``core.hooksPath`` names, as ``(real absolute path, config file
    naming it)``, in the order they were found (repositories outwards-in, as :func:`protected_git_paths`
    says), the same directory possibly more than once. ``config_files``: each config file git reads (or
    would, once it is there), as ``(real path, the config file including it)``, ``None`` for one git reads
    of its own accord (a repository's, the user's, the system's), in the order they were read.
    ``unknown``: why it cannot be told, as ``(config file, problem)`` (the file ``None`` where the error
    named none, as an ``EIO`` from read), or ``None`` if every file was read.
    """

    hooks_directories: tuple[tuple[str, str], ...]
    config_files: tuple[tuple[str, str | None], ...]
    unknown: tuple[str | None, str] | None


def protected_git_paths(root: str, target: str) -> GitProtection:
    """The hooks directories and git config files that a write of ``target`` must not touch, or why that
    cannot be told; ``root`` (the workspace's) and ``target`` (under it) are real absolute paths.

    git runs its hooks from ``core.hooksPath`` when set (husky, pre-commit and team conventions set
    ``.husky/_`` or ``githooks``), so a file written there is a command run at the next commit, as one in
    ``.git/hooks``; and it runs the commands a config file names (``core.fsmonitor``, aliases). Read, in this
    order: the user's and system's configs (``/etc/gitconfig``, ``$XDG_CONFIG_HOME/git/config``,
    ``~/.gitconfig``; one that may not be read is skipped, as git skips it), for their absolute values
    (they apply in every repository, in the workspace or not); then for each repository git may run hooks of
    for ``target`` -- the one holding ``root`` (found upwards, as git finds it) and each one nested on the
    way down to ``target`` -- those again, its ``config``, ``config.worktree`` and its common directory's
    ``config``, each with the files it includes whatever their ``includeIf`` condition (a hooks directory
    too many is refused, none missed), each file read and parsed once. Every value counts, not the last only;
    one under ``%(prefix)/`` (git's installation) is left out; a relative one is taken from the working
    tree, and from the git directory too (a bare repository's base); ``~/`` from the home directory.

    A config file that cannot be read or is not git config syntax (git refuses those too) stops the reading,
    as ``unknown``: it might name a hooks directory, and guessing could miss it. The hooks directories found
    before it are listed, so a caller refusing for one of those first, then for ``unknown``, refuses for the
    first reason met in the order above; ``config_files`` is complete only when ``unknown`` is ``None``.

    Nothing is kept between calls: each reads every file and resolves every path again, so a config or a
    symlink changed outside dsh counts at the next write. Within a call each path is resolved once (see
    :meth:`_GitConfigs.realpath`): about 0.3 ms a call in a plain repository with small configs (0.43 ms
    resolving a path each time it was named: 24 ``realpath`` calls, 9 of them distinct).
    """
    configs_read = _GitConfigs()
    hooks_directories: list[tuple[str, str]] = []
    unknown: tuple[str | None, str] | None = None
    global_configs = _global_git_configs()
    # None: no repository (the user's and system's absolute values count where the workspace is in none).
    repositories: list[tuple[str, str] | None] = [None, *_repositories_around(root, target)]
    try:
        for repository in repositories:
            configs = list(global_configs)
            if repository is not None:
                gitdir = repository[1]
                configs += [os.path.join(gitdir, "config"), os.path.join(gitdir, "config.worktree")]
                common = _read_small(os.path.join(gitdir, "commondir"))
                if common is not None:  # a worktree's git directory: the repository's config is there
                    configs.append(os.path.join(gitdir, os.fsdecode(common.strip()), "config"))
            for config in configs:
                for value, source in configs_read.hooks_paths(config, skip_denied=config in global_configs):
                    if value.startswith("%(prefix)/"):
                        continue  # under git's installation directory, not the workspace
                    # A relative one is taken from a repository's working tree or git directory.
                    for base in ("",) if os.path.isabs(value) else (repository or ()):
                        hooks_directories.append((configs_read.realpath(os.path.join(base, value)), source))
    except _git_config.ConfigError as error:
        unknown = (error.filename, f"line {error.line} is not git config syntax (git refuses the file too)")
    except OSError as error:
        unknown = (error.filename, f"cannot be read ({error.strerror or error})")
    return GitProtection(tuple(hooks_directories), tuple(configs_read.named.items()), unknown)


def _repositories_around(root: str, target: str) -> list[tuple[str, str]]:
    """(working tree, git directory) of each repository git may run hooks of for ``target``: the one
    holding ``root`` (found upwards, as git finds it) and each one nested on the way down to ``target``."""
    found: list[tuple[str, str]] = []
    directory = root
    while (gitdir := _git_directory(directory)) is None and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    if gitdir is not None:
        found.append((directory, gitdir))
    parts = os.path.relpath(target, root).replace(os.sep, "/").split("/")[:-1]
    for depth in range(1, len(parts) + 1):
        directory = os.path.join(root, *parts[:depth])
        if (gitdir := _git_directory(directory)) is not None:
            found.append((directory, gitdir))
    return found


def _read_small(path: str) -> bytes | None:
    """The bytes of the regular file ``path`` (at most :data:`MAX_GIT_CONFIG_BYTES`), ``None`` if there is
    none; :class:`OSError` if it cannot be read. Opened without blocking: a FIFO there cannot hang the call."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    with open(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        data = handle.read(MAX_GIT_CONFIG_BYTES + 1)
    if len(data) > MAX_GIT_CONFIG_BYTES:
        raise OSError(errno.EFBIG, f"larger than {MAX_GIT_CONFIG_BYTES / (1 << 20):.1f} MiB", path)
    return data


def _git_directory(worktree: str) -> str | None:
    """The git directory of the repository whose working tree is ``worktree``, or ``None``: its ``.git``
    directory, or the one its ``.git`` file names (``gitdir: ...``, as a submodule or a worktree has)."""
    dotgit = os.path.join(worktree, ".git")
    if os.path.isdir(dotgit):
        return dotgit
    try:
        data = _read_small(dotgit)
    except OSError:
        return None  # git cannot read it either: no repository, no hooks
    if data is None or not data.startswith(b"gitdir:"):
        return None
    return os.path.join(worktree, os.fsdecode(data[len(b"gitdir:") :].strip()))


def _global_git_configs() -> list[str]:
    """The system's and the user's git config files, whose core.hooksPath applies to every repository."""
    home = os.path.expanduser("~")
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    return ["/etc/gitconfig", os.path.join(xdg, "git", "config"), os.path.join(home, ".gitconfig")]


class _GitConfigs:
    """The git config files one check reads: each read and parsed once, however often it is named, and each
    path resolved once. Made anew for each check (:func:`protected_git_paths`), so it keeps nothing between
    two."""

    def __init__(self) -> None:
        self._parsed: dict[str, list[tuple[str, bytes | None]]] = {}
        self._real: dict[str, str] = {}
        #: Every config file git reads (or would, once it is there), by its real path, to the file including
        #: it (``None`` for a config git reads of its own accord).
        self.named: dict[str, str | None] = {}

    def realpath(self, path: str) -> str:
        """:func:`os.path.realpath` of ``path``, resolved once in this check.

        One check names the same few paths again and again (each global config and its directory, once per
        repository around the target: 24 calls, 9 of them distinct, in a plain repository), and each
        ``realpath`` is an ``lstat`` a component: half the check's time. Only within the check: a symlink
        changed outside dsh between two writes must count at the second, so nothing outlives this object.
        """
        real = self._real.get(path)
        if real is None:
            real = self._real[path] = os.path.realpath(path)
        return real

    def _settings(self, config: str, skip_denied: bool) -> list[tuple[str, bytes | None]]:
        key = self.realpath(config)
        if key not in self._parsed:
            try:
                data = _read_small(config)
            except PermissionError:
                if not skip_denied:
                    raise
                data = None
            try:
                self._parsed[key] = [] if data is None else _git_config.parse(data)
            except _git_config.ConfigError as error:
                error.filename = config
                raise
        return self._parsed[key]

    def hooks_paths(
        self,
        config: str,
        depth: int = 0,
        seen: dict[tuple[str, str], int] | None = None,
        *,
        skip_denied: bool = False,
        includer: str | None = None,
    ) -> Iterator[tuple[str, str]]:
        """Each ``core.hooksPath`` the git config file ``config`` sets (and the file setting it), the files it
        includes followed whatever their ``includeIf`` condition (a hooks directory too many is refused, none
        missed). Raises :class:`OSError` or :class:`_git_config.ConfigError` (with the file as ``filename``).

        A file is followed again only from less deep than before (``seen``): a file naming itself, or one
        file many times, or through symlinks to its directory, is not read once per path through the
        includes (exponential in the depth). With ``skip_denied`` (the user's and system's configs), a file
        that may not be read is skipped, as git skips those (``ACCESS_EACCES_OK``); it dies on others."""
        seen = {} if seen is None else seen
        # Relative includes are taken from the directory as named: it is part of the key.
        key = (self.realpath(os.path.dirname(config)), self.realpath(config))
        if seen.get(key, MAX_GIT_INCLUDE_DEPTH + 1) <= depth:
            return
        seen[key] = depth
        self.named.setdefault(key[1], includer)
        for name, value in self._settings(config, skip_denied and depth == 0):
            if not value:
                continue
            text = os.path.expanduser(os.fsdecode(value))  # git expands ~/ and ~user/ in paths
            if name == "core.hookspath":
                yield text, config
            elif _is_include(name) and depth < MAX_GIT_INCLUDE_DEPTH:  # deeper, git refuses the whole config
                yield from self.hooks_paths(
                    os.path.join(os.path.dirname(config), text), depth + 1, seen, includer=config
                )


def _is_include(name: str) -> bool:
    """True if the git config setting ``name`` names a file to read as config too."""
    return name == "include.path" or (name.startswith("includeif.") and name.endswith(".path"))
