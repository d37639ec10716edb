"""Isolation levels: what each one needs, how a zygote is launched for it, what the host verifies.

L0  process, empty env, private cwd, host-side kill of the process group.
L1  + rlimits (address space, CPU, files, file size, no core), PDEATHSIG,
    no-new-privs, empty capability bounding set.
L2  + Landlock (read-only interpreter prefix, nothing else; TCP denied;
    signal/abstract-unix scope) and the post-boot seccomp allowlist.
L3  + bubblewrap (new net/pid/mnt/ipc/uts namespaces, minimal read-only fs,
    private tmpfs per run), a real kernel uid 65534 with no capabilities, and
    a cgroup memory + pids cap per run.

What actually took effect is never assumed: the worker reports the steps
that succeeded, and the host appends what it reads in ``/proc`` for the
worker's host pid; :func:`check_level` refuses a worker whose verified state
is weaker than its level claims.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import sys

import attrs

from dsh_core.cgroups import sweep_stale, write_file

__all__ = [
    "LEVELS",
    "ZygotePlan",
    "plan_for",
    "candidate_levels",
    "verify_proc",
    "check_level",
    "CgroupPool",
    "Cgroup",
    "WORKER_DIR",
    "usable_cpus",
]

LEVELS = (0, 1, 2, 3)
WORKER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker")
L3_NAMESPACES = ("net", "pid", "mnt", "ipc", "uts")
_NS_ORDER = ("user", "net", "pid", "mnt", "ipc", "uts", "cgroup")
_CGROUP_ROOT = "/sys/fs/cgroup"


@attrs.frozen
class ZygotePlan:
    """How to launch a zygote for one level."""

    level: int
    argv_prefix: tuple[str, ...]  # bwrap ... -- (empty below L3)
    interpreter: str
    ro_paths: tuple[str, ...]
    import_paths: tuple[str, ...]


def candidate_levels(requested: str) -> list[int]:
    """Levels to try, strongest first, at or below ``requested``."""
    top = 3 if requested == "auto" else int(requested[1])
    return list(range(top, -1, -1))


def _preload_paths(preload: tuple[str, ...]) -> list[str]:
    # Find the sys.path entry holding each preloaded top-level package, so the
    # ``-I -S`` zygote can import it without running ``site``.
    paths: list[str] = []
    for name in preload:
        top = name.split(".")[0]
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        locations = list(spec.submodule_search_locations or [])
        origin = spec.origin if spec.origin not in (None, "built-in", "frozen") else None
        target = locations[0] if locations else origin
        if target is None:
            continue
        # The sys.path entry that directly holds the package or module.
        parent = os.path.dirname(os.path.abspath(target))
        if parent not in paths:
            paths.append(parent)
    return paths


def plan_for(level: int, preload: tuple[str, ...]) -> ZygotePlan:
    """The launch plan of a zygote at ``level`` (raises OSError when impossible)."""
    interpreter = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    import_paths = _preload_paths(preload)
    ro = [prefix, os.path.realpath(WORKER_DIR), *[os.path.realpath(p) for p in import_paths]]
    if not interpreter.startswith(prefix + os.sep):
        ro.append(os.path.dirname(interpreter))
    argv: tuple[str, ...] = ()
    if level >= 3:
        bwrap = shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")
        if bwrap is None:
            raise OSError("bubblewrap (bwrap) is not installed")
        if os.geteuid() != 0:
            # Without root bwrap needs a user namespace, in which the kernel
            # uid stays ours: not the real unprivileged uid L3 promises.
            raise OSError("L3 needs root to give workers a real unprivileged uid")
        args = [
            bwrap,
            "--unshare-net",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--ro-bind",
            "/usr",
            "/usr",
        ]
        for link in ("lib", "lib64", "bin", "sbin"):
            if os.path.islink("/" + link):
                args += ["--symlink", os.readlink("/" + link), "/" + link]
        # The tmpfs goes first: bwrap mounts in order, so code living under /tmp (a checkout
        # there, a venv there) is bound on top of it instead of being hidden by it.
        args += ["--tmpfs", "/tmp"]
        for path in ro:
            if not path.startswith("/usr/"):
                args += ["--ro-bind", path, path]
        args += ["--proc", "/proc", "--dev", "/dev", "--chdir", "/tmp", "--cap-drop", "ALL"]
        # The zygote keeps only what each child needs before it drops to uid
        # 65534: a private /tmp mount and the uid/gid change; CAP_KILL lets it
        # kill (and so reap) a worker that already dropped to uid 65534.
        for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_SYS_ADMIN", "CAP_KILL"):
            args += ["--cap-add", cap]
        args.append("--")
        argv = tuple(args)
    return ZygotePlan(level, argv, interpreter, tuple(ro), tuple(import_paths))


def verify_proc(pid: int) -> dict[str, str]:
    """What the host sees of ``pid``: kernel uids, CapEff, NoNewPrivs, seccomp, new namespaces."""
    facts = {"kuid": "?", "CapEff": "?", "NoNewPrivs": "?", "seccomp": "?", "new-ns": "?"}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            value = value.strip()
            if key == "Uid":
                facts["kuid"] = "/".join(value.split()[:3])
            elif key == "CapEff":
                facts["CapEff"] = value
            elif key == "NoNewPrivs":
                facts["NoNewPrivs"] = value
            elif key == "Seccomp":
                facts["seccomp"] = {"0": "off", "1": "strict", "2": "filter"}.get(value, value)
    fresh = []
    for ns in _NS_ORDER:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"):
                fresh.append(ns)
    facts["new-ns"] = ",".join(fresh) or "none"
    return facts


def suffix(facts: dict[str, str]) -> str:
    """The host-verified descriptor suffix."""
    return "[host-verified " + " ".join(f"{k}={v}" for k, v in facts.items()) + "]"


def check_level(level: int, facts: dict[str, str]) -> str | None:
    """None when the verified facts back the level's claims, else the reason."""
    if level >= 1 and facts["NoNewPrivs"] != "1":
        return "no-new-privs is not set"
    if level >= 2 and facts["seccomp"] != "filter":
        return "no seccomp filter is installed"
    if level >= 3:
        if facts["kuid"] != "65534/65534/65534":
            return f"kernel uid is {facts['kuid']}, not 65534"
        if facts["CapEff"].strip("0") != "":
            return f"capabilities remain ({facts['CapEff']})"
        missing = set(L3_NAMESPACES) - set(facts["new-ns"].split(","))
        if missing:
            return f"namespaces not unshared: {','.join(sorted(missing))}"
    return None


def _cgroup_cpu_limit(proc_cgroup: str, root: str) -> int | None:
    """Whole CPUs allowed by the tightest CPU quota on this process's cgroup and its ancestors.

    None without a quota (or without a readable cgroup file system). A container limited with
    ``docker run --cpus`` keeps every CPU in its affinity mask: only the quota says how much
    CPU time it may take at once.
    """
    try:
        with open(proc_cgroup) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    limit: float | None = None
    for line in lines:
        hierarchy, _, path = line.partition(":")[2].partition(":")
        if hierarchy == "":  # v2: "0::/path", cpu.max holds "quota period" or "max period"
            base, names = root, ["cpu.max"]
        elif "cpu" in hierarchy.split(","):  # v1: the cpu controller's CFS quota (-1: none)
            base, names = os.path.join(root, hierarchy), ["cpu.cfs_quota_us", "cpu.cfs_period_us"]
        else:
            continue
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):  # the quota of any ancestor binds too
            directory = os.path.join(base, *parts[:depth])
            try:
                fields: list[str] = []
                for name in names:
                    with open(os.path.join(directory, name)) as handle:
                        fields += handle.read().split()
                quota, period = float(fields[0]), float(fields[1])
            except (OSError, IndexError, ValueError):  # absent, or "max": no quota here
                continue
            if quota > 0 and period > 0:
                limit = quota / period if limit is None else min(limit, quota / period)
    return None if limit is None else max(1, int(limit))


def usable_cpus(proc_cgroup: str = "/proc/self/cgroup", root: str = _CGROUP_ROOT) -> int:
    """The CPUs this process may keep busy at once: its affinity mask, bounded by a CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # refused by a sandbox, or not Linux: importing must not fail
        cpus = os.cpu_count() or 1
    limit = _cgroup_cpu_limit(proc_cgroup, root)
    return cpus if limit is None else min(cpus, limit)


# --------------------------------------------------------------------------- cgroups (v1)


class Cgroup:
    """One per-run cgroup pair (memory + pids), reused across runs."""

    def __init__(self, name: str, memory_bytes: int, pids: int) -> None:
        self.memory = os.path.join(_CGROUP_ROOT, "memory", name)
        self.pids = os.path.join(_CGROUP_ROOT, "pids", name)
        self._pids_current = -1
        os.mkdir(self.memory)
        try:
            os.mkdir(self.pids)
            write_file(os.path.join(self.memory, "memory.limit_in_bytes"), str(memory_bytes))
            write_file(os.path.join(self.pids, "pids.max"), str(pids))
            # Held open: a pread of it answers "is anything left?" in microseconds, where
            # opening and reading ``cgroup.procs`` costs 0.1 ms or more in every run.
            self._pids_current = os.open(os.path.join(self.pids, "pids.current"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self.remove()
            raise
        self.oom_base = 0

    def join(self, pid: int) -> None:
        """Move ``pid`` into both groups and note the OOM-kill baseline."""
        self.oom_base = self.oom_kills()
        write_file(os.path.join(self.memory, "cgroup.procs"), str(pid))
        write_file(os.path.join(self.pids, "cgroup.procs"), str(pid))

    def leave(self, pid: int) -> None:
        """Move ``pid`` back to both hierarchies' roots (best effort)."""
        for hierarchy in ("memory", "pids"):
            with contextlib.suppress(OSError):
                write_file(os.path.join(_CGROUP_ROOT, hierarchy, "cgroup.procs"), str(pid))

    def oom_kills(self) -> int:
        """The cgroup's OOM-kill counter."""
        try:
            with open(os.path.join(self.memory, "memory.oom_control")) as handle:
                for line in handle:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    def kill_all(self) -> int:
        """SIGKILL every process still in the group (nothing should be); return how many were found.

        The pids hierarchy alone is read: ``join`` puts a worker in both
        groups and its descendants inherit both, while the worker has no write
        access to any ``cgroup.procs`` to leave. The group's task count is
        read first, so an empty group (every run's case) costs one ``pread``.
        """
        try:
            if int(os.pread(self._pids_current, 32, 0)) == 0:
                return 0
        except (OSError, ValueError):
            pass  # read the list instead
        try:
            with open(os.path.join(self.pids, "cgroup.procs")) as handle:
                pids = [int(x) for x in handle.read().split()]
        except OSError:
            return -1  # unknown, not empty
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        return len(pids)

    def remove(self) -> None:
        """Delete both groups (they must be empty)."""
        if self._pids_current >= 0:
            os.close(self._pids_current)
            self._pids_current = -1
        for group in (self.memory, self.pids):
            with contextlib.suppress(OSError):
                os.rmdir(group)


#: The name of a pool's cgroup: ``dsh-<host pid>-<runtime id>-<n>``.
_POOL_GROUP = re.compile(r"dsh-(\d+)-[0-9a-f]+-\d+")


class CgroupPool:
    """Per-run cgroups of one runtime, created on demand and reused."""

    def __init__(self, prefix: str, memory_mb: int, pids: int = 64) -> None:
        self.prefix = prefix
        self.memory_bytes = memory_mb * 1024 * 1024
        self.pids = pids
        self.free: list[Cgroup] = []
        self.all: list[Cgroup] = []

    @staticmethod
    def available() -> bool:
        """True when v1 memory and pids hierarchies are writable here."""
        return os.access(os.path.join(_CGROUP_ROOT, "memory"), os.W_OK) and os.access(
            os.path.join(_CGROUP_ROOT, "pids"), os.W_OK
        )

    @staticmethod
    def sweep_stale() -> list[str]:
        """Remove empty per-run cgroups left by dsh processes that no longer exist.

        A host that dies without ``aclose`` takes its zygote and workers with it,
        but not its cgroup directories. Only directories named like a pool's
        (``dsh-<pid>-<id>-<n>``) whose ``<pid>`` is gone are touched, and only
        if empty (``rmdir`` refuses otherwise). Returns the paths removed.
        """
        return sweep_stale([os.path.join(_CGROUP_ROOT, h) for h in ("memory", "pids")], _POOL_GROUP)

    def acquire(self) -> Cgroup:
        """A free cgroup (new if none)."""
        if self.free:
            return self.free.pop()
        group = Cgroup(f"{self.prefix}-{len(self.all)}", self.memory_bytes, self.pids)
        self.all.append(group)
        return group

    def release(self, group: Cgroup) -> None:
        """Return an (empty) cgroup to the pool."""
        self.free.append(group)

    def close(self) -> None:
        """Remove every cgroup of the pool."""
        for group in self.all:
            group.kill_all()
            group.remove()
        self.all.clear()
        self.free.clear()
