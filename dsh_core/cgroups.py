"""cgroup helpers shared by the Code Mode runtime and the ``bash`` tool.

The runtime's per-run memory + pids groups live in :mod:`dsh_core.coderuntime.isolation`; what they
share with the per-command groups here is where they are made, in dsh's own group of each hierarchy
(:func:`own_group`, found through mountinfo), the writing, and the sweep of groups left by a dsh that
died (:func:`sweep_stale`: their names carry the owner's pid).

A per-command group (:class:`CommandGroup`, made by :class:`CommandCgroups`) follows every process a
command starts, whatever session or process group it moves to (``setsid``, a double-forking daemon),
so that killing the group kills all of it. The command may make groups inside its own and move
processes there (a dsh run through ``bash`` does): the group is a tree, killed whole and removed
bottom-up. Two kinds of hierarchy are used, best first:

* cgroup v2 (a pure v2 host, or the ``unified`` mount of a hybrid one), with ``cgroup.kill``
  (Linux 5.14): the group is made under dsh's own v2 group, and one write kills every member of
  the tree at once, even one forking meanwhile;
* the v1 ``pids`` hierarchy: the group is made under dsh's own pids group (so dsh's pids limit holds
  for the command too); v1 has no ``cgroup.kill``: ``pids.max`` is set to 0 throughout the tree (no
  member forks from then on), then SIGKILL rounds over the ``cgroup.procs`` of every group of the
  tree go on until they are all empty, within a bound (:data:`KILL_WITHIN_S`, 2 s).

The command joins its group itself, between fork and exec (:meth:`CommandGroup.joiner`). A group
still busy after its kill is kept and removed later (:meth:`CommandCgroups.discard`,
:meth:`CommandCgroups.close`); the groups a dsh that died left are removed where no process is left
in them (:meth:`CommandCgroups.sweep_stale`).

Either group is found through the hierarchy's mount that ``/proc/self/mountinfo`` lists (a container
may see only its own subtree, mounted anywhere). Neither is used unless dsh can write it (as root, or
in a delegated v2 subtree); without one, :meth:`CommandCgroups.probe` says so and the caller keeps to
what it did before. Not a sandbox: a
command running as root can write its own pid to another group's ``cgroup.procs`` and leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import os
import re
import signal
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import ClassVar, Final

import attrs

from dsh_core.processes import signal_if

__all__ = [
    "write_file",
    "subtree",
    "remove_tree",
    "sweep_stale",
    "own_group",
    "writable",
    "Hierarchy",
    "hierarchies",
    "CommandCgroups",
    "CommandGroup",
]

#: Why a hierarchy refuses a group for good (dsh may not write it, it is read-only or gone, a v2 one has no
#: ``cgroup.kill``); any other refusal (EAGAIN at ``cgroup.max.descendants``, ENOMEM, ENOSPC) may pass.
_LASTING_REFUSALS: Final = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.EOPNOTSUPP})

#: Seconds a v1 group's SIGKILL rounds (and a v2 group's emptying after ``cgroup.kill``) may take.
KILL_WITHIN_S = 2.0


def write_file(path: str, text: str) -> None:
    """Write ``text`` to the cgroup file ``path`` in one ``write`` (the kernel reads each write whole)."""
    with open(path, "w") as handle:
        handle.write(text)


def subtree(path: str) -> list[str]:
    """``path`` and every group below it, each before its parent (the order they can be removed in).

    Walked without recursion: a command may nest groups deeper than Python's recursion limit.
    """
    found: list[str] = []
    stack = [path]
    while stack:
        group = stack.pop()
        found.append(group)
        with contextlib.suppress(OSError), os.scandir(group) as entries:
            stack.extend(entry.path for entry in entries if entry.is_dir(follow_symlinks=False))
    found.reverse()  # a parent was found before everything below it
    return found


def remove_tree(path: str) -> bool:
    """Delete the group ``path`` and the groups below it, bottom-up; True when ``path`` is gone.

    ``rmdir`` refuses a group that still has a task or a group in it: a busy group below keeps its
    ancestors, and the rest of the tree is removed.
    """
    for group in subtree(path):
        with contextlib.suppress(OSError):
            os.rmdir(group)
    return not os.path.lexists(path)


def sweep_stale(roots: Iterable[str], pattern: re.Pattern[str], *, subgroups: bool = False) -> list[str]:
    """Remove the empty groups under ``roots`` that a dsh process which no longer exists left behind.

    Only directories whose name ``pattern`` matches whole, with the owner's pid as its first group,
    are touched, and only when that pid is gone and the group is empty (``rmdir`` refuses a group
    with a task or a group in it). With ``subgroups`` (groups whose members may make groups inside
    them: the ``bash`` tool's), each is removed with the groups below it, bottom-up, when no task is
    left anywhere in that tree (the empty groups below a busy one are removed all the same). Nothing
    is killed. Returns the paths removed.
    """
    removed: list[str] = []
    for root in roots:
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            match = pattern.fullmatch(name)
            if match is None or os.path.exists(f"/proc/{match.group(1)}"):
                continue
            path = os.path.join(root, name)
            if subgroups:
                if remove_tree(path):
                    removed.append(path)
                continue
            with contextlib.suppress(OSError):
                os.rmdir(path)
                removed.append(path)
    return removed


@attrs.frozen
class Hierarchy:
    """A directory in which dsh may make per-command groups, and how a group there is killed."""

    parent: str
    version: int  # 2: cgroup v2, killed through cgroup.kill; 1: the v1 pids hierarchy, killed by rounds


def _unescape(field: str) -> str:
    """A mountinfo path field as the path it is: the kernel writes a space, tab, newline and backslash
    in it as an octal escape (``\\040``), so that the fields stay split by spaces."""
    return re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape.group(1), 8)), field)


def own_group(
    fstype: str,
    controller: str | None,
    mountinfo: str = "/proc/self/mountinfo",
    proc_cgroup: str = "/proc/self/cgroup",
) -> str | None:
    """The directory of this process's own group in one hierarchy, found through its mount (``None``: none).

    ``fstype`` ``cgroup2`` with ``controller`` ``None``: the v2 hierarchy (its ``0::`` line); ``cgroup``
    with a controller: the v1 hierarchy that controller is mounted in (its ``N:a,b:`` line names it, and
    so do the mount's super options, ``rw,pids``). Of several mounts showing the group, a read-write one
    is taken before a read-only one, and of those the one whose root is topmost (the first listed among equals).
    """
    try:
        with open(proc_cgroup) as handle:
            lines = [line.rstrip("\n").split(":", 2) for line in handle]
        with open(mountinfo) as handle:
            mounts = [line.split() for line in handle]
    except OSError:
        return None
    own = next(
        (
            fields[2]
            for fields in lines
            if len(fields) == 3
            and (fields[:2] == ["0", ""] if controller is None else controller in fields[1].split(","))
        ),
        None,
    )
    if own is None:
        return None
    shown: list[tuple[bool, int, str]] = []  # (read-only, depth of the mount's root, own group there)
    for fields in mounts:
        dash = fields.index("-") if "-" in fields else -1
        if dash < 0 or fields[dash + 1 : dash + 2] != [fstype]:
            continue
        options = fields[dash + 3] if len(fields) > dash + 3 else ""
        if controller is not None and controller not in options.split(","):
            continue
        # A mount may show a subtree only (a container sharing the host's cgroup namespace, Docker's
        # default on a v1 host): the own path is then the mount's root followed by the part under the
        # mount point. The mount point is read, never assumed (/sys/fs/cgroup/pids is only the usual one).
        root, point = _unescape(fields[3]).rstrip("/"), _unescape(fields[4])
        if own == root or own.startswith(root + "/"):
            read_only = "ro" in fields[5].split(",") or "ro" in options.split(",")  # the mount's, the superblock's
            shown.append(
                (read_only, root.count("/"), os.path.normpath(os.path.join(point, own[len(root) :].lstrip("/"))))
            )
    # The same hierarchy may be mounted more than once (a read-only bind for a container, a subtree): a
    # writable mount first, then the topmost root; min() keeps the first listed among equals.
    return min(shown, key=lambda mount: mount[:2])[2] if shown else None


def writable(group: str) -> bool:
    """Whether dsh may make groups in ``group`` and move processes into it (write its ``cgroup.procs``)."""
    return os.access(group, os.W_OK) and os.access(os.path.join(group, "cgroup.procs"), os.W_OK)


def hierarchies(mountinfo: str = "/proc/self/mountinfo", proc_cgroup: str = "/proc/self/cgroup") -> list[Hierarchy]:
    """The hierarchies dsh can make per-command groups in here, best first (empty: none).

    Each is dsh's own group, found from its line in ``proc_cgroup`` and the mount that shows it in
    ``mountinfo``: a hierarchy not mounted, or mounted without dsh's group in it, is none.
    """
    found: list[Hierarchy] = []
    # Moving a process needs write access to the cgroup.procs of the common ancestor: dsh's own group.
    # v1: in dsh's own pids group, not at the hierarchy's root: its pids limit (a service's) holds for the
    # commands too.
    for version, fstype, controller in ((2, "cgroup2", None), (1, "cgroup", "pids")):
        own = own_group(fstype, controller, mountinfo, proc_cgroup)
        if own is not None and writable(own):
            found.append(Hierarchy(own, version))
    return found


def _join(procs_fd: int) -> None:
    """The ``preexec_fn`` of :meth:`CommandGroup.joiner`: move the calling (forked) process into the group.

    Writing 0 to ``cgroup.procs`` moves the writer itself. A refused move (the group was removed, the
    host forbids it) runs the command outside the group: the caller still kills the command's session
    as it did before cgroups, so a refused join costs the containment of setsid'd processes, never the call.
    """
    # A bare try, not contextlib.suppress: no context manager object made and entered in the child.
    try:  # noqa: SIM105
        os.write(procs_fd, b"0")
    except OSError:
        pass


class CommandGroup:
    """One command's fresh cgroup: join it from the start (:meth:`joiner`), kill all in it, remove it."""

    def __init__(self, hierarchy: Hierarchy, name: str) -> None:
        self.hierarchy = hierarchy
        self.name = name
        self.path = os.path.join(hierarchy.parent, name)
        self.procs = os.path.join(self.path, "cgroup.procs")
        os.mkdir(self.path)
        if hierarchy.version == 2 and not os.path.exists(os.path.join(self.path, "cgroup.kill")):
            os.rmdir(self.path)  # a kernel before 5.14: no way to kill the group whole
            raise OSError(errno.EOPNOTSUPP, f"{hierarchy.parent} has no cgroup.kill (Linux 5.14 or later is needed)")
        self.seen: set[int] = set()  # every member ever listed, for the caller to reap
        self.killed = False  # v2: cgroup.kill was written

    @contextlib.contextmanager
    def joiner(self) -> Iterator[Callable[[], None] | None]:
        """A ``preexec_fn`` that moves the child into the group, for a spawn inside this context.

        The child joins between ``fork`` and ``exec``: the process that becomes the command is in the
        group before the command's first instruction, so nothing it forks can escape. The group's
        ``cgroup.procs`` is opened here, in dsh (close-on-exec: no other spawn inherits it), and closed
        when the context ends. ``None`` when it cannot be opened (the group is gone): the command then
        runs outside the group, as after a refused join.

        What a ``preexec_fn`` brings with it. Python code in the fork of a threaded process is documented
        as unsafe; CPython runs for it the protocol it runs around ``os.fork``: in the parent, on the
        thread that spawns (the event loop's), the import lock and every ``before`` hook registered with
        ``os.register_at_fork`` (logging's module lock and ``concurrent.futures``' shutdown lock among
        them: the spawn waits while another thread holds one); in the child, the interpreter's own
        reinitialisation and every ``after_in_child`` hook (threading's, logging's lock re-creation,
        ``random``'s reseeding, and any a third-party module registered), and only then :func:`_join`,
        one ``os.write`` on a descriptor opened beforehand. The standard library's child hooks re-create
        the locks they use rather than wait on them; a third-party hook runs there unchecked.

        What it costs: ``subprocess`` uses ``vfork`` only without a ``preexec_fn``, so each spawn is a
        full ``fork`` that copies dsh's page tables, on the event loop's thread: about 22 µs per MiB of
        dsh's memory as measured (some 1 ms for a 50 MiB dsh, 25 ms for 1 GiB). Under
        ``vm.overcommit_memory=2`` the fork of a large dsh may fail with ENOMEM, where ``vfork`` would
        not: the call then fails as a shell that cannot start does (``could not start ...: Cannot
        allocate memory``).

        Why not a shell that joins and then ``exec``s the command (what dsh did first): the shell
        rewrites the environment it passes on (a POSIX shell drops the names it cannot represent,
        ``a.b``, ``X-Y``, and bash's exported functions; it sets PWD, IFS, OPTIND and SHLVL), and the
        configured shell failing to start became the wrapper's exit code (127, 126) or a script run by
        the wrapper, instead of the error the spawn reports without a cgroup.
        """
        try:
            fd = os.open(self.procs, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            yield None
            return
        try:
            yield functools.partial(_join, fd)
        finally:
            os.close(fd)

    def members(self) -> list[int]:
        """The pids in the group and the groups below it now (zombies are not listed); noted in :attr:`seen`.

        A command (as root, or in a delegated v2 subtree) may make groups inside its own and move
        processes there: dsh run through ``bash`` does. A v1 group's ``cgroup.procs`` lists its own
        members only, so every group of the tree is read.
        """
        pids: list[int] = []
        for group in subtree(self.path):
            try:
                with open(os.path.join(group, "cgroup.procs")) as handle:
                    pids += [int(pid) for pid in handle.read().split()]
            except (OSError, ValueError):
                continue
        self.seen.update(pids)
        return pids

    def signal(self, signum: int) -> int:
        """Send ``signum`` to every member; return how many were listed."""
        pids = self.members()
        for pid in pids:
            self._signal_member(pid, signum)
        return len(pids)

    def _signal_member(self, pid: int, signum: int) -> None:
        signal_if(pid, signum, self._inside)

    def _inside(self, pid: int) -> bool:
        """Whether ``pid`` is in the group or one below it now."""
        try:
            with open(f"/proc/{pid}/cgroup") as handle:
                return any(f"/{self.name}/" in line.rstrip("\n") + "/" for line in handle)
        except OSError:
            return False

    def kill_now(self) -> None:
        """SIGKILL the group without waiting: v2's ``cgroup.kill`` (the groups below it too), or one v1 round.

        v2: written once per group. The kernel kills every member of the tree, and a fork in progress
        too, so nothing is left in it to kill again. v1: each round first sets ``pids.max`` to 0 in the
        group and every group below it (a fork fails from then on, so no member starts another between a
        listing and its SIGKILL), then signals every member listed.
        """
        self.members()  # noted for reaping before they die (a dead member is no longer listed)
        if self.hierarchy.version == 2:
            if not self.killed:
                self.killed = True
                with contextlib.suppress(OSError):
                    write_file(os.path.join(self.path, "cgroup.kill"), "1")
            return
        for group in subtree(self.path):
            with contextlib.suppress(OSError):
                write_file(os.path.join(group, "pids.max"), "0")
        self.signal(signal.SIGKILL)

    async def kill(self, within_s: float | None = None) -> bool:
        """SIGKILL every member until none is left, then delete the group, within ``within_s`` (by default
        :data:`KILL_WITHIN_S`, read at the call); True when gone.

        No member can fork once the kill began (v2's ``cgroup.kill``; v1's ``pids.max`` of 0); v1's
        rounds go on until a listing is empty all the same (a process moved in from outside). Either
        way a member that is no longer listed may still be exiting, and the group's removal waits for that.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (KILL_WITHIN_S if within_s is None else within_s)
        self.kill_now()
        while True:
            if not self.members() and self.remove():
                return True
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.005)
            if self.hierarchy.version == 1:
                self.signal(signal.SIGKILL)

    def remove(self) -> bool:
        """Delete the group and the groups below it, bottom-up (no task may be left); True when it is gone."""
        return remove_tree(self.path)


class CommandCgroups:
    """Makes a fresh group per command, named ``<prefix>-<dsh pid>-<n>``, in the best hierarchy that works."""

    _swept: ClassVar[set[str]] = set()  # prefixes whose stale groups this process swept already
    _numbers: ClassVar[Iterator[int]] = itertools.count()  # one count per process: two rows never share a name

    def __init__(self, prefix: str, found: Sequence[Hierarchy]) -> None:
        self.prefix = prefix
        self.hierarchies = list(found)
        self.pattern = re.compile(re.escape(prefix) + r"-(\d+)-\d+")
        self.pending: list[CommandGroup] = []  # groups a removal left behind (a member outlived the kill)
        self.active: list[CommandGroup] = []  # groups made and not discarded yet: their calls are running
        self.closed = False

    @classmethod
    def probe(cls, prefix: str) -> CommandCgroups | None:
        """The groups of ``prefix`` where a writable hierarchy exists, else ``None``.

        Sweeps the groups of ``prefix`` left by dsh processes that no longer exist, once per process.
        """
        found = hierarchies()
        if not found:
            return None
        made = cls(prefix, found)
        if prefix not in cls._swept:
            cls._swept.add(prefix)
            made.sweep_stale()
        return made

    def sweep_stale(self) -> list[str]:
        """Remove the groups of this prefix whose owner pid is gone, with the groups below them, where no
        task is left in them; return their paths."""
        return sweep_stale([h.parent for h in self.hierarchies], self.pattern, subgroups=True)

    def create(self) -> CommandGroup | None:
        """A new, empty group (``None`` when no hierarchy will make one: the caller goes without).

        Asked best first. A hierarchy that refuses for good (:data:`_LASTING_REFUSALS`: not writable, gone,
        no ``cgroup.kill``) is not asked again by this instance; one that refuses for now (EAGAIN at its
        ``cgroup.max.descendants``, ENOMEM, ENOSPC) is passed over for this group only. After :meth:`close`
        none is made.
        """
        self.pending = [group for group in self.pending if not group.remove()]
        if self.closed:
            return None
        for hierarchy in list(self.hierarchies):
            while True:
                try:
                    group = CommandGroup(hierarchy, f"{self.prefix}-{os.getpid()}-{next(self._numbers)}")
                except FileExistsError:  # left by a dead dsh that had this pid, still busy: the next number
                    continue
                except OSError as error:
                    if error.errno in _LASTING_REFUSALS:
                        self.hierarchies.remove(hierarchy)
                    break
                self.active.append(group)
                return group
        return None

    def discard(self, group: CommandGroup) -> None:
        """Remove ``group``, or keep it to retry at the next :meth:`create` and at :meth:`close`.

        A group is still busy here when the call's own kill was cut short (a second cancellation):
        its members had their SIGKILL but may not have exited yet. After :meth:`close` a group is gone
        already (close killed and removed it), unless close's kill ran out of time too: it is then
        among the ones :attr:`pending` names, which nothing retries.
        """
        with contextlib.suppress(ValueError):
            self.active.remove(group)
        if not group.remove() and group not in self.pending:
            self.pending.append(group)

    async def close(self) -> None:
        """Kill and remove every group left: the ones :meth:`discard` kept, and those of the calls still
        running (the owner's scope ends: nothing it started may outlive it, and a call that ends after
        this must find no group of its own to leave behind). No group is made afterwards. :attr:`pending`
        then names, once each, the groups still there (a member outlived the kill), a call's
        :meth:`discard` during the kills included."""
        self.closed = True
        groups, self.pending = [*self.pending, *self.active], []
        for group, gone in zip(groups, await asyncio.gather(*(group.kill() for group in groups)), strict=True):
            # A call that ended during the kills discarded its group, and kept it in pending if still busy.
            if gone:
                with contextlib.suppress(ValueError):
                    self.pending.remove(group)
            elif group not in self.pending:
                self.pending.append(group)
