"""Boot a deployment: root scope, hooks, registry, runtime, plugins, agents.

:meth:`Harness.start` composes everything a :class:`~dsh_core.config.Deployment`
describes, in order (plugins in row order, then agents), and disposes all of
it if any step fails. :meth:`Harness.aclose` first aborts and awaits the calls
made through :meth:`Harness.call`, then disposes the root scope: every plugin,
tool, hook implementation, agent and task unwinds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from dsh_core.abort import AbortController, AbortSignal
from dsh_core.config import DEFAULT_SOURCE, Deployment, check_graces, validate_plugin_configs
from dsh_core.errors import ConfigError, PluginLoadError, RegistrationError
from dsh_core.hooks import Hooks
from dsh_core.lossless import JSON
from dsh_core.model import ToolDefinition, ToolExecutionInput, ToolResult
from dsh_core.plugins import CONFIG_DIR_SERVICE, PluginCatalog, config_schema_of, start_plugin
from dsh_core.registry import TRANSPORT_NAME, ToolRegistry
from dsh_core.runtime import ToolRuntime
from dsh_core.scope import Scope

__all__ = ["Harness", "NamedRegistry", "load_plugins"]

T = TypeVar("T")

log = logging.getLogger("dsh")


class NamedRegistry(Generic[T]):
    """Objects registered by name by plugins (providers, session stores), owned by their scopes."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, tuple[T, str]] = {}

    def registrar(self, scope: Scope, plugin_id: str) -> Callable[[str, T], None]:
        """The ``register(name, item)`` callable handed to one plugin's registration hook."""

        def register(name: str, item: T) -> None:
            # Checked before any change: scope.on_dispose() would raise only after the item was in,
            # leaving it registered for good (and refusing the name to every later plugin).
            if not scope.active:
                state = "disposed" if scope.disposed else "being disposed"
                raise RegistrationError(f"cannot register {self.kind} {name!r}: scope {scope.path!r} is {state}")
            if not isinstance(name, str) or not name:
                # Config selects these by a non-empty string ([[agents]] provider, [sessions] store): any
                # other name could never be picked, and would break every "known: ..." list built from names().
                got = "an empty string" if isinstance(name, str) else type(name).__name__
                raise RegistrationError(
                    f"cannot register {self.kind} {name!r}: a {self.kind} name must be a non-empty string, got {got}"
                )
            if name in self._items:
                owner = self._items[name][1]
                raise RegistrationError(
                    f"{self.kind} {name!r} is registered by both plugin {owner!r} and plugin {plugin_id!r}"
                )
            self._items[name] = (item, plugin_id)

            def remove() -> None:
                if self._items.get(name, (None, None))[0] is item:
                    del self._items[name]

            scope.on_dispose(remove)

        return register

    def get(self, name: str) -> T | None:
        """The item registered under ``name``."""
        entry = self._items.get(name)
        return None if entry is None else entry[0]

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)


def load_plugins(deployment: Deployment, catalog: PluginCatalog | None = None) -> dict[str, Callable[..., Any]]:
    """Import every enabled row's plugin and validate each row's config: the checks made before any start.

    Returns the factory of each row by id. Raises :class:`ConfigError` for an
    unknown ``use`` or a config its plugin's schema refuses, and
    :class:`PluginLoadError` naming every row whose plugin cannot be imported;
    each message names the file and the row. Every row at fault is named at once, one
    line each (a :class:`ConfigError` when any ``use`` is unknown). Nothing is started.

    What a plugin module prints while it is imported goes to stderr: stdout is
    the command's output (``dsh config dump --json``, ``dsh -p``'s answer).
    """
    catalog = catalog or PluginCatalog()
    factories: dict[str, Callable[..., Any]] = {}
    # Keyed by ``use``: two rows of one broken plugin import it once and both are named.
    failures: dict[str, PluginLoadError] = {}
    problems: list[str] = []
    unknown = False
    for row in deployment.plugins:
        source = deployment.source_of(f"plugins[{row.id}].use") or "config"
        if row.use not in catalog:
            # Named with every other row at fault, in the rows' order: one boot tells the whole of it.
            problems.append(f"{source}: plugins[{row.id}].use: {catalog.unknown(row.use)}")
            unknown = True
            continue
        # Always strict: a configured row may be a guard or an approval policy, and
        # running without it would fail open.
        error = failures.get(row.use)
        if error is None:
            try:
                with contextlib.redirect_stdout(sys.stderr):
                    factories[row.id] = catalog.load(row.use)
                continue
            except PluginLoadError as failed:
                error = failures[row.use] = failed
        problems.append(
            f"{source}: plugins[{row.id}].use: {error.message} (the deployment does not start "
            "without a configured plugin: fix its installation, or remove the row or set "
            "enabled = false)"
        )
    if problems:
        # A row naming no plugin is the configuration's mistake; rows whose plugin fails to import alone, its install's.
        raise (ConfigError if unknown else PluginLoadError)("\n".join(problems))
    validate_plugin_configs(deployment, lambda row: config_schema_of(factories[row.id]))
    return factories


class Harness:
    """A running deployment. Build with :meth:`start`; dispose with :meth:`aclose`."""

    def __init__(
        self,
        deployment: Deployment,
        catalog: PluginCatalog,
        root: Scope,
        hooks: Hooks,
        registry: ToolRegistry,
        runtime: ToolRuntime,
    ) -> None:
        self.deployment = deployment
        self.catalog = catalog
        self.root = root
        self.hooks = hooks
        self.registry = registry
        self.runtime = runtime
        self.providers: NamedRegistry[Any] = NamedRegistry("provider")
        self.session_stores: NamedRegistry[Any] = NamedRegistry("session store")
        self.agents: dict[str, Scope] = {}
        self.plugins: dict[str, Scope] = {}
        self._tool_rows: dict[str, str] = {}  # tool name -> the plugin row that registered it
        self._call_ids = itertools.count(1)
        # Fused into every call made through call(): aclose aborts it, so no body outlives its plugin.
        self._closing = AbortController()
        self._calls: dict[asyncio.Future[None], asyncio.Task[Any] | None] = {}

    @classmethod
    async def start(
        cls,
        deployment: Deployment,
        *,
        catalog: PluginCatalog | None = None,
        transport: ToolDefinition | Callable[[Harness], ToolDefinition] | None = None,
    ) -> Harness:
        """Boot ``deployment``; on any error, dispose what was started and re-raise.

        A deployment whose ``[tools] approval_grace_s`` is not below its ``[lifecycle] task_grace_s``
        is refused first (:func:`~dsh_core.config.check_graces`), before anything starts.

        ``transport`` supplies the reserved ``run_code`` definition (built lazily
        from the harness on first need).
        """
        catalog = catalog or PluginCatalog()
        # compose() checked this already, but a Deployment built in code never went through it: the task grace
        # of the scopes below must cover the runtime's approval grace, or a call outlives its scope's dispose.
        check_graces(deployment)
        # Every plugin's, agent's and run's scope is under this one, and takes its task grace.
        root = Scope("root", task_grace_s=deployment.lifecycle.task_grace_s)
        hooks = Hooks()
        holder: list[Harness] = []

        def transport_source() -> ToolDefinition:
            if transport is None:
                raise RuntimeError("no run_code transport is configured for this harness")
            return transport if isinstance(transport, ToolDefinition) else transport(holder[0])

        registry = ToolRegistry(
            default_mode=deployment.tools.mode,  # type: ignore[arg-type]
            transport=transport_source if transport is not None else None,
        )
        runtime = ToolRuntime(
            registry,
            hooks,
            approval_timeout_s=deployment.tools.approval_timeout_s,
            approval_grace_s=deployment.tools.approval_grace_s,
        )
        harness = cls(deployment, catalog, root, hooks, registry, runtime)
        holder.append(harness)
        root.provide("tools", registry)
        root.provide("runtime", runtime)
        root.provide("harness", harness)
        try:
            await harness._start_plugins()
            harness._start_agents()
        except BaseException:
            await root.dispose()
            raise
        return harness

    async def _start_plugins(self) -> None:
        factories = load_plugins(self.deployment, self.catalog)
        registrars: dict[str, Callable[[Scope, str], Callable[..., None]]] = {
            "dsh_register_tools": self._tool_registrar,
            "dsh_register_providers": self.providers.registrar,
            "dsh_register_session_stores": self.session_stores.registrar,
        }
        for row in self.deployment.plugins:
            # Relative paths in a row's config are the file's, not the working directory's.
            config_dir = self.deployment.config_dir(row.id)
            self.plugins[row.id] = await start_plugin(
                plugin_id=row.id,
                factory=factories[row.id],
                config=row.config,
                parent=self.root,
                hooks=self.hooks,
                registrars=registrars,
                source=self.catalog.source(row.use),
                origin=self.deployment.origin_of(f"plugins[{row.id}].use"),
                config_origin=self.deployment.origin_of(f"plugins[{row.id}].config"),
                services=None if config_dir is None else {CONFIG_DIR_SERVICE: config_dir},
            )

    def _tool_registrar(self, scope: Scope, plugin_id: str) -> Callable[[ToolDefinition], None]:
        def register(definition: ToolDefinition) -> None:
            try:
                self.registry.register(definition, scope=scope)
            except RegistrationError:
                # The registry knows scopes, not rows: name the row that has the name, as providers do.
                owner = self._tool_rows.get(definition.name) if scope.active else None
                if owner is None or owner == plugin_id:
                    raise
                raise RegistrationError(
                    f'tool "{definition.name}" is registered by both plugin row {owner!r} and plugin row {plugin_id!r}'
                ) from None
            name = definition.name
            self._tool_rows[name] = plugin_id

            def forget() -> None:
                if self._tool_rows.get(name) == plugin_id:
                    del self._tool_rows[name]

            scope.on_dispose(forget)

        return register

    def _start_agents(self) -> None:
        rows = self.deployment.agents
        for row in rows:
            scope = self.root.child(f"agent:{row.id}", layered=True)
            self.agents[row.id] = scope
            key = "mode"
            try:
                if row.mode is not None:
                    self.registry.present_as(row.mode, scope)  # type: ignore[arg-type]
                if row.allow is not None or row.deny:
                    inherited = self.registry.inherited_names(scope)
                    for key, names in (("allow", row.allow), ("deny", row.deny)):
                        # run_code is left to restrict(), which says why it cannot be named.
                        unknown = sorted(set(names or ()) - set(inherited) - {TRANSPORT_NAME})
                        if unknown:
                            raise ConfigError(
                                f"{self._agent_source(row.id, key)}: agents[{row.id}].{key}: names tools this agent "
                                f"does not inherit: {', '.join(unknown)} (known: {', '.join(inherited) or 'none'})"
                            )
                    key = "allow" if row.allow is not None and TRANSPORT_NAME in row.allow else "deny"
                    self.registry.restrict(scope, allow=row.allow, deny=row.deny)
            except RegistrationError as error:
                raise ConfigError(
                    f"{self._agent_source(row.id, key)}: agents[{row.id}].{key}: {error.message}"
                ) from None

    def _agent_source(self, agent_id: str, key: str) -> str:
        """The file that set ``agents[<id>].<key>`` (else the one that added the agent)."""
        return (
            self.deployment.source_of(f"agents[{agent_id}].{key}")
            or self.deployment.source_of(f"agents[{agent_id}].id")
            or "config"
        )

    def agent(self, agent_id: str | None = None) -> Scope:
        """The scope of agent ``agent_id`` (the first agent by default)."""
        if agent_id is None:
            if not self.agents:
                # A composed deployment gets an implicit agent unless its files declare rows: then they
                # disabled every one, and the message names them (a Deployment built in code has none).
                files = [
                    source
                    for source in self.deployment.sources
                    if source != DEFAULT_SOURCE and not source.startswith("env:")
                ]
                where = (
                    (
                        f": the [[agents]] rows of its files ({', '.join(files)}) are all disabled (enable one with "
                        "enabled = true, or drop the rows for the implicit agent 'main')"
                    )
                    if files
                    else ""
                )
                raise PluginLoadError(f"the deployment defines no agent{where}")
            return next(iter(self.agents.values()))
        scope = self.agents.get(agent_id)
        if scope is None:
            raise ConfigError(f"unknown agent {agent_id!r} (known: {', '.join(self.agents) or 'none'})")
        return scope

    def next_call_id(self) -> str:
        """A fresh call id for a model-direct call."""
        return f"call-{next(self._call_ids)}"

    async def call(
        self,
        name: str,
        arguments: JSON,
        *,
        agent: str | Scope | None = None,
        signal: AbortSignal | None = None,
        call_id: str | None = None,
    ) -> ToolResult:
        """One model-direct call through the whole pipeline.

        The call runs under ``signal`` fused with the harness's own: :meth:`aclose`
        aborts it (reason ``"harness closed"``) and waits for it to end. Raises
        :class:`RuntimeError` once :meth:`aclose` has begun.
        """
        if self._closing.signal.aborted:
            raise RuntimeError(f"the harness is closed: no call of {name!r} can start (start a new harness)")
        scope = agent if isinstance(agent, Scope) else self.agent(agent)
        fused, release = AbortSignal.fuse((signal or AbortSignal.never(), self._closing.signal))
        request = ToolExecutionInput(
            call_id=call_id or self.next_call_id(), name=name, arguments=arguments, signal=fused, agent=scope
        )
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._calls[ended] = asyncio.current_task()
        try:
            return await self.runtime.execute(request)
        finally:
            release()
            del self._calls[ended]
            ended.set_result(None)

    async def aclose(self) -> None:
        """Abort and await the calls in flight, then dispose every plugin, agent and task.

        Calls made through :meth:`call` are aborted with the reason ``"harness closed"``
        and awaited (their results go to their callers as usual), so no body is still
        running when its plugin's resources go; later calls raise. Then the root scope
        is disposed: what the harness started (plugin tasks, agent runs it spawned,
        workers) is ended and awaited. A body that ignores its abort signal holds this
        method until it returns. Closing twice is harmless.
        """
        try:
            self._closing.abort("harness closed")
        except Exception:  # a body's abort listener raised: the others were called; close anyway
            log.warning("an abort listener of a call in flight failed while the harness closed", exc_info=True)
        current = asyncio.current_task()
        # A body that closes its own harness must not wait for itself.
        pending = [ended for ended, task in self._calls.items() if task is None or task is not current]
        if pending:
            await asyncio.wait(pending)
        await self.root.dispose()

    async def __aenter__(self) -> Harness:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
