"""The bash plugin through the pipeline: output, timeout, output cap, abort, environment allowlist, cgroup."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from dsh_core import AbortController, cgroups
from dsh_core.cgroups import CommandCgroups, Hierarchy
from dsh_core.config import compose, dump, looks_like_secret_name
from dsh_core.errors import ConfigError, PluginLoadError, ToolError
from dsh_plugins import bash as bash_module
from dsh_plugins.bash import BashTool, build_environment, looks_like_credential

pytestmark = pytest.mark.anyio


def bash(root: Path, **config: object) -> dict[str, object]:
    """The bash plugin row."""
    return {"id": "bash", "use": "bash", "config": {"root": str(root), **config}}


def alive(pid: int, settle_s: float = 2.0) -> bool:
    """True if ``pid`` is still running ``settle_s`` after a kill (a zombie counts as dead)."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                state = handle.read().rsplit(")", 1)[-1].split()[0]
        except OSError:
            return False
        if state == "Z":
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.02)


async def test_runs_in_the_root_and_reports_output_and_exit_code(boot: Any, tmp_path: Path) -> None:
    """stdout and stderr are combined; a non-zero exit is a result the model reads, not a failure."""
    async with boot(bash(tmp_path)) as h:
        ok = await h.call("bash", {"command": "pwd; echo out; echo err >&2"})
        assert ok.value == {"exit_code": 0, "output": f"{tmp_path.resolve()}\nout\nerr\n", "truncated": False}
        assert ok.text.endswith("[exit code 0]")
        failed = await h.call("bash", {"command": "exit 3"})
        assert failed.value["exit_code"] == 3 and failed.text == "(no output)\n[exit code 3]"
        stdin = await h.call("bash", {"command": "cat"})  # stdin is closed: cat ends at once
        assert stdin.value["exit_code"] == 0


async def test_a_shell_killed_by_a_signal_reports_128_plus_the_signal(boot: Any, tmp_path: Path) -> None:
    """Like a shell's ``$?``: 137 for SIGKILL, not Python's negative returncode."""
    async with boot(bash(tmp_path)) as h:
        killed = await h.call("bash", {"command": "echo before; kill -9 $$"})
        terminated = await h.call("bash", {"command": "kill -TERM $$"})
    assert killed.value == {"exit_code": 137, "output": "before\n", "truncated": False}
    assert killed.text == "before\n[exit code 137]" and terminated.value["exit_code"] == 143


async def test_credentials_are_never_passed_through(boot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only allowlisted variables reach the command; credential-like names never do."""
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws_secret")
    monkeypatch.setenv("HARMLESS", "visible")
    monkeypatch.setenv("UNLISTED", "hidden")
    async with boot(bash(tmp_path, env_allowlist=["PATH", "HARMLESS"], env={"FIXED": "1"})) as h:
        result = await h.call("bash", {"command": "env"})
    output = result.value["output"]
    assert "HARMLESS=visible" in output and "FIXED=1" in output
    assert "secret" not in output and "UNLISTED" not in output
    with pytest.raises(PluginLoadError, match="env_allowlist names credential-like variables"):
        async with boot(bash(tmp_path, env_allowlist=["PATH", "GITHUB_TOKEN"])):
            pass


async def test_an_env_entry_no_environment_can_hold_is_refused_at_load(boot: Any, tmp_path: Path) -> None:
    """A name with ``=`` or a NUL, or a value with a NUL, cannot be put in an environment: the load says so,
    naming the variable, rather than every call failing with a bare ``ValueError``."""
    for env, what in (
        ({"A=B": "x"}, "'A=B': a name cannot hold '=' or a NUL"),
        ({"A\0B": "x"}, "'A\\x00B': a name cannot hold '=' or a NUL"),
        ({"OK": "1", "A": "x\0y"}, "'A': a value cannot hold a NUL"),
    ):
        with pytest.raises(PluginLoadError, match=re.escape(f"bash: env variable {what}")):
            async with boot(bash(tmp_path, env=env)):
                pass


def test_credential_names_and_environment_building() -> None:
    """The credential patterns and the allowlist filter, without a process."""
    for name in ("GITHUB_TOKEN", "OPENAI_API_KEY", "aws_access_key_id", "DB_PASSWORD", "MY_SECRET"):
        assert looks_like_credential(name), name
    for name in ("PATH", "HOME", "LANG", "TERM", "PWD", "OLDPWD", "GIT_AUTHOR_NAME", "KEYMAP", "PASSENGER_ENV"):
        assert not looks_like_credential(name), name
    env = build_environment({"PATH": "/bin", "API_KEY": "k", "X": "1"}, ["PATH", "API_KEY"], {"Y": "2"})
    assert env == {"PATH": "/bin", "Y": "2"}


#: Whether a name names a secret, for the allowlist and for ``config dump`` alike. The bash plugin's
#: patterns and the dump's words used to disagree; the comments say which of them missed a name.
SECRET_NAMES = [
    # Both said so.
    ("GITHUB_TOKEN", True),
    ("PGPASSWORD", True),
    ("AWS_SECRET_ACCESS_KEY", True),
    ("api_key", True),
    ("STRIPE_KEY", True),
    ("SMTP_PASS", True),
    ("MYSQL_PWD", True),
    ("SENTRY_DSN", True),
    ("Authorization", True),
    ("max_tokens", True),
    ("GITHUB_TOKEN_ENV", True),
    # The dump missed them (bash's *TOKEN*, AWS_*, *ACCESS_KEY*, *DATABASE_URL*, *_AUTH_*, *API_KEY*...).
    ("TOKENIZER_PATH", True),
    ("GITHUBTOKEN", True),
    ("AWS_REGION", True),
    ("aws_access_key_id", True),
    ("DATABASE_URL", True),
    ("SSH_AUTH_SOCK", True),
    ("DOCKER_AUTH_CONFIG", True),
    ("OPENAI_API_KEY_FILE", True),
    ("PRIVATE_KEY_PATH", True),
    # bash missed them (the dump's words: *_KEY did not match _KEYS, camelCase, pwd as a first word...).
    ("SSH_KEYS", True),
    ("privateKey", True),
    ("PWD_FILE", True),
    ("basicAuth", True),
    ("dbPass", True),
    ("pgDsn", True),
    ("X-Api-Key", True),
    ("auth", True),
    ("key", True),
    # Neither said so.
    ("PATH", False),
    ("LANG", False),
    ("OLDPWD", False),
    ("KEYMAP", False),
    ("KEY_ID", False),
    ("PASSENGER_ENV", False),
    ("PASS_THROUGH", False),
    ("GIT_AUTHOR_NAME", False),
    ("auth_mode", False),
    ("root", False),
    # One said so, and a deliberate exception says not: the shell's working directory (the dump's pwd word),
    # and the name of the variable holding a key (bash's *API_KEY*).
    ("PWD", False),
    ("api_key_env", False),
    ("OPENAI_API_KEY_ENV", False),
]


def test_the_allowlist_and_config_dump_judge_secret_names_by_one_rule(tmp_path: Path) -> None:
    """bash refused SSH_KEYS-like names by patterns the dump did not share, and the dump printed AWS_REGION-like
    ones in clear; both now ask dsh_core.config.looks_like_secret_name."""
    env = {name: f"value of {name}" for name, _ in SECRET_NAMES}
    row = {"id": "sh", "use": "bash", "config": {"root": str(tmp_path), "env": env}}
    shown = [value for _, value, _ in dump(compose([("base.toml", {"plugins": [row]})], env={}))]
    wrong = []
    for name, secret in SECRET_NAMES:
        try:
            BashTool({"root": str(tmp_path), "env_allowlist": [name]})
            refused = False
        except ToolError:
            refused = True
        verdicts = {
            "looks_like_secret_name": looks_like_secret_name(name),
            "looks_like_credential": looks_like_credential(name),
            "refused in env_allowlist": refused,
            "left out of the environment": name not in build_environment({name: "v"}, [name], {}),
            "hidden by config dump": env[name] not in shown,
        }
        wrong.extend(f"{name}: {what} is {verdict}" for what, verdict in verdicts.items() if verdict != secret)
    assert wrong == [], "\n".join(wrong)


async def test_keys_agent_sockets_and_urls_with_passwords_are_credentials_too(
    boot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Names ending in KEY, PASS or PWD, passphrases, DSNs and the ssh agent's socket are refused in the
    allowlist; an allowlisted variable whose value is a URL carrying a password never reaches the command."""
    for name in (
        "STRIPE_KEY",
        "SIGNING_KEY",
        "MYSQL_PWD",
        "SMTP_PASS",
        "GPG_PASSPHRASE",
        "SSH_AUTH_SOCK",
        "DOCKER_AUTH_CONFIG",
        "HTTP_AUTHORIZATION",
        "SENTRY_DSN",
        "DATABASE_URL",
    ):
        with pytest.raises(PluginLoadError, match=f"env_allowlist names credential-like variables.*{name}"):
            async with boot(bash(tmp_path, env_allowlist=["PATH", name])):
                pass
    monkeypatch.setenv("HTTP_PROXY", "http://alice:s3cr3t@proxy.example:3128")
    monkeypatch.setenv("REDIS_URL", "redis://:hunter2@cache.example/0")
    monkeypatch.setenv("PLAIN_URL", "https://example.com/path?q=a:b@c")
    async with boot(bash(tmp_path, env_allowlist=["PATH", "HTTP_PROXY", "REDIS_URL", "PLAIN_URL"])) as h:
        output = (await h.call("bash", {"command": "env"})).value["output"]
    assert "s3cr3t" not in output and "hunter2" not in output
    assert "PLAIN_URL=https://example.com/path?q=a:b@c" in output


async def test_a_url_with_a_token_as_its_user_name_never_reaches_the_command(
    boot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``https://ghp_abc@github.com`` carries a token with no password part: it passed the password check.

    Any user information in a URL is left out, as ``config dump`` hides it: dsh cannot tell a user name
    from a token written where the user name goes.
    """
    monkeypatch.setenv("GIT_REMOTE", "https://ghp_s3cr3tT0ken@github.com/org/repo.git")
    monkeypatch.setenv("MIRROR", "see HTTPS://a@b@host/x")
    monkeypatch.setenv("SCP_REMOTE", "git@github.com:org/repo.git")
    async with boot(bash(tmp_path, env_allowlist=["PATH", "GIT_REMOTE", "MIRROR", "SCP_REMOTE"])) as h:
        output = (await h.call("bash", {"command": "env"})).value["output"]
    assert "ghp_s3cr3tT0ken" not in output and "GIT_REMOTE" not in output
    assert "MIRROR" not in output
    assert "SCP_REMOTE=git@github.com:org/repo.git" in output


async def test_a_command_that_never_ends_times_out_and_its_group_is_killed(boot: Any, tmp_path: Path) -> None:
    """The timeout kills the whole process group (background children too) and says what to do."""
    async with boot(bash(tmp_path)) as h:
        started = time.monotonic()
        result = await h.call(
            "bash", {"command": "sleep 3600 & echo $! > bg.pid; echo started; sleep 3600", "timeout": 0.5}
        )
        assert time.monotonic() - started < 60  # not the command's hour
    assert result.code == "TOOL_FAILED"
    assert "command timed out after 0.5 s and was killed" in result.text and "started" in result.text
    assert not alive(int((tmp_path / "bg.pid").read_text()))


async def test_background_processes_do_not_outlive_the_command(boot: Any, tmp_path: Path) -> None:
    """When the command ends, what it left running in its group is killed (and the call does not hang)."""
    async with boot(bash(tmp_path)) as h:
        started = time.monotonic()
        result = await h.call("bash", {"command": "sleep 3600 & echo $! > bg.pid"})
        assert time.monotonic() - started < 60  # not the background job's hour
    assert result.value["exit_code"] == 0
    assert not alive(int((tmp_path / "bg.pid").read_text()))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="the session is found through /proc")
@pytest.mark.parametrize("how", ["exit", "timeout"])
async def test_jobs_in_a_process_group_of_their_own_do_not_outlive_the_command(
    boot: Any, tmp_path: Path, how: str
) -> None:
    """``timeout`` and a job under ``set -m`` move to a new process group (not a new session): the
    command's end, or its timeout, kills them too."""
    command = (
        "timeout 100 sleep 100 & echo $! > timeout.pid; set -m; sleep 100 & echo $! > job.pid; "
        "sh -c 'sleep 100 & echo $! > grandchild.pid; wait' & until [ -s grandchild.pid ]; do sleep 0.01; done"
    )
    pid_files = [tmp_path / name for name in ("timeout.pid", "job.pid", "grandchild.pid")]
    try:
        async with boot(bash(tmp_path)) as h:
            result = await h.call(
                "bash",
                {
                    "command": command + ("; sleep 60" if how == "timeout" else ""),
                    "timeout": 2 if how == "timeout" else 30,
                },
            )
        assert result.code == ("TOOL_FAILED" if how == "timeout" else None), result.text
        pids = [int(path.read_text()) for path in pid_files]
        assert pids[1] != 0 and os.getpgid(os.getpid()) not in pids
        assert [pid for pid in pids if alive(pid)] == []
    finally:
        for path in pid_files:
            with contextlib.suppress(ProcessLookupError, ValueError, FileNotFoundError):
                os.kill(int(path.read_text()), signal.SIGKILL)


async def test_flooding_output_is_capped_head_and_tail(boot: Any, tmp_path: Path) -> None:
    """A flood keeps the first and last bytes and says how much was dropped."""
    async with boot(bash(tmp_path, max_output_bytes=1000)) as h:
        result = await h.call("bash", {"command": "echo START; head -c 500000 /dev/zero | tr '\\0' a; echo; echo END"})
    value = result.value
    assert value["truncated"] is True
    assert value["output"].startswith("START\naaa") and value["output"].rstrip().endswith("END")
    # START, 500,000 a's and END, each with its line break: 500,011 bytes, 1,000 of them kept.
    assert "\n[... 499,011 bytes left out ...]\n" in value["output"] and len(value["output"]) < 1200


async def test_the_output_cap_never_splits_a_utf8_character(boot: Any, tmp_path: Path) -> None:
    """Head and tail are cut by bytes; a character across a cut is counted, never shown as U+FFFD.

    Uncut output (a character across the head/tail boundary) comes back exactly as written.
    """
    odd = "x" + "\u00e9" * 400 + "y"  # every 2-byte character off the even cut points
    commands = {
        "whole": "printf 'a%.0s' $(seq 127); printf '\\303\\251'; printf 'b%.0s' $(seq 71)",
        "cut": f"printf '%s' '{odd}'",
    }
    async with boot(bash(tmp_path, max_output_bytes=256)) as h:
        results = {key: (await h.call("bash", {"command": command})).value for key, command in commands.items()}
    assert results["whole"] == {"exit_code": 0, "output": "a" * 127 + "\u00e9" + "b" * 71, "truncated": False}
    cut = results["cut"]["output"]
    head, _, tail = cut.partition("\n[... ")
    omitted = int(tail.split(" bytes", 1)[0].replace(",", ""))
    tail = tail.split("left out ...]\n", 1)[1]
    assert "\ufffd" not in cut and head and tail and odd.startswith(head) and odd.endswith(tail)
    assert omitted == len(odd.encode()) - len(head.encode()) - len(tail.encode())


async def test_an_odd_output_cap_keeps_every_byte_it_allows(boot: Any, tmp_path: Path) -> None:
    """``max_output_bytes`` is the number of bytes kept, odd or even: an output of exactly that many comes
    back whole, and one byte more leaves out one byte (the tail holds the odd one)."""
    async with boot(bash(tmp_path, max_output_bytes=257)) as h:
        exact = await h.call("bash", {"command": "printf 'y%.0s' $(seq 257)"})
        over = await h.call("bash", {"command": "printf 'y%.0s' $(seq 258)"})
    assert exact.value == {"exit_code": 0, "output": "y" * 257, "truncated": False}
    assert over.value == {
        "exit_code": 0,
        "output": "y" * 128 + "\n[... 1 byte left out ...]\n" + "y" * 129,
        "truncated": True,
    }


async def test_abort_kills_the_process_group_promptly(boot: Any, tmp_path: Path) -> None:
    """Aborting the call's signal ends it as ABORTED and kills what the command started."""
    async with boot(bash(tmp_path)) as h:
        controller = AbortController()
        call = asyncio.ensure_future(
            h.call("bash", {"command": "sleep 3600 & echo $! > bg.pid; sleep 3600"}, signal=controller.signal)
        )
        while not (tmp_path / "bg.pid").exists() or not (tmp_path / "bg.pid").read_text().strip():
            await asyncio.sleep(0.02)
        controller.abort("user pressed ctrl-c")
        result = await asyncio.wait_for(call, 60)  # not the command's hour
    assert result.code == "ABORTED"
    assert not alive(int((tmp_path / "bg.pid").read_text()))


async def test_a_call_cancelled_again_during_the_kill_grace_still_kills_its_group(boot: Any, tmp_path: Path) -> None:
    """A second cancellation (a cut nested call whose run is then cancelled) lands in the SIGTERM grace
    period: what ignores SIGTERM still gets the group's SIGKILL."""
    pid_file = tmp_path / "bg.pid"
    async with boot(bash(tmp_path)) as h:
        call = asyncio.ensure_future(h.call("bash", {"command": "trap '' TERM; sleep 60 & echo $! > bg.pid; wait"}))
        while not pid_file.exists() or not pid_file.read_text().strip():
            await asyncio.sleep(0.02)
        call.cancel()
        await asyncio.sleep(0.1)  # inside the grace period: the shell ignores SIGTERM
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
    pid = int(pid_file.read_text())
    try:
        assert not alive(pid, settle_s=1.0)
        assert our_groups() == []  # a cgroup the cut kill could not remove is removed when the plugin ends
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_bad_input_is_refused_clearly(boot: Any, tmp_path: Path) -> None:
    """A timeout above the maximum and a NUL byte are refused before anything runs."""
    async with boot(bash(tmp_path, max_timeout_s=10)) as h:
        too_long = await h.call("bash", {"command": "touch never", "timeout": 11})
        assert "timeout 11 s exceeds the maximum of 10 s" in too_long.text
        huge = await h.call("bash", {"command": "touch never", "timeout": 10**400})  # no float holds it
        assert huge.code == "TOOL_FAILED" and "exceeds the maximum of 10 s" in huge.text, huge.text
        nul = await h.call("bash", {"command": "touch never\0x"})
        assert "NUL character" in nul.text
        empty = await h.call("bash", {"command": ""})
        assert empty.code == "INVALID_ARGS"
    assert not (tmp_path / "never").exists()
    for key in ("timeout_s", "max_timeout_s"):
        with pytest.raises(ConfigError, match=f"config.{key}: .* is greater than the maximum of 31536000"):
            async with boot(bash(tmp_path, **{key: 10**400})):
                pass


def in_a_process(
    root: Path, body: str, prelude: str = "", warnings: str = "default"
) -> subprocess.CompletedProcess[str]:
    """Run ``body`` (async code with ``h``, a harness of the bash plugin in ``root``) in a fresh interpreter.

    ``prelude`` runs first, at module level. What the script prints is in ``stdout``; what the
    interpreter printed at shutdown (unraisable exceptions among them) in ``stderr``; ``warnings``
    is its warning filter (by default every warning is shown once, ResourceWarning included).
    ``body`` may await ``children_left()``: this process's children, as ``[pid, state]``, once none
    is left or 10 s passed (reaping is asynchronous: polled, not slept for).
    """
    script = textwrap.dedent("""
        import asyncio, ctypes, json, os, sys
        from dsh_core.config import compose
        from dsh_core.harness import Harness
        from dsh_core.plugins import PluginCatalog
        ROOT = {root!r}
        {prelude}
        async def children_left(within_s=10.0):
            deadline = asyncio.get_running_loop().time() + within_s
            while True:
                children = []
                for pid in filter(str.isdigit, os.listdir("/proc")):
                    try:
                        with open(f"/proc/{{pid}}/stat") as handle:
                            fields = handle.read().rsplit(")", 1)[1].split()
                    except OSError:
                        continue
                    if int(fields[1]) == os.getpid():
                        children.append([pid, fields[0]])
                if not children or asyncio.get_running_loop().time() > deadline:
                    return children
                await asyncio.sleep(0.05)
        async def main():
            rows = [{{"id": "bash", "use": "bash", "config": {{"root": ROOT}}}}]
            h = await Harness.start(compose([("t", {{"tools": {{"mode": "native"}}, "plugins": rows}})], env={{}}),
                                    catalog=PluginCatalog(strict=True))
            try:
        {body}
            finally:
                await h.aclose()

        asyncio.run(main())
        """).format(root=str(root), prelude=prelude, body=textwrap.indent(textwrap.dedent(body), " " * 8))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run(
        [sys.executable, "-W", warnings, "-c", script], capture_output=True, text=True, env=env, timeout=60, check=False
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")
def test_as_a_subreaper_dsh_reaps_what_the_group_kill_killed(tmp_path: Path) -> None:
    """As a container's PID 1 (here: a child subreaper), the killed background processes become dsh's
    children; they are reaped, not left as zombies, and the shell's own exit status is not taken."""
    done = in_a_process(
        tmp_path,
        prelude="assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0",  # SUBREAPER
        body="""
        codes = []
        for _ in range(3):
            # Children of the shell, a grandchild whose parent already ended, one whose parent is killed too.
            result = await h.call("bash", {"command": "sleep 100 & sleep 100 & (sleep 100 &); "
                                                      "sh -c 'sleep 100 & sleep 100' & echo started"})
            codes.append(result.value["exit_code"])
        codes.append((await h.call("bash", {"command": "sleep 100 & exit 7"})).value["exit_code"])
        # Jobs in process groups of their own, in the shell's session.
        codes.append((await h.call("bash", {"command": "timeout 100 sleep 100 & set -m; sleep 100 & "
                                                       "sh -c 'sleep 100 & wait' & sleep 0.2"})).value["exit_code"])
        print(json.dumps({"codes": codes, "children": await children_left()}))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"codes": [0, 0, 0, 7, 0], "children": []}


def test_a_straggler_outside_the_group_does_not_keep_the_pipe_and_transport(tmp_path: Path) -> None:
    """A process that left the group (setsid) and holds the output pipe is not waited for: once the
    drain is over the call closes its end of the pipe and its subprocess transport, so nothing piles
    up while the straggler lives, and nothing is left to finalize after the event loop closed.

    Without a cgroup (a cgroup's kill would end the straggler with the command)."""
    try:
        done = in_a_process(
            tmp_path,
            prelude="import dsh_core.cgroups; dsh_core.cgroups.hierarchies = lambda *args, **kwargs: []",
            body="""
            await h.call("bash", {"command": "true"})  # what the first call sets up once is not a leak
            before = len(os.listdir("/proc/self/fd"))
            outputs = []
            for n in range(3):
                # The command waits until the straggler left the group (else the group kill may end it first).
                result = await h.call("bash", {"command": f"setsid sh -c 'echo $$ > straggler.{n}; exec sleep 60' & "
                                                          f"until [ -s straggler.{n} ]; do sleep 0.01; done; echo ok"})
                outputs.append(result.value["output"])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10  # closing is asynchronous: polled, not slept for
            while (leaked := len(os.listdir("/proc/self/fd")) - before) > 0 and loop.time() < deadline:
                await asyncio.sleep(0.05)
            print(json.dumps({"outputs": outputs, "leaked": leaked}))
            """,
        )
    finally:
        for straggler in tmp_path.glob("straggler.*"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(straggler.read_text()), signal.SIGKILL)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"outputs": ["ok\n"] * 3, "leaked": 0}
    assert "Event loop is closed" not in done.stderr and "unclosed" not in done.stderr, done.stderr


# --------------------------------------------------------------------------- the per-command cgroup
# What leaves the command's session (setsid, a daemon) is killed too where a writable hierarchy exists;
# without one, the session kill alone, as before.

FOUND = {h.version: h for h in cgroups.hierarchies()}
PREFIX = f"dsh-bash-{os.getpid()}-"

#: A process in a session of its own, and a double-forked one (its parent, a new session's leader,
#: exits at once): neither is in the command's session, so the session kill cannot reach them.
ESCAPES = (
    "setsid sh -c 'echo $$ > setsid.pid; exec sleep 300' & "
    "setsid sh -c 'sleep 300 & echo $! > daemon.pid' & "
    "until [ -s setsid.pid ] && [ -s daemon.pid ]; do sleep 0.01; done; echo started"
)
PID_FILES = ("setsid.pid", "daemon.pid")


def only(monkeypatch: pytest.MonkeyPatch, version: int | None) -> None:
    """Make the plugin see the hierarchy of ``version`` alone (``None``: no writable hierarchy)."""
    chosen = [] if version is None else [FOUND[version]]
    monkeypatch.setattr(cgroups, "hierarchies", lambda *args, **kwargs: list(chosen))


def backends() -> list[Any]:
    """v2 and v1 where this host has them writable (skipped elsewhere), and no cgroup at all."""
    return [
        pytest.param(2, marks=pytest.mark.skipif(2 not in FOUND, reason="no writable cgroup v2 group")),
        pytest.param(1, marks=pytest.mark.skipif(1 not in FOUND, reason="no writable v1 pids hierarchy")),
        pytest.param(None, id="no-cgroup"),
    ]


def our_groups() -> list[str]:
    """The per-command groups this test process has now, in every writable hierarchy."""
    return [
        os.path.join(h.parent, name) for h in FOUND.values() for name in os.listdir(h.parent) if name.startswith(PREFIX)
    ]


def escaped(root: Path) -> list[int]:
    """The pids the command wrote, of those still running (a zombie counts as dead)."""
    return [pid for pid in (int((root / name).read_text()) for name in PID_FILES) if alive(pid, settle_s=1.0)]


#: The kill's bound (``cgroups.KILL_WITHIN_S``) in a test that shows a kill did not wait it out: a call taking
#: half of it did, however loaded the machine.
LONG_KILL_S = 60.0


def kill_escapes(root: Path) -> None:
    for name in PID_FILES:
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int((root / name).read_text()), signal.SIGKILL)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="pids are checked through /proc")
@pytest.mark.parametrize("version", backends())
@pytest.mark.parametrize("how", ["exit", "timeout", "abort"])
async def test_what_leaves_the_session_is_killed_with_a_cgroup_and_survives_without(
    boot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int | None, how: str
) -> None:
    """With a cgroup, nothing the command started survives its end, its timeout or its abort, wherever it
    went; and no group is left behind. Without one, the session kill alone: both escapes survive."""
    only(monkeypatch, version)
    command = ESCAPES + ("" if how == "exit" else "; sleep 300")
    try:
        async with boot(bash(tmp_path)) as h:
            if how == "abort":
                controller = AbortController()
                call = asyncio.ensure_future(h.call("bash", {"command": command}, signal=controller.signal))
                while not all((tmp_path / name).exists() and (tmp_path / name).read_text() for name in PID_FILES):
                    await asyncio.sleep(0.02)
                controller.abort("stop")
                result = await asyncio.wait_for(call, 60)
            else:
                result = await h.call("bash", {"command": command, "timeout": 30 if how == "exit" else 2})
            expected = {"exit": None, "timeout": "TOOL_FAILED", "abort": "ABORTED"}[how]
            assert result.code == expected, result.text
            assert our_groups() == []
        pids = [int((tmp_path / name).read_text()) for name in PID_FILES]
        assert os.getpid() not in pids and 0 not in pids
        assert escaped(tmp_path) == ([] if version is not None else pids)
    finally:
        kill_escapes(tmp_path)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="pids are checked through /proc")
@pytest.mark.parametrize("error", [errno.ENOSYS, errno.EPERM], ids=["ENOSYS", "EPERM"])
@pytest.mark.parametrize("version", backends())
async def test_where_pidfds_are_refused_every_member_is_still_killed(
    boot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int | None, error: int
) -> None:
    """A kernel before 5.3 has no ``pidfd_open`` (ENOSYS), an older container seccomp profile refuses it
    (EPERM): a member is then checked and signalled by its number, as before pidfds. A job in a process
    group of its own (reached by the session's kill) and, with a cgroup, what left the session (by the
    group's kill, v1's rounds signal each member) die with the call, and its group is removed."""
    only(monkeypatch, version)

    def refused(pid: int, flags: int = 0) -> int:
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(os, "pidfd_open", refused)
    monkeypatch.setattr(cgroups, "KILL_WITHIN_S", LONG_KILL_S)
    command = "set -m; sleep 300 & echo $! > job.pid; " + (ESCAPES if version is not None else "echo started")
    try:
        async with boot(bash(tmp_path)) as h:
            started = time.monotonic()
            result = await h.call("bash", {"command": command, "timeout": LONG_KILL_S})
            took = time.monotonic() - started
            assert result.code is None, result.text
            left = our_groups()
        assert not alive(int((tmp_path / "job.pid").read_text()), settle_s=10)
        assert left == [] and (version is None or escaped(tmp_path) == [])
        assert took < LONG_KILL_S / 2, took  # the kill did not wait out its bound
    finally:
        kill_escapes(tmp_path)
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int((tmp_path / "job.pid").read_text()), signal.SIGKILL)
        for group in our_groups():  # a kill that missed its members left their group (v1: pids.max 0)
            deadline = time.monotonic() + 5
            while not cgroups.remove_tree(group) and time.monotonic() < deadline:
                time.sleep(0.05)


@pytest.mark.parametrize("version", [p for p in backends() if p.values[0] is not None])
async def test_a_command_runs_in_a_fresh_group_of_its_own(
    boot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int
) -> None:
    """The shell is in its group from its first instruction: its own /proc/self/cgroup names it, and each
    call gets another group."""
    only(monkeypatch, version)
    async with boot(bash(tmp_path)) as h:
        first = (await h.call("bash", {"command": "cat /proc/self/cgroup"})).value["output"]
        second = (await h.call("bash", {"command": "cat /proc/$$/cgroup"})).value["output"]
    line = {1: ":pids:/", 2: "0::/"}[version]
    names = [
        next(entry.rsplit("/", 1)[1] for entry in out.splitlines() if line in entry + "/") for out in (first, second)
    ]
    assert all(name.startswith(PREFIX) for name in names) and names[0] != names[1], (first, second)
    assert our_groups() == []


#: The command (root) makes groups inside its own and moves a daemon into each: its group is a tree now.
NESTED = (
    'g={parent}/$(awk -F: \'$2 == "{controller}" {{n = split($3, p, "/"); print p[n]}}\' /proc/self/cgroup); '
    'mkdir -p "$g/sub/deeper"; '
    'setsid sh -c \'echo $$ > "$0/cgroup.procs"; echo $$ > setsid.pid; exec sleep 300\' "$g/sub" & '
    'setsid sh -c \'echo $$ > "$0/cgroup.procs"; echo $$ > daemon.pid; exec sleep 300\' "$g/sub/deeper" & '
    "until [ -s setsid.pid ] && [ -s daemon.pid ]; do sleep 0.01; done; "
    'grep -c . "$g/sub/cgroup.procs" "$g/sub/deeper/cgroup.procs"'
)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="pids are checked through /proc")
@pytest.mark.parametrize("version", [p for p in backends() if p.values[0] is not None])
@pytest.mark.parametrize("how", ["exit", "timeout"])
async def test_groups_the_command_makes_inside_its_own_are_killed_and_removed_with_it(
    boot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int, how: str
) -> None:
    """A command may make groups inside its group and move processes there (dsh run through bash makes its
    own groups there): the kill reaches the whole tree, the tree is removed bottom-up, and neither waits
    for the kill's bound."""
    only(monkeypatch, version)
    monkeypatch.setattr(cgroups, "KILL_WITHIN_S", LONG_KILL_S)
    command = NESTED.format(parent=FOUND[version].parent, controller={1: "pids", 2: ""}[version])
    try:
        async with boot(bash(tmp_path)) as h:
            started = time.monotonic()
            result = await h.call("bash", {"command": command + ("" if how == "exit" else "; sleep 300"), "timeout": 3})
            took = time.monotonic() - started
            left = our_groups()
        if how == "exit":  # both daemons were in their groups when the command ended
            assert result.code is None and result.value["output"].count("cgroup.procs:1\n") == 2, result.text
        else:
            assert result.code == "TOOL_FAILED" and "timed out" in result.text, result.text
        assert escaped(tmp_path) == [] and left == [] and our_groups() == []
        assert took < LONG_KILL_S / 2, took  # the timeout's 3 s and SIGTERM grace, never the kill's bound
    finally:
        kill_escapes(tmp_path)


@pytest.mark.parametrize("version", [p for p in backends() if p.values[0] is not None])
async def test_stale_groups_of_a_dead_dsh_are_swept_at_load(
    boot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int
) -> None:
    """A dsh that died mid-call leaves its command's group behind: the next dsh's bash removes it (once per
    process), with a group the command made inside it; a group of a live dsh and one not named like the
    plugin's are kept."""
    only(monkeypatch, version)
    monkeypatch.setattr(CommandCgroups, "_swept", set())
    dead = subprocess.Popen([sys.executable, "-I", "-S", "-c", "pass"])
    dead.wait()
    parent = FOUND[version].parent
    stale = os.path.join(parent, f"dsh-bash-{dead.pid}-3")
    nested = [os.path.join(parent, f"dsh-bash-{dead.pid}-4"), os.path.join(parent, f"dsh-bash-{dead.pid}-4", "sub")]
    kept = [os.path.join(parent, f"{PREFIX}999"), os.path.join(parent, f"dsh-bash-x{dead.pid}-3")]
    for path in [stale, *nested, *kept]:
        os.mkdir(path)
    try:
        async with boot(bash(tmp_path)) as h:
            assert (await h.call("bash", {"command": "true"})).value["exit_code"] == 0
        assert not os.path.exists(stale) and not os.path.exists(nested[0])
        assert all(os.path.exists(path) for path in kept)
    finally:
        for path in [stale, *nested[::-1], *kept]:
            with contextlib.suppress(OSError):
                os.rmdir(path)


def test_stale_groups_are_found_by_name_and_owner(tmp_path: Path) -> None:
    """The sweep without a cgroup file system: only groups named ``<prefix>-<pid>-<n>`` whose pid is gone,
    each with the groups below it, bottom-up, when no task is left in that tree (a file stands for a task:
    ``rmdir`` refuses both)."""
    dead = subprocess.Popen([sys.executable, "-I", "-S", "-c", "pass"])
    dead.wait()
    made = CommandCgroups("dsh-bash", [Hierarchy(str(tmp_path), 1)])
    stale = tmp_path / f"dsh-bash-{dead.pid}-0"
    nested = tmp_path / f"dsh-bash-{dead.pid}-2"
    live = tmp_path / f"dsh-bash-{os.getpid()}-0"
    other = tmp_path / f"dsh-bashful-{dead.pid}-0"
    busy = tmp_path / f"dsh-bash-{dead.pid}-1"
    for path in (stale, nested / "sub" / "deeper", nested / "other", live, other, busy / "child", busy / "empty"):
        path.mkdir(parents=True)
    (busy / "child" / "task").touch()
    assert sorted(made.sweep_stale()) == [str(stale), str(nested)]
    assert not stale.exists() and not nested.exists() and live.exists() and other.exists()
    assert sorted(path.name for path in busy.iterdir()) == ["child"]  # what the busy tree does not need goes


def test_without_a_v2_mount_or_own_group_no_v2_hierarchy_is_found(tmp_path: Path) -> None:
    """The v2 group is dsh's own, found through its mount (a mount of a subtree too), never guessed."""
    mountinfo, proc_cgroup = tmp_path / "mountinfo", tmp_path / "cgroup"
    point = tmp_path / "unified"
    (point / "me").mkdir(parents=True)  # the mount shows the subtree /svc: /svc/me is point/me
    (point / "me" / "cgroup.procs").touch()
    mountinfo.write_text(f"41 31 0:38 /svc {point} rw,relatime - cgroup2 cgroup2 rw\n")
    proc_cgroup.write_text("8:pids:/\n0::/svc/me\n")
    found = cgroups.hierarchies(mountinfo=str(mountinfo), proc_cgroup=str(proc_cgroup))
    assert found == [Hierarchy(str(point / "me"), 2)]
    proc_cgroup.write_text("8:pids:/\n")  # v1 only
    assert cgroups.hierarchies(mountinfo=str(mountinfo), proc_cgroup=str(proc_cgroup)) == []
    proc_cgroup.write_text("0::/other/me\n")  # outside what the mount shows
    assert cgroups.hierarchies(mountinfo=str(mountinfo), proc_cgroup=str(proc_cgroup)) == []


def test_the_v1_group_is_made_under_dshs_own_pids_group(tmp_path: Path) -> None:
    """On v1 the command's group is made in dsh's own pids group (its ``N:pids:/path`` line, the controller
    alone or mounted with others), so dsh's own pids limit holds for the command; never guessed."""
    mountinfo, proc_cgroup = tmp_path / "mountinfo", tmp_path / "cgroup"
    own = tmp_path / "pids" / "system.slice" / "dsh.service"
    own.mkdir(parents=True)
    (own / "cgroup.procs").touch()
    (tmp_path / "pids" / "cgroup.procs").touch()
    mount = f"39 31 0:36 / {tmp_path / 'pids'} rw,relatime - cgroup cgroup rw,{{options}}\n"  # no v2 mount
    for options, line in (("pids", "8:pids:"), ("cpu,pids", "8:cpu,pids:")):
        mountinfo.write_text(mount.format(options=options))
        proc_cgroup.write_text(f"9:name=systemd:/\n{line}/system.slice/dsh.service\n0::/\n")
        found = cgroups.hierarchies(mountinfo=str(mountinfo), proc_cgroup=str(proc_cgroup))
        assert found == [Hierarchy(str(own), 1)]
    proc_cgroup.write_text("8:pids:/\n")
    found = cgroups.hierarchies(mountinfo=str(mountinfo), proc_cgroup=str(proc_cgroup))
    assert found == [Hierarchy(str(tmp_path / "pids"), 1)]
    for text in ("8:pids:/elsewhere\n", "9:name=systemd:/\n0::/\n"):  # a group not there, no pids line
        proc_cgroup.write_text(text)
        assert cgroups.hierarchies(mountinfo=str(mountinfo), proc_cgroup=str(proc_cgroup)) == []


def test_a_v1_pids_mount_of_a_subtree_is_found_through_mountinfo(tmp_path: Path) -> None:
    """A container sharing the host's cgroup namespace (Docker's default on a v1 host): /proc/self/cgroup
    names the host's path, ``/docker/<id>``, while the pids mount shows that subtree only (mountinfo's root
    field), wherever it is mounted. The group is found there, as for v2; never under a guessed path."""
    mountinfo, proc_cgroup = tmp_path / "mountinfo", tmp_path / "cgroup"
    point = tmp_path / "somewhere" / "pids"  # not <cgroup root>/pids: the mount point is read, not assumed
    (point / "sub").mkdir(parents=True)
    for group in (point, point / "sub"):
        (group / "cgroup.procs").touch()
    other = tmp_path / "memory"  # another controller's mount of the same subtree is never taken for pids'
    other.mkdir()
    (other / "cgroup.procs").touch()
    mountinfo.write_text(
        f"35 31 0:32 /docker/abc {other} rw,relatime - cgroup cgroup rw,memory\n"
        f"39 31 0:36 /docker/abc {point} rw,relatime - cgroup cgroup rw,pids\n"
    )
    expected = {"/docker/abc": point, "/docker/abc/sub": point / "sub", "/docker/abcd": None, "/": None}
    for own, path in expected.items():
        proc_cgroup.write_text(f"9:name=systemd:{own}\n4:memory:{own}\n8:pids:{own}\n0::{own}\n")
        found = cgroups.hierarchies(mountinfo=str(mountinfo), proc_cgroup=str(proc_cgroup))
        assert found == ([] if path is None else [Hierarchy(str(path), 1)]), own
    # The same hierarchy with no pids line, or pids' line with no pids mount: none.
    proc_cgroup.write_text("4:memory:/docker/abc\n")
    assert cgroups.hierarchies(mountinfo=str(mountinfo), proc_cgroup=str(proc_cgroup)) == []
    proc_cgroup.write_text("8:pids:/docker/abc\n")
    mountinfo.write_text(f"35 31 0:32 /docker/abc {other} rw,relatime - cgroup cgroup rw,memory\n")
    assert cgroups.hierarchies(mountinfo=str(mountinfo), proc_cgroup=str(proc_cgroup)) == []


def test_a_mount_point_or_root_with_a_space_is_read_as_mountinfo_escapes_it(tmp_path: Path) -> None:
    """mountinfo writes a space, tab, newline or backslash in a mount point or root as an octal escape
    (``\\040``): read literally, a hierarchy mounted under such a path was never found, and containment
    silently dropped."""
    mountinfo, proc_cgroup = tmp_path / "mountinfo", tmp_path / "cgroup"
    point = tmp_path / "my cgroups" / "pi\\ds"
    point.mkdir(parents=True)
    (point / "cgroup.procs").touch()
    escaped = str(point).replace("\\", "\\134").replace(" ", "\\040")
    mountinfo.write_text(f"39 31 0:36 /docker/a\\040b {escaped} rw,relatime - cgroup cgroup rw,pids\n")
    proc_cgroup.write_text("8:pids:/docker/a b\n")
    found = cgroups.hierarchies(mountinfo=str(mountinfo), proc_cgroup=str(proc_cgroup))
    assert found == [Hierarchy(str(point), 1)]


def test_of_several_mounts_showing_dshs_group_a_read_write_one_of_the_topmost_root_is_taken(tmp_path: Path) -> None:
    """The same hierarchy may be mounted more than once (a read-only bind of it for a container, a mount of
    a subtree): the first listed was taken, a read-only one where a writable one was there too. A read-write
    mount is taken before a read-only one (per-mount or superblock option), and of those the one whose root
    is topmost; the first listed only among equals."""
    mountinfo, proc_cgroup = tmp_path / "mountinfo", tmp_path / "cgroup"
    points = {name: tmp_path / name for name in ("ro", "sro", "sub", "top", "top2")}
    for point in points.values():
        (point / "svc" / "me").mkdir(parents=True)
        (point / "me").mkdir()
        for group in (point / "svc" / "me", point / "me"):
            (group / "cgroup.procs").touch()
    lines = {
        "ro": f"39 31 0:36 / {points['ro']} ro,relatime - cgroup cgroup rw,pids\n",  # mounted read-only
        "sro": f"40 31 0:36 / {points['sro']} rw,relatime - cgroup cgroup ro,pids\n",  # read-only superblock
        "sub": f"41 31 0:36 /svc {points['sub']} rw,relatime - cgroup cgroup rw,pids\n",  # a subtree
        "top": f"42 31 0:36 / {points['top']} rw,relatime - cgroup cgroup rw,pids\n",
        "top2": f"43 31 0:36 / {points['top2']} rw,relatime - cgroup cgroup rw,pids\n",
    }
    proc_cgroup.write_text("8:pids:/svc/me\n")
    expected = [
        (("ro", "sro", "sub", "top", "top2"), points["top"] / "svc" / "me"),
        (("ro", "sro", "sub"), points["sub"] / "me"),
        (("ro", "sro"), points["ro"] / "svc" / "me"),  # read-only alone: the first listed, as before
    ]
    for names, group in expected:
        mountinfo.write_text("".join(lines[name] for name in names))
        found = cgroups.hierarchies(mountinfo=str(mountinfo), proc_cgroup=str(proc_cgroup))
        assert found == [Hierarchy(str(group), 1)], names


def _mount_point_of(path: str) -> str:
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


@pytest.mark.skipif(1 not in FOUND or os.geteuid() != 0, reason="needs a writable v1 pids hierarchy and root")
def test_a_v1_command_is_contained_in_a_container_that_sees_only_its_own_pids_subtree(tmp_path: Path) -> None:
    """The real thing: a dsh in a mount namespace of its own, whose pids mount shows only dsh's group (bind
    mounted elsewhere, the hierarchy's own mount gone), as a container sharing the host's cgroup namespace
    sees it. The command's group is made there, and what leaves its session dies with the call."""
    own = os.path.join(FOUND[1].parent, f"dsh-test-ct-{os.getpid()}")
    point = tmp_path / "pids"
    point.mkdir()
    os.mkdir(own)
    try:
        done = in_a_process(
            tmp_path,
            prelude=f"""
import dsh_core.cgroups
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x00020000) == 0, ctypes.get_errno()  # CLONE_NEWNS
assert libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) == 0, ctypes.get_errno()  # MS_REC|MS_PRIVATE
open({os.path.join(own, "cgroup.procs")!r}, "w").write(str(os.getpid()))
assert libc.mount({own!r}.encode(), {str(point)!r}.encode(), None, 0x1000, None) == 0, ctypes.get_errno()  # MS_BIND
assert libc.umount2({_mount_point_of(FOUND[1].parent)!r}.encode(), 2) == 0, ctypes.get_errno()  # MNT_DETACH
found = dsh_core.cgroups.hierarchies
dsh_core.cgroups.hierarchies = lambda *args, **kwargs: [h for h in found(*args, **kwargs) if h.version == 1]
""",
            body=f"""
            result = await h.call("bash", {{"command": {ESCAPES!r} + "; grep :pids: /proc/self/cgroup"}})
            print(json.dumps({{"output": result.value["output"], "pid": os.getpid(),
                               "found": [h.parent for h in dsh_core.cgroups.hierarchies()],
                               "left": [name for name in os.listdir({str(point)!r}) if name.startswith("dsh-bash-")]}}))
            """,
        )
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout.splitlines()[-1])
        assert seen["found"] == [str(point)] and seen["left"] == [], seen
        line = seen["output"].splitlines()[-1].split(":", 2)[2]
        assert line.startswith(f"{own[len(_mount_point_of(own)) :]}/dsh-bash-{seen['pid']}-"), seen
        assert escaped(tmp_path) == []
    finally:
        kill_escapes(tmp_path)
        deadline = time.monotonic() + 5
        while not cgroups.remove_tree(own) and time.monotonic() < deadline:
            time.sleep(0.05)


@pytest.mark.skipif(1 not in FOUND, reason="no writable v1 pids hierarchy")
def test_a_v1_command_runs_under_dshs_own_pids_group(tmp_path: Path) -> None:
    """A dsh in a pids group of its own (a service's): the command's group is inside it, and is removed."""
    own = os.path.join(FOUND[1].parent, f"dsh-test-own-{os.getpid()}")
    os.mkdir(own)
    try:
        done = in_a_process(
            tmp_path,
            prelude=f"""
import dsh_core.cgroups
open({os.path.join(own, "cgroup.procs")!r}, "w").write(str(os.getpid()))
found = dsh_core.cgroups.hierarchies
dsh_core.cgroups.hierarchies = lambda *args, **kwargs: [h for h in found(*args, **kwargs) if h.version == 1]
""",
            body="""
            result = await h.call("bash", {"command": "grep :pids: /proc/self/cgroup"})
            print(json.dumps({"line": result.value["output"], "pid": os.getpid()}))
            """,
        )
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout.splitlines()[-1])
        group = seen["line"].strip().split(":", 2)[2]
        assert group.startswith(f"/{os.path.basename(own)}/dsh-bash-{seen['pid']}-"), seen
        assert os.listdir(own) == [name for name in os.listdir(own) if not name.startswith("dsh-bash-")]
    finally:
        cgroups.remove_tree(own)


@pytest.mark.skipif(not FOUND, reason="no writable cgroup hierarchy")
def test_as_a_subreaper_dsh_reaps_what_the_cgroup_kill_killed(tmp_path: Path) -> None:
    """Killed processes that had left the session become dsh's children when it is a subreaper: they are
    reaped, not left as zombies."""
    try:
        done = in_a_process(
            tmp_path,
            prelude="assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0",  # SUBREAPER
            body=f"""
            result = await h.call("bash", {{"command": {ESCAPES!r}}})
            timed = await h.call("bash", {{"command": "rm *.pid; " + {ESCAPES!r} + "; sleep 100", "timeout": 2}})
            children = await children_left()
            print(json.dumps({{"codes": [result.value["exit_code"], timed.code], "children": children}}))
            """,
        )
    finally:
        kill_escapes(tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"codes": [0, "TOOL_FAILED"], "children": []}


#: A "shell" that runs its -c argument as Python: it shows the environment and fds exactly as exec'd,
#: with no shell of its own to rewrite them.
REPORT = (
    "import json, os; fds = [os.path.realpath('/proc/self/fd/' + n) for n in os.listdir('/proc/self/fd')]; "
    "print(json.dumps({'env': dict(os.environ), 'fds': sorted(fds)}))"
)
#: Names a POSIX shell cannot carry (dash drops them), an exported bash function, and what a shell resets.
ODD_ENV = {
    "a.b": "1",
    "X-Y": "2",
    "BASH_FUNC_greet%%": "() {  echo hi from greet\n}",
    "IFS": "x",
    "OPTIND": "7",
    "PWD": "/nowhere",
    "SHLVL": "41",
}


@pytest.mark.parametrize("version", backends())
async def test_the_environment_reaches_the_command_as_without_a_cgroup(
    boot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int | None
) -> None:
    """Joining the group changes nothing the command sees: every variable passes exactly as built (names
    with ``.`` or ``-``, an exported bash function, IFS/OPTIND/PWD/SHLVL), no fd of the group reaches it,
    and bash still defines the exported function."""
    only(monkeypatch, version)
    # A C locale would make Python add LC_CTYPE (its locale coercion): not the join's doing.
    config = {"env": {**ODD_ENV, "LC_ALL": "C.UTF-8"}, "env_allowlist": ["PATH"]}
    async with boot(bash(tmp_path, shell=sys.executable, **config)) as h:
        seen = json.loads((await h.call("bash", {"command": REPORT})).value["output"])
    async with boot(bash(tmp_path, **config)) as h:
        greet = (await h.call("bash", {"command": "greet; env | grep -c -e '^a\\.b=' -e '^X-Y='"})).value
    assert seen["env"] == build_environment(dict(os.environ), ["PATH"], config["env"])
    assert not [target for target in seen["fds"] if "cgroup" in target], seen["fds"]
    assert greet == {"exit_code": 0, "output": "hi from greet\n2\n", "truncated": False}
    assert our_groups() == []


@pytest.mark.parametrize("version", backends())
async def test_a_shell_that_cannot_start_is_refused_as_without_a_cgroup(
    boot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int | None
) -> None:
    """A missing shell, one that is not executable and one with no ``#!`` fail the call with the exec's
    own error, naming the configured shell: never an exit code, never run by another shell."""
    only(monkeypatch, version)
    (tmp_path / "noexec").write_text("#!/bin/sh\necho ran\n")
    (tmp_path / "noshebang").write_text("echo ran\n")
    (tmp_path / "noshebang").chmod(0o755)
    expected = {
        "missing": "No such file or directory",
        "noexec": "Permission denied",
        "noshebang": "Exec format error",
    }
    texts = {}
    for name in expected:
        async with boot(bash(tmp_path, shell=str(tmp_path / name))) as h:
            result = await h.call("bash", {"command": "echo ran"})
            texts[name] = (result.code, result.text)
    assert texts == {
        name: ("TOOL_FAILED", f"Error: could not start {tmp_path / name}: {error}") for name, error in expected.items()
    }
    assert our_groups() == []


@pytest.mark.parametrize("version", backends())
async def test_a_workspace_root_gone_since_the_load_is_named_as_the_cause(
    boot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int | None
) -> None:
    """A root removed (or replaced by a file) after the load fails the call naming the root, not the shell:
    the shell is there, and "could not start /usr/bin/bash: No such file or directory" sent the reader
    looking for it."""
    only(monkeypatch, version)
    root = tmp_path / "workspace"
    root.mkdir()
    async with boot(bash(root)) as h:
        shell = shutil.which("bash")  # the shell the plugin found on PATH
        root.rmdir()
        gone = await h.call("bash", {"command": "echo ran"})
        root.write_text("")
        a_file = await h.call("bash", {"command": "echo ran"})
    cause = f"Error: could not start {shell}: the workspace root {root.resolve()} cannot be its working directory"
    for result, error in ((gone, "No such file or directory"), (a_file, "Not a directory")):
        assert (result.code, result.text) == ("TOOL_FAILED", f"{cause}: {error}")
    assert our_groups() == []


async def test_a_command_too_long_for_one_argument_is_refused_naming_its_length(boot: Any, tmp_path: Path) -> None:
    """The command is one argument of the shell, which the kernel bounds (128 KiB on Linux): past that the
    exec's "Argument list too long" says what was too long and what to do instead."""
    command = "x=" + "x" * 140_000 + "; echo ${#x}"
    async with boot(bash(tmp_path)) as h:
        result = await h.call("bash", {"command": command})
    assert result.code == "TOOL_FAILED"
    assert result.text == (
        f"Error: could not start {shutil.which('bash')}: Argument list too long (the command, 140,014 bytes, is "
        "one argument of the shell, and the system bounds its length: write a long script to a file in the "
        "workspace and run that)"
    )


class _Exited:
    """A subprocess transport whose shell ``pid`` exited with 0."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def get_returncode(self) -> int:
        return 0

    def get_pid(self) -> int:
        return self.pid


class _Seen:
    """A command group that once listed ``seen``."""

    def __init__(self, seen: set[int]) -> None:
        self.seen = seen


async def test_a_dsh_that_adopts_no_orphans_never_waits_for_the_cgroups_members(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unless dsh is PID 1 or a child subreaper, no member of the command's cgroup but the shell can be its
    child: a pid the group once listed that is now dsh's exited child is another process of dsh's (its
    number reused), whose exit status belongs to whoever started it (asyncio's child watcher)."""
    assert os.getpid() != 1
    shell = subprocess.Popen([sys.executable, "-I", "-S", "-c", "pass"])
    shell.wait()
    other = subprocess.Popen([sys.executable, "-I", "-S", "-c", "raise SystemExit(7)"])
    waited: list[int] = []
    real = os.waitpid

    def waitpid(pid: int, options: int) -> tuple[int, int]:
        waited.append(pid)
        return real(pid, options)

    try:
        while Path(f"/proc/{other.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            await asyncio.sleep(0.01)
        monkeypatch.setattr(os, "waitpid", waitpid)
        await bash_module._reap_group(_Exited(shell.pid), _Seen({shell.pid, other.pid}))  # type: ignore[arg-type]
        monkeypatch.undo()
        assert other.pid not in waited and other.wait(timeout=5) == 7, waited  # its status is still its own
    finally:
        other.wait(timeout=5)


@pytest.mark.skipif(2 not in FOUND, reason="no writable cgroup v2 group")
@pytest.mark.parametrize("how", ["exit", "timeout"])
async def test_a_v2_group_is_killed_with_one_write(
    boot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """``cgroup.kill`` kills the whole tree at once, forks in progress included: one write per call."""
    only(monkeypatch, 2)
    writes: list[tuple[str, str]] = []
    real = cgroups.write_file

    def write_file(path: str, text: str) -> None:
        writes.append((os.path.basename(path), text))
        real(path, text)

    monkeypatch.setattr(cgroups, "write_file", write_file)
    async with boot(bash(tmp_path)) as h:
        result = await h.call(
            "bash", {"command": "sleep 100 &" + (" sleep 100" if how == "timeout" else ""), "timeout": 1}
        )
    assert result.code == {"exit": None, "timeout": "TOOL_FAILED"}[how], result.text
    assert writes == [("cgroup.kill", "1")]
    assert our_groups() == []


@pytest.mark.skipif(1 not in FOUND, reason="no writable v1 pids hierarchy")
async def test_a_v1_group_can_no_longer_fork_before_its_first_sigkill(
    boot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v1 has no cgroup.kill: ``pids.max`` 0 in the group and every group inside it comes first, so that
    no member forks between a listing and its SIGKILL."""
    only(monkeypatch, 1)
    events: list[tuple[str, str]] = []
    real_write, real_signal = cgroups.write_file, cgroups.CommandGroup._signal_member

    def write_file(path: str, text: str) -> None:
        events.append((os.path.relpath(path, FOUND[1].parent), text))
        real_write(path, text)

    def signal_member(group: cgroups.CommandGroup, pid: int, signum: int) -> None:
        if signum == signal.SIGKILL:
            events.append(("SIGKILL", ""))
        real_signal(group, pid, signum)

    monkeypatch.setattr(cgroups, "write_file", write_file)
    monkeypatch.setattr(cgroups.CommandGroup, "_signal_member", signal_member)
    command = NESTED.format(parent=FOUND[1].parent, controller="pids")
    try:
        async with boot(bash(tmp_path)) as h:
            result = await h.call("bash", {"command": command, "timeout": 10})
        assert result.code is None, result.text
        first = events.index(("SIGKILL", ""))
        frozen = sorted(path.split("/", 1)[1] if "/" in path else "" for path, _ in events[:first])
        assert all(text == "0" and path.endswith("pids.max") for path, text in events[:first]), events
        assert frozen == ["pids.max", "sub/deeper/pids.max", "sub/pids.max"], events
        assert escaped(tmp_path) == [] and our_groups() == []
    finally:
        kill_escapes(tmp_path)


@pytest.mark.parametrize("version", [p for p in backends() if p.values[0] is not None])
async def test_a_call_in_flight_when_the_plugin_ends_leaves_no_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int
) -> None:
    """The plugin's scope ending (``close``) kills and removes the groups of the calls still running, not
    only the ones a cut kill left: nothing it started outlives it, however the call ends afterwards."""
    only(monkeypatch, version)
    tool = BashTool({"root": str(tmp_path)})
    assert tool.cgroups is not None

    class Context:
        signal = AbortController().signal

    call = asyncio.ensure_future(tool.run({"command": "sleep 300 & echo $! > bg.pid; wait"}, Context()))
    try:
        while not (tmp_path / "bg.pid").exists() or not (tmp_path / "bg.pid").read_text().strip():
            await asyncio.sleep(0.02)
        await tool.cgroups.close()
        assert our_groups() == [] and tool.cgroups.pending == []
        assert not alive(int((tmp_path / "bg.pid").read_text()), settle_s=10)
        result = await asyncio.wait_for(call, 10)  # its command was killed: it ends at once
        assert result["exit_code"] == 128 + signal.SIGKILL, result
        assert our_groups() == [] and tool.cgroups.pending == []
    finally:
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        kill_bg = tmp_path / "bg.pid"
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int(kill_bg.read_text()), signal.SIGKILL)
        if tool.cgroups.pending:
            await tool.cgroups.close()
        for group in our_groups():
            cgroups.remove_tree(group)


@pytest.mark.parametrize("version", [p for p in backends() if p.values[0] is not None])
async def test_a_call_that_starts_after_the_plugin_ended_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int
) -> None:
    """Once the plugin's groups are closed (its scope is being disposed) no group is made: a command started
    then would run uncontained and could outlive the plugin, so it is refused, saying why, and never run."""
    only(monkeypatch, version)
    tool = BashTool({"root": str(tmp_path)})
    assert tool.cgroups is not None
    await tool.cgroups.close()

    class Context:
        signal = AbortController().signal

    with pytest.raises(ToolError, match=r"^the bash plugin is shutting down: .*not run"):
        await tool.run({"command": "touch ran"}, Context())
    assert not (tmp_path / "ran").exists() and our_groups() == []


@pytest.mark.parametrize("version", [p for p in backends() if p.values[0] is not None])
async def test_a_call_cancelled_while_its_pipes_connect_ends_promptly_with_a_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int
) -> None:
    """A cancellation while ``subprocess_exec`` still connects the output pipe: asyncio kills the shell, then
    waits for the pipe's end (CPython gh-103847), which a process that left the session holds open. With a
    cgroup the group is killed at once: the call ends promptly, and nothing it started outlives it. The
    connect step is held on an event, so the cancellation always lands inside it."""
    only(monkeypatch, version)
    monkeypatch.setattr(cgroups, "KILL_WITHIN_S", LONG_KILL_S)
    tool = BashTool({"root": str(tmp_path)})
    assert tool.cgroups is not None
    loop = asyncio.get_running_loop()
    real_connect = loop.connect_read_pipe
    connecting, release = asyncio.Event(), asyncio.Event()

    async def connect_read_pipe(*args: Any, **kwargs: Any) -> Any:
        connecting.set()
        await release.wait()
        return await real_connect(*args, **kwargs)

    monkeypatch.setattr(loop, "connect_read_pipe", connect_read_pipe)

    class Context:
        signal = AbortController().signal

    pid_file = tmp_path / "setsid.pid"
    command = "setsid sleep 300 & echo $! > setsid.pid; sleep 300"  # setsid's sleep holds the output pipe
    call = asyncio.ensure_future(tool.run({"command": command}, Context()))
    try:
        await asyncio.wait_for(connecting.wait(), 10)
        while not pid_file.exists() or not pid_file.read_text().strip():
            await asyncio.sleep(0.02)
        call.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(call), LONG_KILL_S / 2)  # not the leftover's 300 s, nor the bound
        assert not alive(int(pid_file.read_text()), settle_s=10)
        assert our_groups() == [] and tool.cgroups.pending == []
    finally:
        release.set()
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await tool.cgroups.close()


@pytest.mark.parametrize("outlived", [True, False])
async def test_a_group_discarded_while_close_kills_it_is_pending_once(tmp_path: Path, outlived: bool) -> None:
    """``close()`` kills the group of a call still running; the call ends meanwhile and discards it, which
    keeps it pending (a member is still there). It is then pending once when close's kill could not remove
    it either (a member outlived both), not once by each; and not at all when the kill removed it."""
    made = CommandCgroups("dsh-bash", [Hierarchy(str(tmp_path), 1)])
    group = made.create()
    assert group is not None
    task = Path(group.path) / "task"
    task.touch()  # a file stands for a task: rmdir refuses the group
    killing, release = asyncio.Event(), asyncio.Event()

    async def kill(within_s: float | None = None) -> bool:
        killing.set()
        await release.wait()
        if not outlived:
            task.unlink()
        return group.remove()

    group.kill = kill  # type: ignore[method-assign]
    closing = asyncio.ensure_future(made.close())
    await asyncio.wait_for(killing.wait(), 10)
    made.discard(group)  # the call's end, while close() still kills its group
    assert made.pending == [group]
    release.set()
    await closing
    assert made.pending == ([group] if outlived else []) and made.active == []
    assert os.path.exists(group.path) == outlived


def _refuse_mkdir_once(monkeypatch: pytest.MonkeyPatch, error: int, where: Path) -> None:
    """``os.mkdir`` in ``where`` fails once with ``error``, then works; a group made in a fake v2 hierarchy
    (a directory named ``v2``) gets its ``cgroup.kill``, as the kernel's does."""
    real = os.mkdir
    left = [error]

    def mkdir(path: str, *args: Any, **kwargs: Any) -> None:
        if left and os.path.dirname(path) == str(where):
            refused = left.pop()
            raise OSError(refused, os.strerror(refused), path)
        real(path, *args, **kwargs)
        if os.path.basename(os.path.dirname(path)) == "v2":
            Path(path, "cgroup.kill").touch()

    monkeypatch.setattr(os, "mkdir", mkdir)


@pytest.mark.parametrize("error", [errno.EAGAIN, errno.EMFILE, errno.ENOSPC, errno.ENOMEM], ids=errno.errorcode.get)
def test_a_passing_refusal_costs_one_call_its_group_not_every_later_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    """A group refused for now (EAGAIN at ``cgroup.max.descendants``, a full table) leaves that call without
    one, or in the next hierarchy; the hierarchy is asked again at the next call, not given up for good."""
    best, other = tmp_path / "v2", tmp_path / "v1"
    best.mkdir()
    other.mkdir()
    alone = CommandCgroups("dsh-bash", [Hierarchy(str(other), 1)])
    _refuse_mkdir_once(monkeypatch, error, other)
    assert alone.create() is None
    group = alone.create()
    assert group is not None and os.path.isdir(group.path) and alone.hierarchies == [Hierarchy(str(other), 1)]
    both = CommandCgroups("dsh-bash", [Hierarchy(str(best), 2), Hierarchy(str(other), 1)])
    _refuse_mkdir_once(monkeypatch, error, best)
    first, second = both.create(), both.create()
    assert first is not None and first.hierarchy.version == 1
    assert second is not None and second.hierarchy.version == 2


@pytest.mark.parametrize(
    "error",
    [errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, None],
    ids=lambda e: errno.errorcode.get(e, "no-kill"),
)
def test_a_lasting_refusal_gives_the_hierarchy_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int | None
) -> None:
    """A hierarchy dsh may not write (or that is gone, or a v2 one without ``cgroup.kill``, ``None`` here) is not
    asked again: the calls go to the next one, or without a group."""
    if error is None:
        made = CommandCgroups("dsh-bash", [Hierarchy(str(tmp_path), 2)])  # no cgroup.kill in its groups
    else:
        made = CommandCgroups("dsh-bash", [Hierarchy(str(tmp_path), 1)])
        _refuse_mkdir_once(monkeypatch, error, tmp_path)
    assert made.create() is None and made.hierarchies == []
    assert made.create() is None and os.listdir(tmp_path) == []
