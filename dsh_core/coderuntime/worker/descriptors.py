"""Descriptors between host, zygote and worker: those passed over a socket, and pidfds.

Standard library only: the zygote uses it to read the descriptors that come
with a message and to probe the kernel, the host to do the same and to learn
how a worker ended without waiting for the zygote to report it.

Where the zygote ignores ``SIGCHLD`` the kernel reaps each worker the moment
it exits (no zombie, nothing left for the zygote to do), and its wait status
is read from a pidfd opened while it was alive: ``PIDFD_GET_INFO`` with
``PIDFD_INFO_EXIT`` (Linux 6.15).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import signal
import socket
import struct

__all__ = ["exit_status", "kill", "pid_of", "received", "recorded_exit_status"]

_PIDFD_GET_INFO = 0xC040FF0B  # _IOWR(0xFF, 11, struct pidfd_info): its 64-byte first version
_PIDFD_INFO_EXIT = 1 << 3
_INFO_SIZE = 64
_EXIT_CODE_AT = 60  # offset of ``__s32 exit_code``


def exit_status(pidfd: int) -> int | None:
    """The wait status (as ``os.waitpid`` returns it) of the reaped process behind ``pidfd``.

    None while it has not been reaped, or where the kernel does not report it.
    """
    try:
        return recorded_exit_status(pidfd)
    except OSError:
        return None


def recorded_exit_status(pidfd: int) -> int | None:
    """Like :func:`exit_status`, but raise ``OSError`` where the kernel cannot report it.

    Before Linux 6.13 there is no ``PIDFD_GET_INFO``; before 6.15, once the
    process is reaped, it fails with ``ESRCH``. None: not reaped (or recorded) yet.
    """
    info = bytearray(_INFO_SIZE)
    struct.pack_into("=Q", info, 0, _PIDFD_INFO_EXIT)
    fcntl.ioctl(pidfd, _PIDFD_GET_INFO, info)
    (mask,) = struct.unpack_from("=Q", info, 0)
    if not mask & _PIDFD_INFO_EXIT:
        return None
    status: int = struct.unpack_from("=i", info, _EXIT_CODE_AT)[0]
    return status


def pid_of(pidfd: int) -> int:
    """The pid behind ``pidfd`` in this process's pid namespace; 0 or less once it is gone."""
    with open(f"/proc/self/fdinfo/{pidfd}") as handle:
        for line in handle:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    return -1


def received(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors that came with a message (``recvmsg``'s ancillary data), in order."""
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
    return fds


def kill(pidfd: int) -> None:
    """SIGKILL the process behind ``pidfd``; one that is already gone is not an error."""
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
