"""Isolation levels: what each one needs, how a zygote is launched for it, what the host verifies.

L0  process, empty env, private cwd, host-side kill of the process group.
L1  + rlimits (address space, CPU, files, file size, no core), PDEATHSIG,
    no-new-privs, empty capability bounding set.
L2  + Landlock (read-only interpreter prefix, nothing else; TCP denied;
    signal/abstract-unix scope) and the post-boot seccomp allowlist.
L3  + bubblewrap (new net/pid/mnt/ipc/uts namespaces, minimal read-only fs,
    private tmpfs per run), a real kernel uid 65534 with no capabilities, and
    a cgroup memory + pids cap per run.

The run's cgroups (also from L1 wherever the host can make them) are v1 ``memory`` and ``pids`` groups
made inside dsh's own group of each hierarchy, found through ``/proc/self/mountinfo``
(:func:`dsh_core.cgroups.own_group`): the limits of the deployment running dsh hold for its workers too.

What actually took effect is never assumed: the worker reports the steps
that succeeded, and the host appends what it reads in ``/proc`` for the
worker's host pid; :func:`check_level` refuses a worker whose verified state
is weaker than its level claims.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import re
import shutil
import sys

import attrs

from dsh_core.cgroups import own_group, sweep_stale, writable, write_file

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
#: Where :meth:`CgroupPool.own_groups` finds dsh's own groups (read at each call: tests point them elsewhere).
_MOUNTINFO = "/proc/self/mountinfo"
_PROC_CGROUP = "/proc/self/cgroup"


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
    """One per-run cgroup pair (memory + pids), reused across runs.

    Made as ``name`` inside ``own``, dsh's own (memory, pids) groups, so that the limits on those hold for
    the run as well. Where both controllers are mounted in one v1 hierarchy the two own groups are one
    directory, and so is the run's: made, joined and removed once.
    """

    def __init__(self, own: tuple[str, str], name: str, memory_bytes: int, pids: int) -> None:
        self.own = own
        self.memory = os.path.join(own[0], name)
        self.pids = os.path.join(own[1], name)
        self.groups = tuple(dict.fromkeys((self.memory, self.pids)))  # one where the controllers share a hierarchy
        self._pids_current = -1
        os.mkdir(self.memory)
        try:
            if self.pids != self.memory:
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
        for group in self.groups:
            write_file(os.path.join(group, "cgroup.procs"), str(pid))

    def leave(self, pid: int) -> None:
        """Move ``pid`` back to dsh's own groups (best effort)."""
        for group in dict.fromkeys(self.own):
            with contextlib.suppress(OSError):
                write_file(os.path.join(group, "cgroup.procs"), str(pid))

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
        for group in self.groups:
            with contextlib.suppress(OSError):
                os.rmdir(group)


#: The name of a pool's cgroup: ``dsh-<host pid>-<runtime id>-<n>``.
_POOL_GROUP = re.compile(r"dsh-(\d+)-[0-9a-f]+-\d+")


class CgroupPool:
    """Per-run cgroups of one runtime, created on demand and reused, inside dsh's own memory and pids groups.

    The own groups are found when the pool is made (:meth:`own_groups`) and kept: a worker leaving its
    run's group goes back there.
    """

    def __init__(self, prefix: str, memory_mb: int, pids: int = 64) -> None:
        self.prefix = prefix
        self.memory_bytes = memory_mb * 1024 * 1024
        self.pids = pids
        self.own = self.own_groups()
        self.free: list[Cgroup] = []
        self.all: list[Cgroup] = []

    @staticmethod
    def own_groups() -> tuple[str, str] | None:
        """dsh's own (memory, pids) v1 groups, in which the pool's groups are made; ``None`` without either.

        Each is found through the mount of its hierarchy that mountinfo lists, never assumed at the root
        of ``/sys/fs/cgroup/<controller>``: a worker moved to a hierarchy's root would leave the memory and
        pids limits of the deployment running dsh (a service held to 2 GiB). One directory twice where
        both controllers are mounted in one hierarchy.
        """
        memory = own_group("cgroup", "memory", _MOUNTINFO, _PROC_CGROUP)
        pids = own_group("cgroup", "pids", _MOUNTINFO, _PROC_CGROUP)
        return None if memory is None or pids is None else (memory, pids)

    @staticmethod
    def available() -> bool:
        """True when dsh's own v1 memory and pids groups are found and writable here (their ``cgroup.procs`` too)."""
        own = CgroupPool.own_groups()
        return own is not None and all(writable(group) for group in own)

    @staticmethod
    def sweep_stale() -> list[str]:
        """Remove empty per-run cgroups left by dsh processes that no longer exist.

        A host that dies without ``aclose`` takes its zygote and workers with it,
        but not its cgroup directories. Only directories in dsh's own groups named
        like a pool's (``dsh-<pid>-<id>-<n>``) whose ``<pid>`` is gone are touched,
        and only if empty (``rmdir`` refuses otherwise). Returns the paths removed.
        """
        own = CgroupPool.own_groups()
        return [] if own is None else sweep_stale(dict.fromkeys(own), _POOL_GROUP)

    def acquire(self) -> Cgroup:
        """A free cgroup (new if none); OSError when dsh's own groups were not found."""
        if self.free:
            return self.free.pop()
        if self.own is None:
            raise OSError(errno.ENOENT, "dsh's own memory and pids cgroups are not found")
        group = Cgroup(self.own, f"{self.prefix}-{len(self.all)}", self.memory_bytes, self.pids)
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
