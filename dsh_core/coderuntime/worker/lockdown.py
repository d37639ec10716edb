"""In-child lockdown steps for isolation levels L1-L3 (standard library + ctypes).

Each step returns a short descriptor fragment only when it actually took
effect; the caller joins the fragments into the worker's self-reported
isolation descriptor (the host then appends what it verified in ``/proc``).

Order matters (see reference/sandbox-limits.md section 3, gotcha 2):
namespaces/tmpfs while still privileged, bounding set, then the uid drop
(PDEATHSIG is cleared by setuid, so it comes after), rlimits, no-new-privs,
Landlock, and the seccomp allowlist last, after the event loop exists.
"""

from __future__ import annotations

import ctypes
import os
import resource
import struct

__all__ = [
    "libc",
    "private_tmp",
    "drop_bounding_set",
    "drop_uid",
    "set_pdeathsig",
    "set_no_new_privs",
    "apply_rlimits",
    "landlock_abi",
    "apply_landlock",
    "apply_seccomp",
    "UNPRIVILEGED_UID",
]

UNPRIVILEGED_UID = 65534  # "nobody"

libc = ctypes.CDLL(None, use_errno=True)
_syscall = libc.syscall
_syscall.restype = ctypes.c_long
_prctl = libc.prctl
_prctl.restype = ctypes.c_int
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

PR_SET_PDEATHSIG = 1
PR_SET_SECCOMP = 22
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
CLONE_NEWNS = 0x00020000
MS_NOSUID = 2
MS_NODEV = 4

# x86_64 syscall numbers
NR = {
    "read": 0,
    "write": 1,
    "close": 3,
    "fstat": 5,
    "poll": 7,
    "lseek": 8,
    "mmap": 9,
    "mprotect": 10,
    "munmap": 11,
    "brk": 12,
    "rt_sigaction": 13,
    "rt_sigprocmask": 14,
    "rt_sigreturn": 15,
    "pread64": 17,
    "pwrite64": 18,
    "readv": 19,
    "writev": 20,
    "select": 23,
    "sched_yield": 24,
    "mremap": 25,
    "madvise": 28,
    "nanosleep": 35,
    "getitimer": 36,
    "alarm": 37,
    "setitimer": 38,
    "getpid": 39,
    "sendto": 44,
    "recvfrom": 45,
    "shutdown": 48,
    "clone": 56,
    "exit": 60,
    "kill": 62,
    "uname": 63,
    "gettimeofday": 96,
    "getrlimit": 97,
    "getrusage": 98,
    "sysinfo": 99,
    "times": 100,
    "getuid": 102,
    "getgid": 104,
    "geteuid": 107,
    "getegid": 108,
    "getppid": 110,
    "getpgrp": 111,
    "getgroups": 115,
    "getresuid": 118,
    "getresgid": 120,
    "getpgid": 121,
    "getsid": 124,
    "sigaltstack": 131,
    "gettid": 186,
    "futex": 202,
    "sched_getaffinity": 204,
    "set_tid_address": 218,
    "clock_gettime": 228,
    "clock_getres": 229,
    "clock_nanosleep": 230,
    "exit_group": 231,
    "epoll_wait": 232,
    "epoll_ctl": 233,
    "tgkill": 234,
    "pselect6": 270,
    "ppoll": 271,
    "set_robust_list": 273,
    "epoll_pwait": 281,
    "prlimit64": 302,
    "getrandom": 318,
    "rseq": 334,
    "clone3": 435,
    "epoll_pwait2": 441,
    "landlock_create_ruleset": 444,
    "landlock_add_rule": 445,
    "landlock_restrict_self": 446,
}

#: Syscalls allowed unconditionally after boot: pure compute, memory, clocks,
#: threads' bookkeeping, the event loop on already-open descriptors, exit.
#: Everything that creates a descriptor, a process or touches a path is absent.
PLAIN_ALLOWED = (
    "read",
    "write",
    "close",
    "fstat",
    "poll",
    "lseek",
    "mmap",
    "mprotect",
    "munmap",
    "brk",
    "rt_sigaction",
    "rt_sigprocmask",
    "rt_sigreturn",
    "pread64",
    "pwrite64",
    "readv",
    "writev",
    "select",
    "sched_yield",
    "mremap",
    "nanosleep",
    "getitimer",
    "alarm",
    "setitimer",
    "getpid",
    "sendto",
    "recvfrom",
    "shutdown",
    "exit",
    "uname",
    "gettimeofday",
    "getrlimit",
    "getrusage",
    "sysinfo",
    "times",
    "getuid",
    "getgid",
    "geteuid",
    "getegid",
    "getppid",
    "getpgrp",
    "getgroups",
    "getresuid",
    "getresgid",
    "getpgid",
    "getsid",
    "sigaltstack",
    "gettid",
    "futex",
    "sched_getaffinity",
    "set_tid_address",
    "clock_gettime",
    "clock_getres",
    "clock_nanosleep",
    "exit_group",
    "epoll_wait",
    "epoll_ctl",
    "pselect6",
    "ppoll",
    "set_robust_list",
    "epoll_pwait",
    "getrandom",
    "rseq",
    "epoll_pwait2",
)


def _check(result: int, what: str) -> None:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def private_tmp() -> str:
    """New mount namespace with a fresh tmpfs on /tmp as the cwd (needs CAP_SYS_ADMIN)."""
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(
        libc.mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, b"size=16m,mode=0700"),
        "mount tmpfs /tmp",
    )
    return "tmpfs(/tmp,private)"


def drop_bounding_set() -> str:
    """Drop every capability from the bounding set (needs CAP_SETPCAP)."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as handle:
            last = int(handle.read())
    except OSError:
        last = 40
    for cap in range(last + 1):
        _check(_prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"PR_CAPBSET_DROP({cap})")
    return "capbset=0"


def drop_uid(uid: int = UNPRIVILEGED_UID) -> str:
    """Become a real unprivileged kernel uid (and gid) with no supplementary groups."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid):
        raise OSError("setresuid did not take effect")
    return f"setuid({uid})"


def set_pdeathsig(parent: int) -> str:
    """SIGKILL this process when its parent (the zygote) dies."""
    _check(_prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "PR_SET_PDEATHSIG")
    if os.getppid() != parent:  # the parent died before the flag was set
        os._exit(70)
    return "pdeathsig"


def set_no_new_privs() -> str:
    """Forbid gaining privileges through exec (required by Landlock and seccomp)."""
    _check(_prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    return "nnp"


def _vm_size() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def apply_rlimits(memory_mb: int, cpu_s: float) -> str:
    """Hard = soft rlimits: address space, CPU backstop, files, file size, no core, nproc."""
    mib = 1024 * 1024
    base = _vm_size()
    limit_as = base + memory_mb * mib
    cpu = int(-(-cpu_s // 1)) + 1  # whole seconds, above the host's own CPU poll
    limits = [
        (resource.RLIMIT_AS, limit_as, limit_as),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_NOFILE, 64, 64),
        (resource.RLIMIT_FSIZE, 16 * mib, 16 * mib),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    parts = [f"as={memory_mb}M+{base // mib}M", f"cpu={cpu}s", "nofile=64", "fsize=16M", "core=0"]
    if os.getuid() != 0:  # RLIMIT_NPROC is not enforced for root
        limits.append((resource.RLIMIT_NPROC, 1024, 1024))
        parts.append("nproc=1024")
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))
    return "rlimits(" + ",".join(parts) + ")"


# --------------------------------------------------------------------------- Landlock

_LL_FS_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}
_LL_READ = (1 << 0) | (1 << 2) | (1 << 3)  # EXECUTE | READ_FILE | READ_DIR


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when unavailable."""
    result = _syscall(NR["landlock_create_ruleset"], None, 0, 1)
    return int(result) if result > 0 else 0


def apply_landlock(read_only: list[str]) -> str:
    """Read-only access beneath ``read_only``; no other fs; TCP denied; signals/abstract unix scoped."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError("landlock unavailable")
    fs = _LL_FS_ABI.get(abi, (1 << 16) - 1)
    net = 3 if abi >= 4 else 0
    scoped = 3 if abi >= 6 else 0
    if abi >= 6:
        attr = struct.pack("<QQQ", fs, net, scoped)
    elif abi >= 4:
        attr = struct.pack("<QQ", fs, net)
    else:
        attr = struct.pack("<Q", fs)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _syscall(NR["landlock_create_ruleset"], buf, len(attr), 0)
    _check(ruleset, "landlock_create_ruleset")
    try:
        for path in read_only:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                is_dir = os.path.isdir(path)
                access = _LL_READ if is_dir else ((1 << 0) | (1 << 2))
                rule = ctypes.create_string_buffer(struct.pack("<Qi", access, fd), 12)
                _check(_syscall(NR["landlock_add_rule"], int(ruleset), 1, rule, 0), "landlock_add_rule")
            finally:
                os.close(fd)
        _check(_syscall(NR["landlock_restrict_self"], int(ruleset), 0), "landlock_restrict_self")
    finally:
        os.close(int(ruleset))
    features = ["fs"] + (["tcp"] if net else []) + (["scope"] if scoped else [])
    return f"landlock(abi{abi}:{','.join(features)})"


# --------------------------------------------------------------------------- seccomp

_AUDIT_ARCH_X86_64 = 0xC000003E
_RET_ALLOW = 0x7FFF0000
_RET_KILL = 0x80000000
_ENOSYS = 38
_RET_ENOSYS = 0x00050000 | _ENOSYS
_LD_ABS_W = 0x20
_JEQ = 0x15
_JSET = 0x45
_JGE = 0x35
_RET = 0x06
_CLONE_THREAD = 0x00010000
_MADV_HWPOISON = 100
_MADV_SOFT_OFFLINE = 101
_CLONE_NS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80


#: Syscalls allowed only with the arguments ``_program`` checks.
_CHECKED = ("clone", "tgkill", "kill", "prlimit64", "madvise")


def _ins(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k & 0xFFFFFFFF)


def _arg_lo(index: int) -> int:
    return 16 + 8 * index


def _arg_hi(index: int) -> int:
    return 20 + 8 * index


def _program(pid: int) -> list[bytes]:
    prog = [
        _ins(_LD_ABS_W, 0, 0, 4),  # arch
        _ins(_JEQ, 1, 0, _AUDIT_ARCH_X86_64),
        _ins(_RET, 0, 0, _RET_KILL),
        _ins(_LD_ABS_W, 0, 0, 0),  # nr
        _ins(_JGE, 0, 1, 0x40000000),  # x32 ABI
        _ins(_RET, 0, 0, _RET_ENOSYS),
    ]
    for name in PLAIN_ALLOWED:
        prog += [_ins(_JEQ, 0, 1, NR[name]), _ins(_RET, 0, 0, _RET_ALLOW)]

    def guarded(nr: int, block: list[bytes]) -> list[bytes]:
        # Jump over the block when the number does not match; the block ends
        # with a return, and reloads ``nr`` is unnecessary because it returns.
        return [_ins(_JEQ, 0, len(block), nr), *block]

    # clone: threads only (CLONE_THREAD set, no namespace flags).
    prog += guarded(
        NR["clone"],
        [
            _ins(_LD_ABS_W, 0, 0, _arg_lo(0)),
            _ins(_JSET, 1, 0, _CLONE_THREAD),
            _ins(_RET, 0, 0, _RET_ENOSYS),
            _ins(_JSET, 0, 1, _CLONE_NS),
            _ins(_RET, 0, 0, _RET_ENOSYS),
            _ins(_RET, 0, 0, _RET_ALLOW),
        ],
    )
    prog += [_ins(_LD_ABS_W, 0, 0, 0)]
    # tgkill / kill: only this process may be signalled.
    for name in ("tgkill", "kill"):
        prog += guarded(
            NR[name],
            [
                _ins(_LD_ABS_W, 0, 0, _arg_hi(0)),
                _ins(_JEQ, 1, 0, 0),
                _ins(_RET, 0, 0, _RET_ENOSYS),
                _ins(_LD_ABS_W, 0, 0, _arg_lo(0)),
                _ins(_JEQ, 1, 0, pid),
                _ins(_RET, 0, 0, _RET_ENOSYS),
                _ins(_RET, 0, 0, _RET_ALLOW),
            ],
        )
        prog += [_ins(_LD_ABS_W, 0, 0, 0)]
    # prlimit64: read-only use (new_limit == NULL), so limits cannot be raised.
    prog += guarded(
        NR["prlimit64"],
        [
            _ins(_LD_ABS_W, 0, 0, _arg_lo(2)),
            _ins(_JEQ, 1, 0, 0),
            _ins(_RET, 0, 0, _RET_ENOSYS),
            _ins(_LD_ABS_W, 0, 0, _arg_hi(2)),
            _ins(_JEQ, 1, 0, 0),
            _ins(_RET, 0, 0, _RET_ENOSYS),
            _ins(_RET, 0, 0, _RET_ALLOW),
        ],
    )
    # madvise: all but the memory-failure injections, MADV_HWPOISON and MADV_SOFT_OFFLINE.
    # With CAP_SYS_ADMIN (kept by a worker that stays root, as at L2) they act on the
    # physical page: it is taken out of the machine for good, and a poisoned page
    # kills every process that maps it (copy-on-write pages shared with the zygote
    # and other runs' workers). ``advice`` is an int: the kernel reads the low word.
    prog += guarded(
        NR["madvise"],
        [
            _ins(_LD_ABS_W, 0, 0, _arg_lo(2)),
            _ins(_JEQ, 2, 0, _MADV_HWPOISON),
            _ins(_JEQ, 1, 0, _MADV_SOFT_OFFLINE),
            _ins(_RET, 0, 0, _RET_ALLOW),
            _ins(_RET, 0, 0, _RET_ENOSYS),
        ],
    )
    prog += [_ins(_RET, 0, 0, _RET_ENOSYS)]  # clone3 and everything else
    return prog


_NR_SECCOMP = 317
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def apply_seccomp() -> str:
    """Install the post-boot allowlist (default ENOSYS) with argument checks, on every thread.

    With ``SECCOMP_FILTER_FLAG_TSYNC`` every thread of the worker gets the
    filter, or none does and this fails: a thread that already exists (one a
    preloaded module restarts in each forked child, say) would otherwise run
    unfiltered, and a program can hand it work. Only where the ``seccomp``
    syscall itself is missing is ``prctl`` used, and then only in a worker
    with a single thread.
    """
    prog = _program(os.getpid())
    raw = b"".join(prog)
    buf = ctypes.create_string_buffer(raw, len(raw))
    fprog = _SockFprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    result = _syscall(_NR_SECCOMP, _SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(fprog))
    if result > 0:
        raise OSError(f"seccomp(SET_MODE_FILTER, TSYNC): thread {result} could not take the filter")
    if result < 0:
        errno = ctypes.get_errno()
        if errno != _ENOSYS:
            raise OSError(errno, f"seccomp(SET_MODE_FILTER, TSYNC): {os.strerror(errno)}")
        if len(os.listdir("/proc/self/task")) != 1:
            raise OSError("seccomp: no TSYNC here, and the worker has more than one thread")
        _check(
            _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0),
            "seccomp(SET_MODE_FILTER)",
        )
    return f"seccomp(allowlist{len(PLAIN_ALLOWED) + len(_CHECKED)}+argchecks,default=ENOSYS)"
