"""The Python backend: zygote management, the hostile-peer bridge and the one-outcome latch.

A run goes: validate bindings (misuse raises) -> compile on the host (a
syntax error is an ``exception`` result, no worker) -> ask the zygote to
fork a worker -> the worker locks down and reports ``ready`` -> the host
verifies ``/proc``, joins the cgroup (L1 and up, where the host can make one) and only then sends the program ->
binding calls are bridged -> the first terminal outcome wins -> kill the
worker (the zygote kills its process group when it reaps it), wait until it
is reaped, sweep the cgroup, drain its channel and output pipe -> resolve.

The worker is named by a pidfd the zygote opened while it could not yet
exit. At L2 and above, where the kernel reports a reaped process's status
through its pidfd, the kernel reaps the worker as it exits and the host
reads that status itself; below L2 the zygote reaps and reports it.
"""

from __future__ import annotations

import array
import asyncio
import binascii
import collections
import contextlib
import contextvars
import errno
import functools
import inspect
import itertools
import json
import logging
import marshal
import os
import random
import select
import shutil
import signal as signals
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from dsh_core.abort import AbortController, AbortSignal
from dsh_core.coderuntime import framecost
from dsh_core.coderuntime import isolation as iso
from dsh_core.coderuntime.seam import (
    BindingFunction,
    BindingNamespace,
    CodeRunError,
    CodeRunResult,
    CodeRuntimeConfig,
    ErrorClassSpec,
    RunControl,
    _set_current,
    validate_bindings,
)
from dsh_core.coderuntime.worker import descriptors, wire
from dsh_core.coderuntime.worker import program as programs
from dsh_core.processes import child_pids

__all__ = ["PythonCodeRuntime", "RuntimeDisposedError", "STDLIB_PRELOAD"]

_ZYGOTE_SCRIPT = os.path.join(iso.WORKER_DIR, "zygote.py")
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_NCPU = os.cpu_count() or 1
#: The CPUs this process may keep busy at once. A worker waiting for a binding's reply polls
#: for it (worker/runner.py, ``_POLL_S``) only while there are fewer live runs than these:
#: each polling worker keeps a CPU busy, and the host's loop needs one to answer.
_USABLE_CPUS = iso.usable_cpus()
#: Every runtime's live runs in this process (what decides polling is the CPUs all of them share).
#: Weak: a run left pending on a loop closed under it is only ended (its ``finally``, which
#: leaves this set) when it is collected, and a strong global reference would prevent that.
_LIVE_RUNS: weakref.WeakSet[_Run] = weakref.WeakSet()


def _cpu_to_spare(starting: int = 0) -> bool:
    """The polling hint: whether the live runs (plus ``starting`` about to be) leave a CPU to spare."""
    return len(_LIVE_RUNS) + starting < _USABLE_CPUS


#: The share of a run's cpu_s its worker may spend polling for replies, in all: a program
#: making binding calls for longer spends the rest of its budget as it did without polling.
_POLL_SHARE = 0.1
_WORKER_KINDS = frozenset({"exception", "invalid-output", "output-limit", "memory-limit"})
_READY_MAX = 4096
_DRAIN_GRACE_S = 2.0
_EXIT_GRACE_S = 0.5
# A pidfd polls readable as its process exits; the kernel records the status
# as it reaps it, a moment later: look again this often, this many times.
_EXIT_STATUS_RETRY_S = 0.001
_EXIT_STATUS_TRIES = 200
_START_TIMEOUT_S = 60.0
_PROBE_READY_TIMEOUT_S = 60.0  # the zygote's first worker: locked down, ready and verified
# Socket reads: 64 KiB stays below glibc's mmap threshold (a 1 MiB ``recv``
# maps, faults and unmaps a fresh buffer every time: ~25 us per message).
_CHUNK = 1 << 16
_MAX_CHUNKS = 64  # at most 4 MiB per callback, so one run cannot starve the loop
# Bridge bounds against a hostile worker (documented in bench/README-coderuntime.md).
# A forged binding name is echoed back in an error reply up to this many characters.
_NAME_SHOWN = 100
# Binding calls running at once; past it a call is refused with an error reply.
_MAX_IN_FLIGHT = 10_000
# Reads of frames adding up to this size have the host's time reading them charged to the run's
# CPU budget, and so does every read once a run's smaller ones add up to it.
_TIMED_FRAME_BYTES = 1 << 16
_CGROUP_POOLS = itertools.count(1)  # names each runtime's cgroup pool, once per process
_SAMPLED_READS = 8  # past a run's first 64 KiB of small reads, one in this many is timed (at random)
_sample = random.Random().random  # seeded from the OS: the worker cannot predict it
_SHIP_CODE_MAX = 64 * 1024  # characters of source up to which the host's code object is shipped
_WARM_WORKERS = 2
# Call ids remembered outside the consecutive run 1..n that a real worker sends:
# only forged (or, briefly, out-of-order) ids land there; past it the run settles.
_MAX_STRAY_IDS = 10_000

#: Standard-library modules preloaded in every worker (documented in the README).
STDLIB_PRELOAD: tuple[str, ...] = ()  # filled below from the worker's own list

# Detected level per requested isolation and preload set: detection runs once
# per host process (a level that failed is not tried again).
_DETECTED: dict[tuple[str, tuple[str, ...]], int] = {}
_DETECT_LOCK = threading.Lock()


def _load_stdlib_preload() -> tuple[str, ...]:
    # zygote.py is a script; read its constant without executing its main.
    namespace: dict[str, Any] = {}
    with open(_ZYGOTE_SCRIPT) as handle:
        source = handle.read()
    start = source.index("STDLIB_PRELOAD = (")
    end = source.index(")\n", start)
    exec(source[start : end + 2], namespace)
    return tuple(namespace["STDLIB_PRELOAD"])


STDLIB_PRELOAD = _load_stdlib_preload()


@functools.cache
def _sweep_stale_cgroups_once() -> None:
    # Once per process, before it creates its own per-run cgroups (a rare double
    # sweep from two threads is harmless).
    iso.CgroupPool.sweep_stale()


class RuntimeDisposedError(RuntimeError):
    """``run`` was called on a runtime after :meth:`PythonCodeRuntime.aclose`."""


#: How long closing a zygote waits for its sandbox's init once killed. A killed process ends at
#: once unless a task of its namespace sleeps uninterruptibly (a hung mount): then it is left,
#: named in a warning, rather than hanging ``aclose`` with it.
SANDBOX_END_S = 10.0

log = logging.getLogger("dsh")


def _warn_sandbox_left(pidfd: int) -> None:
    pid = "?"
    with contextlib.suppress(OSError), open(f"/proc/self/fdinfo/{pidfd}") as info:
        for line in info:  # a pidfd's fdinfo names its process: "Pid:\t<pid>"
            if line.startswith("Pid:"):
                pid = line.split()[1]
    log.warning(
        "the code runtime's sandbox init (pid %s) was killed but did not exit within %g s; left running",
        pid,
        SANDBOX_END_S,
    )


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


#: Errors of the host's own resources: no isolation level would start while they last.
_RESOURCE_ERRNOS = frozenset({errno.EAGAIN, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


class ZygoteError(Exception):
    """The zygote could not start (a preload failure, a sandbox that does not work)."""

    def __init__(self, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal  # True when a lower level would fail the same way


# --------------------------------------------------------------------------- zygote


class _Abandoned:
    """What a runtime dropped without ``aclose`` must still end: its zygotes, run directories and cgroups.

    Ended by a finalizer when the runtime is collected, or at interpreter exit.
    Holds no reference to the runtime (only sockets, processes, the loops
    watching those sockets, and paths), so that it can be collected.
    """

    def __init__(self) -> None:
        # By pid, until reaped: its control socket, its process, the loop watching that socket, and
        # pidfds of what its sandbox launcher leaves to end after it (_Zygote.sandbox).
        self.zygotes: dict[
            int, tuple[socket.socket, subprocess.Popen[bytes], asyncio.AbstractEventLoop, list[int]]
        ] = {}
        self.dirs: set[str] = set()  # per-run directories (L0-L2) not yet removed
        self.cgroups: list[iso.CgroupPool] = []  # the runtime's per-run cgroups, until aclose removes them

    def end(self) -> None:
        """Close every zygote's control socket (it then kills and reaps its workers), reap it, remove the
        dirs and the cgroups."""
        zygotes = list(self.zygotes.values())
        self.zygotes.clear()
        for ctrl, _, loop, _ in zygotes:
            if not loop.is_closed() and ctrl.fileno() >= 0:
                # The loop may run on without this runtime: it must stop watching the
                # descriptor before it is closed, or a new one given its number is not watched.
                with contextlib.suppress(Exception):
                    loop.remove_reader(ctrl.fileno())
                    loop.remove_writer(ctrl.fileno())
            ctrl.close()
        for _, proc, _, sandbox in zygotes:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            handles, sandbox[:] = list(sandbox), []
            for handle in handles:
                descriptors.kill(handle)
                waiter = select.poll()
                waiter.register(handle, select.POLLIN)
                if not waiter.poll(SANDBOX_END_S * 1000):  # readable once it has exited
                    _warn_sandbox_left(handle)
                os.close(handle)
        for path in list(self.dirs):
            self.dirs.discard(path)
            try:
                os.rmdir(path)
            except OSError:
                shutil.rmtree(path, ignore_errors=True)
        pools, self.cgroups = self.cgroups, []
        for pool in pools:
            pool.close()  # the workers are reaped: the groups are empty (or emptied, what is left killed)


class _Zygote:
    """Host side of one zygote process."""

    def __init__(
        self, plan: iso.ZygotePlan, loop: asyncio.AbstractEventLoop, abandoned: _Abandoned | None = None
    ) -> None:
        self.plan = plan
        self.loop = loop
        self.abandoned = abandoned
        self.ctrl: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.exits: dict[str, asyncio.Future[int | None]] = {}
        self.spawned: dict[str, Callable[[int], None]] = {}
        #: Why the zygote could not give a run its worker (a fork refused, say), and the errno
        #: if any, by run id.
        self.failures: dict[str, tuple[str, int | None]] = {}
        self.kernel_reaps = False  # set from the zygote's hello
        #: Pidfds of the launcher's children (bubblewrap's init of the sandbox's pid namespace, at L3):
        #: the launcher exits as soon as the zygote has, and leaves them to end a moment later, no
        #: longer the host's descendants. Closing the zygote ends them too, and awaits them.
        self.sandbox: list[int] = []
        self.outbox: collections.deque[tuple[bytes, list[int]]] = collections.deque()
        self.alive = False
        self.hello: asyncio.Future[dict[str, Any]] = loop.create_future()

    async def start(self, config: CodeRuntimeConfig, let_kernel_reap: bool = True) -> None:
        plan = self.plan
        try:
            host_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as error:  # out of descriptors, say: a lower level fares no better
            raise ZygoteError(f"cannot start the zygote: {error}", fatal=True) from None
        payload = {
            "host": os.getpid(),  # names the host in the process list (ps, and the tests' scans)
            "level": plan.level,
            "preload": list(config.preload),
            "paths": list(plan.import_paths),
            "ro_paths": list(plan.ro_paths),
            "ns": list(iso.L3_NAMESPACES),
            # Only where no program can create a process: the zygote's reaping
            # is what sweeps a finished run's process group.
            "kernel_reaps": plan.level >= 2 and let_kernel_reap,
            "budgets": {
                "memory_mb": config.memory_mb,
                "cpu_s": config.cpu_s,
                "max_output_bytes": config.max_output_bytes,
                "max_frame_bytes": config.max_frame_bytes,
            },
        }
        interpreter = plan.interpreter if plan.argv_prefix else sys.executable
        argv = [
            *plan.argv_prefix,
            interpreter,
            "-I",
            "-S",
            _ZYGOTE_SCRIPT,
            str(child_end.fileno()),
            json.dumps(payload),
        ]
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(child_end.fileno(),),
                env={},
                cwd="/",
                start_new_session=True,
            )
        except OSError as error:
            host_end.close()
            # No bubblewrap (ENOENT) is a level that does not work here; no process or
            # descriptor left (EAGAIN, EMFILE...) is this moment, not the level.
            fatal = error.errno in _RESOURCE_ERRNOS
            raise ZygoteError(f"cannot start the zygote: {error}", fatal=fatal) from None
        finally:
            child_end.close()
        host_end.setblocking(False)
        self.ctrl = host_end
        if self.abandoned is not None:
            self.abandoned.zygotes[self.proc.pid] = (host_end, self.proc, self.loop, self.sandbox)
        self.alive = True
        self.loop.add_reader(host_end.fileno(), self._on_readable)
        try:
            hello = await asyncio.wait_for(asyncio.shield(self.hello), _START_TIMEOUT_S)
        except (TimeoutError, ZygoteError) as error:
            if plan.argv_prefix:
                # What of the sandbox is up by now ends with the zygote too (close), like a started one's.
                self.sandbox.extend(_children_pidfds(self.proc.pid))
            await self.close()
            if isinstance(error, ZygoteError):
                raise
            raise ZygoteError("the zygote did not start in time") from None
        if plan.argv_prefix:
            # The zygote has spoken, so the launcher's own processes are all there now.
            self.sandbox.extend(_children_pidfds(self.proc.pid))
        if hello.get("t") == "error":
            await self.close()
            message = str(hello.get("m"))
            raise ZygoteError(message, fatal="code_runtime.preload" in message)
        self.kernel_reaps = hello.get("kernel_reaps") is True

    def abort_start(self, reason: str) -> None:
        """Make a ``start`` still waiting for the hello fail now (it then closes the zygote)."""
        if not self.hello.done():
            self.hello.set_exception(ZygoteError(reason))
            self.hello.exception()  # mark retrieved

    def _on_readable(self) -> None:
        assert self.ctrl is not None
        while True:
            try:
                data, ancdata, _, _ = self.ctrl.recvmsg(1 << 16, socket.CMSG_SPACE(4 * 4), socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, ancdata = b"", []
            fds = descriptors.received(ancdata)
            if not data:
                _close_all(fds)
                self._dead()
                return
            try:
                message = json.loads(data)
            except ValueError:
                _close_all(fds)
                continue
            kind = message.get("t")
            if kind in ("hello", "error"):
                if not self.hello.done():
                    self.hello.set_result(message)
            elif kind == "exit":
                future = self.exits.get(message.get("r"))
                if future is not None and not future.done():
                    reason, number = message.get("m"), message.get("errno")
                    if isinstance(reason, str) and reason:
                        number = number if type(number) is int else None
                        self.failures[str(message.get("r"))] = (reason[:_READY_MAX], number)
                    future.set_result(int(message.get("status", 0)))
            elif kind == "spawned":
                self._on_spawned_message(message.get("r"), fds)
            _close_all(fds)

    def _on_spawned_message(self, run_id: object, fds: list[int]) -> None:
        on_spawned = self.spawned.pop(run_id, None) if isinstance(run_id, str) else None
        if len(fds) == 1 and on_spawned is not None:
            if self.kernel_reaps:
                self.exits.pop(str(run_id), None)  # its pidfd tells when and how it ended
            on_spawned(fds.pop())
        elif len(fds) == 1:
            descriptors.kill(fds[0])  # its run gave up waiting for it: nothing else ever would
        elif on_spawned is not None:
            on_spawned(-1)  # the pidfd was lost on the way (say, the host is out of descriptors)

    def _dead(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self._drop_outbox()
        if self.ctrl is not None:
            self.loop.remove_reader(self.ctrl.fileno())
        if not self.hello.done():
            self.hello.set_exception(ZygoteError("the zygote exited during start-up"))
            self.hello.exception()  # mark retrieved
        for future in self.exits.values():
            if not future.done():
                future.set_result(None)

    def spawn(
        self, run_id: str, proto_fd: int, out_fd: int, cwd: str, on_spawned: Callable[[int], None] | None = None
    ) -> asyncio.Future[int | None]:
        """Ask for a worker; the future resolves with its wait status (None: unknown, the zygote died).

        ``on_spawned`` receives the worker's pidfd (and owns it). Where the kernel
        reaps, the future is then the caller's to resolve, from that pidfd.
        """
        future: asyncio.Future[int | None] = self.loop.create_future()
        self.exits[run_id] = future
        if on_spawned is not None:
            self.spawned[run_id] = on_spawned
        if not self.alive or self.ctrl is None:
            future.set_result(None)
            return future
        request = json.dumps({"t": "spawn", "r": run_id, "cwd": cwd}).encode()
        # Our own copies: the caller closes its descriptors once this returns, and the
        # request may have to wait in the outbox.
        proto = os.dup(proto_fd)
        try:
            out = os.dup(out_fd)
        except BaseException:
            os.close(proto)
            raise
        self._send(request, [proto, out])
        return future

    def kill(self, run_id: str) -> None:
        if self.alive and self.ctrl is not None:
            self._send(json.dumps({"t": "kill", "r": run_id}).encode(), [])

    def _send(self, data: bytes, fds: list[int]) -> None:
        # The control socket's send buffer holds about 280 spawn requests (measured);
        # past that a send would block. A burst of runs larger than that, while the
        # zygote is busy, waits in the outbox, in order, until the zygote has read
        # some: a full socket is not a dead zygote.
        if self.outbox or not self._try_send(data, fds):
            if not self.outbox and self.ctrl is not None:
                self.loop.add_writer(self.ctrl.fileno(), self._flush)
            self.outbox.append((data, fds))

    def _try_send(self, data: bytes, fds: list[int]) -> bool:
        """Send one message; False if the socket is full. Owned ``fds`` are closed once sent."""
        assert self.ctrl is not None
        try:
            if fds:
                self.ctrl.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                self.ctrl.send(data)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            _close_all(fds)
            self._dead()
            return True
        _close_all(fds)
        return True

    def _flush(self) -> None:
        while self.outbox and self.alive:
            data, fds = self.outbox.popleft()  # out first: a failed send closes its fds
            if not self._try_send(data, fds):
                self.outbox.appendleft((data, fds))
                return
        if self.ctrl is not None:
            self.loop.remove_writer(self.ctrl.fileno())

    def _drop_outbox(self) -> None:
        if self.outbox and self.ctrl is not None:
            self.loop.remove_writer(self.ctrl.fileno())
        while self.outbox:
            _close_all(self.outbox.popleft()[1])

    def forget(self, run_id: str) -> None:
        self.exits.pop(run_id, None)
        self.spawned.pop(run_id, None)
        self.failures.pop(run_id, None)

    async def close(self) -> None:
        """Close the control socket (the zygote kills and reaps its children) and reap it."""
        self._drop_outbox()
        if self.ctrl is not None:
            if self.alive:
                self.loop.remove_reader(self.ctrl.fileno())
            self.alive = False
            self.ctrl.close()
            self.ctrl = None
        for future in self.exits.values():
            if not future.done():
                future.set_result(None)
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return  # never started, or closed already: its pid may belong to another process now
        try:
            await self._reap(proc)
        finally:
            if proc.returncode is not None and self.abandoned is not None:
                self.abandoned.zygotes.pop(proc.pid, None)
        # Reaped, its launcher has no more use for them: bubblewrap's --die-with-parent is killing
        # its init now anyway. Ended and awaited here, not left running after the close.
        handles, self.sandbox[:] = list(self.sandbox), []
        try:
            for handle in handles:
                descriptors.kill(handle)
            for handle in handles:
                if not await self._ends_within(handle, SANDBOX_END_S):
                    _warn_sandbox_left(handle)
        finally:
            _close_all(handles)

    async def _reap(self, proc: subprocess.Popen[bytes]) -> None:
        try:
            pidfd = os.pidfd_open(proc.pid)
        except OSError:
            proc.wait()
            return
        try:
            await self._exited(pidfd, 10.0)
        finally:
            os.close(pidfd)
        proc.wait()

    async def _ends_within(self, pidfd: int, seconds: float) -> bool:
        """Whether the process behind ``pidfd`` has exited within ``seconds``."""
        try:
            await asyncio.wait_for(self._exited(pidfd), seconds)
        except TimeoutError:
            return False
        return True

    async def _exited(self, pidfd: int, grace: float | None = None) -> None:
        """Return once the process behind ``pidfd`` has exited, killed if it has not within ``grace`` seconds."""
        exited: asyncio.Future[None] = self.loop.create_future()

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        self.loop.add_reader(pidfd, on_exit)
        try:
            if grace is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(exited), grace)
                except TimeoutError:
                    descriptors.kill(pidfd)
            await exited
        finally:
            self.loop.remove_reader(pidfd)


def _children_pidfds(parent: int) -> list[int]:
    """Pidfds of the processes whose parent is ``parent`` now (a process of the host's, not yet reaped)."""
    handles: list[int] = []
    for pid in child_pids(parent):
        try:
            handle = os.pidfd_open(pid)
        except OSError:
            continue  # gone already
        try:
            with open(f"/proc/{pid}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            # Alive after that read: it was this pidfd's process, not a reused pid.
            signals.pidfd_send_signal(handle, 0)
        except (OSError, ValueError, IndexError):
            ppid = -1
        if ppid == parent:
            handles.append(handle)
        else:
            os.close(handle)
    return handles


async def _until(future: asyncio.Future[Any], timeout: float) -> None:
    """Wait until ``future`` is done or ``timeout`` seconds pass; never cancel ``future``.

    What ``wait_for(shield(future), timeout)`` does for this, in fewer
    event-loop turns (two waits of every run's teardown use it).
    """
    if future.done():
        return
    loop = future.get_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def release(*_: object) -> None:
        if not waiter.done():
            waiter.set_result(None)

    timer = loop.call_later(timeout, release)
    future.add_done_callback(release)
    try:
        await waiter
    finally:
        timer.cancel()
        future.remove_done_callback(release)


# --------------------------------------------------------------------------- wall clock


class _WallClock:
    """The wall-clock budget; :meth:`pause` stops it from counting (nestable)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, budget: float, expire: Any) -> None:
        self.loop = loop
        self.remaining = budget
        self.expire = expire
        self.paused = 0
        self.stopped = False
        self.since = loop.time()
        self.handle: asyncio.TimerHandle | None = loop.call_later(budget, expire)

    def pause(self) -> None:
        self.paused += 1
        if self.paused == 1 and self.handle is not None:
            self.remaining -= self.loop.time() - self.since
            self.handle.cancel()
            self.handle = None

    def resume(self) -> None:
        self.paused -= 1
        if self.paused == 0 and not self.stopped and self.handle is None:
            self.since = self.loop.time()
            self.handle = self.loop.call_later(max(self.remaining, 0.0), self.expire)

    def stop(self) -> None:
        self.stopped = True
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


# --------------------------------------------------------------------------- one run


_Namespaces = list[tuple[str, dict[str, BindingFunction], ErrorClassSpec | None]]


class _Run:
    """One program run: the bridge, the ledger and the one-outcome latch."""

    def __init__(self, owner: PythonCodeRuntime) -> None:
        self.owner = owner
        self.config = owner.config
        self.loop = asyncio.get_running_loop()
        self.namespaces: dict[str, dict[str, BindingFunction]] = {}
        self.start_frame: bytes | None = None
        self.signal: AbortSignal | None = None
        self.assigned = False
        self.run_id = f"r{next(owner._ids)}"
        self.ledger = wire.Ledger(self.config.max_output_bytes)
        self.frames = wire.FrameBuffer(self.config.max_frame_bytes)
        self.controller = AbortController()
        self.control = RunControl(self.controller.signal, self._pause, self._resume)
        self.settled: asyncio.Future[None] = self.loop.create_future()
        self.finished: asyncio.Future[None] = self.loop.create_future()
        self.outcome: tuple[str, Any] | None = None
        self.ready = False
        self.ready_text: str | None = None  # the worker's ready report, until it is verified
        self.pid = 0  # from the pidfd, in the host's pid namespace
        self.cred_pid = 0  # the kernel-attested sender of the worker's first message
        self.pidfd = -1
        self.watching_exit = False
        self.exit_tries = 0
        self.cgroup: iso.Cgroup | None = None
        self.cgroup_empty = False  # a sweep after the reap found no process left
        self.cwd: str | None = None
        self.sock: socket.socket | None = None
        self.out_fd = -1
        self.sock_eof = False
        self.out_eof = False
        self.eof_waiter: asyncio.Future[None] | None = None
        self.exit_future: asyncio.Future[int | None] | None = None
        self.kernel_reaps = False  # the kernel reaps this worker; its pidfd resolves exit_future
        self.exit_status: int | None = None
        self.spawn_errno: int | None = None  # why the zygote could not fork this worker, if it could not
        # Each call id is answered at most once, in bounded memory: the worker
        # numbers its calls 1, 2, 3, ..., so ids 1..id_floor are all seen and only
        # ids outside that run (forged ones) are kept, at most _MAX_STRAY_IDS.
        self.id_floor = 0
        self.seen_ids: set[int] = set()
        #: The binding calls running, by call id (a task, or the future the binding returned).
        self.tasks: dict[int, asyncio.Future[Any]] = {}
        #: Ids of running calls the program cancelled: they get no reply.
        self.cancelled_ids: set[int] = set()
        # What the frames of the calls in ``tasks`` may take once read, bounded by the worker's memory budget.
        self.call_bytes = 0
        self.wbuf = bytearray()
        self.writing = False
        self.pipe_pending = bytearray()
        self.descriptor = ""
        self.cpu_used = 0.0
        self.host_cpu = 0.0  # the host's time reading this run's frames, charged to its CPU budget
        self.untimed_bytes = 0  # the run's frames read before the host timed every read
        self.cpu_handle: asyncio.TimerHandle | None = None
        self.exit_timer: asyncio.TimerHandle | None = None
        self.clock: _WallClock | None = None
        self.remove_listener: Any = None
        self.killed = False
        self.teardown: asyncio.Future[None] | None = None
        self.zygote: _Zygote | None = None  # the one that spawned this worker

    # ---------------------------------------------------------------- latch

    def settle(self, kind: str, payload: Any = None) -> None:
        """Record the first terminal outcome; every later one is ignored."""
        if self.outcome is not None:
            return
        self.outcome = (kind, payload)
        if not self.settled.done():
            self.settled.set_result(None)

    def _pause(self) -> None:
        if self.clock is not None:
            self.clock.pause()

    def _resume(self) -> None:
        if self.clock is not None:
            self.clock.resume()

    # ---------------------------------------------------------------- lifecycle

    def assign(
        self,
        source: str,
        namespaces: _Namespaces,
        signal: AbortSignal | None,
        compiled: tuple[types.CodeType, list[str]] | None = None,
    ) -> None:
        """Give this (fresh or pre-spawned) worker its one program; the budgets start now.

        ``compiled`` is the host's compile of ``source`` and its warning texts.
        """
        self.assigned = True
        self.namespaces = {name: functions for name, functions, _ in namespaces}
        start: dict[str, object] = {
            "t": "start",
            "p": source,
            "ns": [
                [name, sorted(functions), spec.name if spec else None, spec.member if spec else None]
                for name, functions, spec in namespaces
            ],
            # This run is not live yet: with it, the live runs must stay below the usable CPUs.
            "poll": _cpu_to_spare(starting=1),
            "poll_s": self.config.cpu_s * _POLL_SHARE,
        }
        if compiled is not None and len(source) <= _SHIP_CODE_MAX:
            # The same interpreter binary runs the worker, so the host's code
            # object loads there as is (the worker trusts the host), with the
            # warnings that compile printed. Only where it costs little: it
            # triples the start frame, which must stay within the frame cap.
            code, warned = compiled
            start["c"] = binascii.b2a_base64(marshal.dumps(code), newline=False).decode("ascii")
            start["w"] = warned
        frame = wire.pack(start)
        if len(frame) - 4 > self.config.max_frame_bytes and "c" in start:
            del start["c"], start["w"]  # the worker compiles it again instead
            frame = wire.pack(start)
        self.start_frame = frame
        self.signal = signal
        self.clock = _WallClock(self.loop, self.config.timeout_s, self._on_wall)
        if signal is not None:
            self.remove_listener = signal.add_listener(lambda reason: self.settle("abort", str(reason)))
        if self.ready and self.outcome is None:
            self._begin()

    def _begin(self) -> None:
        assert self.start_frame is not None
        self._write(self.start_frame)
        self._schedule_cpu(min(self.config.cpu_s / _NCPU, 0.25))

    async def finish_run(self, zygote: _Zygote) -> CodeRunResult:
        """Wait for the one terminal outcome, tear the worker down, build the result."""
        try:
            await self.settled
        except asyncio.CancelledError:
            self.settle("abort", "run cancelled")
            await self._shielded_teardown(zygote)
            raise
        await self._shielded_teardown(zygote)
        return self._finish()

    async def hold_warm(self, zygote: _Zygote) -> None:
        """Lifecycle of a pre-spawned worker until a run takes it (or it dies unused).

        Cancelled (for instance by ``asyncio.run`` ending with the runtime
        never closed), an unassigned worker is still torn down: killed,
        reaped, its directory removed.
        """
        try:
            await self.settled
        except asyncio.CancelledError:
            if not self.assigned:  # an assigned one is its run's to tear down
                self.settle("error", ("abort", "runtime disposed"))
                await self._shielded_teardown(zygote)
            raise
        if not self.assigned:
            await self._shielded_teardown(zygote)

    async def _shielded_teardown(self, zygote: _Zygote) -> None:
        """Tear down once; a cancellation of the caller leaves it running (``aclose`` awaits it).

        Returns only once the teardown completed (the worker reaped and its pipes
        drained, each wait bounded: 10 s for the reap, the drain grace after); a
        teardown cut short, though it still killed the worker, raises here as it
        ended (cancelled, or its error).
        """
        self._start_teardown(zygote)
        await asyncio.shield(self.finished)
        teardown = self.teardown
        if teardown is not None and teardown.done():
            if teardown.cancelled():
                raise asyncio.CancelledError("the run's teardown was cancelled")
            error = teardown.exception()
            if error is not None:
                raise error

    def _start_teardown(self, zygote: _Zygote) -> None:
        if self.teardown is None and not self.finished.done():
            self.teardown = asyncio.ensure_future(self._teardown(zygote))
            # Cancelled before its first step, it never runs its finally: end it here.
            self.teardown.add_done_callback(lambda _: self._end(zygote, now=True))

    def _spawn(self, zygote: _Zygote) -> None:
        """Ask the zygote for this run's worker; on any failure nothing is left registered or open."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = parent
        try:
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
        except BaseException:
            child.close()
            self._close()
            raise
        self.out_fd = out_r
        try:
            parent.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            parent.setblocking(False)
            os.set_blocking(out_r, False)
            if zygote.plan.level < 3:
                self.cwd = tempfile.mkdtemp(prefix="dsh-run-")
                self.owner._run_dirs.add(self.cwd)  # removed by its run's end, by aclose, or at last by the finalizer
            self.exit_future = zygote.spawn(self.run_id, child.fileno(), out_w, self.cwd or "/", self._on_spawned)
            self.kernel_reaps = zygote.kernel_reaps
            self.exit_future.add_done_callback(self._on_exit)
            self.loop.add_reader(parent.fileno(), self._on_sock)
            self.loop.add_reader(out_r, self._on_pipe)
            self.zygote = zygote
            runs = self.owner._runs
            runs.add(self)  # until its teardown ends: aclose settles and awaits every one
            self.finished.add_done_callback(lambda _: runs.discard(self))
        except BaseException:
            # Closing our ends ends a worker the zygote may already have forked.
            self._close()
            zygote.forget(self.run_id)
            raise
        finally:
            child.close()
            os.close(out_w)

    def _on_spawned(self, pidfd: int) -> None:
        """The zygote's pidfd of this run's worker (owned from here on); -1 if it was lost."""
        if pidfd < 0:
            # The worker cannot be named, so it gets no program: its channel is shut now,
            # which ends it. Where the kernel reaps, no one else will report its end.
            self.settle("error", ("worker-exit", "the worker's pidfd did not reach the host"))
            if self.sock is not None:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
            if self.kernel_reaps and self.exit_future is not None and not self.exit_future.done():
                self.exit_future.set_result(None)
            return
        if self.pidfd >= 0:  # a duplicate
            os.close(pidfd)
            return
        if self.sock is None:  # the run is over: nothing else would kill this worker
            descriptors.kill(pidfd)
            os.close(pidfd)
            return
        self.pidfd = pidfd
        try:
            self.pid = descriptors.pid_of(pidfd)
        except (OSError, ValueError):
            self.pid = -1
        if self.kernel_reaps:
            self.loop.add_reader(pidfd, self._on_pidfd)
            self.watching_exit = True
        if self.outcome is not None:  # settled before the worker was known: kill it now
            descriptors.kill(pidfd)
        elif self.ready_text is not None:
            self._verify(self.ready_text)

    def _on_pidfd(self) -> None:
        """Where the kernel reaps: the worker exited; read its status from the pidfd."""
        if self.pidfd < 0:
            return  # closed meanwhile
        status = descriptors.exit_status(self.pidfd)
        if self.watching_exit:  # readable for good from now on
            self.loop.remove_reader(self.pidfd)
            self.watching_exit = False
        if status is None:
            # Polled readable at exit; the kernel records the status as it reaps, a moment later.
            self.exit_tries += 1
            if self.exit_tries < _EXIT_STATUS_TRIES:
                self.loop.call_later(_EXIT_STATUS_RETRY_S, self._on_pidfd)
                return
        if self.exit_future is not None and not self.exit_future.done():
            self.exit_future.set_result(status)

    def _on_wall(self) -> None:
        self.settle("error", ("timeout", f"wall-clock ceiling reached ({self.config.timeout_s:g} s)"))

    # ---------------------------------------------------------------- inbound

    def _on_sock(self) -> None:
        sock = self.sock
        assert sock is not None
        try:
            if not self.ready:
                data, ancdata, _, _ = sock.recvmsg(_CHUNK, socket.CMSG_SPACE(12))
                for level, kind, payload in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= 12:
                        self.cred_pid = self.cred_pid or int.from_bytes(payload[0:4], sys.byteorder, signed=True)
            else:
                data = sock.recv(_CHUNK)
                if len(data) == _CHUNK:
                    data = self._recv_more(sock, data)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.loop.remove_reader(sock.fileno())
            self.sock_eof = True
            self._check_eof()
            return
        if self.outcome is not None:
            return  # drained after settlement: ignored
        try:
            payloads = self.frames.feed(data)
        except wire.WireError as error:
            self.settle("limit", f"protocol {error} (max_frame_bytes)")
            return
        # The loop thread's CPU time, not the wall clock: while the host is off the CPU (other
        # processes, another thread holding the GIL, stopped with Ctrl-Z) the program is not
        # costing it anything, and cpu_s is a budget of CPU time. Timed per read, not per frame:
        # every read bringing 64 KiB or more; and once the run's smaller reads add up to 64 KiB
        # (a flood of frames just under the size would otherwise cost the host many times the
        # worker's CPU), one read in _SAMPLED_READS at random, charged that many times over, as
        # reading the thread's clock costs more than a small read's work (0.7 us, a syscall).
        # The worker cannot tell which reads are timed. A run that moves little never is.
        size = sum(map(len, payloads))
        if size >= _TIMED_FRAME_BYTES:
            weight = 1
        elif self.untimed_bytes < _TIMED_FRAME_BYTES:
            self.untimed_bytes += size
            weight = 0
        else:
            weight = _SAMPLED_READS if _sample() * _SAMPLED_READS < 1 else 0
        if weight:
            started = time.thread_time()
        try:
            for payload in payloads:
                if self.outcome is not None:
                    return
                cost = framecost.read_cost(payload, self._memory_bytes)
                if cost > self._memory_bytes:
                    self._refuse_dear_frame(len(payload), cost)
                    return
                # Junk (a WireError) is dropped silently, its reading still counted; the listener
                # never raises, whatever the peer sends.
                with contextlib.suppress(Exception):
                    self._on_message(wire.unpack_payload(payload), cost)
        finally:
            if weight:
                self._charge_host_reading((time.thread_time() - started) * weight)

    @property
    def _memory_bytes(self) -> int:
        """The worker's memory budget, which also bounds what its frames make the host hold."""
        return self.config.memory_mb * 1024 * 1024

    def _refuse_dear_frame(self, size: int, cost: int) -> None:
        """Settle the run on a frame that could take more than the worker's memory budget to read.

        Refused before it is parsed (:mod:`~dsh_core.coderuntime.framecost`): a frame of
        tiny JSON elements takes many times its size once parsed, and seconds of the loop.
        """
        # Not "protocol": a genuine program returning or passing this much in tiny elements gets it too.
        self.settle(
            "limit",
            f"a frame of {size} bytes could take up to {cost} bytes of host memory to read, "
            f"more than the memory budget ({self.config.memory_mb} MiB); return or pass less at once",
        )

    @staticmethod
    def _recv_more(sock: socket.socket, first: bytes) -> bytes:
        # A full chunk: more is probably waiting (a large frame). Read on, in
        # bounded chunks that stay below malloc's mmap threshold, so a
        # one-line reply does not pay for mapping and unmapping a huge buffer.
        chunks = [first]
        for _ in range(_MAX_CHUNKS - 1):
            try:
                more = sock.recv(_CHUNK)
            except (BlockingIOError, InterruptedError, OSError):
                break  # EOF and errors are seen by the next callback
            if not more:
                break
            chunks.append(more)
            if len(more) < _CHUNK:
                break
        return b"".join(chunks)

    def _on_message(self, message: object, cost: int = 0) -> None:
        """Handle one parsed message from the worker (never raises for junk).

        ``cost`` bounds the host memory its frame may take once read (:mod:`.framecost`).
        """
        if type(message) is not dict:
            return
        kind = message.get("t")
        if not self.ready:
            if kind == "ready":
                text = message.get("d")
                if type(text) is str and len(text) <= _READY_MAX:
                    self._on_ready(text)
            return
        if kind == "log":
            text = message.get("s")
            # Text, not a value: a surrogate pair written as two code points (print('\ud83d\ude00'))
            # becomes the character it spells, as the worker's ledger counted it, so the logs stay
            # lossless JSON (a result, a session event) instead of making the run's result unrecordable.
            if type(text) is str and not self.ledger.add(wire.join_pairs(text)):
                self.settle("limit", None)
        elif kind == "call":
            self._on_call(message.get("id"), message.get("g"), message.get("n"), message.get("a"), cost)
        elif kind == "cancel":
            self._on_cancel(message.get("id"))
        elif kind == "done":
            self._on_done(message)
        elif kind == "output-limit":
            if message.get("entries") is True and self.ledger.entries_full:
                self.ledger.counted_out = True  # the worker's ledger refused one entry too many
            self.settle("limit", None)

    def _on_ready(self, text: str) -> None:
        # The zygote's pidfd and the worker's ready travel on two sockets: verify once both are in.
        if self.ready_text is not None:
            return
        self.ready_text = text
        if self.pidfd >= 0:
            self._verify(text)

    def _verify(self, text: str) -> None:
        if self.pid <= 0 or self.cred_pid != self.pid:
            self.settle("error", ("worker-exit", "the worker's pid could not be verified"))
            return
        try:
            facts = iso.verify_proc(self.pid)
            # Still the pidfd's process: what /proc showed was the worker, not a reused pid.
            signals.pidfd_send_signal(self.pidfd, 0)
        except OSError as error:
            self.settle("error", ("worker-exit", f"the worker could not be verified: {error}"))
            return
        level = self.owner._level
        problem = iso.check_level(level, facts)
        # Where cgroups can be made (a root host), every level from L1 up joins one: below L3 too,
        # since the kernel holds a root worker to no process count (RLIMIT_NPROC exempts root).
        if problem is None and level >= 1 and self.owner._cgroups is not None:
            try:
                self.cgroup = self.owner._cgroups.acquire()
                self.cgroup.join(self.pid)
                text += f" cgroup(mem={self.config.memory_mb}M,pids={self.owner._cgroups.pids})"
            except OSError as error:
                problem = f"cannot join the run cgroup: {error}"
            else:
                try:  # joined by pid: still the pidfd's process, so not a reused pid
                    signals.pidfd_send_signal(self.pidfd, 0)
                except ProcessLookupError:
                    self.cgroup.leave(self.pid)  # whoever holds that pid now goes back
                    problem = "the worker exited before it was verified"
        if problem is not None:
            self.settle("error", ("worker-exit", f"isolation check failed: {problem}"))
            return
        self.descriptor = f"{text} {iso.suffix(facts)}"
        with contextlib.suppress(OSError):
            assert self.sock is not None
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 0)
        self.ready = True
        if self.owner._probe_only:
            self.settle("probe", None)
        elif self.assigned:
            self._begin()
        # else: a pre-spawned worker, verified and waiting for its program

    def _on_call(self, call_id: object, global_name: object, name: object, args: object, cost: int) -> None:
        # Rebuild field by field; anything malformed is dropped without a reply.
        if self.outcome is not None:
            return  # no calls after settlement
        if type(call_id) is not int or type(global_name) is not str or type(name) is not str:
            return
        if not self._first_sighting(call_id):
            return  # each id is answered at most once
        functions = self.namespaces.get(global_name)
        function = functions.get(name) if functions is not None else None
        if function is None:
            self._reply(call_id, False, f'unknown binding "{_shown(f"{global_name}.{name}")}"')
            return
        # The host holds each running call's decoded arguments: what their frames may take once
        # read (framecost) may not exceed the worker's own memory budget together. A forger
        # writing one buffer as many calls would otherwise make the host hold every copy; a
        # genuine program reaches the bound only by passing large values to many concurrent
        # calls, and gets a catchable error.
        if self.tasks and self.call_bytes + cost > self._memory_bytes:
            self._reply(
                call_id,
                False,
                f"binding arguments in flight exceed the memory budget ({self.config.memory_mb} MiB)",
            )
            return
        try:
            value = wire.decode(args)
        except wire.WireError:
            self._reply(call_id, False, "binding arguments must be lossless JSON")
            return
        if len(self.tasks) >= _MAX_IN_FLIGHT:
            self._reply(call_id, False, f"too many binding calls in flight (at most {_MAX_IN_FLIGHT})")
            return
        # Calling the function only creates a coroutine: an ``async def`` body never runs in this
        # callback, but in a task of its own (it may rely on asyncio.timeout, anyio cancel scopes,
        # current_task()). A plain function returning a future runs here and is awaited without one.
        context = contextvars.copy_context()
        context.run(_set_current, self.control)
        try:
            awaitable = context.run(function, value)
        except (Exception, asyncio.CancelledError) as error:
            self._fail(call_id, error)
            return
        pending: asyncio.Future[Any]
        if isinstance(awaitable, asyncio.Future) and awaitable.get_loop() is self.loop:
            pending = awaitable
            pending.add_done_callback(functools.partial(self._on_resolved, call_id))
        elif inspect.isawaitable(awaitable):
            pending = self.loop.create_task(self._invoke(call_id, awaitable), context=context)
        else:
            self._reply(
                call_id,
                False,
                f"binding {_shown(f'{global_name}.{name}')} returned {type(awaitable).__name__}, not an awaitable",
            )
            return
        self.tasks[call_id] = pending
        self.call_bytes += cost
        pending.add_done_callback(functools.partial(self._call_ended, call_id, cost))

    def _call_ended(self, call_id: int, cost: int, pending: asyncio.Future[Any]) -> None:
        self.tasks.pop(call_id, None)
        self.call_bytes -= cost
        if self.cancelled_ids:
            self.cancelled_ids.discard(call_id)

    def _on_cancel(self, call_id: object) -> None:
        """The program cancelled its call ``call_id`` (its await was cancelled): cancel the call here.

        Only a call of this run that is still running: an unknown, repeated, late (replied
        to, or after settlement) or malformed cancel is ignored. The call gets no reply; it
        stays counted in flight until it has actually ended.
        """
        if self.outcome is not None or type(call_id) is not int:
            return
        pending = self.tasks.get(call_id)
        if pending is None or pending.done() or call_id in self.cancelled_ids:
            return
        self.cancelled_ids.add(call_id)
        pending.cancel()

    def _first_sighting(self, call_id: int) -> bool:
        """Record ``call_id``; False if it was seen before (or the run just settled)."""
        if 0 < call_id <= self.id_floor or call_id in self.seen_ids:
            return False
        if call_id == self.id_floor + 1:
            self.id_floor = call_id
            while self.id_floor + 1 in self.seen_ids:  # a gap filled: absorb what follows it
                self.id_floor += 1
                self.seen_ids.remove(self.id_floor)
            return True
        if len(self.seen_ids) >= _MAX_STRAY_IDS:
            self.settle("limit", f"protocol: more than {_MAX_STRAY_IDS} forged or out-of-order call ids")
            return False
        self.seen_ids.add(call_id)
        return True

    async def _invoke(self, call_id: int, awaitable: Awaitable[Any]) -> None:
        try:
            result = await awaitable
        except Exception as error:
            self._fail(call_id, error)
            return
        except asyncio.CancelledError as error:
            self._fail(call_id, error)
            raise
        self._resolve(call_id, result)

    def _on_resolved(self, call_id: int, future: asyncio.Future[Any]) -> None:
        """Reply for a binding that returned a future (no task: this is its done callback)."""
        error = asyncio.CancelledError() if future.cancelled() else future.exception()
        if error is not None:
            self._fail(call_id, error)
            return
        self._resolve(call_id, future.result())

    def _fail(self, call_id: int, error: BaseException) -> None:
        """The error reply for a binding call that raised, failed or was cancelled."""
        if self.cancelled_ids and call_id in self.cancelled_ids:
            return  # the program cancelled it: nobody waits for this reply
        if isinstance(error, asyncio.CancelledError):
            self._reply(call_id, False, "binding call cancelled")
        else:
            self._reply(call_id, False, str(error) or type(error).__name__)

    def _resolve(self, call_id: int, result: Any) -> None:
        if self.cancelled_ids and call_id in self.cancelled_ids:
            return  # the program cancelled it: nobody waits for this reply
        try:
            tokens = wire.encode(result)
            frame = wire.pack({"t": "reply", "id": call_id, "ok": True, "v": tokens, "poll": _cpu_to_spare()})
        except wire.WireError as error:
            self._reply(call_id, False, f"binding resolution must be lossless JSON: {error.describe('result')}")
            return
        if self.outcome is None:
            self._write(frame)

    def _reply(self, call_id: int, ok: bool, message: str) -> None:
        if self.outcome is None:  # late resolutions are dropped
            self._write(wire.pack({"t": "reply", "id": call_id, "ok": ok, "m": message, "poll": _cpu_to_spare()}))

    def _on_done(self, message: dict[str, Any]) -> None:
        if "e" in message:
            error = message["e"]
            if type(error) is not dict:
                return
            kind, text = error.get("k"), error.get("m")
            if type(kind) is not str or kind not in _WORKER_KINDS or type(text) is not str:
                return  # malformed: dropped
            if kind == "output-limit":
                self.settle("limit", None)
            else:
                self.settle("error", (kind, wire.join_pairs(text)))  # text, as a log is
            return
        if "v" not in message:
            self.settle("novalue", None)
            return
        tokens = message["v"]
        try:
            value = wire.decode(tokens)
            size = wire.tokens_json_size(tokens)  # WireError: an int the worker's limit never lets out
        except wire.WireError:
            self.settle("error", ("invalid-output", "program completion must be lossless JSON"))
            return
        self.settle("value", (value, size))

    def _on_pipe(self) -> None:
        try:
            data = os.read(self.out_fd, 1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.loop.remove_reader(self.out_fd)
            self.out_eof = True
            if self.pipe_pending:
                self._pipe_line(bytes(self.pipe_pending))
                self.pipe_pending.clear()
            self._check_eof()
            return
        if self.ledger.overflow:
            return
        pending = self.pipe_pending
        pending += data
        if b"\n" in data:
            *lines, rest = bytes(pending).split(b"\n")
            pending[:] = rest
            for line in lines:
                self._pipe_line(line)
        if len(pending) > self.ledger.cap:  # one endless line: it cannot fit anyway
            self._pipe_line(bytes(pending))
            pending.clear()

    def _pipe_line(self, line: bytes) -> None:
        # Raw writes to descriptors 1/2 (bypassing print) are output too.
        if not self.ledger.add(line.decode("utf-8", "replace")):
            self.settle("limit", None)

    # ---------------------------------------------------------------- outbound

    def _write(self, data: bytes) -> None:
        sock = self.sock
        if sock is None or self.sock_eof:
            return
        if self.wbuf:
            # The worker has not taken what is already queued. Past one frame cap
            # of undelivered replies it is not reading them: settle rather than
            # buffer without bound (a single larger reply is still always queued).
            if len(self.wbuf) > self.config.max_frame_bytes:
                self.settle(
                    "limit",
                    f"protocol: the worker stopped reading binding replies ({len(self.wbuf)} bytes "
                    f"undelivered, over the {self.config.max_frame_bytes}-byte max_frame_bytes cap)",
                )
                return
            self.wbuf += data
            return
        try:
            sent = sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return
        if sent < len(data):
            self.wbuf += data[sent:]
            self.loop.add_writer(sock.fileno(), self._on_writable)
            self.writing = True

    def _on_writable(self) -> None:
        sock = self.sock
        assert sock is not None
        try:
            sent = sock.send(self.wbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            sent = len(self.wbuf)
        del self.wbuf[:sent]
        if not self.wbuf:
            self.loop.remove_writer(sock.fileno())
            self.writing = False

    # ---------------------------------------------------------------- budgets and exit

    def _schedule_cpu(self, delay: float) -> None:
        self.cpu_handle = self.loop.call_later(max(delay, 0.01), self._poll_cpu)

    def _read_cpu(self) -> float | None:
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _CLK_TCK
        except (OSError, IndexError, ValueError):
            return None

    def _charge_host_reading(self, seconds: float) -> None:
        """Charge the host's time reading frames (large, or past a run's first 64 KiB) to its CPU budget.

        Parsing and decoding a frame within the memory budget can still hold the host's loop
        for seconds (dense numbers parse at 13-35 ms a MiB), and a worker may send one such
        frame after another: without this, only the wall-clock ceiling would end it, while
        every other run on the host waited. A genuine program pays little: a frame's reading
        costs about what writing it cost the worker.
        """
        self.host_cpu += seconds
        if self.outcome is None and self.cpu_used + self.host_cpu >= self.config.cpu_s:
            self._cpu_exhausted()

    def _cpu_exhausted(self) -> None:
        host = f", {self.host_cpu:.1f} s of it the host reading the program's frames" if self.host_cpu >= 0.05 else ""
        self.settle("error", ("timeout", f"CPU budget exhausted ({self.config.cpu_s:g} s of CPU time{host})"))

    def _poll_cpu(self) -> None:
        if self.outcome is not None:
            return
        used = self._read_cpu()
        try:
            signals.pidfd_send_signal(self.pidfd, 0)  # read from the worker, not from a reused pid
        except ProcessLookupError:
            return  # it has exited: its end is being reported
        except OSError:
            pass  # not allowed to ask (not a sign of exit): keep the reading
        if used is not None:
            self.cpu_used = used
            if used + self.host_cpu >= self.config.cpu_s:
                self._cpu_exhausted()
                return
        # A reading refused while the worker lives (the host out of descriptors for a moment)
        # is tried again: giving up would leave the CPU budget unenforced for the rest of the run.
        self._schedule_cpu(min((self.config.cpu_s - self.cpu_used - self.host_cpu) / _NCPU, 0.25))

    def _on_exit(self, future: asyncio.Future[int | None]) -> None:
        self.exit_status = future.result()
        if self.outcome is None:
            # Wait for the channel to drain (a done frame may still be in
            # flight), but not forever: a leftover holder may keep it open.
            if self.sock_eof:
                self._settle_exit()
            else:
                self.exit_timer = self.loop.call_later(_EXIT_GRACE_S, self._settle_exit)

    def _check_eof(self) -> None:
        if self.sock_eof and self.exit_future is not None and self.exit_future.done() and self.outcome is None:
            # The future's _on_exit callback may not have run yet: read the status here.
            self.exit_status = self.exit_future.result()
            self._settle_exit()
        if self.eof_waiter is not None and self.sock_eof and self.out_eof and not self.eof_waiter.done():
            self.eof_waiter.set_result(None)

    def _settle_exit(self) -> None:
        if self.outcome is not None:
            return
        status = self.exit_status
        failure = self.zygote.failures.pop(self.run_id, None) if self.zygote is not None else None
        if failure is not None:  # the zygote had no worker to give this run
            self.spawn_errno = failure[1]
            self.settle("error", ("worker-exit", failure[0]))
        elif status is None and self.kernel_reaps and self.pidfd >= 0:
            self.settle("error", ("worker-exit", "the worker exited before completing (its status is unreadable)"))
        elif status is None:
            self.settle("error", ("worker-exit", "the zygote exited before the worker completed"))
        elif os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            name = signals.Signals(sig).name if sig in signals.Signals._value2member_map_ else str(sig)
            if sig == signals.SIGXCPU or (sig == signals.SIGKILL and self.cpu_used >= self.config.cpu_s):
                self._cpu_exhausted()
            elif sig == signals.SIGKILL and self.cgroup is not None and self.cgroup.oom_kills() > self.cgroup.oom_base:
                self.settle("error", ("memory-limit", f"memory limit exceeded ({self.config.memory_mb} MiB)"))
            else:
                self.settle("error", ("worker-exit", f"worker killed by signal {name} before completing"))
        else:
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
            self.settle("error", ("worker-exit", f"worker exited with code {code} before completing"))

    # ---------------------------------------------------------------- teardown

    async def _teardown(self, zygote: _Zygote) -> None:
        try:
            # Nothing outlives the run: the binding calls still running are cancelled
            # (awaited below, before the run resolves; their replies are dropped).
            bindings = self._quiesce()
            await asyncio.sleep(0)  # let callbacks queued by the winner run first
            self._kill(zygote)
            # (Where the kernel reaps, the zygote keeps no record of its workers:
            # _on_spawned kills this one as soon as its pidfd arrives.)
            # Reap: the status comes once the worker is reaped, from the zygote after
            # its waitpid or, where the kernel reaps, from the pidfd. The leader's exit
            # is most of a run's teardown; nothing else runs on this loop before it,
            # so the worker often has this CPU to itself.
            if self.exit_future is not None:
                await _until(self.exit_future, 10.0)
            # Then the cgroup sweep, for anything that left the process group,
            # before the drain waits on descriptors such a process could hold.
            if self.cgroup is not None:
                self.cgroup_empty = self.cgroup.kill_all() == 0
            # Drain both channels to EOF (bounded: an escaped holder may keep one open).
            if not (self.sock_eof and self.out_eof):
                self.eof_waiter = self.loop.create_future()
                await _until(self.eof_waiter, _DRAIN_GRACE_S)
            if bindings:
                await asyncio.gather(*bindings, return_exceptions=True)
        finally:
            self._end(zygote)

    def _quiesce(self) -> list[asyncio.Future[Any]]:
        """Stop the run's clocks, timers and listener, cancel its binding calls; return those calls."""
        kind, _ = self.outcome or ("abort", None)
        try:
            self.controller.abort(f"code run settled ({kind})")
        except Exception as error:  # a binding's abort listener: its error, not the teardown's
            self.loop.call_exception_handler({"message": "an abort listener of a code run raised", "exception": error})
        if self.clock is not None:
            self.clock.stop()
        if self.cpu_handle is not None:
            self.cpu_handle.cancel()
        if self.exit_timer is not None:
            self.exit_timer.cancel()
        if self.remove_listener is not None:
            self.remove_listener()
            self.remove_listener = None
        bindings = list(self.tasks.values())
        for task in bindings:
            task.cancel()
        return bindings

    def _end(self, zygote: _Zygote, *, now: bool = False) -> None:
        """The synchronous end of every teardown: kill if not yet done, close, forget, finish.

        Also what is left of a teardown cancelled before it could run (a task
        cancelled before its first step never enters its ``finally``), and then
        ``now``: the run directory goes at once, as no later loop turn may come.
        """
        if self.finished.done():
            return
        try:
            if not self.killed:
                self._kill(zygote)
            self._quiesce()
        finally:
            self._close(remove_dir_now=now)
            zygote.forget(self.run_id)
            self.finished.set_result(None)

    def _kill(self, zygote: _Zygote) -> None:
        # The leader through its pidfd (race-free), or through the zygote when
        # there is none yet; the zygote kills the leader's process group when it
        # reaps it (the leader's pid still reserves the group id then), and the
        # cgroup catches anything that left it.
        self.killed = True
        if self.pidfd >= 0:
            descriptors.kill(self.pidfd)
        elif not self.kernel_reaps:
            zygote.kill(self.run_id)

    def _close(self, *, remove_dir_now: bool = False) -> None:
        self.wbuf = bytearray()  # undelivered replies: the worker is gone
        if self.sock is not None:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.sock.fileno())
            if self.writing:
                with contextlib.suppress(Exception):
                    self.loop.remove_writer(self.sock.fileno())
            self.sock.close()
            self.sock = None
        if self.out_fd >= 0:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.out_fd)
            os.close(self.out_fd)
            self.out_fd = -1
        if self.pidfd >= 0:
            if self.watching_exit:
                self.loop.remove_reader(self.pidfd)
                self.watching_exit = False
            os.close(self.pidfd)
            self.pidfd = -1
        if self.cgroup is not None and self.owner._cgroups is not None:
            if not self.cgroup_empty:  # nothing can join an empty group but through the host
                self.cgroup.kill_all()
            self.owner._cgroups.release(self.cgroup)
            self.cgroup = None
        if self.cwd is not None:
            # Removed just after the result is delivered, not before: on a disk
            # file system even an empty directory's rmdir costs about 0.7 ms, and
            # the worker (the only thing that could write there) is gone. At once
            # only when no later loop turn may come (a teardown that never ran).
            if remove_dir_now:
                self.owner._remove_run_dir(self.cwd)
            else:
                self.owner._remove_run_dir_soon(self.cwd)
            self.cwd = None

    def _finish(self) -> CodeRunResult:
        return _assemble(self.ledger, self.outcome or ("error", ("abort", "run ended")))


def _shown(name: str) -> str:
    """A peer-supplied name as echoed back: at most ``_NAME_SHOWN`` characters, the cut marked."""
    if len(name) <= _NAME_SHOWN:
        return name
    return f"{name[:_NAME_SHOWN]}... [{len(name) - _NAME_SHOWN} more characters]"


def _assemble(ledger: wire.Ledger, outcome: tuple[str, Any]) -> CodeRunResult:
    """The result of an outcome through the output ledger (exact UTF-8 JSON bytes)."""
    kind, payload = outcome
    if kind == "value":
        value, size = payload
        if ledger.fits(size):
            return CodeRunResult(logs=tuple(ledger.logs), value=value, has_value=True)
    elif kind in ("novalue", "probe"):
        if not ledger.overflow:
            return CodeRunResult(logs=tuple(ledger.logs))
    elif kind == "error":
        error_kind, message = payload
        if ledger.fits(wire.json_str_size(message)):
            return CodeRunResult(logs=tuple(ledger.logs), error=CodeRunError(error_kind, message))
    elif kind == "abort" and ledger.fits(wire.json_str_size(str(payload))):
        return CodeRunResult(logs=tuple(ledger.logs), error=CodeRunError("abort", str(payload)))
    custom = payload if kind == "limit" and isinstance(payload, str) else None
    logs, message = ledger.fitted(custom or ledger.limit_message())
    return CodeRunResult(logs=tuple(logs), error=CodeRunError("output-limit", message))


def _end_if_abandoned(run: _Run, zygote: _Zygote, task: asyncio.Task[None]) -> None:
    """A pre-spawned worker's task cancelled before its first step: no teardown ever started."""
    if task.cancelled() and not run.assigned and run.teardown is None:
        run.settle("error", ("abort", "runtime disposed"))
        run._end(zygote, now=True)


# --------------------------------------------------------------------------- the runtime


class PythonCodeRuntime:
    """The Python ``CodeRuntime``: a fresh, locked-down worker per run, forked by a zygote."""

    def __init__(self, config: CodeRuntimeConfig | None = None) -> None:
        self.config = config if config is not None else CodeRuntimeConfig()
        self._ids = itertools.count(1)
        self._live: set[_Run] = set()
        self._runs: set[_Run] = set()  # every spawned worker's run until its teardown ends
        self._disposed = False
        self._zygote: _Zygote | None = None
        self._zygote_lock: asyncio.Lock | None = None
        self._level = -1
        self._descriptor: str | None = None
        self._cgroups: iso.CgroupPool | None = None
        self._probe_only = False
        self._failure: str | None = None
        self._warm: collections.deque[_Run] = collections.deque()
        self._warm_tasks: set[asyncio.Task[None]] = set()
        # Per-run directories (L0-L2) not yet removed, and the zygotes not yet reaped:
        # ended at collection or exit if this runtime is dropped without aclose.
        self._abandoned = _Abandoned()
        self._run_dirs = self._abandoned.dirs
        weakref.finalize(self, self._abandoned.end)
        self._starting: _Zygote | None = None  # a zygote being started (aclose aborts it)
        self._probing: _Run | None = None  # its probe worker
        # Let the kernel reap workers where it reports their status (L2+); tests
        # turn it off to keep the zygote's own reaping covered at every level.
        self._let_kernel_reap = True

    @property
    def language(self) -> str:
        """Always ``"python"``."""
        return "python"

    @property
    def isolation(self) -> str:
        """The isolation in force: worker-reported steps plus the host-verified ``/proc`` suffix.

        Detected on first use by actually starting a worker: blocking, once,
        unless :meth:`start` or a run has done it already.
        """
        if self._descriptor is None and self._failure is None:
            self._detect_blocking()
        if self._descriptor is None:
            return f"unavailable ({self._failure})"
        return self._descriptor

    async def start(self) -> str:
        """Start the zygote and its first worker now, and return :attr:`isolation`.

        Optional: the first :meth:`run` does the same. Awaiting it at start-up
        takes the zygote's start (a few hundred milliseconds, and the once-per-host
        detection of the level) off the first run, and reads ``isolation``
        without blocking the event loop. Where no level works, the descriptor
        says ``unavailable (...)`` and runs report ``worker-exit``. Idempotent;
        raises :class:`RuntimeDisposedError` once the runtime is disposed.
        """
        if self._disposed:
            raise RuntimeDisposedError("the code runtime is disposed")
        with contextlib.suppress(ZygoteError):
            await self._ensure_zygote()
        if self._disposed:
            raise RuntimeDisposedError("the code runtime was disposed while starting")
        return self.isolation

    @property
    def level(self) -> int:
        """The isolation level in force (0-3), detecting it if needed; -1 where none could start."""
        if self._level < 0:
            _ = self.isolation
        return self._level

    def _detect_blocking(self) -> None:
        # Runs a private event loop in a thread so it works inside or outside
        # a running loop; its zygote is closed before the thread ends.
        def target() -> None:
            probe = PythonCodeRuntime(self.config)
            probe._probe_only = True

            async def go() -> None:
                try:
                    await probe._ensure_zygote()
                finally:
                    await probe.aclose()

            with contextlib.suppress(ZygoteError):
                asyncio.run(go())
            self._descriptor, self._level, self._failure = probe._descriptor, probe._level, probe._failure

        thread = threading.Thread(target=target, name="dsh-isolation-detect")
        thread.start()
        thread.join()

    async def _ensure_zygote(self) -> _Zygote:
        zygote = self._zygote
        if zygote is not None and zygote.alive:
            return zygote
        if self._zygote_lock is None:
            self._zygote_lock = asyncio.Lock()
        async with self._zygote_lock:
            zygote = self._zygote
            if zygote is not None and zygote.alive:
                return zygote
            if zygote is not None:
                await zygote.close()
                self._zygote = None
            key = (self.config.isolation, self.config.preload)
            with _DETECT_LOCK:
                known = _DETECTED.get(key)
            levels = [known] if known is not None else iso.candidate_levels(self.config.isolation)
            reasons: list[str] = []
            for level in levels:
                if self._disposed:
                    raise ZygoteError("runtime disposed")
                try:
                    zygote = await self._start_level(level)
                except ZygoteError as error:
                    reasons.append(f"L{level}: {error}")
                    if error.fatal:
                        self._failure = str(error)
                        raise
                    continue
                with _DETECT_LOCK:
                    _DETECTED[key] = level
                if self._disposed:  # disposed while it started (aclose waits for this lock)
                    await zygote.close()
                    raise ZygoteError("runtime disposed")
                self._zygote = zygote
                self._refill(zygote)
                return zygote
            self._failure = "no isolation level works here: " + "; ".join(reasons)
            raise ZygoteError(self._failure)

    async def _start_level(self, level: int) -> _Zygote:
        try:
            plan = iso.plan_for(level, self.config.preload)
        except OSError as error:
            raise ZygoteError(str(error)) from None
        loop = asyncio.get_running_loop()
        zygote = _Zygote(plan, loop, self._abandoned)
        self._starting = zygote
        try:
            await zygote.start(self.config, self._let_kernel_reap)
            self._level = level
            if level >= 1 and self._cgroups is None and iso.CgroupPool.available():
                _sweep_stale_cgroups_once()
                # A serial, not id(self): a collected runtime's id is soon another's, and its
                # finalizer, running late, would remove (and empty) the newer one's groups.
                self._cgroups = iso.CgroupPool(f"dsh-{os.getpid()}-{next(_CGROUP_POOLS):x}", self.config.memory_mb)
                self._abandoned.cgroups.append(self._cgroups)
            # Probe: one worker that locks down, reports ready and is verified. It has
            # no program, so no wall clock: it gets the start-up bound instead.
            probe = self._probing = _Run(self)
            saved, self._probe_only = self._probe_only, True
            late = ("worker-exit", "the probe worker did not report ready in time")
            expiry = loop.call_later(_PROBE_READY_TIMEOUT_S, probe.settle, "error", late)
            try:
                try:
                    probe._spawn(zygote)
                except OSError as error:  # the host's own resources: a lower level fares no better
                    raise ZygoteError(f"could not start a probe worker: {error}", fatal=True) from None
                result = await probe.finish_run(zygote)
            finally:
                expiry.cancel()
                self._probe_only = saved
                self._probing = None
            if result.error is not None or not probe.descriptor:
                message = result.error.message if result.error else "no descriptor"
                # A fork refused for want of processes or descriptors is this moment, not the level.
                raise ZygoteError(f"probe worker failed: {message}", fatal=probe.spawn_errno in _RESOURCE_ERRNOS)
        except BaseException:
            # Failed, cancelled or disposed mid-start: nothing started here outlives it.
            if self._descriptor is None:
                self._level = -1  # no level is in force (it was set for the probe's check)
            await asyncio.shield(zygote.close())
            raise
        finally:
            self._starting = None
        self._descriptor = probe.descriptor
        return zygote

    async def run(
        self,
        program: str,
        bindings: Sequence[BindingNamespace],
        signal: AbortSignal | None = None,
    ) -> CodeRunResult:
        """Run ``program`` in a fresh worker; raise only on misuse."""
        if self._disposed:
            raise RuntimeDisposedError("the code runtime is disposed")
        if not isinstance(program, str):
            raise TypeError("program must be a str")
        namespaces = validate_bindings(bindings)
        task = asyncio.current_task()
        cancellations = task.cancelling() if task is not None else 0
        ledger = wire.Ledger(self.config.max_output_bytes)
        if signal is not None and signal.aborted:
            return _assemble(ledger, ("abort", str(signal.reason)))
        warned: list[str] = []
        try:
            code = programs.build(program, warned)
        except SyntaxError as error:
            return _assemble(ledger, ("error", ("exception", programs.format_syntax_error(error, program))))
        except (ValueError, RecursionError, MemoryError) as error:  # e.g. NUL bytes, absurd nesting
            return _assemble(ledger, ("error", ("exception", f"{type(error).__name__}: {error}")))
        try:
            zygote = await self._ensure_zygote()
        except ZygoteError as error:
            if self._disposed:
                return _assemble(ledger, ("error", ("abort", "runtime disposed")))
            return _assemble(ledger, ("error", ("worker-exit", str(error))))
        if self._disposed:  # disposed while this run was starting: it is aborted, not misuse
            return _assemble(ledger, ("error", ("abort", "runtime disposed")))
        run = self._take_warm()
        if run is None:
            run = _Run(self)
            try:
                run._spawn(zygote)
            except OSError as error:  # e.g. out of descriptors: an outcome, not misuse
                return _assemble(ledger, ("error", ("worker-exit", f"could not start a worker: {error}")))
        run.assign(program, namespaces, signal, (code, warned))
        self._live.add(run)
        _LIVE_RUNS.add(run)
        try:
            return await run.finish_run(zygote)
        finally:
            self._live.discard(run)
            _LIVE_RUNS.discard(run)
            # The next worker is prepared after this result is delivered, not before;
            # not after a run cancelled meanwhile: the loop may be shutting down (asyncio.run
            # cancels every task), and a worker spawned then would be nobody's to end. (A
            # timeout cancels too: the next run that ends normally refills the pool.)
            # (Nor when the coroutine is closed with its loop gone: the run's loop, not
            # whichever loop runs the collector then.)
            if (task is None or task.cancelling() <= cancellations) and not run.loop.is_closed():
                run.loop.call_soon(self._refill, zygote)

    def _remove_run_dir_soon(self, path: str) -> None:
        self._run_dirs.add(path)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a teardown finalised outside its loop: no later turn will come
            self._remove_run_dir(path)
            return
        loop.call_soon(self._remove_run_dir, path)

    def _remove_run_dir(self, path: str) -> None:
        if path not in self._run_dirs:
            return  # aclose removed it already
        self._run_dirs.discard(path)
        try:
            os.rmdir(path)  # the common case: the program left nothing behind
        except OSError:  # not empty (or replaced by a link): a walk that follows no link
            shutil.rmtree(path, ignore_errors=True)

    def _take_warm(self) -> _Run | None:
        """A pre-spawned worker for the next run: one that reported ready if any."""
        warm = self._warm
        for run in [run for run in warm if run.outcome is not None]:
            warm.remove(run)  # died unused (its hold_warm task tears it down)
        for run in warm:
            if run.ready:
                warm.remove(run)
                return run
        return warm.popleft() if warm else None

    def _refill(self, zygote: _Zygote) -> None:
        # Keep _WARM_WORKERS pre-spawned workers: spawned, locked down, verified
        # and (from L1, where cgroups can be made) in their cgroup, waiting for a program. Each serves one run
        # only; two let back-to-back runs find one ready while the next prepares.
        if self._disposed or self._probe_only:
            return
        if zygote is not self._zygote or not zygote.alive:
            return
        loop = asyncio.get_running_loop()
        for run in [run for run in self._warm if run.outcome is not None]:
            self._warm.remove(run)  # ended unused (its hold_warm task tears it down)
        while len(self._warm) < _WARM_WORKERS:
            warm = _Run(self)
            try:
                warm._spawn(zygote)
            except OSError:
                return  # e.g. out of descriptors: the next run spawns its own, and reports why not
            self._warm.append(warm)
            task = loop.create_task(warm.hold_warm(zygote))
            self._warm_tasks.add(task)
            task.add_done_callback(self._warm_tasks.discard)
            task.add_done_callback(functools.partial(_end_if_abandoned, warm, zygote))

    async def aclose(self) -> None:
        """Abort every live run ("runtime disposed"), await their workers, stop the zygote."""
        self._disposed = True
        warm, self._warm = list(self._warm), collections.deque()
        for run in warm:
            run.settle("error", ("abort", "runtime disposed"))
        live = list(self._live)
        for run in live:
            run.settle("error", ("abort", "runtime disposed"))
        for run in live:
            await asyncio.shield(run.finished)
        # Pre-spawned workers' lifecycles end once their run settled (all did).
        if self._warm_tasks:
            await asyncio.gather(*list(self._warm_tasks), return_exceptions=True)
        if self._starting is not None:  # a start in progress fails now instead of finishing
            self._starting.abort_start("runtime disposed")
        if self._probing is not None:
            self._probing.settle("error", ("abort", "runtime disposed"))
        if self._zygote_lock is not None:
            async with self._zygote_lock:
                pass  # the start in progress, if any, has closed what it started
        # Any other worker still being torn down (its task cancelled twice, say) ends before the zygote.
        pending = [run for run in self._runs if not run.finished.done()]
        for run in pending:
            run.settle("error", ("abort", "runtime disposed"))
            if run.zygote is not None:
                run._start_teardown(run.zygote)  # joins one in progress, or starts it for a run nothing drives
        if pending:
            await asyncio.gather(*(asyncio.shield(run.finished) for run in pending))
        if self._zygote is not None:
            await self._zygote.close()
            self._zygote = None
        if self._cgroups is not None:
            self._cgroups.close()
            with contextlib.suppress(ValueError):
                self._abandoned.cgroups.remove(self._cgroups)
            self._cgroups = None
        for path in list(self._run_dirs):
            self._remove_run_dir(path)

    async def __aenter__(self) -> PythonCodeRuntime:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
