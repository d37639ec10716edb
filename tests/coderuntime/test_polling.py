"""A worker waiting for a binding's reply polls for it only while the host has a CPU to spare.

Polling keeps the worker's CPU from going idle, so the host's reply needs no cross-CPU
wake-up (the dearest part of a round trip on a virtual machine; see ``_POLL_S``). It is
the program's own CPU time, so it is bounded: the host says in the start frame and in
every reply whether a CPU is spare (fewer live runs than usable CPUs), and a worker whose
replies come later than the poll stops polling for a growing number of calls.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from dsh_core.coderuntime import host
from dsh_core.coderuntime import isolation as iso
from dsh_core.coderuntime.worker import runner, wire

from .conftest import arun, echo, tools, with_runtime, zygote_processes

#: The program reads its bridge's hint (through a binding's closure) before and after a call.
READ_HINT = """
f = tools.echo
bridge = next(c.cell_contents for c in f.__closure__ if type(c.cell_contents).__name__ == "_Bridge")
before = bridge.poll
await f({})
return [before, bridge.poll]
"""


@pytest.mark.parametrize(("cpus", "expected"), [(2, [True, True]), (1, [False, False])])
def test_a_lone_run_polls_only_where_the_host_has_another_cpu(
    monkeypatch: pytest.MonkeyPatch, cpus: int, expected: list[bool]
) -> None:
    monkeypatch.setattr(host, "_USABLE_CPUS", cpus)

    async def go(rt: Any) -> Any:
        return await rt.run(READ_HINT, tools(echo=echo))

    result = arun(with_runtime(go, isolation="L0", timeout_s=20.0))
    assert result.error is None and result.value == expected, result


async def _read_hint_beside_a_live_run(holder: Any, reader: Callable[[], Awaitable[Any]]) -> Any:
    """What ``reader`` returns while a run of ``holder`` is live (waiting in a binding call)."""
    holding, release = asyncio.Event(), asyncio.Event()

    async def hold(args: Any) -> Any:
        holding.set()
        await release.wait()
        return 1

    first = asyncio.ensure_future(holder.run("return await tools.hold({})", tools(hold=hold)))
    await holding.wait()
    try:
        return await reader()
    finally:
        release.set()
        assert (await first).value == 1


def test_runs_live_beside_as_many_as_the_cpus_do_not_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "_USABLE_CPUS", 2)

    async def go(rt: Any) -> Any:
        return await _read_hint_beside_a_live_run(rt, lambda: rt.run(READ_HINT, tools(echo=echo)))

    second = arun(with_runtime(go, isolation="L0", timeout_s=20.0))
    assert second.error is None and second.value == [False, False], second


def test_runs_of_another_runtime_in_the_process_count_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runtimes in one process share its CPUs: one's live run stops the other's from polling."""
    monkeypatch.setattr(host, "_USABLE_CPUS", 2)

    async def read(rt: Any) -> Any:
        return await rt.run(READ_HINT, tools(echo=echo))

    async def go(other: Any) -> Any:
        return await _read_hint_beside_a_live_run(other, lambda: with_runtime(read, isolation="L0", timeout_s=20.0))

    second = arun(with_runtime(go, isolation="L0", timeout_s=20.0))
    assert second.error is None and second.value == [False, False], second


class _Clock:
    """A poll clock that advances 1 ms per reading and can send a late reply on the wait's second one.

    The second reading is the one after a poll found nothing: the deadline (200 us) has passed,
    so the wait is a miss whatever the machine's speed, and the reply is there when it sleeps.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0
        self.late: Any = None

    def __call__(self) -> float:
        self.now += 0.001
        self.reads += 1
        if self.late is not None and self.reads == 2:
            send, self.late = self.late, None
            send()
        return self.now


class _Host:
    """The host's end of a bridge's channel, answering call ids with replies."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.worker_end, self.host_end = socket.socketpair()
        self.loop = asyncio.new_event_loop()
        self.bridge = runner._Bridge(runner._Channel(self.worker_end.fileno(), 1 << 20), self.loop)
        self.bridge.poll, self.bridge.poll_left = True, 60.0
        self.clock = _Clock()
        monkeypatch.setattr(runner, "_clock", self.clock)

    def close(self) -> None:
        self.loop.close()
        self.worker_end.close()
        self.host_end.close()

    def wait(self, call_id: int, *, late: bool = False, poll: bool = True, split: bool = False) -> None:
        """Wait for ``call_id``'s reply: there before the wait, or ``late`` (after a poll found nothing).

        With ``split``, half the reply is there before the wait and the rest comes late.
        """
        frame = wire.pack({"t": "reply", "id": call_id, "ok": True, "v": wire.encode(call_id), "poll": poll})
        future = self.loop.create_future()
        self.bridge.pending[call_id] = (future, "f", None)
        self.clock.reads = 0
        if split:
            self.host_end.sendall(frame[:5])
            frame = frame[5:]
        if late or split:
            self.clock.late = lambda: self.host_end.sendall(frame)
        else:
            self.host_end.sendall(frame)
        assert self.bridge.wait_in_place(future) and future.result() == call_id
        assert self.clock.late is None  # a late reply was sent: the wait did poll


def test_a_worker_whose_replies_come_after_the_poll_stops_polling_for_longer_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    channel = _Host(monkeypatch)
    bridge = channel.bridge
    try:
        channel.wait(1)  # the reply is there before the wait: a hit
        assert (bridge.poll_misses, bridge.polls_to_skip) == (0, 0)
        call_id = 1
        for misses in (1, 2, 4, 8, 16, 32, 64, 64):
            call_id += 1
            channel.wait(call_id, late=True)  # polled in vain, then slept
            assert (bridge.poll_misses, bridge.polls_to_skip) == (misses, misses)
            for _ in range(misses):  # these sleep at once: a reply there before them is no hit
                call_id += 1
                channel.wait(call_id)
                assert bridge.poll_misses == misses
            assert bridge.polls_to_skip == 0
        call_id += 1
        channel.wait(call_id)  # a reply within the poll again: polling resumes at once
        assert (bridge.poll_misses, bridge.polls_to_skip) == (0, 0)
    finally:
        channel.close()


def test_half_a_reply_within_the_poll_is_not_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    channel = _Host(monkeypatch)
    try:
        channel.wait(1, late=True)
        channel.wait(2)  # skipped
        channel.wait(3, split=True)  # a second miss: it was reading a partial frame, not the reply
        assert (channel.bridge.poll_misses, channel.bridge.polls_to_skip) == (2, 2)
    finally:
        channel.close()


def test_polling_stops_for_the_run_once_its_share_of_the_cpu_budget_is_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    channel = _Host(monkeypatch)
    bridge = channel.bridge
    try:
        bridge.poll_left = 0.0015  # the fake clock charges each miss 1 ms
        channel.wait(1, late=True)
        assert bridge.poll_left == pytest.approx(0.0005)
        channel.wait(2)  # skipped after the miss
        channel.wait(3, late=True)  # polls once more, and spends the rest
        assert bridge.poll_left < 0 and bridge.poll_misses == 2
        for call_id in range(4, 100):  # past every skip: none polls again (a poll would make these hits)
            channel.wait(call_id)
        assert bridge.poll_misses == 2 and channel.clock.now == pytest.approx(0.004)
    finally:
        channel.close()


def test_a_worker_told_the_host_has_no_cpu_to_spare_does_not_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    channel = _Host(monkeypatch)
    bridge = channel.bridge
    try:
        channel.wait(1, poll=False)  # this reply says: no CPU to spare from now on
        assert bridge.poll is False
        channel.wait(2, poll=True)  # slept at once (no clock read: no poll), and may poll again
        assert bridge.poll is True and channel.clock.now == pytest.approx(0.002)
        assert (bridge.poll_misses, bridge.polls_to_skip) == (0, 0)
    finally:
        channel.close()


def _tree(root: Any, files: dict[str, str]) -> None:
    for path, text in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


@pytest.mark.parametrize(
    ("cgroup", "files", "expected"),
    [
        # cgroup v2: the tightest cpu.max on the way up (here the parent's 1.5 CPUs) counts, rounded down.
        ("0::/a/b\n", {"a/b/cpu.max": "max 100000\n", "a/cpu.max": "150000 100000\n"}, 1),
        ("0::/a/b\n", {"a/b/cpu.max": "300000 100000\n"}, 3),
        # cgroup v1: the cpu controller's CFS quota and period (-1: no quota).
        (
            "4:cpu,cpuacct:/x\n",
            {"cpu,cpuacct/x/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"},
            2,
        ),
        (
            "4:cpu,cpuacct:/x\n",
            {"cpu,cpuacct/x/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"},
            8,
        ),
        # No quota anywhere, or no cgroup file system: the affinity mask alone.
        ("0::/a\n", {"a/cpu.max": "max 100000\n"}, 8),
        ("0::/a\n", {}, 8),
        # A quota below one CPU still leaves one.
        ("0::/\n", {"cpu.max": "50000 100000\n"}, 1),
    ],
)
def test_the_usable_cpus_are_bounded_by_a_cgroup_cpu_quota(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, cgroup: str, files: dict[str, str], expected: int
) -> None:
    # A container limited to a CPU quota (docker run --cpus) still sees every CPU in its
    # affinity mask: polling there, beside the host, would spend the quota the host needs.
    monkeypatch.setattr(iso.os, "sched_getaffinity", lambda pid: set(range(8)))
    (tmp_path / "cgroup").write_text(cgroup)
    _tree(tmp_path / "fs", files)
    assert iso.usable_cpus(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == expected


@pytest.mark.parametrize("missing", ["refused", "absent"])
def test_the_usable_cpus_are_known_without_an_affinity_mask(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, missing: str
) -> None:
    # Computed when the module is imported: a sandbox refusing sched_getaffinity (EPERM from
    # a seccomp profile), or a platform without it, must not make importing the runtime fail.
    def refused(pid: int) -> set[int]:
        raise PermissionError(1, "Operation not permitted")

    if missing == "refused":
        monkeypatch.setattr(iso.os, "sched_getaffinity", refused)
    else:
        monkeypatch.delattr(iso.os, "sched_getaffinity")
    monkeypatch.setattr(iso.os, "cpu_count", lambda: 6)
    assert iso.usable_cpus(str(tmp_path / "none"), str(tmp_path)) == 6


def test_a_program_freezing_the_clock_does_not_make_its_waits_poll_to_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    # A program may fake time.perf_counter (to test timing code, say): the
    # poll's deadline must not depend on it, or the worker would poll through the whole of a
    # slow binding call (its CPU budget spent on nothing) instead of sleeping.
    monkeypatch.setattr(host, "_USABLE_CPUS", 2)
    program = READ_HINT.replace(
        "before = bridge.poll\nawait f({})\nreturn [before, bridge.poll]\n",
        (
            "import time\nreal, time.perf_counter = time.perf_counter, lambda: 0.0\n"
            "try:\n    value = await tools.slow({})\nfinally:\n    time.perf_counter = real\n"
            "return [value, bridge.poll_misses]\n"
        ),
    )

    async def slow(args: Any) -> Any:
        await asyncio.sleep(0.05)  # far beyond the poll
        return "slow"

    async def go(rt: Any) -> Any:
        return await rt.run(program, tools(echo=echo, slow=slow))

    result = arun(with_runtime(go, isolation="L0", timeout_s=20.0))
    assert result.error is None and result.value == ["slow", 1], result


def test_a_run_may_poll_for_a_tenth_of_its_cpu_budget() -> None:
    program = (
        "f = tools.echo\n"
        "bridge = next(c.cell_contents for c in f.__closure__ if type(c.cell_contents).__name__ == '_Bridge')\n"
        "return bridge.poll_left"
    )

    async def go(rt: Any) -> Any:
        return await rt.run(program, tools(echo=echo))

    result = arun(with_runtime(go, isolation="L0", timeout_s=20.0, cpu_s=5.0))
    assert result.error is None and result.value == 0.5, result


def test_a_run_whose_loop_was_dropped_mid_run_does_not_stay_live_forever() -> None:
    """A run left pending on a loop closed under it is not counted as live once it is collected.

    Otherwise the process-wide count of live runs would keep it for good, and every later
    run in the process would be told not to poll.
    """
    import gc
    import warnings

    loop = asyncio.new_event_loop()
    held = asyncio.Event()

    async def hold(args: Any) -> Any:
        held.set()
        await asyncio.Event().wait()

    runtime = host.PythonCodeRuntime(host.CodeRuntimeConfig(isolation="L0", timeout_s=20.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()  # a run an earlier test dropped is collected now, not below, where it would be miscounted
    before, zygotes = len(host._LIVE_RUNS), zygote_processes()
    task = loop.create_task(runtime.run("return await tools.hold({})", tools(hold=hold)))
    loop.run_until_complete(held.wait())
    assert len(host._LIVE_RUNS) == before + 1
    assert runtime._zygote is not None and runtime._zygote.proc is not None
    zygote = runtime._zygote.proc.pid
    loop.close()  # without finishing the run (or disposing the runtime): both are dropped
    del task, runtime, loop
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # the dropped run's sockets, closed as collected
        gc.collect()
    assert len(host._LIVE_RUNS) == before
    # The runtime was collected: its finalizer ended and reaped its zygote...
    assert zygote not in zygote_processes()
    # ...and the held run's worker dies with it (PDEATHSIG): signalled as the zygote exited,
    # it may still be tearing down a moment later.
    deadline = time.monotonic() + 10.0
    while not zygote_processes() <= zygotes:
        assert time.monotonic() < deadline, zygote_processes() - zygotes
        time.sleep(0.01)
