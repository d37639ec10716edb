"""Plugin discovery, loading and start-up; deployments booted from config rows."""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any

import pytest

from dsh_core import hookimpl, plugin
from dsh_core.config import compose
from dsh_core.errors import ConfigError, PluginLoadError, RegistrationError
from dsh_core.harness import Harness, NamedRegistry
from dsh_core.plugins import ENTRY_POINT_GROUP, PluginCatalog
from dsh_core.scope import Scope
from tests.core import sample_plugins

pytestmark = pytest.mark.anyio


def ep(name: str, value: str) -> metadata.EntryPoint:
    return metadata.EntryPoint(name, value, ENTRY_POINT_GROUP)


def catalog(strict: bool = False, reports: list[str] | None = None) -> PluginCatalog:
    return PluginCatalog(
        entry_points=[
            ep("echo", "tests.core.sample_plugins:echo"),
            ep("deny", "tests.core.sample_plugins:deny"),
            ep("half-broken", "tests.core.sample_plugins:half_broken"),
            ep("broken", "tests.core.broken_plugin:plugin"),
            ep("async-factory", "tests.core.sample_plugins:async_factory"),
        ],
        strict=strict,
        report=(reports.append if reports is not None else None),
    )


def deployment(*documents: dict[str, Any], env: dict[str, str] | None = None) -> Any:
    return compose([(f"file{i}.toml", doc) for i, doc in enumerate(documents, 1)], env=env or {})


async def test_rows_become_plugin_instances_with_their_own_scope_and_config() -> None:
    dep = deployment(
        {
            "plugins": [
                {"id": "a", "use": "echo", "config": {"tool": "alpha"}},
                {"id": "b", "use": "echo", "config": {"tool": "beta"}},
                {"id": "policy", "use": "deny", "config": {"names": ["beta"]}},
            ]
        }
    )
    harness = await Harness.start(dep, catalog=catalog())
    try:
        assert harness.registry.names(harness.agent()) == ["alpha", "beta"]
        assert (await harness.call("alpha", {"text": "hi"})).value == {"said": "hi", "by": "alpha"}
        denied = await harness.call("beta", {})
        assert denied.code == "DENIED" and "denied by config" in denied.text
        await harness.plugins["b"].dispose()
        assert harness.registry.names(harness.agent()) == ["alpha"]
    finally:
        await harness.aclose()
    assert harness.root.disposed
    assert harness.registry.names() == []
    assert not harness.hooks.has_plugin("policy")


async def test_the_plugin_config_is_validated_against_its_schema_naming_file_row_and_path() -> None:
    dep = deployment({"plugins": [{"id": "policy", "use": "deny", "config": {"names": [1], "extra": True}}]})
    with pytest.raises(ConfigError) as caught:
        await Harness.start(dep, catalog=catalog())
    text = str(caught.value)
    assert "plugins[policy].config.names[0]" in text and "file1.toml" in text
    assert "extra" in text


def test_a_declared_config_schema_is_a_snapshot_the_callers_dict_cannot_change() -> None:
    """plugin() kept a shallow copy: a change to a nested part of the caller's dict changed what was accepted."""
    from dsh_core import plugin
    from dsh_core.harness import load_plugins
    from dsh_core.plugins import config_schema_of

    schema: dict[str, Any] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "limits": {"type": "object", "additionalProperties": False, "properties": {"rps": {"type": "integer"}}}
        },
    }

    @plugin(config_schema=schema)
    def make(scope: Any, config: Any) -> None:
        return None

    schema["properties"]["limits"]["properties"]["rps"] = {"type": "string"}
    schema["properties"]["limits"]["additionalProperties"] = True
    schema["additionalProperties"] = True
    assert config_schema_of(make)["properties"]["limits"]["properties"]["rps"] == {"type": "integer"}
    dep = deployment({"plugins": [{"id": "lim", "use": "lim", "config": {"limits": {"rps": "5", "burst": 1}}}]})
    with pytest.raises(ConfigError) as caught:
        load_plugins(dep, PluginCatalog(entry_points=[], extra={"lim": make}))
    assert caught.value.message.splitlines() == [
        "plugins[lim].config.limits.burst: unknown key (allowed: rps) (from file1.toml)",
        "plugins[lim].config.limits.rps: '5' is not of type 'integer' (from file1.toml)",
    ]


def test_an_invalid_declared_config_schema_is_refused_naming_the_factory() -> None:
    """The declaration check said only "plugin config schema", naming no plugin."""
    from dsh_core import plugin
    from dsh_core.errors import SchemaDefinitionError

    expected = (
        r"plugin factory \S*test_plugins\.test_an_invalid_declared_config_schema_is_refused_"
        r"naming_the_factory\.<locals>\.{name} config schema: {problem}"
    )
    with pytest.raises(
        SchemaDefinitionError, match=expected.format(name="make", problem=r"invalid JSON Schema at /properties/x/type")
    ):

        @plugin(config_schema={"type": "object", "properties": {"x": {"type": "integr"}}})
        def make(scope: Any, config: Any) -> None:
            return None

    with pytest.raises(
        SchemaDefinitionError, match=expected.format(name="dangling", problem=r"unresolvable \$ref '#/\$defs/nope'")
    ):

        @plugin(config_schema={"type": "object", "properties": {"x": {"$ref": "#/$defs/nope"}}})
        def dangling(scope: Any, config: Any) -> None:
            return None


async def test_an_unknown_use_is_a_clear_error() -> None:
    dep = deployment({"plugins": [{"id": "x", "use": "nonexistent"}]})
    with pytest.raises(ConfigError, match=r"file1.toml: plugins\[x\].use: unknown plugin 'nonexistent'"):
        await Harness.start(dep, catalog=catalog())


async def test_every_unknown_use_and_every_failed_import_is_named_at_once() -> None:
    # The first unknown row used to end the boot alone: a deployment with three mistyped rows took three tries.
    dep = deployment(
        {
            "plugins": [
                {"id": "g1", "use": "ghost-one"},
                {"id": "e", "use": "echo"},
                {"id": "b", "use": "broken"},
                {"id": "g2", "use": "ghost-two"},
            ]
        }
    )
    with pytest.raises(ConfigError) as caught:
        await Harness.start(dep, catalog=catalog())
    lines = caught.value.message.splitlines()
    assert [line.split(": ", 2)[1] for line in lines] == ["plugins[g1].use", "plugins[b].use", "plugins[g2].use"]
    assert lines[0].startswith("file1.toml: plugins[g1].use: unknown plugin 'ghost-one' (known: ")
    assert lines[1].startswith("file1.toml: plugins[b].use: plugin 'broken' (tests.core.broken_plugin:plugin)")
    assert lines[2].startswith("file1.toml: plugins[g2].use: unknown plugin 'ghost-two' (known: ")


@pytest.mark.parametrize("strict", [False, True])
async def test_a_configured_plugin_that_fails_to_load_fails_the_boot_naming_file_row_and_error(
    strict: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never skipped (a missing guard would fail open), never misreported as "takes no config"; imported once."""
    imports: list[str] = []
    real_load = metadata.EntryPoint.load

    def counting_load(self: metadata.EntryPoint) -> Any:
        imports.append(self.name)
        return real_load(self)

    monkeypatch.setattr(metadata.EntryPoint, "load", counting_load)
    reports: list[str] = []
    dep = deployment(
        {
            "plugins": [
                {"id": "e", "use": "echo"},
                {"id": "guard-a", "use": "broken", "config": {"deny_paths": ["**/.env"]}},
                {"id": "guard-b", "use": "broken"},
            ]
        }
    )
    with pytest.raises(PluginLoadError) as caught:
        await Harness.start(dep, catalog=catalog(strict=strict, reports=reports))
    lines = caught.value.message.splitlines()
    assert len(lines) == 2
    for line, row in zip(lines, ["guard-a", "guard-b"], strict=True):
        assert line.startswith(
            f"file1.toml: plugins[{row}].use: plugin 'broken' (tests.core.broken_plugin:plugin)"
            " failed to load: ImportError: this plugin is broken on purpose"
        )
    assert "takes no config" not in caught.value.message
    assert imports.count("broken") == 1
    assert reports == []


async def test_a_failing_start_leaves_nothing_half_registered() -> None:
    loaded = importlib.import_module("tests.core.sample_plugins")  # the module the entry point loads
    loaded.DISPOSED.clear()
    dep = deployment({"plugins": [{"id": "ok", "use": "echo"}, {"id": "hb", "use": "half-broken"}]})
    with pytest.raises(PluginLoadError, match=r"plugin row 'hb'.*tool \"first\" is already registered"):
        await Harness.start(dep, catalog=catalog())
    assert loaded.DISPOSED == ["half_broken"]


@pytest.mark.parametrize("mode", ["native", "code"])
async def test_a_plugin_registering_run_code_fails_the_boot_and_the_transport_stays_the_cores(mode: str) -> None:
    """No plugin can register, shadow or replace the reserved transport, in any mode: its start fails."""
    dep = deployment(
        {
            "tools": {"mode": mode},
            "plugins": [{"id": "ok", "use": "echo"}, {"id": "usurper", "use": "echo", "config": {"tool": "run_code"}}],
        }
    )
    with pytest.raises(
        PluginLoadError,
        match=r"plugin row 'usurper' .*failed to start: tool name \"run_code\" is "
        r"reserved for the Code Mode presentation transport",
    ):
        await Harness.start(dep, catalog=catalog())


async def test_a_plugin_that_calls_sys_exit_fails_the_boot_instead_of_ending_the_process() -> None:
    """sys.exit(0) in a plugin's import or start escaped the harness: `dsh tools list` exited 0, printing nothing."""
    loaded = importlib.import_module("tests.core.sample_plugins")
    loaded.DISPOSED.clear()
    plugins = PluginCatalog(
        entry_points=[
            ep("exit-on-import", "tests.core.exiting_plugin:plugin"),
            ep("exit-on-start", "tests.core.sample_plugins:exiting"),
        ]
    )
    dep = deployment({"plugins": [{"id": "guard", "use": "exit-on-import"}]})
    with pytest.raises(
        PluginLoadError,
        match=r"file1.toml: plugins\[guard\].use: plugin 'exit-on-import' "
        r"\(tests.core.exiting_plugin:plugin\) failed to load: "
        r"SystemExit: sys.exit\(0\) was called",
    ):
        await Harness.start(dep, catalog=plugins)
    dep = deployment({"plugins": [{"id": "e", "use": "exit-on-start"}]})
    with pytest.raises(
        PluginLoadError,
        match=r"plugin row 'e' .*failed to start: SystemExit: sys.exit\(0\) was "
        r"called",
    ):
        await Harness.start(dep, catalog=plugins)
    assert loaded.DISPOSED == ["exiting"]


async def test_a_tool_name_two_rows_register_names_both_rows() -> None:
    """The second row's failure named only itself: which row already had the tool was left to guess."""
    dep = deployment(
        {
            "plugins": [
                {"id": "first-echo", "use": "echo", "config": {"tool": "alpha"}},
                {"id": "other", "use": "echo", "config": {"tool": "beta"}},
                {"id": "second-echo", "use": "echo", "config": {"tool": "alpha"}},
            ]
        }
    )
    with pytest.raises(
        PluginLoadError,
        match=r"plugin row 'second-echo' .*failed to start: tool \"alpha\" is "
        r"registered by both plugin row 'first-echo' and plugin row "
        r"'second-echo'",
    ):
        await Harness.start(dep, catalog=catalog())
    # Once its row is gone, the name is free again (and no longer blamed on that row).
    harness = await Harness.start(deployment({"plugins": [{"id": "first-echo", "use": "echo"}]}), catalog=catalog())
    try:
        await harness.plugins["first-echo"].dispose()
        harness.registry.register(sample_plugins._echo("echo"))
        with pytest.raises(RegistrationError) as caught:
            harness._tool_registrar(harness.root.child("plugin:late"), "late")(sample_plugins._echo("echo"))
        assert "first-echo" not in caught.value.message
    finally:
        await harness.aclose()


async def test_an_async_factory_fails_the_boot_instead_of_registering_nothing(recwarn: pytest.WarningsChecker) -> None:
    """An ``async def`` factory's coroutine has no hook implementations: registering it would drop the plugin."""
    dep = deployment({"plugins": [{"id": "e", "use": "echo"}, {"id": "policy", "use": "async-factory"}]})
    with pytest.raises(PluginLoadError) as caught:
        await Harness.start(dep, catalog=catalog())
    text = caught.value.message
    assert "plugin row 'policy'" in text and "'async-factory'" in text
    assert "returned a coroutine" in text and "plain function" in text
    import gc

    gc.collect()
    assert not [w for w in recwarn if "never awaited" in str(w.message)]  # the coroutine was closed


async def test_an_unresolvable_ref_in_a_config_schema_is_a_schema_error_not_a_traceback() -> None:
    from dsh_core.errors import ConfigError, SchemaDefinitionError
    from dsh_core.testing.loader import check_config

    def make(scope: Any, config: Any) -> None:
        return None

    make.config_schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}  # type: ignore[attr-defined]
    dep = deployment({"plugins": [{"id": "q", "use": "q", "config": {"a": 1}}]})
    with pytest.raises(
        SchemaDefinitionError,
        match=r"plugin 'q' \(row 'q'\) config: unresolvable \$ref "
        r"'#/\$defs/nope' at /properties/a/\$ref",
    ):
        await Harness.start(dep, catalog=PluginCatalog(entry_points=[], extra={"q": make}))
    with pytest.raises(ConfigError, match=r"plugin 'q' config schema: unresolvable \$ref"):
        check_config("q", make, {"a": 1})


async def test_a_factory_returning_one_object_for_two_rows_names_both_rows() -> None:
    from tests.core.sample_plugins import DenyPlugin

    shared = DenyPlugin([])
    dep = deployment({"plugins": [{"id": "g1", "use": "shared"}, {"id": "g2", "use": "shared"}]})
    with pytest.raises(
        PluginLoadError,
        match=r"plugin row 'g2' .*failed to start: its factory returned the object "
        r"plugin row 'g1' already uses; a factory must build a new instance",
    ):
        await Harness.start(dep, catalog=PluginCatalog(entry_points=[], extra={"shared": lambda s, c: shared}))


def test_duplicate_entry_point_names_are_an_error() -> None:
    with pytest.raises(PluginLoadError, match=r"duplicate plugin entry-point names.*echo"):
        PluginCatalog(
            entry_points=[ep("echo", "tests.core.sample_plugins:echo"), ep("echo", "tests.core.sample_plugins:deny")]
        )


def test_the_env_variable_adds_uninstalled_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSH_PLUGINS", "local-echo=tests.core.sample_plugins:echo")
    assert "local-echo" in PluginCatalog()
    monkeypatch.setenv("DSH_PLUGINS", ",local-echo=tests.core.sample_plugins:echo, ,")  # empty items are skipped
    assert "local-echo" in PluginCatalog()
    monkeypatch.setenv("DSH_PLUGINS", "garbage")
    with pytest.raises(PluginLoadError, match="name=module:attribute"):
        PluginCatalog()


@pytest.mark.parametrize(
    "spec",
    [
        "a=tests.core.sample_plugins:echo b=tests.core.sample_plugins:deny",  # separated by a space
        "a=tests/core/sample_plugins.py:echo",
        "a=:echo",
        "a=tests.core.sample_plugins:",
        "a=m:f:g",
    ],
)
def test_an_env_entry_that_is_no_module_and_attribute_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    # These passed the check (a ':' somewhere) and failed only when loaded, as
    # "AttributeError: 'NoneType' object has no attribute 'group'", advising to fix the installation.
    monkeypatch.setenv("DSH_PLUGINS", spec)
    with pytest.raises(PluginLoadError) as caught:
        PluginCatalog()
    assert caught.value.message == f"DSH_PLUGINS: {spec!r} is not of the form name=module:attribute"
    monkeypatch.setenv("DSH_PLUGINS", " a = tests.core.sample_plugins : echo ")  # spaces around the parts do
    assert PluginCatalog().load("a") is sample_plugins.echo


def test_a_name_the_env_variable_reuses_is_blamed_on_the_env_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The error named no DSH_PLUGINS and told the user to rename entry points after their distribution."""
    monkeypatch.setenv("DSH_PLUGINS", "mine=tests.core.sample_plugins:echo,mine=tests.core.sample_plugins:deny")
    with pytest.raises(PluginLoadError) as caught:
        PluginCatalog()
    assert (
        "mine: 'mine' (tests.core.sample_plugins:echo from DSH_PLUGINS), "
        "'mine' (tests.core.sample_plugins:deny from DSH_PLUGINS)"
    ) in caught.value.message
    assert "rename the DSH_PLUGINS entry" in caught.value.message
    assert "after their distribution" not in caught.value.message


async def test_agents_from_config_get_modes_and_restrictions() -> None:
    dep = deployment(
        {
            "tools": {"mode": "native"},
            "agents": [{"id": "coder", "mode": "code"}, {"id": "reader", "allow": ["alpha"]}],
            "plugins": [
                {"id": "a", "use": "echo", "config": {"tool": "alpha"}},
                {"id": "b", "use": "echo", "config": {"tool": "beta"}},
            ],
        }
    )
    import attrs

    from dsh_core import define_tool

    async def run(args: Any, ctx: Any) -> Any:
        return {"ran": True}

    transport = define_tool(name="run_code", description="t", parameters={"type": "object"}, execute=run)
    harness = await Harness.start(dep, catalog=catalog(), transport=transport)
    try:
        coder, reader = harness.agent("coder"), harness.agent("reader")
        assert harness.registry.mode_for(coder) == "code"
        assert (await harness.call("alpha", {}, agent=coder)).code == "UNKNOWN_TOOL"
        assert [s.name for s in harness.registry.wire_schemas(coder)] == ["run_code"]
        assert harness.registry.names(reader) == ["alpha"]
        assert (await harness.call("beta", {}, agent=reader)).code == "UNKNOWN_TOOL"
        with pytest.raises(ConfigError, match="unknown agent 'ghost'"):
            harness.agent("ghost")
    finally:
        await harness.aclose()
    assert attrs.has(type(dep))


@pytest.mark.parametrize(
    ("key", "names", "expected"),
    [
        (
            "allow",
            ["alpha", "nope"],
            "file2.toml: agents[reader].allow: names tools this agent does not inherit: nope (known: alpha)",
        ),
        (
            "deny",
            ["ghost"],
            "file2.toml: agents[reader].deny: names tools this agent does not inherit: ghost (known: alpha)",
        ),
        ("allow", ["run_code"], 'file2.toml: agents[reader].allow: "run_code" is reserved transport'),
    ],
)
async def test_an_agent_restriction_error_blames_the_file_and_key_that_set_it(
    key: str, names: list[str], expected: str
) -> None:
    dep = deployment(
        {"agents": [{"id": "reader"}], "plugins": [{"id": "a", "use": "echo", "config": {"tool": "alpha"}}]},
        {"agents": [{"id": "reader", key: names}]},
    )
    with pytest.raises(ConfigError) as caught:
        await Harness.start(dep, catalog=catalog())
    assert caught.value.message.startswith(expected)


async def test_the_tools_mode_env_override_reaches_the_registry() -> None:
    dep = deployment({"plugins": [{"id": "a", "use": "echo"}]}, env={"DSH_TOOLS_MODE": "code"})
    assert dep.tools.mode == "code"
    with pytest.raises(ConfigError, match="DSH_TOOLS_MODE='turbo' must be one of native, code, both"):
        deployment({}, env={"DSH_TOOLS_MODE": "turbo"})


async def test_a_named_registration_on_a_disposed_scope_changes_nothing() -> None:
    """The refused provider is not left behind, so a healthy plugin may still register the name."""
    providers: NamedRegistry[object] = NamedRegistry("provider")
    root = Scope()
    gone = root.child("plugin:p")
    register = providers.registrar(gone, "p")
    await gone.dispose()
    with pytest.raises(RegistrationError, match="cannot register provider 'openai': scope 'root/plugin:p' is disposed"):
        register("openai", object())
    assert providers.names() == []
    healthy = root.child("plugin:q")
    item = object()
    providers.registrar(healthy, "q")("openai", item)
    assert providers.get("openai") is item
    await root.dispose()
    assert providers.names() == []


def test_the_kits_config_check_reports_a_schema_that_recurses_forever_as_a_config_error() -> None:
    from dsh_core.errors import ConfigError
    from dsh_core.testing.loader import check_config

    def make(scope: Any, config: Any) -> None:
        return None

    make.config_schema = {
        "type": "object",
        "properties": {"limits": {"$ref": "#/$defs/limits"}},  # type: ignore[attr-defined]
        "$defs": {"limits": {"allOf": [{"$ref": "#/$defs/limits"}]}},
    }
    with pytest.raises(
        ConfigError,
        match=r"config for plugin 'lim' cannot be checked against its config schema: "
        r"validation recursed too deeply",
    ):
        check_config("lim", make, {"limits": {"rps": 5}})


async def test_a_row_that_fails_to_start_names_the_file_that_set_it() -> None:
    """The row id and the plugin were named, but not which of several config files held the row."""
    dep = deployment(
        {"plugins": [{"id": "ok", "use": "echo", "config": {"tool": "alpha"}}]},
        {"plugins": [{"id": "broken", "use": "echo", "config": {"tool": "alpha"}}]},
    )
    with pytest.raises(PluginLoadError, match=r"^plugin row 'broken' of file2.toml \(use 'echo' .*\) failed to start"):
        await Harness.start(dep, catalog=catalog())


async def test_a_row_that_fails_to_start_names_the_file_its_config_came_from_too() -> None:
    """Only the file that added the row was named, not the overlay whose config made it fail."""
    dep = deployment(
        {
            "plugins": [
                {"id": "ok", "use": "echo", "config": {"tool": "alpha"}},
                {"id": "broken", "use": "echo", "config": {"tool": "beta"}},
            ]
        },
        {"plugins": [{"id": "broken", "config": {"tool": "alpha"}}]},
    )
    with pytest.raises(
        PluginLoadError,
        match=r"^plugin row 'broken' of file1.toml \(use 'echo' .*\) with its config "
        r"from file2.toml failed to start",
    ):
        await Harness.start(dep, catalog=catalog())


async def test_hooks_run_in_the_documented_call_order_tryfirst_then_last_row_first_then_trylast() -> None:
    """The README's "call order": tryfirst, then the newest row first, then trylast."""
    order: list[str] = []

    def voter(tag: str, **marks: bool) -> Any:
        class Voter:
            @hookimpl(**marks)
            def dsh_pre_execute(self) -> None:
                order.append(tag)

        @plugin()
        def make(scope: Scope, config: Any) -> Voter:
            return Voter()

        return make

    plugins = PluginCatalog(
        entry_points=[],
        extra={
            "echo": sample_plugins.echo,
            "a": voter("a"),
            "b": voter("b"),
            "c": voter("c"),
            "first": voter("first", tryfirst=True),
            "last": voter("last", trylast=True),
        },
    )
    rows = [
        {"id": "e", "use": "echo"},
        {"id": "first", "use": "first"},
        {"id": "a", "use": "a"},
        {"id": "last", "use": "last"},
        {"id": "b", "use": "b"},
        {"id": "c", "use": "c"},
    ]
    harness = await Harness.start(deployment({"plugins": rows}), catalog=plugins)
    try:
        assert (await harness.call("echo", {})).is_error is False
    finally:
        await harness.aclose()
    assert order == ["first", "c", "b", "a", "last"]


async def test_a_deployment_whose_files_disable_every_agent_says_so_naming_them() -> None:
    """Every command failed with only 'the deployment defines no agent', though a file had disabled each."""
    dep = deployment(
        {"agents": [{"id": "main"}], "plugins": [{"id": "e", "use": "echo"}]},
        {"agents": [{"id": "main", "enabled": False}]},
    )
    harness = await Harness.start(dep, catalog=catalog())
    try:
        with pytest.raises(PluginLoadError) as caught:
            await harness.call("echo", {})
    finally:
        await harness.aclose()
    assert caught.value.message == (
        "the deployment defines no agent: the [[agents]] rows of its files (file1.toml, file2.toml) are all "
        "disabled (enable one with enabled = true, or drop the rows for the implicit agent 'main')"
    )


async def test_a_start_that_lets_out_a_stray_cancellation_fails_naming_the_row_not_as_an_interrupt() -> None:
    """A factory or registration hook that read a cancelled future's result let a CancelledError out of the
    boot: `dsh` said "interrupted" (exit 130) and named no plugin, though nobody had cancelled anything."""
    import asyncio

    disposed: list[str] = []

    class Registers:
        @hookimpl
        def dsh_register_tools(self, register: Any) -> None:
            register(sample_plugins._echo("stray"))
            cancelled = asyncio.get_running_loop().create_future()
            cancelled.cancel()
            cancelled.result()

    @plugin()
    def in_factory(scope: Scope, config: Any) -> None:
        scope.on_dispose(lambda: disposed.append("in-factory"))
        cancelled = asyncio.get_running_loop().create_future()
        cancelled.cancel()
        cancelled.result()

    @plugin()
    def in_hook(scope: Scope, config: Any) -> Registers:
        scope.on_dispose(lambda: disposed.append("in-hook"))
        return Registers()

    plugins = PluginCatalog(
        entry_points=[], extra={"echo": sample_plugins.echo, "in-factory": in_factory, "in-hook": in_hook}
    )
    for use in ("in-factory", "in-hook"):
        dep = deployment({"plugins": [{"id": "e", "use": "echo"}, {"id": "p", "use": use}]})
        with pytest.raises(
            PluginLoadError,
            match=rf"^plugin row 'p' of file1.toml \(use '{use}' .*\) failed to "
            r"start: CancelledError",
        ):
            await Harness.start(dep, catalog=plugins)
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    assert disposed == ["in-factory", "in-hook"]


async def test_a_plugin_failing_with_an_unprintable_exception_is_still_named() -> None:
    """An exception whose str() raises escaped the loader as that second exception's raw traceback, naming
    no plugin, both from a module's import and from a factory."""
    from tests.core.sample_plugins import DISPOSED

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise AttributeError("'Unprintable' object has no attribute 'field'")

    @plugin()
    def raising(scope: Scope, config: Any) -> None:
        scope.on_dispose(lambda: DISPOSED.append("unprintable"))
        raise Unprintable()

    DISPOSED.clear()
    plugins = PluginCatalog(
        entry_points=[ep("on-import", "tests.core.unprintable_plugin:plugin")], extra={"on-start": raising}
    )
    with pytest.raises(
        PluginLoadError,
        match=r"^file1.toml: plugins\[i\].use: plugin 'on-import' "
        r"\(tests.core.unprintable_plugin:plugin\) failed to load: "
        r"Unprintable: <unprintable exception>",
    ):
        await Harness.start(deployment({"plugins": [{"id": "i", "use": "on-import"}]}), catalog=plugins)
    with pytest.raises(
        PluginLoadError,
        match=r"^plugin row 's' of file1.toml \(use 'on-start' .*\) failed to start: "
        r"Unprintable: <unprintable exception>$",
    ):
        await Harness.start(deployment({"plugins": [{"id": "s", "use": "on-start"}]}), catalog=plugins)
    assert DISPOSED == ["unprintable"]


async def test_a_provider_or_store_name_that_is_no_string_fails_the_start_naming_the_row() -> None:
    """``register(config.get("name"), provider)`` without a name registered it under None: no agent could ever
    pick it, and the first "no provider named ..." message crashed joining the known names (a raw TypeError)."""

    class Registers:
        def __init__(self, hook: str, name: object) -> None:
            self.hook, self.name = hook, name

        @hookimpl
        def dsh_register_providers(self, register: Any) -> None:
            if self.hook == "providers":
                register(self.name, object())

        @hookimpl
        def dsh_register_session_stores(self, register: Any) -> None:
            if self.hook == "stores":
                register(self.name, object())

    @plugin(config_schema={"type": "object"})
    def registers(scope: Scope, config: Any) -> Registers:
        return Registers(config["hook"], config.get("name"))

    plugins = PluginCatalog(entry_points=[], extra={"registers": registers})
    for hook, kind in (("providers", "provider"), ("stores", "session store")):
        for name in (None, "", 7):
            config: dict[str, Any] = {"hook": hook} if name is None else {"hook": hook, "name": name}
            dep = deployment(
                {
                    "plugins": [
                        {"id": "ok", "use": "registers", "config": {"hook": hook, "name": "a"}},
                        {"id": "p", "use": "registers", "config": config},
                    ]
                }
            )
            with pytest.raises(
                PluginLoadError,
                match=rf"^plugin row 'p' .*failed to start: cannot register {kind} "
                rf"{name!r}: a {kind} name must be a non-empty string",
            ):
                await Harness.start(dep, catalog=plugins)


@pytest.mark.parametrize(
    "returned",
    [{"tools": []}, "echo", True, 1, ["a"], ("a",), b"x", "its config"],
    ids=lambda value: type(value).__name__ if value != "its config" else "config",
)
async def test_a_factory_returning_a_data_value_fails_the_start_instead_of_registering_nothing(returned: Any) -> None:
    """A factory that returned its config (or a flag, a name) booted fine: pluggy found no hook in the value,
    so the plugin's tools and guards silently did not exist."""
    from tests.core.sample_plugins import DISPOSED

    @plugin(config_schema={"type": "object"})
    def make(scope: Scope, config: Any) -> Any:
        scope.on_dispose(lambda: DISPOSED.append("data"))
        return config if returned == "its config" else returned

    DISPOSED.clear()
    kind = "FrozenDict" if returned == "its config" else type(returned).__name__
    plugins = PluginCatalog(entry_points=[], extra={"echo": sample_plugins.echo, "data": make})
    dep = deployment({"plugins": [{"id": "e", "use": "echo"}, {"id": "d", "use": "data"}]})
    with pytest.raises(
        PluginLoadError,
        match=rf"^plugin row 'd' of file1.toml \(use 'data' .*\) failed to start: its "
        rf"factory .*make returned a {kind} "
        r"\(a data value\), "
        r"not a plugin object: a plugin factory returns the object whose "
        r"@hookimpl methods",
    ):
        await Harness.start(dep, catalog=plugins)
    assert DISPOSED == ["data"]


async def test_a_plugin_object_that_subclasses_a_builtin_collection_still_loads() -> None:
    """Only the builtin data types themselves are refused: a plugin class built on ``dict`` (a config-backed
    object, say) with hook implementations is a plugin object like any other."""
    from dsh_core import PreDecision, hookimpl

    class Settings(dict[str, Any]):
        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> PreDecision | None:
            return PreDecision.deny("denied by the dict-based plugin") if execution.name == "echo" else None

    @plugin(config_schema={"type": "object"})
    def make(scope: Scope, config: Any) -> Any:
        return Settings(config)

    plugins = PluginCatalog(entry_points=[], extra={"echo": sample_plugins.echo, "settings": make})
    dep = deployment({"plugins": [{"id": "e", "use": "echo"}, {"id": "s", "use": "settings"}]})
    harness = await Harness.start(dep, catalog=plugins)
    try:
        denied = await harness.call("echo", {})
        assert denied.code == "DENIED" and "denied by the dict-based plugin" in denied.text
    finally:
        await harness.aclose()


async def test_a_task_a_factory_returns_is_cancelled_with_the_refused_start() -> None:
    """A factory returning a task it started (``asyncio.ensure_future(setup())``) was refused, but the task
    kept running after the failed start, with nothing left to await or cancel it."""
    import asyncio

    started: list[asyncio.Task[None]] = []

    async def setup() -> None:
        await asyncio.sleep(3600)

    @plugin(config_schema={"type": "object"})
    def make(scope: Scope, config: Any) -> Any:
        started.append(asyncio.ensure_future(setup()))
        return started[-1]

    plugins = PluginCatalog(entry_points=[], extra={"tasker": make})
    with pytest.raises(PluginLoadError, match=r"returned an awaitable \(Task\)"):
        await Harness.start(deployment({"plugins": [{"id": "t", "use": "tasker"}]}), catalog=plugins)
    await asyncio.sleep(0)
    assert started[0].cancelled()


async def test_an_optionalhook_impl_of_a_hook_no_spec_defines_loads_and_a_plain_one_is_refused() -> None:
    """pluggy lets ``@hookimpl(optionalhook=True)`` name a hook no spec defines (a hook of a newer dsh, say):
    it is simply never called. dsh refused it as an unknown hook, so such a plugin could not load at all."""
    from dsh_core import PreDecision, hookimpl

    class Forward:
        @hookimpl(optionalhook=True)
        def dsh_from_a_newer_dsh(self, anything: Any) -> None:
            raise AssertionError("a hook no spec defines is never called")

        @hookimpl
        def dsh_pre_execute(self, execution: Any) -> PreDecision | None:
            return PreDecision.deny("denied by the forward-looking plugin") if execution.name == "echo" else None

    class Typo:
        @hookimpl
        def dsh_from_a_newer_dsh(self, anything: Any) -> None:
            return None

    @plugin(config_schema={"type": "object"})
    def forward(scope: Scope, config: Any) -> Any:
        return Forward()

    @plugin(config_schema={"type": "object"})
    def typo(scope: Scope, config: Any) -> Any:
        return Typo()

    plugins = PluginCatalog(entry_points=[], extra={"echo": sample_plugins.echo, "forward": forward, "typo": typo})
    harness = await Harness.start(
        deployment({"plugins": [{"id": "e", "use": "echo"}, {"id": "f", "use": "forward"}]}), catalog=plugins
    )
    try:
        denied = await harness.call("echo", {})
        assert denied.code == "DENIED" and "denied by the forward-looking plugin" in denied.text
        assert "dsh_from_a_newer_dsh" not in harness.hooks.hook_names()
    finally:
        await harness.aclose()
    with pytest.raises(
        PluginLoadError,
        match=r"plugin row 't'.*plugin 't' implements unknown hook "
        r"'dsh_from_a_newer_dsh'.*optionalhook=True",
    ):
        await Harness.start(deployment({"plugins": [{"id": "t", "use": "typo"}]}), catalog=plugins)
