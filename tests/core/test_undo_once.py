"""What a registration returns undoes that registration once: called again, it removes nothing later.

A plugin that keeps its undo function and calls it twice (once by hand, once again
from its own cleanup) must not silently remove a guard, a restriction, a mode or a
plugin that was registered anew in between and looks the same as the one undone.
"""

from __future__ import annotations

from typing import Any

import pytest

from dsh_core import hookimpl
from dsh_core.errors import ErrorCode
from dsh_core.model import PreDecision, ToolExecution

from .helpers import Stack, tool

pytestmark = pytest.mark.anyio


def deny_everything(execution: ToolExecution) -> str:
    return "denied by the guard"


async def test_a_guard_added_again_survives_the_first_guards_second_removal() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    remove = stack.registry.guard(deny_everything)
    remove()
    stack.registry.guard(deny_everything)
    remove()
    result = await stack.call("echo")
    assert result.error is not None and result.error.code == ErrorCode.DENIED, result


async def test_a_mode_declared_again_survives_the_first_declarations_second_restore() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))
    agent = stack.agent()
    restore = stack.registry.present_as("code", agent)
    restore()
    stack.registry.present_as("code", agent)
    restore()
    # Code Mode still collapses the tools for this agent: the model cannot call echo directly.
    result = await stack.call("echo", agent=agent)
    assert result.error is not None and result.error.code == ErrorCode.UNKNOWN_TOOL, result


async def test_a_tool_registered_again_survives_the_first_registrations_second_undo() -> None:
    stack = Stack()
    echo = tool("echo")
    unregister = stack.registry.register(echo)
    unregister()
    stack.registry.register(echo)
    unregister()
    assert stack.registry.get("echo") is echo


async def test_a_plugin_registered_again_survives_the_first_registrations_second_undo() -> None:
    stack = Stack()
    stack.registry.register(tool("echo"))

    class Refuse:
        @hookimpl
        def dsh_pre_execute(self) -> PreDecision:
            return PreDecision.deny("refused by the plugin")

    plugin = Refuse()
    unregister = stack.hooks.register(plugin, name="refuse")
    unregister()
    stack.hooks.register(plugin, name="refuse")
    unregister()
    result = await stack.call("echo")
    assert result.error is not None and result.error.code == ErrorCode.DENIED, result


async def test_a_nesting_opened_twice_is_closed_once_per_opener() -> None:
    stack = Stack(mode="code")
    stack.registry.register(tool("echo"))
    token: Any = object()
    close_first = stack.runtime.open_nesting(token, None)
    stack.runtime.open_nesting(token, None)  # a second body under the same parent, still running
    close_first()
    close_first()
    result = await stack.call("echo", parent=token)
    assert result.error is None, result


async def test_a_service_and_a_disposer_given_again_survive_the_first_ones_second_undo() -> None:
    stack = Stack()
    service = object()
    withdraw = stack.root.provide("key", service)
    withdraw()
    stack.root.provide("key", service)
    withdraw()
    assert stack.root.lookup("key") is service

    ran: list[str] = []

    def disposer() -> None:
        ran.append("disposed")

    forget = stack.root.on_dispose(disposer)
    forget()
    stack.root.on_dispose(disposer)
    forget()
    await stack.root.dispose()
    assert ran == ["disposed"]
