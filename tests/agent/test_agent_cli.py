"""``dsh -p``, ``dsh sessions`` and ``dsh demo`` as a user runs them (subprocesses, no TTY)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
from agent_kit import call, calls, final, write_script

from dsh_core.agent.demo import DEMO_TASK
from dsh_core.agent.loop import StopReason
from dsh_core.sessions import SessionLease
from dsh_core.sessions.sqlite import SqliteSessionStore
from dsh_plugins.providers.scripted import NO_MODEL_NOTICE


def dsh(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSH_")}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "dsh_core", *args],
        cwd=cwd,
        env=environ,
        text=True,
        capture_output=True,
        timeout=60,
        check=False,
    )


def test_dsh_p_works_out_of_the_box_and_prints_only_the_answer(tmp_path: Path) -> None:
    done = dsh("-p", "hello", cwd=tmp_path, env={"DSH_HOME": str(tmp_path / "home")})
    assert done.returncode == 0, done.stderr
    assert done.stdout == NO_MODEL_NOTICE + "\n"
    assert done.stderr == ""  # not a terminal: no progress output
    assert (tmp_path / "home" / "sessions.db").exists()


def config(tmp_path: Path, turns: list[dict[str, Any]], max_turns: int = 5) -> Path:
    script = write_script(tmp_path / "script.jsonl", turns)
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "a.txt").write_text("alpha\n")
    path = tmp_path / "dsh.toml"
    path.write_text(f"""
[sessions]
home = {json.dumps(str(tmp_path / "home"))}

[[agents]]
id = "main"
provider = "scripted"
max_turns = {max_turns}

[[plugins]]
id = "workspace"
use = "workspace"
config = {{ root = {json.dumps(str(tmp_path / "ws"))} }}

[[plugins]]
id = "scripted"
use = "scripted"
config = {{ script = {json.dumps(str(script))} }}

[[plugins]]
id = "sessions"
use = "sqlite-sessions"
""")
    return path


CHATTY_PLUGIN = """
from dsh_core import define_tool, hookimpl, plugin

class Chatty:
    @hookimpl
    def dsh_register_tools(self, register):
        async def body(args, ctx):
            print("chatty tool runs")
            return "said hi"

        register(define_tool(name="chatty", description="Print, then answer.", parameters={"type": "object"},
                             execute=body))

@plugin()
def make(scope, config):
    print("chatty factory runs")
    scope.on_dispose(lambda: print("chatty disposed"))
    return Chatty()
"""


def test_what_a_plugin_prints_during_a_run_goes_to_stderr_not_before_the_answer(tmp_path: Path) -> None:
    # stdout is the answer alone; a plugin's print() (factory, tool body, disposer) used to land there.
    cfg = config(tmp_path, [calls(call("chatty", {})), final("The answer.", {"last_role": "tool"})])
    (tmp_path / "chatty_plugin.py").write_text(CHATTY_PLUGIN)
    with cfg.open("a") as out:
        out.write('\n[[plugins]]\nid = "chatty"\nuse = "chatty"\n')
    env = {
        "DSH_PLUGINS": "chatty=chatty_plugin:make",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    done = dsh("--config", str(cfg), "-p", "go", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "The answer.\n"
    assert done.stderr == "chatty factory runs\nchatty tool runs\nchatty disposed\n"
    # `dsh sessions` boots the same deployment to reach its store.
    listed = dsh("sessions", "list", "--json", "--config", str(cfg), cwd=tmp_path, env=env)
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)) == 1
    assert listed.stderr == "chatty factory runs\nchatty disposed\n"


def test_a_run_is_recorded_listed_shown_and_resumed(tmp_path: Path) -> None:
    turns = [
        calls(call("read", {"path": "a.txt"}, "r")),
        final("It says alpha.", {"last_role": "tool"}),
        final("Still alpha.", {"last_content_contains": "again"}),
    ]
    cfg = config(tmp_path, turns)
    first = dsh("--config", str(cfg), "-p", "what is in a.txt?", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout == "It says alpha.\n" and first.stderr == ""

    listed = dsh("sessions", "list", "--config", str(cfg), "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    (session,) = json.loads(listed.stdout)
    assert session["meta"] == {"agent": "main", "task": "what is in a.txt?"}
    table = dsh("sessions", "list", "--config", str(cfg), cwd=tmp_path)
    assert session["id"] in table.stdout and "what is in a.txt?" in table.stdout

    again = dsh("--config", str(cfg), "-p", "again?", "--session", session["id"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout == "Still alpha.\n"

    shown = dsh("sessions", "show", session["id"], "--config", str(cfg), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"session {session['id']} · agent main · ")
    assert lines[1] == "├─ run 1: what is in a.txt? · provider scripted · mode native"
    assert any(line.startswith('│  ├─ read [1.1] {"path": "a.txt"} — ok · ') for line in lines)
    assert "│  └─ end: final-answer after 2 turn(s)" in lines
    assert lines[-4:] == [
        "└─ run 2 (resumed): again? · provider scripted · mode native",
        "   ├─ user: again?",
        "   ├─ assistant: Still alpha.",
        "   └─ end: final-answer after 1 turn(s)",
    ]
    events = json.loads(dsh("sessions", "show", session["id"], "--json", "--config", str(cfg), cwd=tmp_path).stdout)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))


def test_a_run_without_an_answer_exits_1_and_says_why(tmp_path: Path) -> None:
    cfg = config(tmp_path, [calls(call("read", {"path": "a.txt"})), final("late")], max_turns=1)
    done = dsh("--config", str(cfg), "-p", "go", cwd=tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    assert "dsh: run stopped: turn-limit: the turn limit (1) was reached before a final answer" in done.stderr


def test_unknown_sessions_fail_with_usage_errors(tmp_path: Path) -> None:
    cfg = config(tmp_path, [final("x")])
    resumed = dsh("--config", str(cfg), "-p", "go", "--session", "nope", cwd=tmp_path)
    assert resumed.returncode == 2 and "dsh: error: no session 'nope'" in resumed.stderr
    shown = dsh("sessions", "show", "nope", "--config", str(cfg), cwd=tmp_path)
    assert shown.returncode == 2 and "no session 'nope'" in shown.stderr


def test_a_session_another_run_holds_fails_with_exit_1_until_that_run_is_gone(tmp_path: Path) -> None:
    cfg = config(tmp_path, [final("one"), final("two", {"last_content_contains": "again"})])
    first = dsh("--config", str(cfg), "-p", "go", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (session,) = json.loads(dsh("sessions", "list", "--config", str(cfg), "--json", cwd=tmp_path).stdout)

    async def hold(lease: SessionLease, *, instead_of: SessionLease | None = None) -> None:
        store = SqliteSessionStore.open(tmp_path / "home")
        try:
            if instead_of is not None:
                await store.release(session["id"], instead_of)
            await store.acquire(session["id"], lease)
        finally:
            await store.close()

    live = SessionLease.for_this_run()
    asyncio.run(hold(live))  # this test process stands in for a run still going
    busy = dsh("--config", str(cfg), "-p", "again", "--session", session["id"], cwd=tmp_path)
    assert busy.returncode == 1 and busy.stdout == ""
    assert busy.stderr.startswith(
        f"dsh: error: session {session['id']!r} is in use by another run (pid {os.getpid()} on host "
    ), busy.stderr
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    asyncio.run(hold(attrs.evolve(live, token="killed", pid=dead.pid), instead_of=live))  # a run killed mid-way
    again = dsh("--config", str(cfg), "-p", "again", "--session", session["id"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout == "two\n"


def test_sessions_release_frees_a_session_whose_holder_dsh_cannot_check(tmp_path: Path) -> None:
    cfg = config(tmp_path, [final("one"), final("two", {"last_content_contains": "again"})])
    assert dsh("--config", str(cfg), "-p", "go", cwd=tmp_path).returncode == 0
    (session,) = json.loads(dsh("sessions", "list", "--config", str(cfg), "--json", cwd=tmp_path).stdout)
    gone = attrs.evolve(SessionLease.for_this_run(), host="container-1f2e")  # killed with its container

    async def hold() -> None:
        store = SqliteSessionStore.open(tmp_path / "home")
        try:
            await store.acquire(session["id"], gone)
        finally:
            await store.close()

    assert session["in_use_by"] is None
    asyncio.run(hold())
    (held,) = json.loads(dsh("sessions", "list", "--config", str(cfg), "--json", cwd=tmp_path).stdout)
    assert held["in_use_by"] == {"pid": os.getpid(), "host": "container-1f2e", "since": gone.since}
    shown = dsh("sessions", "show", session["id"], "--config", str(cfg), cwd=tmp_path)
    assert f"· in use by pid {os.getpid()} on host 'container-1f2e' since " in shown.stdout.splitlines()[0]
    busy = dsh("--config", str(cfg), "-p", "again", "--session", session["id"], cwd=tmp_path)
    assert busy.returncode == 1
    assert f"free the session with: dsh sessions release {session['id']})" in busy.stderr
    released = dsh("sessions", "release", session["id"], "--config", str(cfg), cwd=tmp_path)
    assert released.returncode == 0, released.stderr
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(gone.since))
    assert released.stdout == (
        f"released session {session['id']} (held by pid {os.getpid()} on host 'container-1f2e' since {since})\n"
    )
    again = dsh("--config", str(cfg), "-p", "again", "--session", session["id"], cwd=tmp_path)
    assert again.returncode == 0 and again.stdout == "two\n"
    idle = dsh("sessions", "release", session["id"], "--config", str(cfg), cwd=tmp_path)
    assert idle.returncode == 0 and idle.stdout == f"session {session['id']} was not held by any run\n"
    unknown = dsh("sessions", "release", "nope", "--config", str(cfg), cwd=tmp_path)
    assert unknown.returncode == 2 and "no session 'nope'" in unknown.stderr


def test_a_broken_script_fails_at_boot_naming_the_line(tmp_path: Path) -> None:
    cfg = config(tmp_path, [final("x")])
    (tmp_path / "script.jsonl").write_text('{"role": "assistant", "content": "ok"}\n{"expect": {"colour": 1}}\n')
    done = dsh("--config", str(cfg), "-p", "go", cwd=tmp_path)
    assert done.returncode == 2
    assert "script.jsonl:2: unknown expect key 'colour'" in done.stderr


SLOW_PLUGIN = """
import asyncio, pathlib
import dsh_core.clirun
from dsh_core import define_tool, hookimpl, plugin as declare

MARK = pathlib.Path(__file__).with_name("started")
# A drain no test waits for: a run that only ends when the drain does is told from one the second
# interrupt cancelled by far more than a loaded machine's delays (5 s against a second or two, else).
dsh_core.clirun.DRAIN_SECONDS = 600.0

class Slow:
    @hookimpl
    def dsh_register_tools(self, register):
        async def body(args, ctx):
            MARK.write_text("x")
            while True:  # never watches the abort signal; a stubborn one even ignores cancellation
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    if not args.get("stubborn"):
                        raise

        register(define_tool(name="slow", description="Slow work.", parameters={"type": "object"}, execute=body))

@declare(config_schema={"type": "object"})
def plugin(scope, config):
    return Slow()
"""


def slow_env(tmp_path: Path) -> dict[str, str]:
    return {
        "DSH_PLUGINS": "slow=slow_plugin:plugin",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }


def interrupt(tmp_path: Path, signals: int, *, stubborn: bool = False) -> tuple[int, str, float]:
    """Run ``dsh -p`` with a slow tool, send ``signals`` SIGINTs once it runs; exit code, stderr, seconds."""
    cfg = config(tmp_path, [calls(call("slow", {"stubborn": stubborn})), final("never")])
    (tmp_path / "slow_plugin.py").write_text(SLOW_PLUGIN)
    with cfg.open("a") as out:
        out.write('\n[[plugins]]\nid = "slow"\nuse = "slow"\n')
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSH_")}
    environ.update(slow_env(tmp_path))
    child = subprocess.Popen(
        [sys.executable, "-m", "dsh_core", "--config", str(cfg), "-p", "go"],
        cwd=tmp_path,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "started").exists():
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()[1]
            time.sleep(0.05)
        started = time.monotonic()
        for _ in range(signals):
            child.send_signal(signal.SIGINT)
            time.sleep(0.3)
        _, err = child.communicate(timeout=60)
        return child.returncode, err, time.monotonic() - started
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def last_run_end(tmp_path: Path) -> dict[str, Any] | None:
    cfg, env = str(tmp_path / "dsh.toml"), slow_env(tmp_path)
    listed = dsh("sessions", "list", "--config", cfg, "--json", cwd=tmp_path, env=env)
    (session,) = json.loads(listed.stdout)
    shown = dsh("sessions", "show", session["id"], "--json", "--config", cfg, cwd=tmp_path, env=env)
    ends = [e["payload"] for e in json.loads(shown.stdout) if e["kind"] == "run/end"]
    return ends[-1] if ends else None


def test_a_second_interrupt_cancels_the_run_which_still_records_its_end(tmp_path: Path) -> None:
    code, err, took = interrupt(tmp_path, 2)
    assert code == 130, err
    assert "Traceback" not in err and err.splitlines()[-1] == "dsh: error: interrupted"
    assert "SIGINT received, cancelling (again to exit at once)" in err
    assert took < 30  # not the (600 s) drain: the second interrupt cancels at once
    assert last_run_end(tmp_path) == {
        "reason": str(StopReason.ABORTED),
        "turns": 1,
        "answer": None,
        "error": "cancelled",
    }


def test_a_third_interrupt_exits_at_once(tmp_path: Path) -> None:
    code, err, took = interrupt(tmp_path, 3, stubborn=True)  # the tool swallows the cancellation
    assert code == 130 and took < 30, err  # not never (nor the 600 s drain)
    assert last_run_end(tmp_path) is None


CLASH_PLUGIN = """
from dsh_core import hookimpl, plugin as declare
from dsh_core.model import PromptSection

class Clash:
    @hookimpl
    def dsh_prompt_sections(self, context):
        return [PromptSection("notes", "a", order=1), PromptSection("notes", "b", order=2)]

@declare(config_schema={"type": "object"})
def plugin(scope, config):
    return Clash()
"""


def test_a_run_error_that_is_no_dsh_error_is_one_line_and_recorded(tmp_path: Path) -> None:
    cfg = config(tmp_path, [final("never")])
    (tmp_path / "clash_plugin.py").write_text(CLASH_PLUGIN)
    with cfg.open("a") as out:
        out.write('\n[[plugins]]\nid = "clash"\nuse = "clash"\n')
    env = {
        "DSH_PLUGINS": "clash=clash_plugin:plugin",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    done = dsh("--config", str(cfg), "-p", "go", cwd=tmp_path, env=env)
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("dsh: run stopped: error: prompt section 'notes' is contributed twice")
    listed = dsh("sessions", "list", "--config", str(cfg), "--json", cwd=tmp_path, env=env)
    (session,) = json.loads(listed.stdout)
    shown = dsh("sessions", "show", session["id"], "--config", str(cfg), cwd=tmp_path, env=env)
    assert shown.stdout.splitlines()[-1].startswith("   └─ end: error after 1 turn(s): prompt section 'notes'")


@pytest.mark.skipif(
    importlib.util.find_spec("dsh_core.codemode.transport") is None,
    reason="Code Mode's run_code transport (dsh_core.codemode.transport) is not built yet",
)
def test_the_demo_runs_code_mode_end_to_end(tmp_path: Path) -> None:
    done = dsh("demo", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Answer: Surveyed src/inventory.py" in out
    assert "run_code [1.1] 'Read three files and search for TODOs in parallel' — ok" in out
    for nested in (
        'read [#1] {"path": "src/inventory.py"} — ok',
        'search [#4] {"pattern": "TODO"} — ok',
        'write [#2] {"path": "REPORT.md"',
    ):
        assert nested in out
    assert "REPORT.md: written" in out
    assert "Code Mode sent" in out and "native " in out


CHATTY_DEMO = """
from dsh_core.cli import main
from dsh_plugins import workspace

read = workspace.WorkspaceTools.read

async def chatty(self, args, ctx):
    print("printed by a tool body")
    return await read(self, args, ctx)

workspace.WorkspaceTools.read = chatty
main(["demo"])
"""


@pytest.mark.skipif(
    importlib.util.find_spec("dsh_core.codemode.transport") is None,
    reason="Code Mode's run_code transport (dsh_core.codemode.transport) is not built yet",
)
def test_what_a_tool_body_prints_during_the_demo_goes_to_stderr_not_into_its_report(tmp_path: Path) -> None:
    """The demo ran without run_async's stdout_to_stderr: a plugin's print() came out ahead of the report."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSH_")}
    done = subprocess.run(
        [sys.executable, "-c", CHATTY_DEMO],
        cwd=tmp_path,
        env=environ,
        text=True,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"Task: {DEMO_TASK}\n") and "printed by a tool body" not in done.stdout
    assert "printed by a tool body\n" in done.stderr


@pytest.mark.anyio
async def test_a_demo_whose_tool_call_fails_is_an_error_not_the_scripted_success(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scripted model answers "wrote the report" whatever happened: a failed program still exited 0."""
    from dsh_core.agent import demo
    from dsh_core.errors import DshError

    files = {name: text for name, text in demo.DEMO_FILES.items() if name != "notes/plan.md"}
    monkeypatch.setattr(demo, "DEMO_FILES", files)
    with pytest.raises(
        DshError,
        match=r"(?s)the demo run \(code mode\): tool call run_code \[1\.1\] failed .*: "
        r"CODE_RUN_FAILED: .*file not found: 'notes/plan\.md'",
    ):
        await demo.run_demo(tmp_path)


def test_the_kept_demo_says_how_to_open_its_sessions_and_that_works(tmp_path: Path) -> None:
    done = dsh("demo", "--keep", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "run with --keep to open it later" in done.stdout
    config_path = done.stdout.split("Its sessions: dsh sessions list --config ", 1)[1].split(" ", 1)[0]
    try:
        listed = dsh("sessions", "list", "--config", config_path, "--json", cwd=tmp_path)
        (session,) = json.loads(listed.stdout)
        shown = dsh("sessions", "show", session["id"], "--config", config_path, cwd=tmp_path)
        assert shown.returncode == 0 and "run_code [1.1]" in shown.stdout, shown.stderr
    finally:
        shutil.rmtree(Path(config_path).parent.parent, ignore_errors=True)


def test_the_kept_demos_hint_works_where_dsh_home_is_set(tmp_path: Path) -> None:
    # DSH_HOME overrides [sessions] home: the printed command listed the user's own sessions.
    own_home = {"DSH_HOME": str(tmp_path / "own-home")}
    done = dsh("demo", "--keep", cwd=tmp_path, env=own_home)
    assert done.returncode == 0, done.stderr
    command = shlex.split(done.stdout.split("Its sessions: ", 1)[1].split(" (then", 1)[0])
    assignments = dict(word.split("=", 1) for word in command[: command.index("dsh")])
    config_path = command[command.index("--config") + 1]
    try:
        listed = dsh(*command[command.index("dsh") + 1 :], "--json", cwd=tmp_path, env={**own_home, **assignments})
        assert listed.returncode == 0, listed.stderr
        assert [session["meta"]["agent"] for session in json.loads(listed.stdout)] == ["demo"]
        assert "with the same DSH_HOME and --config" in done.stdout
    finally:
        shutil.rmtree(Path(config_path).parent.parent, ignore_errors=True)


def test_session_or_agent_without_a_prompt_is_a_usage_error(tmp_path: Path) -> None:
    for option in ("--session", "--agent"):
        done = dsh(option, "x", cwd=tmp_path, env={"DSH_HOME": str(tmp_path / "home")})
        assert done.returncode == 2 and done.stdout == ""
        assert f"{option} needs -p" in done.stderr


def test_a_file_name_that_is_not_utf8_is_listed_recorded_and_shown(tmp_path: Path) -> None:
    # os.listdir hands such a name over as lone surrogates: the session store and sessions show
    # used to fail on them (UnicodeEncodeError), ending the run at the first list.
    turns = [calls(call("list", {}, "l")), final("Listed.", {"last_role": "tool"})]
    cfg = config(tmp_path, turns)
    with open(os.path.join(os.fsencode(tmp_path / "ws"), b"caf\xe9.txt"), "wb") as latin1_name:
        latin1_name.write(b"latin-1 name\n")
    done = dsh("--config", str(cfg), "-p", "list the files", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Listed.\n"
    listed = json.loads(dsh("sessions", "list", "--config", str(cfg), "--json", cwd=tmp_path).stdout)
    events = json.loads(dsh("sessions", "show", listed[0]["id"], "--json", "--config", str(cfg), cwd=tmp_path).stdout)
    results = [e for e in events if e["kind"] == "tool/result"]
    assert results and "caf\\udce9.txt" in json.dumps(results)  # kept exactly, as its JSON escape
    shown = dsh("sessions", "show", listed[0]["id"], "--config", str(cfg), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "list [1.1]" in shown.stdout


HOSTILE_ANSWER = "Done.\x1b]52;c;Y3VybCBldmlsLnNoIHwgc2g=\x07\x1b[2J\nsecond\tline\rX"  # OSC 52: a clipboard write


def test_on_a_terminal_the_answers_escape_sequences_are_shown_not_obeyed(
    tmp_path: Path, dsh_on_terminal: Callable[..., tuple[int, bytes]]
) -> None:
    cfg = config(tmp_path, [final(HOSTILE_ANSWER)])
    code, shown = dsh_on_terminal("--config", str(cfg), "-p", "go", cwd=tmp_path, stderr=False)
    assert code == 0
    # Newlines and tabs are kept (the terminal shows \n as \r\n); everything that drives a terminal is escaped.
    assert shown == (b"Done.\\x1b]52;c;Y3VybCBldmlsLnNoIHwgc2g=\\x07\\x1b[2J\r\nsecond\tline\\rX\r\n")
    # Into a pipe the answer goes as the model wrote it: it is data there.
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSH_")}
    piped = subprocess.run(
        [sys.executable, "-m", "dsh_core", "--config", str(cfg), "-p", "go"],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert piped.returncode == 0 and piped.stdout == (HOSTILE_ANSWER + "\n").encode()


def test_a_plugin_that_cannot_be_imported_exits_2_from_every_command_that_boots(tmp_path: Path) -> None:
    # README: such a row "fails the boot (exit 2, ...)"; `dsh sessions` mapped the same error to 1.
    cfg = config(tmp_path, [final("never")])
    (tmp_path / "broken_import.py").write_text('raise ImportError("missing dependency")\n')
    with cfg.open("a") as out:
        out.write('\n[[plugins]]\nid = "guard"\nuse = "broken"\n')
    env = {
        "DSH_PLUGINS": "broken=broken_import:plugin",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    for args in (["-p", "go"], ["tools", "list"], ["sessions", "list"], ["sessions", "show", "some-id"]):
        done = dsh("--config", str(cfg), *args, cwd=tmp_path, env=env)
        assert (done.returncode, done.stdout) == (2, ""), (args, done.stderr)
        assert "plugins[guard].use: plugin 'broken'" in done.stderr and "missing dependency" in done.stderr


def test_a_provider_or_store_no_plugin_registers_is_blamed_on_the_file_that_names_it(tmp_path: Path) -> None:
    # Every other config error names its file; these two named only the key.
    cfg = config(tmp_path, [final("never")])
    text = cfg.read_text()
    (tmp_path / "provider.toml").write_text('[[agents]]\nid = "main"\nprovider = "ghost"\n')
    (tmp_path / "store.toml").write_text('[sessions]\nstore = "nope"\n')
    assert 'provider = "scripted"' in text and "[sessions]" in text
    for overlay, expected in (
        ("provider.toml", "agents[main].provider: no provider named 'ghost'"),
        ("store.toml", "sessions.store: no session store named 'nope'"),
    ):
        done = dsh("--config", str(cfg), "--config", overlay, "-p", "go", cwd=tmp_path)
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        assert done.stderr.startswith(f"dsh: error: {overlay}: {expected}"), done.stderr


RAISING_PLUGIN = """
from dsh_core import hookimpl, plugin as declare

class Raising:
    @hookimpl
    def dsh_prompt_sections(self, context):
        raise RuntimeError("bad \\x1b]0;PWNED\\x07\\x1b[2J title")

@declare(config_schema={"type": "object"})
def plugin(scope, config):
    return Raising()
"""


def test_why_a_run_stopped_is_shown_with_its_escape_sequences_escaped(tmp_path: Path) -> None:
    cfg = config(tmp_path, [final("never")])
    (tmp_path / "raising_plugin.py").write_text(RAISING_PLUGIN)
    with cfg.open("a") as out:
        out.write('\n[[plugins]]\nid = "raising"\nuse = "raising"\n')
    env = {
        "DSH_PLUGINS": "raising=raising_plugin:plugin",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    done = dsh("--config", str(cfg), "-p", "go", cwd=tmp_path, env=env)
    assert done.returncode == 1 and "\x1b" not in done.stderr and "\x07" not in done.stderr
    assert (
        "dsh: run stopped: error: dsh_prompt_sections of plugin 'raising' failed: "
        "RuntimeError: bad \\x1b]0;PWNED\\x07\\x1b[2J title"
    ) in done.stderr


def test_an_error_message_is_shown_with_its_escape_sequences_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    from dsh_core.clirun import fail

    with pytest.raises(SystemExit) as exited:
        fail("quoted \x1b[2Jtext\x9b\nsecond line\tkept", 2)
    assert exited.value.code == 2
    assert capsys.readouterr().err == "dsh: error: quoted \\x1b[2Jtext\\x9b\nsecond line\tkept\n"


STUCK_STORE_PLUGIN = """
import asyncio, pathlib
from dsh_core import hookimpl, plugin as declare

class Stuck:
    def __init__(self, marks):
        self.marks = marks

    async def list(self, *, limit=None):
        (self.marks / "listing").touch()
        await asyncio.Event().wait()  # a store waiting on a lock, a network disk...

    async def close(self):
        (self.marks / "closed").touch()

class Plugin:
    def __init__(self, marks):
        self.marks = marks

    @hookimpl
    def dsh_register_session_stores(self, register):
        register("stuck", lambda home: Stuck(self.marks))

@declare(config_schema={"type": "object"})
def plugin(scope, config):
    return Plugin(pathlib.Path(config["marks"]))
"""


def test_sigterm_ends_a_sessions_command_through_the_harness_shutdown(tmp_path: Path) -> None:
    """'dsh sessions' ran under a bare asyncio.run: SIGTERM killed it with its store and harness open."""
    (tmp_path / "stuck_plugin.py").write_text(STUCK_STORE_PLUGIN)
    cfg = tmp_path / "dsh.toml"
    cfg.write_text(
        f'[sessions]\nstore = "stuck"\n[[plugins]]\nid = "stuck"\nuse = "stuck"\nconfig = {{ marks = "{tmp_path}" }}\n'
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSH_")}
    environ.update(
        {
            "DSH_PLUGINS": "stuck=stuck_plugin:plugin",
            "DSH_HOME": str(tmp_path / "home"),
            "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        }
    )
    child = subprocess.Popen(
        [sys.executable, "-m", "dsh_core", "sessions", "list", "--config", str(cfg)],
        cwd=tmp_path,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "listing").exists():
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()[1]
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 130, err
    assert out == "" and err.splitlines()[-1] == "dsh: error: interrupted", err
    assert (tmp_path / "closed").exists()  # the store was closed on the way out


def test_sigterm_during_the_demo_exits_130_and_removes_its_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo ran under a bare asyncio.run: SIGTERM killed it and left its temporary directory."""
    from dsh_core.agent import demo

    made: list[Path] = []

    async def terminated(base: Path, **_: Any) -> str:
        made.append(base)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.Event().wait()
        return "never"

    class Terminated(Exception):
        pass

    def on_term(signum: int, frame: Any) -> None:
        raise Terminated  # without run_async's handler, instead of ending the test process

    monkeypatch.setattr(demo, "run_demo", terminated)
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        with pytest.raises(SystemExit) as exited:
            demo.demo_main(keep=False)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exited.value.code == 130
    assert made and not made[0].exists()


@pytest.mark.parametrize(
    ("reason", "text", "warning"),
    [
        ("length", "The three files are: a.txt, b", "the model stopped at its output limit (finish_reason 'length')"),
        ("content_filter", None, "the provider's content filter stopped the model (finish_reason 'content_filter')"),
        ("stop", "All done.", None),
    ],
)
def test_an_answer_the_model_did_not_finish_is_printed_with_a_warning(
    tmp_path: Path, reason: str, text: str | None, warning: str | None
) -> None:
    # A reply cut off at max_tokens, or emptied by a content filter, passed for a whole answer without a word.
    answer: dict[str, Any] = {"role": "assistant", "content": text, "_meta": {"finish_reason": reason}}
    done = dsh("--config", str(config(tmp_path, [answer])), "-p", "go", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == (text or "") + "\n"
    if warning is None:
        assert done.stderr == ""
    else:
        assert done.stderr == f"dsh: warning: the answer may be incomplete: {warning}\n"


def test_a_refusal_is_printed_as_the_answer_with_a_warning(tmp_path: Path) -> None:
    # A refusal (OpenAI's message.refusal, which the provider makes the content) passed for an answer.
    refusal = "I'm sorry, I can't help with that."
    answer = {"role": "assistant", "content": refusal, "_meta": {"finish_reason": "stop", "refusal": True}}
    done = dsh("--config", str(config(tmp_path, [answer])), "-p", "go", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == refusal + "\n"
    assert done.stderr == "dsh: warning: the model refused; the answer is its refusal\n"
