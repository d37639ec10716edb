"""Lifecycle scopes: ownership, disposal order, quiescence."""

from __future__ import annotations

import asyncio
import math

import pytest

from dsh_core.scope import TASK_GRACE_S, Scope, ScopeDisposedError

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


async def test_a_concurrent_dispose_waits_until_the_scope_and_its_children_are_quiescent() -> None:
    """A second dispose() (Harness.aclose while a plugin scope is being stopped) returns only when all is done."""
    root = Scope()
    plugin = root.child("plugin:p")
    trail: list[str] = []

    async def slow_close() -> None:
        await asyncio.sleep(0.05)
        trail.append("slow_close")

    plugin.on_dispose(slow_close)
    first = asyncio.ensure_future(plugin.dispose())
    await asyncio.sleep(0)
    await asyncio.wait_for(root.dispose(), 5)
    assert trail == ["slow_close"] and plugin.disposed and root.disposed
    await asyncio.wait_for(plugin.dispose(), 5)  # a third call: already disposed
    await first


async def test_cancelling_the_caller_of_dispose_does_not_stop_the_unwinding() -> None:
    """The caller gets its CancelledError; the remaining disposers still run, and a retry waits for the end."""
    root = Scope()
    plugin = root.child("plugin:p")
    trail: list[str] = []
    plugin.on_dispose(lambda: trail.append("unregister"))
    entered = asyncio.Event()

    async def slow_close() -> None:
        entered.set()
        await asyncio.sleep(0.05)
        trail.append("slow_close")

    plugin.on_dispose(slow_close)
    caller = asyncio.ensure_future(root.dispose())
    await entered.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert not root.active and trail == []
    await asyncio.wait_for(root.dispose(), 5)
    assert trail == ["slow_close", "unregister"] and plugin.disposed and root.disposed


async def test_cancelling_the_unwinding_itself_abandons_one_step_and_runs_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What a loop shutdown does (it cancels every task): the disposer being awaited is given up, not the rest."""
    root = Scope()
    trail: list[str] = []
    root.on_dispose(lambda: trail.append("last"))
    entered = asyncio.Event()

    async def hangs() -> None:
        entered.set()
        await asyncio.sleep(10)

    root.on_dispose(hangs)
    caller = asyncio.ensure_future(root.dispose())
    await entered.wait()
    (unwinding,) = [t for t in asyncio.all_tasks() if t.get_name() == "dispose root"]
    unwinding.cancel()
    await asyncio.wait_for(caller, 5)
    assert trail == ["last"] and root.disposed and "was cancelled" in caplog.text


async def test_a_disposer_raising_any_base_exception_does_not_stop_the_unwinding(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Odd(BaseException):
        pass

    root = Scope()
    child = root.child("c")
    trail: list[str] = []
    child.on_dispose(lambda: trail.append("child"))

    def odd() -> None:
        raise Odd

    async def cancelled_inside() -> None:  # a disposer whose own await was cancelled: not ours to obey
        raise asyncio.CancelledError

    child.on_dispose(odd)
    root.on_dispose(lambda: trail.append("root"))
    root.on_dispose(cancelled_inside)
    await asyncio.wait_for(root.dispose(), 5)
    assert trail == ["child", "root"] and child.disposed and root.disposed
    assert "failed" in caplog.text and "Odd" in caplog.text


def test_keyboard_interrupt_stops_the_unwinding_and_a_later_dispose_resumes_it() -> None:
    """KeyboardInterrupt leaves the event loop as asyncio intends; what is left runs on the next dispose()."""
    root = Scope()
    trail: list[str] = []
    root.on_dispose(lambda: trail.append("first registered"))

    def interrupted() -> None:
        trail.append("interrupted")
        raise KeyboardInterrupt

    root.on_dispose(interrupted)
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(root.dispose())
    assert trail == ["interrupted"] and not root.active and not root.disposed
    asyncio.run(asyncio.wait_for(root.dispose(), 5))
    assert trail == ["interrupted", "first registered"] and root.disposed


async def test_dispose_from_within_the_unwinding_does_not_deadlock() -> None:
    """A disposer disposing its own scope or an ancestor returns at once; the ancestor is still disposed."""
    root = Scope()
    child = root.child("c")
    trail: list[str] = []

    async def disposes_itself_and_its_parent() -> None:
        await child.dispose()
        await root.dispose()
        trail.append("returned")

    child.on_dispose(disposes_itself_and_its_parent)
    await asyncio.wait_for(child.dispose(), 5)
    assert trail == ["returned"] and child.disposed
    await asyncio.wait_for(root.dispose(), 5)
    assert root.disposed


async def test_a_task_of_the_scope_may_dispose_it() -> None:
    """The task is cancelled by the unwinding it started, which still completes."""
    root = Scope()
    worker = root.child("worker")
    stopped = asyncio.Event()

    async def work() -> None:
        try:
            await worker.dispose()
        finally:
            stopped.set()

    task = worker.spawn(work())
    await asyncio.wait_for(stopped.wait(), 5)
    assert task.cancelled()
    await asyncio.wait_for(worker.dispose(), 5)
    assert worker.disposed


async def test_an_unwinding_cancelled_before_it_ran_is_started_again_for_its_callers() -> None:
    root = Scope()
    trail: list[str] = []
    root.on_dispose(lambda: trail.append("ran"))
    caller = asyncio.ensure_future(root.dispose())
    await asyncio.sleep(0)  # the caller has started the unwinding task, which has not run yet
    (unwinding,) = [t for t in asyncio.all_tasks() if t.get_name() == "dispose root"]
    unwinding.cancel()
    await asyncio.wait_for(caller, 5)
    assert unwinding.cancelled() and trail == ["ran"] and root.disposed


class _Stubborn:
    """A task body that swallows its cancellation and keeps waiting until the test releases it."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.release = asyncio.Event()

    async def run(self) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            await self.release.wait()  # ignores the cancellation: dispose must not wait for this


def _grace_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "dsh" and "did not end within" in record.getMessage()
    ]


async def test_dispose_leaves_a_task_that_ignores_its_cancellation_after_the_grace_and_names_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = Scope(task_grace_s=0.05)
    plugin = root.child("plugin:p")
    trail: list[str] = []
    plugin.on_dispose(lambda: trail.append("disposer"))
    stubborn = _Stubborn()
    task = plugin.spawn(stubborn.run(), name="poller")
    await asyncio.sleep(0)
    try:
        await asyncio.wait_for(root.dispose(), 5)
        assert root.disposed and plugin.disposed and trail == ["disposer"]
        assert stubborn.cancelled.is_set() and not task.done()
        (warning,) = _grace_warnings(caplog)
        assert "'poller'" in warning and "_Stubborn.run" in warning and "'root/plugin:p'" in warning
        assert "0.05 s" in warning
    finally:
        stubborn.release.set()
        await asyncio.wait_for(task, 5)


async def test_a_child_scope_inherits_the_task_grace_unless_given_its_own() -> None:
    root = Scope(task_grace_s=0.25)
    child = root.child("c")
    assert child.task_grace_s == 0.25 and child.child("g").task_grace_s == 0.25
    assert root.child("own", task_grace_s=1).task_grace_s == 1.0
    assert Scope().task_grace_s == TASK_GRACE_S == 10.0


async def test_a_child_left_with_the_inherited_grace_does_not_hang_its_parent(caplog: pytest.LogCaptureFixture) -> None:
    root = Scope(task_grace_s=0.05)
    grandchild = root.child("c").child("g")
    stubborn = _Stubborn()
    task = grandchild.spawn(stubborn.run())
    await asyncio.sleep(0)
    try:
        await asyncio.wait_for(root.dispose(), 5)
        (warning,) = _grace_warnings(caplog)
        assert "'root/c/g'" in warning and "_Stubborn.run" in warning
    finally:
        stubborn.release.set()
        await asyncio.wait_for(task, 5)


async def test_well_behaved_tasks_end_within_the_grace_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    root = Scope(task_grace_s=0.05)
    ended = asyncio.Event()

    async def tidy() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.set()

    tasks = [root.spawn(tidy()), root.spawn(asyncio.sleep(3600))]
    await asyncio.sleep(0)
    await asyncio.wait_for(root.dispose(), 5)
    assert all(t.cancelled() for t in tasks) and ended.is_set()
    assert _grace_warnings(caplog) == []


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, True, "5", pytest.param(10**400, id="huge-int")])
def test_the_task_grace_must_be_a_positive_finite_number_of_seconds(value: object) -> None:
    with pytest.raises(ValueError, match=r"task_grace_s of scope 'root' must be a positive, finite number of sec"):
        Scope(task_grace_s=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"task_grace_s of scope 'c' must be a positive, finite number of sec"):
        Scope().child("c", task_grace_s=value)  # type: ignore[arg-type]
