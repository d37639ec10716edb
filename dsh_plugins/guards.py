"""The ``guards`` plugin: a path guard and a per-tool allow/deny list, as ``dsh_guard`` implementations.

Guards run after a call was allowed (by the pre-execute votes or a person)
and can only deny: they are the last, monotonic line of the policy.

* Tools: ``deny_tools`` denies matching names; a non-empty ``allow_tools``
  denies every name it does not match (``fnmatch`` globs). In Code Mode, list
  ``run_code`` in ``allow_tools`` too.
* Paths: every argument named in ``path_arguments`` (``path`` and friends by
  default) or ``extend_path_arguments``, at any depth (a ``path`` key in an object inside another argument
  too), holding a string or a list of strings, is resolved against ``root``
  (symlinks followed, a ``..`` after one both as the system and as the
  workspace reads it), which must be the root the tools resolve against (the
  workspace root) and is required once ``deny_paths`` or ``allowed_roots`` is
  set. A call is denied when the path falls under a ``deny_paths`` glob, or
  lies outside every ``allowed_roots`` directory (when that list is given).
  Fail closed: when relative ``deny_paths`` exist, a path that resolves
  outside ``root`` (an absolute path, ``..``, a symlink) is denied, since
  relative globs cannot judge it. A leading ``~`` is checked both expanded and
  literally (tools differ in whether they expand it). An empty string is the
  root. While there are path rules, a path argument holding anything else
  (null, a number, an object, a nested list) is denied: it cannot be judged;
  and one the tool's schema declares but the call leaves out is judged as its
  schema ``default``, else as the root (``list`` and ``search`` without a
  path work on the whole root).
* What tools reach from a named path: the guard judges the paths a call
  names, and publishes its rules (a read-only
  :class:`~dsh_plugins._path_rules.PathRules`, in the
  :class:`~dsh_plugins._path_rules.PublishedRules` service ``"path_rules"`` of
  the harness root; a row started in an agent's scope publishes them for that
  agent's calls only, as its guard judges only those) to the tools that reach
  paths no call names. The workspace plugin's
  ``list`` and ``search`` look them up at each call (so the rows may load in
  any order) and withhold every entry these rules deny, judged by the same
  code that judges a named path: ``list`` judges a symlink where it leads, as
  naming it would; ``search`` (in its worker process, which gets the rules in
  its request) judges each file before it opens it, and does not enter a
  directory everything under which a ``.../**`` glob denies (``secrets/``,
  ``**/.git/**``). Both count what they withheld (``withheld``; the text says
  ``[N entries withheld by the path guard]``) without naming it. A tool that
  reaches paths no argument names and does not consult the published rules
  (``bash``, a third-party tool, and ``run_code`` below isolation L2, where
  no Landlock rule keeps its program from opening files) is judged by its
  arguments only: deny such tools too where that matters.
* Limits: paths are judged by name, never by the file a name leads to past
  its symlinks. A hard link to a denied file under an allowed name
  (``notes.txt`` sharing ``.env``'s inode) is read under that name, by
  ``read`` as by ``search``; a directory another program renames while a
  search walks it is judged by the name it had when the walk reached it; and
  Unicode normalisation is not folded (on macOS, where ``é`` decomposed on
  disk opens as ``é`` composed, a glob matches only the spelling it is
  written in).

Globs: ``*`` and ``?`` stay within one path segment, ``**`` spans any number
of segments; brace groups expand as bash expands them (``**/*.{pem,key}`` is
``**/*.pem`` and ``**/*.key``; ``{x}`` and ``[{]`` are literal), and unbalanced
braces are a config error rather than a glob that silently matches nothing.
A glob starting with ``/`` (or ``~``) matches the absolute path,
as written and with the symlinks of its glob-free leading directories resolved
(so ``/tmp/ws/secrets/**`` holds when ``/tmp`` is a symlink, or ``root`` is
spelled through one); any other glob matches the path relative to ``root`` (so
``**/.env`` denies every ``.env`` inside the workspace), and where its glob-free
leading directories are a symlink, also the files it leads to (``alias/**``
with ``alias -> secrets`` denies ``secrets/key``). Symlinks in globs are
resolved at load. Globs are normalised
like the paths they judge (``./x`` is ``x``, ``x//y`` and ``x/./y`` are
``x/y``); a glob ending in ``/`` denies the directory and everything under it
(``secrets/`` is ``secrets`` and ``secrets/**``), while ``secrets/**`` leaves
the directory itself (its listing) allowed. A glob with a ``..`` segment, or
starting with a ``~`` that names no known home directory, is a config error.
Matching is case-sensitive, unless the root's file system looks names up
ignoring case (macOS and Windows volumes usually do; probed once at load, on
the root's own file system: from a name in the root, else from the root's name
in its parent when that is the same file system, else from a file made and
removed in the root at once; when none can decide, globs fold case, the safe
way for deny rules): there ``**/.env`` denies ``.ENV`` too. A case-insensitive
mount below a case-sensitive root is not detected.

Config::

    [[plugins]]
    id = "guards"
    use = "guards"
    config = { deny_tools = ["bash"], deny_paths = ["**/.env", "**/.git/**"], allowed_roots = ["."] }

Path argument names: ``path_arguments`` replaces the default names (``path``,
``paths``, ``file``, ``file_path``, ``filename``, ``directory``, ``dir``,
``cwd``): ``path_arguments = ["target"]`` judges ``target`` only, and no
longer ``path``. To judge more names, keep the defaults and list the new ones
in ``extend_path_arguments`` (empty by default; as ruff's ``select`` and
``extend-select``). Both take non-empty names only: anything else is a
config error naming the key.
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import itertools
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, Final

from dsh_core import Scope, ToolError, ToolExecution, hookimpl, plugin
from dsh_core.registry import judged_definition
from dsh_plugins._path_rules import SERVICE, DenyRule, PathRules, PublishedRules, lexical

__all__ = ["plugin", "Guards", "glob_to_regex", "tool_globs"]

DEFAULT_PATH_ARGUMENTS = ["path", "paths", "file", "file_path", "filename", "directory", "dir", "cwd"]

_NAMES = {"type": "array", "items": {"type": "string", "minLength": 1}}

CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "allow_tools": {**_NAMES, "description": "if non-empty, only these tool names (globs) may run"},
        "deny_tools": {**_NAMES, "description": "tool names (globs) that may never run"},
        "deny_paths": {**_NAMES, "description": "path globs no call may touch"},
        "allowed_roots": {**_NAMES, "description": "directories every path argument must lie in"},
        "path_arguments": {
            **_NAMES,
            "default": DEFAULT_PATH_ARGUMENTS,
            "description": (
                "argument names holding paths; replaces the defaults (to add names, use extend_path_arguments)"
            ),
        },
        "extend_path_arguments": {
            **_NAMES,
            "default": [],
            "description": "argument names holding paths, judged in addition to path_arguments",
        },
        "root": {
            "type": "string",
            "minLength": 1,
            "description": (
                "base of relative paths and globs: the workspace root the tools resolve "
                "against (required with deny_paths or allowed_roots)"
            ),
        },
    },
}


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Compile a path glob: ``*``/``?`` within a segment, ``**`` across segments, ``[...]`` classes."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif char == "*":
            out.append("[^/]*")
            i += 1
        elif char == "?":
            out.append("[^/]")
            i += 1
        elif char == "[":
            # As fnmatch reads a class: a "]" right after "[" or "[!" is a member, not the end.
            start = i + 2 if pattern.startswith("[!", i) else i + 1
            end = pattern.find("]", start + 1 if pattern.startswith("]", start) else start)
            if end == -1:
                out.append(re.escape(char))
                i += 1
            else:
                body = pattern[i + 1 : end]
                negated = body.startswith("!")
                # Members are literal for the regex too (a backslash, "[" and "]"; "&", "~", "|" would warn
                # as future set operations); only "-" ranges and a leading "^" (negation, as in bash) stay.
                body = re.sub(r"([\\\[\]&~|])", r"\\\1", body[1:] if negated else body)
                out.append(f"[{'^' if negated else ''}{body}]")
                i = end + 1
        else:
            out.append(re.escape(char))
            i += 1
    return re.compile("".join(out) + r"\Z", re.DOTALL)


class Guards:
    """The plugin instance: compiled tool lists and path rules."""

    def __init__(self, scope: Scope, config: dict[str, Any]) -> None:
        self.scope = scope
        # The scope of a plugin row is named "plugin:<row id>"; denials name the row to edit.
        self.row = scope.name.partition(":")[2] or "guards"
        self.allow_tools: list[str] = list(config.get("allow_tools", []))
        self.deny_tools: list[str] = list(config.get("deny_tools", []))
        #: Each tool glob as written, with the globs its brace groups stand for.
        self._allow_globs = tool_globs(self.allow_tools, "allow_tools", self.row)
        self._deny_globs = tool_globs(self.deny_tools, "deny_tools", self.row)
        # As ruff's select and extend-select: path_arguments replaces the defaults, extend_path_arguments
        # adds to them, so naming one extra argument cannot silently stop `path` and `file` being judged.
        self.path_arguments = frozenset(config.get("path_arguments", DEFAULT_PATH_ARGUMENTS)) | frozenset(
            config.get("extend_path_arguments", [])
        )
        if config.get("root") is None and (config.get("deny_paths") or config.get("allowed_roots")):
            # Resolving against the current directory would check another file than the tool opens.
            raise ToolError(
                f'guards: plugin row "{self.row}" sets deny_paths or allowed_roots but no root; '
                "set root to the workspace root the tools resolve paths against"
            )
        root = os.path.expanduser(config.get("root") or os.getcwd())
        if not os.path.isabs(root):
            raise ToolError(f'guards: root of plugin row "{self.row}" must be an absolute path, got {root!r}')
        real_root = os.path.realpath(root)
        # Where the root looks names up ignoring case, ".ENV" opens .env: the globs fold case there too.
        flags = re.DOTALL | re.IGNORECASE if _case_insensitive(real_root) else re.DOTALL
        deny: list[DenyRule] = []
        entries = [
            (entry, alternative)
            for entry in config.get("deny_paths", [])
            for alternative in _brace_alternatives(entry, self.row)
        ]
        for pattern, alternative in entries:
            globs = _normalised_globs(alternative, self.row, pattern)
            absolute = globs[0].startswith("/")
            if absolute:
                # An absolute glob is matched as written and with the symlinks of its glob-free leading
                # directories resolved, since candidates are real paths too: "/tmp/link/secrets/**" still
                # denies what the tools open as /tmp/real/secrets/key.
                globs += [_resolve_prefix(glob) for glob in globs]
            try:
                deny.extend(_rule(pattern, glob, flags, absolute) for glob in dict.fromkeys(globs))
                if not absolute:
                    # Likewise a relative glob through a symlink in the root ("alias/**", alias -> secrets):
                    # secrets/key is the file alias/key opens. Its resolved form is matched as an absolute
                    # glob, since the symlink may lead anywhere.
                    for glob in dict.fromkeys(globs):
                        resolved = _resolve_relative_prefix(glob, real_root)
                        if resolved is not None:
                            deny.append(_rule(pattern, resolved, flags, True))
            except re.error as error:  # a class no regex holds: "[z-a]"
                raise ToolError(
                    f'guards: deny_paths pattern "{pattern}" of plugin row "{self.row}" is not a '
                    f"valid glob: {error.msg}"
                ) from None
        #: The path rules, judged by :class:`~dsh_plugins._path_rules.PathRules` alone (for the calls this
        #: guard sees and, published, for what ``list`` and ``search`` reach).
        self.rules = PathRules(
            row=self.row,
            root=real_root,
            # Relative paths resolve against the real root, but a path may also be spelled through the root
            # as configured (a symlink, like /tmp on macOS): both spellings are the inside of the root.
            roots=tuple(dict.fromkeys((real_root, lexical(root)))),
            deny=tuple(deny),
            allowed_roots=tuple(
                os.path.realpath(os.path.join(real_root, os.path.expanduser(r)))
                for r in config.get("allowed_roots", [])
            ),
        )
        if self.rules.active:
            _publish(scope, self.rules)

    @hookimpl
    def dsh_guard(self, execution: ToolExecution) -> str | None:
        """Deny by tool name first, then by each path-like argument."""
        name = execution.name
        denied = next(
            (written for written, globs in self._deny_globs if any(fnmatch.fnmatchcase(name, glob) for glob in globs)),
            None,
        )
        if denied is not None:
            return (
                f'guards: tool "{name}" is denied (deny_tools pattern "{denied}" '
                f'in the config of plugin row "{self.row}")'
            )
        if self.allow_tools and not any(
            fnmatch.fnmatchcase(name, glob) for _, globs in self._allow_globs for glob in globs
        ):
            return (
                f'guards: tool "{name}" is not in allow_tools of plugin row "{self.row}" '
                f"(allowed: {', '.join(self.allow_tools)})"
            )
        if self.rules.active:
            reason = self._check_omitted(execution)
            if reason is not None:
                return reason
        # Every object in the arguments, nested ones too (in document order, without recursion: the
        # arguments may be arbitrarily deep): a path key inside another argument ({"files": [{"path":
        # ".env"}]}) names a file all the same.
        pending: collections.deque[object] = collections.deque([execution.arguments])
        while pending:
            node = pending.popleft()
            if isinstance(node, list):
                pending.extend(node)
            elif isinstance(node, dict):
                for key, value in node.items():
                    if key in self.path_arguments:
                        reason = self._check_value(key, value)
                        if reason is not None:
                            return reason
                    if isinstance(value, (dict, list)):
                        pending.append(value)
        return None

    def _check_omitted(self, execution: ToolExecution) -> str | None:
        """Judge the path arguments the tool declares but the call leaves out, as the tool's schema default
        or else the root: ``list`` and ``search`` without a path work on the whole root, which an
        ``allowed_roots`` below it must deny as it denies an explicit ``"."``."""
        definition = judged_definition(execution, self.scope.lookup("tools"))
        properties = None if definition is None else definition.parameters.get("properties")
        if not isinstance(properties, Mapping):
            return None
        given = execution.arguments if isinstance(execution.arguments, dict) else {}
        for key, schema in properties.items():
            if key in self.path_arguments and key not in given:
                default = schema.get("default", ".") if isinstance(schema, Mapping) else "."
                reason = self._check_value(key, default, omitted=True)
                if reason is not None:
                    return reason
        return None

    def _check_value(self, key: str, value: object, *, omitted: bool = False) -> str | None:
        """Judge the value of a path argument: a string or a list of strings. Anything else (null, a number,
        which ``open()`` takes for a descriptor, an object, a nested list) cannot be judged, so it is denied
        while there are path rules; an empty string is the root, as ``os.path.join`` reads it."""
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str):
                reason = self._check_path(key, item, omitted=omitted)
            elif self.rules.active:
                verb = "holds" if isinstance(value, list) else "is"
                note = " (omitted: its default)" if omitted else ""
                reason = (
                    f'guards: argument "{key}"{note} {verb} {_json_kind(item)}, not a path (a string or '
                    f'a list of strings), so deny_paths and allowed_roots of plugin row "{self.row}" '
                    "cannot judge it; denied"
                )
            else:
                reason = None
            if reason is not None:
                return reason
        return None

    def _check_path(self, key: str, given: str, *, omitted: bool = False) -> str | None:
        where = f'argument "{key}"' + (", omitted: judged as the tool's default" if omitted else "")
        if "\0" in given:
            return f'guards: argument "{key}" contains a NUL character'
        try:
            os.fsencode(given)
        except UnicodeEncodeError as error:  # no file has this name, and realpath would raise on it
            shown = given.encode("utf-8", "backslashreplace").decode("utf-8")
            return (
                f'guards: path "{shown}" ({where}) cannot be a file name: it holds a lone surrogate '
                f"(\\u{ord(given[error.start]):04x}) that has no encoding"
            )
        denial = self.rules.judge(given)
        if denial is None:
            return None
        if denial.kind == "pattern":
            return (
                f'guards: path "{given}" ({where}) matches the denied pattern '
                f'"{denial.pattern}" (deny_paths of plugin row "{self.row}")'
            )
        if denial.kind == "outside_root":
            # Counted, not listed: naming every pattern would hand the model the whole deny list (file names
            # that list and search withhold without naming) for one call naming "/"; the row is where to look.
            count = len(self.rules.relative_deny)
            return (
                f'guards: path "{given}" ({where}) resolves to {denial.candidate}, outside the guard '
                f'root {self.rules.root}, where the relative deny_paths patterns of plugin row "{self.row}" '
                f"({count} pattern{'' if count == 1 else 's'}) cannot be checked; denied (use a path inside the root)"
            )
        return (
            f'guards: path "{given}" ({where}) resolves to {denial.candidate}, outside the allowed '
            f'roots ({", ".join(self.rules.allowed_roots)}) of plugin row "{self.row}"'
        )


def _publish(scope: Scope, rules: PathRules) -> None:
    """Publish ``rules`` for the tools that reach paths no call names (``list``, ``search``): in the
    :class:`~dsh_plugins._path_rules.PublishedRules` of the root of this row's scope tree (made and provided
    there by the first row that publishes), for the calls this row's guard judges (those of the agent whose
    scope it was started in, else every call), withdrawn when this row's scope is disposed."""
    # The root, not the nearest scope: a row started in an agent's scope would otherwise provide the board
    # where a deployment-level workspace row never looks, and that agent's search would read what its own
    # guard denies; the layer keeps its rules from withholding anything from other agents.
    root = next(node for node in scope.chain() if node.parent is None)
    board = root.lookup(SERVICE)
    if not isinstance(board, PublishedRules):
        board = PublishedRules()
        root.provide(SERVICE, board)
    scope.on_dispose(board.publish(rules, scope.layer_owner))


def _rule(pattern: str, glob: str, flags: int, absolute: bool) -> DenyRule:
    """The compiled ``glob`` of the ``deny_paths`` entry ``pattern``; a glob ending in ``/**`` (or ``**``
    alone) also gets the regex of the directories it denies everything under (the glob without ``/**``):
    ``glob_to_regex`` reads a glob left to right, so a directory that matches it has every path below it
    match the whole glob."""
    head = glob[:-3] if glob.endswith("/**") else glob if glob == "**" else None
    subtree = None if head is None else re.compile(glob_to_regex(head or "/**").pattern, flags)
    return DenyRule(pattern, re.compile(glob_to_regex(glob).pattern, flags), absolute, subtree)


#: Most globs one ``deny_paths`` entry may expand to (``{a,b}{c,d}`` is 4), and deepest brace nesting.
MAX_BRACE_ALTERNATIVES = 1024
MAX_BRACE_DEPTH = 16


def _class_end(pattern: str, start: int) -> int:
    """Index of the ``]`` closing the class opened at ``pattern[start]``, as :func:`glob_to_regex` reads
    it, or -1 when it is not closed (then the ``[`` is literal)."""
    first = start + 2 if pattern.startswith("[!", start) else start + 1
    return pattern.find("]", first + 1 if pattern.startswith("]", first) else first)


def _brace_group(pattern: str, start: int) -> tuple[int, list[int]]:
    """The index of the ``}`` closing the ``{`` at ``start`` and the group's own commas (not nested ones')."""
    commas: list[int] = []
    depth, index = 0, start
    while index < len(pattern):
        char = pattern[index]
        if char == "[" and (end := _class_end(pattern, index)) != -1:
            index = end + 1
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return index, commas
        elif char == "," and depth == 1:
            commas.append(index)
        index += 1
    raise AssertionError("unbalanced braces are refused before groups are read")  # pragma: no cover


#: What is left of a tool glob without its wildcards and classes must be spelled as tool names are.
_TOOL_NAME_CHARS: Final = re.compile(r"[A-Za-z0-9_-]*")


def tool_globs(patterns: list[str], key: str, row: str, owner: str = "guards") -> list[tuple[str, list[str]]]:
    """Each of ``key``'s tool globs as written, with the globs its brace groups stand for. A glob no tool
    name can match (a ``.``, a space, a ``/`` outside a class: names use ``[A-Za-z0-9_-]`` only) is
    refused: in ``deny_tools`` it would silently deny nothing. ``owner`` is the plugin whose config is
    read (the ``approval`` plugin's ``allow`` and ``deny`` are tool globs too), named in refusals."""
    globs = []
    for pattern in patterns:
        alternatives = _brace_alternatives(pattern, row, key, owner)
        for alternative in alternatives:
            literal, index = [], 0
            while index < len(alternative):
                if alternative[index] == "[" and (end := _class_end(alternative, index)) != -1:
                    index = end + 1
                    continue
                if alternative[index] not in "*?":
                    literal.append(alternative[index])
                index += 1
            if not _TOOL_NAME_CHARS.fullmatch("".join(literal)):
                raise ToolError(
                    f'{owner}: {key} pattern "{pattern}" of plugin row "{row}" can never match a tool '
                    'name (names use only A-Z, a-z, 0-9, "_" and "-"; globs add "*", "?", "[...]" '
                    'and "{a,b}")'
                )
        globs.append((pattern, alternatives))
    return globs


def _brace_alternatives(pattern: str, row: str, key: str = "deny_paths", owner: str = "guards") -> list[str]:
    """The globs ``pattern`` stands for with its brace groups expanded as bash expands them:
    ``*.{pem,key}`` is ``*.pem`` and ``*.key`` (nested and several groups too); a group with no comma
    (``{x}``) and a brace in a class (``[{]``) are literal. Unbalanced braces are refused (no path would
    match what was meant), as is an entry expanding past :data:`MAX_BRACE_ALTERNATIVES` globs."""

    def refuse(why: str) -> ToolError:
        return ToolError(f'{owner}: {key} pattern "{pattern}" of plugin row "{row}" {why}')

    depth, index = 0, 0
    while index < len(pattern):
        char = pattern[index]
        if char == "[" and (end := _class_end(pattern, index)) != -1:
            index = end + 1
            continue
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth < 0 or depth > MAX_BRACE_DEPTH:
            break
        index += 1
    if depth != 0:
        why = f"nests braces deeper than {MAX_BRACE_DEPTH}" if depth > MAX_BRACE_DEPTH else "has unbalanced braces"
        raise refuse(f'{why}; "{{a,b}}" stands for "a" and "b", and "[{{]" / "[}}]" match a brace itself')
    return _expand(pattern, refuse)


def _expand(text: str, refuse: Callable[[str], ToolError]) -> list[str]:
    index = 0
    while index < len(text):
        char = text[index]
        if char == "[" and (end := _class_end(text, index)) != -1:
            index = end + 1
            continue
        if char == "{":
            close, commas = _brace_group(text, index)
            if commas:
                head, tail = text[:index], text[close + 1 :]
                bounds = [index, *commas, close]
                expanded: list[str] = []
                for left, right in itertools.pairwise(bounds):
                    expanded.extend(head + rest for rest in _expand(text[left + 1 : right] + tail, refuse))
                    if len(expanded) > MAX_BRACE_ALTERNATIVES:
                        raise refuse(
                            f"expands to more than {MAX_BRACE_ALTERNATIVES} globs; write fewer "
                            "alternatives, or several entries"
                        )
                return list(dict.fromkeys(expanded))
        index += 1
    return [text]


def _normalised_globs(pattern: str, row: str, shown: str | None = None) -> list[str]:
    """The globs a ``deny_paths`` entry (or one of its brace alternatives, the entry being ``shown``)
    stands for, spelled as the judged paths are: ``~`` expanded, no empty or ``.`` segments (``./x``,
    ``x//y``, ``x/./y``); a trailing ``/`` is the directory and everything under it. A ``..`` segment is
    refused: it would never match a normalised path."""
    entry = pattern
    pattern = shown if shown is not None else pattern  # the entry as written, in messages
    expanded = os.path.expanduser(entry)
    if expanded.startswith("~"):
        # Left as is it would be a relative glob under root, never matching the home directory it names.
        raise ToolError(
            f'guards: deny_paths pattern "{pattern}" of plugin row "{row}" starts with "~" but '
            'names no home directory that can be found; write the absolute path (or "./~..." '
            "for a directory named so inside root)"
        )
    parts = [part for part in expanded.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ToolError(
            f'guards: deny_paths pattern "{pattern}" of plugin row "{row}" has a ".." segment, '
            "which no path matches (paths are normalised before they are judged); write the "
            'directory it means without ".."'
        )
    glob = ("/" if expanded.startswith("/") else "") + "/".join(parts) or "."
    if not expanded.endswith("/"):
        return [glob]
    return [glob, "**" if glob == "." else glob.rstrip("/") + "/**"]


def _case_insensitive(directory: str) -> bool:
    """Whether ``directory`` looks names up ignoring case, decided on its own file system.

    A name found again with the case of its ASCII letters swapped says so: a name in
    ``directory``; else (it is empty) the name of ``directory`` or an ancestor in its
    parent, but only while that parent is on the same device (a mount point's parent is
    another file system); else a file made, probed and removed in ``directory``. When
    none of these can decide (an empty, unwritable mount point), ``True``: the answer
    only ever makes deny globs fold case, and denying ``.ENV`` with ``.env`` is the safe error.
    """

    def swapped(name: str) -> str:
        return "".join(char.swapcase() if char.isascii() else char for char in name)

    def same_entry(probe: str) -> bool:
        parent, name = os.path.split(probe)
        try:
            return os.path.samestat(os.lstat(probe), os.lstat(os.path.join(parent, swapped(name))))
        except OSError:
            return False

    probe = None
    try:
        with os.scandir(directory) as entries:
            probe = next(
                (
                    os.path.join(directory, entry.name)
                    for entry in itertools.islice(entries, 64)
                    if swapped(entry.name) != entry.name
                ),
                None,
            )
    except OSError:
        pass
    if probe is not None:
        return same_entry(probe)
    try:
        device = os.stat(directory).st_dev
    except OSError:
        return True  # not there to probe: nothing says how it will look names up
    path = directory
    while os.path.dirname(path) != path:
        parent = os.path.dirname(path)
        try:
            if os.stat(parent).st_dev != device:
                break  # the name is looked up by another file system than the directory's own
        except OSError:
            break
        if swapped(os.path.basename(path)) != os.path.basename(path):
            return same_entry(path)
        path = parent
    try:
        # A name with letters; removed at once (a workspace watcher may glimpse it).
        fd, made = tempfile.mkstemp(prefix=".dsh-case-probe-", dir=directory)
    except OSError:
        return True
    try:
        os.close(fd)
        return same_entry(made)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(made)


def _json_kind(value: object) -> str:
    """What a JSON value that is not a string is, for a denial reason."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "an object" if isinstance(value, dict) else "an array" if isinstance(value, list) else "a value"


def _glob_escape(text: str) -> str:
    """``text`` as a glob matching itself only (``*``, ``?`` and ``[`` in brackets)."""
    return re.sub(r"([*?\[])", r"[\1]", text)


def _split_glob(glob: str) -> tuple[list[str], list[str]]:
    """The components of ``glob`` before its first one holding a glob character, and the rest."""
    parts = glob.split("/")
    literal = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts))
    return parts[:literal], parts[literal:]


def _resolve_prefix(glob: str) -> str:
    """An absolute ``glob`` with the symlinks of its glob-free leading components resolved (the tail kept)."""
    head, tail = _split_glob(glob)
    return "/".join([_glob_escape(os.path.realpath("/".join(head) or "/")).rstrip("/"), *tail]) or "/"


def _resolve_relative_prefix(glob: str, root: str) -> str | None:
    """The absolute glob a ``glob`` relative to ``root`` stands for through the symlinks of its glob-free
    leading components, or None when there are none (the relative glob says it all)."""
    head, tail = _split_glob(glob)
    prefix = os.path.join(root, *head)
    real = os.path.realpath(prefix)
    if real == lexical(prefix):
        return None
    return "/".join([_glob_escape(real).rstrip("/"), *tail]) or "/"


@plugin(config_schema=CONFIG_SCHEMA)
def guards_plugin(scope: Scope, config: Any) -> Guards:
    """Entry point ``guards``: path and tool-name guards (no config: guards nothing)."""
    return Guards(scope, dict(config))


plugin = guards_plugin  # the entry point names ``dsh_plugins.guards:plugin``
