"""Load one plugin the way the conformance kit sees it: strict, alone, with its tool bodies observed.

:func:`load_plugin` resolves one entry point of ``dsh.plugins`` (and no
other), validates the config against the plugin's schema, and starts the
plugin in a fresh pipeline (its own pluggy manager, registry and runtime,
under a root scope that provides ``tools`` and ``runtime``). Every tool the
plugin registers is registered with its body wrapped by a :class:`ToolSpy`,
which counts invocations and records each run of the body (a :class:`BodyRun`:
the call it ran for, how long it held the event loop without awaiting, when it
ended, what it raised) and of the tool's
``finalize_content`` (a :class:`FinalizeRun`). The hook facade is a
:class:`WatchingHooks`: with a :class:`CallWatch` set in :data:`CALL_WATCH` around
a call, the kit sees whether the call waits in an approval ask, so that a call
stuck there is never blamed on its body, which has not run.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from importlib import metadata
from typing import Any

import attrs
from attrs import define

from dsh_core.errors import ConfigError, DshError, PluginLoadError, SchemaDefinitionError
from dsh_core.harness import NamedRegistry
from dsh_core.hooks import Hooks
from dsh_core.lossless import JSON, freeze
from dsh_core.model import (
    ApprovalOutcome,
    ApprovalRequest,
    ContentBlock,
    ToolContext,
    ToolDefinition,
    ToolExecution,
    ToolResult,
)
from dsh_core.plugins import ENTRY_POINT_GROUP, PluginCatalog, config_schema_of, installed_entry_points, start_plugin
from dsh_core.registry import ToolRegistry
from dsh_core.runtime import ToolRuntime
from dsh_core.schema import SchemaEvaluationError, check_schema, compile_validator, validation_errors
from dsh_core.scope import Scope

__all__ = [
    "BodyExited",
    "BodyRun",
    "FinalizeRun",
    "CALL_WATCH",
    "CallWatch",
    "ToolSpy",
    "WatchingHooks",
    "LoadedPlugin",
    "find_entry_point",
    "load_factory",
    "load_plugin",
    "make_root",
]


@define
class CallWatch:
    """Whether one call the kit makes waits in its approval ask: what holds a call stuck before its body, and how
    long the runtime may take to end it once it is withdrawn, depend on it (whether the body was entered, and has
    ended, the :class:`ToolSpy` records by call id)."""

    #: The call id of the call watched: only its own ask marks it. The tasks the call starts inherit the watch,
    #: and a call of the plugin's own made in one (by its body or a hook) asks for itself, not for this call.
    call_id: str
    #: From the first channel asked until the runtime resolves the ask (answered, or withdrawn and its channel
    #: ended or let go after the runtime's approval grace).
    asking: bool = False


#: The watch of the call the kit is making (set by the checks in the call's task; the tasks the call starts,
#: its approval ask's among them, copy it).
CALL_WATCH: contextvars.ContextVar[CallWatch | None] = contextvars.ContextVar(
    "dsh_conformance_call_watch", default=None
)


class WatchingHooks(Hooks):
    """The kit's hook facade: :class:`Hooks`, marking the :data:`CALL_WATCH` of a call while its approval ask lasts.

    Watched here, where the runtime asks and resolves, rather than through a channel of the kit's:
    no implementation is added to the plugin's pipeline, and none has to be asked before the plugin's.
    """

    def __init__(self) -> None:
        super().__init__()
        #: The tasks the runtime asks in, and the call id and tool of each: one still running once its call ended
        #: is the channel's, which ignored its withdrawal (the runtime leaves it running after its grace). The tool
        #: too, as the kit's call ids repeat across tools (each tool's ``"dispose"`` call, its ``"example-0"``).
        self.asks: weakref.WeakKeyDictionary[asyncio.Task[Any], tuple[str, str]] = weakref.WeakKeyDictionary()

    async def approve(
        self, request: ApprovalRequest, *, on_channel: Callable[[str], None] | None = None
    ) -> ApprovalOutcome:
        """As :meth:`Hooks.approve`; the call is marked asking."""
        watch = CALL_WATCH.get()
        if watch is not None and watch.call_id == request.execution.call_id:
            watch.asking = True
        task = asyncio.current_task()
        if task is not None:
            self.asks[task] = (request.execution.call_id, request.execution.name)
        return await super().approve(request, on_channel=on_channel)

    async def approval_resolved(self, request: ApprovalRequest, outcome: ApprovalOutcome) -> None:
        """As :meth:`Hooks.approval_resolved`; the call's ask is over (the runtime no longer waits on its channel)."""
        watch = CALL_WATCH.get()
        if watch is not None and watch.call_id == request.execution.call_id:
            watch.asking = False
        await super().approval_resolved(request, outcome)


class BodyExited(Exception):
    """What the spy raises in place of a body's ``SystemExit``, ``KeyboardInterrupt`` or other
    ``BaseException`` that is neither a cancellation nor the ``GeneratorExit`` of its close (the original is in
    :attr:`ToolSpy.errors`)."""


@define
class BodyRun:
    """One run of a tool body, as its :class:`ToolSpy` saw it: the call it ran for, how long it kept the event loop
    without awaiting (its first step, its longest), and when and how it ended.

    Kept per call because the kit makes several calls of a tool on one loaded plugin, and a body may run
    for a call the kit is not watching (the plugin's own, or one the kit abandoned that goes on): a count
    or an error list across calls says nothing of the call in question.
    """

    #: The call id of the execution the body ran for (``ToolContext.call_id``): the kit gives its calls of one
    #: tool each an id of its own.
    call_id: str
    #: ``time.monotonic()`` when the body ended (returned or raised), ``None`` while it runs.
    ended_at: float | None = None
    #: What the body raised, as it raised it; ``None`` if it returned (or runs).
    error: BaseException | None = None
    #: Seconds the body ran from its entry to its first suspension (or its end, if it never suspended): how long it
    #: kept the event loop from running anything else, an abort due as it is entered included; ``None`` until then.
    first_step_s: float | None = None
    #: The longest the body ran in one step, between two suspensions (its entry and end count as such): how long it
    #: kept the event loop at a stretch, during which no timer (a timeout of the kit's) can fire.
    longest_step_s: float = 0.0

    @property
    def ended(self) -> bool:
        """Whether the body has returned or raised."""
        return self.ended_at is not None

    def stepped(self, seconds: float) -> None:
        """Record one step of the body, ``seconds`` long."""
        if self.first_step_s is None:
            self.first_step_s = seconds
        self.longest_step_s = max(self.longest_step_s, seconds)


class _TimedSteps:
    """Awaits a body's coroutine step by step, timing each step in its :class:`BodyRun`.

    A step is what runs between two suspensions of the body: while it runs, the event loop runs nothing else (no
    callback, no timer), so its length is how long the body blocked the loop, which the body's wall time is not (a
    body that awaits a slow reply holds its call, not the loop). Driven as ``await`` drives the coroutine itself:
    every value, exception and close passes through unchanged; only the clock is read around each step.
    """

    def __init__(self, body: Coroutine[Any, Any, JSON], run: BodyRun, began: float | None = None) -> None:
        self._steps = body.__await__()
        self._run = run
        #: When the first step began, if before it is driven (the body's call, made before its awaitable is).
        self._began = began

    def __await__(self) -> _TimedSteps:
        return self

    def __iter__(self) -> _TimedSteps:
        return self

    def __next__(self) -> Any:
        return self.send(None)

    def send(self, value: Any) -> Any:
        """Resume the body with ``value``."""
        began = time.monotonic() if self._began is None else self._began
        self._began = None
        try:
            return self._steps.send(value)
        finally:
            self._run.stepped(time.monotonic() - began)

    def throw(self, *arguments: Any) -> Any:
        """Resume the body with an exception (a cancellation, mostly), as the coroutine's own ``throw`` does.

        The arguments are handed on unchanged, so every form behaves as on the coroutine itself: the exception
        (``throw(error)``, what asyncio passes) or the deprecated ``throw(type[, value[, traceback]])``, which builds
        it from ``value`` as Python does (and warns, on 3.12+, only when the caller used that form).
        """
        began = time.monotonic() if self._began is None else self._began
        self._began = None
        try:
            return self._steps.throw(*arguments)
        finally:
            self._run.stepped(time.monotonic() - began)

    def close(self) -> None:
        """Close the body (its ``finally`` clauses run)."""
        self._steps.close()


@define
class FinalizeRun:
    """One run of a tool's ``finalize_content``, as its :class:`ToolSpy` saw it: the call it ran for, and when.

    dsh calls it synchronously on the event loop, so it can hold a call only by blocking the loop, which no
    timeout of the kit's interrupts: how long it ran is what names it once the loop is free again, whether the call
    has returned by then or a stage after it (a result observer) still runs.
    """

    #: The call id of the execution it ran for.
    call_id: str
    #: ``time.monotonic()`` when it began.
    started_at: float
    #: ``time.monotonic()`` when it returned or raised, ``None`` while it runs.
    ended_at: float | None = None

    @property
    def seconds(self) -> float | None:
        """How long it ran, ``None`` while it runs."""
        return None if self.ended_at is None else self.ended_at - self.started_at


class ToolSpy:
    """Wraps one tool body (and its ``finalize_content``): counts calls, records each run (by call id) and raised
    exceptions, runs a hook on entry."""

    def __init__(self, definition: ToolDefinition) -> None:
        self.definition = definition
        self.calls = 0
        self.errors: list[BaseException] = []
        #: Every run of the body, in the order they were entered.
        self.runs: list[BodyRun] = []
        #: Every run of the tool's ``finalize_content``, in the order they began.
        self.finalizations: list[FinalizeRun] = []
        self.on_enter: Callable[[ToolContext], None] | None = None

    def runs_of(self, call_id: str, since: int = 0) -> list[BodyRun]:
        """The runs of the body for the call ``call_id`` among :attr:`runs` from index ``since`` (wherever they
        ran: a middleware may run the body in a task of its own, so the call's own context cannot say)."""
        return [run for run in self.runs[since:] if run.call_id == call_id]

    def finalized_for(self, call_id: str, since: int = 0) -> list[FinalizeRun]:
        """The runs of ``finalize_content`` for the call ``call_id`` among :attr:`finalizations` from index
        ``since``."""
        return [run for run in self.finalizations[since:] if run.call_id == call_id]

    def finalize(self, execution: ToolExecution, result: ToolResult) -> Sequence[ContentBlock] | None:
        """The instrumented ``finalize_content`` (registered only for a tool that has one)."""
        finalizer = self.definition.finalize_content
        assert finalizer is not None, "the spy's finalize_content is registered only for a tool that has one"
        run = FinalizeRun(execution.call_id, time.monotonic())
        self.finalizations.append(run)
        try:
            return finalizer(execution, result)
        finally:
            run.ended_at = time.monotonic()

    def execute(self, arguments: JSON, context: ToolContext) -> Awaitable[JSON]:
        """The instrumented body: calls the tool's ``execute`` and hands the runtime what it returned.

        A plain function, as the runtime calls it (it calls ``execute``, then awaits what it got): what the tool's
        ``execute`` returns is passed on, so the runtime judges the same value it would outside the kit. An
        awaitable comes back wrapped, timed step by step; anything else (a plain ``def`` that returned its value)
        unchanged, for the runtime to refuse with its own message. Were the spy an ``async def`` awaiting it, its own
        ``await`` would refuse such a value first, with Python's bare "object dict can't be used in 'await'
        expression" instead of the runtime's error naming the tool.
        """
        run = BodyRun(context.call_id)
        self.runs.append(run)
        self.calls += 1
        if self.on_enter is not None:
            self.on_enter(context)
        began = time.monotonic()
        try:
            pending = self.definition.execute(arguments, context)
        except BaseException as error:
            run.stepped(time.monotonic() - began)
            raised = self._ended(run, error)
            if raised is error:
                raise
            raise raised from error
        if not inspect.isawaitable(pending):
            # It ran whole, synchronously, and returned (its type notwithstanding): its only step. The runtime fails
            # the call for it.
            run.stepped(time.monotonic() - began)
            run.ended_at = time.monotonic()
            return pending
        # The runtime awaits it at once, in the same step: what ran before it returned its awaitable (a plain def
        # that blocks, then hands back a coroutine) is part of the body's first step.
        return self._awaited(pending, run, began)

    async def _awaited(self, pending: Awaitable[JSON], run: BodyRun, began: float) -> JSON:
        """Await what the tool's ``execute`` returned, timing each step in ``run`` (the first from ``began``)."""

        async def body() -> JSON:
            # Awaited inside a coroutine, whatever the awaitable is: _TimedSteps drives a coroutine's steps.
            return await pending

        try:
            return await _TimedSteps(body(), run, began)
        except BaseException as error:
            raised = self._ended(run, error)
            if raised is error:
                raise
            raise raised from error
        finally:
            run.ended_at = time.monotonic()

    def _ended(self, run: BodyRun, error: BaseException) -> BaseException:
        """Record that the body raised ``error`` for ``run``; what the spy raises in its place (itself, mostly)."""
        run.error = error
        run.ended_at = time.monotonic()
        self.errors.append(error)
        if isinstance(error, Exception | asyncio.CancelledError | GeneratorExit):
            # GeneratorExit is how a suspended body's close() ends it (the runtime or a middleware dropping the call,
            # the loop shutting down): close() expects it back, and raises whatever else comes out instead.
            return error
        # SystemExit or KeyboardInterrupt: the runtime lets it out and asyncio re-raises it out of the event loop,
        # so it would leave the check as a bare traceback (KeyboardInterrupt ends the whole test run). As an
        # ordinary error the call fails and the checks name the tool.
        return BodyExited(f"the body raised {type(error).__name__}")


def find_entry_point(name: str) -> metadata.EntryPoint:
    """The entry point ``name`` of group ``dsh.plugins``; :class:`PluginLoadError` lists the known ones."""
    installed, unreadable = installed_entry_points()
    found = [ep for ep in installed if ep.name == name]
    if not found:
        known = ", ".join(sorted({ep.name for ep in installed})) or "none"
        if unreadable:  # one of them may ship it: its entry points were left out, unread
            known += f"; the entry points of these distributions could not be read: {'; '.join(unreadable)}"
        raise PluginLoadError(
            f"no entry point named {name!r} in group {ENTRY_POINT_GROUP!r} (installed: {known}); "
            "is the distribution installed?"
        )
    return found[0]


def load_factory(name: str) -> tuple[PluginCatalog, Callable[..., Any]]:
    """A strict catalog that sees only entry point ``name``, and the factory it loads."""
    catalog = PluginCatalog(entry_points=[find_entry_point(name)], strict=True)
    return catalog, catalog.load(name)


def check_config(name: str, factory: object, config: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` when ``config`` does not match the plugin's config schema."""
    schema = config_schema_of(factory)
    try:
        # Also resolves every $ref: an unresolvable one would escape iter_errors as a raw traceback.
        check_schema(schema, owner=f"plugin {name!r} config schema")
    except SchemaDefinitionError as error:
        raise ConfigError(error.message) from None
    try:
        found = validation_errors(compile_validator(schema), config)
    except SchemaEvaluationError as error:
        raise ConfigError(f"config for plugin {name!r} cannot be checked against its config schema: {error}") from None
    problems = sorted(
        f"{'/'.join(str(p) for p in error.absolute_path) or '(top level)'}: {error.message}" for error in found
    )
    if problems:
        raise ConfigError(f"config for plugin {name!r} does not match its config schema: " + "; ".join(problems))


class LoadedPlugin:
    """A plugin started alone in a fresh pipeline. Dispose it with :meth:`dispose`."""

    def __init__(
        self,
        name: str,
        root: Scope,
        hooks: Hooks,
        registry: ToolRegistry,
        runtime: ToolRuntime,
        providers: NamedRegistry[Any],
        stores: NamedRegistry[Any],
    ) -> None:
        self.name = name
        self.root = root
        self.hooks = hooks
        self.registry = registry
        self.runtime = runtime
        self.providers = providers
        self.stores = stores
        self.scope: Scope | None = None
        self.definitions: list[ToolDefinition] = []
        self.spies: dict[str, ToolSpy] = {}
        #: Each registration through the kit's register callable that the registry refused, and the registry's
        #: message, in order. Recorded before the error is raised to the plugin: one that swallows it and goes on
        #: starts without the tool, which has a definition here but no spy (the tool-names check reports it).
        self.refusals: list[tuple[ToolDefinition, str]] = []
        # What the registry holds before the plugin starts: not the plugin's to undo.
        self.baseline = Counter(registry.inventory())

    async def dispose(self) -> None:
        """Dispose the plugin's scope, then the root scope."""
        if self.scope is not None:
            await self.scope.dispose()
        await self.root.dispose()

    def leftovers(self) -> list[str]:
        """What the plugin still has registered (after dispose this must be empty).

        Every kind of registry state counts (tools, guards, restrictions, modes,
        layers, change listeners), then hook implementations, providers and stores.
        """
        found = list((Counter(self.registry.inventory()) - self.baseline).elements())
        if self.hooks.has_plugin(self.name):
            found.append("its hook implementations (still registered with the plugin manager)")
        for hook in self.hooks.hook_names():
            for info in self.hooks.impls(hook):
                found.append(f"an implementation of {hook} (plugin {info.plugin!r})")
        found.extend(f"provider {n!r}" for n in self.providers.names())
        found.extend(f"session store {n!r}" for n in self.stores.names())
        return found


def make_root(hooks: Hooks) -> tuple[Scope, ToolRegistry, ToolRuntime]:
    """The root scope a plugin starts under in the kit: it provides ``tools`` and ``runtime``."""
    registry = ToolRegistry()
    runtime = ToolRuntime(registry, hooks)
    root = Scope("conformance")
    root.provide("tools", registry)
    root.provide("runtime", runtime)
    return root, registry, runtime


async def load_plugin(
    name: str, config: Mapping[str, Any], *, record_only: bool = False, factory: Callable[..., Any] | None = None
) -> LoadedPlugin:
    """Start entry point ``name`` alone with ``config``.

    With ``record_only`` tools are recorded in :attr:`LoadedPlugin.definitions`
    but not registered (so that checks can report names and schemas the
    registry would refuse). Raises :class:`PluginLoadError` or
    :class:`ConfigError` when the plugin cannot start.
    """
    if factory is None:
        catalog, factory = load_factory(name)
        source = catalog.source(name)
    else:
        source = None
    check_config(name, factory, config)
    hooks = WatchingHooks()
    root, registry, runtime = make_root(hooks)
    loaded = LoadedPlugin(
        name, root, hooks, registry, runtime, NamedRegistry("provider"), NamedRegistry("session store")
    )

    def tool_registrar(scope: Scope, plugin_id: str) -> Callable[[ToolDefinition], None]:
        def register(definition: ToolDefinition) -> None:
            loaded.definitions.append(definition)
            if record_only:
                return
            spy = ToolSpy(definition)
            try:
                finalize = spy.finalize if definition.finalize_content is not None else None
                registry.register(attrs.evolve(definition, execute=spy.execute, finalize_content=finalize), scope=scope)
            except DshError as error:
                loaded.refusals.append((definition, error.message))
                raise type(error)(f"plugin {plugin_id!r}: {error.message}") from None
            loaded.spies[definition.name] = spy

        return register

    registrars: dict[str, Callable[[Scope, str], Callable[..., None]]] = {
        "dsh_register_tools": tool_registrar,
        "dsh_register_providers": loaded.providers.registrar,
        "dsh_register_session_stores": loaded.stores.registrar,
    }
    try:
        loaded.scope = await start_plugin(
            plugin_id=name,
            factory=factory,
            config=freeze(dict(config)),
            parent=root,
            hooks=hooks,
            registrars=registrars,
            source=source,
        )
    except BaseException:
        await root.dispose()
        raise
    return loaded


def run(coroutine: Awaitable[Any]) -> Any:
    """Run ``coroutine`` in a fresh event loop (each check gets its own loop)."""
    import asyncio

    async def main() -> Any:
        return await coroutine

    return asyncio.run(main())
