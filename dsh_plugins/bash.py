"""The ``bash`` plugin: run a shell command in the workspace.

Each call starts ``bash -c COMMAND`` in the workspace root, in a new session
(its own process group), with stdin closed and an environment built from an allowlist (names
that look like credentials, see :func:`dsh_core.config.looks_like_secret_name`, are refused in it, and a
value holding a URL with user information in it, a password or a token, is never passed through).
Output (stdout and stderr, interleaved) is capped: the head and the tail are
kept and the middle is left out, marked ``[... N bytes left out ...]``. The exit code is the shell's, reported as a
shell reports a command's: 128+N when the shell was killed by signal N. A timeout, an abort of the call, or the end
of the command kills the whole process group and, on Linux (found through
``/proc``), every other process of the command's session: a job that moved to a
group of its own (``timeout``, a job under ``set -m``) is killed too.

Where dsh can write a cgroup hierarchy (cgroup v2 with ``cgroup.kill``, else the v1 ``pids`` one:
as root, or in a delegated v2 subtree), each command also runs in a fresh cgroup of its own, joined
between fork and exec, and the same three ends kill everything in it and in the groups the command
made inside it: a process that started a session of its own (``setsid``, a double-forking daemon)
dies with the call too. How the group is joined and what that costs each spawn, how it is killed and
within what bound, and how a group still busy after its kill, or left by a dsh that died, is removed:
the README's "How ``bash`` contains a command", and :mod:`dsh_core.cgroups` in full. The plugin's end kills and removes
the groups left; a call that starts after that is refused (``the bash plugin is shutting down``), not
run without a group. Without a writable hierarchy, what started a session of its own outlives the
call (where dsh is PID 1 or a subreaper, the killed processes became dsh's children, and it reaps
them); with one, only what a command running as root moves out of its group does.

This is not a sandbox: the command runs as dsh's own user, with its files
and its processes. A command running as root can move itself out of its cgroup, and the allowlist
keeps credentials out of the command's environment, not out of its reach: it can still read
what the user can, dsh's own ``/proc/<pid>/environ`` included. Approval
(the ``workspace-write`` preset asks before every command) is the control;
a deployment that must contain the shell runs dsh itself in a container.

Config::

    [[plugins]]
    id = "bash"
    use = "bash"
    config = { root = "/path/to/project", timeout_s = 120, env_allowlist = ["PATH", "HOME", "LANG"] }
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import subprocess
from collections.abc import Coroutine
from typing import Any

from dsh_core import AbortedError, Scope, ToolContext, ToolError, define_tool, hookimpl, plugin
from dsh_core.cgroups import CommandCgroups, CommandGroup
from dsh_core.config import has_url_credentials, looks_like_secret_name
from dsh_core.processes import is_child_subreaper, proc_stat, signal_if
from dsh_core.textcut import left_out_marker

__all__ = ["plugin", "BashTool", "build_environment", "looks_like_credential"]

DEFAULT_ENV_ALLOWLIST = [
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "TERM",
    "TZ",
    "TMPDIR",
]

#: The largest timeout a config may set, in seconds (a year).
MAX_TIMEOUT_S = 365 * 24 * 3600

CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["root"],
    "properties": {
        "root": {"type": "string", "minLength": 1, "description": "working directory of every command"},
        "shell": {
            "type": "string",
            "minLength": 1,
            "default": "bash",
            "description": "the shell run as SHELL -c COMMAND",
        },
        "timeout_s": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": MAX_TIMEOUT_S,
            "default": 120,
            "description": "default timeout of a command",
        },
        "max_timeout_s": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": MAX_TIMEOUT_S,
            "default": 600,
            "description": "largest timeout a call may ask for",
        },
        "max_output_bytes": {
            "type": "integer",
            "minimum": 256,
            "default": 65536,
            "description": "output kept per call (head and tail)",
        },
        "env_allowlist": {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "default": DEFAULT_ENV_ALLOWLIST,
            "description": "variables passed through from dsh's environment",
        },
        "env": {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "description": "variables set for every command (after the allowlist)",
        },
    },
}

#: Seconds between SIGTERM and SIGKILL of a command's process group.
KILL_GRACE_S = 0.5
#: Seconds to keep reading output after the command exited (stragglers holding the pipe are killed).
DRAIN_S = 1.0
#: Seconds to wait for killed members of the group that are dsh's children to exit, to reap them.
REAP_S = 1.0
#: The names of the commands' cgroups: ``dsh-bash-<dsh pid>-<n>``.
CGROUP_PREFIX = "dsh-bash"


def looks_like_credential(name: str) -> bool:
    """True for variable names that typically hold secrets (``GITHUB_TOKEN``, ``AWS_SECRET_ACCESS_KEY``...).

    The rule ``config dump`` hides values by too: :func:`dsh_core.config.looks_like_secret_name`.
    """
    return looks_like_secret_name(name)


def build_environment(source: dict[str, str], allowlist: list[str], fixed: dict[str, str]) -> dict[str, str]:
    """The environment of a command: allowlisted, non-credential variables of ``source``, then ``fixed``.

    An allowlisted variable whose value holds a URL with user information (``HTTP_PROXY`` with a
    password, a remote with a token as its user name) is left out too, as ``config dump`` hides it;
    ``fixed`` (the config's own ``env``) is passed as written.
    """
    env = {
        name: source[name]
        for name in allowlist
        if name in source and not looks_like_credential(name) and not has_url_credentials(source[name])
    }
    env.update(fixed)
    return env


class _Output:
    """Keeps the first ``cap // 2`` and the last ``cap - cap // 2`` bytes of a stream and counts what it dropped."""

    def __init__(self, cap: int) -> None:
        self.half = cap // 2
        # The tail takes the odd byte of an odd cap: all ``cap`` bytes are kept, as the config promises.
        self.tail_cap = cap - self.half
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def feed(self, chunk: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if not chunk:
            return
        self.tail += chunk
        excess = len(self.tail) - self.tail_cap
        if excess > 0:
            del self.tail[:excess]
            self.dropped += excess

    def text(self) -> str:
        if not self.dropped:  # one stream: a character across the head/tail boundary is whole
            return (self.head + self.tail).decode("utf-8", errors="replace")
        # The cuts fall on byte counts: a UTF-8 character split by one is left out (and counted)
        # rather than shown as U+FFFD, which the command never wrote.
        head, tail = self.head[: _whole_prefix(self.head)], self.tail[_first_start(self.tail) :]
        omitted = self.dropped + len(self.head) - len(head) + len(self.tail) - len(tail)
        return (
            f"{head.decode('utf-8', errors='replace')}\n{left_out_marker(omitted, 'byte')}\n"
            f"{tail.decode('utf-8', errors='replace')}"
        )


def _whole_prefix(data: bytes | bytearray) -> int:
    """The length of ``data`` without a UTF-8 character its end cuts short."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: its lead is further back
            continue
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return len(data) - back if need > back else len(data)
    return len(data)


def _first_start(data: bytes | bytearray) -> int:
    """The offset of the first byte of ``data`` that is not the rest of a character cut before it."""
    for index in range(min(3, len(data))):
        if data[index] & 0xC0 != 0x80:
            return index
    return min(3, len(data))


class BashTool:
    """The plugin instance: the config and the ``bash`` tool."""

    def __init__(self, config: dict[str, Any]) -> None:
        root = config["root"]
        if not os.path.isabs(root) or not os.path.isdir(root):
            raise ToolError(f"bash: root must be an existing absolute directory, got {root!r}")
        self.root = os.path.realpath(root)
        shell = config.get("shell", "bash")
        found = shutil.which(shell) if not os.path.isabs(shell) else shell
        if found is None and shell == "bash":
            found = shutil.which("sh")
        if found is None:
            raise ToolError(f"bash: shell {shell!r} was not found on PATH")
        self.shell = found
        self.timeout_s: float = config.get("timeout_s", 120)
        self.max_timeout_s: float = config.get("max_timeout_s", 600)
        self.max_output_bytes: int = config.get("max_output_bytes", 65536)
        allowlist = list(config.get("env_allowlist", DEFAULT_ENV_ALLOWLIST))
        refused = [name for name in allowlist if looks_like_credential(name)]
        if refused:
            raise ToolError(
                f"bash: env_allowlist names credential-like variables {refused}; they are never "
                "passed through (set a non-secret value under env instead)"
            )
        self.allowlist = allowlist
        self.fixed_env: dict[str, str] = dict(config.get("env", {}))
        # What no environment can hold fails the spawn of every call with a bare ValueError: refused here, named.
        for name, value in self.fixed_env.items():
            if "=" in name or "\0" in name:
                raise ToolError(f"bash: env variable {name!r}: a name cannot hold '=' or a NUL")
            if "\0" in value:
                raise ToolError(f"bash: env variable {name!r}: a value cannot hold a NUL")
        # Probed once per instance (and stale groups swept once per process): None where no
        # hierarchy is writable, and every command then goes without a group, as before cgroups.
        self.cgroups = CommandCgroups.probe(CGROUP_PREFIX)

    @hookimpl
    def dsh_register_tools(self, register: Any) -> None:
        """Register the ``bash`` tool."""
        register(
            define_tool(
                name="bash",
                description=(
                    f"Run a bash command in the workspace ({self.root}) and return its combined "
                    "stdout/stderr and exit code. stdin is closed; the command is killed after "
                    f"timeout seconds (default {self.timeout_s:g}, at most {self.max_timeout_s:g}). "
                    f"Output beyond {self.max_output_bytes} bytes is cut in the middle."
                ),
                parameters={
                    "type": "object",
                    "properties": {
                        "command": {"type": "string", "minLength": 1, "description": "the bash command line"},
                        "timeout": {
                            "type": "number",
                            "exclusiveMinimum": 0,
                            "description": "seconds before the command is killed",
                        },
                    },
                    "required": ["command"],
                    "additionalProperties": False,
                },
                output_schema={
                    "type": "object",
                    "properties": {
                        "exit_code": {"type": "integer", "description": "128+N if the shell was killed by signal N"},
                        "output": {"type": "string"},
                        "truncated": {"type": "boolean"},
                    },
                    "required": ["exit_code", "output", "truncated"],
                },
                execute=self.run,
                render=_render,
                is_concurrency_safe=False,
                examples=[{"command": "echo hello"}, {"command": "pwd && ls", "timeout": 10}],
            )
        )

    async def run(self, args: Any, ctx: ToolContext) -> Any:
        """Body of ``bash``: run, capture, and kill the process group on timeout, abort or exit."""
        asked = args.get("timeout", min(self.timeout_s, self.max_timeout_s))
        if asked > self.max_timeout_s:  # compared before float(): JSON integers have no bound
            shown = f"{asked:g}" if isinstance(asked, float) or asked < 10**20 else "of more than 10^20"
            raise ToolError(f"timeout {shown} s exceeds the maximum of {self.max_timeout_s:g} s")
        timeout = float(asked)
        if "\0" in args["command"]:
            raise ToolError("the command contains a NUL character, which no shell command can carry")
        ctx.signal.raise_if_aborted()
        env = build_environment(dict(os.environ), self.allowlist, self.fixed_env)
        output = _Output(self.max_output_bytes)
        if self.cgroups is not None and self.cgroups.closed:
            # close() ran: no group is made now, and a command without one could outlive the plugin.
            raise ToolError(
                "the bash plugin is shutting down: its commands' cgroups are closed, so the command was not "
                "run (it could not be contained, and what it started could outlive the plugin)"
            )
        group = self.cgroups.create() if self.cgroups is not None else None
        try:
            # loop.subprocess_exec, not create_subprocess_exec: its transport is ours to close, which
            # a process outside the group that holds the output pipe (setsid) makes necessary.
            with group.joiner() if group is not None else contextlib.nullcontext() as join:
                transport, shell = await _spawn(
                    asyncio.get_running_loop().subprocess_exec(
                        lambda: _Shell(output),
                        self.shell,
                        "-c",
                        args["command"],
                        cwd=self.root,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=join,  # joins the group between fork and exec (see CommandGroup.joiner)
                    ),
                    group,
                )
        except OSError as error:
            if group is not None and self.cgroups is not None:
                self.cgroups.discard(group)
            if error.filename == self.root:  # the chdir failed, not the exec: the shell is not the one missing
                raise ToolError(
                    f"could not start {self.shell}: the workspace root {self.root} cannot be its working "
                    f"directory: {error.strerror}"
                ) from None
            if error.errno == errno.E2BIG:  # the exec's own words name no culprit: the command is the long one
                size = len(os.fsencode(args["command"]))
                raise ToolError(
                    f"could not start {self.shell}: {error.strerror} (the command, {size:,} bytes, is one argument "
                    "of the shell, and the system bounds its length: write a long script to a file in the "
                    "workspace and run that)"
                ) from None
            raise ToolError(f"could not start {self.shell}: {error.strerror}") from None
        except BaseException:
            if group is not None and self.cgroups is not None:
                self.cgroups.discard(group)
            raise
        aborted = asyncio.Event()
        remove = ctx.signal.add_listener(lambda _reason: aborted.set())
        # The exit, not the end of the output, tells us the command ended: a leftover background
        # child may hold the pipe open.
        waiter = asyncio.ensure_future(shell.exited.wait())
        stopper = asyncio.ensure_future(aborted.wait())
        try:
            done, _ = await asyncio.wait({waiter, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if stopper in done:
                await _kill_group(transport, shell, group)
                raise AbortedError(ctx.signal.reason)
            if waiter not in done:
                await _kill_group(transport, shell, group)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(shell.drained.wait(), DRAIN_S)
                raise ToolError(
                    f"command timed out after {timeout:g} s and was killed "
                    f"(pass a larger timeout, up to {self.max_timeout_s:g}). Output so far:\n"
                    + (output.text() or "(none)")
                )
            # The command is done; anything it left in its process group would hold the pipe open.
            _signal_group(transport, signal.SIGKILL, group)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(shell.drained.wait(), DRAIN_S)
            returncode = transport.get_returncode()
            assert returncode is not None
            exit_code = returncode if returncode >= 0 else 128 - returncode  # -N: killed by signal N
        finally:
            remove()
            stopper.cancel()
            waiter.cancel()
            try:
                if transport.get_returncode() is None:
                    await _kill_group(transport, shell, group)
                else:
                    _signal_group(transport, signal.SIGKILL, None)  # the cgroup's own kill comes next
                if group is not None:
                    await group.kill()
                await _reap_group(transport, group)
            finally:
                # What still holds the pipe left the group: stop reading it (the straggler's next write
                # gets EPIPE) rather than keep the pipe and the transport for as long as it lives.
                transport.close()
                if group is not None and self.cgroups is not None:
                    self.cgroups.discard(group)
            await asyncio.gather(waiter, stopper, return_exceptions=True)
        return {"exit_code": exit_code, "output": output.text(), "truncated": output.dropped > 0}


async def _spawn(
    starting: Coroutine[Any, Any, tuple[asyncio.SubprocessTransport, _Shell]], group: CommandGroup | None
) -> tuple[asyncio.SubprocessTransport, _Shell]:
    """Await ``starting`` (the shell's ``subprocess_exec``); cancelled meanwhile, kill ``group`` first.

    A cancellation while asyncio still connects the output pipe makes it kill the shell and then wait for
    the pipe's end (CPython gh-103847): a process the command started holds the pipe for as long as it
    lives (a ``setsid`` one, that the session kill never reaches), and the cancelled call waited as long.
    So the spawn runs in a task of its own: on the cancellation the group (the shell included) is
    killed, then that task is cancelled and awaited, and the group emptied and removed. Without a group
    the spawn is awaited as it is, and such a wait remains.
    """
    if group is None:
        return await starting
    spawn = asyncio.ensure_future(starting)
    try:
        return await asyncio.shield(spawn)
    except asyncio.CancelledError:
        group.kill_now()
        spawn.cancel()
        try:
            transport, _shell = await spawn
        except BaseException:  # its cancellation (or failure): the call is cancelled all the same
            pass
        else:  # it had started just before the cancellation: the kill ended it, its transport is ours to close
            transport.close()
        await group.kill()
        raise


class _Shell(asyncio.SubprocessProtocol):
    """What the running command reports: its output, the end of its output, its exit."""

    def __init__(self, output: _Output) -> None:
        self.output = output
        self.drained = asyncio.Event()  # every holder of the output pipe closed it
        self.exited = asyncio.Event()  # the shell exited (``transport.get_returncode()`` is set)

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.output.feed(data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self.drained.set()

    def process_exited(self) -> None:
        self.exited.set()


def _signal_group(transport: asyncio.SubprocessTransport, signum: int, group: CommandGroup | None) -> None:
    """Send ``signum`` to the command's process group, every other process of its session, and its cgroup.

    start_new_session=True made the shell a session and group leader: its pid is both ids. A job
    can move to a group of its own without leaving the session (``timeout`` does, and so does
    every job under ``set -m``), so the group alone is not enough; the session's other members are
    found through ``/proc`` (Linux; elsewhere only the group is signalled). Only ``setsid`` leaves
    the session, and only the command's cgroup follows it, where there is one (``group``). SIGKILL is
    :meth:`CommandGroup.kill_now`: on v2 the whole kill (one ``cgroup.kill``), on v1 one round, which
    :meth:`CommandGroup.kill` afterwards repeats until the group is empty.
    """
    leader = transport.get_pid()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signum)
    for pid, _parent in _session_members(leader):
        _signal_member(pid, leader, signum)
    if group is not None:
        if signum == signal.SIGKILL:
            group.kill_now()
        else:
            group.signal(signum)


def _session_members(session: int) -> list[tuple[int, int]]:
    """``(pid, parent pid)`` of the processes in ``session`` (empty without ``/proc``).

    The number stays the session's while any member lives (Linux reuses no pid that is still a
    session or group id), so every process found was started by the command.
    """
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    members = []
    for entry in entries:
        if entry.isdigit():
            stat = proc_stat(entry)
            if stat is not None and stat.session == session:
                members.append((int(entry), stat.parent))
    return members


def _is_zombie_child(pid: int, me: int) -> bool:
    """True if ``pid`` is a child of ``me`` that has exited and awaits its reaping.

    For the command's cgroup members, whose number (unlike a session's) may be reused once they are
    reaped: only a zombie is waited for, so a process dsh started later under a reused number that
    still runs is never waited for. One that already exited and that asyncio has not reaped yet
    could be: the caller asks only where dsh adopts orphans (:func:`_adopts_orphans`), since
    elsewhere no member but the shell can be dsh's child. The group was emptied first: every member
    that is still dsh's child is a zombie by then.
    """
    stat = proc_stat(pid)
    return stat is not None and stat.state == "Z" and stat.parent == me


def _adopts_orphans() -> bool:
    """True when the processes whose parent ends are reparented to dsh: it is PID 1 or a child subreaper (Linux)."""
    return os.getpid() == 1 or is_child_subreaper()


def _signal_member(pid: int, session: int, signum: int) -> None:
    """Signal ``pid`` if it is (still) in ``session`` (see :func:`dsh_core.processes.signal_if`)."""
    signal_if(pid, signum, lambda member: (stat := proc_stat(member)) is not None and stat.session == session)


async def _kill_group(transport: asyncio.SubprocessTransport, shell: _Shell, group: CommandGroup | None) -> None:
    """SIGTERM the group (and cgroup), SIGKILL it after a grace period, and wait for the shell's exit.

    The shell leads its session, so it never leaves the group: the group's SIGKILL ends it.
    """
    _signal_group(transport, signal.SIGTERM, group)
    try:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(shell.exited.wait(), KILL_GRACE_S)
    finally:
        # However the grace period ends (a second cancellation, too): what ignores SIGTERM is killed.
        _signal_group(transport, signal.SIGKILL, group)
    await shell.exited.wait()


async def _reap_group(transport: asyncio.SubprocessTransport, group: CommandGroup | None) -> None:
    """Reap the killed members of the shell's session that became dsh's children.

    When dsh is PID 1 (of a container) or a child subreaper, what the shell leaves behind is
    reparented to dsh, and asyncio waits for the shell's pid only: without this, every killed
    background process would stay a zombie. Called once the shell is reaped (its returncode is
    known), so ``waitpid(-pgid)`` cannot take the shell's status from asyncio's child watcher;
    the group id stays the shell's pid while members live, so no other process is waited for.
    Members in other groups of the session are waited for by pid, found as the session's members
    whose parent is dsh (none of them is a process asyncio started: those lead sessions of their own).
    So are the members the command's cgroup ever listed (``group.seen``: the dead are no longer listed),
    which may have left the session, only when dsh adopts orphans (:func:`_adopts_orphans`); the shell's
    own pid is left to asyncio.
    Elsewhere no member is dsh's child and the first look says so.
    """
    assert transport.get_returncode() is not None
    leader = transport.get_pid()
    me = os.getpid()
    # Only an adopter can be the parent of a member that left the session; elsewhere a pid the group once
    # listed that is now dsh's child is another process of dsh's under a reused number.
    adopts = _adopts_orphans()
    deadline = asyncio.get_running_loop().time() + REAP_S
    while True:
        try:
            pid, _status = os.waitpid(-leader, os.WNOHANG)
        except ChildProcessError:  # no child of dsh left in the group
            pid = -1
        if pid > 0:
            continue
        left = pid == 0
        members = [member for member, parent in _session_members(leader) if parent == me]
        if group is not None and adopts:
            members += [pid for pid in group.seen - {leader} if _is_zombie_child(pid, me)]
        for member in members:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(member, os.WNOHANG)[0] == 0:
                    left = True
        if not left:
            return
        if asyncio.get_running_loop().time() > deadline:  # one that even SIGKILL does not end at once
            return
        await asyncio.sleep(0.01)


def _render(_args: Any, value: Any) -> str:
    text = value["output"].rstrip("\n")
    footer = f"[exit code {value['exit_code']}]"
    return f"{text}\n{footer}" if text else f"(no output)\n{footer}"


@plugin(config_schema=CONFIG_SCHEMA)
def bash_plugin(scope: Scope, config: Any) -> BashTool:
    """Entry point ``bash``: the ``bash`` tool, run in ``config["root"]``."""
    tool = BashTool(dict(config))
    if tool.cgroups is not None:
        # A call cut short by a second cancellation may leave its (killed) group to remove, and a call
        # still running when the plugin ends (the harness aborts its own calls first) has its group
        # killed and removed then.
        scope.on_dispose(tool.cgroups.close)
    return tool


plugin = bash_plugin  # the entry point names ``dsh_plugins.bash:plugin``
