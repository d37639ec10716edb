"""The dsh command: exact JSON shapes, errors on stderr only, exit codes."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest
from click.testing import CliRunner

from dsh_core.cli import LazyGroup, main
from dsh_core.clirun import DRAIN_SECONDS

BASE = """
[tools]
mode = "native"

[[agents]]
id = "main"

[[agents]]
id = "coder"
mode = "code"

[[plugins]]
id = "alpha"
use = "sample-echo"
config = { tool = "alpha" }

[[plugins]]
id = "policy"
use = "sample-deny"
config = { names = ["nothing"] }
"""

OVERLAY = """
[tools]
mode = "both"

[[plugins]]
id = "policy"
config = { names = ["alpha"] }
"""


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(
        "DSH_PLUGINS", "sample-echo=tests.core.sample_plugins:echo,sample-deny=tests.core.sample_plugins:deny"
    )
    monkeypatch.delenv("DSH_TOOLS_MODE", raising=False)
    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "overlay.toml").write_text(OVERLAY)
    monkeypatch.chdir(tmp_path)

    def invoke(*args: str):  # type: ignore[no-untyped-def]
        return CliRunner().invoke(main, list(args), catch_exceptions=False)

    return invoke


def test_config_dump_names_the_source_of_every_value(run) -> None:  # type: ignore[no-untyped-def]
    result = run("config", "dump", "--config", "base.toml", "--config", "overlay.toml")
    assert result.exit_code == 0, result.stderr
    # One final newline, like every other command's output.
    assert result.stdout.endswith("# overlay.toml\n") and not result.stdout.endswith("\n\n")
    lines = result.stdout.splitlines()
    assert any(line.startswith('tools.mode = "both"') and "# overlay.toml" in line for line in lines)
    assert any(line.startswith("plugins[alpha].config.tool") and "# base.toml" in line for line in lines)
    assert any(line.startswith("plugins[policy].config.names") and "# overlay.toml" in line for line in lines)
    as_json = json.loads(run("config", "dump", "--json", "--config", "base.toml").stdout)
    assert {"path": "tools.mode", "value": "native", "source": "base.toml"} in as_json


def test_config_dump_refuses_a_deployment_that_would_not_start(  # type: ignore[no-untyped-def]
    run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The dump is the effective deployment: it used to print a plugin config that every start
    # refuses as if it were in force.
    (tmp_path / "bad.toml").write_text(
        '[[plugins]]\nid = "alpha"\nuse = "sample-echo"\nconfig = { tool = 3, colour = "red" }\n'
    )
    for args in (["config", "dump"], ["config", "dump", "--json"]):
        result = run(*args, "--config", "base.toml", "--config", "bad.toml")
        assert result.exit_code == 2 and result.stdout == ""
        assert "plugins[alpha].config.colour: unknown key (allowed: tool) (from bad.toml)" in result.stderr
        assert "plugins[alpha].config.tool: 3 is not of type 'string' (from bad.toml)" in result.stderr
    (tmp_path / "unknown_use.toml").write_text('[[plugins]]\nid = "x"\nuse = "ghost-plugin"\n')
    unknown = run("config", "dump", "--config", "unknown_use.toml")
    assert unknown.exit_code == 2
    assert "unknown_use.toml: plugins[x].use: unknown plugin 'ghost-plugin'" in unknown.stderr
    monkeypatch.setenv("DSH_PLUGINS", "broken=tests.core.broken_plugin:plugin")
    (tmp_path / "broken.toml").write_text('[[plugins]]\nid = "my-guard"\nuse = "broken"\n')
    broken = run("config", "dump", "--config", "broken.toml")
    assert broken.exit_code == 2 and "broken.toml: plugins[my-guard].use: plugin 'broken'" in broken.stderr


@pytest.mark.parametrize("config", ['config = { tool = "noisy" }', "config = { tool = 3 }"])
def test_what_a_plugin_prints_on_import_never_reaches_stdout(  # type: ignore[no-untyped-def]
    run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str
) -> None:
    # config dump imports the rows' plugins now: a module that prints when imported must not turn
    # `dump --json` into something that is not JSON, nor put text on stdout when the dump is refused.
    # A fresh module per case: a module is imported (and prints) once per process.
    module = "noisy_plugin_refused" if "3" in config else "noisy_plugin_valid"
    (tmp_path / f"{module}.py").write_text(
        'print("hello from the noisy plugin")\nfrom tests.core.sample_plugins import echo\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DSH_PLUGINS", f"noisy={module}:echo")
    (tmp_path / "noisy.toml").write_text(f'[[plugins]]\nid = "noisy"\nuse = "noisy"\n{config}\n')
    result = run("config", "dump", "--json", "--config", "noisy.toml")
    assert "hello from the noisy plugin" in result.stderr
    if "3" in config:
        assert result.exit_code == 2 and result.stdout == ""
    else:
        assert result.exit_code == 0, result.stderr
        assert {"path": "plugins[noisy].config.tool", "value": "noisy", "source": "noisy.toml"} in json.loads(
            result.stdout
        )


def test_what_a_plugin_prints_while_a_command_runs_never_reaches_stdout(  # type: ignore[no-untyped-def]
    run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Import-time prints were sent to stderr, but a factory's or a registration hook's print()
    # went to stdout, ahead of the JSON the command printed there.
    monkeypatch.setenv("DSH_PLUGINS", "chatty=tests.core.sample_plugins:chatty")
    (tmp_path / "chatty.toml").write_text('[[plugins]]\nid = "chatty"\nuse = "chatty"\n')
    result = run("tools", "list", "--json", "--config", "chatty.toml")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["visible"] == ["chatty"]
    assert "chatty factory runs\nchatty registers its tool\n" in result.stderr
    # Nor while a tool runs or the harness closes: the output is printed after both.
    called = run("tools", "call", "chatty", "--json", "--config", "chatty.toml")
    assert called.exit_code == 0, called.stderr
    assert json.loads(called.stdout)["value"] == {"said": "hi"}
    assert "chatty tool runs\nchatty disposed\n" in called.stderr


def test_an_interrupt_outside_the_event_loop_exits_130(  # type: ignore[no-untyped-def]
    run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C while `config dump` imports a slow plugin (no event loop runs there) reached click,
    # which printed "Aborted!" and exited 1, the status of a failed operation.
    (tmp_path / "interrupted_plugin.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DSH_PLUGINS", "interrupted=interrupted_plugin:plugin")
    (tmp_path / "interrupted.toml").write_text('[[plugins]]\nid = "slow"\nuse = "interrupted"\n')
    result = run("config", "dump", "--config", "interrupted.toml")
    assert (result.exit_code, result.stdout, result.stderr) == (130, "", "dsh: error: interrupted\n")


def _interrupted(*args: object, **kwargs: object) -> NoReturn:
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("where", "args"),
    [("parse", ("tools", "list")), ("help", ("--help",)), ("help", ("-h",))],
)
def test_an_interrupt_while_the_root_parses_its_arguments_exits_130(  # type: ignore[no-untyped-def]
    run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, args: tuple[str, ...]
) -> None:
    """Ctrl-C while click parsed the root's arguments, or printed its help (which imports the modules of
    the commands it lists), ended with "Aborted!" and status 1, where one in a command ends with 130."""
    if where == "parse":
        monkeypatch.setattr(LazyGroup, "parse_args", _interrupted)
    else:
        (tmp_path / "interrupted_command.py").write_text("raise KeyboardInterrupt\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setitem(main.lazy_commands, "slow", "interrupted_command:command")
    result = run(*args)
    assert (result.exit_code, result.stdout, result.stderr) == (130, "", "dsh: error: interrupted\n")


@pytest.mark.parametrize(
    "args",
    [("--nope",), ("tools", "list", "--nope"), ("--agent", "coder", "tools", "list"), ("sessions", "show")],
)
def test_an_interrupt_while_a_usage_error_is_shown_exits_130(  # type: ignore[no-untyped-def]
    run, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]
) -> None:
    """Ctrl-C while click printed a usage error (the root's, a command's, or one dsh raises) ended with
    status 2, click's for the error it was showing, where a Ctrl-C anywhere else ends with 130."""
    import click

    monkeypatch.setattr(click.UsageError, "show", _interrupted)
    result = run(*args)
    assert (result.exit_code, result.stdout, result.stderr) == (130, "", "dsh: error: interrupted\n")


def test_sigint_while_the_help_imports_a_command_exits_130(tmp_path: Path) -> None:
    """A real Ctrl-C where `dsh --help` imports a slow command module (here one that blocks on a read)."""
    (tmp_path / "blocking_command.py").write_text(
        'import os, sys\nprint("ready", flush=True)\nos.read(sys.stdin.fileno(), 1)\n'
    )
    script = textwrap.dedent("""
        import signal
        from dsh_core.cli import main

        signal.signal(signal.SIGINT, signal.default_int_handler)  # as on a terminal: a background job ignores it
        main.lazy_commands["slow"] = "blocking_command:command"
        main(["--help"], prog_name="dsh")
    """)
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=20)
    finally:
        process.kill()  # left blocked on its read if the signal did not end it
        process.wait()
    assert (process.returncode, out, err) == (130, "", "dsh: error: interrupted\n")


def test_tools_list_json_has_the_documented_shape(run) -> None:  # type: ignore[no-untyped-def]
    listing = json.loads(run("tools", "list", "--json", "--config", "base.toml").stdout)
    assert listing == {
        "mode": "native",
        "visible": ["alpha"],
        "wire": [
            {
                "name": "alpha",
                "description": "Echo through alpha.",
                "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
            }
        ],
    }


def test_tools_call_json_and_exit_codes(run) -> None:  # type: ignore[no-untyped-def]
    ok = run("tools", "call", "alpha", "--args", '{"text": "hi"}', "--json", "--config", "base.toml")
    assert ok.exit_code == 0
    assert json.loads(ok.stdout) == {
        "ok": True,
        "error": None,
        "content": [{"text": '{"said": "hi", "by": "alpha"}', "type": "text"}],
        "value": {"said": "hi", "by": "alpha"},
    }
    denied = run("tools", "call", "alpha", "--json", "--config", "base.toml", "--config", "overlay.toml")
    assert denied.exit_code == 1
    body = json.loads(denied.stdout)
    assert body["ok"] is False and body["error"]["code"] == "DENIED" and body["value"] is None
    collapsed = run("tools", "call", "alpha", "--agent", "coder", "--json", "--config", "base.toml")
    assert json.loads(collapsed.stdout)["error"]["code"] == "UNKNOWN_TOOL"


def test_errors_go_to_stderr_and_nothing_to_stdout(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bad_json = run("tools", "call", "alpha", "--args", "{nope", "--config", "base.toml")
    assert bad_json.exit_code == 2 and bad_json.stdout == "" and "--args is not valid JSON" in bad_json.stderr
    (tmp_path / "bad.toml").write_text('[tools]\nmode = "turbo"\nsurprise = 1\n')
    bad_config = run("tools", "list", "--config", "bad.toml")
    assert bad_config.exit_code == 2 and bad_config.stdout == ""
    assert "bad.toml: tools.mode" in bad_config.stderr and "surprise" in bad_config.stderr
    unknown_agent = run("tools", "list", "--agent", "ghost", "--config", "base.toml")
    assert unknown_agent.exit_code == 2 and "unknown agent 'ghost'" in unknown_agent.stderr
    (tmp_path / "unknown_use.toml").write_text('[[plugins]]\nid = "x"\nuse = "ghost-plugin"\n')
    unknown_use = run("tools", "list", "--config", "unknown_use.toml")
    assert unknown_use.exit_code == 2 and "plugins[x].use: unknown plugin 'ghost-plugin'" in unknown_use.stderr


@pytest.mark.parametrize(
    "raw",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"n": ' + "9" * 5000 + "}",
        '{"text": NaN}',
        '{"n": Infinity}',
        '{"n": -Infinity}',
    ],
)
def test_args_that_json_cannot_read_are_a_usage_error_not_a_traceback(run, raw: str) -> None:  # type: ignore[no-untyped-def]
    # Nesting past the recursion limit and integers past the digit limit escaped as a raw RecursionError
    # or ValueError with a traceback and exit 1, not the "--args is not valid JSON" of any other bad text.
    # NaN and Infinity (no JSON either; the agent loop refuses them in a model's call) reached the pipeline
    # and failed as INVALID_ARGS with exit 1.
    result = CliRunner().invoke(main, ["tools", "call", "alpha", "--config", "base.toml", "--args", raw])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("dsh: error: --args is not valid JSON: ") and "Traceback" not in result.stderr


def test_a_program_file_that_is_not_utf8_is_a_usage_error_not_a_traceback(  # type: ignore[no-untyped-def]
    run, tmp_path: Path
) -> None:
    # The UnicodeDecodeError of reading FILE escaped with a traceback and exit 1, before any run.
    (tmp_path / "latin.py").write_bytes(b"# caf\xe9\nreturn 1\n")
    result = CliRunner().invoke(main, ["run-code", "latin.py", "--config", "base.toml"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == "dsh: error: latin.py: the program is not UTF-8 text (invalid continuation byte)\n"


@pytest.mark.parametrize("command", [("config", "dump"), ("sessions", "list")])
def test_the_default_deployment_in_a_deleted_directory_is_an_error_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: tuple[str, ...]
) -> None:
    # Its workspace is the working directory; os.getcwd() raising escaped as a FileNotFoundError traceback.
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    result = CliRunner().invoke(main, list(command))
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("dsh: error: cannot use the current directory as the default workspace: ")


@pytest.mark.parametrize(
    "command",
    [
        ("config", "dump"),
        ("tools", "list"),
        ("tools", "call", "alpha"),
        ("sessions", "list"),
        ("sdk",),
        ("run-code", "-"),
        ("demo",),
    ],
)
@pytest.mark.parametrize("option", ["--session", "--agent", "-p"])
def test_run_options_before_a_command_are_refused_not_ignored(  # type: ignore[no-untyped-def]
    run, option: str, command: tuple[str, ...]
) -> None:
    # `dsh --agent coder tools call ...` used to call as the first agent, `dsh --session X sessions list`
    # to list them all: these options belong to a -p run, and no command reads them.
    result = run("--config", "base.toml", option, "x", *command)
    assert result.exit_code == 2 and result.stdout == ""
    if option == "-p":
        assert f"-p TASK is a run of its own and takes no command, but 'dsh {command[0]}' was given" in result.stderr
    else:
        assert f"{option} applies only to a -p run; 'dsh {command[0]}' does not read it" in result.stderr


def test_a_config_before_demo_is_refused_not_ignored(run) -> None:  # type: ignore[no-untyped-def]
    # `dsh --config base.toml demo` ran the shipped demo deployment without a word about base.toml.
    result = run("--config", "base.toml", "demo")
    assert result.exit_code == 2 and result.stdout == ""
    assert "--config does not apply to 'dsh demo'" in result.stderr


def test_a_configured_plugin_that_cannot_load_fails_the_boot_with_exit_2(  # type: ignore[no-untyped-def]
    run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "DSH_PLUGINS", "sample-echo=tests.core.sample_plugins:echo,broken=tests.core.broken_plugin:plugin"
    )
    (tmp_path / "guarded.toml").write_text(
        '[[plugins]]\nid = "alpha"\nuse = "sample-echo"\n\n'
        '[[plugins]]\nid = "my-guard"\nuse = "broken"\n'
        'config = { deny_paths = ["**/.env"] }\n'
    )
    result = run("tools", "call", "alpha", "--config", "guarded.toml")
    assert result.exit_code == 2 and result.stdout == ""
    assert "guarded.toml: plugins[my-guard].use: plugin 'broken'" in result.stderr
    assert "ImportError: this plugin is broken on purpose" in result.stderr
    assert "takes no config" not in result.stderr


def _installed_distribution(site: Path, name: str, entry_points: str) -> None:
    """A distribution of ``name`` 1.0 installed in ``site``, with ``entry_points`` as its entry_points.txt."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_a_distribution_whose_entry_points_cannot_be_read_breaks_only_the_plugins_it_ships(  # type: ignore[no-untyped-def]
    run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One malformed entry_points.txt, of any package and any group, made importlib.metadata's
    # entry_points() raise a bare TypeError: every dsh command died with a traceback naming nothing.
    site = tmp_path / "site"
    _installed_distribution(site, "unrelated-tool", "[console_scripts]\nno-equals-sign-here\n")
    monkeypatch.syspath_prepend(str(site))
    listing = run("tools", "list", "--json", "--config", "base.toml")
    assert listing.exit_code == 0, listing.stderr
    assert json.loads(listing.stdout)["visible"] == ["alpha"]
    # A row using a plugin the broken distribution ships fails the boot, naming the distribution.
    _installed_distribution(site, "dsh-broken-meta", "[dsh.plugins]\nweather\n")
    (tmp_path / "weather.toml").write_text('[[plugins]]\nid = "weather"\nuse = "weather"\n')
    for args in (["config", "dump"], ["tools", "list"]):
        refused = run(*args, "--config", "weather.toml")
        assert refused.exit_code == 2 and refused.stdout == ""
        assert "weather.toml: plugins[weather].use: unknown plugin 'weather'" in refused.stderr
        assert "dsh-broken-meta 1.0" in refused.stderr and "unrelated-tool 1.0" in refused.stderr


def test_the_mode_env_variable_is_checked_at_boot(run, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("DSH_TOOLS_MODE", "turbo")
    result = run("tools", "list", "--config", "base.toml")
    assert result.exit_code == 2 and "DSH_TOOLS_MODE='turbo'" in result.stderr and result.stdout == ""


SIGNAL_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from dsh_core.cli import run_async

    stop = None

    async def main():
        global stop
        stop = asyncio.Event()
        print("ready", flush=True)
        await asyncio.wait_for(stop.wait(), 30)
        print("main returned", flush=True)

    async def dispose():
        print("disposed", flush=True)
        if sys.argv[1] == "slow":
            try:
                await asyncio.sleep(600)
            except asyncio.CancelledError:
                print("disposal cut", flush=True)
                raise
        stop.set()

    run_async(main, on_signal=dispose)
""")


def _started(script: str, *args: str, first_line: str = "ready\n") -> subprocess.Popen[str]:
    """``script`` running in a fresh interpreter, once it has printed ``first_line``."""
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline() == first_line
    return process


def _main_waiting(then: str) -> str:
    """:data:`SIGNAL_SCRIPT` with main's wait in a ``try:`` followed by ``then`` (at the ``try``'s indent)."""
    waits = "    await asyncio.wait_for(stop.wait(), 30)\n"
    assert waits in SIGNAL_SCRIPT
    return SIGNAL_SCRIPT.replace(waits, "    try:\n    " + waits + textwrap.indent(then, "    "))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_disposes_the_root_and_exits(signum: int) -> None:
    process = _started(SIGNAL_SCRIPT, "fast")
    process.send_signal(signum)
    out, err = process.communicate(timeout=20)
    assert out.splitlines() == ["disposed", "main returned"] and process.returncode == 0
    assert "shutting down" in err


def test_a_main_that_does_not_finish_in_the_drain_is_cancelled() -> None:
    script = SIGNAL_SCRIPT.replace("stop.set()", "pass").replace('sys.argv[1] == "slow"', "False")
    process = _started(script, "fast")
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=20)
    assert "disposed" in out and "main returned" not in out
    assert process.returncode == 130 and "interrupted" in err


def test_a_second_signal_cancels_main_at_once_and_the_drain_keeps_its_bound() -> None:
    script = _main_waiting("except asyncio.CancelledError:\n    print('main cancelled', flush=True)\n    raise\n")
    process = _started(script, "slow")
    first = time.monotonic()
    process.send_signal(signal.SIGINT)
    assert process.stdout.readline() == "disposed\n"
    process.send_signal(signal.SIGINT)
    # Cancelled by the second signal, before the drain's bound cuts the disposal; not by that cut (which
    # would print "disposal cut" first): the order of the lines shows it, not a time.
    assert process.stdout.readline() == "main cancelled\n"
    # The slow on_signal (a disposal) is not abandoned: it gets the rest of its drain bound, and no more
    # (it would take 600 s).
    out, err = process.communicate(timeout=DRAIN_SECONDS + 60)
    assert process.returncode == 128 + signal.SIGINT
    assert time.monotonic() - first < DRAIN_SECONDS + 60
    assert out == "disposal cut\n" and "cancelling" in err and "interrupted" in err


def test_two_signals_in_one_loop_turn_still_run_on_signal_before_main_is_cancelled() -> None:
    script = textwrap.dedent("""
        import asyncio, time
        from dsh_core.cli import run_async

        async def main():
            print("ready", flush=True)
            time.sleep(1.0)  # a synchronous step: both signals wait for the same loop turn
            try:
                await asyncio.sleep(30)
            finally:
                print("main finally", flush=True)

        run_async(main, on_signal=lambda: print("on_signal", flush=True))
    """)
    process = _started(script)
    process.send_signal(signal.SIGINT)
    time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    out, _ = process.communicate(timeout=20)
    assert process.returncode == 128 + signal.SIGINT
    assert out.splitlines() == ["on_signal", "main finally"]


def test_an_async_on_signal_is_not_cut_short_by_the_signal_that_cancels_main() -> None:
    script = textwrap.dedent("""
        import asyncio, atexit
        from dsh_core.cli import run_async
        from dsh_core.scope import Scope

        root = Scope("root")
        ran = []

        async def main():
            async def slow_disposer():
                await asyncio.sleep(1)
                ran.append("slow")

            root.on_dispose(lambda: ran.append("last"))
            root.on_dispose(slow_disposer)
            print("ready", flush=True)
            await asyncio.sleep(30)

        atexit.register(lambda: print(ran, root._state, flush=True))
        run_async(main, on_signal=root.dispose)
    """)
    process = _started(script)
    process.send_signal(signal.SIGINT)
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    out, _ = process.communicate(timeout=20)
    assert process.returncode == 128 + signal.SIGINT
    assert out.splitlines() == ["['slow', 'last'] disposed"]


def test_a_signal_while_waiting_for_worker_threads_after_main_exits_at_once() -> None:
    script = textwrap.dedent("""
        import asyncio, time
        from dsh_core.cli import run_async

        async def main():
            try:  # a tool's blocking call outlives main
                await asyncio.wait_for(asyncio.to_thread(time.sleep, 600), 0.2)
            except TimeoutError:
                pass
            print("main returned", flush=True)

        run_async(main, on_signal=lambda: None)
    """)
    process = _started(script, first_line="main returned\n")
    time.sleep(0.3)
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    # Not after the worker thread's 600 s sleep.
    assert process.returncode == 128 + signal.SIGINT and time.monotonic() - started < 60
    assert err.strip() == "dsh: error: interrupted"


def test_a_signal_after_main_ended_waits_for_the_drain_and_says_so() -> None:
    script = textwrap.dedent("""
        import asyncio
        from dsh_core.cli import run_async

        stop = None

        async def main():
            global stop
            stop = asyncio.Event()
            print("ready", flush=True)
            await stop.wait()
            print("main returned", flush=True)

        async def dispose():
            stop.set()  # main ends at once; the rest of the clean-up takes a while
            await asyncio.sleep(1.5)
            print("disposed", flush=True)

        run_async(main, on_signal=dispose)
    """)
    process = _started(script)
    process.send_signal(signal.SIGINT)
    assert process.stdout.readline() == "main returned\n"
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=20)
    assert process.returncode == 0 and out == "disposed\n"
    assert "waiting for the shutdown to finish" in err and "cancelling" not in err


def test_a_third_signal_exits_at_once_when_main_will_not_end() -> None:
    # main's clean-up outlives its cancellation: only the third signal ends the process.
    script = _main_waiting("finally:\n    print('cleaning up', flush=True)\n    await asyncio.sleep(600)\n")
    process = _started(script, "slow")
    process.send_signal(signal.SIGINT)
    assert process.stdout.readline() == "disposed\n"
    process.send_signal(signal.SIGINT)
    assert process.stdout.readline() == "cleaning up\n"
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT and time.monotonic() - started < 60  # not the 600 s clean-up


def test_json_output_stays_valid_json_on_a_stdout_that_cannot_encode_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CLI writes what stdout cannot encode as a backslash escape; in --json output that must
    # be a JSON escape (\\xe9 and \\U0001f600 are not JSON), so the document still parses the same.
    monkeypatch.setenv("DSH_PLUGINS", "sample-echo=tests.core.sample_plugins:echo")
    (tmp_path / "base.toml").write_text(BASE.split('[[plugins]]\nid = "policy"', maxsplit=1)[0])
    monkeypatch.chdir(tmp_path)
    text = "caf\u00e9 \u2014 \U0001f600 \udce9"
    for charset in ("latin-1", "cp1252", "ascii", "utf-8"):
        result = CliRunner(charset=charset).invoke(
            main,
            ["tools", "call", "alpha", "--args", json.dumps({"text": text}), "--json", "--config", "base.toml"],
            catch_exceptions=False,
        )
        assert result.exit_code == 0, (charset, result.output)
        assert json.loads(result.stdout_bytes.decode(charset))["value"]["said"] == text, charset


def _dsh_piped(*args: str, cwd: Path) -> tuple[int, bytes, bytes]:
    """``python -m dsh_core ARGS`` into pipes: exit code, stdout, stderr."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSH_")}
    done = subprocess.run(
        [sys.executable, "-m", "dsh_core", *args], cwd=cwd, env=environ, capture_output=True, timeout=60, check=False
    )
    return done.returncode, done.stdout, done.stderr


def test_an_unbuffered_stdout_writes_whole_and_stays_unbuffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `python -u` (PYTHONUNBUFFERED) stdout's binary layer is the file itself, whose write may
    take only part of what it is given (a full non-blocking pipe, a signal mid-write); the text layer
    dropped the rest, so a large result reached the reader cut short, with status 0 and no word."""
    (tmp_path / "big.py").write_text('return "x" * 2_000_000\n')
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSH_")}
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # a pipe holds 64 KiB: a larger write into it takes only part
    try:
        child = subprocess.Popen(
            [sys.executable, "-u", "-m", "dsh_core", "run-code", "big.py"],
            cwd=tmp_path,
            env=environ,
            stdout=write_end,
            stderr=subprocess.PIPE,
        )
    finally:
        os.close(write_end)
    with open(read_end, "rb") as reader:
        out = reader.read()
    assert child.stderr is not None
    err = child.stderr.read()
    child.stderr.close()
    assert child.wait(timeout=60) == 0, err
    assert (len(out), out) == (2_000_001, b"x" * 2_000_000 + b"\n")

    # Each write still reaches the file at once: here nothing flushes, and a read that finds nothing fails.
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    unbuffered = io.TextIOWrapper(io.FileIO(write_end, "w"), encoding="utf-8", newline="\n", write_through=True)
    monkeypatch.setattr(sys, "stdout", unbuffered)
    monkeypatch.setattr(sys, "stderr", sys.stderr)  # restored after: dsh replaces an unbuffered one too
    try:
        assert main.main(["--help"], standalone_mode=False) == 0
        assert "Usage:" in os.read(read_end, 1 << 16).decode()
        print("first", end="")  # not a whole line: line buffering would keep it too
        assert os.read(read_end, 1 << 16) == b"first"
        assert unbuffered.buffer.fileno() == write_end  # the interpreter's own stream is left as it was
    finally:
        monkeypatch.undo()
        unbuffered.close()
        os.close(read_end)


def test_an_unbuffered_stderr_writes_whole_and_stays_unbuffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `python -u` stderr's binary layer is the file itself too: what a plugin printed while a
    command ran (sent to stderr, as stdout is the command's own) reached a full pipe cut short."""
    (tmp_path / "loud_plugin.py").write_text(
        "from dsh_core import plugin\n\n"
        "class Loud:\n    pass\n\n"
        "@plugin()\ndef loud(scope, config):\n    print('x' * 2_000_000)\n    return Loud()\n"
    )
    (tmp_path / "loud.toml").write_text('[[plugins]]\nid = "loud"\nuse = "loud"\n')
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSH_")}
    environ["DSH_PLUGINS"] = "loud=loud_plugin:loud"  # found in the working directory (python -m)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # a pipe holds 64 KiB: a larger write into it takes only part
    try:
        child = subprocess.Popen(
            [sys.executable, "-u", "-m", "dsh_core", "tools", "list", "--json", "--config", "loud.toml"],
            cwd=tmp_path,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=write_end,
        )
    finally:
        os.close(write_end)
    with open(read_end, "rb") as reader:
        err = reader.read()
    assert child.stdout is not None
    out = child.stdout.read()
    child.stdout.close()
    assert child.wait(timeout=60) == 0, err[-2000:]
    assert json.loads(out)["visible"] == []
    assert (len(err), err) == (2_000_001, b"x" * 2_000_000 + b"\n")

    # Each write still reaches the file at once, with the stream's handler for what it cannot encode.
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    unbuffered = io.TextIOWrapper(
        io.FileIO(write_end, "w"), encoding="utf-8", errors="backslashreplace", newline="\n", write_through=True
    )
    monkeypatch.setattr(sys, "stderr", unbuffered)
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # restored after: dsh replaces an unbuffered one too
    try:
        assert main.main(["--help"], standalone_mode=False) == 0
        assert sys.stderr is not unbuffered
        print("first \udcff", end="", file=sys.stderr)  # not a whole line: line buffering would keep it too
        assert os.read(read_end, 1 << 16) == b"first \\udcff"
        assert unbuffered.buffer.fileno() == write_end  # the interpreter's own stream is left as it was
    finally:
        monkeypatch.undo()
        unbuffered.close()
        os.close(read_end)


def test_tools_call_on_a_terminal_shows_the_outputs_escape_sequences_not_obeys_them(
    tmp_path: Path, dsh_on_terminal: Callable[..., tuple[int, bytes]]
) -> None:
    """A tool's text (here a command's output: a carriage return, a title-setting OSC, a screen clear)
    is escaped on a terminal, on stdout and, for a failed call, on stderr; into a pipe it is data."""
    (tmp_path / "bash.toml").write_text(
        textwrap.dedent(f"""
        [tools]
        mode = "native"

        [[plugins]]
        id = "bash"
        use = "bash"
        config = {{ root = {json.dumps(str(tmp_path))} }}
        """)
    )
    ok = [
        "--config",
        "bash.toml",
        "tools",
        "call",
        "bash",
        "--args",
        json.dumps({"command": r"printf 'one\rX\033]0;TITLE\007\ttab\n'"}),
    ]
    assert dsh_on_terminal(*ok, cwd=tmp_path) == (0, b"one\\rX\\x1b]0;TITLE\\x07\ttab\r\n[exit code 0]\r\n")
    assert _dsh_piped(*ok, cwd=tmp_path) == (0, b"one\rX\x1b]0;TITLE\x07\ttab\n[exit code 0]\n", b"")
    failed = [
        "--config",
        "bash.toml",
        "tools",
        "call",
        "bash",
        "--args",
        json.dumps({"command": r"printf 'late\033[2J'; sleep 30", "timeout": 0.5}),
    ]
    code, shown = dsh_on_terminal(*failed, cwd=tmp_path)
    assert code == 1 and shown.endswith(b"Output so far:\r\nlate\\x1b[2J\r\n") and b"\x1b" not in shown
    code, out, err = _dsh_piped(*failed, cwd=tmp_path)
    assert code == 1 and out == b"" and err.endswith(b"Output so far:\nlate\x1b[2J\n")


def test_run_code_on_a_terminal_shows_the_programs_escape_sequences_not_obeys_them(
    tmp_path: Path, dsh_on_terminal: Callable[..., tuple[int, bytes]]
) -> None:
    (tmp_path / "prog.py").write_text('print("a\\x1b]0;TITLE\\x07b\\rX")\nreturn 1\n')
    code, shown = dsh_on_terminal("run-code", "prog.py", cwd=tmp_path)  # stderr's mode note shares the pty
    assert code == 0 and shown.endswith(b"\r\na\\x1b]0;TITLE\\x07b\\rX\r\n1\r\n") and b"\x1b" not in shown
    code, out, _ = _dsh_piped("run-code", "prog.py", cwd=tmp_path)
    assert (code, out) == (0, b"a\x1b]0;TITLE\x07b\rX\n1\n")


def test_main_help_names_the_prompt_and_session_arguments_as_it_describes_them() -> None:
    # The help read "-p, --prompt TEXT  Run one headless agent turn on TASK": TASK was never named.
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "-p, --prompt TASK" in result.output and "--session ID" in result.output


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (("run-code",), ["exit status is 0 only if the program completed", "native mode"]),
        (("tools", "call"), ["exit status is 1 if the call failed"]),
    ],
)
def test_the_help_of_a_call_says_what_its_exit_status_means(command: tuple[str, ...], says: list[str]) -> None:
    # Scripts branch on these: run-code exits 1 for a program that raised, tools call for a denied
    # call, and only the README said so. run-code also lends a native agent "both", said only when run.
    result = CliRunner().invoke(main, [*command, "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert all(phrase in text for phrase in says), text


@pytest.mark.parametrize("redirect", [True, False])
def test_run_async_sends_what_main_prints_to_stderr_only_when_asked(
    redirect: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    from dsh_core.clirun import run_async

    async def main() -> int:
        print("printed by a plugin")
        await asyncio.sleep(0)
        return 7

    assert run_async(main, stdout_to_stderr=redirect) == 7
    out, err = capsys.readouterr()
    assert (out, err) == (("", "printed by a plugin\n") if redirect else ("printed by a plugin\n", ""))
    print("after")  # stdout is the command's own again once main returned
    assert capsys.readouterr().out == "after\n"


def _read_one_line_then_close(*args: str, cwd: Path, env: dict[str, str]) -> tuple[int, bytes, bytes]:
    """``python -m dsh_core ARGS | head -1``: exit code, the line read, and stderr."""
    child = subprocess.Popen(
        [sys.executable, "-m", "dsh_core", *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stderr is not None
        line = child.stdout.readline()
        child.stdout.close()  # the reader goes away with most of the output unread
        err = child.stderr.read()
        return child.wait(timeout=60), line, err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_output_into_a_pipe_its_reader_closed_ends_as_sigpipe_would_with_nothing_on_stderr(tmp_path: Path) -> None:
    """`dsh sessions show ID --json | head -1` exited 1, a failed operation's status (click's handling).

    A process killed by SIGPIPE (cat, grep, git log) ends with 141 in the shell and says nothing:
    `set -o pipefail` scripts already expect that of a producer whose reader stopped early.
    """
    from dsh_core.sessions.events import NewEvent
    from dsh_core.sessions.sqlite import SqliteSessionStore

    home = tmp_path / "home"

    async def create() -> None:
        # About 1.2 MB of JSON, written in pieces: far more than a pipe holds.
        store = SqliteSessionStore.open(home)
        try:
            await store.create(session_id="long")
            await store.append(
                "long",
                [NewEvent("tool/result", {"content": "x" * 20_000, "n": n}, root_call_id=f"c{n}") for n in range(60)],
            )
        finally:
            await store.close()

    asyncio.run(create())
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSH_")}
    code, line, err = _read_one_line_then_close(
        "sessions", "show", "long", "--json", cwd=tmp_path, env={**environ, "DSH_HOME": str(home)}
    )
    assert line == b"[\n"
    assert (code, err) == (128 + signal.SIGPIPE, b"")


def _into_a_closed_pipe(*args: str, cwd: Path, unbuffered: bool, stderr_too: bool = False) -> tuple[int, bytes]:
    """``python -m dsh_core ARGS | head -0`` (``2>&1`` too with ``stderr_too``): exit code and stderr."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DSH_") and k != "PYTHONUNBUFFERED"}
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before dsh writes a byte
    try:
        done = subprocess.run(
            [sys.executable, *(["-u"] if unbuffered else []), "-m", "dsh_core", *args],
            cwd=cwd,
            env=environ,
            stdout=write_end,
            stderr=write_end if stderr_too else subprocess.PIPE,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    return done.returncode, done.stderr or b""


@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("args", [("--help",), ("-h",), ("tools", "call", "--help"), ("sessions", "--help")])
def test_help_into_a_pipe_its_reader_closed_ends_as_sigpipe_would_with_nothing_on_stderr(
    tmp_path: Path, args: tuple[str, ...], unbuffered: bool
) -> None:
    """`dsh --help | head -0` exited 1 (click's handling): the root's help is printed while click parses
    the arguments, before the command runs, where a closed output pipe already ended dsh with 141."""
    assert _into_a_closed_pipe(*args, cwd=tmp_path, unbuffered=unbuffered) == (128 + signal.SIGPIPE, b"")


@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("args", [("tools",), ("--no-such-option",)])
def test_usage_into_a_pipe_its_reader_closed_ends_as_sigpipe_would(
    tmp_path: Path, args: tuple[str, ...], unbuffered: bool
) -> None:
    # `dsh tools 2>&1 | head -0`: click shows a usage error (or a group's help) on stderr once it
    # has left the command; a closed pipe there exited 120 (1 under -u), each a failed operation's status.
    code, _ = _into_a_closed_pipe(*args, cwd=tmp_path, unbuffered=unbuffered, stderr_too=True)
    assert code == 128 + signal.SIGPIPE
