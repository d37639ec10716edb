"""Harness.aclose with calls in flight: they are aborted and awaited before any plugin goes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from importlib import metadata

import pytest

from dsh_core import AbortController
from dsh_core.config import compose
from dsh_core.harness import Harness
from dsh_core.plugins import ENTRY_POINT_GROUP, PluginCatalog
from tests.core import sample_plugins

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def fresh_events() -> Iterator[None]:
    sample_plugins.SLOW_EVENTS.clear()
    sample_plugins.SLOW_PLUGINS.clear()
    yield


async def start() -> Harness:
    catalog = PluginCatalog(
        entry_points=[metadata.EntryPoint("slow", "tests.core.sample_plugins:slow", ENTRY_POINT_GROUP)]
    )
    return await Harness.start(
        compose([("dsh.toml", {"plugins": [{"id": "slow", "use": "slow"}]})], env={}), catalog=catalog
    )


async def until_started(count: int) -> None:
    while sample_plugins.SLOW_PLUGINS[0].started < count:
        await asyncio.sleep(0)


async def test_aclose_aborts_the_calls_in_flight_and_waits_for_them_before_disposing_plugins() -> None:
    harness = await start()
    calls = [asyncio.ensure_future(harness.call("slow", {})) for _ in range(3)]
    await until_started(3)
    await harness.aclose()
    # Every body saw the abort while its plugin was still open; disposal came after the last one.
    assert sample_plugins.SLOW_EVENTS == ["started"] * 3 + ["aborted: harness closed (plugin open: True)"] * 3 + [
        "disposed"
    ]
    assert all(call.done() for call in calls)
    results = [call.result() for call in calls]
    assert [result.code for result in results] == ["ABORTED"] * 3
    assert harness.root.disposed


async def test_a_call_after_aclose_raises_naming_the_tool() -> None:
    harness = await start()
    await harness.aclose()
    with pytest.raises(RuntimeError, match="the harness is closed: no call of 'slow' can start"):
        await harness.call("slow", {})
    assert sample_plugins.SLOW_PLUGINS[0].started == 0
    await harness.aclose()  # twice is harmless


async def test_the_callers_signal_still_aborts_the_call_and_its_listener_is_released() -> None:
    harness = await start()
    try:
        controller = AbortController()
        call = asyncio.ensure_future(harness.call("slow", {}, signal=controller.signal))
        await until_started(1)
        assert controller.signal._listeners  # the fused signal listens while the call runs
        controller.abort("user pressed stop")
        result = await call
        assert result.code == "ABORTED"
        assert sample_plugins.SLOW_EVENTS[-1] == "aborted: user pressed stop (plugin open: True)"
        assert not controller.signal._listeners  # nothing left behind on a long-lived signal
        assert not harness._closing.signal._listeners and not harness._calls
    finally:
        await harness.aclose()


async def test_a_body_that_closes_its_own_harness_waits_for_the_other_calls_not_for_itself() -> None:
    harness = await start()
    other = asyncio.ensure_future(harness.call("slow", {}))
    await until_started(1)
    closed = await asyncio.wait_for(harness.call("close_harness", {}), 5)
    assert other.done() and other.result().code == "ABORTED"
    assert sample_plugins.SLOW_EVENTS == ["started", "aborted: harness closed (plugin open: True)", "disposed"]
    assert harness.root.disposed
    # Its own signal was aborted by the close as well, so its success is reported as aborted.
    assert closed.code == "ABORTED"


async def test_an_abort_listener_that_raises_does_not_stop_the_close(caplog: pytest.LogCaptureFixture) -> None:
    harness = await start()
    call = asyncio.ensure_future(harness.call("slow", {}))
    await until_started(1)

    def broken(_reason: object) -> None:
        raise ValueError("listener bug")

    harness._closing.signal.add_listener(broken)
    with caplog.at_level(logging.WARNING, logger="dsh"):
        await harness.aclose()
    assert (await call).code == "ABORTED"
    assert harness.root.disposed
    assert "an abort listener of a call in flight failed while the harness closed" in caplog.text
