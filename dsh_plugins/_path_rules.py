"""What the ``guards`` plugin's path guard denies, as data: the one place its path rules are judged.

The guard (:mod:`dsh_plugins.guards`) compiles its config into a :class:`PathRules` and judges every path a
call names with :meth:`PathRules.judge`. The same object is published for the tools that reach paths no
call names: the workspace plugin's ``list`` and ``search`` look the published rules up at call time
(:data:`SERVICE`, a :class:`PublishedRules`) and withhold every entry the guard would deny if a call named
it. ``search`` runs in a worker process, which gets the rules as JSON (:meth:`PathRules.to_wire`) and
judges each file with the same code before it opens it.

Standard library only, and no import of ``dsh_core``: the search worker runs as ``python -I -S`` and loads
this file by its path.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["SERVICE", "Denial", "DenyRule", "PathRules", "PublishedRules", "lexical", "under"]

#: The scope service under which the guards rows publish their rules (a :class:`PublishedRules`), in the
#: root of their scope tree (the harness root), so every other plugin row finds it with
#: ``scope.lookup(SERVICE)``, whichever loaded first and wherever in the tree either was started.
SERVICE = "path_rules"


@dataclass(frozen=True)
class DenyRule:
    """One compiled glob of a ``deny_paths`` entry (an entry may stand for several: see ``guards``)."""

    #: The entry as configured, named in denials.
    pattern: str
    #: Matches the paths it denies: absolute ones, or relative to the guard root (``/`` separated).
    regex: re.Pattern[str]
    #: True: ``regex`` judges the absolute path; False: the path relative to the guard root.
    absolute: bool
    #: For a glob ending in ``/**`` (or ``**`` alone): matches a directory everything under which ``regex``
    #: denies (the glob without its ``/**``), so a walk need not enter it. None for any other glob.
    subtree: re.Pattern[str] | None = None


@dataclass(frozen=True)
class Denial:
    """Why a path is denied: which spelling of it, and by what rule."""

    kind: Literal["pattern", "outside_root", "outside_allowed"]
    #: The spelling judged (absolute): the path, or where its symlinks lead.
    candidate: str
    #: The ``deny_paths`` entry that matched (``kind == "pattern"``), else None.
    pattern: str | None = None


@dataclass(frozen=True)
class PathRules:
    """The path rules of one guards row, read-only.

    ``root`` is the real guard root, ``roots`` the spellings that are its inside (the real root, and the
    root as configured when a symlink makes it differ); ``allowed_roots`` are real directories.
    """

    row: str
    root: str
    roots: tuple[str, ...]
    deny: tuple[DenyRule, ...]
    allowed_roots: tuple[str, ...]

    @property
    def active(self) -> bool:
        """True if there is anything to deny."""
        return bool(self.deny or self.allowed_roots)

    @functools.cached_property
    def relative_deny(self) -> tuple[str, ...]:
        """The entries matched relative to the root (those that cannot judge a path outside it). Cached: a
        search asks for it for every file and directory it walks."""
        return tuple(dict.fromkeys(rule.pattern for rule in self.deny if not rule.absolute))

    def relative(self, candidate: str) -> str | None:
        """``candidate`` relative to the root (either spelling of it, ``/`` separated), None if outside."""
        for root in self.roots:
            relative = os.path.relpath(candidate, root).replace(os.sep, "/")
            if not (relative == ".." or relative.startswith("../")):
                return relative
        return None

    def judge(self, given: str) -> Denial | None:
        """The denial of a path a call names (relative to the root, absolute, or starting with ``~``), or None.

        Every spelling a tool may open is judged: ``~`` literal and expanded, each as given (under the real
        root and under the root as configured) and where its symlinks lead: as the system resolves it (a
        symlink before a ``..``: ``link/../x`` is x beside the link's target) and as the workspace does
        (``..`` first). ``given`` must be encodable (no NUL, no lone surrogate): the guard checks that first.
        """
        joined = [
            os.path.join(root, spelling)
            for spelling in dict.fromkeys((given, os.path.expanduser(given)))
            for root in self.roots
        ]
        lexicals = [lexical(path) for path in joined]
        reals = [os.path.realpath(path) for path in dict.fromkeys(lexicals + joined)]
        return self._judge(list(dict.fromkeys(lexicals + reals)), list(dict.fromkeys(reals)))

    def judge_found(self, path: str) -> Denial | None:
        """:meth:`judge` of an absolute, normalised ``path`` reached without following a symlink: an entry of
        a real directory that is not itself a symlink (what a walk finds), whose real path is its own
        spelling. A call naming it is judged under every spelling of the root (:meth:`spellings`), so it is
        here too: ``/tmp/l*nk/.env`` denies ``.env`` of a root configured as the symlink ``/tmp/link``. No
        system call."""
        return self._judge(self.spellings(path), [path])

    def judge_link(self, path: str) -> Denial | None:
        """:meth:`judge` of the symlink at the absolute, normalised ``path`` in a real directory (what a
        listing finds): under every spelling of the root, and where it leads."""
        real = os.path.realpath(path)
        return self._judge(list(dict.fromkeys([*self.spellings(path), real])), [real])

    def spellings(self, path: str) -> list[str]:
        """The absolute, normalised ``path`` and, when it lies under the real root, its spellings under the
        root as configured (the other :attr:`roots`): what :meth:`judge` judges of a call naming it."""
        spelled = [path]
        relative = os.path.relpath(path, self.root)
        if not (relative == ".." or relative.startswith("../")):
            spelled += [lexical(os.path.join(root, relative)) for root in self.roots if root != self.root]
        return list(dict.fromkeys(spelled))

    def closes(self, directory: str) -> bool:
        """True if every path under the real ``directory`` (absolute, normalised) is denied, so a walk need not
        enter it: a ``deny_paths`` glob ending in ``/**`` (``secrets/`` stands for ``secrets/**`` too) holds
        it, under any spelling of the root (:meth:`spellings`). Fail closed like :meth:`judge`: outside the
        root, relative globs deny all when there are any."""
        relative = self.relative(directory)
        if relative is None and self.relative_deny:
            return True
        spelled = self.spellings(directory)
        for rule in self.deny:
            if rule.subtree is None:
                continue
            subjects = spelled if rule.absolute else [relative] if relative is not None else []
            if any(rule.subtree.match(subject) for subject in subjects):
                return True
        return False

    def _judge(self, candidates: list[str], reals: list[str]) -> Denial | None:
        """The first denial among ``candidates`` (spellings, absolute) and ``reals`` (their real paths)."""
        judged = [(candidate, self.relative(candidate)) for candidate in candidates]
        for candidate, relative in judged:
            for rule in self.deny:
                subject = candidate if rule.absolute else relative
                if subject is not None and rule.regex.match(subject):
                    return Denial("pattern", candidate, rule.pattern)
        if self.relative_deny:
            for candidate, relative in judged:
                if relative is None:
                    return Denial("outside_root", candidate)
        if self.allowed_roots:
            for real in reals:
                if not any(under(real, root) for root in self.allowed_roots):
                    return Denial("outside_allowed", real)
        return None

    def to_wire(self) -> dict[str, Any]:
        """The rules as JSON, for the search worker (:meth:`from_wire` reads them back)."""

        def regex(compiled: re.Pattern[str] | None) -> list[Any] | None:
            return None if compiled is None else [compiled.pattern, compiled.flags]

        return {
            "row": self.row,
            "root": self.root,
            "roots": list(self.roots),
            "allowed_roots": list(self.allowed_roots),
            "deny": [[rule.pattern, regex(rule.regex), rule.absolute, regex(rule.subtree)] for rule in self.deny],
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> PathRules:
        """The rules :meth:`to_wire` wrote."""

        def regex(spelled: list[Any] | None) -> re.Pattern[str] | None:
            return None if spelled is None else re.compile(spelled[0], spelled[1])

        deny = []
        for pattern, compiled, absolute, subtree in wire["deny"]:
            main = regex(compiled)
            assert main is not None
            deny.append(DenyRule(pattern, main, absolute, regex(subtree)))
        return cls(
            row=wire["row"],
            root=wire["root"],
            roots=tuple(wire["roots"]),
            deny=tuple(deny),
            allowed_roots=tuple(wire["allowed_roots"]),
        )


class PublishedRules:
    """The path rules every guards row with path rules publishes (the service :data:`SERVICE`).

    A row adds its rules when it starts and removes them when its scope is disposed; readers take
    :meth:`snapshot` at call time, so the order in which plugin rows load does not matter. A row started in
    an agent's scope judges that agent's calls only (as its guard hook sees them), so its rules are
    published with that agent's layer and a snapshot for a call holds only the rules whose guard judges it.
    """

    def __init__(self) -> None:
        self._rules: list[tuple[PathRules, Any]] = []

    def publish(self, rules: PathRules, layer: Any = None) -> Callable[[], None]:
        """Add ``rules`` of a guard that judges the calls of agents within the scope ``layer`` (``None``: every
        call); the returned function removes them again (once)."""
        entry = (rules, layer)
        self._rules.append(entry)

        def withdraw() -> None:
            if any(published is entry for published in self._rules):
                self._rules = [published for published in self._rules if published is not entry]

        return withdraw

    def snapshot(self, agent: Any = None) -> tuple[PathRules, ...]:
        """The rules published now that judge a call of ``agent`` (a scope; ``None``: a call of no agent)."""
        return tuple(
            rules for rules, layer in self._rules if layer is None or (agent is not None and agent.is_within(layer))
        )


def lexical(path: str) -> str:
    """``path`` normalised without touching the disk (``..`` removes the component before it).

    The one reading of a path the guard and the workspace share: a path the guard judges is the path
    the workspace opens only while both normalise it alike.
    """
    normal = os.path.normpath(path)
    # POSIX lets a system give a leading "//" its own meaning, so normpath keeps it; on Linux it is "/",
    # and "//home/me/ws/a.txt" is a path inside the workspace.
    return "/" + normal.lstrip("/") if normal.startswith("//") else normal


def under(path: str, base: str) -> bool:
    """True if the normalised absolute ``path`` is ``base`` or lies under it (by its components)."""
    return path == base or path.startswith(base.rstrip("/") + "/")
