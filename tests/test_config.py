"""Deployment config: file shape, composition of overlays, environment overrides,
provenance, dumping and plugin-config validation (dsh_core.config)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from dsh_core.config import (
    DEPLOYMENT_SCHEMA,
    AgentRow,
    CodeRuntimeSection,
    Deployment,
    PluginRow,
    SessionsSection,
    ToolsSection,
    compose,
    default_deployment,
    dump,
    dump_text,
    load_deployment,
    validate_plugin_configs,
)
from dsh_core.errors import ConfigError, SchemaDefinitionError

NO_ENV: dict[str, str] = {}


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Write named TOML files into a temp cwd, so provenance shows short names."""
    monkeypatch.chdir(tmp_path)

    def write(name: str, text: str) -> str:
        (tmp_path / name).write_text(textwrap.dedent(text), encoding="utf-8")
        return name

    return write


def load(*paths: str, env: dict[str, str] | None = None) -> Deployment:
    return load_deployment(paths, env=NO_ENV if env is None else env)


def config_error(*paths: str, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load(*paths, env=env)
    return caught.value.message


BASE = """
    [tools]
    mode = "native"
    max_parallel_sub_calls = 4

    [code_runtime]
    preload = ["numpy"]

    [[agents]]
    id = "main"
    provider = "scripted"
    allow = ["read", "write"]

    [[plugins]]
    id = "fs"
    use = "workspace"
    config = { root = ".", allow_write = false }

    [[plugins]]
    id = "shell"
    use = "bash"
    config = { timeout_s = 30 }
"""


# --------------------------------------------------------------------------- schema and defaults


def test_deployment_schema_is_a_valid_draft_2020_12_schema() -> None:
    Draft202012Validator.check_schema(DEPLOYMENT_SCHEMA)
    assert DEPLOYMENT_SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_an_empty_file_gives_every_default_and_one_implicit_main_agent(files: Any) -> None:
    d = load(files("empty.toml", ""))
    assert d.tools == ToolsSection()
    assert d.tools.mode == "native" and d.tools.max_parallel_sub_calls == 10
    assert d.code_runtime == CodeRuntimeSection()
    assert d.code_runtime.max_output_bytes == 64 * 1024 * 1024
    assert d.sessions == SessionsSection(store="sqlite", home=None)
    assert d.agents == (AgentRow(id="main"),)
    assert d.plugins == ()
    assert d.sources == ("empty.toml",)
    assert d.source_of("tools.mode") == "default"
    assert d.source_of("code_runtime.preload") == "default"
    assert d.source_of("agents[main].id") == "default"
    assert d.source_of("sessions.home") is None


def test_every_documented_key_is_read_with_its_type(files: Any) -> None:
    d = load(
        files(
            "full.toml",
            """
            [tools]
            mode = "both"
            max_parallel_sub_calls = 3
            [code_runtime]
            isolation = "L2"
            timeout_s = 30
            cpu_s = 1.5
            memory_mb = 256
            max_output_bytes = 4
            preload = ["numpy", "os.path"]
            [sessions]
            store = "jsonl"
            home = "~/.dsh"
            [[agents]]
            id = "main"
            mode = "code"
            provider = "scripted"
            model = "deepseek-chat"
            max_turns = 20
            max_tool_result_chars = 5000
            allow = ["read"]
            deny = ["bash"]
            system_prompt = "be brief"
            [[plugins]]
            id = "fs"
            use = "workspace"
            enabled = true
            config = { root = "." }
            """,
        )
    )
    assert d.tools == ToolsSection(mode="both", max_parallel_sub_calls=3)
    assert d.code_runtime == CodeRuntimeSection(
        isolation="L2",
        timeout_s=30.0,
        cpu_s=1.5,
        memory_mb=256,
        max_output_bytes=4,
        preload=("numpy", "os.path"),
    )
    assert type(d.code_runtime.timeout_s) is float
    assert d.sessions == SessionsSection(store="jsonl", home="~/.dsh")
    assert d.agents == (
        AgentRow(
            id="main",
            mode="code",
            provider="scripted",
            model="deepseek-chat",
            max_turns=20,
            max_tool_result_chars=5000,
            allow=("read",),
            deny=("bash",),
            system_prompt="be brief",
        ),
    )
    assert d.plugins == (PluginRow(id="fs", use="workspace", config={"root": "."}),)


def test_integral_floats_for_integer_keys_become_ints(files: Any) -> None:
    d = load(
        files(
            "f.toml",
            "[tools]\nmax_parallel_sub_calls = 10.0\n[[agents]]\nid = 'a'\nmax_turns = 2.0\n"
            "max_tool_result_chars = 1000.0\n",
        )
    )
    assert type(d.tools.max_parallel_sub_calls) is int and d.tools.max_parallel_sub_calls == 10
    agent = d.agent("a")
    assert agent is not None and type(agent.max_turns) is int
    assert type(agent.max_tool_result_chars) is int and agent.max_tool_result_chars == 1000


# --------------------------------------------------------------------------- merging


def test_tables_deep_merge_and_each_leaf_keeps_its_own_source(files: Any) -> None:
    d = load(files("base.toml", BASE), files("overlay.toml", '[tools]\nmode = "code"\n'))
    assert d.tools == ToolsSection(mode="code", max_parallel_sub_calls=4)
    assert d.source_of("tools.mode") == "overlay.toml"
    assert d.source_of("tools.max_parallel_sub_calls") == "base.toml"
    assert d.source_of("code_runtime.timeout_s") == "default"
    assert d.sources == ("base.toml", "overlay.toml")


def test_lists_replace_instead_of_merging(files: Any) -> None:
    overlay = files(
        "overlay.toml",
        """
        [code_runtime]
        preload = ["pandas"]
        [[agents]]
        id = "main"
        allow = ["bash"]
        """,
    )
    d = load(files("base.toml", BASE), overlay)
    assert d.code_runtime.preload == ("pandas",)
    assert d.agents[0].allow == ("bash",)
    assert d.agents[0].provider == "scripted"
    assert d.source_of("agents[main].allow") == "overlay.toml"
    assert d.source_of("agents[main].provider") == "base.toml"


def test_an_overlay_row_replaces_the_config_whole(files: Any) -> None:
    overlay = files("overlay.toml", '[[plugins]]\nid = "fs"\nconfig = { allow_write = true }\n')
    d = load(files("base.toml", BASE), overlay)
    fs = d.plugin("fs")
    assert fs is not None
    assert fs.use == "workspace"
    assert dict(fs.config) == {"allow_write": True}  # "root" from base is gone: no deep merge
    assert d.source_of("plugins[fs].config.allow_write") == "overlay.toml"
    assert d.source_of("plugins[fs].config.root") is None
    assert d.source_of("plugins[fs].config") == "overlay.toml"
    assert d.source_of("plugins[fs].use") == "base.toml"


def test_a_rows_config_dir_is_the_absolute_directory_of_the_file_that_set_its_config(
    files: Any, tmp_path: Path
) -> None:
    (tmp_path / "site").mkdir()
    overlay = files("site/overlay.toml", '[[plugins]]\nid = "fs"\nconfig = { allow_write = true }\n')
    d = load(files("base.toml", BASE), overlay)
    assert d.config_dir("fs") == tmp_path / "site"  # the overlay's config won
    assert d.config_dir("shell") == tmp_path
    assert d.config_dir("ghost") is None
    assert default_deployment(tmp_path, env=NO_ENV).config_dir("workspace") is None  # no file set it
    assert (
        compose([("base.toml", {"plugins": [{"id": "x", "use": "x", "config": {}}]})], env=NO_ENV).config_dir("x")
        is None
    )


def test_an_overlay_row_without_config_keeps_the_config_and_replaces_given_keys(files: Any) -> None:
    overlay = files("overlay.toml", '[[plugins]]\nid = "fs"\nuse = "files-v2"\n')
    d = load(files("base.toml", BASE), overlay)
    fs = d.plugin("fs")
    assert fs == PluginRow(id="fs", use="files-v2", config={"root": ".", "allow_write": False})
    assert d.source_of("plugins[fs].use") == "overlay.toml"
    assert d.source_of("plugins[fs].id") == "base.toml"
    assert d.source_of("plugins[fs].config.root") == "base.toml"


def test_an_unknown_id_inserts_a_row_and_rows_keep_first_appearance_order(files: Any) -> None:
    o1 = files("o1.toml", '[[plugins]]\nid = "git"\nuse = "mcp-stdio"\n[[plugins]]\nid = "fs"\nuse = "w2"\n')
    o2 = files("o2.toml", '[[plugins]]\nid = "web"\nuse = "fetch"\n[[plugins]]\nid = "git"\nconfig = {a = 1}\n')
    d = load(files("base.toml", BASE), o1, o2)
    assert [row.id for row in d.plugins] == ["fs", "shell", "git", "web"]
    git = d.plugin("git")
    assert git == PluginRow(id="git", use="mcp-stdio", config={"a": 1})
    assert d.source_of("plugins[git].id") == "o1.toml"
    assert d.source_of("plugins[git].config.a") == "o2.toml"
    assert d.source_of("plugins[web].use") == "o2.toml"


def test_a_new_plugin_row_without_use_is_an_error_naming_file_and_id(files: Any) -> None:
    overlay = files("overlay.toml", '[[plugins]]\nid = "git"\nconfig = { x = 1 }\n')
    message = config_error(files("base.toml", BASE), overlay)
    assert message.startswith("overlay.toml: plugins[git]: a new plugin row needs `use`")


def test_enabled_false_drops_a_row_and_a_later_overlay_re_enables_it(files: Any) -> None:
    base = files("base.toml", BASE)
    drop = files("drop.toml", '[[plugins]]\nid = "fs"\nenabled = false\n')
    d = load(base, drop)
    assert [row.id for row in d.plugins] == ["shell"]
    assert d.plugin("fs") is None
    assert d.source_of("plugins[fs].use") is None

    patch = files("patch.toml", '[[plugins]]\nid = "fs"\nconfig = { root = "/srv" }\n')
    assert load(base, drop, patch).plugin("fs") is None  # patched, but still dropped

    again = files("again.toml", '[[plugins]]\nid = "fs"\nenabled = true\n')
    d = load(base, drop, patch, again)
    assert [row.id for row in d.plugins] == ["fs", "shell"]  # back in its first-appearance place
    assert d.plugin("fs") == PluginRow(id="fs", use="workspace", config={"root": "/srv"})
    assert d.source_of("plugins[fs].enabled") == "again.toml"
    assert d.source_of("plugins[fs].config.root") == "patch.toml"


def test_a_row_inserted_disabled_can_be_enabled_later(files: Any) -> None:
    o1 = files("o1.toml", '[[plugins]]\nid = "git"\nuse = "mcp"\nenabled = false\n')
    o2 = files("o2.toml", '[[plugins]]\nid = "git"\nenabled = true\n')
    base = files("base.toml", BASE)
    assert load(base, o1).plugin("git") is None
    assert load(base, o1, o2).plugin("git") == PluginRow(id="git", use="mcp")


@pytest.mark.parametrize("kind", ["plugins", "agents"])
def test_dropping_an_id_no_earlier_file_defines_is_an_unmatched_overlay_target(files: Any, kind: str) -> None:
    overlay = files("overlay.toml", f'[[{kind}]]\nid = "ghost"\nenabled = false\n')
    message = config_error(files("base.toml", BASE), overlay)
    assert message == (
        f"overlay.toml: {kind}[ghost]: unmatched overlay target: enabled = false names an id "
        "that no earlier file defines"
    )


def test_the_same_id_in_two_files_patches_while_twice_in_one_file_is_an_error(files: Any) -> None:
    twice = files("twice.toml", '[[plugins]]\nid = "fs"\nuse = "a"\n[[plugins]]\nid = "fs"\nuse = "b"\n')
    assert config_error(twice) == "twice.toml: plugins[fs]: duplicate id (rows 1 and 2 of [[plugins]])"
    agents = files("agents.toml", "[[agents]]\nid = 'x'\n[[agents]]\nid = 'y'\n[[agents]]\nid = 'x'\n")
    assert config_error(agents) == "agents.toml: agents[x]: duplicate id (rows 1 and 3 of [[agents]])"


def test_agent_rows_patch_insert_and_drop_by_id(files: Any) -> None:
    overlay = files(
        "overlay.toml",
        """
        [[agents]]
        id = "reviewer"
        mode = "code"
        [[agents]]
        id = "main"
        model = "m2"
        """,
    )
    d = load(files("base.toml", BASE), overlay)
    assert [a.id for a in d.agents] == ["main", "reviewer"]
    assert d.agent("main") == AgentRow(id="main", provider="scripted", model="m2", allow=("read", "write"))
    assert d.agent("reviewer") == AgentRow(id="reviewer", mode="code")
    assert d.source_of("agents[reviewer].mode") == "overlay.toml"
    assert d.agent("nobody") is None

    dropped = load(files("b.toml", BASE), files("d.toml", '[[agents]]\nid = "main"\nenabled = false\n'))
    # Rows were declared, so no implicit agent stands in for the dropped one.
    assert dropped.agents == ()


def test_an_overlay_agent_named_main_replaces_the_implicit_one(files: Any) -> None:
    d = load(files("base.toml", ""), files("o.toml", '[[agents]]\nid = "main"\nmode = "both"\n'))
    assert d.agents == (AgentRow(id="main", mode="both"),)
    assert d.source_of("agents[main].id") == "o.toml"


def test_the_agent_mode_is_independent_of_the_env_override(files: Any) -> None:
    d = load(files("base.toml", '[[agents]]\nid = "main"\nmode = "native"\n'), env={"DSH_TOOLS_MODE": "code"})
    assert d.tools.mode == "code"
    assert d.agents[0].mode == "native"


def test_compose_does_not_alias_the_caller_documents() -> None:
    document: dict[str, Any] = {
        "code_runtime": {"preload": ["numpy"]},
        "plugins": [{"id": "fs", "use": "w", "config": {"root": ".", "deep": {"list": [1]}}}],
    }
    d = compose([("doc", document)], env=NO_ENV)
    document["plugins"][0]["config"]["root"] = "/elsewhere"
    document["plugins"][0]["config"]["deep"]["list"].append(2)
    document["code_runtime"]["preload"].append("x")
    assert d.plugins[0].config == {"root": ".", "deep": {"list": [1]}}
    assert d.code_runtime.preload == ("numpy",)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "bogus = 1\n",
            "f.toml: bogus: unknown key (allowed: agents, code_runtime, lifecycle, plugins, sessions, tools)",
        ),
        (
            "[tools]\nturbo = true\n",
            "f.toml: tools.turbo: unknown key "
            "(allowed: approval_grace_s, approval_timeout_s, max_parallel_sub_calls, mode)",
        ),
        (
            "[code_runtime]\ntimeout = 3\n",
            "f.toml: code_runtime.timeout: unknown key (did you mean 'timeout_s'? allowed: cpu_s, isolation, "
            "max_output_bytes, memory_mb, preload, timeout_s)",
        ),
        (
            '[[agents]]\nid = "main"\nmax_turn = 3\n',
            "f.toml: agents[main].max_turn: unknown key (did you mean 'max_turns'? allowed: allow, deny, enabled, "
            "id, max_tool_result_chars, max_turns, mode, model, provider, system_prompt)",
        ),
        ("[sessions]\npath = 'x'\n", "f.toml: sessions.path: unknown key (allowed: home, store)"),
        (
            '[[plugins]]\nid = "fs"\nuse = "w"\nconfg = {}\n',
            "f.toml: plugins[fs].confg: unknown key (did you mean 'config'? allowed: config, enabled, id, use)",
        ),
        (
            '[[agents]]\nid = "main"\ntemperature = 0.2\n',
            "f.toml: agents[main].temperature: unknown key (allowed: allow, deny, enabled, id, "
            "max_tool_result_chars, max_turns, mode, model, provider, system_prompt)",
        ),
    ],
)
def test_unknown_keys_at_every_level_name_file_and_key_path(files: Any, text: str, expected: str) -> None:
    assert config_error(files("f.toml", text)) == expected


def test_keys_inside_a_plugin_config_are_the_plugins_business(files: Any) -> None:
    d = load(files("f.toml", '[[plugins]]\nid = "fs"\nuse = "w"\nconfig = { anything = { goes = [1, "a"] } }\n'))
    assert d.plugins[0].config == {"anything": {"goes": [1, "a"]}}


def test_a_bad_mode_in_an_overlay_names_file_and_path(files: Any) -> None:
    message = config_error(files("base.toml", BASE), files("overlay.toml", '[tools]\nmode = "turbo"\n'))
    assert message == "overlay.toml: tools.mode: 'turbo' is not one of ['native', 'code', 'both']"


def test_a_bad_agent_mode_names_the_row(files: Any) -> None:
    message = config_error(files("f.toml", '[[agents]]\nid = "main"\nmode = "fast"\n'))
    assert message == "f.toml: agents[main].mode: 'fast' is not one of ['native', 'code', 'both']"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[tools]\nmax_parallel_sub_calls = 0\n",
            "tools.max_parallel_sub_calls: 0 is less than the minimum of 1",
        ),
        (
            "[tools]\nmax_parallel_sub_calls = true\n",
            "tools.max_parallel_sub_calls: True is not of type 'integer'",
        ),
        ("[code_runtime]\nisolation = 'L9'\n", "code_runtime.isolation: 'L9' is not one of"),
        (
            "[code_runtime]\ntimeout_s = 0\n",
            "code_runtime.timeout_s: 0 is less than or equal to the minimum of 0",
        ),
        (
            "[code_runtime]\ncpu_s = -1.0\n",
            "code_runtime.cpu_s: -1.0 is less than or equal to the minimum of 0",
        ),
        ("[code_runtime]\ntimeout_s = inf\n", "code_runtime.timeout_s: float inf is not finite"),
        ("[code_runtime]\ncpu_s = nan\n", "code_runtime.cpu_s: float nan is not finite"),
        ("[code_runtime]\nmemory_mb = 1.5\n", "code_runtime.memory_mb: 1.5 is not of type 'integer'"),
        (
            "[code_runtime]\nmax_output_bytes = 3\n",
            "code_runtime.max_output_bytes: 3 is less than the minimum of 4",
        ),
        ("[code_runtime]\npreload = 'numpy'\n", "code_runtime.preload: 'numpy' is not of type 'array'"),
        (
            "[code_runtime]\npreload = ['os path']\n",
            "code_runtime.preload[0]: 'os path' is not a dotted Python module name",
        ),
        ("[sessions]\nstore = ''\n", "sessions.store: '' should be non-empty"),
        ("[[agents]]\nid = 'a'\nmax_turns = 0\n", "agents[a].max_turns: 0 is less than the minimum of 1"),
        (
            "[[agents]]\nid = 'a'\nmax_tool_result_chars = 0\n",
            "agents[a].max_tool_result_chars: 0 is less than the minimum of 1",
        ),
        (
            "[[agents]]\nid = 'a'\nmax_tool_result_chars = '100k'\n",
            "agents[a].max_tool_result_chars: '100k' is not of type 'integer'",
        ),
        (
            "[[agents]]\nid = 'a'\nmax_tool_result_chars = 1.5\n",
            "agents[a].max_tool_result_chars: 1.5 is not of type 'integer'",
        ),
        ("[[agents]]\nid = 'a'\nallow = 'read'\n", "agents[a].allow: 'read' is not of type 'array'"),
        ("[[plugins]]\nid = 'fs'\nuse = 'w'\nconfig = 5\n", "plugins[fs].config: 5 is not of type 'object'"),
        (
            "[[plugins]]\nid = 'fs'\nuse = 'w'\nenabled = 'no'\n",
            "plugins[fs].enabled: 'no' is not of type 'boolean'",
        ),
        ("[[plugins]]\nid = 'fs'\nuse = 7\n", "plugins[fs].use: 7 is not of type 'string'"),
        ("[[plugins]]\nid = 7\nuse = 'w'\n", "plugins[#1].id: 7 is not of type 'string'"),
        ("[[plugins]]\nuse = 'w'\n", "plugins[#1]: 'id' is a required property"),
        ("plugins = 'fs'\n", "plugins: 'fs' is not of type 'array'"),
        (
            "[[agents]]\nid = 'a'\n[[agents]]\nid = '-bad'\n",
            "agents[#2].id: '-bad' is not a valid id (letters, digits, '_', '.', '-', starting with a letter or digit)",
        ),
        ('[[agents]]\nid = "main\\n"\n', "agents[#1].id: 'main\\n' is not a valid id"),
        (
            "[[plugins]]\nid = 'fs'\nuse = 'w'\nconfig = { when = 2024-01-01 }\n",
            "plugins[fs].config.when: date",
        ),
    ],
)
def test_bad_values_name_file_row_and_path(files: Any, text: str, expected: str) -> None:
    assert config_error(files("f.toml", text)).startswith(f"f.toml: {expected}")


def test_every_problem_of_every_file_is_reported_at_once(files: Any) -> None:
    a = files("a.toml", "[tools]\nmode = 'x'\nextra = 1\n")
    b = files("b.toml", "[code_runtime]\nmemory_mb = 0\n")
    assert config_error(a, b).splitlines() == [
        "a.toml: tools.extra: unknown key (allowed: approval_grace_s, approval_timeout_s, max_parallel_sub_calls, "
        "mode)",
        "a.toml: tools.mode: 'x' is not one of ['native', 'code', 'both']",
        "b.toml: code_runtime.memory_mb: 0 is less than the minimum of 1",
    ]


def test_merge_problems_of_several_rows_are_reported_together(files: Any) -> None:
    overlay = files("o.toml", "[[plugins]]\nid = 'a'\n[[plugins]]\nid = 'b'\nenabled = false\n")
    lines = config_error(files("base.toml", BASE), overlay, env={"DSH_TOOLS_MODE": "turbo"}).splitlines()
    assert [line.split(":")[0] + ":" + line.split(":")[1] for line in lines[:2]] == [
        "o.toml: plugins[a]",
        "o.toml: plugins[b]",
    ]
    assert lines[2] == "DSH_TOOLS_MODE='turbo' must be one of native, code, both"


def test_malformed_toml_names_the_file_and_the_line_and_column(files: Any) -> None:
    message = config_error(files("bad.toml", "[tools]\nmode = native\n"))
    assert message.startswith("bad.toml: invalid TOML: ")
    assert "line 2, column 8" in message


def test_a_file_nesting_too_deeply_to_parse_is_a_config_error_naming_it(files: Any) -> None:
    """tomllib recurses into arrays and inline tables: a raw RecursionError naming no file escaped."""
    for deep in ("[" * 50_000 + "]" * 50_000, "{ a = " * 50_000 + "1" + " }" * 50_000):
        assert config_error(files("deep.toml", f"x = {deep}\n")) == (
            "deep.toml: cannot parse: arrays or inline tables nest too deeply"
        )


def test_a_missing_file_is_named(files: Any) -> None:
    assert config_error(files("base.toml", BASE), "nope.toml") == "nope.toml: config file not found"


def test_a_directory_or_non_utf8_file_is_a_config_error(files: Any, tmp_path: Path) -> None:
    (tmp_path / "adir").mkdir()
    assert config_error("adir").startswith("adir: cannot read config file: ")
    (tmp_path / "latin1.toml").write_bytes(b"[tools]\nmode = '\xe9'\n")
    assert config_error("latin1.toml").startswith("latin1.toml: invalid TOML: not UTF-8 text")


def test_a_file_starting_with_a_byte_order_mark_is_named_as_such(files: Any, tmp_path: Path) -> None:
    # tomllib said only "Invalid statement (at line 1, column 1)", at a character no editor shows.
    (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbf[tools]\nmode = 'code'\n")
    assert config_error("bom.toml") == (
        "bom.toml: invalid TOML: the file starts with a UTF-8 byte order mark (BOM), which TOML does not "
        "allow; save it as UTF-8 without a BOM"
    )


def test_provenance_names_the_path_as_given(files: Any, tmp_path: Path) -> None:
    files("base.toml", BASE)
    d = load_deployment([tmp_path / "base.toml"], env=NO_ENV)
    assert d.sources == (str(tmp_path / "base.toml"),)
    assert d.source_of("tools.mode") == str(tmp_path / "base.toml")


@pytest.mark.parametrize("name", ["default", "env:DSH_HOME"])
def test_a_file_whose_name_reads_as_a_built_in_label_is_still_named_as_a_file(
    files: Any, tmp_path: Path, name: str
) -> None:
    """A file given as ``default`` was labelled ``default``, as the built-in defaults are (and one given as
    ``env:DSH_HOME`` as that variable): the dump showed its values as built in, and errors named no file."""
    files(
        name,
        """
        [tools]
        mode = "code"

        [[plugins]]
        id = "p"
        use = "u"
        config = { k = 1 }
    """,
    )
    d = load(name)
    label = f"./{name}"
    assert d.sources == (label,)
    assert d.source_of("tools.mode") == d.origin_of("tools.mode") == label
    assert d.source_of("tools.max_parallel_sub_calls") == "default"  # the built-in default keeps its own label
    assert d.config_dir("p") == tmp_path
    lines = dump_text(d).splitlines()
    assert any(line.startswith('tools.mode = "code"') and line.endswith(f"# {label}") for line in lines), lines
    assert any(line.startswith("plugins[p].use") and line.endswith(f"# {label}") for line in lines), lines
    with pytest.raises(ConfigError) as caught:
        validate_plugin_configs(d, lambda row: None)
    assert caught.value.message == f"plugins[p].config.k: unknown key (plugin 'u' takes no config) (from {label})"


def test_no_config_at_all_is_refused() -> None:
    with pytest.raises(ConfigError, match="no config given"):
        load_deployment([], env=NO_ENV)


def test_compose_refuses_a_document_that_is_not_a_table() -> None:
    with pytest.raises(ConfigError) as caught:
        compose([("x", ["not", "a", "table"])], env=NO_ENV)  # type: ignore[list-item]
    assert caught.value.message == "x: a config file must be a TOML table, got list"


# --------------------------------------------------------------------------- environment


def test_dsh_tools_mode_overrides_the_files_last(files: Any) -> None:
    overlay = files("overlay.toml", '[tools]\nmode = "both"\n')
    d = load(files("base.toml", BASE), overlay, env={"DSH_TOOLS_MODE": "code"})
    assert d.tools.mode == "code"
    assert d.source_of("tools.mode") == "env:DSH_TOOLS_MODE"


@pytest.mark.parametrize("value", ["turbo", "", "Code", " code"])
def test_dsh_tools_mode_with_another_value_is_a_clear_error(files: Any, value: str) -> None:
    message = config_error(files("base.toml", BASE), env={"DSH_TOOLS_MODE": value})
    assert message == f"DSH_TOOLS_MODE={value!r} must be one of native, code, both"


def test_dsh_home_overrides_sessions_home(files: Any) -> None:
    base = files("base.toml", '[sessions]\nhome = "/from/file"\n')
    assert load(base).sessions.home == "/from/file"
    assert load(base).source_of("sessions.home") == "base.toml"
    d = load(base, env={"DSH_HOME": "/from/env"})
    assert d.sessions.home == "/from/env"
    assert d.source_of("sessions.home") == "env:DSH_HOME"
    assert config_error(base, env={"DSH_HOME": ""}) == "DSH_HOME is set but empty; unset it or name a directory"


def test_a_relative_sessions_home_from_a_file_is_read_from_that_files_directory(
    files: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "proj").mkdir()
    (tmp_path / "a").mkdir()
    files("proj/dsh.toml", '[sessions]\nhome = "state"\n')
    files("proj/overlay.toml", '[sessions]\nhome = "../s2"\n')
    files("abs.toml", '[sessions]\nhome = "/abs/state"\n')
    files("tilde.toml", '[sessions]\nhome = "~/.dsh-x"\n')
    monkeypatch.chdir(tmp_path / "a")  # not the files' directory
    d = load("../proj/dsh.toml")
    assert d.sessions.home == str(tmp_path / "a" / ".." / "proj" / "state")
    assert d.source_of("sessions.home") == "../proj/dsh.toml"
    assert ("sessions.home", d.sessions.home, "../proj/dsh.toml") in dump(d)  # dump shows where it is
    # The file that set it last decides, from its own directory.
    assert load("../proj/dsh.toml", "../proj/overlay.toml").sessions.home == str(
        tmp_path / "a" / ".." / "proj" / ".." / "s2"
    )
    # Absolute and ~ paths stay as written; compose() has no file to be relative to.
    assert load("../abs.toml").sessions.home == "/abs/state"
    assert load("../tilde.toml").sessions.home == "~/.dsh-x"
    assert compose([("f.toml", {"sessions": {"home": "state"}})], env=NO_ENV).sessions.home == "state"
    # DSH_HOME keeps meaning a path from the working directory, as any environment path does.
    d = load("../proj/dsh.toml", env={"DSH_HOME": "rel"})
    assert d.sessions.home == "rel" and d.source_of("sessions.home") == "env:DSH_HOME"


def test_the_environment_defaults_to_os_environ(files: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSH_TOOLS_MODE", "both")
    monkeypatch.delenv("DSH_HOME", raising=False)
    assert load_deployment([files("base.toml", BASE)]).tools.mode == "both"
    monkeypatch.setenv("DSH_TOOLS_MODE", "turbo")
    with pytest.raises(ConfigError, match="DSH_TOOLS_MODE='turbo'"):
        default_deployment(".")


# --------------------------------------------------------------------------- provenance and dump


def test_provenance_covers_every_kind_of_leaf(files: Any) -> None:
    overlay = files(
        "overlay.toml",
        """
        [[plugins]]
        id = "shell"
        config = { env = { PATH = "/bin" }, args = ["-c"], empty = {} }
        [[plugins]]
        id = "guards"
        use = "guards"
        """,
    )
    d = load(files("base.toml", BASE), overlay, env={"DSH_TOOLS_MODE": "both"})
    expected = {
        "tools.mode": "env:DSH_TOOLS_MODE",
        "tools.max_parallel_sub_calls": "base.toml",
        "code_runtime.isolation": "default",
        "code_runtime.preload": "base.toml",
        "sessions.store": "default",
        "agents[main].id": "base.toml",
        "agents[main].enabled": "default",
        "agents[main].provider": "base.toml",
        "plugins[fs].id": "base.toml",
        "plugins[fs].use": "base.toml",
        "plugins[fs].enabled": "default",
        "plugins[fs].config.root": "base.toml",
        "plugins[shell].config.env.PATH": "overlay.toml",
        "plugins[shell].config.args": "overlay.toml",
        "plugins[shell].config.empty": "overlay.toml",
        "plugins[guards].config": "default",
    }
    assert {path: d.source_of(path) for path in expected} == expected
    assert d.source_of("plugins[shell].config.timeout_s") is None
    assert d.source_of("no.such.path") is None


def test_dump_lists_every_leaf_in_a_stable_order(files: Any) -> None:
    overlay = files("overlay.toml", '[tools]\nmode = "code"\n[[plugins]]\nid = "shell"\nenabled = false\n')
    rows = dump(load(files("base.toml", BASE), overlay))
    assert rows == [
        ("tools.mode", "code", "overlay.toml"),
        ("tools.max_parallel_sub_calls", 4, "base.toml"),
        ("tools.approval_grace_s", 5.0, "default"),
        ("code_runtime.isolation", "auto", "default"),
        ("code_runtime.timeout_s", 600.0, "default"),
        ("code_runtime.cpu_s", 60.0, "default"),
        ("code_runtime.memory_mb", 512, "default"),
        ("code_runtime.max_output_bytes", 67108864, "default"),
        ("code_runtime.preload", ["numpy"], "base.toml"),
        ("sessions.store", "sqlite", "default"),
        ("lifecycle.task_grace_s", 10.0, "default"),
        ("agents[main].id", "main", "base.toml"),
        ("agents[main].enabled", True, "default"),
        ("agents[main].provider", "scripted", "base.toml"),
        ("agents[main].allow", ["read", "write"], "base.toml"),
        ("plugins[fs].id", "fs", "base.toml"),
        ("plugins[fs].use", "workspace", "base.toml"),
        ("plugins[fs].enabled", True, "default"),
        ("plugins[fs].config.root", ".", "base.toml"),
        ("plugins[fs].config.allow_write", False, "base.toml"),
    ]


def test_dump_text_shows_one_aligned_leaf_per_line_with_its_source(files: Any) -> None:
    base = files(
        "base.toml",
        """
        [tools]
        mode = "code"
        [sessions]
        home = "/h"
        [[plugins]]
        id = "g"
        use = "guards"
        """,
    )
    assert dump_text(load(base)) == textwrap.dedent(
        """\
        tools.mode = "code"                       # base.toml
        tools.max_parallel_sub_calls = 10         # default
        tools.approval_grace_s = 5.0              # default
        code_runtime.isolation = "auto"           # default
        code_runtime.timeout_s = 600.0            # default
        code_runtime.cpu_s = 60.0                 # default
        code_runtime.memory_mb = 512              # default
        code_runtime.max_output_bytes = 67108864  # default
        code_runtime.preload = []                 # default
        sessions.store = "sqlite"                 # default
        sessions.home = "/h"                      # base.toml
        lifecycle.task_grace_s = 10.0             # default
        agents[main].id = "main"                  # default
        agents[main].enabled = true               # default
        plugins[g].id = "g"                       # base.toml
        plugins[g].use = "guards"                 # base.toml
        plugins[g].enabled = true                 # default
        plugins[g].config = {}                    # default"""
    )


def test_dump_text_quotes_odd_keys_escapes_line_breaks_and_caps_alignment(files: Any) -> None:
    base = files(
        "base.toml",
        """
        [[plugins]]
        id = "p"
        use = "u"
        [plugins.config]
        "a.b" = 1
        "x y" = "line\\u2028break\\nnext"
        "é" = "ü"
        long = "%s"
        """
        % ("v" * 80),
    )
    d = load(base)
    assert d.source_of('plugins[p].config."a.b"') == "base.toml"
    lines = dump_text(d).splitlines()
    assert len(lines) == len(dump(d))
    assert 'plugins[p].config."a.b" = 1' in lines[-4]
    assert lines[-3].startswith('plugins[p].config."x y" = "line\\u2028break\\nnext"')
    assert lines[-2].startswith('plugins[p].config."é" = "ü"')
    assert lines[-1] == f'plugins[p].config.long = "{"v" * 80}"  # base.toml'
    assert lines[0].index("#") == 62  # padded to the cap of 60, then two spaces


def test_dump_text_escapes_what_would_drive_a_terminal_in_values_keys_and_file_names(files: Any) -> None:
    """json escapes C0 controls but leaves C1 (``\\x9b`` is an 8-bit CSI) and bidi overrides raw."""
    name = files(
        "odd\x1b[2J.toml",
        """
        [[plugins]]
        id = "p"
        use = "u"
        [plugins.config]
        "k\\u202e" = "a\\u009b2Jb\\u2066c\\u007f"
        """,
    )
    (line,) = [line for line in dump_text(load(name)).splitlines() if ".config." in line]
    assert line == 'plugins[p].config."k\\u202e" = "a\\u009b2Jb\\u2066c\\u007f"  # odd\\u001b[2J.toml'
    assert json.loads(line.split(" = ", 1)[1].split("  #")[0]) == "a\x9b2Jb\u2066c\x7f"  # the same value


def test_dump_of_a_hand_built_deployment_marks_unknown_sources() -> None:
    d = Deployment(plugins=(PluginRow(id="p", use="u"),))
    assert dump(d)[-1] == ("plugins[p].config", {}, "unknown")
    assert d.sources == ("default",)


# --------------------------------------------------------------------------- default deployment


def test_the_default_deployment_has_the_built_in_rows(tmp_path: Path) -> None:
    d = default_deployment(tmp_path, env=NO_ENV)
    root = str(tmp_path)
    assert d.plugins == (
        PluginRow(id="workspace", use="workspace", config={"root": root}),
        PluginRow(id="bash", use="bash", config={"root": root}),
        PluginRow(id="approval", use="approval", config={"preset": "workspace-write", "root": root}),
        PluginRow(id="guards", use="guards", config={"root": root}),
        PluginRow(id="code-mode", use="code-mode"),
        PluginRow(id="scripted", use="scripted"),
        PluginRow(id="sessions", use="sqlite-sessions"),
    )
    assert d.agents == (AgentRow(id="main", provider="scripted"),)
    assert d.tools.mode == "native"
    assert d.sources == ("default",)
    assert {source for _, _, source in dump(d)} == {"default"}


def test_the_default_deployment_uses_an_absolute_root_and_honours_the_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    d = default_deployment(".", env={"DSH_TOOLS_MODE": "code", "DSH_HOME": "/h"})
    workspace = d.plugin("workspace")
    assert workspace is not None and workspace.config["root"] == str(tmp_path)
    assert d.tools.mode == "code" and d.source_of("tools.mode") == "env:DSH_TOOLS_MODE"
    assert d.sessions.home == "/h"


# --------------------------------------------------------------------------- values


def test_values_are_frozen(files: Any) -> None:
    d = load(files("base.toml", BASE))
    fs = d.plugins[0]
    with pytest.raises(TypeError):
        fs.config["root"] = "/"
    with pytest.raises(TypeError):
        d.provenance["tools.mode"] = "x"  # type: ignore[index]
    with pytest.raises(AttributeError):
        d.tools.mode = "code"  # type: ignore[misc]
    assert hash(fs) == hash(PluginRow(id="fs", use="workspace", config={"root": "."}))
    assert hash(d) == hash(d)


def test_a_plugin_row_freezes_any_mapping_it_is_given() -> None:
    from types import MappingProxyType

    row = PluginRow(id="p", use="u", config=MappingProxyType({"a": [1]}))
    assert row.config == {"a": [1]}
    with pytest.raises(TypeError):
        row.config["a"].append(2)


# --------------------------------------------------------------------------- plugin configs


SCHEMAS: dict[str, dict[str, Any]] = {
    "workspace": {
        "type": "object",
        "additionalProperties": False,
        "required": ["root"],
        "properties": {"root": {"type": "string"}, "allow_write": {"type": "boolean"}},
    },
    "bash": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "timeout_s": {"type": "number", "exclusiveMinimum": 0},
            "env": {"type": "object", "additionalProperties": {"type": "string"}},
            "args": {"type": "array", "items": {"type": "string"}},
        },
    },
}


def schema_for(row: PluginRow) -> dict[str, Any] | None:
    return SCHEMAS.get(row.use)


def plugin_error(d: Deployment) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate_plugin_configs(d, schema_for)
    return caught.value.message.splitlines()


def test_valid_plugin_configs_pass(files: Any, tmp_path: Path) -> None:
    validate_plugin_configs(load(files("base.toml", BASE)), schema_for)
    validate_plugin_configs(
        default_deployment(tmp_path, env=NO_ENV),
        lambda row: None if row.use == "code-mode" else {"type": "object"},
    )


def test_plugin_config_violations_name_row_path_and_the_file_that_set_the_leaf(files: Any) -> None:
    bad = files(
        "bad.toml",
        """
        [[plugins]]
        id = "shell"
        config = { timeout_s = -1, bogus = 1, env = { HOME = 5 }, args = ["ok", 3] }
        """,
    )
    assert plugin_error(load(files("base.toml", BASE), bad)) == [
        "plugins[shell].config.args[1]: 3 is not of type 'string' (from bad.toml)",
        "plugins[shell].config.bogus: unknown key (allowed: args, env, timeout_s) (from bad.toml)",
        "plugins[shell].config.env.HOME: 5 is not of type 'string' (from bad.toml)",
        "plugins[shell].config.timeout_s: -1 is less than or equal to the minimum of 0 (from bad.toml)",
    ]


def test_a_required_key_lost_by_a_whole_config_replacement_blames_the_overlay(files: Any) -> None:
    overlay = files("overlay.toml", '[[plugins]]\nid = "fs"\nconfig = { allow_write = true }\n')
    assert plugin_error(load(files("base.toml", BASE), overlay)) == [
        "plugins[fs].config: 'root' is a required property (from overlay.toml)"
    ]


def test_a_config_checked_against_a_plugin_a_later_file_chose_names_that_file_too(files: Any) -> None:
    """Only base.toml was blamed, though its config was right for its plugin: overlay.toml had switched the
    row to another plugin and kept the config, and no message named it."""
    overlay = files("overlay.toml", '[[plugins]]\nid = "fs"\nuse = "bash"\n')
    assert plugin_error(load(files("base.toml", BASE), overlay)) == [
        "plugins[fs].config.allow_write: unknown key (allowed: args, env, timeout_s) (from base.toml; the row's "
        "use = 'bash' is from overlay.toml, a later file)",
        "plugins[fs].config.root: unknown key (allowed: args, env, timeout_s) (from base.toml; the row's "
        "use = 'bash' is from overlay.toml, a later file)",
    ]
    # A config given with (or after) the use is that file's alone.
    both = files("both.toml", '[[plugins]]\nid = "fs"\nuse = "bash"\nconfig = { root = "." }\n')
    assert plugin_error(load(files("base.toml", BASE), both)) == [
        "plugins[fs].config.root: unknown key (allowed: args, env, timeout_s) (from both.toml)"
    ]
    later = files("later.toml", '[[plugins]]\nid = "fs"\nconfig = { root = "." }\n')
    assert plugin_error(load(files("base.toml", BASE), overlay, later)) == [
        "plugins[fs].config.root: unknown key (allowed: args, env, timeout_s) (from later.toml)"
    ]


def test_a_row_that_never_got_a_config_is_blamed_on_the_file_that_added_it(files: Any) -> None:
    overlay = files("overlay.toml", '[[plugins]]\nid = "fs2"\nuse = "workspace"\n')
    assert plugin_error(load(files("base.toml", BASE), overlay)) == [
        "plugins[fs2].config: 'root' is a required property (from overlay.toml)"
    ]


def test_a_plugin_without_a_schema_accepts_only_an_empty_config(files: Any) -> None:
    base = files(
        "base.toml",
        """
        [[plugins]]
        id = "g"
        use = "guards"
        [[plugins]]
        id = "g2"
        use = "guards"
        config = { strict = true }
        """,
    )
    assert plugin_error(load(base)) == [
        "plugins[g2].config.strict: unknown key (plugin 'guards' takes no config) (from base.toml)"
    ]


def test_violations_of_every_row_are_collected_in_row_order(files: Any) -> None:
    base = files(
        "base.toml",
        """
        [[plugins]]
        id = "b"
        use = "bash"
        config = { timeout_s = 0 }
        [[plugins]]
        id = "a"
        use = "workspace"
        config = { root = 1, extra = 2 }
        """,
    )
    assert plugin_error(load(base)) == [
        "plugins[b].config.timeout_s: 0 is less than or equal to the minimum of 0 (from base.toml)",
        "plugins[a].config.extra: unknown key (allowed: allow_write, root) (from base.toml)",
        "plugins[a].config.root: 1 is not of type 'string' (from base.toml)",
    ]


def test_unevaluated_and_pattern_only_extra_keys_are_named_individually() -> None:
    schema = {
        "type": "object",
        "patternProperties": {"^x_": {"type": "integer"}},
        "additionalProperties": False,
        "properties": {"nested": {"unevaluatedProperties": False, "type": "object"}},
    }
    d = compose(
        [
            (
                "c.toml",
                {"plugins": [{"id": "p", "use": "u", "config": {"x_ok": 1, "nope": 2, "nested": {"k": 1}}}]},
            )
        ],
        env=NO_ENV,
    )
    with pytest.raises(ConfigError) as caught:
        validate_plugin_configs(d, lambda row: schema)
    assert caught.value.message.splitlines() == [
        "plugins[p].config.nested.k: unknown key (no keys are allowed here) (from c.toml)",
        "plugins[p].config.nope: unknown key (allowed: nested) (from c.toml)",
    ]


def test_a_config_path_under_a_quoted_key_finds_its_source() -> None:
    schema = {
        "type": "object",
        "properties": {"a.b": {"type": "object", "properties": {"c": {"type": "string"}}}},
    }
    d = compose([("q.toml", {"plugins": [{"id": "p", "use": "u", "config": {"a.b": {"c": 1}}}]})], env=NO_ENV)
    with pytest.raises(ConfigError) as caught:
        validate_plugin_configs(d, lambda row: schema)
    assert caught.value.message == "plugins[p].config.\"a.b\".c: 1 is not of type 'string' (from q.toml)"


def test_a_hand_built_deployment_without_provenance_is_blamed_on_default() -> None:
    d = Deployment(plugins=(PluginRow(id="p", use="u", config={"k": 1}),))
    with pytest.raises(ConfigError) as caught:
        validate_plugin_configs(d, lambda row: None)
    assert caught.value.message == "plugins[p].config.k: unknown key (plugin 'u' takes no config) (from default)"


def test_an_invalid_plugin_schema_is_a_schema_definition_error(files: Any) -> None:
    d = load(files("base.toml", BASE))
    with pytest.raises(SchemaDefinitionError, match="plugin 'workspace' \\(row 'fs'\\) config"):
        validate_plugin_configs(d, lambda row: {"type": "nonsense"})


MENU_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"menu": {"$ref": "#/$defs/node"}},
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"label": {"type": "string"}, "items": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        }
    },
}


def test_a_config_too_deep_for_a_recursive_schema_is_a_config_error_naming_row_and_file(files: Any) -> None:
    """jsonschema recurses: a 600-deep menu under a recursive schema escaped as a raw RecursionError."""
    node: dict[str, Any] = {"label": "leaf"}
    for depth in range(600):
        node = {"label": f"level {depth}", "items": [node]}
    d = compose(
        [
            (
                "menu.toml",
                {
                    "plugins": [
                        {"id": "menu", "use": "menus", "config": {"menu": node}},
                        {"id": "sh", "use": "bash", "config": {"timeout_s": 0}},
                    ]
                },
            )
        ],
        env=NO_ENV,
    )
    with pytest.raises(ConfigError) as caught:
        validate_plugin_configs(d, lambda row: MENU_SCHEMA if row.use == "menus" else schema_for(row))
    first, second = caught.value.message.splitlines()
    assert first.startswith(
        "plugins[menu].config: cannot be checked against the config schema of plugin 'menus': "
        "validation recursed too deeply"
    )
    assert "nests 1202 levels" in first and first.endswith("(from menu.toml)")
    # the other rows are still checked
    assert second == "plugins[sh].config.timeout_s: 0 is less than or equal to the minimum of 0 (from menu.toml)"
    # a shallow menu under the same schema is fine
    shallow = compose(
        [
            (
                "m.toml",
                {
                    "plugins": [
                        {"id": "m", "use": "menus", "config": {"menu": {"label": "root", "items": [{"label": "a"}]}}}
                    ]
                },
            )
        ],
        env=NO_ENV,
    )
    validate_plugin_configs(shallow, lambda row: MENU_SCHEMA)


def test_a_ref_cycle_in_a_plugin_config_schema_is_a_config_error_naming_row_and_file() -> None:
    cyclic = {
        "type": "object",
        "properties": {"limits": {"$ref": "#/$defs/limits"}},
        "$defs": {"limits": {"allOf": [{"$ref": "#/$defs/limits"}]}},
    }
    d = compose(
        [("deploy.toml", {"plugins": [{"id": "lim", "use": "limiter", "config": {"limits": {"rps": 5}}}]})], env=NO_ENV
    )
    with pytest.raises(ConfigError) as caught:
        validate_plugin_configs(d, lambda row: cyclic)
    message = caught.value.message
    assert message.startswith(
        "plugins[lim].config: cannot be checked against the config schema of plugin "
        "'limiter': validation recursed too deeply"
    )
    assert "$ref cycle" in message and message.endswith("(from deploy.toml)")


@pytest.mark.parametrize(("key", "value"), [("memory_mb", (1 << 30) + 1), ("cpu_s", 1e10)])
def test_budgets_the_worker_cannot_be_given_are_refused_by_the_config(files: Any, key: str, value: object) -> None:
    """Before, every isolation level's probe failed (its rlimits overflowed) with only an exit code."""
    from dsh_core.coderuntime.seam import MAX_CPU_S, MAX_MEMORY_MB, CodeRuntimeConfig

    with pytest.raises(ConfigError) as caught:
        load(files("big.toml", f"[code_runtime]\n{key} = {value!r}\n"))
    assert "big.toml" in caught.value.message and key in caught.value.message
    with pytest.raises(ValueError, match=f"CodeRuntimeConfig.{key} must be <= "):
        CodeRuntimeConfig(**{key: value})  # type: ignore[arg-type]
    # The config's maxima are the runtime's.
    schema = DEPLOYMENT_SCHEMA["properties"]["code_runtime"]["properties"]
    assert (schema["memory_mb"]["maximum"], schema["cpu_s"]["maximum"]) == (MAX_MEMORY_MB, MAX_CPU_S)
    assert CodeRuntimeConfig(memory_mb=MAX_MEMORY_MB, cpu_s=MAX_CPU_S).memory_mb == MAX_MEMORY_MB


def test_dump_never_shows_the_credentials_of_a_url(files: Any) -> None:
    toml = (
        '[[plugins]]\nid = "llm"\nuse = "openai"\n[plugins.config]\nbase_url = "https://me:hunter2@llm.example/v1"\n'
        'mirrors = ["http://a:b@x.example/", "http://plain.example/"]\n'
    )
    rows = dump(load(files("base.toml", toml)))
    shown = {path: value for path, value, _ in rows}
    assert shown["plugins[llm].config.base_url"] == "https://***@llm.example/v1"
    assert shown["plugins[llm].config.mirrors"] == ["http://***@x.example/", "http://plain.example/"]
    assert "hunter2" not in dump_text(load(files("base.toml", toml)))


def test_url_credentials_are_hidden_up_to_the_authoritys_last_at_as_a_url_parser_reads_them() -> None:
    from dsh_core.config import without_url_credentials

    assert without_url_credentials("https://a@b@host/x") == "https://***@host/x"
    assert (
        without_url_credentials("see https://u:p@h/v1 or http://host/p@x") == "see https://***@h/v1 or http://host/p@x"
    )


def test_has_url_credentials_agrees_with_what_without_url_credentials_hides() -> None:
    from dsh_core.config import has_url_credentials, without_url_credentials

    for text in ("https://ghp_abc@github.com", "redis://:pw@h/0", "x https://u:p@h y", "https://a@b@host/x"):
        assert has_url_credentials(text) and without_url_credentials(text) != text, text
    for text in ("https://host/p@x", "git@github.com:o/r.git", "user@example.com", "https://h?q=a"):
        assert not has_url_credentials(text) and without_url_credentials(text) == text, text


def test_dump_never_shows_a_value_whose_key_names_a_secret(files: Any) -> None:
    """A key, token or password written into a plugin's config (a bash env, a header) was dumped in clear."""
    toml = (
        '[[plugins]]\nid = "sh"\nuse = "bash"\n[plugins.config]\nroot = "/srv"\napi_key_env = "DSH_API_KEY"\n'
        'max_tokens = 4096\napi_key = "sk-live-1"\nauth = "u:hunter3"\nprivateKey = "k"\n'
        'tokens = ["t-1", "t-2"]\n'
        '[plugins.config.env]\nGITHUB_TOKEN = "ghp_secret"\nPGPASSWORD = "pw"\nLANG = "C.UTF-8"\n'
        '[plugins.config.headers]\nAuthorization = "Bearer abc"\nAccept = "text/html"\n'
        '[plugins.config.credentials]\nuser = "me"\nport = 5432\n'
    )
    deployment = load(files("base.toml", toml))
    shown = {path: value for path, value, _ in dump(deployment)}
    cfg = "plugins[sh].config"
    assert shown[f"{cfg}.root"] == "/srv"
    assert shown[f"{cfg}.api_key_env"] == "DSH_API_KEY"  # the name of a variable, not its value
    assert shown[f"{cfg}.max_tokens"] == 4096
    assert shown[f"{cfg}.env.LANG"] == "C.UTF-8" and shown[f"{cfg}.headers.Accept"] == "text/html"
    for key in (
        "api_key",
        "auth",
        "privateKey",
        "env.GITHUB_TOKEN",
        "env.PGPASSWORD",
        "headers.Authorization",
        "credentials.user",
    ):
        assert shown[f"{cfg}.{key}"] == "***", key
    assert shown[f"{cfg}.credentials.port"] == 5432  # a secret is text: numbers (max_tokens) stay readable
    assert shown[f"{cfg}.tokens"] == ["***", "***"]
    text = dump_text(deployment)
    for secret in ("sk-live-1", "hunter3", "ghp_secret", "Bearer", "t-1"):
        assert secret not in text
    # The deployment itself keeps the values: only what is shown hides them.
    assert deployment.plugins[0].config["env"]["GITHUB_TOKEN"] == "ghp_secret"


def test_dump_hides_the_bash_env_names_bash_itself_treats_as_credentials(files: Any) -> None:
    """bash keeps *_PASS and *_DSN variables from its commands as credentials; dumping the same names
    in a bash env printed them in clear (DB_PASS, a key=value DSN: no URL whose password is hidden)."""
    toml = (
        '[[plugins]]\nid = "sh"\nuse = "bash"\n[plugins.config]\nroot = "/srv"\n'
        '[plugins.config.env]\nDB_PASS = "hunter2"\nPG_DSN = "host=db password=hunter3"\n'
        'PASS_THROUGH = "yes"\n'
    )
    shown = {path: value for path, value, _ in dump(load(files("base.toml", toml)))}
    cfg = "plugins[sh].config.env"
    assert shown[f"{cfg}.DB_PASS"] == "***" and shown[f"{cfg}.PG_DSN"] == "***"
    assert shown[f"{cfg}.PASS_THROUGH"] == "yes"  # a last word only, as for key


@pytest.mark.parametrize("kind", ["plugins", "agents"])
def test_a_single_bracket_row_table_says_to_write_double_brackets(files: Any, kind: str) -> None:
    """`[plugins]` for `[[plugins]]` was answered with a Python dict's repr 'is not of type array'."""
    assert config_error(files("f.toml", f'[{kind}]\nid = "w"\nuse = "workspace"\n')) == (
        f"f.toml: {kind}: is a table, not an array of tables: write each row as [[{kind}]] (double brackets), "
        f"not [{kind}]"
    )


def test_approval_timeout_is_unset_by_default_and_a_positive_finite_number_when_given(files: Any) -> None:
    """[tools] approval_timeout_s: none by default (an ask waits for its person); else seconds > 0, finite."""
    assert load(files("empty.toml", "")).tools.approval_timeout_s is None
    d = load(files("t.toml", "[tools]\napproval_timeout_s = 30\n"))
    assert d.tools.approval_timeout_s == 30.0 and type(d.tools.approval_timeout_s) is float
    assert ("tools.approval_timeout_s", 30.0, "t.toml") in dump(d)
    for bad in ("0", "-1", "nan", "inf", '"30"'):
        problem = config_error(files("bad.toml", f"[tools]\napproval_timeout_s = {bad}\n"))
        assert "tools.approval_timeout_s" in problem, (bad, problem)


@pytest.mark.parametrize(
    ("key", "default", "given", "whole"),
    # Each given alone, so on the right side of the other's default: the approval grace must stay below the task's.
    [("tools.approval_grace_s", 5.0, 0.25, 2), ("lifecycle.task_grace_s", 10.0, 7.5, 8)],
)
def test_a_grace_has_its_default_and_is_a_positive_finite_number_when_given(
    files: Any, key: str, default: float, given: float, whole: int
) -> None:
    """How long a withdrawn ask's channel, or a disposed scope's cancelled task, is waited for: set per deployment."""
    section, name = key.split(".")
    defaults = load(files("empty.toml", ""))
    assert getattr(getattr(defaults, section), name) == default and (key, default, "default") in dump(defaults)
    d = load(files("t.toml", f"[{section}]\n{name} = {given}\n"))
    assert getattr(getattr(d, section), name) == given and (key, given, "t.toml") in dump(d)
    assert type(getattr(getattr(load(files("i.toml", f"[{section}]\n{name} = {whole}\n")), section), name)) is float
    for bad in ("0", "-1", "nan", "inf", '"5"', "true"):
        problem = config_error(files("bad.toml", f"[{section}]\n{name} = {bad}\n"))
        assert problem.startswith(f"bad.toml: {key}: "), (bad, problem)


def test_the_grace_defaults_are_the_runtimes_and_the_scopes() -> None:
    """The config keeps its own copy of the defaults (loading a config imports no runtime): they must agree."""
    from dsh_core.config import LifecycleSection
    from dsh_core.runtime import APPROVAL_GRACE_S
    from dsh_core.scope import TASK_GRACE_S

    assert (ToolsSection().approval_grace_s, LifecycleSection().task_grace_s) == (APPROVAL_GRACE_S, TASK_GRACE_S)


@pytest.mark.parametrize(
    "key", ["tools.approval_timeout_s", "tools.approval_grace_s", "lifecycle.task_grace_s", "code_runtime.timeout_s"]
)
def test_seconds_too_large_for_a_float_are_a_config_error_naming_the_key_and_source(key: str) -> None:
    """No TOML integer is that large, but a composed document can hold one: it raised OverflowError."""
    section, name = key.split(".")
    with pytest.raises(ConfigError) as caught:
        compose([("big.json", {section: {name: 10**400}})], env=NO_ENV)
    assert caught.value.message.startswith(f"big.json: {key}: must be a positive, finite number of seconds, got ")
