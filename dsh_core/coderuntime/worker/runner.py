"""One run inside a freshly forked worker: lock down, then execute the program.

Standard library only. The protocol is on descriptor 3 (a stream socket);
descriptors 1 and 2 are a pipe the host reads as raw output. Nothing untrusted
is read before the lockdown for the configured level has been applied.
"""

from __future__ import annotations

import asyncio
import binascii
import builtins
import collections
import contextlib
import errno
import linecache
import marshal
import os
import select
import sys
import threading
import time
import traceback
import types
from collections.abc import Coroutine
from typing import Any, TypeVar

from . import lockdown, program, wire

__all__ = ["run_to_completion", "serve"]

T = TypeVar("T")

#: How long a wait in place polls for its reply before it sleeps. The host answers a trivial
#: call in tens of microseconds and a Code Mode tool call, through the whole pipeline, in about
#: 100-150; a worker asleep in select is then woken on an idle CPU, and on a virtual machine
#: that wake-up (an inter-processor interrupt, the CPU's exit from idle) can cost more than the
#: host's whole answer: a bare socket ping-pong between two processes took 67 us sleeping on
#: both sides and 19 us with one side polling. The polling is the program's own CPU time
#: (counted by its cpu_s budget), spent only while it has nothing else to do.
_POLL_S = 200e-6
#: After a reply that took longer than the poll, the next waits sleep at once: 1 after the
#: first such miss, doubling with each further one up to this many, so that a program calling
#: slow bindings polls in vain at most once in this many calls.
_MAX_POLL_SKIP = 64
#: The poll's clock, taken before the program runs: a program that replaces time.perf_counter
#: (a frozen clock, to test timing code) would otherwise make every wait poll to its end.
_clock = time.perf_counter


class _Channel:
    """Blocking, thread-safe frame writer on the protocol descriptor."""

    def __init__(self, fd: int, max_frame: int) -> None:
        self.fd = fd
        self.max_frame = max_frame
        self.lock = threading.Lock()

    def send(self, message: dict[str, object]) -> None:
        self.raw(wire.pack(message))

    def raw(self, data: bytes) -> None:
        with self.lock:
            try:
                sent = os.write(self.fd, data)  # one write for a frame that fits the socket buffer
                if sent < len(data):
                    view = memoryview(data)[sent:]
                    while view:
                        view = view[os.write(self.fd, view) :]
            except OSError:
                os._exit(0)  # the host is gone or closed the channel

    def read_frame(self) -> object:
        buffer = wire.FrameBuffer(self.max_frame)
        while True:
            data = os.read(self.fd, 1 << 16)
            if not data:
                os._exit(0)
            frames = buffer.feed(data)
            if frames:
                return wire.unpack_payload(frames[0])


class _Logs:
    """Ordered log capture streamed to the host, with the same ledger as the host.

    One entry per line written; a partial line (``print(..., end="")``) waits
    for the rest of its line, and is sent as an entry of its own when the
    stream is flushed (``flush=True``, ``sys.stdout.flush()``), when a console
    entry follows, or when the program ends: a flushed partial line survives
    a run that is then killed (timeout, abort, memory).
    """

    def __init__(self, channel: _Channel, cap: int) -> None:
        self.channel = channel
        self.ledger = wire.Ledger(cap)
        self.partial: list[str] = []
        self.lock = threading.RLock()

    def emit(self, text: str) -> None:
        text = wire.join_pairs(text)  # as the host records it, so both ledgers count the same bytes
        with self.lock:
            if self.ledger.add(text):
                self.channel.send({"t": "log", "s": text})
                return
            # Over budget: send the fitting prefix (none past the entry cap), say so, and stop here.
            ledger = self.ledger
            room = ledger.cap - ledger.used - (1 if ledger.logs else 0)
            prefix = "" if ledger.counted_out else wire.truncate_json_str(text, room)
            if prefix:
                self.channel.send({"t": "log", "s": prefix})
            self.channel.send({"t": "output-limit", "entries": True} if ledger.counted_out else {"t": "output-limit"})
            os._exit(0)

    def write(self, text: str) -> None:
        with self.lock:
            lines = text.split("\n")
            if len(lines) == 1:
                self.partial.append(text)
                return
            first = "".join(self.partial) + lines[0]
            self.partial = [lines[-1]] if lines[-1] else []
            self.emit(first)
            for line in lines[1:-1]:
                self.emit(line)

    def flush_partial(self) -> None:
        with self.lock:
            if self.partial:
                text = "".join(self.partial)
                self.partial = []
                self.emit(text)


class _Stream:
    """``sys.stdout``/``sys.stderr`` replacement feeding the ordered log."""

    encoding = "utf-8"
    errors = "strict"

    def __init__(self, logs: _Logs, name: str) -> None:
        self._logs = logs
        self.name = name

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._logs.write(text)
        return len(text)

    def writelines(self, lines: list[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._logs.flush_partial()  # the pending partial line becomes an entry now

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False


class _Console:
    """``console.log/info/warn/error/debug``: one log entry per call."""

    __slots__ = ("_logs",)

    def __init__(self, logs: _Logs) -> None:
        self._logs = logs

    def _entry(self, args: tuple[object, ...]) -> None:
        self._logs.flush_partial()
        self._logs.emit(" ".join(a if type(a) is str else str(a) for a in args))

    def log(self, *args: object) -> None:
        """Log the arguments joined by spaces."""
        self._entry(args)

    info = warn = error = debug = log

    def __repr__(self) -> str:
        return "<console>"


class _ImportGuard:
    """Refuse imports of modules that were not preloaded, with a clear message."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:
        raise ModuleNotFoundError(
            f"module {name!r} is not available in the code runtime; "
            f"a deployment can allow it with code_runtime.preload",
            name=name,
        )

    @staticmethod
    def find_module(name: str, path: object = None) -> None:
        _ImportGuard.find_spec(name)


class CodecGuard:
    """A codec search function behind ``encodings``': an existing codec that was not preloaded is named as such.

    Without it, a codec whose module the import check refused reads as
    ``unknown encoding``. ``available`` holds the codec modules of the
    interpreter's ``encodings`` package (listed once, in the zygote).
    """

    __slots__ = ("available",)

    def __init__(self, available: frozenset[str]) -> None:
        self.available = available

    @classmethod
    def install(cls) -> None:
        """List the interpreter's codec modules and register the guard (in the zygote, before any fork)."""
        import codecs
        import encodings

        names: set[str] = set()
        for directory in encodings.__path__:
            with contextlib.suppress(OSError):
                names.update(name.partition(".")[0] for name in os.listdir(directory) if name.endswith((".py", ".pyc")))
        codecs.register(cls(frozenset(names - {"__init__", "aliases", "mbcs", "oem"})))

    def __call__(self, name: str) -> None:  # None: unknown here too
        import encodings
        from encodings.aliases import aliases

        normalized = encodings.normalize_encoding(name)
        for module in (aliases.get(normalized), aliases.get(normalized.replace(".", "_")), normalized):
            if module in self.available and f"encodings.{module}" not in sys.modules:
                raise LookupError(
                    f"encoding {name!r} is not available in the code runtime; "
                    f"a deployment can allow it with code_runtime.preload (module 'encodings.{module}')"
                )


def _make_error_class(name: str, member: str) -> type[Exception]:
    cls = types.new_class(name, (Exception,))
    cls.__module__ = "__main__"  # a global of the program: shown as a script's own class is
    setattr(cls, member, None)
    return cls


def _missing(error: tuple[type[Exception], str] | None, lookup: type[LookupError | AttributeError]) -> type[Exception]:
    """The class raised for an unknown binding name: the declared error class and ``lookup`` at once."""
    if error is None:
        return lookup
    cls = error[0]

    def body(namespace: dict[str, Any]) -> None:
        namespace["__str__"] = BaseException.__str__  # not KeyError's quoted repr

    both = types.new_class(cls.__name__, (cls, lookup), exec_body=body)
    both.__module__, both.__qualname__ = cls.__module__, cls.__qualname__  # reads as the declared class
    return both


#: At most this many of a namespace's names are listed when a program asks for one it lacks.
_KNOWN_SHOWN = 40


def _unknown(
    cls: type[Exception], error: tuple[type[Exception], str] | None, global_name: str, name: str, known: list[str]
) -> Exception:
    # The names it has: a program (or the model writing it) that guessed a name, or asked for a
    # tool its agent does not see, learns what it may call instead.
    shown = ", ".join(known[:_KNOWN_SHOWN]) or "none"
    if len(known) > _KNOWN_SHOWN:
        shown += f", and {len(known) - _KNOWN_SHOWN} more"
    instance = cls(f"{global_name} has no binding {name!r} (it has: {shown})")
    if error is not None:
        setattr(instance, error[1], name)
    return instance


class _Bridge:
    """Binding calls from the program to the host and their replies."""

    def __init__(self, channel: _Channel, loop: asyncio.AbstractEventLoop) -> None:
        self.channel = channel
        self.loop = loop
        self.next_id = 0
        self.pending: dict[int, tuple[asyncio.Future[object], str, tuple[type[Exception], str] | None]] = {}
        self.frames = wire.FrameBuffer(1 << 62)  # replies come from the trusted host
        # The loop's self-pipe: threads (call_soon_threadsafe) and asyncio signal
        # handlers wake the loop through it, so a wait in place watches it too.
        self_pipe = getattr(loop, "_ssock", None)
        self.wakeup = self_pipe.fileno() if self_pipe is not None else -1
        selector = getattr(loop, "_selector", None)
        self.selector_map = selector.get_map() if selector is not None else None
        # Whether the host has a CPU to spare for a polling wait (it says so in the start frame
        # and in every reply: not while as many runs are live as there are CPUs).
        self.poll = False
        # Seconds this run may still spend polling (a share of its cpu_s, from the start frame):
        # polling is CPU time the program's budget pays for, so it may not take much of it.
        self.poll_left = 0.0
        self.poll_misses = 0  # consecutive waits whose reply came after the poll
        self.polls_to_skip = 0

    def make_namespace(self, global_name: str, names: list[str], error: tuple[type[Exception], str] | None) -> object:
        table = {name: self._make_function(global_name, name, error) for name in names}
        known = sorted(table)
        # An unknown name raises the declared error class (as the SDK promises for an unknown
        # call), as an AttributeError or KeyError too, so hasattr() and getattr() defaults work.
        missing_attribute = _missing(error, AttributeError)
        missing_key = _missing(error, KeyError)

        def __getattr__(self: object, attr: str) -> object:
            try:
                return table[attr]
            except KeyError:
                raise _unknown(missing_attribute, error, global_name, attr, known) from None

        def __getitem__(self: object, key: str) -> object:
            try:
                return table[key]
            except (KeyError, TypeError):
                if error is None or type(key) is not str:
                    raise KeyError(key) from None
                raise _unknown(missing_key, error, global_name, key, known) from None

        def __dir__(self: object) -> list[str]:
            return sorted(table)

        def __contains__(self: object, key: object) -> bool:
            return key in table

        def __repr__(self: object) -> str:
            return f"<bindings {global_name}: {', '.join(sorted(table))}>"

        namespace = {
            "__slots__": (),
            "__getattr__": __getattr__,
            "__getitem__": __getitem__,
            "__dir__": __dir__,
            "__contains__": __contains__,
            "__repr__": __repr__,
        }
        cls = type("Bindings", (), namespace)
        return cls()

    def _fail(self, error: tuple[type[Exception], str] | None, name: str, message: str) -> Exception:
        if error is None:
            return Exception(message)
        cls, member = error
        instance = cls(message)
        setattr(instance, member, name)
        return instance

    def _make_function(self, global_name: str, name: str, error: tuple[type[Exception], str] | None) -> object:
        bridge = self

        async def binding(*args: object, **kwargs: object) -> object:
            if len(args) > 1 or (args and kwargs):
                # Named as the program must write it: a name like "my-tool" only by subscript.
                spelled = f".{name}" if name.isidentifier() else f"[{name!r}]"
                raise TypeError(f"{global_name}{spelled}() takes one dict of arguments or keywords")
            argument = args[0] if args else dict(kwargs)
            try:
                tokens = wire.encode(argument)
                frame = wire.pack({"t": "call", "id": bridge.next_id + 1, "g": global_name, "n": name, "a": tokens})
            except wire.WireError as reason:
                raise bridge._fail(error, name, f"binding arguments must be lossless JSON: {reason}") from None
            bridge.next_id += 1
            call_id = bridge.next_id
            if len(frame) - 4 > bridge.channel.max_frame:
                raise bridge._fail(
                    error, name, f"binding arguments exceed the {bridge.channel.max_frame}-byte frame cap"
                )
            alone = bridge.alone()
            future: asyncio.Future[object] = bridge.loop.create_future()
            bridge.pending[call_id] = (future, name, error)
            try:
                # Written at once, even when other calls are pending: the host starts on
                # it while this worker goes on (deferring frames to the end of the loop
                # turn, to batch them, measured 2x slower with ten calls in flight).
                bridge.channel.raw(frame)
                # Nothing else in the program could run meanwhile: wait for the
                # reply right here rather than through two event-loop turns.
                if alone and bridge.wait_in_place(future):
                    return future.result()
                return await future
            except GeneratorExit:
                # Closed, not cancelled: maybe by the garbage collector, even while this thread
                # holds the channel's lock, where sending would deadlock. The run's end stops it.
                raise
            except BaseException:
                # The program stopped waiting before the reply came (its await was cancelled:
                # asyncio.wait_for, asyncio.timeout, task.cancel()): the host cancels the call.
                # Once per call: a reply that arrived already took the entry out.
                if bridge.pending.pop(call_id, None) is not None:
                    bridge.channel.send({"t": "cancel", "id": call_id})
                raise
            finally:
                bridge.pending.pop(call_id, None)

        binding.__name__ = name if name.isidentifier() else "binding"
        binding.__qualname__ = f"{global_name}.{name}"
        return binding

    def alone(self) -> bool:
        """True when a call made now would be the only thing the program waits for.

        That is: no other binding call outstanding, no callback ready and no
        timer pending on the program's loop, no descriptor watched by it but its
        self-pipe and the channel, and the caller is that loop's thread. A wait
        for the reply in place (:meth:`wait_in_place`) then delays nothing.
        """
        loop = self.loop
        watched = self.selector_map
        return (
            not self.pending
            and not getattr(loop, "_ready", True)
            and not getattr(loop, "_scheduled", True)
            and self.wakeup >= 0
            and watched is not None
            and len(watched) <= 2
            and threading.current_thread() is threading.main_thread()
            and asyncio.get_running_loop() is loop
        )

    def wait_in_place(self, future: asyncio.Future[object]) -> bool:
        """Read replies until ``future`` is done; False if the loop was woken first.

        A wake-up of the loop (a thread's callback, an asyncio signal handler)
        means something else may now run: the caller then awaits the future
        through the loop instead. An exception raised by a plain signal handler
        during the wait surfaces from the call, as from any blocking call.
        """
        fd, wakeup = self.channel.fd, self.wakeup
        watched = [fd, wakeup]
        polling = self.poll and self.poll_left > 0.0 and not self.polls_to_skip
        if polling:
            started = _clock()
            deadline = started + _POLL_S
        elif self.polls_to_skip:
            self.polls_to_skip -= 1
        while not future.done():
            if polling:
                ready, _, _ = select.select(watched, [], [], 0.0)
                if not ready:
                    now = _clock()
                    if now < deadline:
                        continue
                    # The reply is late (a binding doing real work): sleep, and poll less from now on.
                    polling = False
                    self.poll_left -= now - started
                    self.poll_misses = min(2 * self.poll_misses or 1, _MAX_POLL_SKIP)
                    self.polls_to_skip = self.poll_misses
                    continue
            else:
                ready, _, _ = select.select(watched, [], [])
            if fd in ready:
                self.on_readable()  # readable: does not block
            if wakeup in ready:
                break
        if polling:  # the wait ended while polling
            self.poll_left -= _clock() - started
            if future.done():  # its reply came within the poll: not a partial frame, nor a wake-up
                self.poll_misses = 0
        return future.done()

    def on_readable(self) -> None:
        try:
            # 64 KiB: below malloc's mmap threshold (a 1 MiB read maps and
            # unmaps a buffer per reply); a larger reply takes a few callbacks.
            data = os.read(self.channel.fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            os._exit(0)  # the host closed the channel: the run is over
        for payload in self.frames.feed(data):
            try:
                message = wire.unpack_payload(payload)
            except wire.WireError:
                continue
            if type(message) is not dict or message.get("t") != "reply":
                continue
            self.poll = message.get("poll") is True
            entry = self.pending.pop(message.get("id"), None)  # type: ignore[arg-type]
            if entry is None:
                continue
            future, name, error = entry
            if future.done():
                continue
            if message.get("ok") is True:
                try:
                    future.set_result(wire.decode(message.get("v")))
                except wire.WireError:
                    future.set_exception(self._fail(error, name, "binding resolution must be lossless JSON"))
            else:
                text = message.get("m")
                future.set_exception(self._fail(error, name, text if type(text) is str else "binding failed"))


def _describe_self() -> str:
    uid = os.getuid()
    caps = "?"
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("CapEff:"):
                    caps = line.split()[1]
    except OSError:
        pass
    who = f"uid={uid}" + ("(root!)" if uid == 0 else "")
    return f"{who} caps:{'none' if caps.strip('0') == '' else caps}"


class Prepared:
    """A spare worker after the lockdown steps that do not need the run's descriptors."""

    def __init__(
        self, level: int, parts: list[str], loop: asyncio.AbstractEventLoop, config: dict[str, object]
    ) -> None:
        self.level = level
        self.parts = parts
        self.loop = loop
        self.config = config
        selector = getattr(loop, "_selector", None)
        self.keep_fds = [
            sock.fileno() for sock in (getattr(loop, "_ssock", None), getattr(loop, "_csock", None)) if sock is not None
        ] + ([selector.fileno()] if selector is not None else [])


def run_to_completion(loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` as a task on ``loop`` to its end: ``loop.run_until_complete``, minus a cold start.

    The task's first step runs at once, inside the loop's own ``run_forever``
    set-up and clean-up (running loop, thread, async-generator hooks), rather
    than from a first turn of the loop. A program that then has finished,
    and has left nothing scheduled, never starts the loop: in a fresh worker
    that machinery runs cold, and for ``return 1`` it cost about a quarter
    of the worker's time. In every other case (the task waits on something;
    the step scheduled a callback, a task or a timer; it stopped the loop)
    the loop goes on as ``run_until_complete`` would have gone on after its
    first turn, so what runs, in which order, and the outcome are the same.
    Where that first turn could have done more than run the step (a watched
    descriptor already ready, something already scheduled, debug mode, a
    loop class with its own ``run_forever``), it is ``run_until_complete``.
    """
    if not _steps_like_base_loop(loop):
        return loop.run_until_complete(coroutine)
    base: Any = loop
    base._check_closed()  # the errors run_until_complete raises, before anything runs
    base._check_running()
    if base._ready or base._scheduled or base._selector.select(0):  # level-triggered: a peek
        return loop.run_until_complete(coroutine)
    task = loop.create_task(coroutine)
    task._log_destroy_pending = False  # type: ignore[attr-defined]  # as run_until_complete does
    try:
        first_step = base._ready.popleft()  # the task's, alone (checked empty above)
        _run_forever_setup(base)
        try:
            first_step._run()
        finally:
            stopped = base._stopping
            _run_forever_cleanup(base)
        if stopped:  # the program called loop.stop(): run_forever ends after this turn
            if not task.done():
                raise RuntimeError("Event loop stopped before Future completed.")
            return task.result()
        if task.done() and not base._ready and not base._scheduled:
            return task.result()
        return loop.run_until_complete(task)
    except BaseException:
        # SystemExit or KeyboardInterrupt from the program, re-raised by the task:
        # retrieved, as run_until_complete does for its own task (no "never retrieved" log).
        if task.done() and not task.cancelled():
            task.exception()
        raise


def _steps_like_base_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` runs exactly BaseEventLoop's ``run_forever`` over a selector, debug off."""
    return (
        isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop)
        and type(loop).run_forever is asyncio.BaseEventLoop.run_forever
        and type(getattr(loop, "_ready", None)) is collections.deque
        and not loop.get_debug()
    )


def _run_forever_setup(loop: Any) -> None:
    # What BaseEventLoop.run_forever does before its first turn (its own method from 3.13).
    if hasattr(loop, "_run_forever_setup"):
        loop._run_forever_setup()
        return
    loop._old_agen_hooks = sys.get_asyncgen_hooks()
    loop._thread_id = threading.get_ident()
    sys.set_asyncgen_hooks(firstiter=loop._asyncgen_firstiter_hook, finalizer=loop._asyncgen_finalizer_hook)
    asyncio.events._set_running_loop(loop)


def _run_forever_cleanup(loop: Any) -> None:
    # What BaseEventLoop.run_forever does after its last turn (its own method from 3.13).
    if hasattr(loop, "_run_forever_cleanup"):
        loop._run_forever_cleanup()
        return
    loop._stopping = False
    loop._thread_id = None
    asyncio.events._set_running_loop(None)
    sys.set_asyncgen_hooks(*loop._old_agen_hooks)
    loop._old_agen_hooks = None


def prepare(config: dict[str, object], zygote: int) -> Prepared:
    """Lock down as far as possible before a run is assigned, and warm the code paths.

    Runs in a freshly forked spare: the pages touched here are copied from
    the zygote now, not while a program waits.
    """
    level = int(config["level"])  # type: ignore[call-overload]
    budgets = config["budgets"]
    assert isinstance(budgets, dict)
    # Its own process group, so the zygote's killpg reaches whatever it forks.
    # Not setsid(): a session leader may acquire a controlling terminal, and
    # its exit costs the kernel about 1.5 ms more (measured), inside every run.
    os.setpgid(0, 0)
    parts = [f"L{level}"]
    if level >= 3:
        parts.append("ns(" + ",".join(config["ns"]) + ")")  # type: ignore[arg-type]
        parts.append(lockdown.private_tmp())
        os.chdir("/tmp")
    else:
        parts.append("ns:host")
    if level >= 1:
        parts.append(lockdown.drop_bounding_set())
    if level >= 3:
        parts.append(lockdown.drop_uid())
    if level >= 1:
        parts.append(lockdown.set_pdeathsig(zygote))
        parts.append(lockdown.set_no_new_privs())
        parts.append(lockdown.apply_rlimits(int(budgets["memory_mb"]), float(budgets["cpu_s"])))
    parts.insert(1, _describe_self())
    loop = asyncio.new_event_loop()  # epoll + self-pipe: must exist before seccomp
    asyncio.set_event_loop(loop)
    _warm(loop)
    return Prepared(level, parts, loop, config)


def _warm(loop: asyncio.AbstractEventLoop) -> None:
    async def sample() -> object:
        await asyncio.sleep(0)
        return [1]

    code = program.build("x = 1\nreturn x")
    marshal.loads(binascii.a2b_base64(binascii.b2a_base64(marshal.dumps(code))))  # as a shipped program
    run_to_completion(loop, sample())
    wire.decode(wire.encode({"a": [1, 2.5, "x", None, True]}))
    wire.unpack_payload(wire.pack({"t": "log", "s": "x"})[4:])


def serve(fd: int, request: dict[str, object], prepared: Prepared) -> int:
    """Finish the lockdown, build the program's world, report ready, run the program, report done."""
    config = prepared.config
    level = prepared.level
    budgets = config["budgets"]
    assert isinstance(budgets, dict)
    parts = prepared.parts
    loop = prepared.loop
    if level < 3:
        os.chdir(str(request["cwd"]))
    if level >= 2 and lockdown.landlock_abi() > 0:
        parts.append(lockdown.apply_landlock(list(config["ro_paths"])))  # type: ignore[call-overload]
    channel = _Channel(fd, int(budgets["max_frame_bytes"]))
    sys.meta_path.insert(0, _ImportGuard)
    if level >= 2:
        parts.append(lockdown.apply_seccomp())
    # Everything that does not depend on the program is built now, while this
    # pre-spawned worker waits for a run, not after the program arrives.
    logs = _Logs(channel, int(budgets["max_output_bytes"]))
    sys.stdout = _Stream(logs, "<stdout>")
    sys.stderr = _Stream(logs, "<stderr>")
    bridge = _Bridge(channel, loop)
    loop.add_reader(fd, bridge.on_readable)  # serviced only once the program's loop runs
    safe_builtins = dict(builtins.__dict__)

    def _no_input(*_: object) -> str:
        raise EOFError("input() is not available in a program")

    safe_builtins["input"] = _no_input
    # What the site module would have added (the worker runs without it): exit() is sys.exit().
    safe_builtins["exit"] = safe_builtins["quit"] = sys.exit
    # The program is the main module, as a script is: ``if __name__ == "__main__":`` runs,
    # its classes belong to ``__main__``, and sys.modules["__main__"] holds its globals.
    main_module = types.ModuleType("__main__")
    env: dict[str, object] = main_module.__dict__
    env.update({"__builtins__": safe_builtins, "console": _Console(logs)})
    sys.modules["__main__"] = main_module
    asyncio.run = _run_refused_inside_the_program
    channel.send({"t": "ready", "d": " ".join(parts)})

    # ---- from here on, everything read is untrusted input for the program
    start = channel.read_frame()
    if type(start) is not dict or start.get("t") != "start":
        return 2
    source = start["p"]
    bridge.poll = start.get("poll") is True
    poll_s = start.get("poll_s")
    bridge.poll_left = float(poll_s) if isinstance(poll_s, (int, float)) else 0.0
    linecache.cache[program.FILENAME] = (len(source), None, source.splitlines(True), program.FILENAME)
    classes: dict[str, type[Exception]] = {}
    for global_name, names, class_name, member in start["ns"]:
        error = None
        if class_name is not None:
            if class_name not in classes:
                classes[class_name] = _make_error_class(class_name, member)
            error = (classes[class_name], member)
            env[class_name] = error[0]
        env[global_name] = bridge.make_namespace(global_name, names, error)
    outcome: dict[str, object]
    try:
        if "c" in start:
            # The host compiled the program already (to report syntax errors
            # without a worker); loading its code object skips a second compile.
            for text in start["w"]:
                sys.stderr.write(text)  # what compiling here would have printed
            code = marshal.loads(binascii.a2b_base64(start["c"]))
        else:
            code = program.build(source)
        exec(code, env)  # defines __dsh_main__ only
        main = env[program.MAIN]
        result = run_to_completion(loop, main())  # type: ignore[operator]
        logs.flush_partial()
        if result is None:
            outcome = {"t": "done"}
        else:
            value = result[0]
            try:
                tokens = wire.encode(value)
                size = wire.tokens_json_size(tokens)  # also refuses an int too long to write as text
            except wire.WireError as reason:
                message = f"program completion must be lossless JSON: {reason.describe('result')}"
                outcome = {"t": "done", "e": {"k": "invalid-output", "m": message}}
            else:
                outcome = {"t": "done", "v": tokens} if logs.ledger.fits(size) else {"t": "output-limit"}
    except BaseException as error:  # the program's own failure, reported as data
        try:
            logs.flush_partial()
            if isinstance(error, SystemExit) and _exits_with_success(error):
                outcome = {"t": "done"}  # sys.exit() or sys.exit(0): the program ended, as a script does
            else:
                kind = "memory-limit" if isinstance(error, MemoryError) else "exception"
                message = wire.join_pairs(_format(error) + _sandbox_note(error, level))
                if not logs.ledger.fits(wire.json_str_size(message)):
                    outcome = {"t": "output-limit"}
                else:
                    outcome = {"t": "done", "e": {"k": kind, "m": message}}
        except MemoryError:
            outcome = {"t": "done", "e": {"k": "memory-limit", "m": "MemoryError"}}
    frame = wire.pack(outcome)
    if len(frame) - 4 > channel.max_frame:
        frame = wire.pack({"t": "done", "e": {"k": "output-limit", "m": "completion exceeds the frame cap"}})
    channel.raw(frame)
    return 0


def _exits_with_success(error: SystemExit) -> bool:
    """Whether a script ending with ``error`` would exit with status 0 (``sys.exit()``, ``sys.exit(0)``)."""
    return error.code is None or (type(error.code) in (int, bool) and error.code == 0)


_asyncio_run = asyncio.run


def _run_refused_inside_the_program(main: Any, *, debug: bool | None = None) -> Any:
    """``asyncio.run``: refused in the program's own loop, with the fix; elsewhere (a thread) as usual."""
    if asyncio._get_running_loop() is None:
        return _asyncio_run(main, debug=debug)
    name = getattr(main, "__name__", None)
    if asyncio.iscoroutine(main):
        main.close()  # not awaited by design: no "never awaited" warning on top of this error
    call = f"{name}()" if isinstance(name, str) and name.isidentifier() else "main()"
    raise RuntimeError(
        "asyncio.run() cannot be called from a running event loop: the program already runs "
        f"inside one, so await {call} instead of asyncio.run({call})"
    )


_HERE = os.path.dirname(os.path.abspath(__file__))


def _sandbox_note(error: BaseException, level: int) -> str:
    """A line naming the sandbox when ``error`` (or one it was raised from) is the filter's ENOSYS.

    Python reports a refused ``open`` or ``socket`` as ``[Errno 38] Function not implemented``,
    which names neither dsh nor the fix. Empty below L2 (no filter) and for any other error.
    """
    if level < 2:
        return ""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen and len(seen) < 100:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSYS:  # the seccomp filter's refusal
            return (
                f"\n(dsh: the Code Mode sandbox, isolation L{level}, refuses this system call with ENOSYS: "
                "a program cannot open files, sockets or processes itself; it reaches them only "
                "through its tools, as await tools.NAME(...))"
            )
        current = current.__cause__ or current.__context__
    return ""


def _format(error: BaseException) -> str:
    """The traceback as the interpreter prints it for a script, without the runner's own frames.

    Chained exceptions and the members of exception groups included.
    """
    try:
        top = traceback.TracebackException(type(error), error, error.__traceback__)
        pending = [top]
        seen: set[int] = set()
        while pending:  # iterative: chained exceptions can be long
            exc = pending.pop()
            if id(exc) in seen:
                continue
            seen.add(id(exc))
            frames = [frame for frame in exc.stack if not frame.filename.startswith(_HERE)]
            # Frames before the program's first one are the event loop's plumbing.
            for index, frame in enumerate(frames):
                if frame.filename == program.FILENAME:
                    frames = frames[index:]
                    break
            exc.stack = traceback.StackSummary.from_list(frames)
            pending.extend(e for e in (exc.__cause__, exc.__context__) if e is not None)
            pending.extend(exc.exceptions or ())  # an exception group's members
        text = "".join(top.format())
    except Exception:
        try:
            text = f"{type(error).__name__}: {error}"
        except Exception:
            text = "program raised an unrenderable exception"
    return text.rstrip("\n")
