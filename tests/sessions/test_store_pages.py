"""Reading a session a page at a time: the store contract of ``load_page`` and ``iter_events``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from dsh_core.sessions import NewEvent, SessionEvent, SessionNotFoundError, SessionStore, SessionStoreError
from dsh_core.sessions.sqlite import PAGE_CHARS, SqliteSessionStore
from dsh_core.sessions.store import iter_events

pytestmark = pytest.mark.anyio

#: Every store implementation dsh ships, as ``factory(home)``: each must honour the paging contract.
STORES: list[object] = [pytest.param(SqliteSessionStore.open, id="sqlite")]

StoreFactory = Callable[[Path], SessionStore]


async def _filled(store: SessionStore, count: int) -> list[SessionEvent]:
    await store.create(session_id="s")
    # Two call trees interleaved, in several batches.
    for start in range(0, count, 7):
        await store.append(
            "s",
            [NewEvent("tool/call", {"n": n}, root_call_id=f"r{n % 2}") for n in range(start, min(start + 7, count))],
        )
    return await store.load("s")


@pytest.mark.parametrize("factory", STORES)
async def test_pages_after_each_other_are_the_whole_session_in_order(tmp_path: Path, factory: StoreFactory) -> None:
    store = factory(tmp_path)
    try:
        everything = await _filled(store, 23)
        for limit in (1, 5, 23, 100):
            read: list[SessionEvent] = []
            while page := await store.load_page("s", after=read[-1].seq if read else 0, limit=limit):
                assert 1 <= len(page) <= limit
                read.extend(page)
            assert read == everything
        assert await store.load_page("s", after=23) == []
        assert await store.load_page("s", after=10**30) == []  # past anything SQLite's INTEGER holds
        assert await store.load_page("s", after=-(10**30), limit=2) == everything[:2]
        assert await store.load_page("s", after=20, limit=2**63) == everything[20:]
        one_tree = await store.load("s", root_call_id="r1")
        assert [e async for e in iter_events(store, "s", root_call_id="r1", page=3)] == one_tree
        assert await store.load_page("s", after=one_tree[2].seq, limit=2, root_call_id="r1") == one_tree[3:5]
        assert [e async for e in iter_events(store, "s", page=4)] == everything
        with pytest.raises(SessionNotFoundError, match="'nope'"):
            await store.load_page("nope")
        await store.create(session_id="empty")
        assert await store.load_page("empty") == []
        assert [e async for e in iter_events(store, "empty")] == []
    finally:
        await store.close()


async def test_a_sqlite_page_of_large_events_stops_at_its_size(tmp_path: Path) -> None:
    store = SqliteSessionStore.open(tmp_path)
    try:
        await store.create(session_id="s")
        big = "x" * (PAGE_CHARS // 4)
        await store.append("s", [NewEvent("tool/result", {"content": big}) for _ in range(10)])
        first = await store.load_page("s", limit=1000)
        assert 1 <= len(first) <= 4
        await store.append("s", [NewEvent("tool/result", {"content": "y" * (2 * PAGE_CHARS)})])
        assert [e.seq for e in await store.load_page("s", after=10)] == [11]  # one larger than a page still comes
        assert [e.seq for e in [e async for e in iter_events(store, "s")]] == list(range(1, 12))
    finally:
        await store.close()


class _Counting:
    """A store of ``count`` events that logs which pages were read and which events handed out."""

    def __init__(self, count: int) -> None:
        self.events = [SessionEvent("s", n, "k", {}, 0.0) for n in range(1, count + 1)]
        self.log: list[str] = []

    async def load_page(
        self, session_id: str, *, after: int = 0, limit: int = 1000, root_call_id: str | None = None
    ) -> list[SessionEvent]:
        self.log.append(f"page after {after}")
        return self.events[after : after + limit]

    async def load(self, session_id: str, *, root_call_id: str | None = None) -> list[SessionEvent]:
        self.log.append("load")
        return list(self.events)


async def test_iter_events_reads_the_next_page_only_once_the_last_one_is_used() -> None:
    store = _Counting(7)
    seen: list[int] = []
    async for event in iter_events(store, "s", page=3):  # type: ignore[arg-type]
        store.log.append(f"event {event.seq}")
        seen.append(event.seq)
    assert seen == [1, 2, 3, 4, 5, 6, 7]
    assert store.log == [
        "page after 0",
        "event 1",
        "event 2",
        "event 3",
        "page after 3",
        "event 4",
        "event 5",
        "event 6",
        "page after 6",
        "event 7",
        "page after 7",
    ]


async def test_iter_events_reads_a_store_without_pages_whole() -> None:
    class Older(_Counting):
        load_page = None  # type: ignore[assignment]

    store = Older(5)
    assert [e.seq async for e in iter_events(store, "s", page=2)] == [1, 2, 3, 4, 5]  # type: ignore[arg-type]
    assert store.log == ["load"]


@pytest.mark.parametrize(
    "page",
    [
        lambda events, after, limit: events[:limit],  # the first page, whatever after says: read for ever
        lambda events, after, limit: events[after : after + limit + 1],  # more than limit
        lambda events, after, limit: list(reversed(events[after : after + limit])),  # not in seq order
    ],
)
async def test_a_store_whose_pages_do_not_move_on_is_named(
    page: Callable[[Sequence[SessionEvent], int, int], list[SessionEvent]],
) -> None:
    class Stuck(_Counting):
        async def load_page(
            self, session_id: str, *, after: int = 0, limit: int = 1000, root_call_id: str | None = None
        ) -> list[SessionEvent]:
            return page(self.events, after, limit)

    with pytest.raises(SessionStoreError, match=r"test_store_pages\..*Stuck: load_page\('s', after="):
        _: list[Any] = [e async for e in iter_events(Stuck(9), "s", page=3)]  # type: ignore[arg-type]


async def test_iter_events_with_a_limit_gives_the_first_events_and_asks_no_page_past_them() -> None:
    # `show` reads the events a session had when its count was read: not one more, nor a page more.
    store = _Counting(9)
    assert [e.seq async for e in iter_events(store, "s", page=3, limit=5)] == [1, 2, 3, 4, 5]  # type: ignore[arg-type]
    assert store.log == ["page after 0", "page after 3"]
    assert [e.seq async for e in iter_events(store, "s", limit=0)] == []  # type: ignore[arg-type]
    assert [e.seq async for e in iter_events(store, "s", page=4, limit=20)] == list(range(1, 10))  # type: ignore[arg-type]

    class Older(_Counting):
        load_page = None  # type: ignore[assignment]

    assert [e.seq async for e in iter_events(Older(5), "s", limit=2)] == [1, 2]  # type: ignore[arg-type]
