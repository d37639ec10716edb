"""Isolation levels: descriptors, the escape matrix per level, cgroup memory cap."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dsh_core.coderuntime import CodeRuntimeConfig, PythonCodeRuntime
from dsh_core.coderuntime import isolation as iso
from dsh_core.coderuntime.isolation import CgroupPool

from .conftest import HAS_BWRAP, LEVELS, arun, run_one, tools, with_runtime

ATTEMPTS = """
import os, sys, socket, resource
def attempt(fn):
    try:
        fn()
        return "ESCAPE"
    except BaseException as error:
        return "blocked"
def read():
    open(HOST_FILE).read()
def write():
    open(os.path.join(os.path.dirname(HOST_FILE), "written"), "w").write("x")
def connect():
    s = socket.socket()
    s.settimeout(2)
    s.connect(("127.0.0.1", PORT))
    s.close()
def spawn():
    os.waitpid(os.posix_spawn("/bin/true", ["/bin/true"], {}), 0)
def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
def signal_host():
    os.kill(HOST_PID, 0)
def import_more():
    sys.meta_path[:] = [m for m in sys.meta_path if "ImportGuard" not in getattr(m, "__name__", "")]
    import xml.dom.minidom
def raise_rlimit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
def clone3():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(435, 0, 0)  # clone3(NULL, 0): EINVAL where the call is reachable
    if ctypes.get_errno() == 38:
        raise OSError(38, "clone3 refused")
def abstract_unix():
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2)
    s.connect(ABSTRACT)
    s.close()
def big_file():
    with open("big", "wb") as handle:
        handle.write(b"x" * (17 << 20))  # past the 16 MiB file-size limit of L1 and up
return {name: attempt(fn) for name, fn in [("read", read), ("write", write), ("socket", connect),
        ("spawn", spawn), ("fork", fork), ("signal", signal_host), ("import", import_more),
        ("rlimit", raise_rlimit), ("clone3", clone3), ("abstract-unix", abstract_unix),
        ("big-file", big_file)]}
"""


def _has_sys_resource() -> bool:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) & (1 << 24))
    return False


def _expected(level: str) -> dict[str, str]:
    names = [
        "read",
        "write",
        "socket",
        "spawn",
        "fork",
        "signal",
        "import",
        "rlimit",
        "clone3",
        "abstract-unix",
        "big-file",
    ]
    if level == "L0":
        return dict.fromkeys(names, "ESCAPE")
    if level == "L1":
        verdicts = dict.fromkeys(names, "ESCAPE")
        # Only the missing CAP_SYS_RESOURCE (as in this VM) keeps root from raising it back.
        verdicts["rlimit"] = "ESCAPE" if _has_sys_resource() else "blocked"
        verdicts["big-file"] = "blocked"  # RLIMIT_FSIZE: EFBIG (the interpreter ignores SIGXFSZ)
        return verdicts
    return dict.fromkeys(names, "blocked")


@pytest.mark.parametrize("level", LEVELS)
def test_escape_matrix(level: str, tmp_path: Path) -> None:
    host_file = tmp_path / "secret.txt"
    host_file.write_text("secret")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    abstract_name = f"\0dsh-escape-{os.getpid()}-{level}"
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(abstract_name)
    abstract.listen(8)
    program = (
        f"HOST_FILE = {str(host_file)!r}\nPORT = {port}\nHOST_PID = {os.getpid()}\nABSTRACT = {abstract_name!r}\n"
        + ATTEMPTS
    )

    async def go(rt: PythonCodeRuntime) -> dict[str, str]:
        result = await rt.run(program, [])
        assert result.error is None, result.error
        return dict(result.value)

    try:
        verdicts = arun(with_runtime(go, isolation=level))
    finally:
        listener.close()
        abstract.close()
    assert verdicts == _expected(level)
    assert (tmp_path / "written").exists() == (level in ("L0", "L1"))


@pytest.mark.parametrize("level", LEVELS)
def test_descriptor_is_honest(level: str) -> None:
    async def go(rt: PythonCodeRuntime) -> str:
        await rt.run("return 1", [])
        return rt.isolation

    descriptor = arun(with_runtime(go, isolation=level))
    assert descriptor.startswith(level + " ") and "[host-verified kuid=" in descriptor
    steps = descriptor.split(" [host-verified", 1)[0]
    # Only what took effect: each level's own steps, none of a stronger level's.
    assert ("rlimits(" in steps) == ("capbset=0" in steps) == ("nnp" in steps.split()) == (level != "L0")
    assert ("landlock(" in steps) == ("seccomp(" in steps) == (level in ("L2", "L3"))
    assert ("setuid(65534)" in steps) == (level == "L3")
    # From L1, wherever the host can make cgroups (and always at L3, which needs that host).
    assert ("cgroup(" in steps) == (level != "L0" and CgroupPool.available())
    if level == "L0":
        assert "NoNewPrivs=0 seccomp=off new-ns=none" in descriptor
    if level in ("L1", "L2", "L3"):
        assert "rlimits(as=" in descriptor and "pdeathsig" in descriptor and "NoNewPrivs=1" in descriptor
    if level in ("L2", "L3"):
        assert "seccomp=filter" in descriptor and "seccomp(allowlist" in descriptor
    if level == "L3":
        assert "kuid=65534/65534/65534" in descriptor and "CapEff=0000000000000000" in descriptor
        assert "new-ns=net,pid,mnt,ipc,uts" in descriptor and "cgroup(mem=" in descriptor


@pytest.mark.parametrize("level", ["L0", "L1"])
def test_the_verified_suffix_is_what_the_worker_itself_sees(level: str) -> None:
    # Below L2 the worker can still read its own /proc entry: the host's suffix must match it.
    program = (
        "status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines())\n"
        "return {k: status[k].split() for k in ('Uid', 'CapEff', 'NoNewPrivs', 'Seccomp')}"
    )

    async def go(rt: PythonCodeRuntime) -> tuple[Any, str]:
        result = await rt.run(program, [])
        assert result.error is None, result.error
        return result.value, rt.isolation

    seen, descriptor = arun(with_runtime(go, isolation=level))
    seccomp = {"0": "off", "1": "strict", "2": "filter"}[seen["Seccomp"][0]]
    expected = (
        f"[host-verified kuid={'/'.join(seen['Uid'][:3])} CapEff={seen['CapEff'][0]}"
        f" NoNewPrivs={seen['NoNewPrivs'][0]} seccomp={seccomp} new-ns=none]"
    )
    assert descriptor.endswith(expected), (descriptor, expected)


@pytest.mark.parametrize(
    ("level", "forged", "reason", "fallback"),
    [
        ("L1", {"NoNewPrivs": "0"}, "no-new-privs is not set", "L0"),
        ("L2", {"seccomp": "off"}, "no seccomp filter is installed", "L1"),
    ],
)
def test_a_worker_whose_proc_facts_do_not_back_its_level_is_refused(
    level: str, forged: dict[str, str], reason: str, fallback: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsh_core.coderuntime import host
    from dsh_core.coderuntime import isolation as iso
    from dsh_core.coderuntime.host import ZygoteError

    real = iso.verify_proc
    monkeypatch.setattr(host.iso, "verify_proc", lambda pid: {**real(pid), **forged})
    monkeypatch.setattr(host, "_DETECTED", {})  # detect afresh

    async def go(rt: PythonCodeRuntime) -> str:
        with pytest.raises(ZygoteError, match=f"isolation check failed: {reason}"):
            await rt._start_level(int(level[1]))  # the level's probe worker is refused...
        result = await rt.run("return 1", [])
        assert result.value == 1, result.error
        return rt.isolation

    # ... so the runtime settles on the strongest level whose facts do back it.
    assert arun(with_runtime(go, isolation=level)).startswith(fallback + " ")


def test_a_level_that_fails_to_start_falls_back_and_is_detected_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsh_core.coderuntime import host
    from dsh_core.coderuntime.host import ZygoteError

    tried: list[int] = []
    real = PythonCodeRuntime._start_level

    async def start_level(self: PythonCodeRuntime, level: int) -> Any:
        tried.append(level)
        if level >= 2:
            raise ZygoteError(f"L{level} refused for this test")
        return await real(self, level)

    monkeypatch.setattr(PythonCodeRuntime, "_start_level", start_level)
    monkeypatch.setattr(host, "_DETECTED", {})

    async def go(rt: PythonCodeRuntime) -> str:
        result = await rt.run("return 1", [])
        assert result.value == 1, result.error
        return rt.isolation

    assert arun(with_runtime(go, isolation="L3")).startswith("L1 ")  # the strongest that works
    assert tried == [3, 2, 1]
    assert arun(with_runtime(go, isolation="L3")).startswith("L1 ")
    assert tried == [3, 2, 1, 1]  # detected once per host: the next runtime starts at L1 directly


@pytest.mark.parametrize("level", LEVELS)
def test_worker_runs_the_hosts_interpreter_isolated_with_only_its_own_descriptors(level: str) -> None:
    # An inheritable descriptor the host holds when the zygote starts must not reach a worker.
    leak_r, leak_w = os.pipe()
    os.set_inheritable(leak_r, True)
    os.set_inheritable(leak_w, True)
    program = (
        "import os, sys\n"
        "def is_open(fd):\n"
        "    for probe in (lambda: os.read(fd, 0), lambda: os.write(fd, b'')):\n"
        "        try:\n"
        "            probe()\n"
        "            return True\n"
        "        except OSError as error:\n"
        "            if error.errno != 9:\n"
        "                return True\n"
        "    return False\n"
        "return [[sys.flags.isolated, sys.flags.no_site, sys.flags.ignore_environment], sys.executable,\n"
        "        [fd for fd in range(1024) if is_open(fd)]]"
    )
    try:
        result = run_one(program, [], isolation=level)
    finally:
        os.close(leak_r)
        os.close(leak_w)
    assert result.error is None, result.error
    flags, executable, fds = result.value
    assert flags == [1, 1, 1]  # -I -S
    # The resolved interpreter, never a PATH lookup (bubblewrap runs its real path).
    assert executable == (os.path.realpath(sys.executable) if level == "L3" else sys.executable)
    # stdin, the output pipe on 1 and 2, the protocol on 3, and the event loop's
    # epoll descriptor and self-pipe: nothing else.
    assert fds[:4] == [0, 1, 2, 3] and len(fds) == 7, fds


@pytest.mark.parametrize("level", ["L0", "L1"])
def test_private_cwd_starts_empty(level: str) -> None:
    # (From L2 on the program cannot even list it: getcwd and directory reads are refused.)
    result = run_one("import os\nreturn [os.getcwd(), os.listdir('.')]", [], isolation=level)
    assert result.error is None, result.error
    cwd, entries = result.value
    assert entries == [] and os.path.basename(cwd).startswith("dsh-run-")


THREADS = """
import threading
threading.stack_size(256 << 10)  # so that the stacks, sized by the runner's ulimit -s, are not what stops it
stop = threading.Event()
threads, error = [], None
for _ in range(WANTED):
    thread = threading.Thread(target=stop.wait)
    try:
        thread.start()
    except RuntimeError as failure:
        error = str(failure)
        break
    threads.append(thread)
stop.set()
for thread in threads:
    thread.join()
return [len(threads), error]
"""


MEMORY_FAILURE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
def madvise(address, advice):
    ctypes.set_errno(0)
    return [libc.madvise(address, 4096, advice), ctypes.get_errno()]
page = libc.mmap(None, 4096, 3, 0x22, -1, 0)  # PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS
ordinary = madvise(page, 4)  # MADV_DONTNEED: malloc and thread stacks need it
libc.munmap(page, 4096)  # unmapped: a reachable injection finds no page to act on (EFAULT)
return [ordinary, madvise(page, 100), madvise(page, 101)]  # MADV_HWPOISON, MADV_SOFT_OFFLINE
"""


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv in ("L2", "L3")])
def test_memory_failure_injection_is_refused_by_the_filter(level: str) -> None:
    # At L2 the worker keeps root's capabilities, CAP_SYS_ADMIN among them: on a kernel
    # with CONFIG_MEMORY_FAILURE (most distributions'), madvise(MADV_HWPOISON) would take
    # physical pages out of the host for good and kill every process sharing one (the
    # zygote, other runs' workers: copy-on-write pages); MADV_SOFT_OFFLINE offlines them.
    result = run_one(MEMORY_FAILURE, [], isolation=level)
    assert result.error is None, result.error
    ordinary, poison, offline = result.value
    assert ordinary == [0, 0]
    assert poison == [-1, 38] and offline == [-1, 38]  # ENOSYS from the filter, not the kernel's answer


@pytest.mark.parametrize("level", LEVELS)
def test_programs_can_start_dozens_of_threads(level: str) -> None:
    # glibc reserves 64 MiB of address space per thread arena: under RLIMIT_AS a program
    # could start only about seven threads until the zygote asked for a single arena.
    result = run_one("WANTED = 40\n" + THREADS, [], isolation=level)
    assert result.value == [40, None], result


@pytest.mark.skipif(not CgroupPool.available(), reason="writable v1 memory and pids cgroups are needed")
@pytest.mark.parametrize("level", ["L1", "L2", "L3"])
def test_the_pids_cgroup_caps_threads_at_every_level_from_l1(level: str) -> None:
    # A memory budget large enough that the address space is not what stops it: the
    # worker's pids cgroup (64 tasks: the worker and 63 threads) is. Below L3 a root
    # worker had no cap at all (RLIMIT_NPROC exempts root): 6,000 threads in one run.
    if level == "L3" and not HAS_BWRAP:
        pytest.skip("bubblewrap (as root) is needed for L3")
    result = run_one("WANTED = 200\n" + THREADS, [], isolation=level, memory_mb=2048)
    assert result.value == [63, "can't start new thread"], result


def _groups_of(pid: int | str) -> dict[str, str]:
    """The v1 memory and pids groups of ``pid``, as ``/proc/<pid>/cgroup`` names them."""
    with open(f"/proc/{pid}/cgroup") as handle:
        lines = [line.rstrip("\n").split(":", 2) for line in handle]
    return {c: path for _, names, path in lines for c in names.split(",") if c in ("memory", "pids")}


@pytest.mark.skipif(not CgroupPool.available(), reason="writable v1 memory and pids cgroups are needed")
@pytest.mark.parametrize("level", ["L1", "L2"])
def test_a_worker_runs_inside_the_hosts_own_memory_and_pids_groups(level: str) -> None:
    # A deployment's memory and pids limits (a service held to 2 GiB) are on dsh's own groups: a worker whose
    # run group was made at a hierarchy's root ran outside them. Read while the worker waits on a tool.
    own = _groups_of("self")
    seen: dict[str, str] = {}

    async def where(pid: int) -> None:
        seen.update(_groups_of(pid))

    async def go(runtime: PythonCodeRuntime) -> Any:
        result = await runtime.run("import os\nawait tools.where(os.getpid())\nreturn 1", tools(where=where))
        assert runtime._cgroups is not None
        return result, runtime._cgroups.prefix

    result, prefix = arun(with_runtime(go, isolation=level))
    assert result.value == 1, result
    for controller in ("memory", "pids"):
        assert seen[controller].startswith(os.path.join(own[controller], prefix + "-")), (controller, seen, own)
    groups = CgroupPool.own_groups()
    assert groups is not None
    assert [name for group in groups for name in os.listdir(group) if name.startswith(prefix)] == []


def test_l0_has_no_pids_cap() -> None:
    at_l0 = run_one("WANTED = 100\n" + THREADS, [], isolation="L0", memory_mb=2048)
    assert at_l0.value == [100, None], at_l0


@pytest.mark.skipif(not HAS_BWRAP, reason="bubblewrap (as root) is needed for L3")
def test_auto_picks_l3_and_cgroup_oom_is_memory_limit() -> None:
    assert PythonCodeRuntime(CodeRuntimeConfig()).isolation.startswith("L3 ")

    async def go(rt: PythonCodeRuntime) -> Any:
        # Touched pages, in chunks: the cgroup charge hits the cap (SIGKILL by
        # the OOM killer) before the address-space limit does.
        return await rt.run("chunks = []\nwhile True:\n    chunks.append(b'x' * (4 << 20))", [])

    result = arun(with_runtime(go, isolation="L3", memory_mb=96))
    assert result.error is not None and result.error.kind == "memory-limit", result.error


def test_preload_failure_names_the_module_and_the_key() -> None:
    result = run_one("return 1", [], isolation="L2", preload=("definitely_not_installed_mod",))
    assert result.error is not None and result.error.kind == "worker-exit"
    assert "definitely_not_installed_mod" in result.error.message and "code_runtime.preload" in result.error.message


@pytest.mark.parametrize(
    "source",
    [
        'open("/etc/passwd").read()',
        "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)",
        'try:\n    open("/etc/passwd")\nexcept OSError as e:\n    raise ValueError("wrapped") from e',
    ],
)
def test_a_call_the_sandbox_refuses_is_named_as_the_sandboxs(source: str) -> None:
    # "[Errno 38] Function not implemented" alone names neither dsh nor the fix.
    result = run_one(source, [], isolation="L2")
    assert result.error is not None and result.error.kind == "exception", result
    assert "Errno 38" in result.error.message
    assert "Code Mode sandbox, isolation L2, refuses this system call" in result.error.message
    assert "await tools.NAME(...)" in result.error.message


@pytest.mark.parametrize(
    ("source", "level"),
    [
        ('raise OSError(38, "made up by the program")', "L0"),  # no filter below L2
        ('raise OSError(5, "some other failure")', "L2"),
        ('raise ValueError("plain")', "L2"),
    ],
)
def test_other_failures_get_no_sandbox_note(source: str, level: str) -> None:
    result = run_one(source, [], isolation=level)
    assert result.error is not None and result.error.kind == "exception", result
    assert "Code Mode sandbox" not in result.error.message


AT_FORK_THREAD = """
import os, threading, queue

jobs = queue.Queue()


def _serve():
    while True:
        job, box, done = jobs.get()
        try:
            box.append(job())
        except BaseException as error:
            box.append(f"blocked: errno {getattr(error, 'errno', None)}")
        done.set()


def _start():
    threading.Thread(target=_serve, daemon=True).start()


def run(job):
    box, done = [], threading.Event()
    jobs.put((job, box, done))
    done.wait()
    return box[0]


os.register_at_fork(after_in_child=_start)
"""


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv in ("L2", "L3")])
def test_a_thread_a_preloaded_module_starts_in_each_worker_is_locked_down_too(
    level: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A preloaded package may restart its background thread in every forked child (an
    # at-fork hook, as tracing and metrics exporters do): that thread existed before the
    # lockdown, and a filter installed on the worker's main thread alone did not reach it.
    # A program handing it work (here a queue; in general by patching what it calls) read
    # host files at L2.
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "dsh_at_fork_thread.py").write_text(AT_FORK_THREAD)
    monkeypatch.syspath_prepend(str(modules))
    program = (
        "import dsh_at_fork_thread, threading\n"
        f"return [threading.active_count(), dsh_at_fork_thread.run(lambda: open({str(secret)!r}).read())]"
    )
    result = run_one(program, [], isolation=level, preload=("dsh_at_fork_thread",))
    assert result.error is None, result.error
    assert result.value == [2, "blocked: errno 38"]  # ENOSYS: the seccomp filter reached that thread too


def test_preload_allows_an_installed_package() -> None:
    result = run_one("import attr\nreturn attr.__name__", [], isolation="auto", preload=("attr",))
    assert result.value == "attr", result.error
    blocked = run_one("import attr\nreturn attr.__name__", [], isolation="auto")
    assert blocked.error is not None and "code_runtime.preload" in blocked.error.message
    assert "'attr'" in blocked.error.message


def test_worker_cannot_see_host_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSH_SECRET_TOKEN", "hunter2")

    result = run_one("import os\nreturn [dict(os.environ), sorted(os.listdir('/proc/self/fd'))]", [], isolation="L0")
    assert result.value[0] == {}
    # Only stdin (/dev/null), the output pipe on 1/2, the protocol on 3, and the
    # event loop's own epoll/self-pipe descriptors (plus the one listdir opens).
    assert "3" in result.value[1] and len(result.value[1]) <= 8


@pytest.mark.parametrize("level", LEVELS)
def test_worker_leads_its_process_group_but_not_a_session(level: str) -> None:
    # Group leader: the zygote's killpg reaches everything the program forks.
    # Not a session leader: it could otherwise acquire a controlling terminal.
    result = run_one("import os\nreturn [os.getpid(), os.getpgid(0), os.getsid(0)]", [], isolation=level)
    assert result.error is None, result.error
    pid, pgid, sid = result.value
    assert pgid == pid and sid != pid


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    dead = subprocess.Popen([sys.executable, "-I", "-S", "-c", "pass"])
    dead.wait()
    return dead.pid


def _as_cgroupfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Directories made under ``tmp_path`` act as cgroups: one is made with the kernel's files a pool opens
    (``cgroup.procs``, ``pids.current``) and removed with them. Returns the log of the groups made and removed."""
    log: list[str] = []
    mkdir, rmdir = os.mkdir, os.rmdir

    def make(path: Any, *args: Any, **kwargs: Any) -> None:
        mkdir(path, *args, **kwargs)
        if str(path).startswith(str(tmp_path)):
            log.append(f"mkdir {path}")
            Path(path, "cgroup.procs").write_text("")
            Path(path, "pids.current").write_text("0\n")

    def remove(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).startswith(str(tmp_path)):
            for entry in os.scandir(path):
                if entry.is_file():
                    os.unlink(entry.path)
            log.append(f"rmdir {path}")
        rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", make)
    monkeypatch.setattr(os, "rmdir", remove)
    return log


def _own_groups_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> tuple[Path, Path]:
    """dsh's own (memory, pids) groups in hierarchies mounted under ``tmp_path``, as the pool will find them."""
    mountinfo, proc_cgroup = tmp_path / "mountinfo", tmp_path / "cgroup"
    if layout == "apart":
        memory_point = tmp_path / "elsewhere" / "mem"  # not <cgroup root>/memory: the mount point is read
        pids_point = tmp_path / "pids"  # a mount of a subtree: the host's /docker/abc
        mountinfo.write_text(
            f"35 31 0:32 / {memory_point} rw,relatime - cgroup cgroup rw,memory\n"
            f"39 31 0:36 /docker/abc {pids_point} rw,relatime - cgroup cgroup rw,pids\n"
        )
        proc_cgroup.write_text("4:memory:/process_api/me\n8:pids:/docker/abc/me\n0::/\n")
        own = (memory_point / "process_api" / "me", pids_point / "me")
    else:  # both controllers in one v1 hierarchy: one own group
        point = tmp_path / "both"
        mountinfo.write_text(f"35 31 0:32 / {point} rw,relatime - cgroup cgroup rw,memory,pids\n")
        proc_cgroup.write_text("4:memory,pids:/svc/me\n0::/\n")
        own = (point / "svc" / "me", point / "svc" / "me")
    for group in own:
        group.mkdir(parents=True, exist_ok=True)
        (group / "cgroup.procs").touch()
    monkeypatch.setattr(iso, "_MOUNTINFO", str(mountinfo))
    monkeypatch.setattr(iso, "_PROC_CGROUP", str(proc_cgroup))
    return own


@pytest.mark.parametrize("layout", ["apart", "co-mounted"])
def test_the_pools_groups_are_made_in_dshs_own_groups_found_through_mountinfo(
    layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # They were made at the root of each hierarchy, /sys/fs/cgroup/<controller>/: a worker moved there left
    # the memory and pids limits of the deployment running dsh (a service held to 2 GiB). Where both
    # controllers share one hierarchy the run's group is one directory: made, joined and removed once.
    log = _as_cgroupfs(tmp_path, monkeypatch)
    own = _own_groups_at(tmp_path, monkeypatch, layout)
    assert CgroupPool.available()
    log.clear()
    pool = CgroupPool("dsh-1-ab", 64)
    group = pool.acquire()
    assert (group.memory, group.pids) == (str(own[0] / "dsh-1-ab-0"), str(own[1] / "dsh-1-ab-0"))
    assert (Path(group.memory) / "memory.limit_in_bytes").read_text() == str(64 << 20)
    assert (Path(group.pids) / "pids.max").read_text() == "64"
    groups = list(dict.fromkeys((group.memory, group.pids)))
    group.join(4242)
    assert [Path(path, "cgroup.procs").read_text() for path in groups] == ["4242"] * len(groups)
    group.leave(4242)  # back to dsh's own groups, not to the hierarchies' roots
    assert [(path / "cgroup.procs").read_text() for path in dict.fromkeys(own)] == ["4242"] * len(groups)
    pool.release(group)
    pool.close()
    assert log == [f"mkdir {path}" for path in groups] + [f"rmdir {path}" for path in groups]


def test_without_both_own_groups_the_pool_is_not_available(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _own_groups_at(tmp_path, monkeypatch, "apart")
    assert CgroupPool.available()
    for lines in ("8:pids:/docker/abc/me\n", "4:memory:/process_api/me\n", "4:memory:/process_api/gone\n8:pids:/\n"):
        (tmp_path / "cgroup").write_text(lines)  # no memory line; no pids line; pids outside what its mount shows
        assert not CgroupPool.available(), lines
        assert CgroupPool.sweep_stale() == []


def test_stale_cgroups_of_dead_hosts_are_swept_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A host that died without aclose leaves its empty per-run cgroups behind, in its own groups. Under
    # hierarchies of the test's own, so nothing else that sweeps (another test process's first runtime) can
    # take a group away meanwhile.
    own = _own_groups_at(tmp_path, monkeypatch, "apart")
    dead = _dead_pid()
    roots = [str(group) for group in own]
    stale = [os.path.join(root, f"dsh-{dead}-abc123-0") for root in roots]
    live = [os.path.join(root, f"dsh-{os.getpid()}-abc123-7") for root in roots]  # ours: kept
    other = [os.path.join(root, f"not-dsh-{dead}") for root in roots]  # not a pool's: kept
    outside = [str(tmp_path / "pids" / f"dsh-{dead}-abc123-0")]  # not in dsh's own group: another's, kept
    busy = os.path.join(roots[0], f"dsh-{dead}-abc123-1")  # not empty (a task still in it): rmdir refuses, kept
    for path in stale + live + other + outside + [busy, os.path.join(busy, "child")]:
        os.makedirs(path)
    assert sorted(CgroupPool.sweep_stale()) == sorted(stale)
    assert not any(os.path.exists(p) for p in stale)
    assert all(os.path.exists(p) for p in [*live, *other, *outside, busy])


@pytest.mark.skipif(not CgroupPool.available(), reason="writable v1 memory and pids cgroups are needed")
def test_stale_cgroups_of_dead_hosts_are_swept_from_the_real_hierarchies() -> None:
    # The same on the machine's cgroup file system, where a group's directory holds the kernel's files and
    # rmdir still removes it. Another process may sweep meanwhile (a second test worker's first runtime):
    # what is checked is where this test's groups end up, and that the sweep names none it did not remove.
    dead = _dead_pid()
    own = CgroupPool.own_groups()
    assert own is not None
    roots = list(dict.fromkeys(own))
    stale = [os.path.join(root, f"dsh-{dead}-abc123-0") for root in roots]
    live = [os.path.join(root, f"dsh-{os.getpid()}-abc123-7") for root in roots]  # ours: kept
    other = [os.path.join(root, f"not-dsh-{dead}") for root in roots]  # not a pool's: kept
    for path in stale + live + other:
        os.mkdir(path)
    try:
        removed = CgroupPool.sweep_stale()
        assert not set(removed) & set(live + other)
        assert not any(os.path.exists(p) for p in stale + removed)
        assert all(os.path.exists(p) for p in live + other)
    finally:
        for path in stale + live + other:
            with contextlib.suppress(OSError):
                os.rmdir(path)
