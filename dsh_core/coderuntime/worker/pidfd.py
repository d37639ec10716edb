"""Process descriptors: which process a pidfd names, and how it ended once the kernel reaped it.

Standard library only: the zygote uses it to probe the kernel, the host to
learn how a worker ended without waiting for the zygote to report it.

Where the zygote ignores ``SIGCHLD`` the kernel reaps each worker the moment
it exits (no zombie, nothing left for the zygote to do), and its wait status
is read from a pidfd opened while it was alive: ``PIDFD_GET_INFO`` with
``PIDFD_INFO_EXIT`` (Linux 6.15).
"""

from __future__ import annotations

import fcntl
import struct

__all__ = ["exit_status", "pid_of", "recorded_exit_status"]

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
