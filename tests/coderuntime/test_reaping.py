"""Who reaps a worker, and how the host learns how it ended.

At L2 and above the kernel reaps workers (the zygote ignores SIGCHLD) where it
reports their status through a pidfd; below L2, or where it does not, the
zygote reaps and reports. Both paths are pinned here, at the levels that use
them and, with kernel reaping turned off, at the levels that would not.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from dsh_core.coderuntime import CodeRuntimeConfig, PythonCodeRuntime
from dsh_core.coderuntime import isolation as iso
from dsh_core.coderuntime.host import _Run, _Zygote
from dsh_core.coderuntime.worker import descriptors

from .conftest import arun, collect_leftovers, tools, zygote_processes


def _kernel_reports_exit_status() -> bool:
    child = subprocess.Popen([sys.executable, "-I", "-S", "-c", "raise SystemExit(5)"])
    handle = os.pidfd_open(child.pid)
    try:
        child.wait()
        return descriptors.exit_status(handle) == 5 << 8
    finally:
        os.close(handle)


KERNEL_REPORTS = _kernel_reports_exit_status()


def _descendants(root: int) -> dict[int, str]:
    """pid -> state letter of every live or zombie descendant of ``root``."""
    found: dict[int, str] = {}
    pending = [root]
    while pending:
        pid = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as handle:
                    children = [int(c) for c in handle.read().split()]
            except OSError:
                continue
            for child in children:
                try:
                    with open(f"/proc/{child}/stat") as handle:
                        found[child] = handle.read().rsplit(")", 1)[1].split()[0]
                except OSError:
                    continue
                pending.append(child)
    return found


def _new_descendants(earlier: dict[int, str]) -> dict[int, str]:
    """Descendants of this process that were not already there (``earlier``: another test's leftovers)."""
    return {pid: state for pid, state in _descendants(os.getpid()).items() if pid not in earlier}


def _runtime(level: str, kernel_reap: bool, **config: Any) -> PythonCodeRuntime:
    runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation=level, **config))
    runtime._let_kernel_reap = kernel_reap
    return runtime


_NO_KERNEL_REAPING = pytest.mark.skipif(
    not KERNEL_REPORTS, reason="this kernel does not report a reaped process's status through its pidfd (< 6.15)"
)
MODES = [
    pytest.param("L1", True, False, id="L1-zygote-reaps"),
    pytest.param("L2", True, True, id="L2-kernel-reaps", marks=_NO_KERNEL_REAPING),
    pytest.param("L2", False, False, id="L2-zygote-reaps"),
    pytest.param("auto", True, True, id="strongest-kernel-reaps", marks=_NO_KERNEL_REAPING),
    pytest.param("auto", False, False, id="strongest-zygote-reaps"),
]


@pytest.fixture
def worker_pids(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The host-side pid of every worker sent a program from now on."""
    seen: list[int] = []
    begin = _Run._begin

    def recording(run: _Run) -> None:
        seen.append(run.pid)
        begin(run)

    monkeypatch.setattr(_Run, "_begin", recording)
    return seen


@pytest.mark.parametrize(("level", "allow", "kernel_reaps"), MODES)
def test_every_ending_is_reported_and_its_worker_is_gone_when_run_returns(
    level: str, allow: bool, kernel_reaps: bool, worker_pids: list[int]
) -> None:
    async def echo(args: Any) -> Any:
        return args

    endings = [
        ("return 1", None),
        ("import os\nos._exit(3)", ("worker-exit", "worker exited with code 3 before completing")),
        ("import os\nos.kill(os.getpid(), 15)", ("worker-exit", "worker killed by signal SIGTERM")),
        ("1/0", ("exception", "Traceback")),
        ("while True: pass", ("timeout", "CPU budget exhausted")),
    ]

    collect_leftovers()
    fds_before = set(os.listdir("/proc/self/fd"))
    zygotes_before = zygote_processes()
    earlier = _descendants(os.getpid())  # what other tests left running (or unreaped) is not this test's

    async def go() -> None:
        runtime = _runtime(level, allow, cpu_s=0.5)
        try:
            for program, expected in endings:
                worker_pids.clear()
                result = await runtime.run(program, tools(echo=echo))
                # Reaped before run() returned: the worker's pid no longer names a process.
                ran = [pid for pid in worker_pids if pid > 0]
                assert ran and not [pid for pid in ran if os.path.exists(f"/proc/{pid}")], program
                assert runtime._zygote is not None and runtime._zygote.kernel_reaps is kernel_reaps
                if expected is None:
                    assert result.error is None and result.value == 1
                else:
                    assert result.error is not None, program
                    assert (result.error.kind, result.error.message[: len(expected[1])]) == expected, program
                # Nothing under this process is a zombie either.
                zombies = [pid for pid, state in _new_descendants(earlier).items() if state == "Z"]
                assert zombies == [], program
        finally:
            await runtime.aclose()
        assert _new_descendants(earlier) == {}

    arun(go())
    assert set(os.listdir("/proc/self/fd")) <= fds_before
    assert zygote_processes() <= zygotes_before  # no spare or worker left behind, orphaned or not


@pytest.mark.parametrize(("level", "allow", "kernel_reaps"), [m for m in MODES if m.id != "L1-zygote-reaps"])
def test_a_zygote_that_dies_ends_its_live_runs(level: str, allow: bool, kernel_reaps: bool) -> None:
    # Its workers die with it (PDEATHSIG); each live run settles as worker-exit,
    # and the next run starts a new zygote.
    collect_leftovers()
    fds_before = set(os.listdir("/proc/self/fd"))
    zygotes_before = zygote_processes()
    earlier = _descendants(os.getpid())  # what other tests left running (or unreaped) is not this test's

    async def go() -> None:
        runtime = _runtime(level, allow)
        try:
            assert (await runtime.run("return 1", [])).value == 1
            zygote = runtime._zygote
            assert zygote is not None and zygote.kernel_reaps is kernel_reaps
            live = asyncio.ensure_future(runtime.run("import time\ntime.sleep(30)", []))
            await asyncio.sleep(0.3)
            assert not live.done()
            inner = [pid for pid in _new_descendants(earlier) if _is_zygote(pid)]
            assert len(inner) == 1
            os.kill(inner[0], signal.SIGKILL)
            result = await asyncio.wait_for(live, 10)
            assert result.error is not None and result.error.kind == "worker-exit", result
            assert (await runtime.run("return 2", [])).value == 2
        finally:
            await runtime.aclose()
        assert _new_descendants(earlier) == {}

    arun(go())
    assert set(os.listdir("/proc/self/fd")) <= fds_before
    assert zygote_processes() <= zygotes_before


def _is_zygote(pid: int) -> bool:
    # The zygote runs zygote.py under python; so do its forked workers, whose parent
    # is the zygote (at L3 the zygote's parent is bubblewrap, whose arguments name it too).
    def runs_zygote(p: int) -> bool:
        try:
            with open(f"/proc/{p}/comm") as handle:
                comm = handle.read().strip()
            with open(f"/proc/{p}/cmdline", "rb") as handle:
                return comm.startswith("python") and b"zygote.py" in handle.read()
        except OSError:
            return False

    try:
        with open(f"/proc/{pid}/stat") as handle:
            parent = int(handle.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return False
    return runs_zygote(pid) and not runs_zygote(parent)


def test_a_worker_whose_pid_differs_from_its_pidfd_is_refused() -> None:
    # The pid the kernel attests on the worker's first message must be the one
    # behind the zygote's pidfd; anything else is refused before the program is sent.
    async def go() -> Any:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L0"))
        run = _Run(runtime)
        run.pid, run.cred_pid = os.getpid(), os.getpid() + 1
        run._verify("L0")
        return run.outcome

    assert arun(go()) == ("error", ("worker-exit", "the worker's pid could not be verified"))


def test_the_exit_status_is_read_again_until_the_kernel_has_recorded_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # A pidfd polls readable as its process exits; the status is recorded as the
    # kernel reaps it, a moment later. The host looks again instead of giving up.
    answers = [None, None, 3 << 8]
    monkeypatch.setattr(descriptors, "exit_status", lambda fd: answers.pop(0))

    async def go() -> Any:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L0"))
        run = _Run(runtime)
        run.kernel_reaps = True
        run.pidfd = os.pidfd_open(os.getpid())
        try:
            run.exit_future = asyncio.get_running_loop().create_future()
            run._on_pidfd()
            return await asyncio.wait_for(run.exit_future, 5), answers
        finally:
            os.close(run.pidfd)

    assert arun(go()) == (3 << 8, [])


def test_exit_status_of_a_live_process_is_none() -> None:
    handle = os.pidfd_open(os.getpid())
    try:
        assert descriptors.exit_status(handle) is None
        assert descriptors.pid_of(handle) == os.getpid()
    finally:
        os.close(handle)


def _sleeper() -> tuple[subprocess.Popen[bytes], int]:
    child = subprocess.Popen([sys.executable, "-I", "-S", "-c", "import time; time.sleep(60)"])
    return child, os.pidfd_open(child.pid)


def test_a_pidfd_that_arrives_after_its_run_gave_up_kills_its_worker() -> None:
    # No run waits for it any more: nothing else would ever kill that worker.
    async def go() -> int:
        zygote = _Zygote(None, asyncio.get_running_loop())  # type: ignore[arg-type]
        child, handle = _sleeper()
        fds = [handle]
        zygote._on_spawned_message("r-gone", fds)
        assert fds == [handle]  # still the caller's to close
        os.close(handle)
        return await asyncio.to_thread(child.wait, 10)

    assert arun(go()) == -signal.SIGKILL


def test_a_spawned_message_without_its_pidfd_ends_the_run() -> None:
    # The descriptor was lost on the way (e.g. the host ran out of descriptors): the run cannot
    # name its worker, so it never sends it a program; it ends, and does not wait for a report
    # that, where the kernel reaps, would never come.
    async def go() -> Any:
        loop = asyncio.get_running_loop()
        zygote = _Zygote(None, loop)  # type: ignore[arg-type]
        zygote.kernel_reaps = True
        run = _Run(PythonCodeRuntime(CodeRuntimeConfig(isolation="L0")))
        run.kernel_reaps = True
        run.exit_future = loop.create_future()
        zygote.exits["r1"], zygote.spawned["r1"] = run.exit_future, run._on_spawned
        zygote._on_spawned_message("r1", [])
        return run.outcome, run.exit_future.done(), run.pidfd

    outcome, exit_known, pidfd = arun(go())
    assert outcome == ("error", ("worker-exit", "the worker's pidfd did not reach the host"))
    assert exit_known and pidfd == -1


def test_a_second_pidfd_for_the_same_run_is_closed() -> None:
    async def go() -> None:
        run = _Run(PythonCodeRuntime(CodeRuntimeConfig(isolation="L0")))
        run.sock = object()  # type: ignore[assignment]  # an open run
        child, first = _sleeper()
        try:
            run._on_spawned(first)
            fds_before = set(os.listdir("/proc/self/fd"))
            run._on_spawned(os.dup(first))
            assert set(os.listdir("/proc/self/fd")) == fds_before
            assert run.pidfd == first
        finally:
            child.kill()
            child.wait()
            os.close(first)

    arun(go())


def test_descriptors_from_the_zygote_are_not_inherited_by_programs_the_host_starts() -> None:
    import array
    import json
    import socket

    async def go() -> bool:
        host_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        host_end.setblocking(False)
        zygote = _Zygote(None, asyncio.get_running_loop())  # type: ignore[arg-type]
        zygote.ctrl, zygote.alive = host_end, True
        got: list[int] = []
        zygote.spawned["r1"] = got.append
        child, handle = _sleeper()
        try:
            os.set_inheritable(handle, True)  # the sender's copy may be inheritable; the received one must not
            message = json.dumps({"t": "spawned", "r": "r1", "pid": child.pid}).encode()
            zygote_end.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [handle]))])
            zygote._on_readable()
            (received,) = got
            inheritable = os.get_inheritable(received)
            os.close(received)
            return inheritable
        finally:
            child.kill()
            child.wait()
            os.close(handle)
            host_end.close()
            zygote_end.close()

    assert arun(go()) is False


def test_the_zygote_probe_gives_up_at_once_where_the_kernel_cannot_report(tmp_path: Any) -> None:
    # Before Linux 6.15 the status read fails outright: no point waiting for it.
    script = tmp_path / "probe.py"
    script.write_text(
        "import errno, sys\n"
        f"sys.path.insert(0, {iso.WORKER_DIR!r})\n"
        "import zygote\n"
        "zygote._load_package()\n"
        "import _dsh_worker.descriptors as descriptors\n"
        "calls = []\n"
        "def unsupported(fd):\n"
        "    calls.append(fd)\n"
        "    raise OSError(errno.ENOTTY, 'no PIDFD_GET_INFO')\n"
        "descriptors.recorded_exit_status = unsupported\n"
        "print(zygote._kernel_reports_reaped_status(), len(calls))\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(script)], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["False", "1"], done.stderr


def _polling_run(monkeypatch: pytest.MonkeyPatch, probe_error: BaseException) -> Any:
    async def go() -> Any:
        run = _Run(PythonCodeRuntime(CodeRuntimeConfig(isolation="L0", cpu_s=1.0)))
        run.pidfd = 1234
        monkeypatch.setattr(run, "_read_cpu", lambda: 5.0)  # over the budget

        def probe(fd: int, sig: int) -> None:
            raise probe_error

        monkeypatch.setattr(signal, "pidfd_send_signal", probe)
        run._poll_cpu()
        return run.outcome

    return arun(go())


def test_cpu_polling_ignores_a_reading_once_the_worker_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its pid may name another process by now; its own end is being reported.
    assert _polling_run(monkeypatch, ProcessLookupError()) is None


def test_cpu_polling_still_enforces_the_budget_when_the_liveness_probe_is_not_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outcome = _polling_run(monkeypatch, PermissionError())
    assert outcome == ("error", ("timeout", "CPU budget exhausted (1 s of CPU time)"))


def test_cpu_polling_goes_on_after_a_reading_that_failed_while_the_worker_lives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # /proc refused for a moment (the host out of descriptors, say): the budget is still enforced.
    async def go() -> Any:
        run = _Run(PythonCodeRuntime(CodeRuntimeConfig(isolation="L0", cpu_s=1.0)))
        run.pidfd = 1234
        readings = iter([None, 5.0])
        monkeypatch.setattr(run, "_read_cpu", lambda: next(readings))
        monkeypatch.setattr(signal, "pidfd_send_signal", lambda fd, sig: None)  # still alive
        run._poll_cpu()
        assert run.outcome is None and run.cpu_handle is not None, "no further reading was scheduled"
        run.cpu_handle.cancel()
        run._poll_cpu()  # the next reading, as the timer would run it
        return run.outcome

    assert arun(go()) == ("error", ("timeout", "CPU budget exhausted (1 s of CPU time)"))


def test_a_run_without_its_pidfd_shuts_its_worker_channel() -> None:
    import socket

    async def go() -> bytes:
        run = _Run(PythonCodeRuntime(CodeRuntimeConfig(isolation="L0")))
        ours, workers = socket.socketpair()
        workers.settimeout(5)  # a failure, not a hang
        run.sock = ours
        try:
            run._on_spawned(-1)
            return workers.recv(10)  # EOF: the worker's read ends and it exits
        finally:
            ours.close()
            workers.close()

    assert arun(go()) == b""


def test_a_pidfd_that_arrives_after_its_run_closed_kills_the_worker() -> None:
    async def go() -> int:
        run = _Run(PythonCodeRuntime(CodeRuntimeConfig(isolation="L0")))
        assert run.sock is None  # closed (never opened here)
        child, handle = _sleeper()
        run._on_spawned(handle)  # owned from here on: killed and closed
        assert run.pidfd == -1
        return await asyncio.to_thread(child.wait, 10)

    assert arun(go()) == -signal.SIGKILL


def test_a_worker_gone_right_after_joining_its_cgroup_is_moved_out_and_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The join goes by pid: if the pidfd says the worker is gone, the pid may be
    # someone else's by now, so it is moved back out and the worker refused.
    moves: list[tuple[str, int]] = []

    class Group:
        def join(self, pid: int) -> None:
            moves.append(("join", pid))

        def leave(self, pid: int) -> None:
            moves.append(("leave", pid))

    class Pool:
        pids = 64

        def acquire(self) -> Group:
            return Group()

    async def go() -> Any:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L3"))
        runtime._level, runtime._cgroups = 3, Pool()  # type: ignore[assignment]
        run = _Run(runtime)
        run.pid = run.cred_pid = 4242
        run.pidfd = 1234
        monkeypatch.setattr(iso, "verify_proc", lambda pid: {})
        monkeypatch.setattr(iso, "check_level", lambda level, facts: None)
        probes = iter([None, ProcessLookupError()])  # alive for /proc, gone after the join

        def probe(fd: int, sig: int) -> None:
            outcome = next(probes)
            if outcome is not None:
                raise outcome

        monkeypatch.setattr(signal, "pidfd_send_signal", probe)
        run._verify("L3")
        return run.outcome

    assert arun(go()) == ("error", ("worker-exit", "isolation check failed: the worker exited before it was verified"))
    assert moves == [("join", 4242), ("leave", 4242)]


@pytest.mark.skipif(not iso.CgroupPool.available(), reason="needs a writable v1 pids hierarchy")
def test_a_zygote_that_cannot_fork_keeps_its_live_runs_and_fails_only_the_new_one(tmp_path: Any) -> None:
    # A fork refused for a moment (the host's process limit, say) is one spawn that fails: the
    # zygote must not exit on it, taking every live run's worker with it (PDEATHSIG).
    group = f"/sys/fs/cgroup/pids/dsh-test-nofork-{os.getpid()}"
    os.mkdir(group)

    async def go() -> None:
        runtime = PythonCodeRuntime(CodeRuntimeConfig(isolation="L1", timeout_s=20.0))
        try:
            await runtime.start()
            zygote = runtime._zygote
            assert zygote is not None and zygote.proc is not None
            for _ in range(2000):  # both pre-spawned workers forked and ready: the zygote holds a spare
                if len(runtime._warm) == 2 and all(run.ready for run in runtime._warm):
                    break
                await asyncio.sleep(0.005)
            with open(os.path.join(group, "pids.max"), "w") as handle:
                handle.write("1")  # the zygote alone: its next fork fails with EAGAIN
            with open(os.path.join(group, "cgroup.procs"), "w") as handle:
                handle.write(str(zygote.proc.pid))
            held, release = asyncio.Queue[int](), asyncio.Event()

            async def hold(args: Any) -> Any:
                held.put_nowait(args)
                await release.wait()
                return args

            # Both pre-spawned workers taken by live runs; the spare serves the next one, whose
            # spawn is followed by a fork that fails.
            live = asyncio.ensure_future(runtime.run("return await tools.hold(1)", tools(hold=hold)))
            other = asyncio.ensure_future(runtime.run("return await tools.hold(2)", tools(hold=hold)))
            assert {await held.get(), await held.get()} == {1, 2}
            spawned = await runtime.run("return 3", [])
            assert spawned.value == 3, spawned
            assert zygote.alive and runtime._zygote is zygote
            refused = await asyncio.wait_for(runtime.run("return 4", []), 10)
            assert refused.error is not None and refused.error.kind == "worker-exit", refused
            assert "fork" in refused.error.message, refused.error.message
            assert zygote.alive
            release.set()
            assert (await live).value == 1
            assert (await other).value == 2
        finally:
            await runtime.aclose()

    try:
        arun(go())
    finally:
        os.rmdir(group)
