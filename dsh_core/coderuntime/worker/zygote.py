"""The zygote: a warm, single-threaded ``-I -S`` process that forks one worker per run.

Standard library only; started by the host as
``<sys.executable> -I -S .../worker/zygote.py <control-fd> <config-json>``
(inside bubblewrap at L3). It never runs user code itself: it preloads the
documented module set plus ``code_runtime.preload``, then loops on its
control socket (SOCK_SEQPACKET). The documented set is STDLIB_PRELOAD, the
helpers those modules import on first use (LAZY_HELPERS) and the common
codecs (PRELOADED_ENCODINGS); a worker names any other codec's module when a
program looks it up. Each ``spawn`` request carries two descriptors (the
run's protocol socket and its stdout/stderr pipe) as SCM_RIGHTS; a
pre-forked spare takes them, locks itself down and serves one run. The
zygote answers ``spawned`` with a pidfd of that worker, opened before the
worker could exit, so the host never names it by a pid that could be reused.

Who reaps depends on the level:

* Below L2 a program may fork, so the zygote reaps: it kills a dead leader's
  process group before the pid is released (no member of a finished run
  survives, no pid is reused under the host's feet) and reports the status.
* At L2 and above seccomp forbids new processes, so there is no group to
  sweep. Where the kernel reports an exited process's status through its
  pidfd (tried once at start-up), the zygote ignores ``SIGCHLD``: the kernel
  reaps each worker as it exits and the host reads the status itself. That
  takes the zygote (and its copy-on-write faults after every fork) off the
  end of every run.
"""

from __future__ import annotations

import array
import codecs
import contextlib
import errno
import importlib
import json
import os
import select
import signal
import socket
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load_package() -> None:
    # Load this directory as the private package ``_dsh_worker`` so the
    # worker modules never collide with names a program might import.
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_dsh_worker", os.path.join(_HERE, "__init__.py"), submodule_search_locations=[_HERE]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["_dsh_worker"] = module
    spec.loader.exec_module(module)


#: Standard-library modules every worker has (documented; importing anything
#: else needs ``code_runtime.preload``).
STDLIB_PRELOAD = (
    "abc",
    "array",
    "ast",
    "asyncio",
    "base64",
    "binascii",
    "bisect",
    "calendar",
    "cmath",
    "collections",
    "collections.abc",
    "colorsys",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "enum",
    "fnmatch",
    "fractions",
    "functools",
    "graphlib",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "keyword",
    "linecache",
    "math",
    "numbers",
    "operator",
    "pathlib",
    "pprint",
    "random",
    "re",
    "reprlib",
    "secrets",
    "shlex",
    "statistics",
    "string",
    "struct",
    "textwrap",
    "time",
    "traceback",
    "types",
    "typing",
    "unicodedata",
    "urllib.parse",
    "uuid",
    "weakref",
    "zlib",
)


#: Modules that those of STDLIB_PRELOAD import only when a common entry point is
#: first used (found by running each module's common entry points after the
#: preload and listing what ``sys.modules`` gained). Imported here, so a worker's
#: import check never refuses a module the program did not name.
LAZY_HELPERS = (
    "_strptime",  # datetime.datetime.strptime, time.strptime
    "concurrent.futures.thread",  # asyncio.to_thread, loop.run_in_executor (threads are allowed)
    "pwd",  # os.path.expanduser("~"), pathlib.Path.home(): a worker has no HOME
)

#: Codecs looked up (so imported and cached) here, for ``str.encode``, ``bytes.decode``,
#: ``codecs`` and text I/O in a worker: the common ones, each a few KiB in every
#: worker. Any other codec (``idna`` alone would cost 340 KiB, for ``stringprep``)
#: needs ``encodings.<name>`` in ``code_runtime.preload``; a worker's lookup says so.
PRELOADED_ENCODINGS = (
    "ascii",
    "latin_1",
    "utf_8_sig",
    "utf_16",
    "utf_16_le",
    "utf_16_be",
    "cp1252",
    "unicode_escape",
    "punycode",
    "hex_codec",
    "base64_codec",
    "zlib_codec",
)


def _preload(extra: list[str], paths: list[str]) -> str | None:
    for path in paths:
        if path not in sys.path:
            sys.path.append(path)
    for name in STDLIB_PRELOAD + LAZY_HELPERS:
        importlib.import_module(name)
    for name in PRELOADED_ENCODINGS:
        codecs.lookup(name)
    for name in extra:
        try:
            importlib.import_module(name)
        except BaseException as error:
            return f"cannot preload module {name!r} listed in code_runtime.preload: {type(error).__name__}: {error}"
    return None


def _send(ctrl: socket.socket, message: dict[str, object], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    try:
        if fds:
            ctrl.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            ctrl.send(data)
    except OSError:
        os._exit(0)  # the host is gone


def _kernel_reports_reaped_status() -> bool:
    """Whether, with SIGCHLD ignored, the kernel reports a child's status through its pidfd.

    Tried with one short-lived child, before the preload makes forking dear;
    SIGCHLD is left at its default (a preloaded module may wait for a child).
    """
    descriptors: Any = importlib.import_module("_dsh_worker.descriptors")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    works = False
    go_r, go_w = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:
            os.read(go_r, 1)
            os._exit(7)
        try:
            handle = os.pidfd_open(pid)
        finally:
            os.write(go_w, b"g")
        try:
            select.select([handle], [], [], 10.0)
            # Readable as it exits; the status is recorded as it is reaped, a moment later.
            # An error (no such ioctl, or no status once reaped) means no support: no waiting.
            for _ in range(1000):
                status = descriptors.recorded_exit_status(handle)
                if status is not None:
                    works = status == 7 << 8
                    break
                time.sleep(0.001)
        finally:
            os.close(handle)
    except OSError:
        works = False
    finally:
        os.close(go_r)
        os.close(go_w)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    return works


def _one_malloc_arena() -> None:
    """Ask the C library for a single malloc arena, for the zygote and every worker it forks.

    glibc gives each new thread its own arena, and each reserves 64 MiB of
    address space: under a worker's RLIMIT_AS (the memory budget) a program
    could start only about seven threads. With the GIL one arena costs
    nothing. A C library without ``mallopt`` is left as it is.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-8, 1)  # M_ARENA_MAX


def main() -> None:
    """Zygote entry point."""
    ctrl_fd = int(sys.argv[1])
    config = json.loads(sys.argv[2])
    os.environ.clear()  # PEP 538 may have added LC_CTYPE; children inherit nothing
    _one_malloc_arena()  # before any thread exists
    ctrl = socket.socket(fileno=ctrl_fd)
    _load_package()
    descriptors: Any = importlib.import_module("_dsh_worker.descriptors")
    kernel_reaps = bool(config.get("kernel_reaps")) and _kernel_reports_reaped_status()
    failure = _preload(config["preload"], config["paths"])
    if failure is None:
        try:
            runner: Any = importlib.import_module("_dsh_worker.runner")  # warm the child code
            runner.CodecGuard.install()
        except BaseException as error:
            failure = f"worker bootstrap failed: {type(error).__name__}: {error}"
    if failure is not None:
        _send(ctrl, {"t": "error", "m": failure})
        return
    import gc

    gc.collect()
    gc.freeze()  # children share these pages copy-on-write; keep GC off them
    sigr, sigw = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(sigw)
    # Ignored: the kernel reaps each child as it exits (and the host reads its status).
    signal.signal(signal.SIGCHLD, signal.SIG_IGN if kernel_reaps else lambda *_: None)
    _send(ctrl, {"t": "hello", "pid": os.getpid(), "kernel_reaps": kernel_reaps})
    children: dict[int, str] = {}  # pid -> run id, for the runs this zygote reaps
    spare, _ = _try_make_spare(ctrl, config)
    while True:
        try:
            ready, _, _ = select.select([ctrl.fileno(), sigr], [], [])
        except InterruptedError:
            continue
        if sigr in ready:
            try:
                while os.read(sigr, 512):
                    pass
            except BlockingIOError:
                pass
            if _reap(ctrl, children, spare[0] if spare else 0) and spare is not None:
                spare[1].close()
                os.close(spare[2])
                spare = None  # the spare died unassigned; make another when needed
        if ctrl.fileno() in ready:
            try:
                data, ancdata, _, _ = ctrl.recvmsg(1 << 16, socket.CMSG_SPACE(8 * 4))
            except InterruptedError:
                continue
            fds: list[int] = descriptors.received(ancdata)
            if not data:  # the host closed the control socket: shut down
                for fd in fds:
                    os.close(fd)
                if spare is not None:  # it never ran a program: it is alone in its group
                    spare[1].close()
                    descriptors.kill(spare[2])
                    if kernel_reaps:
                        select.select([spare[2]], [], [], 10.0)  # readable once it is gone
                    else:
                        children[spare[0]] = ""
                    os.close(spare[2])
                # Workers of this zygote's own reaping; the others were torn down by the
                # host through their pidfds (and would die with the zygote: PDEATHSIG).
                for pid in list(children):
                    _kill_group(pid)
                while children:
                    _reap(ctrl, children, 0, block=True)
                return
            request = json.loads(data)
            if request.get("t") == "spawn" and len(fds) == 2:
                refusal: dict[str, object] = {"m": "the worker died before it was given its run"}
                given = False
                for _attempt in range(2):
                    if spare is None:
                        spare, refused = _try_make_spare(ctrl, config)
                        if spare is None:
                            # The errno tells the host whether this is the moment (no process or
                            # descriptor left) or the level.
                            refusal = {
                                "m": f"the zygote could not fork a worker: {refused}",
                                "errno": refused.errno if refused is not None else None,
                            }
                            break
                    pid, channel, handle = spare
                    spare = None
                    try:
                        channel.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                    except OSError:
                        os.close(handle)  # the spare died unassigned
                        continue
                    finally:
                        channel.close()
                    if not kernel_reaps:
                        children[pid] = request["r"]
                    _send(ctrl, {"t": "spawned", "r": request["r"], "pid": pid}, [handle])
                    os.close(handle)
                    given = True
                    break
                if not given:
                    _send(ctrl, {"t": "exit", "r": request["r"], "status": 70 << 8, **refusal})
                for fd in fds:
                    os.close(fd)
                if spare is None:
                    spare, _ = _try_make_spare(ctrl, config)
            else:
                for fd in fds:
                    os.close(fd)
                if request.get("t") == "kill":
                    for pid, run in children.items():
                        if run == request.get("r"):
                            _kill_group(pid)


def _make_spare(ctrl: socket.socket, config: dict[str, object]) -> tuple[int, socket.socket, int]:
    """Fork the next worker now; it locks down, warms up and waits for its one run.

    Returns its pid, the zygote's end of its channel and a pidfd, opened before
    the child may go on (so before it can exit and, reaped by the kernel, free its pid).
    """
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        pid = os.fork()
    except OSError:
        parent.close()
        child.close()
        raise
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        parent.close()
        _child(ctrl, child, config)  # never returns
    child.close()
    try:
        handle = os.pidfd_open(pid)
    except OSError:
        parent.close()  # the child's recv sees no "g": it exits at once, and is reaped as any other
        raise
    with contextlib.suppress(OSError):
        parent.send(b"g")
    return pid, parent, handle


def _try_make_spare(
    ctrl: socket.socket, config: dict[str, object]
) -> tuple[tuple[int, socket.socket, int] | None, OSError | None]:
    """:func:`_make_spare` and None, or None and the OSError that refused it.

    A fork or a descriptor refused (the host's process or file limit, for a moment) fails
    the one spawn that needed it: an exception here would end the zygote, and with it
    (PDEATHSIG) every live run's worker.
    """
    try:
        return _make_spare(ctrl, config), None
    except OSError as error:
        return None, error


def _kill_group(pid: int) -> None:
    # Safe: the pid is ours and not yet reaped, so neither it nor its
    # process-group id can have been reused.
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)


def _reap(ctrl: socket.socket, children: dict[int, str], spare: int, block: bool = False) -> bool:
    spare_died = False
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG))
        except ChildProcessError:
            return spare_died
        except InterruptedError:
            continue
        if info is None:
            return spare_died
        pid = info.si_pid
        # The leader is a zombie: its group id is still reserved, so killing
        # the group now reaches every process the run left behind.
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        spare_died = spare_died or pid == spare
        run = children.pop(pid, None)
        if run:
            _send(ctrl, {"t": "exit", "r": run, "status": status})
        if block and not children:
            return spare_died


def _child(ctrl: socket.socket, channel: socket.socket, config: dict[str, object]) -> None:
    code = 1
    try:
        zygote = os.getppid()
        ctrl.close()
        if channel.recv(1) != b"g":  # the zygote holds a pidfd of this process from here on
            os._exit(0)
        runner: Any = importlib.import_module("_dsh_worker.runner")
        if channel.fileno() != 3:
            os.dup2(0, 3)  # hold descriptor 3 for the protocol: the loop's own fds land above it
        prepared = runner.prepare(config, zygote)
        data, ancdata, _, _ = channel.recvmsg(1 << 16, socket.CMSG_SPACE(8 * 4))
        fds: list[int] = importlib.import_module("_dsh_worker.descriptors").received(ancdata)
        if not data or len(fds) != 2:
            os._exit(0)  # the zygote is shutting down
        channel.close()
        proto, out = fds
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.dup2(proto, 3)
        keep = sorted(fd for fd in prepared.keep_fds if fd > 3)
        low = 4
        for fd in keep:  # close everything inherited except the event loop's own descriptors
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, 1 << 16)
        code = runner.serve(3, json.loads(data), prepared)
    except BaseException as error:  # report through stderr (counted by the host ledger)
        with contextlib.suppress(OSError):
            os.write(2, f"worker bootstrap failed: {type(error).__name__}: {error}\n".encode())
        code = 70
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
    except OSError as error:
        if error.errno not in (errno.EPIPE, errno.ECONNRESET):
            raise
