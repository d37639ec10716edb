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
from dsh_core.coderuntime.isolation import CgroupPool

from .conftest import HAS_BWRAP, LEVELS, arun, run_one, with_runtime

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
return {name: attempt(fn) for name, fn in [("read", read), ("write", write), ("socket", connect),
        ("spawn", spawn), ("fork", fork), ("signal", signal_host), ("import", import_more),
        ("rlimit", raise_rlimit)]}
"""


def _has_sys_resource() -> bool:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) & (1 << 24))
    return False


def _expected(level: str) -> dict[str, str]:
    names = ["read", "write", "socket", "spawn", "fork", "signal", "import", "rlimit"]
    if level == "L0":
        return dict.fromkeys(names, "ESCAPE")
    if level == "L1":
        verdicts = dict.fromkeys(names, "ESCAPE")
        # Only the missing CAP_SYS_RESOURCE (as in this VM) keeps root from raising it back.
        verdicts["rlimit"] = "ESCAPE" if _has_sys_resource() else "blocked"
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
    program = f"HOST_FILE = {str(host_file)!r}\nPORT = {port}\nHOST_PID = {os.getpid()}\n" + ATTEMPTS

    async def go(rt: PythonCodeRuntime) -> dict[str, str]:
        result = await rt.run(program, [])
        assert result.error is None, result.error
        return dict(result.value)

    try:
        verdicts = arun(with_runtime(go, isolation=level))
    finally:
        listener.close()
    assert verdicts == _expected(level)
    assert (tmp_path / "written").exists() == (level in ("L0", "L1"))


@pytest.mark.parametrize("level", LEVELS)
def test_descriptor_is_honest(level: str) -> None:
    async def go(rt: PythonCodeRuntime) -> str:
        await rt.run("return 1", [])
        return rt.isolation

    descriptor = arun(with_runtime(go, isolation=level))
    assert descriptor.startswith(level + " ") and "[host-verified kuid=" in descriptor
    if level == "L0":
        assert "NoNewPrivs=0 seccomp=off new-ns=none" in descriptor
    if level in ("L1", "L2", "L3"):
        assert "rlimits(as=" in descriptor and "pdeathsig" in descriptor and "NoNewPrivs=1" in descriptor
    if level in ("L2", "L3"):
        assert "seccomp=filter" in descriptor and "seccomp(allowlist" in descriptor
    if level == "L3":
        assert "kuid=65534/65534/65534" in descriptor and "CapEff=0000000000000000" in descriptor
        assert "new-ns=net,pid,mnt,ipc,uts" in descriptor and "cgroup(mem=" in descriptor


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


@pytest.mark.skipif(not CgroupPool.available(), reason="writable v1 memory and pids cgroups are needed")
def test_stale_cgroups_of_dead_hosts_are_swept() -> None:
    # A host that died without aclose leaves its empty per-run cgroups behind.
    dead = subprocess.Popen([sys.executable, "-I", "-S", "-c", "pass"])
    dead.wait()
    roots = [os.path.join("/sys/fs/cgroup", h) for h in ("memory", "pids")]
    stale = [os.path.join(root, f"dsh-{dead.pid}-abc123-0") for root in roots]
    live = [os.path.join(root, f"dsh-{os.getpid()}-abc123-7") for root in roots]  # ours: kept
    other = [os.path.join(root, f"not-dsh-{dead.pid}") for root in roots]  # not a pool's: kept
    for path in stale + live + other:
        os.mkdir(path)
    try:
        removed = CgroupPool.sweep_stale()
        assert sorted(removed) == sorted(stale)
        assert not any(os.path.exists(p) for p in stale)
        assert all(os.path.exists(p) for p in live + other)
    finally:
        for path in stale + live + other:
            with contextlib.suppress(OSError):
                os.rmdir(path)
