"""The plugin manager and its typed facade: the only code that touches pluggy.

pluggy keeps the hook implementations and validates them against the
hookspecs; this module calls them. It iterates implementations itself, in
pluggy's order, so that it can (a) filter them by scope (an implementation
registered inside an agent's scope sees only that agent's calls), (b) await
what they return, (c) contain an observer's failure without skipping the
others, and (d) name the plugin that failed. The aggregation rule of every
hook lives here, next to its call.
"""

from __future__ import annotations

import asyncio
import difflib
import importlib
import inspect
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import pluggy
from dsh_hookspecs import PROJECT, SPEC_MODULES

from dsh_core.errors import DshError, ErrorCode, InvalidToolOutputError, PluginLoadError, describe_exception
from dsh_core.model import (
    POST_KINDS,
    PRE_KINDS,
    ApprovalOutcome,
    ApprovalRequest,
    ContentBlock,
    Middleware,
    PostDecision,
    PreDecision,
    PromptContext,
    PromptSection,
    ToolExecution,
    ToolResult,
    content_problem,
)
from dsh_core.scope import Scope, one_shot

__all__ = [
    "Hooks",
    "HookFailure",
    "HookImplInfo",
    "PluginObjectInUse",
    "cancellation_requested",
    "failure_message",
    "guard_verdict_error",
    "own_cancellation",
]

log = logging.getLogger("dsh")


class PluginObjectInUse(PluginLoadError):
    """:meth:`Hooks.register` was given an object already registered under another plugin name.

    ``name`` is the name asked for, ``other`` the name the object is registered
    under; the plugin loader uses them to name both rows. ``equal`` is true
    when it is not the same object but an equal one: pluggy tells plugins
    apart with ``==``, so value-type plugins need ``eq=False``.
    """

    def __init__(self, name: str, other: str, *, equal: bool = False) -> None:
        if equal:
            detail = (
                f"an equal object is already registered as plugin {other!r} (pluggy compares plugin "
                "objects with ==: give the class identity equality, e.g. attrs/dataclass eq=False)"
            )
        else:
            detail = f"the object is already registered as plugin {other!r} (each registration needs its own object)"
        super().__init__(f"cannot register plugin {name!r}: {detail}")
        self.name = name
        self.other = other
        self.equal = equal


#: Hooks whose implementations are called once per plugin at registration.
REGISTRATION_HOOKS: Final = ("dsh_register_tools", "dsh_register_providers", "dsh_register_session_stores")
#: Hooks whose return value dsh uses as it is, never awaited: an ``async def`` implementation would do
#: nothing (a registration hook registers nothing) or hand the core a coroutine where it expects a value.
SYNC_HOOKS: Final = frozenset({*REGISTRATION_HOOKS, "dsh_around_dispatch", "dsh_prompt_sections", "dsh_prompt_filter"})


#: The aggregate "allow" (frozen, so one instance serves every call).
_ALLOW: Final = PreDecision.allow()


def guard_verdict_error(verdict: object) -> TypeError:
    """The error a guard verdict that is neither a reason (``str``) nor ``None`` is reported as."""
    return TypeError(f"returned {type(verdict).__name__}, expected a denial reason (str) or None")


def failure_message(hook: str, plugin: str, error: BaseException) -> str:
    """``<hook> of plugin '<name>' failed: <Type>: <text>``: what the model reads of a raising hook."""
    return f"{hook} of plugin {plugin!r} failed: {describe_exception(error)}"


def _section_problem(section: object) -> str | None:
    """Why ``section`` cannot be assembled, or ``None``.

    :class:`PromptSection` does not check its fields, and the assembly merges by name, sorts by
    ``(order, name)`` and strips the text: a wrong type would fail it later, naming no plugin.
    """
    if not isinstance(section, PromptSection):
        return f"returned {type(section).__name__}, expected PromptSection"
    name, text, order = section.name, section.text, section.order
    if not isinstance(name, str):
        return f"returned section {name!r} whose name is {type(name).__name__}, expected str"
    if not isinstance(text, str):
        return f"returned section {name!r} whose text is {type(text).__name__}, expected str"
    if not isinstance(order, int | float):  # a float sorts among ints as well
        return f"returned section {name!r} whose order is {type(order).__name__}, expected int"
    if isinstance(order, float) and math.isnan(order):
        # NaN compares false both ways: sorted() would leave it, and the sections around it, in plugin order.
        return f"returned section {name!r} whose order is NaN, which sorts nowhere"
    return None


class HookFailure(DshError):
    """A hook implementation raised; names the plugin and keeps a typed code.

    The message is :func:`failure_message`, except for a :class:`DshError`
    the plugin raised on purpose: its code and message are the plugin's choice.
    """

    def __init__(self, hook: str, plugin: str, error: BaseException) -> None:
        code = error.code if isinstance(error, DshError) else ErrorCode.TOOL_FAILED
        text = error.message if isinstance(error, DshError) else failure_message(hook, plugin, error)
        super().__init__(text, code=code)
        self.hook = hook
        self.plugin = plugin
        self.original = error


class HookImplInfo:
    """One implementation as the facade calls it: positional values in spec order, opted-in subset."""

    __slots__ = ("hook", "plugin", "function", "argnames", "layer", "_picks")

    def __init__(
        self,
        hook: str,
        plugin: str,
        function: Callable[..., Any],
        argnames: tuple[str, ...],
        layer: Scope | None,
        spec_argnames: tuple[str, ...],
    ) -> None:
        self.hook = hook
        self.plugin = plugin
        self.function = function
        self.argnames = argnames
        self.layer = layer
        # pluggy's opt-in arguments: an implementation may take any subset of the spec's arguments.
        picks = tuple(spec_argnames.index(name) for name in argnames)
        self._picks: tuple[int, ...] | None = None if picks == tuple(range(len(spec_argnames))) else picks

    def sees(self, agent: Scope | None) -> bool:
        """Scope filter: deployment-level implementations see everything."""
        return self.layer is None or (agent is not None and agent.is_within(self.layer))

    def invoke(self, *values: Any) -> Any:
        """Call with the spec's arguments (in spec order), passing only those it declared."""
        if self._picks is None:
            return self.function(*values)
        return self.function(*[values[index] for index in self._picks])


def _is_awaitable(value: Any) -> bool:
    # inspect.isawaitable goes through ABC machinery; coroutines are the common case.
    return type(value) is _COROUTINE or hasattr(value, "__await__")


async def _coroutine_type_probe() -> None:
    return None


_probe = _coroutine_type_probe()
_COROUTINE = type(_probe)
_probe.close()


def cancellation_requested() -> bool:
    """True when a ``CancelledError`` caught now is the current task's own: the task is being cancelled.

    Otherwise the code it awaited let out the cancellation of something cancelled elsewhere (a
    future or task another owner cancelled): a failure of that code, not the caller's cancellation,
    which propagated would end a whole agent run as interrupted.
    """
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def own_cancellation(error: BaseException) -> bool:
    """True when ``error`` is the current task's own cancellation, to propagate; else it is a failure.

    For an ``except (Exception, asyncio.CancelledError)`` around plugin code: anything else it
    catches, a ``CancelledError`` the code let out of something cancelled elsewhere included
    (see :func:`cancellation_requested`), is that plugin's failure, contained like any other.
    """
    return isinstance(error, asyncio.CancelledError) and cancellation_requested()


def _cancelled_observer(error: asyncio.CancelledError, what: str, plugin: str) -> asyncio.CancelledError | None:
    """``error`` if the calling task is being cancelled (to raise once every observer heard), else ``None``.

    A ``CancelledError`` while the task is not being cancelled is the observer's own (it awaited
    something cancelled elsewhere): a failure of that observer, logged and contained like any other.
    """
    if cancellation_requested():
        return error
    log.warning("%s of plugin %r failed", what, plugin, exc_info=error)
    return None


def _parameters(function: object) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(function).parameters.values())  # type: ignore[arg-type]
    except (TypeError, ValueError):  # no signature to read (a builtin): pluggy passes what it can
        return []


class Hooks:
    """The typed facade over one pluggy ``PluginManager`` (one per harness, one per test)."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(PROJECT)
        for module_name in SPEC_MODULES:
            self._pm.add_hookspecs(importlib.import_module(module_name))
        self._layers: dict[str, Scope | None] = {}
        self._cache: dict[str, tuple[tuple[HookImplInfo, ...], bool]] = {}

    # -- registration -------------------------------------------------------------------------------

    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        """The underlying manager (for tests and the conformance kit's inspection only)."""
        return self._pm

    def register(self, plugin: object, *, name: str, scope: Scope | None = None) -> Callable[[], None]:
        """Register a plugin object's hook implementations under ``name``.

        With a ``scope``, the implementations are unregistered when the scope
        is disposed, and per-call hooks only show them the calls of agents
        inside the scope's layer (if it lives in an agent's subtree). Refuses,
        registering nothing, an implementation of an unknown hook (unless it
        is marked ``optionalhook=True``: then, as in pluggy, it is accepted and
        never called), a wrapper,
        a duplicate name, an object already registered under another name
        (:class:`PluginObjectInUse`), or a ``scope`` that is no longer active.
        Returns the unregister function: it removes this registration only, so
        called late (after ``name`` was registered again, for another object)
        it does nothing.
        """
        if scope is not None and not scope.active:
            state = "disposed" if scope.disposed else "being disposed"
            raise PluginLoadError(f"cannot register plugin {name!r}: its scope {scope.path!r} is {state}")
        if self._pm.has_plugin(name):
            raise PluginLoadError(f"a plugin named {name!r} is already registered")
        other = self._pm.get_name(plugin)
        if other is not None:
            # pluggy would raise a bare ValueError ("already registered under a different name").
            raise PluginObjectInUse(name, other, equal=self._pm.get_plugin(other) is not plugin)
        try:
            self._pm.register(plugin, name=name)
        except pluggy.PluginValidationError as error:
            if self._pm.get_plugin(name) is plugin:
                # pluggy before 1.7 registered the earlier hookimpls, and the name, before it refused.
                self._pm.unregister(name=name)
            raise PluginLoadError(f"plugin {name!r}: {error}") from None
        try:
            self._validate(plugin, name)
        except PluginLoadError:
            self._pm.unregister(name=name)
            raise
        self._layers[name] = scope.layer_owner if scope is not None else None
        self._cache.clear()

        @one_shot
        def unregister() -> None:
            if self._pm.get_plugin(name) is plugin:  # never a later plugin that took the name
                self.unregister(name)

        if scope is not None:
            try:
                scope.on_dispose(unregister)
            except BaseException:
                unregister()
                raise
        return unregister

    def _validate(self, plugin: object, name: str) -> None:
        for caller in self._pm.get_hookcallers(plugin) or ():
            for impl in caller.get_hookimpls():
                if impl.plugin is not plugin:
                    continue
                if caller.spec is None:
                    if impl.optionalhook:
                        # pluggy's contract: an optional implementation of a hook no spec defines (one of a
                        # newer dsh, say) is accepted and never called, so nothing about it needs checking.
                        continue
                    known = self.hook_names()
                    close = difflib.get_close_matches(caller.name, known, n=1)
                    hint = f"did you mean {close[0]!r}? " if close else ""
                    raise PluginLoadError(
                        f"plugin {name!r} implements unknown hook {caller.name!r} ({hint}known: {', '.join(known)}; "
                        "mark it @hookimpl(optionalhook=True) if it is meant for a hook this dsh may not define)"
                    )
                if caller.name in SYNC_HOOKS and (
                    inspect.iscoroutinefunction(impl.function) or inspect.isasyncgenfunction(impl.function)
                ):
                    raise PluginLoadError(
                        f"plugin {name!r}: {caller.name} is async def, but dsh calls it synchronously and never "
                        "awaits what it returns: make it a plain def (start async work with scope.spawn(...))"
                    )
                spec_arguments = set(caller.spec.argnames)
                defaulted = [
                    parameter.name
                    for parameter in _parameters(impl.function)
                    if parameter.default is not inspect.Parameter.empty and parameter.name in spec_arguments
                ]
                if defaulted:
                    raise PluginLoadError(
                        f"plugin {name!r}: {caller.name} declares a default for {', '.join(defaulted)}; pluggy "
                        "never passes an argument that has a default, so it would always be the default: "
                        "remove the default (accept only the arguments you use, all required)"
                    )
                if impl.wrapper or impl.hookwrapper:
                    raise PluginLoadError(
                        f"plugin {name!r}: {caller.name} is declared as a pluggy wrapper; dsh calls its hooks "
                        "itself and awaits their results, so wrappers are not supported: return middleware "
                        "from dsh_around_dispatch to wrap the tool body"
                    )

    def unregister(self, name: str) -> None:
        """Remove a plugin's implementations (idempotent)."""
        if self._pm.has_plugin(name):
            self._pm.unregister(name=name)
        self._layers.pop(name, None)
        self._cache.clear()

    def hook_names(self) -> list[str]:
        """Names of every hook specification."""
        # Not every name on pm.hook: pluggy leaves a spec-less caller there for a
        # rejected plugin's misspelled hook, which is no hook anyone may implement.
        return sorted(
            name
            for name in dir(self._pm.hook)
            if name.startswith("dsh_") and getattr(self._pm.hook, name).spec is not None
        )

    def has_plugin(self, name: str) -> bool:
        """True if a plugin is registered under ``name``."""
        return self._pm.has_plugin(name)

    def impls(self, hook: str) -> tuple[HookImplInfo, ...]:
        """Implementations of ``hook`` in call order."""
        cached = self._cache.get(hook)
        if cached is None:
            caller = getattr(self._pm.hook, hook)
            spec_argnames = tuple(caller.spec.argnames) if caller.spec is not None else ()
            infos = tuple(
                HookImplInfo(
                    hook,
                    impl.plugin_name,
                    impl.function,
                    tuple(impl.argnames),
                    self._layers.get(impl.plugin_name),
                    spec_argnames,
                )
                for impl in reversed(caller.get_hookimpls())
            )
            cached = (infos, any(info.layer is not None for info in infos))
            self._cache[hook] = cached
        return cached[0]

    def _visible(self, hook: str, agent: Scope | None) -> Iterable[HookImplInfo]:
        # One dict lookup on the per-call path (six hooks per nested call); impls() fills a miss.
        cached = self._cache.get(hook)
        if cached is None:
            self.impls(hook)
            cached = self._cache[hook]
        infos, scoped = cached
        if not scoped:
            return infos
        return [info for info in infos if info.sees(agent)]

    def sees_any(self, hook: str, agent: Scope | None) -> bool:
        """True when some implementation of ``hook`` would see a call of ``agent``.

        Lets a caller skip building a hook's argument when nobody would receive it.
        """
        for _ in self._visible(hook, agent):
            return True
        return False

    def call_registration(self, plugin: str, hook: str, register: Callable[..., None]) -> None:
        """Call one plugin's implementation of a registration hook with ``register``."""
        for info in self.impls(hook):
            if info.plugin == plugin:
                info.invoke(register)

    # -- the per-call pipeline ----------------------------------------------------------------------

    async def pre_execute(self, execution: ToolExecution) -> PreDecision:
        """Aggregate pre-execute votes: any deny wins, else any ask, else allow."""
        ask: PreDecision | None = None
        for info in self._visible("dsh_pre_execute", execution.agent):
            try:
                decision = info.invoke(execution)
                if decision is not None and _is_awaitable(decision):
                    decision = await decision
            except (Exception, asyncio.CancelledError) as error:
                if own_cancellation(error):
                    raise
                raise HookFailure("dsh_pre_execute", info.plugin, error) from error
            if decision is None:
                continue
            if not isinstance(decision, PreDecision):
                raise HookFailure(
                    "dsh_pre_execute",
                    info.plugin,
                    TypeError(f"returned {type(decision).__name__}, expected PreDecision or None"),
                )
            # Fail closed on a decision the core does not recognise (built around the validators):
            # only exactly "allow" allows, never "anything but deny or ask".
            kind, reason = decision.kind, decision.reason
            if reason is not None and not isinstance(reason, str):
                raise HookFailure(
                    "dsh_pre_execute",
                    info.plugin,
                    TypeError(f"returned a PreDecision whose reason is {type(reason).__name__}, expected str or None"),
                )
            if kind == "deny":
                return decision
            if kind == "ask":
                if ask is None:
                    ask = decision
            elif kind != "allow":
                raise HookFailure(
                    "dsh_pre_execute",
                    info.plugin,
                    ValueError(
                        f"returned a PreDecision of unknown kind {kind!r}, expected one of {', '.join(PRE_KINDS)}"
                    ),
                )
        return ask if ask is not None else _ALLOW

    async def approve(
        self, request: ApprovalRequest, *, on_channel: Callable[[str], None] | None = None
    ) -> ApprovalOutcome:
        """The first channel's answer; ``unavailable`` when none answers or a channel raises.

        ``on_channel(plugin)`` is called as each channel is asked, so that the caller knows
        which one holds the ask (and can name it if it ignores the ask's withdrawal). An ask
        withdrawn while a channel holds it (the task running this is cancelled) ends
        cancelled even if that channel swallows the cancellation: whatever it answers,
        ``allowed`` included, is dropped, and no further channel is asked.
        """
        for info in self._visible("dsh_approve", request.execution.agent):
            if on_channel is not None:
                on_channel(info.plugin)
            try:
                outcome = info.invoke(request)
                if outcome is not None and _is_awaitable(outcome):
                    outcome = await outcome
            except (Exception, asyncio.CancelledError) as error:
                if own_cancellation(error):
                    raise  # the ask was given up (an abort, the caller cancelled): the runtime reports it
                # A stray cancellation too: the channel failed, the ask was not cancelled by anyone.
                log.warning("approval channel of plugin %r failed", info.plugin, exc_info=True)
                return ApprovalOutcome.UNAVAILABLE
            if cancellation_requested():
                # The channel swallowed the ask's withdrawal: its answer reaches nobody, and no other
                # channel may pick up an ask that no longer exists.
                raise asyncio.CancelledError
            if outcome is None:
                continue
            try:
                return ApprovalOutcome(outcome)
            except Exception:  # not an outcome (a typo, a bool, an object whose == raises): never allowed
                log.warning(
                    "approval channel of plugin %r answered %r, which is not an ApprovalOutcome; "
                    "the request counts as unavailable",
                    info.plugin,
                    outcome,
                )
                return ApprovalOutcome.UNAVAILABLE
        return ApprovalOutcome.UNAVAILABLE

    async def approval_resolved(self, request: ApprovalRequest, outcome: ApprovalOutcome) -> None:
        """Notify every approval observer; failures are logged and contained.

        Cancelled meanwhile, the observer being awaited is interrupted, the later ones are
        still notified, and the cancellation is raised after the last.
        """
        cancelled: asyncio.CancelledError | None = None
        for info in self._visible("dsh_approval_resolved", request.execution.agent):
            try:
                result = info.invoke(request, outcome)
                if result is not None and _is_awaitable(result):
                    await result
            except asyncio.CancelledError as error:
                cancelled = _cancelled_observer(error, "approval observer", info.plugin) or cancelled
            except Exception:
                log.warning("approval observer of plugin %r failed", info.plugin, exc_info=True)
        if cancelled is not None:
            raise cancelled

    async def guard(self, execution: ToolExecution) -> str | None:
        """The first denial reason of the guard implementations (fail closed on errors)."""
        for info in self._visible("dsh_guard", execution.agent):
            try:
                reason = info.invoke(execution)
                if reason is not None and _is_awaitable(reason):
                    reason = await reason
            except (Exception, asyncio.CancelledError) as error:
                if own_cancellation(error):
                    raise
                # Fail closed, and say whose guard it was: the model reads the reason, the log the trace.
                log.warning(
                    "dsh_guard of plugin %r failed on call %r; the call is denied",
                    info.plugin,
                    execution.call_id,
                    exc_info=True,
                )
                return failure_message("dsh_guard", info.plugin, error)
            if reason is not None:
                if isinstance(reason, str):
                    # A blank reason still denies; the model is told whose guard it was.
                    return (
                        str(reason)
                        if reason.strip()
                        else (f'dsh_guard of plugin {info.plugin!r} denied tool "{execution.name}" (it gave no reason)')
                    )
                # Not a reason (a bool, a dict): deny all the same, and say whose guard answered what.
                log.warning(
                    "dsh_guard of plugin %r returned %s on call %r; the call is denied",
                    info.plugin,
                    type(reason).__name__,
                    execution.call_id,
                )
                return failure_message("dsh_guard", info.plugin, guard_verdict_error(reason))
        return None

    def around_dispatch(self, execution: ToolExecution) -> list[tuple[str, Middleware]]:
        """Middleware with its plugin's name, in call order (the first is outermost)."""
        chain: list[tuple[str, Middleware]] = []
        for info in self._visible("dsh_around_dispatch", execution.agent):
            try:
                middleware = info.invoke(execution)
            except (Exception, asyncio.CancelledError) as error:
                if own_cancellation(error):
                    raise
                raise HookFailure("dsh_around_dispatch", info.plugin, error) from error
            if middleware is not None:
                chain.append((info.plugin, middleware))
        return chain

    async def post_execute(self, execution: ToolExecution, result: ToolResult) -> list[tuple[str, PostDecision]]:
        """Every post-execute decision with its plugin name, in call order."""
        decisions: list[tuple[str, PostDecision]] = []
        for info in self._visible("dsh_post_execute", execution.agent):
            try:
                decision = info.invoke(execution, result)
                if decision is not None and _is_awaitable(decision):
                    decision = await decision
            except (Exception, asyncio.CancelledError) as error:
                if own_cancellation(error):
                    raise
                raise HookFailure("dsh_post_execute", info.plugin, error) from error
            if decision is None:
                continue
            if not isinstance(decision, PostDecision):
                raise HookFailure(
                    "dsh_post_execute",
                    info.plugin,
                    TypeError(f"returned {type(decision).__name__}, expected PostDecision or None"),
                )
            if decision.kind not in POST_KINDS:  # built around the validator: fail, never read as a replacement
                raise HookFailure(
                    "dsh_post_execute",
                    info.plugin,
                    ValueError(
                        f"returned a PostDecision of unknown kind {decision.kind!r}, expected one of "
                        f"{', '.join(POST_KINDS)}"
                    ),
                )
            if decision.kind in ("replace-content", "block"):
                problem = content_problem(decision.content)
                if problem is not None:  # content altered around its checks: what the model would read
                    raise HookFailure(
                        "dsh_post_execute",
                        info.plugin,
                        InvalidToolOutputError(
                            f"dsh_post_execute of plugin {info.plugin!r} returned invalid content for tool "
                            f'"{execution.name}": {problem}'
                        ),
                    )
            decisions.append((info.plugin, decision))
        return decisions

    async def tool_result(self, execution: ToolExecution, result: ToolResult) -> None:
        """Notify every observer; failures are logged and contained.

        Exactly one result event per observer: cancelled meanwhile (the caller gave up on the
        call), the observer being awaited is interrupted, the later ones are still notified
        (the session recorder among them), and the cancellation is raised after the last.
        """
        cancelled: asyncio.CancelledError | None = None
        for info in self._visible("dsh_tool_result", execution.agent):
            try:
                outcome = info.invoke(execution, result)
                if outcome is not None and _is_awaitable(outcome):
                    await outcome
            except asyncio.CancelledError as error:
                cancelled = _cancelled_observer(error, "tool result observer", info.plugin) or cancelled
            except Exception:
                log.warning("tool result observer of plugin %r failed", info.plugin, exc_info=True)
        if cancelled is not None:
            raise cancelled

    async def code_dispatch_log(self, dispatch: Any, agent: Scope | None) -> Sequence[ContentBlock] | None:
        """The first reshaped durable content, or ``None`` (failures contained)."""
        for info in self._visible("dsh_code_dispatch_log", agent):
            try:
                blocks = info.invoke(dispatch)
                if blocks is not None and _is_awaitable(blocks):
                    blocks = await blocks
            except (Exception, asyncio.CancelledError) as error:
                if own_cancellation(error):
                    raise
                log.warning("code dispatch log hook of plugin %r failed", info.plugin, exc_info=True)
                return None
            if blocks is not None:
                return tuple(blocks)
        return None

    # -- prompt assembly ------------------------------------------------------------------------------

    def prompt_sections(self, context: PromptContext) -> list[tuple[PromptSection, int, str]]:
        """Contributed sections with the depth of their plugin's layer (0 = deployment) and plugin name.

        A raising implementation, or one returning something other than sections, fails the
        assembly with a :class:`HookFailure` naming the hook and the plugin.
        """
        found: list[tuple[PromptSection, int, str]] = []
        for info in self._visible("dsh_prompt_sections", context.agent):
            try:
                contributed = info.invoke(context)
                if contributed is None:
                    continue
                items = [contributed] if isinstance(contributed, PromptSection) else list(contributed)
            except Exception as error:
                raise HookFailure("dsh_prompt_sections", info.plugin, error) from error
            depth = 0 if info.layer is None else info.layer.depth
            for section in items:
                problem = _section_problem(section)
                if problem is not None:
                    raise HookFailure("dsh_prompt_sections", info.plugin, TypeError(problem))
                found.append((section, depth, info.plugin))
        return found

    def prompt_filter(self, context: PromptContext, sections: list[PromptSection]) -> list[PromptSection]:
        """Run the filters in call order, each on the previous output.

        A raising filter, or one returning something other than sections, fails the assembly
        with a :class:`HookFailure` naming the hook and the plugin.
        """
        for info in self._visible("dsh_prompt_filter", context.agent):
            try:
                replaced = info.invoke(context, tuple(sections))
                if replaced is None:
                    continue
                filtered = list(replaced)
            except Exception as error:
                raise HookFailure("dsh_prompt_filter", info.plugin, error) from error
            for section in filtered:
                problem = _section_problem(section)
                if problem is not None:
                    raise HookFailure("dsh_prompt_filter", info.plugin, TypeError(problem))
            sections = filtered
        return sections
