"""The conformance kit (dsh_core.testing), tested black-box with pytester in subprocesses.

The fixture plugins under tests/fixtures/conformance are "installed" into each
pytester directory as a distribution (a ``.dist-info`` with entry points), so
the kit finds them through ``dsh.plugins`` exactly as it finds a real package.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dsh_core.abort import AbortSignal
from dsh_core.model import ToolResult
from dsh_core.testing import checks
from dsh_core.testing.checks import Target

pytest_plugins = ["pytester"]

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "conformance"

ENTRY_POINTS = """\
[dsh.plugins]
good = good_plugin:plugin
noisy = noisy_plugin:plugin
bad-config = broken_plugins:bad_config
bad-names = broken_plugins:bad_names
bad-tools = broken_plugins:bad_tools
bad-hooks = broken_plugins:bad_hooks
leaky = broken_plugins:leaky
swallows-cancel = broken_plugins:swallows_cancel
refused-and-shadowed = broken_plugins:refused_and_shadowed
"""


#: Options of every inner run: no cache, and no hypothesis plugin (it costs a second per interpreter).
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")

#: The checks that bound each call they make of a tool by the call limit (``Target.call_timeout_s``).
LIMIT_CHECKS = ("check_example_calls", "check_typed_errors", "check_dispose")
#: Those and the abort check (its call bounded by the abort bound): every check whose call runs the tool's body.
BODY_CHECKS = ("check_abort", *LIMIT_CHECKS)
#: Those that make a single call of a fixture tool (its one example; typed-errors adds two variants): the tests of a
#: call held before its body expect one failure of each (the pre-abort check's call reaches no stage before the body).
SINGLE_CALL_CHECKS = ("check_abort", "check_example_calls", "check_dispose")
#: Those and the pre-abort check, whose call runs no body but still reaches finalize_content and the result observers.
CALLING_CHECKS = (*BODY_CHECKS, "check_pre_abort")


def _check_id(check: str) -> str:
    """The id the failures of the check function ``check`` name (``check_typed_errors``: ``[dsh:typed-errors]``)."""
    return check.removeprefix("check_").replace("_", "-")


@pytest.fixture
def kit(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester directory where the fixture plugins are an installed distribution."""
    for source in FIXTURES.glob("*.py"):
        shutil.copy(source, pytester.path / source.name)
    dist = pytester.path / "dsh_conformance_fixtures-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dsh-conformance-fixtures\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    return pytester


def test_good_plugin_passes_every_check_from_the_command_line_and_as_a_subclass(kit: pytest.Pytester) -> None:
    """--dsh-conformance=good adds the shipped suite; a ToolPluginConformance subclass runs the same checks.

    Both pass all 13 checks (the subclass feeds its own config through plugin_config); a subclass that
    forgets plugin_name errors with a message saying what to set; the marker is registered (strict markers).
    """
    kit.makepyfile(
        test_mine="""
        import pytest
        from dsh_core.testing import ToolPluginConformance

        class TestGood(ToolPluginConformance):
            plugin_name = "good"

            @pytest.fixture
            def plugin_config(self):
                return {"greeting": "hi"}

        class TestNothing(ToolPluginConformance):
            pass
    """
    )
    result = kit.runpytest_subprocess(
        ".", "--dsh-conformance=good", *QUIET, "--strict-markers", "-m", "dsh_conformance", "-v"
    )
    result.assert_outcomes(passed=26, errors=13)
    out = result.stdout
    out.fnmatch_lines(["*TestDshConformance::test_dispose_unregisters_everything_and_quiesces[[]good[]] PASSED*"])
    out.fnmatch_lines(["*test_mine.py::TestGood::test_dispose_unregisters_everything_and_quiesces PASSED*"])
    out.fnmatch_lines(["*TestNothing: set plugin_name = '<entry point name in dsh.plugins>'*"])


def test_broken_plugins_fail_each_check_with_its_message(kit: pytest.Pytester) -> None:
    """Every check fails on the plugin broken for it, naming the tool, the check and the fix.

    Also: an unknown name lists the installed entry points, and with no test paths only the suite runs.
    """
    kit.makepyfile(test_unrelated="def test_not_collected():\n    raise AssertionError")
    names = ["noisy", "bad-config", "bad-names", "bad-tools", "bad-hooks", "leaky", "nope"]
    result = kit.runpytest_subprocess(
        *[f"--dsh-conformance={n}" for n in names], "--dsh-conformance-abort-bound=0.1", *QUIET, "-rf"
    )
    out = result.stdout
    out.fnmatch_lines(
        [
            '*[[]dsh:stdout[]] plugin "noisy": importing the plugin\'s module wrote to stdout: '
            "b'noisy plugin loaded!*",
            "*fix: remove print() and other writes to stdout at module level*",
        ]
    )
    out.fnmatch_lines(['*[[]dsh:config-schema[]] plugin "bad-config": *invalid JSON Schema*'])
    out.fnmatch_lines(['*[[]dsh:entry-point[]] plugin "bad-config": *config schema*'])
    out.fnmatch_lines(['*[[]dsh:tool-names[]] plugin "bad-names", tool "run_code": "run_code" is reserved*'])
    out.fnmatch_lines(['*[[]dsh:tool-names[]] plugin "bad-names", tool "bad name!": invalid tool name*'])
    out.fnmatch_lines(['*[[]dsh:tool-names[]] plugin "bad-names", tool "twice": the plugin registers this name twice*'])
    out.fnmatch_lines(['*[[]dsh:tool-schemas[]] plugin "bad-tools", tool "bad_schema": *invalid JSON Schema*'])
    out.fnmatch_lines(['*[[]dsh:examples[]] plugin "bad-tools", tool "no_examples": the tool declares no examples*'])
    out.fnmatch_lines(
        ['*[[]dsh:concurrency-safe[]] plugin "bad-tools", tool "no_examples": is_concurrency_safe is not declared*']
    )
    out.fnmatch_lines(
        ['*[[]dsh:concurrency-safe[]] plugin "bad-tools", tool "moody": is_concurrency_safe is not pure*']
    )
    out.fnmatch_lines(
        ['*[[]dsh:concurrency-safe[]] plugin "bad-tools", tool "stringly": is_concurrency_safe returned \'yes\' (str)*']
    )
    out.fnmatch_lines(['*[[]dsh:example-calls[]] plugin "bad-tools", tool "lossy": *INVALID_TOOL_OUTPUT*'])
    out.fnmatch_lines(['*[[]dsh:example-calls[]] plugin "bad-tools", tool "wrong_output": *INVALID_TOOL_OUTPUT*'])
    out.fnmatch_lines(
        [
            '*[[]dsh:typed-errors[]] plugin "bad-tools", tool "untyped": *the untyped KeyError*',
            "*fix: catch it and raise dsh_core.ToolError*",
        ]
    )
    out.fnmatch_lines(
        ['*[[]dsh:abort[]] plugin "bad-tools", tool "deaf": the body returned * s after the abort (bound: 0.1 s)*']
    )
    out.fnmatch_lines(
        ['*[[]dsh:hookimpls[]] plugin "bad-hooks": dsh_guard (hook dsh_guard) declares defaults for execution*']
    )
    out.fnmatch_lines(
        ['*[[]dsh:hookimpls[]] plugin "bad-hooks": dsh_approve (hook dsh_approve) is async def on a first-result hook*']
    )
    out.fnmatch_lines(
        ['*[[]dsh:hookimpls[]] plugin "bad-hooks": dsh_pre_execute (hook dsh_pre_execute) is a pluggy wrapper*']
    )
    out.fnmatch_lines(
        ['*[[]dsh:hookimpls[]] plugin "bad-hooks": dsh_no_such_hook (hook dsh_no_such_hook) implements no known hook*']
    )
    out.fnmatch_lines(
        [
            '*[[]dsh:dispose[]] plugin "leaky": task leaked-task * was left running at load and is '
            "still running after dispose*"
        ]
    )
    out.fnmatch_lines(
        ["*[[]dsh:dispose[]] plugin \"leaky\": thread 'leaked-thread' was left running at load and is still running*"]
    )
    out.fnmatch_lines(
        [
            '*[[]dsh:dispose[]] plugin "leaky": child process pid * (sleep 10) was left running at load '
            "and is still running*"
        ]
    )
    out.fnmatch_lines(["*[[]dsh:entry-point[]] plugin \"nope\": no entry point named 'nope'*installed:*good*"])
    assert "test_not_collected" not in out.str()
    failed = {
        line.split("[", 1)[1].split("]", 1)[0] for line in result.outlines if line.startswith("FAILED") and "[" in line
    }
    assert set(names) <= failed


def test_opting_out_with_p_no_dsh_removes_the_options(kit: pytest.Pytester) -> None:
    """-p no:dsh disables the plugin: its options are unknown."""
    result = kit.runpytest_subprocess("-p", "no:dsh", *QUIET, "--dsh-conformance=good")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*unrecognized arguments: --dsh-conformance=good*"])


def test_the_plugin_is_inert_without_its_options(kit: pytest.Pytester) -> None:
    """Without --dsh-conformance the plugin collects nothing extra (the project's tests run alone)."""
    kit.makepyfile(test_plain="def test_ok():\n    pass")
    kit.runpytest_subprocess(*QUIET, "--strict-markers").assert_outcomes(passed=1)


class _StubRuntime:
    """A runtime that ignores abort signals: what the pre-abort check exists to catch."""

    def __init__(self, loaded: Any) -> None:
        self.loaded = loaded

    async def execute(self, request: Any) -> ToolResult:
        spy = self.loaded.spies[request.name]
        await spy.execute(request.arguments, SimpleNamespace(signal=AbortSignal.never(), call_id=request.call_id))
        return ToolResult(content="ran anyway")


def test_pre_abort_check_catches_a_body_that_runs_after_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    """The core makes a pre-aborted dispatch impossible for plugins, so the check is proven on a stub runtime."""
    real_load = checks.load_plugin

    async def load(*args: Any, **kwargs: Any) -> Any:
        loaded = await real_load(*args, **kwargs)
        loaded.runtime = _StubRuntime(loaded)  # type: ignore[assignment]
        return loaded

    monkeypatch.setattr(checks, "load_plugin", load)
    failures = checks.check_pre_abort(Target("guards"))
    assert failures == []  # guards registers no tools: nothing to call
    failures = checks.check_pre_abort(Target("bash", {"root": str(Path.cwd())}))
    assert any("the body ran although the call was aborted" in f for f in failures)
    assert any("expected ABORTED_BEFORE_DISPATCH, got a success" in f for f in failures)


def test_same_compares_types_deeply() -> None:
    """The round-trip comparison tells 1, 1.0 and True apart, at any depth."""
    assert checks.same({"a": [1, {"b": None}]}, {"a": [1, {"b": None}]})
    assert not checks.same({"a": [1]}, {"a": [1.0]})
    assert not checks.same([True], [1])
    assert not checks.same({"a": 1, "b": 2}, {"b": 2, "a": 1})  # key order survives JSON; keep it
    asyncio.run(asyncio.sleep(0))


def test_a_config_that_misses_required_keys_is_named_before_the_factory_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin run without the config it needs fails with its schema's message, not the factory's KeyError."""
    from dsh_core.testing import checks

    monkeypatch.setattr(
        checks, "load_factory", lambda name: (None, __import__("tests.core.sample_plugins", fromlist=["deny"]).deny)
    )
    failures = checks.check_hookimpls(checks.Target("needs-config", {}))
    assert len(failures) == 1
    assert "'names' is a required property" in failures[0] and "--dsh-conformance-config" in failures[0]


def test_an_async_factory_fails_the_entry_point_check_and_every_check_that_starts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ``async def`` factory registers nothing; the kit must not pass it on empty tool lists."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint("async-factory", "tests.core.sample_plugins:async_factory", ENTRY_POINT_GROUP)
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    target = Target("async-factory")
    failures = checks.check_entry_point(target)
    assert len(failures) == 1
    assert failures[0].startswith('[dsh:entry-point] plugin "async-factory": the plugin did not start alone:')
    assert "returned a coroutine" in failures[0] and "never `async def`" in failures[0]
    for check in (checks.check_tool_names, checks.check_examples, checks.check_dispose):
        assert any("returned a coroutine" in f for f in check(target)), check.__name__


def test_the_tool_names_check_refuses_a_trailing_newline(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.core.helpers import tool

    monkeypatch.setattr(checks, "_recorded", lambda target, check: [tool("read\n"), tool("fine")])
    failures = checks.check_tool_names(Target("newline"))
    assert len(failures) == 1 and "invalid tool name 'read\\n'" in failures[0]


def test_async_def_on_a_hook_dsh_never_awaits_fails_the_hookimpls_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """``async def dsh_register_tools`` registers nothing (its coroutine is discarded): zero tools must not pass."""
    import warnings
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "async-registration", "tests.fixtures.conformance.broken_plugins:async_registration", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "coroutine ... was never awaited": the point here
        failures = checks.check_hookimpls(Target("async-registration"))
    assert len(failures) == 2, failures
    assert failures[0].startswith(
        '[dsh:hookimpls] plugin "async-registration": dsh_prompt_sections (hook '
        "dsh_prompt_sections) is async def, but dsh calls dsh_prompt_sections "
        "synchronously"
    )
    assert failures[1].startswith(
        '[dsh:hookimpls] plugin "async-registration": dsh_register_tools (hook dsh_register_tools) is async def'
    )
    assert "so nothing is registered" in failures[1] and "fix: make it a plain def" in failures[1]
    (started,) = checks.check_entry_point(Target("async-registration"))
    assert "is async def, but dsh calls it synchronously" in started, started
    assert "the hookimpls check says how" in started


def test_a_hook_method_without_hookimpl_fails_the_hookimpls_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``dsh_*`` method without ``@hookimpl`` is never called (no tools, no guard): zero tools must not pass."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "unmarked", "tests.fixtures.conformance.broken_plugins:unmarked", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    failures = checks.check_hookimpls(Target("unmarked"))
    assert len(failures) == 2, failures
    assert failures[0].startswith(
        '[dsh:hookimpls] plugin "unmarked": dsh_gaurd (no known hook) is not marked @hookimpl'
    )
    assert "name a known hook: " in failures[0] and "dsh_guard" in failures[0]
    assert failures[1].startswith(
        '[dsh:hookimpls] plugin "unmarked": dsh_register_tools (hook '
        "dsh_register_tools) is not marked @hookimpl, so pluggy never calls it"
    )


def test_concurrency_safe_of_a_tool_without_examples_is_not_called_with_invalid_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With require_examples off, a tool may have no examples: ``{}`` misses its required arguments, and a
    classifier raising on it is fine (the registry treats a raise as exclusive), so it must not fail."""
    from tests.core.helpers import tool

    needs_seconds = tool(
        "wait",
        safe=lambda args: args["seconds"] < 1,
        parameters={"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]},
    )
    monkeypatch.setattr(checks, "_recorded", lambda target, check: [needs_seconds])
    assert checks.check_concurrency_safe(Target("no-examples", require_examples=False)) == []


def test_the_hookimpls_check_starts_the_factory_in_the_scope_load_plugin_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """A factory that looks up the "tools" registry starts under load_plugin, so the hookimpls check passes it."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "needs-registry", "tests.fixtures.conformance.broken_plugins:needs_registry", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    target = Target("needs-registry")
    assert checks.check_entry_point(target) == []
    assert checks.check_hookimpls(target) == []


def test_an_optionalhook_impl_of_a_hook_no_spec_defines_passes_the_entry_point_and_hookimpls_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pluggy accepts ``@hookimpl(optionalhook=True)`` on a hook no spec defines; the kit failed it as unknown."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "forward-hooks", "tests.fixtures.conformance.broken_plugins:forward_hooks", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    target = Target("forward-hooks")
    assert checks.check_entry_point(target) == []
    assert checks.check_hookimpls(target) == []


def test_a_plugin_that_hangs_while_loading_fails_the_stdout_check_with_a_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe interpreter is killed at PROBE_TIMEOUT_S and the failure names the plugin (no raw traceback)."""
    import subprocess
    import sys

    monkeypatch.setattr(checks, "PROBE_TIMEOUT_S", 0.5, raising=False)
    real_run = subprocess.run

    def hang(command: list[str], **kwargs: Any) -> Any:  # a probe whose plugin import never returns
        return real_run([sys.executable, "-c", "import time; time.sleep(5)"], **kwargs)

    monkeypatch.setattr(checks.subprocess, "run", hang)
    failures = checks.check_stdout(Target("hangs"))
    assert len(failures) == 1
    assert failures[0].startswith(
        '[dsh:stdout] plugin "hangs": loading, starting and disposing the plugin in a '
        "fresh interpreter took more than 0.5 s"
    )


CHATTY_PLUGINS = """
import subprocess

from dsh_core import hookimpl, plugin


class Prints:
    @hookimpl
    def dsh_register_tools(self, register):
        print("registering")


class Echoes:
    @hookimpl
    def dsh_register_tools(self, register):
        subprocess.run(["echo", "registering"], check=True)


@plugin()
def in_hook(scope, config):
    return Prints()


@plugin()
def child_in_hook(scope, config):
    return Echoes()


@plugin()
def in_dispose(scope, config):
    scope.on_dispose(lambda: print("bye"))
    return None


@plugin()
def fails_to_start(scope, config):
    raise RuntimeError("no database")


@plugin()
def exits_in_dispose(scope, config):
    def undo():
        raise SystemExit(3)

    scope.on_dispose(undo)
    return None
"""


def test_the_stdout_check_says_where_the_output_or_the_failure_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Import, start (factory and hooks) and dispose each get their own message and fix; "make the entry point
    importable" is the fix only for a module that does not import.

    print() in a hook is no failure: dsh sends it to stderr while a plugin starts; a child process writes to the
    file descriptor itself, so the fix names that."""
    (tmp_path / "chatty_plugins.py").write_text(CHATTY_PLUGINS)
    (tmp_path / "unimportable_plugin.py").write_text("raise ImportError('needs what conftest.py imported')\n")
    dist = tmp_path / "chatty-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: chatty\nVersion: 1.0\n")
    names = ["in-hook", "child-in-hook", "in-dispose", "fails-to-start", "exits-in-dispose"]
    (dist / "entry_points.txt").write_text(
        "[dsh.plugins]\n"
        + "".join(f"{n} = chatty_plugins:{n.replace('-', '_')}\n" for n in names)
        + "unimportable = unimportable_plugin:plugin\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    assert checks.check_stdout(Target("in-hook")) == []
    (found,) = checks.check_stdout(Target("child-in-hook"))
    assert found.startswith(
        '[dsh:stdout] plugin "child-in-hook": starting the plugin (its factory and the hooks '
        "dsh calls as it starts, such as dsh_register_tools) wrote to stdout: "
        "b'registering\\n'"
    ), found
    assert "a child process that inherits stdout" in found and "importable" not in found
    (found,) = checks.check_stdout(Target("in-dispose"))
    assert found.startswith(
        '[dsh:stdout] plugin "in-dispose": disposing the plugin (its disposers and the tasks '
        "dispose cancels) wrote to stdout: b'bye\\n'"
    ), found
    assert "fix: do not print() in disposers" in found

    (found,) = checks.check_stdout(Target("fails-to-start"))
    assert found.startswith(
        '[dsh:stdout] plugin "fails-to-start": starting the plugin (its factory and the '
        "hooks dsh calls as it starts, such as dsh_register_tools) in a fresh interpreter "
        "failed: "
    ), found
    assert "no database" in found and "importable" not in found and "fix: make the factory start" in found
    (found,) = checks.check_stdout(Target("exits-in-dispose"))
    assert found.startswith(
        '[dsh:stdout] plugin "exits-in-dispose": disposing the plugin (its disposers and the '
        "tasks dispose cancels) in a fresh interpreter failed: SystemExit: 3"
    ), found
    assert "importable" not in found and "fix: disposers must neither raise SystemExit" in found
    (found,) = checks.check_stdout(Target("unimportable"))
    assert found.startswith(
        '[dsh:stdout] plugin "unimportable": importing the plugin\'s module in a fresh interpreter failed: '
    ), found
    assert "needs what conftest.py imported" in found and "fix: make the entry point importable on its own" in found


LEAVES_AT_LOAD = """
import subprocess

from dsh_core import plugin


@plugin(config_schema={"type": "object", "properties": {"pids": {"type": "string"}}, "required": ["pids"]})
def leaves_at_load(scope, config):
    # Neither goes through the scope: a child left running, and an orphan whose shell exited at once.
    child = subprocess.Popen(["sleep", "37"])
    orphan = subprocess.run(["sh", "-c", "sleep 38 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                            check=True).stdout.strip()
    with open(config["pids"], "w") as pids:
        pids.write(f"{child.pid} {orphan}")
    return None
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="processes are found through /proc")
def test_the_stdout_check_kills_what_the_plugin_left_running_in_its_fresh_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every check that starts the plugin in the kit's process kills and reaps what it left running at load; the
    stdout check starts it in a fresh interpreter, and what the plugin left running there (a child, an orphan)
    ran on after the interpreter exited, and after the kit. It is killed, unreported as the other checks leave
    reporting it to the dispose check."""
    import os
    import signal

    (tmp_path / "leaves_at_load.py").write_text(LEAVES_AT_LOAD)
    dist = tmp_path / "leaves-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: leaves\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[dsh.plugins]\nleaves-at-load = leaves_at_load:leaves_at_load\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pids_file = tmp_path / "pids"
    pids: list[int] = []
    try:
        assert checks.check_stdout(Target("leaves-at-load", {"pids": str(pids_file)})) == []
        pids = [int(pid) for pid in pids_file.read_text().split()]
        assert len(pids) == 2, pids
        assert [checks._describe_pid(pid) for pid in pids if os.path.exists(f"/proc/{pid}")] == []
    finally:
        for pid in pids:  # what the check did not kill, so it does not run on after the test
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as command:
                if command.read().startswith(b"sleep\0"):
                    os.kill(pid, signal.SIGKILL)


def test_a_config_that_is_not_json_fails_the_stdout_check_with_a_message() -> None:
    """``{"root": tmp_path}`` (a Path) is an easy slip in plugin_config: the probe's JSON argument cannot hold it,
    which raised a raw TypeError out of the check instead of naming the value."""
    (found,) = checks.check_stdout(Target("any", {"root": Path("/tmp")}))
    assert found.startswith(
        '[dsh:stdout] plugin "any": the config cannot be passed to a fresh interpreter: not lossless JSON at /root: '
    ), found
    assert "str(path)" in found


def test_a_name_given_twice_is_checked_once(kit: pytest.Pytester) -> None:
    result = kit.runpytest_subprocess("--dsh-conformance=good", "--dsh-conformance=good", *QUIET, "-v")
    result.assert_outcomes(passed=13)
    result.stdout.fnmatch_lines(["*test_hookimpls_are_well_formed[[]good[]] PASSED*"])


NEEDY_PLUGIN = """
from dsh_core import plugin


@plugin(config_schema={"type": "object", "properties": {"token": {"type": "string"}}, "required": ["token"],
                       "additionalProperties": False})
def needy(scope, config):
    return None
"""


def test_each_checked_plugin_gets_its_own_config_from_the_command_line(kit: pytest.Pytester) -> None:
    """``good`` refuses the key ``needy`` requires: one config for both names cannot pass, NAME=JSON can.

    A bare JSON object is the config of the names without their own; a NAME= for a name not checked
    (a typo would be silently ignored) is refused before any test runs.
    """
    kit.makepyfile(needy_plugin=NEEDY_PLUGIN)
    (kit.path / "dsh_conformance_fixtures-1.0.dist-info" / "entry_points.txt").write_text(
        ENTRY_POINTS + "needy = needy_plugin:needy\n"
    )
    result = kit.runpytest_subprocess(
        "--dsh-conformance=good",
        "--dsh-conformance=needy",
        *QUIET,
        "--dsh-conformance-config",
        'needy={"token": "{tmp}"}',
        "--dsh-conformance-config",
        '{"greeting": "hi"}',
    )
    result.assert_outcomes(passed=26)
    result = kit.runpytest_subprocess(
        "--dsh-conformance=good", *QUIET, "--dsh-conformance-config", 'neddy={"token": "t"}'
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*--dsh-conformance-config 'neddy={\"token\": \"t\"}': 'neddy' is not checked; "
            "add --dsh-conformance=neddy or fix the name (checked: good)*"
        ]
    )


def test_a_config_without_a_plugin_to_check_is_refused_not_ignored(kit: pytest.Pytester) -> None:
    """Without --dsh-conformance the config fed nothing: a subclass suite ran with its own config, silently."""
    result = kit.runpytest_subprocess(*QUIET, "--dsh-conformance-config", '{"greeting": "hi"}')
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--dsh-conformance-config applies only to plugins named with --dsh-conformance*"])


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--dsh-conformance-call-timeout", "0"),
        ("--dsh-conformance-call-timeout", "-1"),
        ("--dsh-conformance-abort-bound", "0"),
        ("--dsh-conformance-abort-bound", "-0.5"),
        ("--dsh-conformance-call-timeout", "nan"),
        ("--dsh-conformance-abort-bound", "inf"),
    ],
)
def test_a_bound_that_is_not_a_positive_number_of_seconds_is_refused(
    kit: pytest.Pytester, option: str, value: str
) -> None:
    """A timeout of 0 or less failed every call of the suite as "did not return within 0 s", and a bound of 0
    failed every body, as if each plugin were at fault; NaN and infinity bound nothing. Refused at parsing,
    naming the option and the value, before any test runs."""
    result = kit.runpytest_subprocess("--dsh-conformance=good", *QUIET, f"{option}={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.outlines
    result.stderr.fnmatch_lines([f"*argument {option}: {value!r} is not a positive, finite number of seconds*"])
    assert "passed" not in result.stdout.str()


def test_config_values_that_cannot_be_used_are_named() -> None:
    from dsh_core.testing.pytest_plugin import parse_configs

    assert parse_configs([], ["a"]) == ({}, {})
    assert parse_configs(['{"k": "x=y"}', 'a={"k": 1}'], ["a", "b"]) == ({"k": "x=y"}, {"a": {"k": 1}})
    for values, message in [
        (["a=[1]"], "--dsh-conformance-config 'a=[1]': the config must be a JSON object, got list"),
        (["a={"], "--dsh-conformance-config 'a={': not valid JSON"),
        (["{}", "{}"], "--dsh-conformance-config '{}': a config without NAME= is given twice"),
        (["a={}", "a={}"], "--dsh-conformance-config 'a={}': plugin 'a' is given a config twice"),
    ]:
        with pytest.raises(ValueError) as raised:
            parse_configs(values, ["a"])
        assert str(raised.value).startswith(message), raised.value


def test_the_dispose_check_reports_every_kind_of_registry_state_left_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only tools: a guard, a change listener, and a layer with its mode, restriction and tool."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "leaky-registry", "tests.fixtures.conformance.broken_plugins:leaky_registry", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    failures = checks.check_dispose(Target("leaky-registry"))
    module = "tests.fixtures.conformance.broken_plugins"
    left = [
        f"guard {module}._passes in the global layer",
        "the tool layer of scope 'stray'",
        "tool \"stray_tool\" in the layer of scope 'stray'",
        "restriction (deny=['ping']) in the layer of scope 'stray'",
        "presentation mode \"both\" in the layer of scope 'stray'",
        f"change listener {module}._listens (from on_change)",
    ]
    assert sorted(failures) == sorted(
        f'[dsh:dispose] plugin "leaky-registry": after dispose, {what} is still registered\n'
        "    fix: register through the plugin's scope (the register callables, scope=scope for registry guards, "
        "restrictions and modes, scope.on_dispose(undo) for on_change) so dispose can undo it"
        for what in left
    )


def test_a_body_that_blocks_the_event_loop_fails_the_abort_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body doing blocking work without awaiting (time.sleep, subprocess.run in ``async def``) returns before
    the abort can even be delivered: the kit must time it from the abort's request, not its delivery."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "blocking", "tests.fixtures.conformance.broken_plugins:blocking", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    (found,) = checks.check_abort(Target("blocking", abort_bound_s=0.1))
    assert found.startswith('[dsh:abort] plugin "blocking", tool "block": the body kept the event loop busy for '), (
        found
    )
    assert "asyncio.to_thread" in found


def test_output_that_breaks_the_output_schema_only_on_an_edge_variant_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example's output matches; the variant with the string emptied returns what the runtime refuses."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "variant-output", "tests.fixtures.conformance.broken_plugins:variant_output", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    target = Target("variant-output")
    assert checks.check_example_calls(target) == []
    (found,) = checks.check_typed_errors(target)
    assert found.startswith(
        '[dsh:typed-errors] plugin "variant-output", tool "length": called with {"s": ""}, '
        "the tool returned output the runtime refused (INVALID_TOOL_OUTPUT): "
    ), found
    assert "0 is less than the minimum of 1" in found and "output_schema" in found


def test_invalid_output_is_blamed_on_the_body_only_when_the_body_ran_in_that_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The body runs (validly) on the example; a middleware then answers the edge variant itself with output the
    runtime refuses. Whether the body ran is a fact of each call: a running count of calls made the earlier
    call's entry into the body stand for this one, so the body was blamed for output it never returned."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "short-circuit", "tests.fixtures.conformance.broken_plugins:short_circuit", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    assert checks.check_typed_errors(Target("short-circuit")) == []


def test_a_body_that_lets_out_a_cancellation_nobody_asked_for_fails_the_typed_errors_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kit never cancels nor aborts these calls: a CancelledError from the body fails the call as TOOL_FAILED
    with no message of the tool's, which is what the check is for."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "stray-cancel", "tests.fixtures.conformance.broken_plugins:stray_cancel", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    (found,) = checks.check_typed_errors(Target("stray-cancel"))
    assert found.startswith(
        '[dsh:typed-errors] plugin "stray-cancel", tool "count": called with {"s": ""}, the '
        "body let out CancelledError although its call was neither cancelled nor aborted"
    ), found
    assert "ToolError" in found


def test_a_hook_or_disposer_whose_exception_dsh_only_logs_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """An observer hook that raises on every call and a disposer that raises: dsh logs and goes on, so the
    results look fine; the kit must read what dsh logged while the plugin ran."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "raising-hooks", "tests.fixtures.conformance.broken_plugins:raising_hooks", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    target = Target("raising-hooks")
    found = checks.check_example_calls(target)
    assert any(
        f.startswith(
            '[dsh:example-calls] plugin "raising-hooks": dsh logged a failure of the plugin: '
            "tool result observer of plugin 'raising-hooks' failed (RuntimeError: observer is "
            "broken)"
        )
        for f in found
    ), found
    assert any("disposer is broken" in f for f in found), found
    assert all("fix: " in f for f in found)
    assert any("tool result observer" in f for f in checks.check_typed_errors(target))
    assert any("disposer is broken" in f for f in checks.check_dispose(target))


def _kit_disposer_fails() -> None:
    raise RuntimeError("this disposer is not the plugin's")


def test_only_warnings_the_plugin_caused_fail_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """dsh warns that a disposer of the kit's own root scope failed, with a traceback through code that is not
    the plugin's: that is no failure of the plugin (every dsh warning was). The same disposer in the plugin's
    scope is the plugin's; so are a guard of the plugin's that dsh names, and the plugin's own warning on a
    dsh logger (neither names the plugin nor carries an exception)."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    real_load = checks.load_plugin
    owner = "root"

    async def load(*args: Any, **kwargs: Any) -> Any:
        loaded = await real_load(*args, **kwargs)
        (loaded.root if owner == "root" else loaded.scope).on_dispose(_kit_disposer_fails)
        return loaded

    monkeypatch.setattr(checks, "load_plugin", load)
    assert checks.check_dispose(Target("guards")) == []
    owner = "plugin"
    (found,) = checks.check_dispose(Target("guards"))
    assert found.startswith(
        '[dsh:dispose] plugin "guards": dsh logged a failure of the plugin: a disposer of scope '
        "'conformance/plugin:guards' failed (RuntimeError: this disposer is not the plugin's)"
    ), found
    monkeypatch.undo()

    entry_point = metadata.EntryPoint(
        "bad-verdict", "tests.fixtures.conformance.broken_plugins:bad_verdict", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    found = checks.check_typed_errors(Target("bad-verdict"))
    assert any("guard tests.fixtures.conformance.broken_plugins._bad_verdict returned int" in f for f in found), found
    assert any("the plugin's own warning, on a dsh logger" in f for f in found), found


def test_a_body_that_returns_on_abort_but_leaves_its_process_running_fails_the_abort_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dispose check's calls run to completion: only the abort check sees work an abort leaves behind."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "abort-leak", "tests.fixtures.conformance.broken_plugins:abort_leak", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    monkeypatch.setattr(checks, "QUIESCENCE_GRACE_S", 0.2)
    (found,) = checks.check_abort(Target("abort-leak"))
    assert found.startswith('[dsh:abort] plugin "abort-leak", tool "spawn": child process pid ')
    assert "(sleep 3) is still running after the aborted call and dispose" in found
    assert "fix: kill and reap every process the plugin starts" in found


def test_a_body_that_returns_on_abort_but_leaves_its_task_running_fails_the_abort_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Like a process, an asyncio task the aborted body abandons must be reported, not cancelled silently when
    the check's event loop closes."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "abort-task-leak", "tests.fixtures.conformance.broken_plugins:abort_task_leak", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    monkeypatch.setattr(checks, "QUIESCENCE_GRACE_S", 0.2)
    (found,) = checks.check_abort(Target("abort-task-leak"))
    assert found.startswith('[dsh:abort] plugin "abort-task-leak": task abandoned-work (<coroutine object sleep '), (
        found
    )
    assert "is still running after the aborted call and dispose" in found
    assert "fix: start background work with scope.spawn(...)" in found


def test_a_config_given_to_a_plugin_that_declares_no_config_schema_fails_the_config_schema_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a declared schema a plugin accepts only ``{}`` (as dsh starts it); the check that names the config
    as the culprit must not pass while every other check fails with "did not start"."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "no-schema", "tests.fixtures.conformance.broken_plugins:blocking", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    assert checks.check_config_schema(Target("no-schema")) == []
    (found,) = checks.check_config_schema(Target("no-schema", {"greeting": "hi"}))
    assert found.startswith(
        "[dsh:config-schema] plugin \"no-schema\": config for plugin 'no-schema' does not match "
        "its config schema: (top level): Additional properties are not allowed"
    ), found
    assert "fix: the plugin declares no config schema, so it takes only {}" in found


def test_an_entry_point_that_is_declared_but_fails_to_load_is_not_told_to_declare_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The entry point exists and its config schema is invalid: the fix names the schema, not the declaration."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "bad-config", "tests.fixtures.conformance.broken_plugins:bad_config", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    (found,) = checks.check_entry_point(Target("bad-config"))
    assert "invalid JSON Schema" in found and "config_schema must be a valid" in found, found
    assert "declare [project.entry-points" not in found
    monkeypatch.undo()
    (missing,) = checks.check_entry_point(Target("no-such-plugin"))
    assert "fix: declare [project.entry-points" in missing


def test_the_probe_command_a_failure_suggests_survives_a_shell_whatever_the_config_holds() -> None:
    """The suggested command quoted the config in '...' as is: a config holding a quote broke it."""
    import json
    import shlex

    config = {"root": "/tmp/it's here", "note": 'a "quoted" $HOME `x`'}
    command = checks.probe_command(checks.Target("my plugin", config))
    assert shlex.split(command) == ["python", "-m", "dsh_core.testing.probe", "my plugin", json.dumps(config)]


def test_a_body_that_exits_or_interrupts_fails_the_checks_instead_of_ending_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sys.exit() or KeyboardInterrupt in a body is no Exception: the runtime lets it out, asyncio re-raises it
    out of the event loop, and it left the check as a bare traceback (KeyboardInterrupt ended the whole pytest
    run) with no word of the plugin or the tool. Each check that calls the tool must name it instead."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint("exits", "tests.fixtures.conformance.broken_plugins:exits", ENTRY_POINT_GROUP)
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    target = Target("exits")

    def run(check: Any) -> list[str]:
        try:
            found: list[str] = check(target)
        except BaseException as error:  # what this test is about: nothing of the plugin's may escape the kit
            pytest.fail(f"{check.__name__} let out {type(error).__name__}: {error}")
        return found

    found = run(checks.check_typed_errors)
    assert len(found) == 2, found
    assert found[0].startswith(
        '[dsh:typed-errors] plugin "exits", tool "quit": called with {}, the body raised '
        "SystemExit (3), which ends the process dsh runs in"
    ), found[0]
    assert found[1].startswith(
        '[dsh:typed-errors] plugin "exits", tool "interrupt": called with {}, the body raised KeyboardInterrupt'
    ), found[1]
    assert all("fix: never call sys.exit() nor raise KeyboardInterrupt in a tool body" in f for f in found)
    found = run(checks.check_example_calls)
    assert [f.split(":", 1)[0] for f in found] == ["[dsh", "[dsh"], found
    assert 'tool "quit": examples[0] {}: it returned error TOOL_FAILED' in found[0], found[0]
    assert 'tool "interrupt": examples[0] {}: it returned error TOOL_FAILED' in found[1], found[1]
    assert run(checks.check_dispose) == []  # its calls fail like any other; nothing is left behind
    assert run(checks.check_abort) == []  # the bodies return at once


def test_a_check_is_selected_with_k_by_the_id_its_failures_name(kit: pytest.Pytester) -> None:
    """A failure reads ``[dsh:typed-errors]``, but the test is named test_errors_are_typed: ``-k typed-errors``
    selected nothing (and ``-k example-calls``, ``-k pre-abort``... neither), so an author could not rerun the
    one check that failed, by its own name. ``dsh:ID`` is a keyword of each check's test, in the shipped suite
    and in a subclass; ``-k dsh:abort`` is the abort check alone (not pre-abort)."""
    kit.makepyfile(
        test_mine="""
        import pytest
        from dsh_core.testing import ToolPluginConformance

        class TestGood(ToolPluginConformance):
            plugin_name = "good"

            @pytest.fixture
            def plugin_config(self):
                return {"greeting": "hi"}
    """
    )
    for selection, tests in [
        ("typed-errors", ["test_errors_are_typed"]),
        ("dsh:example-calls", ["test_example_calls_return_lossless_json_matching_output_schema"]),
        ("dsh:abort", ["test_abort_mid_call_is_honoured"]),
        (
            "dsh:pre-abort or dsh:tool-names",
            ["test_pre_aborted_call_never_runs_the_body", "test_tool_names_are_unique_valid_and_not_reserved"],
        ),
    ]:
        result = kit.runpytest_subprocess(".", "--dsh-conformance=good", *QUIET, "-v", "-k", selection)
        result.assert_outcomes(passed=2 * len(tests))
        for test in tests:
            result.stdout.fnmatch_lines([f"*TestDshConformance::{test}[[]good[]] PASSED*"])
            result.stdout.fnmatch_lines([f"*test_mine.py::TestGood::{test} PASSED*"])
    result = kit.runpytest_subprocess(".", *QUIET, "-k", "not dsh:stdout and not dsh:abort and not dsh:dispose")
    result.assert_outcomes(passed=10)


def test_a_body_whose_child_process_writes_to_stdout_fails_the_example_calls_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stdout check runs import, start and dispose only; a body's child process that inherits file
    descriptor 1 writes into what dsh prints there (the JSON of ``dsh tools call --json``), and passed every
    check. print() in a body is no failure: dsh sends sys.stdout to stderr while it runs tools."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint("echoes", "tests.fixtures.conformance.broken_plugins:echoes", ENTRY_POINT_GROUP)
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    (found,) = checks.check_example_calls(Target("echoes"))
    assert found.startswith(
        '[dsh:example-calls] plugin "echoes", tool "shout": examples[0] {}: the call wrote to '
        "stdout (file descriptor 1): b'from the body\\n'"
    ), found
    assert "stdout=subprocess.PIPE" in found


def test_a_blank_description_fails_the_tool_schemas_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """define_tool refuses a blank description, but a definition built otherwise (attrs.evolve, as a plugin may
    rename or re-describe a tool) reaches the registry, which takes it: the model was shown a tool with no
    description, and every check passed."""
    import attrs

    from tests.core.helpers import tool

    described = tool("fine")
    monkeypatch.setattr(
        checks,
        "_recorded",
        lambda target, check: [
            described,
            attrs.evolve(described, name="empty", description=""),
            attrs.evolve(described, name="blank", description=" \n"),
        ],
    )
    found = checks.check_tool_schemas(Target("blank"))
    assert found == [
        f'[dsh:tool-schemas] plugin "blank", tool "{name}": the description is blank, so the model '
        "is told nothing of what the tool does\n    fix: describe what the tool does and when to use it "
        "(define_tool(description=...))"
        for name in ("empty", "blank")
    ], found


@pytest.mark.parametrize(
    ("name", "check", "expected"),
    [
        (
            "exiting_classifier",
            "check_concurrency_safe",
            '[dsh:concurrency-safe] plugin "exiting_classifier", tool "quit": '
            "is_concurrency_safe raised on examples[0]: SystemExit: 5",
        ),
        (
            "exiting_factory",
            "check_hookimpls",
            '[dsh:hookimpls] plugin "exiting_factory": the factory raised SystemExit: 4',
        ),
    ],
)
def test_sys_exit_in_a_classifier_or_a_factory_is_a_failure_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, name: str, check: str, expected: str
) -> None:
    """is_concurrency_safe and the hookimpls check's factory call caught Exception only: a sys.exit() there
    left the kit as a bare SystemExit, naming neither plugin nor tool."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(name, f"tests.fixtures.conformance.broken_plugins:{name}", ENTRY_POINT_GROUP)
    monkeypatch.setattr(loader, "find_entry_point", lambda _name: entry_point)
    try:
        found = getattr(checks, check)(Target(name))
    except BaseException as error:
        pytest.fail(f"{check} let out {type(error).__name__}: {error}")
    assert any(line.startswith(expected) for line in found), found


def test_a_body_stuck_in_a_thread_is_reported_without_hanging_the_abort_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The body awaits asyncio.to_thread(...) on work that ignores the abort. Cancelling the call does not stop
    the thread, and closing the check's event loop waited for the default executor's threads with no bound: the
    check took as long as the thread (forever, for one that never returns) and reported nothing of it."""
    import threading
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader
    from tests.fixtures.conformance import broken_plugins

    entry_point = metadata.EntryPoint(
        "stuck-in-thread", "tests.fixtures.conformance.broken_plugins:stuck_in_thread", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    monkeypatch.setattr(checks, "STUCK_GRACE_S", 0.2)
    monkeypatch.setattr(checks, "QUIESCENCE_GRACE_S", 0.2)
    broken_plugins.STUCK.clear()
    outcome: list[list[str]] = []
    runner = threading.Thread(
        target=lambda: outcome.append(checks.check_abort(Target("stuck-in-thread", abort_bound_s=0.1)))
    )
    runner.start()
    runner.join(30)  # a hang guard: the thread waits until the event is set, which only happens below
    returned = not runner.is_alive()
    broken_plugins.STUCK.set()
    runner.join(30)
    assert returned, "the abort check waited for the thread the aborted body left running"
    (stuck, leftover) = outcome[0]
    assert stuck.startswith(
        '[dsh:abort] plugin "stuck-in-thread", tool "wait": the call, aborted as its body began, did not return '
        "within 0.3 s: it was held by its body, which had not returned ("
    ), stuck
    assert leftover.startswith('[dsh:abort] plugin "stuck-in-thread", tool "wait": thread '), leftover
    assert (
        "running threading.Event.wait (asyncio.to_thread or loop.run_in_executor) is still running after the "
        "aborted call and dispose" in leftover
    ), leftover
    assert "fix: a thread cannot be cancelled" in leftover, leftover


#: When each check that calls tools looks for what the calls left running, as its failures say.
LEFTOVERS_WHEN = {
    "dispose": "after dispose",
    "abort": "after the aborted call and dispose",
    "example-calls": "after the example calls and dispose",
    "typed-errors": "after the calls and dispose",
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="processes are found through /proc")
@pytest.mark.parametrize("check", ["check_example_calls", "check_typed_errors"])
def test_a_body_that_returns_but_leaves_work_running_fails_the_checks_that_call_it(
    monkeypatch: pytest.MonkeyPatch, check: str
) -> None:
    """Only the dispose and abort checks looked for leftovers, and dispose makes one call per tool: what a body
    leaves running on another example, or on an edge variant, went unseen, and a process ran on after the run."""
    import os
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader
    from tests.fixtures.conformance import broken_plugins

    entry_point = metadata.EntryPoint(
        "call-leak", "tests.fixtures.conformance.broken_plugins:call_leak", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    monkeypatch.setattr(checks, "QUIESCENCE_GRACE_S", 0.2)
    broken_plugins.CALL_LEAK_DONE.clear()
    try:
        found = getattr(checks, check)(Target("call-leak"))
    finally:
        broken_plugins.CALL_LEAK_DONE.set()
    name = _check_id(check)
    when = LEFTOVERS_WHEN[name]
    assert len(found) == 3, found
    task, thread, process = sorted(found, key=lambda f: ("task" not in f, "thread" not in f))
    assert task.startswith(f'[dsh:{name}] plugin "call-leak": task littered-task ('), task
    assert f"is still running {when}" in task and "fix: start background work with scope.spawn" in task, task
    assert thread.startswith(f"[dsh:{name}] plugin \"call-leak\": thread 'littered-thread' is still running {when}"), (
        thread
    )
    prefix = f'[dsh:{name}] plugin "call-leak", tool "litter": child process pid '
    assert process.startswith(prefix) and f"(sleep 3) is still running {when}" in process, process
    pid = int(process.removeprefix(prefix).split(" ", 1)[0])
    assert not os.path.exists(f"/proc/{pid}"), "the leftover process was not killed and reaped"


@pytest.fixture
def load_leak(monkeypatch: pytest.MonkeyPatch) -> Iterator[Target]:
    """The ``load-leak`` plugin (``load-leak-only``: its tool leaves nothing running) as the checks' target, with
    short graces; what it leaves waiting is released after."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader
    from tests.fixtures.conformance import broken_plugins

    def find(name: str) -> metadata.EntryPoint:
        factory = name.replace("-", "_")
        return metadata.EntryPoint(name, f"tests.fixtures.conformance.broken_plugins:{factory}", ENTRY_POINT_GROUP)

    monkeypatch.setattr(loader, "find_entry_point", find)
    monkeypatch.setattr(checks, "QUIESCENCE_GRACE_S", 0.2)
    broken_plugins.LOAD_LEAK_DONE.clear()
    broken_plugins.CALL_LEAK_DONE.clear()
    broken_plugins.LOAD_LEAK_PIDS.clear()
    try:
        yield Target("load-leak")
    finally:
        broken_plugins.LOAD_LEAK_DONE.set()
        broken_plugins.CALL_LEAK_DONE.set()


#: How each leftover ``load-leak`` leaves as it loads shows in a failure.
LOAD_LEFTOVERS = ("task load-task (", "thread 'load-thread'", "running threading.Event.wait", "(sleep 4)")
#: What the dispose check says of a leftover that was left running at load.
_AT_LOAD_DISPOSE = "was left running at load and is still running after dispose"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="processes are found through /proc")
def test_what_a_plugin_leaves_running_at_load_is_reported_once_by_the_dispose_check(load_leak: Target) -> None:
    """Every check that looks for leftovers loads the plugin: each reported what the plugin left running as it
    loaded, as if its own calls had, and blamed a process on the first tool it called."""
    by_check = {
        name: check(load_leak) for name, check in checks.CHECKS.items() if name != "stdout"
    }  # a fresh interpreter, which does not see this test's entry point
    for leftover in LOAD_LEFTOVERS:
        reports = [(name, f) for name, found in by_check.items() for f in found if leftover in f.split("\n")[0]]
        assert len(reports) == 1, (leftover, reports)
        name, report = reports[0]
        assert name == "dispose" and report.startswith('[dsh:dispose] plugin "load-leak": '), report
        assert _AT_LOAD_DISPOSE in report, report


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="processes are found through /proc")
@pytest.mark.parametrize("check", BODY_CHECKS)
def test_a_check_reports_what_its_calls_leave_running_apart_from_what_was_left_at_load(
    load_leak: Target, check: str
) -> None:
    """What was running once the plugin had loaded is no call's: a check reports only what its calls left, and
    kills the processes left at load all the same."""
    before = set(checks._descendants())
    found = getattr(checks, check)(load_leak)
    name = _check_id(check)
    when = LEFTOVERS_WHEN[name]
    calls = [f for f in found if not any(leftover in f.split("\n")[0] for leftover in LOAD_LEFTOVERS)]
    assert len(calls) == 3, found
    assert all(f"is still running {when}" in f and "at load" not in f for f in calls), calls
    process = next(f for f in calls if "child process" in f)
    prefix = f'[dsh:{name}] plugin "load-leak", tool "litter": child process pid '
    assert process.startswith(prefix) and "(sleep 3)" in process, process
    assert len(found) == (3 + len(LOAD_LEFTOVERS) if name == "dispose" else 3), found
    running = [checks._describe_pid(pid) for pid in checks._descendants().keys() - before]
    assert not any("(sleep 4)" in process for process in running), f"the process left at load runs on: {running}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="processes are found through /proc")
@pytest.mark.parametrize("check", ["check_abort", "check_example_calls", "check_typed_errors"])
def test_a_check_whose_calls_leave_nothing_passes_though_the_plugin_left_work_running_at_load(
    load_leak: Target, check: str
) -> None:
    """The dispose check reports what was left at load; the others pass, and kill the process left at load."""
    before = set(checks._descendants())
    assert getattr(checks, check)(Target("load-leak-only")) == []
    running = [checks._describe_pid(pid) for pid in checks._descendants().keys() - before]
    assert not any("(sleep 4)" in process for process in running), f"the process left at load runs on: {running}"
    found = checks.check_dispose(Target("load-leak-only"))
    assert len(found) == len(LOAD_LEFTOVERS) and all(_AT_LOAD_DISPOSE in f for f in found), found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="processes are found through /proc")
@pytest.mark.parametrize(
    ("check", "plugin"),
    [
        ("check_entry_point", "load-leak"),
        ("check_pre_abort", "load-leak"),
        ("check_tool_schemas", "load-leak"),
        ("check_tool_names", "load-leak"),
        ("check_examples", "load-leak"),
        ("check_concurrency_safe", "load-leak"),
        ("check_hookimpls", "load-leak-in-factory"),
    ],
)
def test_a_check_that_looks_for_no_leftovers_still_kills_the_processes_left_at_load(
    load_leak: Target, check: str, plugin: str
) -> None:
    """The checks that load the plugin but report no leftovers (the dispose check reports them) left a process
    the plugin started as it loaded running on after them, and after the kit: each kills and reaps it, silently."""
    import os

    from tests.fixtures.conformance import broken_plugins

    assert getattr(checks, check)(Target(plugin)) == []
    assert broken_plugins.LOAD_LEAK_PIDS, "the plugin was not loaded"
    for pid in broken_plugins.LOAD_LEAK_PIDS:
        assert not os.path.exists(f"/proc/{pid}"), f"the process left at load runs on: {checks._describe_pid(pid)}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="processes are found through /proc")
@pytest.mark.parametrize("check", BODY_CHECKS)
def test_grandchild_processes_a_body_leaves_behind_are_reported_and_killed(
    monkeypatch: pytest.MonkeyPatch, check: str
) -> None:
    """The kit looked at its direct children only: a process behind a shell that is still running, one whose
    shell already exited (reparented away from the kit), and one that also left the session all passed, and
    ran on after the test run."""
    import os
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "grandchildren", "tests.fixtures.conformance.broken_plugins:grandchildren", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    monkeypatch.setattr(checks, "QUIESCENCE_GRACE_S", 0.2)
    found = getattr(checks, check)(Target("grandchildren"))
    name = _check_id(check)
    when = LEFTOVERS_WHEN[name]
    pids = []
    for tool, command in (
        ("behind", "sh -c sleep 62 & wait"),
        ("behind", "sleep 62"),
        ("orphan", "sleep 60"),
        ("daemon", "sleep 61"),
    ):
        prefix = f'[dsh:{name}] plugin "grandchildren", tool "{tool}": child process pid '
        suffix = f" ({command}) is still running {when}"
        lines = [f for f in found if f.startswith(prefix) and f.split("\n")[0].endswith(suffix)]
        assert len(lines) == 1, (tool, command, found)
        assert "fix: kill and reap every process the plugin starts" in lines[0], lines[0]
        pids.append(int(lines[0].removeprefix(prefix).split(" ", 1)[0]))
    assert len(found) == 4, found
    # Killed and reaped: not one of them runs on (nor stays a zombie) once the check has returned.
    assert [pid for pid in pids if os.path.exists(f"/proc/{pid}")] == []


@pytest.mark.parametrize("check", LIMIT_CHECKS)
def test_a_call_that_never_returns_is_aborted_and_reported_within_the_call_limit(
    monkeypatch: pytest.MonkeyPatch, check: str
) -> None:
    """These checks awaited each call with no bound: a body that never returns (it waits on nothing that ends,
    and only returns once aborted or cancelled, if at all) hung the check forever, and nothing was reported."""
    import threading
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "never-returns", "tests.fixtures.conformance.broken_plugins:never_returns", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    monkeypatch.setattr(checks, "CALL_TIMEOUT_S", 0.2)
    monkeypatch.setattr(checks, "STUCK_GRACE_S", 0.2)
    monkeypatch.setattr(checks, "QUIESCENCE_GRACE_S", 0.2)
    outcome: list[list[str]] = []
    runner = threading.Thread(
        target=lambda: outcome.append(getattr(checks, check)(Target("never-returns"))), daemon=True
    )  # on the old code it never ends: it must not hold up the test run
    runner.start()
    runner.join(30)  # a hang guard: bounded, the check takes a few seconds at most
    assert not runner.is_alive(), f"{check} still waits for a call that never returns"
    name = _check_id(check)
    what = {
        "example-calls": 'examples[0] {"q": "forever"}',
        "typed-errors": 'called with {"q": "forever"}',
        "dispose": 'examples[0] {"q": "forever"}',
    }[name]
    found = outcome[0]
    for tool, after in (
        ("hang", "it was still running 0.2 s after its signal was aborted, and was cancelled"),
        ("until_aborted", "it returned once its signal was aborted"),
    ):
        line = (
            f'[dsh:{name}] plugin "never-returns", tool "{tool}": {what}: the call did not return within 0.2 s: '
            f"it was held by its body, which had not returned ({after})\n    fix: return promptly or honour "
            "ctx.signal"
        )
        assert [f for f in found if f.startswith(line)], (line, found)
    # typed-errors also calls the edge variants ("" and "\0"), each reported alike; nothing else fails.
    assert len(found) == (6 if name == "typed-errors" else 2), found
    assert all("the call did not return within 0.2 s" in f for f in found), found


@pytest.mark.parametrize("check", BODY_CHECKS)
def test_a_body_that_swallows_cancellation_fails_the_check_without_hanging_it(
    monkeypatch: pytest.MonkeyPatch, check: str
) -> None:
    """The body catches CancelledError and waits again. The kit awaited the call it had cancelled with no bound,
    and closing the check's event loop (asyncio.run) cancels every task left and waits for it: either hung the
    check forever, whatever the call limit."""
    import threading
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    entry_point = metadata.EntryPoint(
        "swallows-cancel", "tests.fixtures.conformance.broken_plugins:swallows_cancel", ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(loader, "find_entry_point", lambda name: entry_point)
    monkeypatch.setattr(checks, "STUCK_GRACE_S", 0.2)
    monkeypatch.setattr(checks, "QUIESCENCE_GRACE_S", 0.2)
    outcome: list[list[str]] = []
    runner = threading.Thread(
        target=lambda: outcome.append(
            getattr(checks, check)(Target("swallows-cancel", call_timeout_s=0.2, abort_bound_s=0.1))
        ),
        daemon=True,
    )  # the old code never ends
    runner.start()
    runner.join(30)  # a hang guard: bounded, the check takes a second or two
    assert not runner.is_alive(), f"{check} still waits for a body that swallows its cancellation"
    name = _check_id(check)
    (found,) = outcome[0]
    prefix = f'[dsh:{name}] plugin "swallows-cancel", tool "stubborn": '
    assert found.startswith(prefix), found
    assert (
        "it ignored cancellation: it was still running 0.2 s after it was cancelled, so the kit stopped "
        "waiting for it" in found
    ), found
    assert "fix: never swallow asyncio.CancelledError" in found, found


def test_a_body_that_swallows_cancellation_does_not_hang_the_pytest_run(kit: pytest.Pytester) -> None:
    """From the command line, with a short call limit: the check fails and pytest exits, though the body's task
    never ends (the loop it ran on is closed without it)."""
    result = kit.runpytest_subprocess(
        "--dsh-conformance=swallows-cancel",
        "--dsh-conformance-call-timeout=0.2",
        "-k",
        "dsh:example-calls",
        *QUIET,
        "-rf",
        timeout=60,
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            '*[[]dsh:example-calls[]] plugin "swallows-cancel", tool "stubborn": examples[[]0[]] '
            "{}: the call did not return within 0.2 s: it was held by its body, which had not returned (it "
            "ignored cancellation*"
        ]
    )


class _OwnSwitchTask(asyncio.Task[None]):
    """A task a loop's task factory may make, where asyncio's private ``_log_destroy_pending`` switch is shadowed (as
    a later asyncio may rename or drop it): writing it silences nothing."""

    @property
    def _log_destroy_pending(self) -> bool:
        return True

    @_log_destroy_pending.setter
    def _log_destroy_pending(self, value: bool) -> None:
        pass


def test_a_task_abandoned_with_its_closed_loop_is_not_reported_destroyed_and_other_reports_still_are(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The kit abandons a task that swallows its cancellation with the loop it closes: collected later, asyncio
    reported it as "destroyed but pending" in the middle of another test. The kit silenced that by writing
    asyncio's private switch on the task; it drops that one report through the loop's exception handler instead,
    and every other report of that loop still reaches the default handler."""
    import contextlib
    import gc
    import logging

    monkeypatch.setattr(checks, "STUCK_GRACE_S", 0.1)
    loops: list[asyncio.AbstractEventLoop] = []

    async def stubborn() -> None:
        while True:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loops.append(loop)
        loop.set_task_factory(lambda loop, coroutine: _OwnSwitchTask(coroutine, loop=loop))  # type: ignore[arg-type]
        loop.create_task(stubborn(), name="abandoned")  # noqa: RUF006  (left running on purpose)
        await asyncio.sleep(0)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        checks._run(scenario)
        gc.collect()  # the abandoned task, unreachable once its loop is closed, is finalized now
        assert not [r for r in caplog.records if "Task was destroyed" in r.getMessage()], caplog.text
        (loop,) = loops
        assert loop.is_closed()
        loop.call_exception_handler({"message": "an unrelated failure"})
        loop.call_exception_handler({"message": "Task was destroyed but it is pending!", "task": "another task"})
    messages = [r.getMessage().splitlines()[0] for r in caplog.records if r.name == "asyncio"]
    assert messages == ["an unrelated failure", "Task was destroyed but it is pending!"], messages


def test_a_subclass_bound_that_is_not_a_positive_number_of_seconds_is_refused_naming_it(kit: pytest.Pytester) -> None:
    """``abort_bound_s`` and ``call_timeout_s`` of a subclass are vetted as the command-line options are:
    0 or less would fail every call as the plugin's fault, NaN and infinity bound nothing. Each bad one
    errors every test of its class, naming the class, the attribute and the value; good ones pass."""
    bad = [
        ("abort_bound_s", "0"),
        ("abort_bound_s", "-1.5"),
        ("abort_bound_s", "float('inf')"),
        ("call_timeout_s", "0"),
        ("call_timeout_s", "float('nan')"),
        ("call_timeout_s", "True"),
        ("call_timeout_s", "'30'"),
    ]
    classes = "".join(
        f"""
class TestBad{index}(ToolPluginConformance):
    plugin_name = "good"
    {attribute} = {value}
"""
        for index, (attribute, value) in enumerate(bad)
    )
    kit.makepyfile(
        test_mine=f"""
from dsh_core.testing import ToolPluginConformance

class TestFine(ToolPluginConformance):
    plugin_name = "good"
    abort_bound_s = 1
    call_timeout_s = 0.5e2
{classes}"""
    )
    result = kit.runpytest_subprocess("test_mine.py", *QUIET, "-k", "entry_point")
    result.assert_outcomes(passed=1, errors=len(bad))
    for index, (attribute, value) in enumerate(bad):
        shown = repr(eval(value))
        result.stdout.fnmatch_lines(
            [f"*TestBad{index}.{attribute} = {shown} is not a positive, finite number of seconds*"]
        )


@pytest.mark.parametrize(
    ("keyword", "value"),
    [("abort_bound_s", 0.0), ("abort_bound_s", math.nan), ("call_timeout_s", -1.0), ("call_timeout_s", math.inf)],
)
def test_make_target_refuses_a_bound_that_is_not_a_positive_number_of_seconds(
    tmp_path: Path, keyword: str, value: float
) -> None:
    from dsh_core.testing.conformance import make_target

    with pytest.raises(
        ValueError,
        match=rf"make_target: {keyword} = {re.escape(repr(value))} is not a positive, "
        "finite number of seconds",
    ):
        make_target("good", {}, tmp_path, **{keyword: value})


@pytest.fixture
def fixture_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every name is the fixture plugin of ``broken_plugins`` whose factory is the name with ``_`` for ``-``; the
    kit's graces are short."""
    from importlib import metadata

    from dsh_core.plugins import ENTRY_POINT_GROUP
    from dsh_core.testing import loader

    def find(name: str) -> metadata.EntryPoint:
        factory = name.replace("-", "_")
        return metadata.EntryPoint(name, f"tests.fixtures.conformance.broken_plugins:{factory}", ENTRY_POINT_GROUP)

    monkeypatch.setattr(loader, "find_entry_point", find)
    monkeypatch.setattr(checks, "CALL_TIMEOUT_S", 0.2)
    monkeypatch.setattr(checks, "STUCK_GRACE_S", 0.2)
    monkeypatch.setattr(checks, "QUIESCENCE_GRACE_S", 0.2)


def _bounded(check: str, target: Target) -> list[str]:
    """``check`` run on ``target`` in a thread of its own, failing the test if it does not return (a hang guard)."""
    import threading

    outcome: list[list[str] | Exception] = []

    def attempt() -> None:
        try:
            outcome.append(getattr(checks, check)(target))
        except Exception as error:  # raised again below, in the test's thread, so it fails the test readably
            outcome.append(error)

    runner = threading.Thread(target=attempt, daemon=True)
    runner.start()
    runner.join(30)  # bounded, the check takes a second or two
    assert not runner.is_alive(), f"{check} hangs"
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


#: What each check that calls tools says of the call it reports, for the fixture tools' examples[0] ``{"x": 1}``.
CALL_WHAT = {
    "example-calls": 'examples[0] {"x": 1}: ',
    "dispose": 'examples[0] {"x": 1}: ',
    "typed-errors": 'called with {"x": 1}: ',
}
#: The fix of a call that waited for an approval ask, in part.
APPROVAL_FIX = (
    "fix: an approval channel (dsh_approve) must answer, or abstain by returning None, when it can reach no one"
)
#: What the kit says of an approval ask still running after its call and dispose (its channel ignored the withdrawal).
STRAY_ASK = "the approval ask of call "
#: What blames a tool's body: never said of a call whose body never ran (the second, the ignored-cancellation fix's
#: wording before it named no stage).
BODY_BLAME = ("ctx.signal", "a body that goes on")


@pytest.mark.parametrize("check", BODY_CHECKS)
def test_a_call_waiting_for_an_approval_nobody_gives_is_blamed_on_the_ask_not_the_body(
    fixture_plugins: None, check: str
) -> None:
    """The plugin asks before its tool runs, and its channel never answers: the body never runs. The kit said the
    call was still running after its signal was aborted (the abort check never aborted it: it aborts on entering
    the body) and told the author to make the body honour ctx.signal."""
    name = _check_id(check)
    found = _bounded(check, Target("unanswered-ask", abort_bound_s=0.1))
    if name == "abort":
        prefix = (
            '[dsh:abort] plugin "unanswered-ask", tool "gated": the call did not return within 0.3 s: it was '
            "waiting for the answer to an approval ask, which never came, so the body never ran; its abort, due "
            "as the body begins, could not be checked (it was cancelled then)\n"
        )
    else:
        prefix = (
            f'[dsh:{name}] plugin "unanswered-ask", tool "gated": {CALL_WHAT[name]}the call did not return '
            "within 0.2 s: it was waiting for the answer to an approval ask, which never came, so the body "
            "never ran (it returned once its signal was aborted)\n"
        )
    # typed-errors calls the edge variants too ({"x": 0} and {"x": -1}), each reported alike.
    assert found and all(re.sub(r'"x": -?\d', '"x": 1', f).startswith(prefix) for f in found), found
    assert all(APPROVAL_FIX in f and not any(blame in f for blame in BODY_BLAME) for f in found), found
    assert len(found) == (3 if name == "typed-errors" else 1), found


@pytest.mark.parametrize("check", SINGLE_CALL_CHECKS)
def test_a_call_whose_ask_ignores_its_withdrawal_gets_the_runtimes_approval_grace_and_blames_the_channel(
    fixture_plugins: None, monkeypatch: pytest.MonkeyPatch, check: str
) -> None:
    """The channel never answers and swallows the withdrawal of its ask: cancelled or aborted, the call ends only once
    the runtime has waited out its approval grace for the channel and let it go. The kit waited its own grace, the
    same 5 s, so which gave up first was a race: when the kit did, it said the body ignored its cancellation (or was
    still running after the abort) though the body never ran. Here the runtime's grace is the longer one: the kit
    must wait it out (it derives its wait from the runtime's), and name the ask."""
    from dsh_core.runtime import APPROVAL_GRACE_S

    real_load = checks.load_plugin
    graces: list[float] = []

    async def load(*args: Any, **kwargs: Any) -> Any:
        loaded = await real_load(*args, **kwargs)
        graces.append(loaded.runtime.approval_grace_s)
        loaded.runtime.approval_grace_s = 2.0  # longer than the kit's STUCK_GRACE_S
        return loaded

    monkeypatch.setattr(checks, "load_plugin", load)
    # What the kit waits past the runtime's grace: a margin of 1 s, wide enough for a loaded machine.
    monkeypatch.setattr(checks, "STUCK_GRACE_S", 1.0)
    name = _check_id(check)
    found = _bounded(check, Target("deaf-ask", abort_bound_s=0.1))
    assert graces and set(graces) == {APPROVAL_GRACE_S}  # the kit's runtime has the runtime's own grace
    calls = [f for f in found if f.startswith(f'[dsh:{name}] plugin "deaf-ask", tool "gated": ') and STRAY_ASK not in f]
    assert len(calls) == 1, found
    assert "approval ask" in calls[0] and APPROVAL_FIX in calls[0], calls[0]
    assert not any(blame in calls[0] for blame in BODY_BLAME) and "ignored cancellation" not in calls[0], calls[0]
    # The runtime gave up on the channel itself, after its whole grace, and named it; the kit reports that.
    logged = [
        f
        for f in found
        if "dsh logged a failure of the plugin: approval channel of plugin 'deaf-ask' "
        'ignored its withdrawal for 2 s (tool "gated"' in f
    ]
    assert len(logged) == 1, found
    # Its ask, still running (the runtime left it): the channel's, which dsh started, not the plugin's spawning.
    (left,) = [f for f in found if f not in calls + logged]
    # Named with its tool: the kit's call ids repeat across tools ("dispose", "example-0").
    assert left.startswith(f'[dsh:{name}] plugin "deaf-ask", tool "gated": the approval ask of call '), left
    assert "(its channel, dsh_approve) ignored its withdrawal and is still running after" in left, left
    assert "fix: end dsh_approve's ask as soon as it is cancelled" in left and "scope.spawn" not in left, left


@pytest.mark.parametrize("check", SINGLE_CALL_CHECKS)
def test_a_call_held_before_its_body_is_not_blamed_on_the_body(fixture_plugins: None, check: str) -> None:
    """A guard that never returns holds the call before its body: the kit told the author to make the body honour
    ctx.signal, though it never ran."""
    name = _check_id(check)
    (found,) = _bounded(check, Target("held-by-guard", abort_bound_s=0.1))
    if name == "abort":
        prefix = (
            '[dsh:abort] plugin "held-by-guard", tool "guarded": the call did not return within 0.3 s: it was '
            "held before its body (by a pre-execute hook, an approval observer (dsh_approval_resolved), a guard "
            "or an around-dispatch middleware), so the body never ran; its abort, due as the body begins, could "
            "not be checked (it was cancelled then)\n"
        )
    else:
        prefix = (
            f'[dsh:{name}] plugin "held-by-guard", tool "guarded": {CALL_WHAT[name]}the call did not return '
            "within 0.2 s: it was held before its body (by a pre-execute hook, an approval observer "
            "(dsh_approval_resolved), a guard or an around-dispatch middleware), so the body never ran ("
        )
    assert found.startswith(prefix), found
    assert (
        "fix: make pre-execute hooks, approval observers, guards and around-dispatch middleware return "
        "promptly" in found
    ), found
    assert not any(blame in found for blame in BODY_BLAME), found


@pytest.mark.parametrize("check", SINGLE_CALL_CHECKS)
def test_a_call_held_by_an_approval_observer_names_the_observer_not_the_stages_it_never_reached(
    fixture_plugins: None, check: str
) -> None:
    """The ask was answered, but an approval observer (dsh_approval_resolved) never returns: the call is held before
    its body, after its pre-execute hooks. The kit named a pre-execute hook, a guard or an around-dispatch
    middleware, and told the author to fix those, never the observer that held the call."""
    name = _check_id(check)
    (found,) = _bounded(check, Target("held-by-approval-observer", abort_bound_s=0.1))
    assert found.startswith(f'[dsh:{name}] plugin "held-by-approval-observer", tool "observed": '), found
    assert "an approval observer (dsh_approval_resolved)" in found, found
    assert (
        "fix: make pre-execute hooks, approval observers, guards and around-dispatch middleware return "
        "promptly" in found
    ), found
    assert not any(blame in found for blame in BODY_BLAME), found


#: What holds a call before its body, in the kit's words.
BEFORE_BODY = (
    "by a pre-execute hook, an approval observer (dsh_approval_resolved), a guard or an around-dispatch middleware"
)
#: What holds a call after its body, in the kit's words, and its fix (in part).
AFTER_BODY = (
    "by a post-execute hook, a result observer (dsh_tool_result) or an around-dispatch middleware that "
    "did not return once proceed had"
)
AFTER_FIX = (
    "make post-execute hooks, result observers (dsh_tool_result) and around-dispatch middleware return "
    "promptly (a middleware returns once proceed has returned), and end when the call is aborted or cancelled"
)


def _call_failures(found: list[str], name: str, plugin: str, tool: str) -> list[str]:
    """The failures of ``found`` reporting a call of ``tool``, the typed-errors variants' arguments as ``{"x": 1}``."""
    return [
        re.sub(r'"x": -?\d', '"x": 1', f)
        for f in found
        if f.startswith(f'[dsh:{name}] plugin "{plugin}", tool "{tool}": ')
    ]


def _each_call(found: list[str], name: str, plugin: str, tool: str) -> list[str]:
    """The failures of ``found`` reporting a call of ``tool`` (:func:`_call_failures`), asserted to be all of
    ``found``, one per call the check makes: typed-errors calls examples[0] and its two variants (``x`` zeroed and
    negated), the others examples[0] alone."""
    calls = _call_failures(found, name, plugin, tool)
    assert len(calls) == len(found) == (3 if name == "typed-errors" else 1), found
    return calls


def _lead(name: str, plugin: str, tool: str) -> str:
    """The start of a failure the check ``name`` reports of a call of ``tool`` (a regular expression)."""
    return re.escape(f'[dsh:{name}] plugin "{plugin}", tool "{tool}": ')


def _past_limit(name: str, plugin: str, tool: str) -> str:
    """The start of what a call-limit check (example-calls, typed-errors, dispose) reports of a call of ``tool``
    that did not return within the tests' 0.2 s limit, up to what held it (a regular expression)."""
    return _lead(name, plugin, tool) + re.escape(CALL_WHAT[name]) + r"the call did not return within 0\.2 s: "


@pytest.mark.parametrize(
    "plugin",
    [
        "held-by-post-execute",
        "held-by-result-observer",
        "held-by-middleware-after-proceed",
        "held-by-detached-middleware-after-proceed",
    ],
)
@pytest.mark.parametrize("check", BODY_CHECKS)
def test_a_call_held_after_its_body_returned_is_blamed_on_what_held_it_not_the_body(
    fixture_plugins: None, check: str, plugin: str
) -> None:
    """The body returned at once, then a post-execute hook, a result observer or a middleware (also one that ran
    proceed in a task of its own) never returns: the kit said the body did not honour ctx.signal (or was still
    running after its abort), though it had returned. The spy, not the call's context, says the body ended."""
    name = _check_id(check)
    found = _bounded(check, Target(plugin, abort_bound_s=0.1))
    if name == "abort":
        expected = (
            f'[dsh:abort] plugin "{plugin}", tool "after": the call, aborted as its body began, did not return '
            f"within 0.3 s: it was held after its body ({AFTER_BODY}), which had returned already (it was "
            f"cancelled then)\n    fix: {AFTER_FIX}"
        )
    else:
        expected = (
            f'[dsh:{name}] plugin "{plugin}", tool "after": {CALL_WHAT[name]}the call did not return '
            f"within 0.2 s: it was held after its body ({AFTER_BODY}), which had returned already (it was "
            f"still running 0.2 s after its signal was aborted, and was cancelled)\n    fix: {AFTER_FIX}; "
        )
    calls = _each_call(found, name, plugin, "after")
    assert all(f.startswith(expected) for f in calls), found
    assert not any(blame in f for f in calls for blame in BODY_BLAME), found


@pytest.mark.parametrize("check", LIMIT_CHECKS)
def test_a_body_that_returns_once_aborted_and_is_then_held_after_it_names_both(
    fixture_plugins: None, check: str
) -> None:
    """The body ran past the call's limit and returned once its signal was aborted; a post-execute hook then held
    the call. The kit said only that the call was still running after the abort, and told the author to make the
    body honour ctx.signal, which it did: the body is named for its slowness, and what held the call after it."""
    name = _check_id(check)
    plugin = "aborted-then-held-by-post-execute"
    found = _bounded(check, Target(plugin, abort_bound_s=0.1))
    calls = _each_call(found, name, plugin, "after")
    expected = (
        f'[dsh:{name}] plugin "{plugin}", tool "after": {CALL_WHAT[name]}the call did not return within '
        f"0.2 s: it was held by its body, which had not returned (its body returned once its signal was "
        "aborted, but the call was then held after it "
        f"({AFTER_BODY}), still running 0.2 s after the abort, and was cancelled)\n    fix: return promptly "
        "or honour ctx.signal"
    )
    assert all(f.startswith(expected) and f"; and {AFTER_FIX}; " in f for f in calls), found


def test_the_abort_check_times_the_body_to_its_own_end_and_names_a_post_execute_hook_that_delays_the_call(
    fixture_plugins: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The body returns at once; a post-execute hook returns half a second later, past the abort bound but within
    the kit's wait. The kit timed the body to the call's end and said the body returned 0.5 s after the abort."""
    monkeypatch.setattr(checks, "STUCK_GRACE_S", 2.0)  # the hook's delay is well within the kit's wait
    (found,) = _bounded("check_abort", Target("slow-post-execute", abort_bound_s=0.1))
    expected = (
        r'\[dsh:abort\] plugin "slow-post-execute", tool "after": the call returned \d\.\d\d s after its body '
        rf"\(bound: 0\.1 s\): it was held after its body \({re.escape(AFTER_BODY)}\), which had returned already"
        rf"\n    fix: {re.escape(AFTER_FIX)}"
    )
    assert re.fullmatch(expected, found), found


#: What the pre-abort check says of a result observer that holds its call, and its fix (in part).
PRE_ABORT_HELD = (
    "it was held by a result observer (dsh_tool_result), the only hook of the plugin's a call aborted "
    "before dispatch still runs"
)
PRE_ABORT_FIX = (
    "make result observers (dsh_tool_result) return promptly, and end when the call is cancelled: they "
    "hear every call's result, a call aborted before dispatch included"
)


def test_a_pre_aborted_call_held_by_a_result_observer_is_cancelled_and_blamed_on_it(fixture_plugins: None) -> None:
    """A call aborted before dispatch still notifies the result observers (dsh_tool_result), and the pre-abort check
    awaited it with no bound: an observer that never returns hung the check, and the plugin author's test run. It is
    given the call timeout, then cancelled, and reported, naming the observer."""
    plugin = "held-by-result-observer"
    (found,) = _bounded("check_pre_abort", Target(plugin))
    assert (
        found == f'[dsh:pre-abort] plugin "{plugin}", tool "after": the call aborted before dispatch did not '
        f"return within 0.2 s: {PRE_ABORT_HELD} (it was cancelled then)\n    fix: {PRE_ABORT_FIX}; a "
        "call that is slow on purpose needs a larger limit (call_timeout_s in your subclass, "
        "--dsh-conformance-call-timeout)"
    ), found
    assert not any(blame in found for blame in BODY_BLAME), found


def test_a_pre_aborted_call_whose_result_observer_swallows_its_cancellation_is_reported_not_waited_for(
    fixture_plugins: None,
) -> None:
    """The observer also swallows the cancellation: the kit gives it STUCK_GRACE_S, says it ignored cancellation, and
    returns. The limit is the Target's call timeout, as in the other checks' calls."""
    plugin = "held-by-deaf-result-observer"
    (found,) = _bounded("check_pre_abort", Target(plugin, call_timeout_s=0.3))
    assert found.startswith(
        f'[dsh:pre-abort] plugin "{plugin}", tool "after": the call aborted before dispatch did '
        f"not return within 0.3 s: {PRE_ABORT_HELD} (it ignored cancellation: it was still running "
        "0.2 s after it was cancelled, so the kit stopped waiting for it)\n    fix: never swallow "
        f"asyncio.CancelledError"
    ), found
    assert f"; and {PRE_ABORT_FIX}; " in found, found


@pytest.mark.parametrize(
    "plugin",
    [
        "held-by-post-execute",
        "held-by-middleware-after-proceed",
        "held-by-guard",
        "held-by-approval-observer",
        "unanswered-ask",
        "own-call-while-held",
    ],
)
def test_a_pre_aborted_call_reaches_no_hook_but_the_result_observers(fixture_plugins: None, plugin: str) -> None:
    """What the pre-abort check says of a held call rests on it: a call aborted before dispatch runs no pre-execute
    hook, approval ask or observer, guard, middleware or post-execute hook, so none that never returns holds it."""
    assert _bounded("check_pre_abort", Target(plugin)) == []


def test_a_pre_aborted_call_held_after_a_body_that_ran_anyway_is_blamed_on_what_ran_after_it(
    fixture_plugins: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a stub runtime that runs the body of a pre-aborted call and then never returns (the core makes it
    impossible), the body is reported for running, and the call as held after it, not as held by a result
    observer."""
    real_load = checks.load_plugin

    class Stuck(_StubRuntime):
        async def execute(self, request: Any) -> ToolResult:
            await super().execute(request)
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    async def load(*args: Any, **kwargs: Any) -> Any:
        loaded = await real_load(*args, **kwargs)
        loaded.runtime = Stuck(loaded)  # type: ignore[assignment]
        return loaded

    monkeypatch.setattr(checks, "load_plugin", load)
    held, ran = _bounded("check_pre_abort", Target("held-by-guard"))
    assert held.startswith(
        '[dsh:pre-abort] plugin "held-by-guard", tool "guarded": the call aborted before dispatch '
        f"did not return within 0.2 s: it was held after its body ({AFTER_BODY}), which had "
        f"returned already (it was cancelled then)\n    fix: {AFTER_FIX}; "
    ), held
    assert "the body ran although the call was aborted before dispatch" in ran, ran


@pytest.mark.parametrize("after_s", [0.05, 30.0])
def test_a_pre_aborted_call_whose_body_ran_anyway_and_blocked_the_loop_is_named_for_the_blocking(
    fixture_plugins: None, monkeypatch: pytest.MonkeyPatch, after_s: float
) -> None:
    """On a stub runtime that runs the body of a pre-aborted call (the core makes it impossible), the body blocks
    the event loop for 0.6 s and returns, and the runtime then awaits 0.05 s (or 30 s) before it returns. The
    pre-abort check's timeout fired once the loop was free, in that await: the call was cancelled at once and
    blamed on the stages after the body, the blocking unnamed (had it returned by then, the blocking was named). As
    after a finalize_content that blocked, and as the other call-limit checks do, the call is given the grace of a
    stuck call first: one that returns then is reported as one whose body blocked and returned, its result checked
    as usual; one that does not, for the blocking first, then for what held it after the body."""
    real_load = checks.load_plugin

    class Late(_StubRuntime):
        async def execute(self, request: Any) -> ToolResult:
            result = await super().execute(request)
            await asyncio.sleep(after_s)
            return result

    async def load(*args: Any, **kwargs: Any) -> Any:
        loaded = await real_load(*args, **kwargs)
        loaded.runtime = Late(loaded)  # type: ignore[assignment]
        return loaded

    monkeypatch.setattr(checks, "load_plugin", load)
    plugin = "held-by-blocking-body"
    held, *others = _bounded("check_pre_abort", Target(plugin))
    lead = _lead("pre-abort", plugin, "blocked")
    expected = lead + rf"the call aborted before dispatch did not return within 0\.2 s: {BLOCKING_BODY_HELD}"
    if after_s < 1:
        expected += r" \(it returned then\)" + rf"\n    fix: {re.escape(BLOCKING_BODY_FIX)}"
        ran, replaced = others
        assert replaced.startswith(
            f'[dsh:pre-abort] plugin "{plugin}", tool "blocked": expected ABORTED_BEFORE_DISPATCH, got a success'
        ), replaced
    else:
        expected += re.escape(
            f"; its body had returned, but the call was then held after it ({AFTER_BODY}), still running 0.2 s later "
            f"(it was cancelled then)\n    fix: {BLOCKING_BODY_FIX}; and {AFTER_FIX}{LARGER_LIMIT}"
        )
        (ran,) = others
    _assert_timed(expected, [held])
    assert "the body ran although the call was aborted before dispatch" in ran, ran


@pytest.mark.parametrize("check", BODY_CHECKS)
def test_a_call_held_before_its_body_is_not_taken_as_entered_when_another_call_runs_the_body(
    fixture_plugins: None, check: str
) -> None:
    """The plugin's guard makes a call of its own of the tool (its body runs and returns) and holds the kit's call:
    the spy's count grew while the kit's call was held, so the kit took that call as entered and blamed its body
    (the abort check even aborted it as the other call's body was entered). Whether a call entered its body is
    judged by its own call id."""
    name = _check_id(check)
    plugin = "own-call-while-held"
    found = _bounded(check, Target(plugin, abort_bound_s=0.1))
    calls = _each_call(found, name, plugin, "held")
    if name == "abort":
        expected = (
            f'[dsh:abort] plugin "{plugin}", tool "held": the call did not return within 0.3 s: it was held '
            f"before its body ({BEFORE_BODY}), so the body never ran; its abort, due as the body begins, could "
            "not be checked (it was cancelled then)\n"
        )
    else:
        expected = (
            f'[dsh:{name}] plugin "{plugin}", tool "held": {CALL_WHAT[name]}the call did not return within '
            f"0.2 s: it was held before its body ({BEFORE_BODY}), so the body never ran ("
        )
    assert all(f.startswith(expected) for f in calls), found
    assert not any(blame in f for f in calls for blame in BODY_BLAME), found


@pytest.mark.parametrize(
    ("plugin", "tool", "held"),
    [
        ("refused-then-held", "bad name", f"it was held before its body ({BEFORE_BODY}), so the body never ran"),
        ("refused-and-shadowed", "shadowed", "it was held by its body, which had not returned"),
    ],
)
@pytest.mark.parametrize("check", ["check_example_calls", "check_dispose"])
def test_a_call_of_a_tool_the_registry_refused_is_blamed_on_a_body_only_if_the_registry_holds_one(
    fixture_plugins: None, check: str, plugin: str, tool: str, held: str
) -> None:
    """The plugin swallows the registry's refusal of its tool: the kit has the definition, so it calls the tool, but
    no spy of its body. Where the registry holds no tool of that name (refused-then-held: an invalid name), no body
    can run, and a pre-execute hook holds the call: the kit took a body no spy sees as running, and said the call
    was held by its body. Where it holds one all the same (refused-and-shadowed: registered straight in the
    registry, then refused as a duplicate), that body runs unseen and holds the call: it is blamed."""
    name = _check_id(check)
    (call,) = _call_failures(_bounded(check, Target(plugin)), name, plugin, tool)
    assert call.startswith(
        f'[dsh:{name}] plugin "{plugin}", tool "{tool}": examples[0] {{"x": 1}}: the call did not return within '
        f"0.2 s: {held} (it was still running 0.2 s after its signal was aborted, and was cancelled)\n"
    ), call


#: What the tool-names check says of a tool the registry refused, after the registry's message, and the fix.
REFUSED_THEN_ON = (
    "), and the plugin swallowed the error and went on: it started without the tool, and nothing said so\n"
    "    fix: let the error propagate out of dsh_register_tools, so the plugin fails to start naming the tool; and "
    "fix what the registry's message names (register a valid name no other tool has, built with define_tool)"
)


@pytest.mark.parametrize(
    ("plugin", "tool", "refusal"),
    [
        ("refused-then-held", "bad name", "invalid tool name 'bad name': use 1-64 characters from [A-Za-z0-9_-]"),
        ("refused-and-shadowed", "shadowed", 'tool "shadowed" is already registered globally; '),
    ],
)
def test_a_tool_the_registry_refused_the_plugin_going_on_fails_the_tool_names_check(
    fixture_plugins: None, plugin: str, tool: str, refusal: str
) -> None:
    """The plugin swallows the registry's refusal of a tool it registers through the kit's register callable, and
    starts without it: nothing failed, and dsh silently lacks the tool. The tool-names check read the names alone
    (a duplicate of a tool the plugin put straight in the registry, refused-and-shadowed, it could not see), and
    never said the plugin went on: it reports the refusal, naming the tool and the registry's error."""
    found = checks.check_tool_names(Target(plugin))
    lead = f'[dsh:tool-names] plugin "{plugin}", tool "{tool}": the registry refused to register the tool ('
    refused = [f for f in found if f.startswith(lead)]
    assert len(refused) == 1, found
    assert refused[0].startswith(lead + refusal), refused
    assert refused[0].endswith(REFUSED_THEN_ON), refused


def test_a_refusal_the_plugin_lets_out_is_left_to_the_entry_point_check(fixture_plugins: None) -> None:
    """bad-names lets the registry's refusal of its first tool out, so it fails to start: the tool-names check
    reports the names it would refuse, and no refusal gone on from (the plugin went on from none)."""
    found = checks.check_tool_names(Target("bad-names"))
    assert len(found) == 3, found
    assert not any("the registry refused" in f for f in found), found


@pytest.mark.parametrize("plugin", ["refused-then-held", "refused-and-shadowed"])
@pytest.mark.parametrize("check", ["check_typed_errors", "check_pre_abort", "check_abort"])
def test_the_checks_that_watch_a_body_skip_a_tool_the_registry_refused(
    fixture_plugins: None, check: str, plugin: str
) -> None:
    """A tool the registry refused (the plugin going on) has a definition but no spy of its body: these checks
    looked its spy up by name and crashed with a bare KeyError. They judge what the spy sees, so they skip it (the
    tool-names check reports it); the plugin's hooks hold no call they make, as they make none."""
    assert _bounded(check, Target(plugin)) == []


def test_a_tool_the_registry_refused_is_reported_by_the_suite_without_a_key_error(kit: pytest.Pytester) -> None:
    """Through the pytest plugin: the tool-names test fails naming the refused tool, and the tests of the checks
    that watch its body pass, no KeyError in sight."""
    result = kit.runpytest_subprocess(
        "--dsh-conformance=refused-and-shadowed",
        *QUIET,
        "-rf",
        "-k",
        "dsh:tool-names or dsh:typed-errors or dsh:pre-abort or dsh:abort",
    )
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        ['*[[]dsh:tool-names[]] plugin "refused-and-shadowed", tool "shadowed": the registry refused to register*']
    )
    assert "KeyError" not in result.stdout.str() + result.stderr.str()


def test_an_error_an_abandoned_call_raises_late_is_not_blamed_on_the_call_running_then(fixture_plugins: None) -> None:
    """typed-errors abandons the example call (its body ignores abort and cancellation); that body raises an untyped
    error later, while the next call ({"x": 0}) runs, whose body returns normally. The spy's error list runs across
    calls, so the kit said the next call's body raised the untyped ValueError: errors are judged per call id."""
    found = _bounded("check_typed_errors", Target("late-error", abort_bound_s=0.1))
    (only,) = found
    assert only.startswith(
        '[dsh:typed-errors] plugin "late-error", tool "late": called with {"x": 1}: the call did '
        "not return within 0.2 s: it was held by its body, which had not returned (it ignored cancellation: "
    ), found
    assert "ValueError" not in only, only


def test_a_plugin_that_raises_the_runtimes_approval_grace_cannot_make_the_kit_wait_it_out(
    fixture_plugins: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kit gave a call in its approval ask the grace read from the runtime, which the plugin can reach
    (scope.lookup("runtime")) and change: a plugin that set it to an hour, with a channel that ignores its ask's
    withdrawal, made the check wait an hour (twice) instead of reporting. The kit gives at most dsh's own approval
    grace (APPROVAL_GRACE_S, what the kit's runtime starts with), then cancels the call, which ends it."""
    monkeypatch.setattr(checks, "APPROVAL_GRACE_S", 0.5, raising=False)
    found = _bounded("check_example_calls", Target("deaf-ask-long-grace"))
    calls = [f for f in _call_failures(found, "example-calls", "deaf-ask-long-grace", "gated") if STRAY_ASK not in f]
    assert len(calls) == 1, found
    assert calls[0].startswith(
        '[dsh:example-calls] plugin "deaf-ask-long-grace", tool "gated": examples[0] {"x": 1}: '
        "the call did not return within 0.2 s: it was waiting for the answer to an approval "
        "ask, which never came, so the body never ran (it was still running 0.7 s after its "
        "signal was aborted, and was cancelled)\n"
    ), calls[0]


@pytest.mark.parametrize("check", ["check_example_calls", "check_dispose"])
def test_a_call_whose_body_waits_on_a_nested_call_in_its_ask_is_blamed_on_its_body_not_on_an_ask(
    fixture_plugins: None, check: str
) -> None:
    """The body of the kit's call makes a call of its own (call id "inner"), which waits in its approval ask: the
    nested call's ask marked the kit's call as asking (the watch is in the context the nested call inherits), and the
    kit said the kit's call waited for an approval ask "so the body never ran", with the channel's fix, though the
    body ran and is what ignores the abort. Only the call's own ask marks it."""
    name = _check_id(check)
    found = _bounded(check, Target("nested-ask"))
    (outer,) = _call_failures(found, name, "nested-ask", "outer")
    assert outer.startswith(
        f'[dsh:{name}] plugin "nested-ask", tool "outer": examples[0] {{"x": 1}}: the call did '
        "not return within 0.2 s: it was held by its body, which had not returned (it was still running "
        "0.2 s after its signal was aborted, and was cancelled)\n    fix: return promptly or honour ctx.signal"
    ), outer
    assert "approval ask" not in outer and "never ran" not in outer, outer


def test_the_options_defaults_and_help_are_the_kits_constants() -> None:
    """The pytest plugin imports dsh lazily, so it writes the abort bound's and the call limit's defaults as literals:
    they must stay the kit's own (``ABORT_BOUND_S``, ``CALL_TIMEOUT_S``), as every other place takes them."""
    from dsh_core.testing import conformance, pytest_plugin

    options: dict[str, dict[str, Any]] = {}
    group = SimpleNamespace(addoption=lambda name, **kwargs: options.__setitem__(name, kwargs))
    pytest_plugin.pytest_addoption(SimpleNamespace(getgroup=lambda *args: group))  # type: ignore[arg-type]
    bound, limit = options["--dsh-conformance-abort-bound"], options["--dsh-conformance-call-timeout"]
    assert bound["default"] == checks.ABORT_BOUND_S
    assert f"(default {checks.ABORT_BOUND_S:g})" in bound["help"]
    assert limit["default"] is None and f"(default {checks.CALL_TIMEOUT_S:g})" in limit["help"]
    assert Target("x").abort_bound_s == conformance.ToolPluginConformance.abort_bound_s == checks.ABORT_BOUND_S


#: A time the kit measured, as it prints it (two decimals), captured for :func:`_assert_timed` to bound: the fixtures
#: block the loop for 0.6 s, and a loaded machine measures more (never less).
MEASURED = r"(\d+\.\d\d)"


def _assert_timed(expected: str, failures: list[str]) -> None:
    """Each of ``failures`` matches ``expected`` in full, and each time it captured (:data:`MEASURED`) is at least the
    fixtures' 0.6 s and under a generous 5 s: what a loaded machine adds to a measured time must not fail the test."""
    for text in failures:
        match = re.fullmatch(expected, text)
        assert match is not None, (expected, text)
        assert match.groups(), expected  # a message with no time in it is matched exactly elsewhere
        for seconds in match.groups():
            assert 0.6 <= float(seconds) < 5, (seconds, text)


#: What the kit says of a call held by its tool's finalize_content, which blocked the event loop (a regular expression:
#: the seconds it blocked for vary), and its fix.
FINALIZE_HELD = (
    rf"it was held by the tool's finalize_content, which blocked the event loop for {MEASURED} s \(dsh calls it "
    r"synchronously, once the call's result is settled\)"
)
FINALIZE_FIX = (
    "finalize_content runs on the event loop and is never awaited: make it a quick transform of the result's "
    "content (no sleeping, blocking I/O or waiting on locks or threads); do slow work in the body, where it can be "
    "awaited and aborted"
)


@pytest.mark.parametrize("check", CALLING_CHECKS)
def test_a_call_held_by_a_finalize_content_that_blocks_the_loop_names_it(fixture_plugins: None, check: str) -> None:
    """The body returns at once; the tool's finalize_content (synchronous, run after post-execute, for a call aborted
    before dispatch too) then blocks the event loop for 0.6 s, past the abort bound and the call limit. The abort check
    said the body kept the event loop busy, and told the author to fix the body; the checks that bound each call
    reported nothing, the loop being blocked past their limit (their timeout only fires once it is free again, and the
    call had returned by then). finalize_content is named, with how long it blocked the loop."""
    name = _check_id(check)
    plugin = "held-by-finalize-content"
    found = _bounded(check, Target(plugin, abort_bound_s=0.1))
    lead = _lead(name, plugin, "finalized")
    if name == "abort":
        expected = lead + rf"the call returned {MEASURED} s after its body \(bound: 0\.1 s\): {FINALIZE_HELD}"
    elif name == "pre-abort":
        expected = lead + rf"the call aborted before dispatch did not return within 0\.2 s: {FINALIZE_HELD}"
    else:
        expected = _past_limit(name, plugin, "finalized") + FINALIZE_HELD
    expected += r" \(it returned then\)" if name != "abort" else ""
    expected += rf"\n    fix: {re.escape(FINALIZE_FIX)}"
    calls = _each_call(found, name, plugin, "finalized")
    _assert_timed(expected, calls)
    assert not any(blame in f for f in calls for blame in BODY_BLAME), found


@pytest.mark.parametrize("check", CALLING_CHECKS)
def test_a_finalize_content_that_blocks_the_loop_is_named_though_a_result_observer_then_awaits(
    fixture_plugins: None, check: str
) -> None:
    """The tool's finalize_content blocks the event loop for 0.6 s; a correct result observer then awaits 0.05 s.
    The kit's timeout fired once the loop was free, in that observer: the call had not returned, so it took the
    stuck-call path, which blamed the stages after the body (0.05 s of awaiting) and never named finalize_content,
    what kept the call past the limit. Every check gives the stage after it the grace a stuck call gets, before
    aborting it (the call-limit checks aborted it at once, and said it returned "once its signal was aborted", with
    the larger-limit hint), and reports exactly what it reports of a call held by finalize_content that returned."""
    name = _check_id(check)
    plugin = "finalize-then-brief-observer"
    found = _bounded(check, Target(plugin, abort_bound_s=0.1))
    lead = _lead(name, plugin, "finalized")
    if name == "abort":
        expected = lead + rf"the call returned {MEASURED} s after its body \(bound: 0\.1 s\): {FINALIZE_HELD}"
    elif name == "pre-abort":
        expected = (
            lead
            + rf"the call aborted before dispatch did not return within 0\.2 s: {FINALIZE_HELD} \(it returned then\)"
        )
    else:
        expected = _past_limit(name, plugin, "finalized") + rf"{FINALIZE_HELD} \(it returned then\)"
    expected += rf"\n    fix: {re.escape(FINALIZE_FIX)}"
    calls = _each_call(found, name, plugin, "finalized")
    _assert_timed(expected, calls)


#: What the kit says of the stage after finalize_content (only the result observers run then), and its fix.
AFTER_FINALIZE = "by a result observer (dsh_tool_result)"
AFTER_FINALIZE_FIX = (
    "make result observers (dsh_tool_result) return promptly, and end when the call is aborted or cancelled"
)


@pytest.mark.parametrize("check", CALLING_CHECKS)
def test_a_finalize_content_that_blocks_the_loop_then_a_result_observer_that_holds_the_call_are_both_named(
    fixture_plugins: None, check: str
) -> None:
    """The tool's finalize_content blocks the event loop for 0.6 s; a result observer then awaits 30 s, deaf to the
    abort. Both held the call: finalize_content past the limit (the kit's timeout could not fire), the observer for
    good. The kit blamed the stages after the body; it names finalize_content first, then says the call was held
    after it, by a result observer (the only stage after it), with both fixes."""
    name = _check_id(check)
    plugin = "finalize-then-held-by-observer"
    found = _bounded(check, Target(plugin, abort_bound_s=0.1))
    lead = _lead(name, plugin, "finalized")
    then = re.escape(
        f"its finalize_content had returned, but the call was then held after it ({AFTER_FINALIZE}), still running "
    )
    fix = f"{FINALIZE_FIX}; and {AFTER_FINALIZE_FIX}"
    if name == "abort":
        expected = (
            lead
            + rf"the call, aborted as its body began, did not return within 0\.3 s: {FINALIZE_HELD}; {then}0\.2 s "
            + r"later \(it was cancelled then\)"
        )
    elif name == "pre-abort":
        expected = (
            lead
            + rf"the call aborted before dispatch did not return within 0\.2 s: {FINALIZE_HELD}; {then}0\.2 s "
            + r"later \(it was cancelled then\)"
        )
        fix += LARGER_LIMIT
    else:
        # The observer had the grace before the abort too: 0.4 s once the loop was free, not the 0.2 s after the abort.
        expected = (
            _past_limit(name, plugin, "finalized")
            + rf"{FINALIZE_HELD} \({then}0\.4 s after the event loop was free and 0\.2 s after the abort, and was "
            + r"cancelled\)"
        )
        fix += LARGER_LIMIT
    expected += rf"\n    fix: {re.escape(fix)}"
    calls = _each_call(found, name, plugin, "finalized")
    _assert_timed(expected, calls)


@pytest.mark.parametrize(
    "plugin", ["blocks-then-blocking-finalize", "blocks-then-blocking-finalize-then-brief-observer"]
)
@pytest.mark.parametrize("check", BODY_CHECKS)
def test_a_body_and_a_finalize_content_that_both_block_the_loop_are_both_named(
    fixture_plugins: None, check: str, plugin: str
) -> None:
    """The body blocks the event loop for 0.6 s and returns; the tool's finalize_content then blocks it for 0.6 s
    more (with a correct result observer awaiting 0.05 s after it, or not). Each alone kept the call past the limit
    and the bound, and each has its own fix, but the kit named only finalize_content (the abort check only the
    body). Both are named, each with how long it blocked the loop, with both fixes. The observer after them is given
    the grace of a stuck call before the call-limit checks abort the call (they aborted it at once, and said it
    returned "once its signal was aborted", with the larger-limit hint): the call is reported as returned, either way
    alike."""
    name = _check_id(check)
    found = _bounded(check, Target(plugin, abort_bound_s=0.1))
    lead = _lead(name, plugin, "finalized")
    if name == "abort":
        expected = lead + (
            rf"the body kept the event loop busy for {MEASURED} s without awaiting, so the abort could not even be "
            rf"delivered \(bound: 0\.1 s\); then {FINALIZE_HELD}"
        )
    else:
        by_finalize = FINALIZE_HELD.removeprefix("it was held ")
        expected = (
            _past_limit(name, plugin, "finalized") + rf"{BLOCKING_BODY_HELD}, and {by_finalize} \(it returned then\)"
        )
    expected += rf"\n    fix: {re.escape(f'{BLOCKING_BODY_FIX}; and {FINALIZE_FIX}')}"
    calls = _each_call(found, name, plugin, "finalized")
    _assert_timed(expected, calls)


#: What the kit says of a call held by its body, which blocked the event loop without awaiting (a regular expression:
#: the seconds it blocked for vary), and the fix the abort check and the call-limit checks both give for it.
BLOCKING_BODY_HELD = (
    rf"it was held by its body, which blocked the event loop for {MEASURED} s without awaiting \(blocking work in "
    r"async def: time\.sleep, blocking I/O, subprocess\.run\)"
)
BLOCKING_BODY_FIX = (
    "await instead of blocking: run blocking work with await asyncio.to_thread(...) or in an executor "
    "(loop.run_in_executor), processes with asyncio.create_subprocess_exec, and watch ctx.signal"
)


@pytest.mark.parametrize("check", CALLING_CHECKS)
def test_a_call_held_by_a_body_that_blocks_the_loop_names_it(fixture_plugins: None, check: str) -> None:
    """The body blocks the event loop for 0.6 s (time.sleep in async def), past the abort bound and the call limit,
    then returns. Only the abort check said so: the checks that bound each call reported nothing, their timeout
    firing only once the loop was free again, when the call had returned. Each names the body, with how long it
    blocked the loop, and hands the result back as before (so reports nothing else); the abort check's report is
    the one it gave, with the same fix. A call aborted before dispatch runs no body: nothing to report."""
    _assert_blocked_then_returned(check, "held-by-blocking-body")


def _assert_blocked_then_returned(check: str, plugin: str) -> None:
    """``check`` run on ``plugin``, whose tool's body blocks the event loop for 0.6 s and whose call then returns
    (abort bound 0.1 s, call limit 0.2 s), reports that body as one that blocked past them, and its call as returned
    (the abort check: the abort could not even be delivered), with the fix for blocking work alone; the pre-abort
    check, whose call runs no body, nothing."""
    name = _check_id(check)
    found = _bounded(check, Target(plugin, abort_bound_s=0.1))
    if name == "pre-abort":
        assert found == [], found
        return
    lead = _lead(name, plugin, "blocked")
    if name == "abort":
        expected = lead + (
            rf"the body kept the event loop busy for {MEASURED} s without awaiting, so the abort could not even be "
            r"delivered \(bound: 0\.1 s\)"
        )
    else:
        expected = _past_limit(name, plugin, "blocked") + rf"{BLOCKING_BODY_HELD} \(it returned then\)"
    expected += rf"\n    fix: {re.escape(BLOCKING_BODY_FIX)}"
    calls = _each_call(found, name, plugin, "blocked")
    _assert_timed(expected, calls)


@pytest.mark.parametrize("check", LIMIT_CHECKS)
def test_a_body_that_awaits_past_its_blocks_is_not_blamed_for_blocking_the_loop(
    fixture_plugins: None, check: str
) -> None:
    """The body awaits 0.15 s (the loop runs on), then blocks it for 0.1 s and returns: 0.25 s in all, past the
    0.2 s call limit, but the loop was never blocked that long at a stretch, so the kit's timeout was never kept
    from firing by it. How long the body held the loop without awaiting is what is measured, not how long it ran:
    the call-limit checks report nothing of it."""
    found = _bounded(check, Target("awaits-then-blocks-briefly"))
    assert found == [], found


def test_a_synchronous_execute_is_reported_as_the_runtime_reports_it(fixture_plugins: None) -> None:
    """The tool's execute is a plain def returning a dict. Outside the kit the runtime fails the call naming the tool
    and the fix (its execute returned dict, not an awaitable); under the kit the spy's own ``await`` raised first,
    so the kit reported Python's bare "object dict can't be used in 'await' expression" (and, in typed-errors, an
    untyped TypeError the body never raised). The spy must not change what it observes: the kit reports the
    runtime's own result for the same call."""
    from dsh_core.hooks import Hooks
    from dsh_core.model import ToolExecutionInput
    from dsh_core.testing.loader import make_root
    from tests.fixtures.conformance import broken_plugins

    async def outside_the_kit() -> ToolResult:
        root, registry, runtime = make_root(Hooks())
        registry.register(broken_plugins.SyncExecute().definition())
        try:
            return await runtime.execute(ToolExecutionInput(call_id="c", name="sync", arguments={"x": 1}))
        finally:
            await root.dispose()

    own = asyncio.run(outside_the_kit())
    assert own.code == "TOOL_FAILED" and own.error is not None
    assert "its execute returned dict, not an awaitable" in own.error.message, own.error.message
    found = _bounded("check_example_calls", Target("sync-execute"))
    assert found == [
        '[dsh:example-calls] plugin "sync-execute", tool "sync": examples[0] {"x": 1}: it returned error '
        f"TOOL_FAILED: {own.error.message}\n    fix: examples must succeed when called in registration order in a "
        "fresh config (the kit gives workspace-like plugins an empty temporary root) and return values matching "
        "output_schema"
    ], found
    # The runtime's refusal is a typed error of its own, not one the body raised.
    assert _bounded("check_typed_errors", Target("sync-execute")) == []


#: The fix of a call held by its body (it did not return), and the end of every fix of a call the call-limit checks
#: had to abort.
BODY_FIX = (
    "return promptly or honour ctx.signal (ctx.signal.add_listener or await ctx.signal.wait()) and stop waiting on "
    "what never ends"
)
LARGER_LIMIT = (
    "; a call that is slow on purpose needs a larger limit (call_timeout_s in your subclass, "
    "--dsh-conformance-call-timeout)"
)


@pytest.mark.parametrize("check", CALLING_CHECKS)
def test_a_body_that_blocks_the_loop_then_awaits_on_is_named_for_blocking_it(fixture_plugins: None, check: str) -> None:
    """The body blocks the event loop for 0.6 s (past the abort bound and the call limit), then awaits 30 s, deaf to
    its signal. The kit's timeout fired only once the loop was free, and the call, still running, took the stuck-call
    path, which said only that the body had not returned: the blocking, what kept the timeout from firing, went
    unnamed. The verdict names both, and both fixes. A call aborted before dispatch runs no body: nothing to report."""
    name = _check_id(check)
    plugin = "blocks-then-awaits"
    found = _bounded(check, Target(plugin, abort_bound_s=0.1))
    if name == "pre-abort":
        assert found == [], found
        return
    lead = _lead(name, plugin, "blocked")
    fix = f"{BLOCKING_BODY_FIX}; and {BODY_FIX}"
    if name == "abort":
        expected = lead + (
            rf"the call, aborted as its body began, did not return within 0\.3 s: {BLOCKING_BODY_HELD}, and had "
            r"not returned \(it was cancelled then\)"
        )
    else:
        expected = (
            _past_limit(name, plugin, "blocked") + rf"{BLOCKING_BODY_HELD}, and had not returned \(it was still "
            r"running 0\.4 s after the event loop was free and 0\.2 s after its signal was aborted, and was "
            r"cancelled\)"
        )
        fix += LARGER_LIMIT
    expected += rf"\n    fix: {re.escape(fix)}"
    calls = _each_call(found, name, plugin, "blocked")
    _assert_timed(expected, calls)


@pytest.mark.parametrize("check", LIMIT_CHECKS)
def test_a_body_that_blocks_the_loop_then_returns_once_aborted_is_said_to_have_had_the_grace_first(
    fixture_plugins: None, check: str
) -> None:
    """The body blocks the event loop for 0.6 s, then awaits its signal's abort and returns. Once the loop was free
    the call-limit checks give the call the grace of a stuck call, then abort it: the verdict said only that it
    "returned once its signal was aborted", as if it had been aborted as soon as the loop was free. It says the call
    was still running the grace later, and returned once then aborted."""
    name = _check_id(check)
    plugin = "blocks-then-until-aborted"
    found = _bounded(check, Target(plugin))
    expected = (
        _past_limit(name, plugin, "blocked") + rf"{BLOCKING_BODY_HELD}, and had not returned \(it was still "
        r"running 0\.2 s after the event loop was free, and returned once its signal was then aborted\)"
        + rf"\n    fix: {re.escape(f'{BLOCKING_BODY_FIX}; and {BODY_FIX}{LARGER_LIMIT}')}"
    )
    _assert_timed(expected, _each_call(found, name, plugin, "blocked"))


@pytest.mark.parametrize("check", CALLING_CHECKS)
def test_a_body_that_blocks_the_loop_then_awaits_briefly_is_reported_as_returned(
    fixture_plugins: None, check: str
) -> None:
    """The body blocks the event loop for 0.6 s (past the abort bound and the call limit), then awaits 0.05 s and
    returns. The kit's timeout fired once the loop was free, in that await, and the call took the stuck-call path at
    once: the verdict said the body had not returned and added the fix for a body deaf to ctx.signal, and the abort
    check cancelled the call. Its stuck-call grace is given first, as to a stage after a blocking one: the call
    returns in it, and is reported exactly as a body that blocked and then returned. A call aborted before dispatch
    runs no body: nothing to report."""
    _assert_blocked_then_returned(check, "blocks-then-brief-await")


@pytest.mark.parametrize("check", BODY_CHECKS)
def test_a_body_that_blocks_the_loop_is_named_though_the_call_is_past_it_when_the_timeout_fires(
    fixture_plugins: None, check: str
) -> None:
    """The body blocks the event loop for 0.6 s and returns; a post-execute hook then awaits 0.05 s. The kit's timeout
    fired once the loop was free, in that hook, and the kit blamed the stages after the body, which had returned:
    those took 0.05 s. The body's blocking is what kept the call past the limit, and is named. Every check gives the
    hook the grace of a stuck call before aborting the call (the call-limit checks aborted it at once, and said it
    returned "once its signal was aborted", with the larger-limit hint), and reports exactly what it reports of a
    body that blocked and whose call returned."""
    _assert_blocked_then_returned(check, "blocks-then-brief-post-execute")


@pytest.mark.parametrize(
    "plugin", ["blocks-then-held-by-post-execute", "blocks-then-brief-await-then-held-by-post-execute"]
)
@pytest.mark.parametrize("check", BODY_CHECKS)
def test_a_body_that_blocks_the_loop_then_a_stage_after_it_that_holds_the_call_are_both_named(
    fixture_plugins: None, check: str, plugin: str
) -> None:
    """The body blocks the event loop for 0.6 s and returns (at once, or after awaiting 0.05 s); a post-execute hook
    then awaits 30 s, deaf to the abort. Both held the call: the body past the limit (the kit's timeout could not
    fire), the hook for good. The kit named only the hook (the abort check only the body); it names the body first,
    then says its body had returned before the call was held after it (not "once its signal was aborted": it had
    returned before the kit could abort it), with both fixes. A body that awaits once it freed the loop is given the
    grace of a stuck call first, so what held the call is judged once it has returned: the kit said it had not."""
    name = _check_id(check)
    found = _bounded(check, Target(plugin, abort_bound_s=0.1))
    lead = _lead(name, plugin, "blocked")
    then = f"its body had returned, but the call was then held after it ({AFTER_BODY}), still running"
    fix = f"{BLOCKING_BODY_FIX}; and {AFTER_FIX}"
    if name == "abort":
        expected = (
            lead
            + rf"the call, aborted as its body began, did not return within 0\.3 s: {BLOCKING_BODY_HELD}; "
            + re.escape(f"{then} 0.2 s later (it was cancelled then)")
        )
    else:
        # The hook had the grace before the abort too: 0.4 s once the loop was free, not the 0.2 s after the abort.
        expected = (
            _past_limit(name, plugin, "blocked")
            + rf"{BLOCKING_BODY_HELD} "
            + re.escape(f"({then} 0.4 s after the event loop was free and 0.2 s after the abort, and was cancelled)")
        )
        fix += LARGER_LIMIT
    expected += rf"\n    fix: {re.escape(fix)}"
    calls = _each_call(found, name, plugin, "blocked")
    _assert_timed(expected, calls)


def test_the_abort_check_names_a_body_that_blocks_the_loop_once_the_abort_is_delivered(fixture_plugins: None) -> None:
    """The body awaits first (the abort, requested as the body is entered, is delivered at that suspension), then
    blocks the event loop for 0.6 s and returns. The abort check measured only the body's first step, so it said the
    body returned late and told the author to watch ctx.signal: a body blocked in time.sleep can watch nothing, and
    no listener, cancellation or timer can act on it meanwhile. The longest step after the delivery is measured too,
    and the blocking named, with the fix for it."""
    found = _bounded("check_abort", Target("awaits-then-blocks", abort_bound_s=0.1))
    expected = (
        re.escape('[dsh:abort] plugin "awaits-then-blocks", tool "blocked": ')
        + rf"the body kept the event loop busy for {MEASURED} s without awaiting after the abort was delivered, so "
        + r"nothing could stop it meanwhile \(bound: 0\.1 s\)"
        + rf"\n    fix: {re.escape(BLOCKING_BODY_FIX)}"
    )
    assert len(found) == 1, found
    _assert_timed(expected, found)


def _thrown(timed: bool, *args: Any) -> tuple[Any, ...]:
    """What ``throw(*args)`` does to a body suspended at its first await: thrown into the coroutine itself, or into
    the spy's ``_TimedSteps`` driving it. The body's outcome (what it caught: type, args, where its traceback runs),
    or what ``throw`` raised."""
    from dsh_core.testing.loader import BodyRun, _TimedSteps

    async def body() -> Any:
        try:
            await asyncio.sleep(0)
        except BaseException as error:
            where = []
            trace = error.__traceback__
            while trace is not None:
                where.append((trace.tb_frame.f_code.co_name, trace.tb_lineno))
                trace = trace.tb_next
            return ("caught", type(error).__name__, error.args, where)
        return "resumed"

    coroutine = body()
    steps: Any = _TimedSteps(coroutine, BodyRun("c")) if timed else coroutine
    steps.send(None)
    try:
        steps.throw(*args)
    except StopIteration as stop:
        return ("returned", stop.value)
    except BaseException as error:
        return ("raised", type(error).__name__, str(error))
    finally:
        steps.close()
    return ("suspended",)


def test_the_spy_throws_into_a_body_as_a_coroutine_does_in_every_form() -> None:
    """The spy drives the body's coroutine for the runtime, so ``throw`` must do what the coroutine's own does. It
    built the exception itself, from the class alone: ``throw(ValueError, "boom")`` and ``throw(ValueError, ("a",
    "b"))`` raised TypeError instead of throwing ``ValueError("boom")`` and ``ValueError("a", "b")`` into the body,
    and ``throw(instance, value)`` gave another TypeError message than Python's. Each form is compared with the
    coroutine's own; the one-argument form asyncio uses must not trigger the deprecation of the others (3.12+)."""
    import warnings

    try:
        raise KeyError("where")
    except KeyError as error:
        trace = error.__traceback__
    # Made afresh for each throw: an exception thrown carries its traceback on to the next.
    forms: list[Callable[[], tuple[Any, ...]]] = [
        lambda: (ValueError,),
        lambda: (ValueError("x"),),
        lambda: (ValueError, "boom"),
        lambda: (ValueError, ("a", "b")),
        lambda: (ValueError, ValueError("v")),
        lambda: (ValueError, None),
        lambda: (ValueError("i"), "v"),
        lambda: (ValueError, "v", trace),
        lambda: (ValueError("i"), None, trace),
        lambda: (ValueError, "v", "not a traceback"),
        lambda: ("not an exception",),
        lambda: (GeneratorExit,),
        lambda: (asyncio.CancelledError("why"),),
    ]
    for form in forms:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the multi-argument forms, in both
            assert _thrown(True, *form()) == _thrown(False, *form()), form()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outcome = _thrown(True, asyncio.CancelledError("why"))
    assert outcome[0] == "returned" and outcome[1][:3] == ("caught", "CancelledError", ("why",)), outcome


def test_a_suspended_body_the_spy_runs_closes_as_the_body_itself_does() -> None:
    """A body suspended in an await is closed (its coroutine's ``close()``: the runtime or a middleware drops the
    call, or the loop shuts down). The spy took the GeneratorExit close throws in for a body raising a
    BaseException, and raised BodyExited in its place, so ``close()`` raised it (RuntimeError for a generator that
    ignores GeneratorExit, in effect) and the code closing the call went on as if the body had failed. GeneratorExit
    passes through unchanged: ``close()`` returns, the body's ``finally`` having run, as when the body is closed
    itself."""
    from dsh_core import define_tool
    from dsh_core.testing.loader import ToolSpy
    from tests.fixtures.conformance.broken_plugins import OBJECT

    cleaned: list[str] = []

    async def execute(arguments: Any, context: Any) -> Any:
        try:
            await asyncio.sleep(0)  # suspends (no loop needed)
        finally:
            cleaned.append(context.call_id)
        return arguments

    own = execute({"x": 1}, SimpleNamespace(call_id="own"))
    own.send(None)
    own.close()  # the body alone: close() returns
    spy = ToolSpy(define_tool(name="t", description="d", parameters=OBJECT, execute=execute))
    call: Any = spy.execute({"x": 1}, SimpleNamespace(call_id="spied"))  # type: ignore[arg-type]
    call.send(None)
    call.close()
    assert cleaned == ["own", "spied"]
    assert spy.runs[0].ended
