"""Lifecycle scopes: ownership, disposal order, quiescence."""

from __future__ import annotations

import asyncio

import pytest

from dsh_core.scope import Scope, ScopeDisposedError

pytestmark = pytest.mark.anyio


async def test_dispose_unwinds_children_first_then_disposers_in_reverse_and_awaits_tasks() -> None:
    root = Scope()
    trail: list[str] = []
    first, second = root.child("first"), root.child("second")
    first.on_dispose(lambda: trail.append("first"))
    second.on_dispose(lambda: trail.append("second"))

    async def async_disposer() -> None:
        await asyncio.sleep(0)
        trail.append("root-async")

    root.on_dispose(lambda: trail.append("root-1"))
    root.on_dispose(async_disposer)
    cancelled = asyncio.Event()

    async def background() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            cancelled.set()

    task = second.spawn(background())
    await asyncio.sleep(0)
    await root.dispose()
    assert trail == ["second", "first", "root-async", "root-1"]
    assert task.done() and cancelled.is_set()
    assert root.disposed and first.disposed


async def test_a_disposed_scope_refuses_new_work_and_disposing_twice_is_harmless() -> None:
    root = Scope()
    child = root.child("c")
    await child.dispose()
    await child.dispose()
    with pytest.raises(ScopeDisposedError):
        child.on_dispose(lambda: None)
    with pytest.raises(ScopeDisposedError):
        child.spawn(asyncio.sleep(0))


async def test_a_failing_disposer_does_not_stop_the_unwinding(caplog: pytest.LogCaptureFixture) -> None:
    root = Scope()
    trail: list[str] = []
    root.on_dispose(lambda: trail.append("ran"))

    def broken() -> None:
        raise RuntimeError("broken disposer")

    root.on_dispose(broken)
    await root.dispose()
    assert trail == ["ran"] and "disposer" in caplog.text


def test_services_are_looked_up_through_the_chain_and_layers_are_found() -> None:
    root = Scope()
    root.provide("tools", "registry")
    agent = root.child("agent:a", layered=True)
    plugin = agent.child("plugin:p")
    assert plugin.lookup("tools") == "registry" and plugin.lookup("missing") is None
    assert plugin.layer_owner is agent and root.layer_owner is None
    assert plugin.is_within(agent) and not agent.is_within(plugin)
    with pytest.raises(ValueError, match="already provided"):
        root.provide("tools", "again")
