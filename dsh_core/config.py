"""Deployment configuration: TOML files composed into one effective :class:`Deployment`.

A deployment is described by one or more TOML files (``dsh --config base.toml
--config overlay.toml``). The first file is the base, later files are
overlays applied in order:

- tables deep-merge; scalars and lists replace;
- ``[[plugins]]`` and ``[[agents]]`` rows match by ``id``: a known id patches
  the row (given keys replace, and a plugin row's ``config`` is replaced
  *whole*), an unknown id inserts a new row (a plugin row then needs
  ``use``), ``enabled = false`` drops the row from the effective set and a
  later ``enabled = true`` brings it back; row order is first appearance;
  ``enabled = false`` alone for an id no earlier file defines is an
  unmatched overlay target (an error); when no file declares any agent, one
  implicit agent ``main`` stands in;
- ``DSH_TOOLS_MODE`` overrides ``tools.mode`` and ``DSH_HOME`` overrides
  ``sessions.home``, last.

Every effective leaf remembers where it came from: the file name as given,
``default`` for a built-in default, or ``env:NAME``. Every problem is a
:class:`~dsh_core.errors.ConfigError` whose message names the file, the row
id and the key path.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from attrs import asdict, define, evolve, field, frozen

# Checked with types-jsonschema when installed; "unused-ignore" keeps this
# line clean under --strict both with and without those stubs.
from jsonschema import Draft202012Validator  # type: ignore[import-untyped, unused-ignore]
from jsonschema.exceptions import ValidationError  # type: ignore[import-untyped, unused-ignore]

from dsh_core.bounds import is_positive_seconds
from dsh_core.errors import ConfigError
from dsh_core.lossless import JSON, find_loss, freeze, thaw
from dsh_core.schema import SchemaEvaluationError, check_schema, compile_validator, validation_errors
from dsh_core.terminal import TERMINAL_CONTROL

__all__ = [
    "MODES",
    "ISOLATION_LEVELS",
    "DEFAULT_SOURCE",
    "DEPLOYMENT_SCHEMA",
    "ToolsSection",
    "CodeRuntimeSection",
    "SessionsSection",
    "LifecycleSection",
    "AgentRow",
    "PluginRow",
    "Deployment",
    "load_deployment",
    "compose",
    "default_deployment",
    "validate_plugin_configs",
    "check_graces",
    "dump",
    "dump_text",
    "without_url_credentials",
    "has_url_credentials",
    "looks_like_secret_name",
]

#: The presentation modes a deployment or an agent may declare.
MODES: Final = ("native", "code", "both")
#: Code Mode isolation levels; ``auto`` picks the strongest available one.
ISOLATION_LEVELS: Final = ("auto", "L0", "L1", "L2", "L3")
#: Provenance of a value that no file or environment variable set.
DEFAULT_SOURCE: Final = "default"

_TOOLS_MODE_ENV: Final = "DSH_TOOLS_MODE"
_HOME_ENV: Final = "DSH_HOME"

# The character class excludes "\n", but Python's ``re.search`` (which
# jsonschema uses for ``pattern``) lets ``$`` match before a trailing newline;
# the lookahead closes that gap while staying a valid ECMA-262 pattern.
_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$(?!\n)"
_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_MODULE_PATTERN: Final = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$(?!\n)"
_BARE_KEY_RE: Final = re.compile(r"[A-Za-z0-9_-]+")

_ID_SCHEMA: Final[dict[str, Any]] = {
    "type": "string",
    "pattern": _ID_PATTERN,
    "description": "a valid id (letters, digits, '_', '.', '-', starting with a letter or digit)",
}
_NAMES_SCHEMA: Final[dict[str, Any]] = {"type": "array", "items": {"type": "string", "minLength": 1}}

#: The shape of one config file (Draft 2020-12). Every object is closed
#: (``additionalProperties: false``) except a plugin row's ``config``, which
#: belongs to the plugin and is checked later by :func:`validate_plugin_configs`.
DEPLOYMENT_SCHEMA: Final[dict[str, Any]] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "dsh deployment config file",
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "tools": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "mode": {"enum": list(MODES)},
                "max_parallel_sub_calls": {"type": "integer", "minimum": 1},
                "approval_timeout_s": {"type": "number", "exclusiveMinimum": 0},
                "approval_grace_s": {"type": "number", "exclusiveMinimum": 0},
            },
        },
        "code_runtime": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "isolation": {"enum": list(ISOLATION_LEVELS)},
                "timeout_s": {"type": "number", "exclusiveMinimum": 0},
                # The maxima are CodeRuntimeConfig's (MAX_CPU_S, MAX_MEMORY_MB), here so that the
                # config names the file and key; the runtime is not imported to load a config.
                "cpu_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e9},
                "memory_mb": {"type": "integer", "minimum": 1, "maximum": 1 << 30},
                "max_output_bytes": {"type": "integer", "minimum": 4},
                "preload": {
                    "type": "array",
                    "items": {
                        "type": "string",
                        "pattern": _MODULE_PATTERN,
                        "description": "a dotted Python module name",
                    },
                },
            },
        },
        "sessions": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "store": {"type": "string", "minLength": 1},
                "home": {"type": "string", "minLength": 1},
            },
        },
        "lifecycle": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "task_grace_s": {"type": "number", "exclusiveMinimum": 0},
            },
        },
        "agents": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["id"],
                "properties": {
                    "id": _ID_SCHEMA,
                    "enabled": {"type": "boolean"},
                    "mode": {"enum": list(MODES)},
                    "provider": {"type": "string", "minLength": 1},
                    "model": {"type": "string", "minLength": 1},
                    "max_turns": {"type": "integer", "minimum": 1},
                    "max_tool_result_chars": {"type": "integer", "minimum": 1},
                    "allow": _NAMES_SCHEMA,
                    "deny": _NAMES_SCHEMA,
                    "system_prompt": {"type": "string"},
                },
            },
        },
        "plugins": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["id"],
                "properties": {
                    "id": _ID_SCHEMA,
                    "use": {"type": "string", "minLength": 1},
                    "enabled": {"type": "boolean"},
                    "config": {"type": "object"},
                },
            },
        },
    },
}

# Checked against the metaschema by the tests, not here: that check costs every
# dsh command ~70 ms of start-up for a constant that cannot change at run time.
_FILE_VALIDATOR: Final = Draft202012Validator(DEPLOYMENT_SCHEMA)

_ROW_KINDS: Final = ("agents", "plugins")
_SECTIONS: Final = ("tools", "code_runtime", "sessions", "lifecycle")
#: The keys that are seconds: a positive, finite number (:func:`~dsh_core.bounds.is_positive_seconds`).
_SECONDS_KEYS: Final = (
    ("tools", "approval_timeout_s"),
    ("tools", "approval_grace_s"),
    ("code_runtime", "timeout_s"),
    ("lifecycle", "task_grace_s"),
)
_AGENT_FIELDS: Final = (
    "mode",
    "provider",
    "model",
    "max_turns",
    "max_tool_result_chars",
    "allow",
    "deny",
    "system_prompt",
)


# --------------------------------------------------------------------------- values


def _freeze_mapping(value: Mapping[str, Any]) -> JSON:
    # freeze() accepts only dicts (and returns frozen ones unchanged); callers may hand any Mapping.
    return freeze(value if isinstance(value, dict) else dict(value))


def _empty_config() -> JSON:
    return freeze({})


@frozen
class ToolsSection:
    """``[tools]``: the deployment-wide presentation mode, sub-call parallelism and approval bounds.

    ``approval_timeout_s``: seconds an approval ask waits for its answer before it is
    withdrawn and the call denied (``None``: no limit, the ask waits for the person).
    ``approval_grace_s``: seconds a withdrawn ask waits for its channel to end before
    leaving it running, named in a warning (the runtime's ``APPROVAL_GRACE_S`` by default);
    below ``[lifecycle] task_grace_s`` (:func:`check_graces`).
    """

    mode: str = "native"
    max_parallel_sub_calls: int = 10
    approval_timeout_s: float | None = None
    # The runtime's APPROVAL_GRACE_S (a test keeps them equal): loading a config imports no runtime.
    approval_grace_s: float = 5.0


@frozen
class CodeRuntimeSection:
    """``[code_runtime]``: isolation level and resource limits of Code Mode runs."""

    isolation: str = "auto"
    timeout_s: float = 600.0
    cpu_s: float = 60.0
    memory_mb: int = 512
    max_output_bytes: int = 64 * 1024 * 1024
    preload: tuple[str, ...] = ()


@frozen
class SessionsSection:
    """``[sessions]``: which session store to use and where dsh keeps its state.

    A relative ``home`` from a file read by :func:`load_deployment` is already
    joined to that file's directory; one from ``DSH_HOME`` is kept as given.
    """

    store: str = "sqlite"
    home: str | None = None


@frozen
class LifecycleSection:
    """``[lifecycle]``: how the harness's scopes (plugins, agents, runs) are unwound.

    ``task_grace_s``: seconds disposing a scope waits for the background tasks it cancelled
    before leaving the ones still running, each named in a warning (the scopes' ``TASK_GRACE_S``
    by default). It must be above ``[tools] approval_grace_s`` (:func:`check_graces`).
    """

    # dsh_core.scope's TASK_GRACE_S (a test keeps them equal), as for ToolsSection.approval_grace_s.
    task_grace_s: float = 10.0


@frozen
class AgentRow:
    """One effective ``[[agents]]`` row; ``None`` means "not set, inherit"."""

    id: str
    mode: str | None = None
    provider: str | None = None
    model: str | None = None
    max_turns: int | None = None
    #: Characters of one tool result the model sees (the agent loop's default when ``None``).
    max_tool_result_chars: int | None = None
    allow: tuple[str, ...] | None = None
    deny: tuple[str, ...] | None = None
    system_prompt: str | None = None


@frozen
class PluginRow:
    """One enabled ``[[plugins]]`` row: its id, entry-point name and (frozen) config."""

    id: str
    use: str
    # Frozen JSON objects are dicts, hence unhashable; equal rows still hash equal by id/use.
    config: JSON = field(factory=_empty_config, converter=_freeze_mapping, hash=False)


@frozen
class Deployment:
    """The effective deployment after composing every config file and the environment.

    ``provenance`` maps each dotted leaf path (``tools.mode``,
    ``agents[main].mode``, ``plugins[fs].config.root``) to its source: a file
    name as given (one that would read as either of the others is written
    ``./`` first), ``default`` or ``env:NAME``. It also holds
    ``plugins[<id>].config`` itself: the source whose ``config`` table won.

    ``config_dirs`` maps each source that is a file read by
    :func:`load_deployment` to the absolute directory it lives in, the base of
    relative paths in what it sets (see :meth:`config_dir`).
    """

    tools: ToolsSection = field(factory=ToolsSection)
    code_runtime: CodeRuntimeSection = field(factory=CodeRuntimeSection)
    sessions: SessionsSection = field(factory=SessionsSection)
    lifecycle: LifecycleSection = field(factory=LifecycleSection)
    agents: tuple[AgentRow, ...] = ()
    plugins: tuple[PluginRow, ...] = ()
    sources: tuple[str, ...] = (DEFAULT_SOURCE,)
    provenance: Mapping[str, str] = field(factory=dict, converter=_freeze_mapping, hash=False)
    config_dirs: Mapping[str, str] = field(factory=dict, converter=_freeze_mapping, hash=False)

    def source_of(self, path: str) -> str | None:
        """The source of the leaf at ``path`` (e.g. ``"tools.mode"``), or ``None``."""
        return self.provenance.get(path)

    def origin_of(self, path: str) -> str | None:
        """The file (or ``env:NAME``) that set ``path``, for an error to name: ``None`` for the built-in default too."""
        source = self.source_of(path)
        return None if source == DEFAULT_SOURCE else source

    def config_dir(self, plugin_id: str) -> Path | None:
        """The directory of the file whose ``config`` table plugin row ``plugin_id`` got, if a file set it.

        Relative paths in a row's config mean paths from this directory, as
        paths in tox's and pytest's config files do. ``None`` when the config
        came from no file (the default deployment, the environment, a
        document handed to :func:`compose`) or the row has none of its own.
        """
        source = self.source_of(f"plugins[{plugin_id}].config")
        directory = None if source is None else self.config_dirs.get(source)
        return None if directory is None else Path(directory)

    def plugin(self, id: str) -> PluginRow | None:
        """The enabled plugin row with this id, or ``None``."""
        return next((row for row in self.plugins if row.id == id), None)

    def agent(self, id: str) -> AgentRow | None:
        """The enabled agent row with this id, or ``None``."""
        return next((row for row in self.agents if row.id == id), None)


# --------------------------------------------------------------------------- paths


def _key(key: str) -> str:
    # Quote keys that would make a dotted path ambiguous, the way TOML does.
    return key if _BARE_KEY_RE.fullmatch(key) else _literal(key)


def _join(prefix: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{prefix}[{part}]"
    return f"{prefix}.{_key(part)}" if prefix else _key(part)


def _row_label(kind: str, row: object, index: int) -> str:
    row_id = row.get("id") if isinstance(row, Mapping) else None
    if isinstance(row_id, str) and _ID_RE.fullmatch(row_id):
        return f"{kind}[{row_id}]"
    # Rows without a usable id are named by their 1-based position instead.
    return f"{kind}[#{index + 1}]"


def _document_path(document: Mapping[str, Any], parts: Sequence[str | int]) -> str:
    """Render a path inside one parsed file, naming rows by id: ``plugins[fs].config.root``."""
    path = ""
    node: Any = document
    for depth, part in enumerate(parts):
        if depth == 1 and isinstance(part, int) and parts[0] in _ROW_KINDS:
            path = _row_label(str(parts[0]), node[part], part)
        else:
            path = _join(path, part)
        node = node[part]
    return path


def _pointer_parts(document: Any, pointer: str) -> list[str | int]:
    # A JSON pointer does not say whether "/0" is a key or an index; the document does.
    parts: list[str | int] = []
    node = document
    for raw in pointer.split("/")[1:]:
        token = raw.replace("~1", "/").replace("~0", "~")
        part: str | int = int(token) if isinstance(node, list) else token
        parts.append(part)
        node = node[part]
    return parts


# --------------------------------------------------------------------------- file shape


def _error_schema(error: ValidationError) -> Mapping[str, Any]:
    schema = error.schema
    return schema if isinstance(schema, Mapping) else {}


def _unknown_keys(error: ValidationError) -> list[tuple[list[str | int], str]]:
    """One (path, message) per unexpected key of an ``additionalProperties``/``unevaluatedProperties`` error.

    jsonschema reports extra keys at the parent object; naming each key
    instead gives the full key path (and lets its own provenance be found).
    """
    instance = error.instance
    if error.validator not in ("additionalProperties", "unevaluatedProperties") or not isinstance(instance, Mapping):
        return []
    known = sorted(_error_schema(error).get("properties", {}))
    hint = f"allowed: {', '.join(known)}" if known else "no keys are allowed here"
    parts: list[str | int] = list(error.absolute_path)

    def message(key: str) -> str:
        # A typo (max_turn, timeout) is the usual unknown key: name the key it most likely meant.
        close = difflib.get_close_matches(key, known, n=1) if isinstance(key, str) else []
        return f"unknown key (did you mean {close[0]!r}? {hint})" if close else f"unknown key ({hint})"

    # The message quotes each extra key with repr(); matching that reuses
    # jsonschema's own decision instead of re-implementing properties,
    # patternProperties and evaluation rules.
    return [([*parts, key], message(key)) for key in instance if repr(key) in error.message]


def _error_messages(error: ValidationError) -> list[tuple[list[str | int], str]]:
    """(path, message) pairs for one jsonschema error, with friendlier wording where it helps."""
    unknown = _unknown_keys(error)
    if unknown:
        return unknown
    parts: list[str | int] = list(error.absolute_path)
    description = _error_schema(error).get("description")
    if error.validator == "pattern" and description is not None:
        return [(parts, f"{error.instance!r} is not {description}")]
    return [(parts, error.message)]


def _sort_key(parts: Sequence[str | int]) -> list[tuple[int, int, str]]:
    return [(1, part, "") if isinstance(part, int) else (0, 0, part) for part in parts]


def _check_document(source: str, document: object) -> list[str]:
    """Every shape problem of one parsed file, each naming the file and the key path."""
    if not isinstance(document, Mapping):
        return [f"{source}: a config file must be a TOML table, got {type(document).__name__}"]
    document = dict(document)
    found: list[tuple[list[str | int], str]] = []
    for error in _FILE_VALIDATOR.iter_errors(document):
        kind = error.absolute_path[0] if len(error.absolute_path) == 1 else None
        if error.validator == "type" and kind in _ROW_KINDS and isinstance(error.instance, Mapping):
            # `[plugins]` for `[[plugins]]`: one bracket pair too few, the commonest TOML slip with rows.
            found.append(
                (
                    [kind],
                    f"is a table, not an array of tables: write each row as [[{kind}]] (double brackets), not [{kind}]",
                )
            )
            continue
        found.extend(_error_messages(error))
    found.sort(key=lambda item: (_sort_key(item[0]), item[1]))
    problems = [f"{source}: {_document_path(document, parts) or '(top level)'}: {msg}" for parts, msg in found]
    if problems:
        return problems
    # The shape is right; now refuse what JSON cannot carry (TOML dates and
    # times, inf/nan), wherever it hides, including inside a row's config.
    loss = find_loss(document)
    if loss is not None:
        parts = _pointer_parts(document, loss.path)
        return [f"{source}: {_document_path(document, parts)}: {loss.reason}"]
    for section, key in _SECONDS_KEYS:
        # The schema said a number above 0 and find_loss that it is finite; what is left is an integer
        # too large for a float (no TOML one is, a composed document's can be), which no timer can take.
        value = document.get(section, {}).get(key)
        if value is not None and not is_positive_seconds(value):
            shown = f"an integer of {len(str(value))} digits" if isinstance(value, int) else repr(value)
            problems.append(f"{source}: {section}.{key}: must be a positive, finite number of seconds, got {shown}")
    for kind in _ROW_KINDS:
        first_index: dict[str, int] = {}
        for index, row in enumerate(document.get(kind, ())):
            if row["id"] in first_index:
                problems.append(
                    f"{source}: {kind}[{row['id']}]: duplicate id "
                    f"(rows {first_index[row['id']] + 1} and {index + 1} of [[{kind}]])"
                )
            else:
                first_index[row["id"]] = index
    return problems


# --------------------------------------------------------------------------- composition


@define
class _Row:
    """Mutable merge state of one row while files are being composed."""

    id: str
    fields: dict[str, Any]
    sources: dict[str, str]
    enabled: bool
    enabled_source: str
    config: dict[str, Any]
    config_source: str


def _apply_row(rows: dict[str, _Row], kind: str, source: str, given: Mapping[str, Any]) -> str | None:
    """Insert or patch one row; return a problem message instead of applying a bad row."""
    row_id: str = given["id"]
    label = f"{kind}[{row_id}]"
    row = rows.get(row_id)
    if row is None:
        if set(given) == {"id", "enabled"} and given["enabled"] is False:
            return (
                f"{source}: {label}: unmatched overlay target: enabled = false names an id that no earlier file defines"
            )
        if kind == "plugins" and "use" not in given:
            return (
                f"{source}: {label}: a new plugin row needs `use` (an entry-point name in group "
                "dsh.plugins); no earlier file defines this id"
            )
        row = _Row(
            id=row_id,
            fields={},
            sources={"id": source},
            enabled=True,
            enabled_source=DEFAULT_SOURCE,
            config={},
            config_source=DEFAULT_SOURCE,
        )
        rows[row_id] = row
    for key, value in given.items():
        if key == "id":
            continue
        if key == "enabled":
            row.enabled, row.enabled_source = value, source
        elif key == "config":
            # Replaced whole, never deep-merged: a plugin's config is one
            # value its schema validates, and half of an old config merged
            # into a new one is a config nobody wrote.
            row.config, row.config_source = value, source
        else:
            row.fields[key] = value
            row.sources[key] = source
    return None


def _config_leaves(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
    """Leaves of a config value in document order: scalars, lists and empty tables."""
    for path, _, item in _keyed_config_leaves(prefix, value):
        yield path, item


def _keyed_config_leaves(prefix: str, value: Any) -> Iterator[tuple[str, bool, Any]]:
    """:func:`_config_leaves` with, for each leaf, whether a key on its way names a secret
    (:func:`looks_like_secret_name`)."""
    # Iterative on purpose: config values are arbitrary JSON, so depth must
    # not be bounded by the interpreter's recursion limit.
    stack: list[Iterator[tuple[str, bool, Any]]] = [iter([(prefix, False, value)])]
    while stack:
        for path, secret, item in stack[-1]:
            if isinstance(item, Mapping) and item:
                stack.append(
                    iter(
                        [
                            (_join(path, key), secret or looks_like_secret_name(key), child)
                            for key, child in item.items()
                        ]
                    )
                )
                break
            yield path, secret, item
        else:
            stack.pop()


def compose(documents: Sequence[tuple[str, Mapping[str, Any]]], *, env: Mapping[str, str] | None = None) -> Deployment:
    """Compose parsed config files (``(source name, TOML dict)``, base first) into a :class:`Deployment`.

    Every file is checked against :data:`DEPLOYMENT_SCHEMA` first; all problems
    of all files are reported together in one :class:`ConfigError`.
    """
    if not documents:
        raise ConfigError("no config given: pass at least one config file (or use the default deployment)")
    env = os.environ if env is None else env
    problems = [problem for source, document in documents for problem in _check_document(source, document)]
    if problems:
        raise ConfigError("\n".join(problems))

    sections: dict[str, dict[str, Any]] = {
        "tools": {"mode": "native", "max_parallel_sub_calls": 10, "approval_grace_s": ToolsSection().approval_grace_s},
        "code_runtime": {
            "isolation": "auto",
            "timeout_s": 600.0,
            "cpu_s": 60.0,
            "memory_mb": 512,
            "max_output_bytes": 64 * 1024 * 1024,
            "preload": [],
        },
        "sessions": {"store": "sqlite"},
        "lifecycle": {"task_grace_s": LifecycleSection().task_grace_s},
    }
    provenance: dict[str, str] = {
        f"{name}.{key}": DEFAULT_SOURCE for name, values in sections.items() for key in values
    }
    rows: dict[str, dict[str, _Row]] = {kind: {} for kind in _ROW_KINDS}
    for source, document in documents:
        for name in _SECTIONS:
            for key, value in document.get(name, {}).items():
                sections[name][key] = value
                provenance[f"{name}.{key}"] = source
        for kind in _ROW_KINDS:
            for given in document.get(kind, ()):
                problem = _apply_row(rows[kind], kind, source, given)
                if problem is not None:
                    problems.append(problem)

    mode = env.get(_TOOLS_MODE_ENV)
    if mode is not None:
        if mode in MODES:
            sections["tools"]["mode"] = mode
            provenance["tools.mode"] = f"env:{_TOOLS_MODE_ENV}"
        else:
            problems.append(f"{_TOOLS_MODE_ENV}={mode!r} must be one of {', '.join(MODES)}")
    home = env.get(_HOME_ENV)
    if home is not None:
        if home:
            sections["sessions"]["home"] = home
            provenance["sessions.home"] = f"env:{_HOME_ENV}"
        else:
            problems.append(f"{_HOME_ENV} is set but empty; unset it or name a directory")
    if problems:
        raise ConfigError("\n".join(problems))

    agents: list[AgentRow] = []
    for row in rows["agents"].values():
        if not row.enabled:
            continue
        values = row.fields
        agents.append(
            AgentRow(
                id=row.id,
                mode=values.get("mode"),
                provider=values.get("provider"),
                model=values.get("model"),
                max_turns=None if "max_turns" not in values else int(values["max_turns"]),
                max_tool_result_chars=(
                    None if "max_tool_result_chars" not in values else int(values["max_tool_result_chars"])
                ),
                allow=None if "allow" not in values else tuple(values["allow"]),
                deny=None if "deny" not in values else tuple(values["deny"]),
                system_prompt=values.get("system_prompt"),
            )
        )
        for key, key_source in row.sources.items():
            provenance[f"agents[{row.id}].{key}"] = key_source
        provenance[f"agents[{row.id}].enabled"] = row.enabled_source
    if not rows["agents"]:
        # No file declares any agent: the deployment still needs one to run.
        agents.append(AgentRow(id="main"))
        provenance["agents[main].id"] = DEFAULT_SOURCE
        provenance["agents[main].enabled"] = DEFAULT_SOURCE

    plugins: list[PluginRow] = []
    for row in rows["plugins"].values():
        if not row.enabled:
            continue
        plugins.append(PluginRow(id=row.id, use=row.fields["use"], config=row.config))
        prefix = f"plugins[{row.id}]"
        provenance[f"{prefix}.id"] = row.sources["id"]
        provenance[f"{prefix}.use"] = row.sources["use"]
        provenance[f"{prefix}.enabled"] = row.enabled_source
        provenance[f"{prefix}.config"] = row.config_source
        # One file's config won whole, so every leaf shares its source.
        for path, _ in _config_leaves(f"{prefix}.config", row.config):
            provenance[path] = row.config_source

    tools, runtime, sessions = sections["tools"], sections["code_runtime"], sections["sessions"]
    deployment = Deployment(
        tools=ToolsSection(
            mode=tools["mode"],
            max_parallel_sub_calls=int(tools["max_parallel_sub_calls"]),
            approval_timeout_s=(
                None if tools.get("approval_timeout_s") is None else float(tools["approval_timeout_s"])
            ),
            approval_grace_s=float(tools["approval_grace_s"]),
        ),
        code_runtime=CodeRuntimeSection(
            isolation=runtime["isolation"],
            timeout_s=float(runtime["timeout_s"]),
            cpu_s=float(runtime["cpu_s"]),
            memory_mb=int(runtime["memory_mb"]),
            max_output_bytes=int(runtime["max_output_bytes"]),
            preload=tuple(runtime["preload"]),
        ),
        sessions=SessionsSection(store=sessions["store"], home=sessions.get("home")),
        lifecycle=LifecycleSection(task_grace_s=float(sections["lifecycle"]["task_grace_s"])),
        agents=tuple(agents),
        plugins=tuple(plugins),
        sources=tuple(source for source, _ in documents),
        provenance=provenance,
    )
    check_graces(deployment)
    return deployment


def check_graces(deployment: Deployment) -> None:
    """Refuse ``[tools] approval_grace_s`` at or above ``[lifecycle] task_grace_s``: a :class:`ConfigError`.

    A tool call whose scope is disposed (its task cancelled) unwinds through its approval ask:
    the ask is withdrawn and a channel that ignores that is waited for up to the approval grace.
    The scope waits the task grace for the call's task, so with an approval grace as long or
    longer, the call would outlive its scope's dispose (left running, named in a warning). The
    message names both keys, their values and where each came from (when the deployment says).
    :func:`compose` checks this; so does the harness, for a :class:`Deployment` built in code.
    """
    approval, task = deployment.tools.approval_grace_s, deployment.lifecycle.task_grace_s
    if approval < task:
        return

    def shown(path: str, value: float) -> str:
        source = deployment.source_of(path)
        origin = "" if source is None else " (the default)" if source == DEFAULT_SOURCE else f" (from {source})"
        return f"{path} = {value:g}{origin}"

    raise ConfigError(
        f"{shown('tools.approval_grace_s', approval)} must be below {shown('lifecycle.task_grace_s', task)}: "
        "a tool call whose scope is disposed waits out the approval grace for an approval channel that ignores "
        "its withdrawal, and would outlive the scope's wait for it; "
        "lower [tools] approval_grace_s or raise [lifecycle] task_grace_s"
    )


#: What a source label that names no file starts with: ``env:NAME``.
_ENV_SOURCE_PREFIX: Final = "env:"


def _file_label(path: str | Path) -> str:
    """The provenance label of the config file at ``path``: the path as given, unless it reads as another label.

    A file given as ``default`` (or ``env:X``) would carry the label of the built-in defaults (or of
    that variable): its values would be dumped as built in and its errors would name no file. The
    same file as ``./default`` reads as nothing else.
    """
    source = os.fspath(path)
    if source == DEFAULT_SOURCE or source.startswith(_ENV_SOURCE_PREFIX):
        return os.path.join(os.curdir, source)
    return source


def _read(path: str | Path) -> tuple[str, dict[str, Any]]:
    source = _file_label(path)
    try:
        with open(source, "rb") as handle:
            data = handle.read()
        if data.startswith(b"\xef\xbb\xbf"):
            # tomllib would say only "Invalid statement (at line 1, column 1)", at an invisible character.
            raise ConfigError(
                f"{source}: invalid TOML: the file starts with a UTF-8 byte order mark (BOM), "
                "which TOML does not allow; save it as UTF-8 without a BOM"
            )
        return source, tomllib.loads(data.decode())
    except FileNotFoundError:
        raise ConfigError(f"{source}: config file not found") from None
    except tomllib.TOMLDecodeError as error:
        # The parser's message carries the line and column.
        raise ConfigError(f"{source}: invalid TOML: {error}") from None
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise ConfigError(f"{source}: cannot parse: arrays or inline tables nest too deeply") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{source}: invalid TOML: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise ConfigError(f"{source}: cannot read config file: {error.strerror or error}") from None


def load_deployment(paths: Sequence[str | Path], *, env: Mapping[str, str] | None = None) -> Deployment:
    """Read the TOML files in ``paths`` (base first, then overlays) and :func:`compose` them.

    Provenance names each file exactly as given in ``paths``, except that one
    given as ``default`` or ``env:...`` is named ``./default`` (``./env:...``),
    never to be taken for the built-in defaults or a variable; ``config_dirs``
    records each file's directory, made absolute now, so relative paths in a
    file keep meaning paths from that file whatever the working directory is later.
    A relative ``[sessions] home`` is joined to the directory of the file that
    set it here (``DSH_HOME`` stays as given: a path from the working directory).
    """
    deployment = compose([_read(path) for path in paths], env=env)
    directories = {_file_label(path): str(Path(path).absolute().parent) for path in paths}
    deployment = evolve(deployment, config_dirs=directories)
    home, source = deployment.sessions.home, deployment.source_of("sessions.home")
    if home is not None and source in directories and not Path(home).expanduser().is_absolute():
        deployment = evolve(deployment, sessions=evolve(deployment.sessions, home=str(Path(directories[source], home))))
    return deployment


def default_deployment(workspace_root: str | Path, *, env: Mapping[str, str] | None = None) -> Deployment:
    """The built-in deployment used when no config file is given.

    The built-in plugins with ``workspace_root`` as the workspace, the
    ``workspace-write`` approval preset, the ``scripted`` provider and the
    ``sqlite-sessions`` store, one scripted ``main`` agent and mode ``native``
    (``DSH_TOOLS_MODE`` and ``DSH_HOME`` still apply). Every value's provenance
    is ``default``, except that ``DSH_BASE_URL`` adds an ``openai`` provider row
    (``DSH_MODEL``, key in ``DSH_API_KEY``) and makes it ``main``'s provider,
    with provenance ``env:DSH_BASE_URL``; without it, ``DSH_MODEL`` or
    ``DSH_API_KEY`` set the scripted row's ``endpoint_vars`` (their names) so
    its no-model notice says the endpoint is half configured. ``env``
    (default ``os.environ``) is the only environment read.
    """
    root = str(Path(workspace_root).absolute())
    document: dict[str, Any] = {
        "agents": [{"id": "main", "provider": "scripted"}],
        "plugins": [
            {"id": "workspace", "use": "workspace", "config": {"root": root}},
            {"id": "bash", "use": "bash", "config": {"root": root}},
            {"id": "approval", "use": "approval", "config": {"preset": "workspace-write", "root": root}},
            {"id": "guards", "use": "guards", "config": {"root": root}},
            {"id": "code-mode", "use": "code-mode"},
            {"id": "scripted", "use": "scripted"},
            {"id": "sessions", "use": "sqlite-sessions"},
        ],
    }
    documents: list[tuple[str, Mapping[str, Any]]] = [(DEFAULT_SOURCE, document)]
    # DSH_BASE_URL (+ DSH_MODEL, and the key in DSH_API_KEY) points the main agent at an
    # OpenAI-compatible endpoint; as an overlay, its values keep their env provenance.
    environ = os.environ if env is None else env
    base_url = environ.get("DSH_BASE_URL")
    partial = [name for name in ("DSH_MODEL", "DSH_API_KEY") if environ.get(name)]
    if partial and not base_url:
        # Half an endpoint: the scripted provider's notice says which half, from this env (not the
        # process's, which it would read at request time otherwise). Names only: never the key.
        documents.append((f"env:{partial[0]}", {"plugins": [{"id": "scripted", "config": {"endpoint_vars": partial}}]}))
    if base_url:
        endpoint: dict[str, Any] = {"base_url": base_url, "api_key_env": "DSH_API_KEY"}
        if environ.get("DSH_MODEL"):
            endpoint["model"] = environ["DSH_MODEL"]
        documents.append(
            (
                "env:DSH_BASE_URL",
                {
                    "agents": [{"id": "main", "provider": "openai"}],
                    "plugins": [{"id": "openai", "use": "openai", "config": endpoint}],
                },
            )
        )
    return compose(documents, env=env)


# --------------------------------------------------------------------------- plugin configs


def _blame(deployment: Deployment, row: PluginRow, path: str) -> str:
    """The source that set the config leaf at ``path``, else the source of the row's config."""
    # Configs are replaced whole, so every leaf of a row's config shares the
    # source of ``plugins[<id>].config``; the exact lookup is only a shortcut
    # for leaves, and the fallback covers inner paths (a missing required key,
    # an item inside a list leaf).
    source = deployment.source_of(path) or deployment.source_of(f"plugins[{row.id}].config")
    use_source = deployment.source_of(f"plugins[{row.id}].use")
    if source is None or source == DEFAULT_SOURCE:
        # A row that never got a config of its own is blamed on the file that added it.
        return use_source or source or DEFAULT_SOURCE
    order = deployment.sources
    if use_source in order and source in order and order.index(use_source) > order.index(source):
        # A later file set the row's plugin and kept this config, maybe written for another one: naming
        # only the config's file would blame a file that may be right for the plugin it chose.
        return f"{source}; the row's use = {row.use!r} is from {use_source}, a later file"
    return source


def validate_plugin_configs(
    deployment: Deployment, schema_for: Callable[[PluginRow], Mapping[str, Any] | None]
) -> None:
    """Validate each enabled row's ``config`` against its plugin's Draft 2020-12 schema.

    ``schema_for(row)`` returns the plugin's config schema, or ``None`` when
    the plugin takes no config (then only an empty config is accepted). All
    violations of all rows are collected into one :class:`ConfigError`, one per
    line: ``plugins[<id>].config.<path>: <message> (from <file>)``; when a later
    file set the row's ``use`` and kept that config, it is named too. An invalid
    plugin schema raises :class:`~dsh_core.errors.SchemaDefinitionError`.
    """
    problems: list[str] = []
    for row in deployment.plugins:
        prefix = f"plugins[{row.id}].config"
        schema = schema_for(row)
        found: list[tuple[list[str | int], str]] = []
        if schema is None:
            found = [([key], f"unknown key (plugin {row.use!r} takes no config)") for key in row.config]
        else:
            check_schema(schema, owner=f"plugin {row.use!r} (row {row.id!r}) config")
            try:
                errors = validation_errors(compile_validator(schema), row.config)
            except SchemaEvaluationError as failed:
                # A recursive schema meeting a deep config, or a $ref cycle in the schema: one line
                # naming the row and its file, never a raw RecursionError out of the harness.
                problems.append(
                    f"{prefix}: cannot be checked against the config schema of plugin {row.use!r}: "
                    f"{failed} (from {_blame(deployment, row, prefix)})"
                )
                continue
            for error in errors:
                found.extend(_error_messages(error))
        found.sort(key=lambda item: (_sort_key(item[0]), item[1]))
        for parts, message in found:
            path = prefix
            for part in parts:
                path = _join(path, part)
            problems.append(f"{path}: {message} (from {_blame(deployment, row, path)})")
    if problems:
        raise ConfigError("\n".join(problems))


# --------------------------------------------------------------------------- dump


#: The user name and password of a URL (``https://user:secret@host``): everything of its authority
#: up to the last ``@`` (greedy, so ``https://a@b@host`` hides ``a@b`` too, as a URL parser reads it).
_URL_CREDENTIALS: Final = re.compile(r'(?<=://)[^/\s"]*@')


def without_url_credentials(text: str) -> str:
    """``text`` with the user and password of every URL in it written as ``***``.

    For what is shown to a person or a log (a config dump, a provider's error): a base URL may
    carry credentials, which must reach only the request itself.
    """
    return _URL_CREDENTIALS.sub("***@", text)


def has_url_credentials(text: str) -> bool:
    """True when ``text`` holds a URL with user information: what :func:`without_url_credentials` hides.

    Any user information counts, a user name alone too: a token is often written where the user name
    goes (``https://ghp_...@github.com``), and no rule can tell the two apart.
    """
    return _URL_CREDENTIALS.search(text) is not None


#: Parts that make a name a secret's wherever they stand, inside a word too (``PGPASSWORD``, ``GITHUBTOKEN``,
#: ``max_tokens``, ``TOKENIZER_PATH``, ``x-apikey``).
_SECRET_PARTS: Final = (
    "password",
    "passwd",
    "passphrase",
    "secret",
    "credential",
    "token",
    "apikey",
    "authorization",
    "cookie",
)
#: Pairs of words that do so wherever they stand (``AWS_ACCESS_KEY_ID``, ``privateKeyPath``, ``DATABASE_URL``),
#: found in the name's words joined by ``_``: ``API_KEY``, ``apiKey`` and ``api-key`` alike.
_SECRET_PHRASES: Final = ("api_key", "private_key", "access_key", "session_key", "database_url")
#: Words that do so as a name's last word only (``SIGNING_KEY``, ``privateKey``, ``SSH_KEYS``, ``DB_PASS``,
#: ``PG_DSN``); not ``KEY_ID``, ``PASS_THROUGH``.
_SECRET_LAST_WORDS: Final = frozenset({"key", "keys", "pass", "dsn"})
_NAME_WORDS: Final = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def looks_like_secret_name(name: str) -> bool:
    """True for a name (an environment variable's, a config key) whose value is a secret.

    The one rule for what the bash plugin keeps out of a command's environment and what
    ``config dump`` hides. A name is split into words at separators and case changes
    (``privateKey`` is *private key*, ``SSH_AUTH_SOCK`` is *ssh auth sock*), and case is ignored.
    A name is a secret's when:

    - it holds ``password``, ``passwd``, ``passphrase``, ``secret``, ``credential``, ``token``,
      ``apikey``, ``authorization`` or ``cookie`` anywhere, inside a word too (``PGPASSWORD``,
      ``TOKENIZER_PATH``; ``max_tokens`` costs nothing: a number is never hidden);
    - two of its words say *api key*, *private key*, *access key*, *session key* or *database url*
      (``AWS_ACCESS_KEY_ID``, ``OPENAI_API_KEY_FILE``, ``DATABASE_URL``), unless its last word is ``env``;
    - its last word is ``key``, ``keys``, ``pass`` or ``dsn`` (``STRIPE_KEY``, ``SSH_KEYS``, ``SMTP_PASS``);
    - a word is ``pwd`` (``MYSQL_PWD``, ``PWD_FILE``), unless the name is ``PWD``;
    - a word is ``auth``, unless it is the first of several (``SSH_AUTH_SOCK``, ``basicAuth``,
      ``auth``; not ``auth_mode``);
    - its first word is ``aws`` and more follow (every ``AWS_*`` variable: the CLI's settings sit
      beside its keys).

    This names a secret wherever the bash plugin's patterns or the dump's words used to, judged as
    words (a ``_`` at a name's edge no longer counts: ``_AUTH_MODE`` is *auth mode*), save two
    deliberate exceptions. ``PWD`` (so written: the shell's variable) is the working directory,
    not a password, though the dump hid it as a ``pwd`` word. And a name ending in ``env``, such
    as a provider's ``api_key_env``, names the variable that holds a key, not the key, though bash
    refused ``*API_KEY*`` wherever it stood; only the word pairs give way there, so
    ``GITHUB_TOKEN_ENV``, which both hid, still names a secret.
    """
    lower = name.lower()
    if any(part in lower for part in _SECRET_PARTS):
        return True
    words = [word.lower() for word in _NAME_WORDS.findall(name)]
    if not words:
        return False
    joined = "_".join(words)
    return (
        (words[-1] != "env" and any(phrase in joined for phrase in _SECRET_PHRASES))
        or words[-1] in _SECRET_LAST_WORDS
        or ("pwd" in words and name != "PWD")
        or "auth" in words[1:]
        or words == ["auth"]
        or (words[0] == "aws" and len(words) > 1)
    )


def _plain(value: Any, *, secret: bool = False) -> JSON:
    """A dump leaf as plain JSON, with every URL's credentials written as ``***``.

    With ``secret`` (the leaf's key, or one above it, names a secret) every non-empty text in it is ``***``.
    """

    def shown(text: str) -> str:
        return "***" if secret and text else without_url_credentials(text)

    if isinstance(value, str):
        return shown(value)
    if not isinstance(value, (list, tuple, Mapping)):
        return value
    plain: Any = thaw(list(value) if isinstance(value, tuple) else value)  # a fresh mutable copy
    pending = [plain]  # iterative: config values are arbitrary JSON, of any depth
    while pending:
        node = pending.pop()
        for key, child in list(node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(child, str):
                node[key] = shown(child)
            elif isinstance(child, (list, dict)):
                pending.append(child)
    return plain


def dump(deployment: Deployment) -> list[tuple[str, JSON, str]]:
    """Every effective leaf as ``(dotted path, value, source)``.

    Order is stable: tools, code_runtime, sessions, lifecycle, then agents and plugins
    in row order. Unset optional values (``None``) are left out; a plugin's
    empty config appears as one ``{}`` leaf. The user and password of a URL
    (``https://user:secret@host``, say a provider's base URL) are shown as ``***``,
    and so is the text of a plugin config value whose key (or a key above it) names
    a secret: a password, token, API key, credential or ``Authorization`` header
    (``env.GITHUB_TOKEN``, ``api_key``; not ``api_key_env``, which names a variable).
    """
    leaves: list[tuple[str, bool, Any]] = []
    for name, section in (
        ("tools", deployment.tools),
        ("code_runtime", deployment.code_runtime),
        ("sessions", deployment.sessions),
        ("lifecycle", deployment.lifecycle),
    ):
        leaves.extend((f"{name}.{key}", False, value) for key, value in asdict(section, recurse=False).items())
    for agent in deployment.agents:
        prefix = f"agents[{agent.id}]"
        leaves.extend([(f"{prefix}.id", False, agent.id), (f"{prefix}.enabled", False, True)])
        leaves.extend((f"{prefix}.{key}", False, getattr(agent, key)) for key in _AGENT_FIELDS)
    for plugin in deployment.plugins:
        prefix = f"plugins[{plugin.id}]"
        leaves.extend(
            [
                (f"{prefix}.id", False, plugin.id),
                (f"{prefix}.use", False, plugin.use),
                (f"{prefix}.enabled", False, True),
            ]
        )
        leaves.extend(_keyed_config_leaves(f"{prefix}.config", plugin.config))
    return [
        (path, _plain(value, secret=secret), deployment.source_of(path) or "unknown")
        for path, secret, value in leaves
        if value is not None
    ]


def _escaped(text: str) -> str:
    """``text`` with what would drive a terminal as its ``\\uXXXX`` escape (in a JSON literal: the same value)."""
    return TERMINAL_CONTROL.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


def _literal(value: Any) -> str:
    return _escaped(json.dumps(value, ensure_ascii=False))


_DUMP_ALIGN: Final = 60


def dump_text(deployment: Deployment) -> str:
    """The effective config as text, one leaf per line: ``tools.mode = "code"  # overlay.toml``.

    Values are JSON literals (which TOML also reads for strings, numbers,
    booleans and arrays); the ``#`` comments are aligned up to a width of 60.
    """
    lines = [(f"{path} = {_literal(value)}", source) for path, value, source in dump(deployment)]
    width = min(max((len(text) for text, _ in lines), default=0), _DUMP_ALIGN)
    return "\n".join(f"{text.ljust(width)}  # {_escaped(source)}" for text, source in lines)
