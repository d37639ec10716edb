"""The tool registry: layers, presentation modes, restrictions, guards and the Code Mode collapse.

Registrations live in layers: one global layer, plus one per *layered* scope
(agents, presets). A caller sees the tools of its scope chain: a name is
settled by the nearest layer that registers it, which only the restrictions
of layers nearer still can hide (a layer's restrictions filter what it
inherits, never its own tools, as seen from it and from below), and the reserved
``run_code`` transport is added when the scope's effective mode is not
``native``. ``run_code`` is stored in no layer, so no restriction can remove it
and no registration can shadow it.

Security rests on one predicate, :meth:`ToolRegistry.collapses`: a
model-direct call (not nested) under an effective ``code`` mode may only name
``run_code``, and a nested call may never name ``run_code``. The executor (:mod:`dsh_core.runtime`) consults it when it
creates an execution, before any hook, and every execution-path lookup goes
through :meth:`ToolRegistry.resolve_execution`, which applies it again.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Final, Literal, TypeAlias

from dsh_core.errors import RegistrationError
from dsh_core.lossless import JSON
from dsh_core.model import ExecutionMode, ToolDefinition, ToolExecution, ToolSchema
from dsh_core.scope import Scope, one_shot

__all__ = ["ToolRegistry", "definition_mode", "Mode", "MODES", "TRANSPORT_NAME", "TOOL_NAME_PATTERN", "Guard"]

Mode: TypeAlias = Literal["native", "code", "both"]
#: The three presentation modes.
MODES: Final = ("native", "code", "both")
#: The reserved name of the Code Mode transport.
TRANSPORT_NAME: Final = "run_code"
#: What a tool name may look like (what every major provider accepts). Use ``fullmatch``;
#: ``\Z`` keeps even ``match`` exact (``$`` would also match before a trailing newline).
TOOL_NAME_PATTERN: Final = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")

#: Per-scope caches (layer chains, views) are dropped wholesale beyond this many scopes.
_CACHE_LIMIT: Final = 4096

Guard: TypeAlias = Callable[[ToolExecution], "str | None | Awaitable[str | None]"]

log = logging.getLogger("dsh")


def _ensure_active(scope: Scope, action: str) -> None:
    # Checked before any change: scope.on_dispose() would raise only after the change was made,
    # leaving a registration that nothing ever removes.
    if not scope.active:
        state = "disposed" if scope.disposed else "being disposed"
        raise RegistrationError(f"cannot {action}: scope {scope.path!r} is {state}")


def _describe(function: object) -> str:
    name = getattr(function, "__qualname__", None)
    module = getattr(function, "__module__", None)
    if not isinstance(name, str):
        return repr(function)
    return f"{module}.{name}" if isinstance(module, str) else name


def check_mode(mode: object, *, source: str = "mode") -> Mode:
    """Return ``mode`` if it is one of :data:`MODES`, else raise ``ValueError`` naming ``source``."""
    if mode not in MODES:
        raise ValueError(f"{source}={mode!r} must be one of native, code, both")
    return mode


def definition_mode(definition: ToolDefinition | None, arguments: JSON) -> ExecutionMode:
    """How a call of ``definition`` may run: ``parallel`` only for an exact ``True`` from its
    ``is_concurrency_safe(arguments)``; no definition, no predicate or a raising one is ``exclusive``."""
    if definition is None or definition.is_concurrency_safe is None:
        return "exclusive"
    try:
        verdict = definition.is_concurrency_safe(arguments)
    except Exception:
        return "exclusive"
    return "parallel" if verdict is True else "exclusive"


class _Restriction:
    __slots__ = ("allow", "deny")

    def __init__(self, allow: frozenset[str] | None, deny: frozenset[str]) -> None:
        self.allow = allow
        self.deny = deny

    def admits(self, name: str) -> bool:
        return (self.allow is None or name in self.allow) and name not in self.deny


class _Layer:
    __slots__ = ("guards", "mode", "owner", "restrictions", "tools")

    def __init__(self, owner: Scope | None) -> None:
        self.owner = owner
        self.tools: dict[str, ToolDefinition] = {}
        self.restrictions: list[_Restriction] = []
        self.guards: list[Guard] = []
        self.mode: Mode | None = None


class _View:
    __slots__ = ("schemas", "version", "visible", "wire")

    def __init__(self, version: int, visible: dict[str, ToolDefinition]) -> None:
        self.version = version
        self.visible = visible
        self.schemas: tuple[ToolSchema, ...] | None = None
        self.wire: tuple[ToolSchema, ...] | None = None


#: Marks a name not yet resolved in ``ToolRegistry._resolved`` (``None`` is a cached answer).
_UNRESOLVED: Final = object()


class ToolRegistry:
    """Tools, restrictions, guards and modes, per layer. See the module docstring."""

    def __init__(
        self,
        *,
        default_mode: Mode = "native",
        transport: ToolDefinition | Callable[[], ToolDefinition] | None = None,
    ) -> None:
        self.default_mode: Mode = check_mode(default_mode, source="tools.mode")
        self._transport_source = transport
        self._transport: ToolDefinition | None = transport if isinstance(transport, ToolDefinition) else None
        self._global = _Layer(None)
        self._layers: dict[Scope, _Layer] = {}
        self._version = 0
        self._views: dict[Scope | None, _View] = {}
        self._chains: dict[Scope | None, list[_Layer]] = {}
        # get() answers per (name, scope) until the next change: a nested call resolves its tool
        # three times (create, scheduling class, body), each a walk of the scope chain otherwise.
        self._resolved: dict[tuple[str, Scope | None], ToolDefinition | None] = {}
        self._listeners: list[Callable[[], None]] = []

    # -- layers ----------------------------------------------------------------------------------------

    def _invalidate(self) -> None:
        self._version += 1
        self._views.clear()
        self._chains.clear()
        self._resolved.clear()

    def _notify(self, change: str) -> None:
        """Call every listener once the change is complete (its undo handed to its scope too).

        A listener's error is not the registering plugin's: raised here, it would make a change that was
        made look failed (a caller given no undo for a tool left registered) and keep the later listeners
        from hearing of it. It is logged, naming the listener and the change, and the rest are called.
        """
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:
                log.warning(
                    "tool registry change listener %s failed on %s; the change stands and the other "
                    "listeners were notified",
                    _describe(listener),
                    change,
                    exc_info=True,
                )

    def _changed(self, change: str) -> None:
        self._invalidate()
        self._notify(change)

    def on_change(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` after every change of tools, restrictions or modes.

        A listener that raises is logged (naming it and the change) and the other listeners are still
        called: the change stands, and the call that made it does not fail.
        """
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _own_layer(self, scope: Scope | None, *, create: bool) -> _Layer | None:
        owner = scope.layer_owner if scope is not None else None
        if owner is None:
            return self._global
        layer = self._layers.get(owner)
        if layer is None and create:
            # The owner may be disposing while the registering scope (a child not unwound yet) is still
            # active: a layer made now would fail on owner.on_dispose() after being stored, and stay.
            _ensure_active(owner, "add to its tool layer")
            layer = _Layer(owner)
            self._layers[owner] = layer
            self._chains.clear()
            self._resolved.clear()
            owner.on_dispose(lambda: self._drop_layer(owner))
        return layer

    def _drop_layer(self, owner: Scope) -> None:
        if self._layers.pop(owner, None) is not None:
            self._changed(f"drop the tool layer of scope {owner.path!r}")

    def _chain(self, scope: Scope | None) -> list[_Layer]:
        """Layers from nearest to farthest, ending with the global layer (cached until the next change)."""
        cached = self._chains.get(scope)
        if cached is not None:
            return cached
        chain: list[_Layer] = []
        if scope is not None:
            for node in scope.chain():
                if node.layered:
                    layer = self._layers.get(node)
                    if layer is not None:
                        chain.append(layer)
        chain.append(self._global)
        if len(self._chains) >= _CACHE_LIMIT:  # short-lived run scopes must not pile up between changes
            self._chains.clear()
        self._chains[scope] = chain
        return chain

    def _own_of(self, scope: Scope | None, chain: list[_Layer]) -> _Layer | None:
        owner = scope.layer_owner if scope is not None else None
        if owner is None:
            return None  # the global scope has no "own" layer: everything is inherited
        return chain[0] if chain and chain[0].owner is owner else None

    # -- registration ------------------------------------------------------------------------------------

    def register(self, definition: ToolDefinition, *, scope: Scope | None = None) -> Callable[[], None]:
        """Register a tool in ``scope``'s layer (global for ``None`` or a deployment plugin's scope).

        The tool is unregistered when ``scope`` is disposed or when the returned
        function is called. Refuses the reserved name, an invalid name, a
        definition not built by :func:`dsh_core.define_tool`, and a duplicate in
        the same layer.
        """
        if not isinstance(definition, ToolDefinition) or definition.parameters_validator is None:
            raise RegistrationError(f"cannot register {definition!r}: build tools with dsh_core.define_tool(...)")
        name = definition.name
        if name == TRANSPORT_NAME:
            raise RegistrationError(
                f'tool name "{TRANSPORT_NAME}" is reserved for the Code Mode presentation transport '
                "and cannot be registered or shadowed"
            )
        if not TOOL_NAME_PATTERN.fullmatch(name):
            raise RegistrationError(f"invalid tool name {name!r}: use 1-64 characters from [A-Za-z0-9_-]")
        if scope is not None:
            _ensure_active(scope, f'register tool "{name}"')
        layer = self._own_layer(scope, create=True)
        assert layer is not None
        if name in layer.tools:
            if layer is self._global:
                raise RegistrationError(
                    f'tool "{name}" is already registered globally; to give one agent its own variant, '
                    "register it from a plugin in that agent's scope"
                )
            raise RegistrationError(f'tool "{name}" is already registered in this scope ({layer.owner!r})')
        layer.tools[name] = definition
        self._invalidate()

        @one_shot
        def unregister() -> None:
            if layer.tools.get(name) is definition:
                del layer.tools[name]
                self._changed(f'unregister tool "{name}"')

        if scope is not None:
            scope.on_dispose(unregister)
        self._notify(f'register tool "{name}"')
        return unregister

    def restrict(
        self, scope: Scope, *, allow: Iterable[str] | None = None, deny: Iterable[str] | None = None
    ) -> Callable[[], None]:
        """Filter what a layered scope inherits (allow-list and/or deny-list); restrictions intersect.

        Scoped only; an empty filter, naming ``run_code``, or naming a tool the
        scope does not inherit is an error. The scope's own tools are exempt, as
        seen from the scope and from every scope below it.
        """
        _ensure_active(scope, "restrict tools")
        owner = scope.layer_owner
        if owner is None:
            raise RegistrationError("restrict() requires a scoped context (an agent or preset scope)")
        for option, names in (("allow", allow), ("deny", deny)):
            if isinstance(names, str):  # frozenset("ab") is {"a", "b"}: it would filter other tools
                raise RegistrationError(
                    f"restrict() {option} must be a collection of tool names, not a str (write {option}=[{names!r}])"
                )
        allow_set = frozenset(allow) if allow is not None else None
        deny_set = frozenset(deny or ())
        if allow_set is None and not deny_set:
            raise RegistrationError("restrict() with neither allow nor deny would be a no-op")
        named = (allow_set or frozenset()) | deny_set
        if TRANSPORT_NAME in named:
            raise RegistrationError(f'"{TRANSPORT_NAME}" is reserved transport, not a restriction target')
        inherited = self._inherited_names(owner)
        unknown = sorted(named - inherited)
        if unknown:
            raise RegistrationError(
                f"restrict() names tools scope {owner.path!r} does not inherit: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(inherited)) or 'none'})"
            )
        layer = self._own_layer(owner, create=True)
        assert layer is not None
        restriction = _Restriction(allow_set, deny_set)
        layer.restrictions.append(restriction)
        self._invalidate()

        @one_shot
        def lift() -> None:
            if restriction in layer.restrictions:
                layer.restrictions.remove(restriction)
                self._changed(f"lift a tool restriction of scope {owner.path!r}")

        scope.on_dispose(lift)
        self._notify(f"restrict the tools of scope {owner.path!r}")
        return lift

    def inherited_names(self, scope: Scope) -> list[str]:
        """The sorted names a layered scope inherits from outer layers: what :meth:`restrict` may name."""
        owner = scope.layer_owner
        if owner is None:
            raise RegistrationError("inherited_names() requires a scoped context (an agent or preset scope)")
        return sorted(self._inherited_names(owner))

    def _inherited_names(self, owner: Scope) -> set[str]:
        names: set[str] = set()
        for layer in self._chain(owner):
            if layer.owner is not owner:
                names.update(layer.tools)
        return names

    def guard(self, guard: Guard, *, scope: Scope | None = None) -> Callable[[], None]:
        """Add a monotonic guard to ``scope``'s layer: return a reason to deny, ``None`` to pass."""
        if scope is not None:
            _ensure_active(scope, "add a guard")
        layer = self._own_layer(scope, create=True)
        assert layer is not None
        layer.guards.append(guard)

        @one_shot
        def remove() -> None:
            if guard in layer.guards:
                layer.guards.remove(guard)

        if scope is not None:
            scope.on_dispose(remove)
        return remove

    def guards_for(self, scope: Scope | None) -> list[Guard]:
        """Guards in evaluation order: the global layer's, then the scope chain's from outermost in."""
        chain = self._chain(scope)
        guards: list[Guard] = []
        for layer in reversed(chain):
            guards.extend(layer.guards)
        return guards

    def present_as(self, mode: Mode, scope: Scope) -> Callable[[], None]:
        """Declare a layered scope's presentation mode; one declaration per scope.

        Disposing the scope (or calling the returned function) restores the
        inherited mode.
        """
        check_mode(mode)
        _ensure_active(scope, f"present_as({mode!r})")
        owner = scope.layer_owner
        if owner is None:
            raise RegistrationError("present_as() requires a scoped context (an agent or preset scope)")
        layer = self._own_layer(owner, create=True)
        assert layer is not None
        if layer.mode is not None:
            raise RegistrationError(
                f"present_as({mode!r}) conflicts with mode {layer.mode!r} already declared for scope {owner.path!r}"
            )
        layer.mode = mode
        self._invalidate()

        @one_shot
        def restore() -> None:
            if layer.mode == mode:
                layer.mode = None
                self._changed(f"restore the inherited mode of scope {owner.path!r}")

        scope.on_dispose(restore)
        self._notify(f"present_as({mode!r}) for scope {owner.path!r}")
        return restore

    def mode_for(self, scope: Scope | None) -> Mode:
        """The effective mode: the nearest layer's declaration, else the deployment default."""
        for layer in self._chain(scope):
            if layer.mode is not None:
                return layer.mode
        return self.default_mode

    # -- introspection -----------------------------------------------------------------------------------

    def inventory(self) -> list[str]:
        """Everything registered, one description each: tools, guards, restrictions, modes, layers, listeners.

        For leak checks (the conformance kit's dispose check): what is still here once
        its owners are disposed outlived them.
        """
        found: list[str] = []
        for layer in (self._global, *self._layers.values()):
            where = "in the global layer" if layer.owner is None else f"in the layer of scope {layer.owner.path!r}"
            if layer.owner is not None:
                found.append(f"the tool layer of scope {layer.owner.path!r}")
            found.extend(f'tool "{name}" {where}' for name in layer.tools)
            found.extend(f"guard {_describe(guard)} {where}" for guard in layer.guards)
            for restriction in layer.restrictions:
                parts = [] if restriction.allow is None else [f"allow={sorted(restriction.allow)}"]
                parts += [f"deny={sorted(restriction.deny)}"] if restriction.deny else []
                found.append(f"restriction ({', '.join(parts)}) {where}")
            if layer.mode is not None:
                found.append(f'presentation mode "{layer.mode}" {where}')
        found.extend(f"change listener {_describe(listener)} (from on_change)" for listener in self._listeners)
        return found

    # -- transport -------------------------------------------------------------------------------------

    @property
    def transport(self) -> ToolDefinition | None:
        """The reserved ``run_code`` definition (built on first need)."""
        if self._transport is None and callable(self._transport_source):
            self._transport = self._transport_source()
        return self._transport

    def _require_transport(self, mode: Mode) -> ToolDefinition:
        transport = self.transport
        if transport is None:
            raise RuntimeError(f'mode "{mode}" needs the run_code transport, but this registry has none')
        return transport

    # -- resolution ----------------------------------------------------------------------------------------

    def get(self, name: str, scope: Scope | None = None) -> ToolDefinition | None:
        """The definition ``scope`` sees under ``name`` (``run_code`` included), uncollapsed.

        For presenters, inspection and SDK enumeration; execution goes through
        :meth:`resolve_execution`. Cost: proportional to the scope depth, then a dict
        lookup until the registry changes.
        """
        key = (name, scope)
        resolved = self._resolved.get(key, _UNRESOLVED)
        if resolved is not _UNRESOLVED:
            return resolved  # type: ignore[return-value]
        resolved = self._get(name, scope)
        if len(self._resolved) >= _CACHE_LIMIT:  # short-lived run scopes must not pile up between changes
            self._resolved.clear()
        self._resolved[key] = resolved
        return resolved

    def _get(self, name: str, scope: Scope | None) -> ToolDefinition | None:
        if name == TRANSPORT_NAME:
            mode = self.mode_for(scope)
            return None if mode == "native" else self._require_transport(mode)
        chain = self._chain(scope)
        own = self._own_of(scope, chain)
        if own is not None and name in own.tools:
            return own.tools[name]
        for depth, layer in enumerate(chain):
            if layer is own:
                continue
            definition = layer.tools.get(name)
            if definition is not None:
                # A layer's restrictions filter what it inherits, never its own tools: only the
                # layers nearer than the one that registered the tool can hide it.
                for restricting in chain[:depth]:
                    for restriction in restricting.restrictions:
                        if not restriction.admits(name):
                            return None
                return definition
        return None

    def collapses(self, name: str, scope: Scope | None, nested: bool) -> bool:
        """The Code Mode collapse: a model-direct call under ``code`` may only name ``run_code``,
        and a nested call may never name it (a program does not start programs).

        The single predicate shared by execution creation and execution
        resolution; it uses the scope's effective mode, not the deployment's.
        The second rule does not rest on the transport's namespace leaving
        ``run_code`` out: whoever holds a live parent token (a custom transport,
        a tool body handed its execution) still cannot nest the transport.
        """
        if name == TRANSPORT_NAME:
            return nested
        return not nested and self.mode_for(scope) == "code"

    def resolve_execution(self, name: str, scope: Scope | None, nested: bool) -> ToolDefinition | None:
        """The definition an execution may run: :meth:`get` with the collapse applied."""
        if self.collapses(name, scope, nested):
            return None
        return self.get(name, scope)

    def execution_mode(self, name: str, arguments: JSON, scope: Scope | None, nested: bool) -> ExecutionMode:
        """``parallel`` only when the tool resolves and ``is_concurrency_safe(args)`` is exactly ``True``."""
        return definition_mode(self.resolve_execution(name, scope, nested), arguments)

    # -- views -------------------------------------------------------------------------------------------

    def _view(self, scope: Scope | None) -> _View:
        view = self._views.get(scope)
        if view is not None and view.version == self._version:
            return view
        chain = self._chain(scope)
        own = self._own_of(scope, chain)
        # Nearest layer first: a name is settled by the nearest layer that registers it (shown,
        # or hidden by a restriction of a layer nearer still); farther layers cannot bring it back.
        visible: dict[str, ToolDefinition] = {}
        settled: set[str] = set()
        nearer: list[_Restriction] = []
        for layer in chain:
            for name, definition in layer.tools.items():
                if name in settled:
                    continue
                settled.add(name)
                if layer is own or all(r.admits(name) for r in nearer):
                    visible[name] = definition
            nearer.extend(layer.restrictions)
        view = _View(self._version, dict(sorted(visible.items())))
        if len(self._views) >= _CACHE_LIMIT:
            self._views.clear()
        self._views[scope] = view
        return view

    def definitions(self, scope: Scope | None = None) -> list[ToolDefinition]:
        """Visible registered tools (``run_code`` excluded), sorted by name: what SDKs are rendered from."""
        return list(self._view(scope).visible.values())

    def names(self, scope: Scope | None = None) -> list[str]:
        """Visible names, ``run_code`` included when the mode presents it, sorted."""
        names = list(self._view(scope).visible)
        if self.mode_for(scope) != "native":
            names.append(TRANSPORT_NAME)
        return sorted(names)

    def schemas(self, scope: Scope | None = None) -> tuple[ToolSchema, ...]:
        """Projections of every visible tool, ``run_code`` included when present (cached, immutable)."""
        view = self._view(scope)
        if view.schemas is None:
            schemas = [d.schema for d in view.visible.values()]
            mode = self.mode_for(scope)
            if mode != "native":
                schemas.append(self._require_transport(mode).schema)
            view.schemas = tuple(sorted(schemas, key=lambda s: s.name))
        return view.schemas

    def wire_schemas(self, scope: Scope | None = None) -> tuple[ToolSchema, ...]:
        """What the model is shown: ``native`` all, ``code`` only ``run_code``, ``both`` all plus ``run_code``.

        Cached per scope until the next change; O(1) for an unchanged registry.
        """
        view = self._view(scope)
        if view.wire is None:
            mode = self.mode_for(scope)
            view.wire = (self._require_transport(mode).schema,) if mode == "code" else self.schemas(scope)
        return view.wire


def judged_definition(execution: ToolExecution, registry: ToolRegistry | None) -> ToolDefinition | None:
    """The definition a policy hook judges for ``execution``: the one its body runs.

    That is ``execution.definition``, pinned when the call was created, never the registry's entry at
    the hook's own stage (a shadow registered for the vote and gone by the body would otherwise be
    what was judged). ``registry`` is asked only for an execution built by hand, with no definition.
    """
    pinned = getattr(execution, "definition", None)  # a stand-in without the field counts as built by hand
    if pinned is not None:
        return pinned  # type: ignore[no-any-return]
    return None if registry is None else registry.get(execution.name, execution.agent)
