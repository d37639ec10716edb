"""A run leases its session: a second run on it fails clearly, and the lease ends with the run, however it ends."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from agent_kit import call, calls, final, scripted, start, tool

from dsh_core.agent.loop import StopReason, history_from_events, open_session_store, run_agent
from dsh_core.harness import Harness
from dsh_core.sessions import SessionBusyError, SessionLease, SessionLeaseLostError

pytestmark = pytest.mark.anyio


async def lease_is_free(harness: Harness, session_id: str) -> bool:
    """Whether another run could lease the session now (this process counts as a live holder)."""
    store = open_session_store(harness)
    probe = SessionLease.for_this_run()
    try:
        await store.acquire(session_id, probe)
    except SessionBusyError:
        return False
    finally:
        await store.close()
    store = open_session_store(harness)
    try:
        await store.release(session_id, probe)
    finally:
        await store.close()
    return True


async def test_a_second_run_on_a_leased_session_fails_and_leaves_it_resumable(tmp_path: Path) -> None:
    started, go_on = asyncio.Event(), asyncio.Event()

    async def slow(args: Any, ctx: Any) -> Any:
        started.set()
        await go_on.wait()
        return "slow done"

    turns = [
        final("first"),
        calls(call("slow", {}, "call_A")),
        final("second", expect={"last_role": "tool"}),
        final("third", expect={"last_content_contains": "and again"}),
    ]
    harness = await start(tmp_path, tools=[tool("slow", slow)], turns=turns)
    try:
        first = await run_agent(harness, "start")
        session_id = first.session_id
        assert session_id is not None
        a = asyncio.ensure_future(run_agent(harness, "continue A", session_id=session_id))
        await asyncio.wait_for(started.wait(), 5)
        # Its own store, like a second `dsh -p --session` in another terminal.
        with pytest.raises(SessionBusyError) as caught:
            await run_agent(harness, "continue B", session_id=session_id)
        assert caught.value.code == "SESSION_BUSY"
        assert caught.value.message.startswith(
            f"session {session_id!r} is in use by another run (pid {os.getpid()} on host "
        )
        go_on.set()
        resumed = await a
        assert resumed.ok and resumed.answer == "second"

        store = open_session_store(harness)
        try:
            events = await store.load(session_id)
        finally:
            await store.close()
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert [e.payload["task"] for e in events if e.kind == "run/start"] == ["start", "continue A"]
        assert "continue B" not in str([e.payload for e in events])  # the refused run wrote nothing
        assert [e.kind for e in events].count("run/end") == 2

        third = await run_agent(harness, "and again", session_id=session_id)
        assert third.ok and third.answer == "third"
        request = scripted(harness).requests[-1]["messages"]
        assert [m["role"] for m in request] == [
            "system",
            "user",
            "assistant",
            "user",
            "assistant",
            "tool",
            "assistant",
            "user",
        ]
        assert [m["tool_call_id"] for m in history_from_events(events) if m["role"] == "tool"] == ["call_A"]
    finally:
        await harness.aclose()


async def test_a_run_holds_its_new_session_and_releases_it_at_a_normal_end(tmp_path: Path) -> None:
    seen: list[bool] = []

    async def probe(args: Any, ctx: Any) -> Any:
        store = open_session_store(harness)
        try:
            (info,) = await store.list()
        finally:
            await store.close()
        seen.append(await lease_is_free(harness, info.id))
        return "probed"

    harness = await start(tmp_path, tools=[tool("probe", probe)], turns=[calls(call("probe", {})), final("done")])
    try:
        result = await run_agent(harness, "go")
        assert result.ok and seen == [False]  # leased by the run that created it, while it runs
        assert result.session_id is not None and await lease_is_free(harness, result.session_id)
    finally:
        await harness.aclose()


async def test_the_lease_is_released_when_the_run_ends_in_an_error(tmp_path: Path) -> None:
    harness = await start(tmp_path, turns=[final("only one")])
    try:
        first = await run_agent(harness, "one")
        assert first.session_id is not None
        second = await run_agent(harness, "two", session_id=first.session_id)  # the script is exhausted
        assert second.reason is StopReason.PROVIDER_ERROR
        assert await lease_is_free(harness, first.session_id)
    finally:
        await harness.aclose()


async def test_the_lease_is_released_when_the_run_is_cancelled(tmp_path: Path) -> None:
    started = asyncio.Event()

    async def stubborn(args: Any, ctx: Any) -> Any:
        started.set()
        await asyncio.sleep(30)

    harness = await start(tmp_path, tools=[tool("stubborn", stubborn)], turns=[calls(call("stubborn", {}))])
    try:
        task = asyncio.ensure_future(run_agent(harness, "go"))
        await asyncio.wait_for(started.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        store = open_session_store(harness)
        try:
            (info,) = await store.list()
        finally:
            await store.close()
        assert await lease_is_free(harness, info.id)
    finally:
        await harness.aclose()


async def test_a_refused_run_does_not_release_the_holders_lease(tmp_path: Path) -> None:
    harness = await start(tmp_path, turns=[final("x")])
    store = open_session_store(harness)
    holder = SessionLease.for_this_run()
    try:
        info = await store.create(lease=holder)
        for _ in range(2):
            with pytest.raises(SessionBusyError):
                await run_agent(harness, "go", session_id=info.id)
        assert not await lease_is_free(harness, info.id)
        await store.release(info.id, holder)
        assert (await run_agent(harness, "go", session_id=info.id)).ok
    finally:
        await store.close()
        await harness.aclose()


async def test_a_run_whose_lease_was_taken_over_stops_writing_the_session(tmp_path: Path) -> None:
    thief = SessionLease.for_this_run()

    async def steal(args: Any, ctx: Any) -> Any:
        # `dsh sessions release` then a second run resuming the session, while this run goes on.
        store = open_session_store(harness)
        try:
            (info,) = await store.list()
            await store.break_lease(info.id)
            await store.acquire(info.id, thief)
        finally:
            await store.close()
        return "stolen"

    harness = await start(tmp_path, tools=[tool("steal", steal)], turns=[calls(call("steal", {})), final("done")])
    store = open_session_store(harness)
    try:
        with pytest.raises(SessionLeaseLostError, match="is no longer held by this run"):
            await run_agent(harness, "go")
        (info,) = await store.list()
        events = await store.load(info.id)
        assert [e.kind for e in events] == ["run/start", "message/user", "message/assistant", "tool/call"]
        assert (await store.get(info.id)).holder == thief  # the losing run's end did not free it
    finally:
        await store.close()
        await harness.aclose()


async def test_a_store_whose_append_takes_no_lease_is_named_before_the_run_writes(tmp_path: Path) -> None:
    """A store written before append took lease= failed the run's first write with a bare TypeError."""
    from dsh_core.sessions import SessionStoreError

    harness = await start(tmp_path, tools=[], turns=[final("done")])
    try:
        real = open_session_store(harness)

        class OldStore:
            """Every method but append forwarded to a real store; append has the old signature."""

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            async def append(self, session_id: str, events: Any) -> Any:
                return await real.append(session_id, events)

        old = OldStore()
        try:
            with pytest.raises(SessionStoreError, match=r"OldStore: append\(\) takes no lease= keyword"):
                await run_agent(harness, "go", store=old)  # type: ignore[arg-type]
            assert await real.list() == []  # refused before a session was created
        finally:
            await real.close()
        # Without a lease (a tool's own recorder, a test), such a store still records.
        from dsh_core.sessions.recorder import SessionRecorder

        store = open_session_store(harness)
        try:
            session = await store.create()
            real = store
            stored = await SessionRecorder(OldStore(), session.id).append("note", {"k": 1})  # type: ignore[arg-type]
            assert stored.kind == "note"
        finally:
            await store.close()
    finally:
        await harness.aclose()
