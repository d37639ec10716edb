"""Session leases: one run at a time continues a session.

A run claims its session before it loads the history
(:meth:`~dsh_core.sessions.store.SessionStore.acquire`, or ``create(lease=...)``
for a new one) and releases it when it ends, however it ends. Two runs that
continued one session at once would each rebuild the same history, number
their calls alike and interleave their events in one log.

A lease names its holder: a random token (one per run, so two runs of one
process are told apart), the pid, the host name, the machine id, the kernel's
boot id, the pid namespace and the process's start time. A lease whose holder is gone must not
keep the session from being resumed: :func:`holder_alive` says whether a
holder may still be running. On the holder's host it checks the pid, and
guards against the pid having been reused since by comparing the process's
start time (``/proc/<pid>/stat``) and the boot id; a zombie counts as gone.
About a holder on another host (or in another pid namespace) it cannot tell,
and answers that it may be.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attrs import frozen

__all__ = ["SessionLease", "holder_alive", "boot_id", "machine_id", "pid_namespace", "process_start"]


def boot_id() -> str | None:
    """The kernel's boot id (Linux), new at every boot; ``None`` where there is none."""
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip() or None
    return None


def machine_id() -> str | None:
    """This machine's id (``/etc/machine-id``, systemd's), which outlives reboots; ``None`` where there is none.

    Host names alone do not tell machines apart: two machines sharing a session home may both be
    ``localhost``, and one would take the other's boot id for a reboot of its own.
    """
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            found = Path(path).read_text(encoding="ascii").strip()
            if found:
                return found
    return None


def pid_namespace() -> str | None:
    """This process's pid namespace (``pid:[4026531836]`` on Linux); ``None`` where there is none."""
    with contextlib.suppress(OSError):
        return os.readlink("/proc/self/ns/pid")
    return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time in clock ticks after boot)`` of ``pid`` from ``/proc``, or ``None``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)
    except (IndexError, ValueError):
        return None


def process_start(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot (``/proc``); ``None`` where that cannot be read."""
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


@frozen
class SessionLease:
    """Who holds a session: one run of one process on one host."""

    token: str
    pid: int
    host: str
    boot_id: str | None = None
    pid_ns: str | None = None
    #: The holder's start time in clock ticks after boot (guards against a reused pid).
    started: int | None = None
    #: When the lease was made (seconds since the epoch).
    since: float = 0.0
    #: The holder's machine id (:func:`machine_id`).
    machine: str | None = None

    @classmethod
    def for_this_run(cls) -> SessionLease:
        """A new lease held by this process, with a fresh token."""
        pid = os.getpid()
        return cls(
            secrets.token_hex(16),
            pid,
            socket.gethostname(),
            boot_id(),
            pid_namespace(),
            process_start(pid),
            time.time(),
            machine_id(),
        )

    @classmethod
    def unreadable(cls) -> SessionLease:
        """The stand-in for a stored lease record that cannot be read (corrupt or tampered).

        It names no run: no token, no process, no host. :attr:`readable` is ``False`` and
        :meth:`describe` says the record is unreadable rather than showing a pid and host.
        """
        return cls("", 0, "")

    @property
    def readable(self) -> bool:
        """``False`` only for :meth:`unreadable`'s stand-in: a lease made or read always has a pid above 0."""
        return self.pid > 0

    def to_json(self) -> dict[str, Any]:
        """The lease as a JSON object (what a store keeps)."""
        return {
            "token": self.token,
            "pid": self.pid,
            "host": self.host,
            "boot_id": self.boot_id,
            "pid_ns": self.pid_ns,
            "started": self.started,
            "since": self.since,
            "machine": self.machine,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SessionLease:
        """The lease of :meth:`to_json`'s object; :class:`ValueError` if it is not one.

        A pid no process can have or a ``since`` that is no time is not one either: a corrupt
        (or tampered) record then reads as unreadable, as the store treats one, instead of
        failing later in :meth:`describe` or :func:`holder_alive` with an ``OverflowError``.
        """
        try:
            pid = data["pid"]
            if not isinstance(pid, int) or isinstance(pid, bool):
                raise ValueError(f"pid {pid!r} is not an integer")
            if not 0 < pid <= _PID_MAX:
                raise ValueError(f"not a session lease: pid {pid} is no process id")
            since = float(data.get("since") or 0.0)
            if not _is_time(since):
                raise ValueError(f"not a session lease: since {since!r} is not a time")
            started = data.get("started")
            return cls(
                str(data["token"]),
                pid,
                str(data["host"]),
                _optional_str(data.get("boot_id")),
                _optional_str(data.get("pid_ns")),
                started if isinstance(started, int) and not isinstance(started, bool) else None,
                since,
                _optional_str(data.get("machine")),
            )
        except (KeyError, TypeError, OverflowError) as error:  # OverflowError: an integer too large for a float
            raise ValueError(f"not a session lease: {error}") from None

    def describe(self) -> str:
        """``pid 1234 on host 'box' since 2025-01-01 12:00:00`` (for :meth:`unreadable`, that it is unreadable)."""
        if not self.readable:
            return "an unreadable lease record (which run it was is unknown)"
        since = _format_time(self.since) if self.since else "an unknown time"
        return f"pid {self.pid} on host {self.host!r} since {since}"


#: The largest pid of any platform (``pid_t`` is a C ``int``): ``os.kill`` overflows past it.
_PID_MAX = 2**31 - 1


def _format_time(since: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))


def _is_time(since: float) -> bool:
    """Whether ``since`` is seconds since the epoch (or 0, unknown) that :meth:`SessionLease.describe` can show."""
    if not math.isfinite(since) or since < 0:
        return False
    try:
        _format_time(since)
    except (OverflowError, OSError, ValueError):  # past what the platform's time_t (or strftime) holds
        return False
    return True


def _optional_str(value: object) -> str | None:
    return None if value is None else str(value)


def holder_alive(holder: SessionLease) -> bool:
    """Whether ``holder`` may still be running (``False`` only when it surely is not).

    Gone: on this host (same host name and machine id, same pid namespace) the
    host rebooted since (another boot id), no process has the pid, it is a
    zombie, or it started at another time than the holder (the pid was reused).
    """
    if holder.host != socket.gethostname():
        return True  # another machine: its processes cannot be seen from here
    if holder.machine is not None and holder.machine != machine_id():
        return True  # another machine of the same name (its boot id is not this one's reboot)
    here = boot_id()
    if holder.boot_id is not None and here is not None and holder.boot_id != here:
        return False  # this host rebooted since: every process of that boot is gone
    namespace = pid_namespace()
    if holder.pid_ns is not None and namespace is not None and holder.pid_ns != namespace:
        return True  # another container's pids mean nothing here
    if holder.pid < 1:
        return False  # no process has it (and os.kill would signal a group)
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # EPERM: it exists, owned by another user
    stat = _proc_stat(holder.pid)
    if stat is None:
        return True  # no /proc: the pid exists, whether it is still the holder cannot be told
    state, started = stat
    if state in ("Z", "X"):
        return False  # exited, not yet reaped by its parent
    return holder.started is None or started == holder.started
