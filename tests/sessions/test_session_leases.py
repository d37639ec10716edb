"""Session leases: the store contract (one run at a time holds a session) and when a holder counts as gone."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from dsh_core.sessions import (
    NewEvent,
    SessionBusyError,
    SessionLease,
    SessionLeaseLostError,
    SessionNotFoundError,
    SessionRecorder,
    SessionStore,
    holder_alive,
)
from dsh_core.sessions.lease import boot_id, machine_id, process_start
from dsh_core.sessions.sqlite import DB_FILENAME, SqliteSessionStore

pytestmark = pytest.mark.anyio

#: Every store implementation dsh ships, as ``factory(home)``: each must honour the lease contract.
STORES: list[object] = [pytest.param(SqliteSessionStore.open, id="sqlite")]

StoreFactory = Callable[[Path], SessionStore]

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")


def exited_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("factory", STORES)
async def test_a_lease_holds_its_session_until_it_is_released(tmp_path: Path, factory: StoreFactory) -> None:
    store = factory(tmp_path)
    first, second = SessionLease.for_this_run(), SessionLease.for_this_run()
    try:
        info = await store.create(meta={"task": "t"}, lease=first)  # a new session is born held
        with pytest.raises(SessionBusyError) as caught:
            await store.acquire(info.id, second)
        busy = caught.value
        assert busy.code == "SESSION_BUSY" and busy.session_id == info.id and busy.holder == first
        assert busy.message.startswith(f"session {info.id!r} is in use by another run (pid {os.getpid()} on host ")
        await store.acquire(info.id, first)  # the holder may claim it again
        await store.release(info.id, second)  # not the holder's: nothing happens
        with pytest.raises(SessionBusyError):
            await store.acquire(info.id, second)
        await store.release(info.id, first)
        await store.release(info.id, first)  # idempotent
        await store.acquire(info.id, second)
        with pytest.raises(SessionBusyError):
            await store.acquire(info.id, first)

        unleased = await store.create()
        await store.acquire(unleased.id, first)
        with pytest.raises(SessionNotFoundError, match="no session 'nope'"):
            await store.acquire("nope", first)
        await store.release("nope", first)
        assert [e.kind for e in await store.load(info.id)] == []  # leases are not events
    finally:
        await store.close()


@pytest.mark.parametrize("factory", STORES)
async def test_of_two_stores_racing_for_a_session_exactly_one_wins(tmp_path: Path, factory: StoreFactory) -> None:
    # Two store instances on one home stand in for two dsh processes resuming one session at once.
    stores = [factory(tmp_path), factory(tmp_path)]
    try:
        info = await stores[0].create()
        for _ in range(20):
            leases = [SessionLease.for_this_run(), SessionLease.for_this_run()]
            racing = (store.acquire(info.id, lease) for store, lease in zip(stores, leases, strict=True))
            outcomes = await asyncio.gather(*racing, return_exceptions=True)
            winners = [lease for lease, outcome in zip(leases, outcomes, strict=True) if outcome is None]
            assert len(winners) == 1, outcomes
            assert [type(o) for o in outcomes if o is not None] == [SessionBusyError]
            await stores[0].release(info.id, winners[0])
    finally:
        for store in stores:
            await store.close()


HOLDER = textwrap.dedent("""
    import asyncio, sys, time
    from pathlib import Path
    from dsh_core.sessions import SessionLease
    from dsh_core.sessions.sqlite import SqliteSessionStore

    async def main():
        store = SqliteSessionStore.open(Path(sys.argv[1]))
        await store.acquire(sys.argv[2], SessionLease.for_this_run())
        print("held", flush=True)
        time.sleep(60)  # killed here, holding the lease

    asyncio.run(main())
""")


async def test_a_lease_of_a_process_killed_mid_run_does_not_block_a_resume(tmp_path: Path) -> None:
    store = SqliteSessionStore.open(tmp_path)
    try:
        info = await store.create()
        child = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(tmp_path), info.id], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout is not None and child.stdout.readline() == "held\n"
            with pytest.raises(SessionBusyError, match=f"pid {child.pid} on host"):
                await store.acquire(info.id, SessionLease.for_this_run())
            child.send_signal(signal.SIGKILL)  # no chance to release: the lease stays behind
            child.wait(10)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        await store.acquire(info.id, SessionLease.for_this_run())
    finally:
        await store.close()


def _mine(**changes: object) -> SessionLease:
    return attrs.evolve(SessionLease.for_this_run(), **changes)  # type: ignore[arg-type]


@needs_proc
@pytest.mark.parametrize("factory", STORES)
@pytest.mark.parametrize(
    ("holder", "gone"),
    [
        pytest.param(lambda: _mine(pid=exited_pid(), started=None), True, id="no-such-pid"),
        pytest.param(lambda: _mine(started=(process_start(os.getpid()) or 0) + 1), True, id="pid-reused-since"),
        pytest.param(lambda: _mine(boot_id="another-boot"), True, id="host-rebooted-since"),
        pytest.param(lambda: _mine(pid=0), True, id="no-pid"),
        pytest.param(_mine, False, id="this-process"),
        pytest.param(lambda: _mine(pid=1, started=None), False, id="a-live-pid-started-unknown"),
        pytest.param(
            lambda: _mine(pid=exited_pid(), host=socket.gethostname() + "-elsewhere"), False, id="another-host"
        ),
        pytest.param(lambda: _mine(pid=exited_pid(), pid_ns="pid:[1]"), False, id="another-pid-namespace"),
        # Two machines of one name sharing a home: the other's boot id is no reboot of this one.
        pytest.param(
            lambda: _mine(pid=exited_pid(), boot_id="its-boot", machine="another-machine"),
            False,
            id="another-machine-of-the-same-name",
        ),
        pytest.param(lambda: _mine(boot_id="another-boot", machine=None), True, id="a-lease-without-machine-id"),
    ],
)
async def test_a_lease_whose_holder_is_gone_is_taken_over(
    tmp_path: Path, factory: StoreFactory, holder: Callable[[], SessionLease], gone: bool
) -> None:
    held = holder()
    assert holder_alive(held) is not gone
    store = factory(tmp_path)
    try:
        info = await store.create(lease=held)
        if gone:
            await store.acquire(info.id, SessionLease.for_this_run())
        else:
            with pytest.raises(SessionBusyError):
                await store.acquire(info.id, SessionLease.for_this_run())
    finally:
        await store.close()


@needs_proc
def test_a_zombie_holder_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        started = process_start(child.pid)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        assert not holder_alive(_mine(pid=child.pid, started=started))  # exited, not yet reaped
    finally:
        child.wait()


def test_a_lease_survives_its_json_form() -> None:
    lease = SessionLease.for_this_run()
    assert SessionLease.from_json(lease.to_json()) == lease
    assert lease.token != SessionLease.for_this_run().token  # two runs of one process are told apart
    if Path("/proc/sys/kernel/random/boot_id").exists():
        assert lease.boot_id == boot_id() and lease.started == process_start(os.getpid())
    assert lease.machine == machine_id()
    older = lease.to_json()
    del older["machine"]  # a lease written before machine ids were kept
    assert SessionLease.from_json(older) == attrs.evolve(lease, machine=None)
    for bad in ({}, {"token": "t", "pid": "1", "host": "h"}, {"token": "t", "pid": True, "host": "h"}):
        with pytest.raises(ValueError, match=r"not a session lease|not an integer"):
            SessionLease.from_json(bad)


async def test_an_unreadable_sqlite_lease_is_taken_over(tmp_path: Path) -> None:
    store = SqliteSessionStore.open(tmp_path)
    try:
        info = await store.create()
        conn = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
        try:
            conn.execute(
                "INSERT INTO leases (session_id, token, holder, acquired_at) VALUES (?, 'x', '[1]', 0)", (info.id,)
            )
        finally:
            conn.close()
        # Summaries agree with acquire: nobody holds the session (sessions list/show said "in use by
        # pid 0 on host 'unknown'", with its calls "running", while the next run took it over at once).
        assert (await store.get(info.id)).holder is None
        assert [summary.holder for summary in await store.list()] == [None]
        await store.acquire(info.id, SessionLease.for_this_run())
    finally:
        await store.close()


async def test_an_unreadable_sqlite_lease_is_named_unreadable_not_given_a_pid_and_host(tmp_path: Path) -> None:
    """Breaking (dsh sessions release) or losing to a lease whose record cannot be read named it "pid 0 on host
    'unknown'": a process and a host nobody has. Its messages say the record is unreadable instead."""
    store = SqliteSessionStore.open(tmp_path)
    try:
        info = await store.create()
        mine = SessionLease.for_this_run()
        await store.acquire(info.id, mine)
        conn = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
        try:
            conn.execute("UPDATE leases SET token = 'x', holder = '[1]' WHERE session_id = ?", (info.id,))
        finally:
            conn.close()
        with pytest.raises(SessionLeaseLostError) as lost:
            await store.append(info.id, [NewEvent("late")], lease=mine)
        assert lost.value.holder is not None and not lost.value.holder.readable
        assert "pid 0" not in lost.value.message and "'unknown'" not in lost.value.message, lost.value.message
        assert "another run holds it, whose lease record is unreadable" in lost.value.message
        broken = await store.break_lease(info.id)
        assert broken is not None and not broken.readable
        assert broken.describe() == "an unreadable lease record (which run it was is unknown)"
        assert mine.readable and mine.describe().startswith(f"pid {os.getpid()} on host ")
    finally:
        await store.close()


#: Lease records no run writes (tampered, or corrupt), that from_json used to take for leases.
CORRUPT_HOLDERS = [
    pytest.param({"pid": 2**40, "host": socket.gethostname()}, id="pid-past-pid_t"),  # os.kill overflowed
    pytest.param({"pid": -5}, id="negative-pid"),
    pytest.param({"since": 1e300}, id="since-past-time_t"),  # describe() overflowed
    pytest.param({"since": -1e300}, id="since-before-time_t"),
    pytest.param({"since": float("nan")}, id="since-nan"),
    pytest.param({"since": 10**400}, id="since-past-a-float"),
]


@pytest.mark.parametrize("corrupt", CORRUPT_HOLDERS)
async def test_a_corrupt_sqlite_lease_reads_as_an_unreadable_one(tmp_path: Path, corrupt: dict[str, object]) -> None:
    # Not an OverflowError out of get/list (sessions list/show) or acquire (a resumed run): such a
    # lease is unreadable, and is treated as one (nobody holds the session; acquire takes it over).
    store = SqliteSessionStore.open(tmp_path)
    try:
        info = await store.create()
        holder = {"token": "x", "pid": 1234, "host": "elsewhere", "since": 1.0, **corrupt}
        conn = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
        try:
            conn.execute(
                "INSERT INTO leases (session_id, token, holder, acquired_at) VALUES (?, 'x', ?, 0)",
                (info.id, json.dumps(holder)),
            )
        finally:
            conn.close()
        with pytest.raises(ValueError, match="not a session lease"):
            SessionLease.from_json(json.loads(json.dumps(holder)))
        assert (await store.get(info.id)).holder is None
        assert [summary.holder for summary in await store.list()] == [None]
        lease = SessionLease.for_this_run()
        await store.acquire(info.id, lease)
        await store.append(info.id, [NewEvent("resumed")], lease=lease)
    finally:
        await store.close()


async def test_a_database_from_before_leases_gets_the_table(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / DB_FILENAME, isolation_level=None)
    try:
        conn.executescript("""
            CREATE TABLE sessions (id TEXT PRIMARY KEY, created_at REAL NOT NULL, updated_at REAL NOT NULL,
                                   event_count INTEGER NOT NULL DEFAULT 0, meta TEXT NOT NULL DEFAULT '{}');
            INSERT INTO sessions (id, created_at, updated_at) VALUES ('old', 0, 0);
        """)
    finally:
        conn.close()
    store = SqliteSessionStore.open(tmp_path)
    try:
        await store.acquire("old", SessionLease.for_this_run())
        with pytest.raises(SessionBusyError):
            await store.acquire("old", SessionLease.for_this_run())
    finally:
        await store.close()


@pytest.mark.parametrize("factory", STORES)
async def test_a_lease_dsh_cannot_check_is_broken_on_request(tmp_path: Path, factory: StoreFactory) -> None:
    """A run on another host (or container) that died keeps its lease until a person breaks it."""
    store = factory(tmp_path)
    try:
        info = await store.create()
        elsewhere = attrs.evolve(SessionLease.for_this_run(), host="another-host")
        await store.acquire(info.id, elsewhere)
        assert holder_alive(elsewhere)  # unknowable: it may be running
        with pytest.raises(SessionBusyError, match=f"free the session with: dsh sessions release {info.id}"):
            await store.acquire(info.id, SessionLease.for_this_run())
        assert await store.break_lease(info.id) == elsewhere
        assert await store.break_lease(info.id) is None  # nothing holds it any more
        await store.acquire(info.id, SessionLease.for_this_run())
        with pytest.raises(SessionNotFoundError):
            await store.break_lease("no-such-session")
    finally:
        await store.close()


@pytest.mark.parametrize("factory", STORES)
async def test_a_sessions_summary_names_the_lease_holding_it(tmp_path: Path, factory: StoreFactory) -> None:
    store = factory(tmp_path)
    holder = SessionLease.for_this_run()
    try:
        created = await store.create(lease=holder)
        free = await store.create()
        assert created.holder == holder and free.holder is None
        assert (await store.get(created.id)).holder == holder
        assert {info.id: info.holder for info in await store.list()} == {created.id: holder, free.id: None}
        await store.release(created.id, holder)
        assert (await store.get(created.id)).holder is None
    finally:
        await store.close()


@pytest.mark.parametrize("factory", STORES)
async def test_a_run_that_lost_its_lease_appends_nothing(tmp_path: Path, factory: StoreFactory) -> None:
    """Released (`dsh sessions release`) or taken over, a lease no longer lets its run write the session."""
    store = factory(tmp_path)
    first, second = SessionLease.for_this_run(), SessionLease.for_this_run()
    try:
        info = await store.create(lease=first)
        recorder = SessionRecorder(store, info.id, lease=first)
        await recorder.append("mine")
        await store.break_lease(info.id)
        with pytest.raises(SessionLeaseLostError, match=f"session {info.id!r} is no longer held by this run") as lost:
            await recorder.append("after release")
        assert lost.value.code == "SESSION_LEASE_LOST" and lost.value.holder is None
        await store.acquire(info.id, second)
        with pytest.raises(SessionLeaseLostError, match=f"pid {os.getpid()} on host") as lost:
            await recorder.append_many([NewEvent("after takeover"), NewEvent("batch")])
        assert lost.value.holder == second
        await store.append(info.id, [NewEvent("theirs")], lease=second)
        assert [e.kind for e in await store.load(info.id)] == ["mine", "theirs"]
        with pytest.raises(SessionNotFoundError):
            await store.append("nope", [NewEvent("x")], lease=first)
    finally:
        await store.close()
