"""Plugin discovery and start-up: entry points in ``dsh.plugins``, one instance per config row.

An entry point resolves to a *plugin factory*: a plain (never ``async def``)
function ``factory(scope, config)`` that receives the plugin's own lifecycle scope and its validated config and
returns an object with ``@hookimpl`` methods (or ``None``). Everything the
instance registers is owned by its scope; if start-up fails anywhere, the
scope is disposed and nothing stays half-registered.

Built-in plugins are found through the same group as third-party ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from types import MappingProxyType
from typing import Any, Final, Protocol

from attrs import frozen

from dsh_core.errors import DshError, PluginLoadError, describe_callable, describe_exception
from dsh_core.hooks import REGISTRATION_HOOKS, Hooks, PluginObjectInUse, own_cancellation
from dsh_core.lossless import JSON, FrozenDict, FrozenList, freeze
from dsh_core.schema import check_schema
from dsh_core.scope import Scope

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginFactory",
    "PluginSource",
    "PluginCatalog",
    "plugin",
    "start_plugin",
    "installed_entry_points",
    "config_schema_of",
    "CONFIG_DIR_SERVICE",
]

#: The entry-point group every dsh plugin (built-in or third-party) is found in.
ENTRY_POINT_GROUP: Final = "dsh.plugins"

#: The scope service (``scope.lookup(CONFIG_DIR_SERVICE)``) a plugin resolves relative paths of its
#: config against: the :class:`pathlib.Path` of the directory of the config file that set its row's
#: ``config``, or ``None`` when no file did (the default deployment, the environment).
CONFIG_DIR_SERVICE: Final = "config_dir"

#: The config schema of a plugin that declares none: only an empty table is valid.
NO_CONFIG_SCHEMA: Final = {"type": "object", "additionalProperties": False}


class PluginFactory(Protocol):
    """``factory(scope, config) -> plugin object | None`` (a plain function); may carry ``config_schema``."""

    def __call__(self, scope: Scope, config: JSON) -> object | None: ...


def plugin(*, config_schema: Mapping[str, Any] | None = None) -> Callable[[Callable[..., Any]], Any]:
    """Mark a function as a plugin factory and declare its config's JSON Schema.

    >>> @plugin(config_schema={"type": "object", "properties": {"root": {"type": "string"}},
    ...                        "additionalProperties": False})
    ... def make(scope, config):
    ...     return MyPlugin(config)

    The schema is checked when the decorator is applied (a valid Draft 2020-12
    schema whose every ``$ref`` resolves inside it); a
    :class:`~dsh_core.errors.SchemaDefinitionError` names the factory. The
    factory keeps a frozen deep copy of it.
    """

    def mark(factory: Callable[..., Any]) -> Any:
        schema = config_schema
        if schema is not None:
            # Checked where it is declared, naming the factory: a broken schema fails the import of its
            # module, not a later deployment that happens to configure it.
            check_schema(schema, owner=f"plugin factory {describe_callable(factory)} config schema")
            # A detached, immutable snapshot: a later change to the caller's (often shared) dict
            # must not change what configs the plugin accepts.
            schema = freeze(schema)
        factory.config_schema = schema  # type: ignore[attr-defined]
        return factory

    return mark


def config_schema_of(factory: object) -> Mapping[str, Any]:
    """The declared config schema of a factory (a strict empty-object schema if none)."""
    schema: Mapping[str, Any] | None = getattr(factory, "config_schema", None)
    return NO_CONFIG_SCHEMA if schema is None else schema


@frozen
class PluginSource:
    """Where a plugin comes from: entry-point name and value, its distribution or ``origin`` (``DSH_PLUGINS``)."""

    name: str
    value: str
    distribution: str | None
    origin: str | None = None

    def describe(self) -> str:
        """``name (module:attr from distribution dist 1.0)``, or ``... from DSH_PLUGINS``."""
        if self.distribution:
            where = f" from distribution {self.distribution}"
        else:
            where = f" from {self.origin}" if self.origin else ""
        return f"{self.name!r} ({self.value}{where})"


def installed_entry_points() -> tuple[list[metadata.EntryPoint], tuple[str, ...]]:
    """The installed entry points of :data:`ENTRY_POINT_GROUP`, and each distribution whose entry points cannot be read.

    A distribution is named ``name version (error)``; its plugins are left out, so a row using one is an unknown plugin
    and fails the boot (the message names the distribution).
    """
    try:
        return list(metadata.entry_points(group=ENTRY_POINT_GROUP)), ()
    except Exception:  # whatever one distribution's malformed file makes importlib raise
        pass
    # One malformed entry_points.txt, of any package and any group, fails that call as a whole with an error
    # naming no package (a line without "=" is a bare TypeError): read each distribution on its own instead.
    found: list[metadata.EntryPoint] = []
    unreadable: list[str] = []
    seen: set[str] = set()
    for dist in metadata.distributions():
        name: str | None = dist.name
        key = re.sub(r"[-_.]+", "-", name).lower() if name else None
        if key is not None:
            # Only the first of a name on sys.path counts, as importlib.metadata.entry_points() has it.
            if key in seen:
                continue
            seen.add(key)
        try:
            found.extend(dist.entry_points.select(group=ENTRY_POINT_GROUP))
        except Exception as error:  # as above
            unreadable.append(f"{name} {dist.version} ({describe_exception(error)})")
    return found, tuple(unreadable)


def _distribution_of(entry_point: metadata.EntryPoint) -> str | None:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return None
    return f"{dist.metadata['Name']} {dist.version}"


#: ``DSH_PLUGINS="name=module:attr,other=pkg.mod:factory"`` adds uninstalled plugins (for plugin development).
PLUGINS_ENV: Final = "DSH_PLUGINS"


def _dotted_name(text: str) -> bool:
    return all(part.isidentifier() for part in text.split("."))


def _env_entry_points(environ: Mapping[str, str]) -> list[metadata.EntryPoint]:
    spec = environ.get(PLUGINS_ENV, "").strip()
    if not spec:
        return []
    found = []
    for item in spec.split(","):
        if not item.strip():
            continue  # "a=m:f," or ",a=m:f", as ``DSH_PLUGINS="$DSH_PLUGINS,a=m:f"`` builds it
        name, sep, value = item.strip().partition("=")
        module, colon, attribute = value.strip().partition(":")
        # Each side a dotted name: anything else (a path, a space-separated list) would fail only
        # when loaded, as an AttributeError from inside importlib that names neither mistake.
        if (
            not sep
            or not name.strip()
            or not colon
            or not _dotted_name(module.strip())
            or not _dotted_name(attribute.strip())
        ):
            raise PluginLoadError(f"{PLUGINS_ENV}: {item.strip()!r} is not of the form name=module:attribute")
        found.append(metadata.EntryPoint(name.strip(), value.strip(), ENTRY_POINT_GROUP))
    return found


class PluginCatalog:
    """The plugins that can be used: entry points of :data:`ENTRY_POINT_GROUP`, plus extras.

    ``extra`` maps names to factories directly (tests, embedding). Loading is
    lazy: only plugins a deployment uses are imported. :meth:`load` always
    raises on failure (a :class:`~dsh_core.harness.Harness` loads every
    configured row with it: a row that cannot load fails the boot);
    :meth:`try_load`, for callers that only survey plugins, reports and skips
    instead unless ``strict``.
    """

    def __init__(
        self,
        *,
        entry_points: Iterable[metadata.EntryPoint] | None = None,
        extra: Mapping[str, Callable[..., Any]] | None = None,
        strict: bool = False,
        report: Callable[[str], None] | None = None,
    ) -> None:
        self.strict = strict
        self._report = report or (lambda text: print(text, file=sys.stderr))
        self._entry_points: dict[str, metadata.EntryPoint] = {}
        self._sources: dict[str, PluginSource] = {}
        self._loaded: dict[str, Callable[..., Any]] = {}
        #: Each installed distribution whose entry points could not be read, as ``name version (error)``.
        self.unreadable: tuple[str, ...] = ()
        from_env: list[metadata.EntryPoint] = []
        if entry_points is None:
            from_env = _env_entry_points(os.environ)
            installed, self.unreadable = installed_entry_points()
            found = [*installed, *from_env]
        else:
            found = list(entry_points)
        env_ids = {id(entry_point) for entry_point in from_env}
        duplicates: dict[str, list[PluginSource]] = {}
        seen_values: dict[str, str] = {}
        for entry_point in found:
            source = PluginSource(
                entry_point.name,
                entry_point.value,
                _distribution_of(entry_point),
                PLUGINS_ENV if id(entry_point) in env_ids else None,
            )
            if entry_point.name in self._entry_points:
                # The same distribution can be visible twice on sys.path (an editable install plus a
                # build directory); only different targets are a real conflict.
                if seen_values.get(entry_point.name) == entry_point.value:
                    continue
                duplicates.setdefault(entry_point.name, [self._sources[entry_point.name]]).append(source)
                continue
            self._entry_points[entry_point.name] = entry_point
            self._sources[entry_point.name] = source
            seen_values[entry_point.name] = entry_point.value
        if duplicates:
            lines = [f"{name}: " + ", ".join(s.describe() for s in sources) for name, sources in duplicates.items()]
            involved = [source for sources in duplicates.values() for source in sources]
            hint = (
                "rename the DSH_PLUGINS entry"
                if any(s.origin == PLUGINS_ENV for s in involved)
                else "name entry points after their distribution"
            )
            raise PluginLoadError(
                f"duplicate plugin entry-point names in group {ENTRY_POINT_GROUP!r} (each name must be unique; "
                f"{hint}): " + "; ".join(lines)
            )
        for name, factory in (extra or {}).items():
            self._loaded[name] = factory
            self._sources[name] = PluginSource(name, f"{factory.__module__}:{factory.__qualname__}", None)

    def names(self) -> list[str]:
        """Every plugin name, sorted."""
        return sorted(self._sources)

    def source(self, name: str) -> PluginSource:
        """Where ``name`` comes from (``KeyError`` if unknown)."""
        return self._sources[name]

    def __contains__(self, name: object) -> bool:
        return name in self._sources

    def unknown(self, name: str) -> str:
        """Why ``name`` is no plugin: ``unknown plugin 'x' (known: ...)``, naming the unreadable distributions too."""
        text = f"unknown plugin {name!r} (known: {', '.join(self.names()) or 'none'}"
        if self.unreadable:
            # One of them may be the one that ships it: its entry points were left out, unread.
            text += f"; the entry points of these distributions could not be read: {'; '.join(self.unreadable)}"
        return text + ")"

    def load(self, name: str) -> Callable[..., Any]:
        """Import and return a plugin factory; :class:`PluginLoadError` names the distribution on failure."""
        if name in self._loaded:
            return self._loaded[name]
        entry_point = self._entry_points.get(name)
        if entry_point is None:
            raise PluginLoadError(self.unknown(name))
        source = self._sources[name]
        try:
            factory: Callable[..., Any] = entry_point.load()
        except (Exception, SystemExit) as error:
            # SystemExit too: a module that exits on import ("requires X") would otherwise end dsh with its
            # status (0 included) and no word of which plugin did it.
            raise PluginLoadError(f"plugin {source.describe()} failed to load: {_describe_failure(error)}") from error
        if not callable(factory):
            raise PluginLoadError(f"plugin {source.describe()} is not a factory: {type(factory).__name__}")
        try:
            check_schema(config_schema_of(factory), owner=f"plugin {name!r} config schema")
        except DshError as error:
            raise PluginLoadError(error.message) from None
        self._loaded[name] = factory
        return factory

    def try_load(self, name: str) -> Callable[..., Any] | None:
        """:meth:`load`, but report and return ``None`` on failure unless strict."""
        try:
            return self.load(name)
        except PluginLoadError as error:
            if self.strict:
                raise
            self._report(f"dsh: warning: {error.message}; skipped")
            return None


def _describe_failure(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return f"SystemExit: sys.exit({error.code!r}) was called"
    # Never str(error) directly: an exception whose __str__ raises would replace the plugin's failure
    # with a traceback of its own, naming no plugin.
    return describe_exception(error)


Registrars = Mapping[str, Callable[[Scope, str], Callable[..., None]]]

#: What a factory may return by mistake (its config, a flag, a name) and no plugin object ever is. Exact
#: types, matched by ``type(...) in``: a plugin class may subclass ``dict`` and carry hook implementations.
_DATA_VALUES: Final = frozenset(
    {
        str,
        bytes,
        bytearray,
        bool,
        int,
        float,
        complex,
        dict,
        MappingProxyType,
        list,
        tuple,
        set,
        frozenset,
        FrozenDict,
        FrozenList,
    }
)


async def start_plugin(
    *,
    plugin_id: str,
    factory: Callable[..., Any],
    config: JSON,
    parent: Scope,
    hooks: Hooks,
    registrars: Registrars,
    source: PluginSource | None = None,
    services: Mapping[str, object] | None = None,
    origin: str | None = None,
    config_origin: str | None = None,
) -> Scope:
    """Create the plugin's scope, build its instance, register its hooks and call its registration hooks.

    ``registrars`` maps a registration hook name to ``make(scope, plugin_id)``
    returning that hook's ``register`` callable. ``services`` are provided in
    the plugin's scope before its factory runs (e.g. :data:`CONFIG_DIR_SERVICE`).
    On any failure the scope is disposed (nothing stays registered) and
    :class:`PluginLoadError` names the row, the config file that set it
    (``origin``, if given), the plugin, and the file that set its ``config``
    (``config_origin``) where that is another one: an overlay's config is the
    usual cause of a failed start, and the row's own file shows a different one.
    """
    scope = parent.child(f"plugin:{plugin_id}")
    for key, service in (services or {}).items():
        scope.provide(key, service)
    what = (
        f"plugin row {plugin_id!r}"
        + (f" of {origin}" if origin else "")
        + (f" (use {source.describe()})" if source else "")
        + (f" with its config from {config_origin}" if config_origin and config_origin != origin else "")
    )
    try:
        # What a factory or a registration hook prints goes to stderr, as what its module prints on
        # import does (load_plugins): stdout is the command's output (`dsh tools list --json`).
        # Nothing here awaits, so no other task writes to stdout meanwhile.
        with contextlib.redirect_stdout(sys.stderr):
            instance = factory(scope, config)
            if inspect.isawaitable(instance):
                # Registering the coroutine would register no hook at all: the plugin's tools and
                # guards would silently not exist. Refuse it, and close (or cancel) it so it
                # neither warns nor runs on later.
                returned = (
                    "a coroutine" if inspect.iscoroutine(instance) else f"an awaitable ({type(instance).__name__})"
                )
                if inspect.iscoroutine(instance):
                    instance.close()
                elif isinstance(instance, asyncio.Future):  # a task it started: nothing else would stop it
                    instance.cancel()
                raise PluginLoadError(
                    f"its factory {describe_callable(factory)} returned {returned} (is it `async def`?); a plugin "
                    "factory must be a plain function returning the plugin object or None (start async work "
                    "with scope.spawn(...))"
                )
            if type(instance) in _DATA_VALUES:
                # pluggy finds no hook in a value, so registering it would drop the plugin as silently as
                # a coroutine. The value is not shown: a factory that returned its config would print it.
                raise PluginLoadError(
                    f"its factory {describe_callable(factory)} returned a {type(instance).__name__} (a data value), "
                    "not a plugin object: a plugin factory returns the object whose @hookimpl methods make up "
                    "the plugin, or None"
                )
            if instance is not None:
                try:
                    hooks.register(instance, name=plugin_id, scope=scope)
                except PluginObjectInUse as error:
                    # Rows register under their ids, so the other name is the row that has this object.
                    if error.equal:
                        raise PluginLoadError(
                            f"its factory returned an object equal to the one plugin row {error.other!r} uses; "
                            "pluggy compares plugin objects with ==, so give the plugin class identity "
                            "equality (attrs or dataclass eq=False)"
                        ) from None
                    raise PluginLoadError(
                        f"its factory returned the object plugin row {error.other!r} already uses; a factory must "
                        "build a new instance for each row (every row has its own scope and config)"
                    ) from None
                for hook in REGISTRATION_HOOKS:
                    make = registrars.get(hook)
                    if make is not None:
                        hooks.call_registration(plugin_id, hook, make(scope, plugin_id))
    except BaseException as error:
        await scope.dispose()
        if isinstance(error, DshError):
            raise PluginLoadError(f"{what} failed to start: {error.message}") from error
        # A CancelledError is the boot's own cancellation only when this task is being cancelled; any
        # other one came out of the plugin's code (a cancelled future's result()): its failure, to name.
        if isinstance(error, Exception | SystemExit) or (
            isinstance(error, asyncio.CancelledError) and not own_cancellation(error)
        ):
            raise PluginLoadError(f"{what} failed to start: {_describe_failure(error)}") from error
        raise
    return scope
