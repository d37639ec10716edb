"""Tool registration."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from dsh_hookspecs import hookspec

if TYPE_CHECKING:
    from dsh_core.model import ToolDefinition


@hookspec
def dsh_register_tools(register: Callable[[ToolDefinition], None]) -> None:
    """Register this plugin's tools: call ``register(definition)`` once per tool.

    Called once per plugin instance, right after the instance is registered.
    Tools land in the layer of the plugin's scope (the global layer for a
    deployment plugin, the agent's layer for an agent-scoped one) and are
    unregistered when that scope is disposed.

    ``register`` validates as it goes and raises
    :class:`dsh_core.errors.RegistrationError` (duplicate name in the layer,
    the reserved name ``run_code``, a name that is not 1-64 characters of
    ``[A-Za-z0-9_-]``, a definition not built by ``define_tool``); a schema
    that is not valid Draft 2020-12 is refused earlier, by ``define_tool``
    (:class:`dsh_core.errors.SchemaDefinitionError`). Either way the plugin
    fails to start and nothing it registered stays. Return value: ignored.
    """
