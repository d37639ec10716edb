"""The README documents every hook with its exact signature, and its plugin walk-through works."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from dsh_hookspecs import PROJECT, SPEC_MODULES

README = Path(__file__).resolve().parent.parent / "README.md"


def _section(name: str) -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(rf"<!-- section:{name} -->(.*?)<!-- /section:{name} -->", text, re.S)
    assert match, f"README.md has no {name} section"
    return match.group(1)


def _hookspecs() -> dict[str, str]:
    found: dict[str, str] = {}
    for module_name in SPEC_MODULES:
        module = importlib.import_module(module_name)
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if getattr(function, f"{PROJECT}_spec", None) is not None:
                found[name] = f"{name}({', '.join(inspect.signature(function).parameters)})"
    return found


def test_every_hookspec_is_documented_with_its_exact_signature() -> None:
    """Each hook has a heading ### `dsh_name(arg1, arg2)` in the hooks section, and no stale ones remain."""
    headings = set(re.findall(r"^### `(dsh_\w+\([^)]*\))`$", _section("hooks"), re.M))
    specs = _hookspecs()
    assert len(specs) >= 12
    missing = sorted(set(specs.values()) - headings)
    assert not missing, f"undocumented (or wrong signature) in README hooks section: {missing}"
    stale = sorted(h for h in headings if h.split("(")[0] not in specs)
    assert not stale, f"README documents hooks that do not exist: {stale}"


def _code_blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


@pytest.mark.slow
def test_the_writing_a_plugin_walk_through_passes_the_kit(tmp_path: Path) -> None:
    """The README's example package, made importable with its entry point, passes all 13 checks."""
    section = _section("plugins")
    python = [block for block in _code_blocks(section, "python") if "class Weather" in block]
    test = [block for block in _code_blocks(section, "python") if "ToolPluginConformance" in block]
    assert python and test
    (tmp_path / "dsh_weather.py").write_text(python[0])
    (tmp_path / "test_conformance.py").write_text(test[0])
    dist = tmp_path / "dsh_weather-0.1.0.dist-info"  # what `pip install` would write
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dsh-weather\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[dsh.plugins]\nweather = dsh_weather:plugin\n")
    assert 'weather = "dsh_weather:plugin"' in section
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:hypothesispytest",
            "test_conformance.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, textwrap.indent(completed.stdout[-3000:], "  ")
    assert "13 passed" in completed.stdout


def test_the_cpu_budget_sentence_says_how_the_hosts_reading_is_charged() -> None:
    """Past a run's first 64 KiB of small reads the host times one read in eight at random (9358183);
    the README still said every read was timed."""
    from dsh_core.coderuntime import host

    section = _section("isolation")
    assert (host._TIMED_FRAME_BYTES, host._SAMPLED_READS) == (64 * 1024, 8)
    assert (
        "each read bringing 64 KiB or more, and, once the smaller ones add up to 64 KiB, one smaller read "
        "in eight, at random, charged eight times over" in section
    )


def _config_block() -> str:
    blocks = _code_blocks(_section("config"), "toml")
    assert blocks, "README.md's config section has no toml example"
    return blocks[0]


def test_the_config_example_shows_the_code_defaults_and_limits() -> None:
    """The example deployment's [tools], [code_runtime] and [lifecycle] values are the defaults a missing key gets."""
    import tomllib

    import attrs

    from dsh_core.coderuntime.seam import MAX_CPU_S, MAX_MEMORY_MB, CodeRuntimeConfig
    from dsh_core.config import DEPLOYMENT_SCHEMA, CodeRuntimeSection, LifecycleSection, ToolsSection, compose

    example = tomllib.loads(_config_block())
    composed = compose([("empty.toml", {})], env={})  # what a file that sets none of the keys gets
    sections = {"tools": ToolsSection(), "code_runtime": CodeRuntimeSection(), "lifecycle": LifecycleSection()}
    assert {name: getattr(composed, name) for name in sections} == sections
    for name, section in sections.items():
        defaults = attrs.asdict(section)
        for key, value in example[name].items():
            assert value == defaults[key], f"README shows [{name}] {key} = {value!r}; the default is {defaults[key]!r}"
    runtime = CodeRuntimeConfig()
    for key, value in example["code_runtime"].items():
        assert getattr(runtime, key) == value, f"CodeRuntimeConfig.{key} default differs from [code_runtime]'s"
    limits = DEPLOYMENT_SCHEMA["properties"]["code_runtime"]["properties"]
    assert (limits["cpu_s"]["maximum"], limits["memory_mb"]["maximum"]) == (MAX_CPU_S, MAX_MEMORY_MB)
    assert "cpu_s = 60                      # at most 1e9" in _config_block() and MAX_CPU_S == 1e9
    assert "# at most 2**30 (1 PiB)" in _config_block() and MAX_MEMORY_MB == 2**30


def test_every_deployment_config_key_is_documented() -> None:
    """Each key a deployment file may set (every section, agent row and plugin row key) is named in README.md."""
    from dsh_core.config import DEPLOYMENT_SCHEMA

    text = README.read_text(encoding="utf-8")
    missing = []
    for section, schema in DEPLOYMENT_SCHEMA["properties"].items():
        keys = schema["items"]["properties"] if schema["type"] == "array" else schema["properties"]
        heading = f"[[{section}]]" if schema["type"] == "array" else f"[{section}]"
        if heading not in text:
            missing.append(heading)
        missing += [
            f"{heading} {key}" for key in keys if not re.search(rf"`[^`\n]*\b{key}\b[^`\n]*`|^{key} = ", text, re.M)
        ]
    assert not missing, f"config keys README.md never names: {missing}"


def _plugin_keys(name: str) -> set[str]:
    from dsh_core.plugins import config_schema_of

    factory = importlib.metadata.entry_points(group="dsh.plugins", name=name)[name].load()
    return set((config_schema_of(factory) or {}).get("properties", {}))


@pytest.mark.parametrize("name", ["workspace", "bash", "approval", "guards"])
def test_the_plugin_table_lists_exactly_each_builtin_plugins_config_keys(name: str) -> None:
    """The config column of the Using plugins table names every key of the plugin's schema, and no other."""
    rows = [line for line in _section("plugins").splitlines() if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1, f"no single row for {name} in the plugin table"
    cell = rows[0].rstrip(" |").rsplit(" | ", 1)[1]
    while re.search(r"\([^()]*\)", cell):  # asides name other things (default values, examples)
        cell = re.sub(r"\([^()]*\)", "", cell)
    documented = set(re.findall(r"`(\w+)`", cell))
    assert documented == _plugin_keys(name), f"{name}: README {sorted(documented)}, schema {sorted(_plugin_keys(name))}"


@pytest.mark.parametrize(
    ("name", "where"),
    [("scripted", "- `scripted`"), ("openai", "- `openai`"), ("sqlite-sessions", "The default store")],
)
def test_every_builtin_provider_and_store_config_key_is_documented(name: str, where: str) -> None:
    """Each key of the provider's (store's) config schema is named in its paragraph of the agents section."""
    section = _section("agents")
    start = section.index(where)
    paragraph = re.split(r"\n\n|\n- ", section[start:])[0]
    missing = sorted(key for key in _plugin_keys(name) if f"`{key}`" not in paragraph and f"{key} = " not in paragraph)
    assert not missing, f"config keys of plugin {name!r} its README paragraph never names: {missing}"


def test_every_conformance_kit_option_is_documented() -> None:
    """Each ``--dsh-conformance*`` pytest option the kit registers is named in the plugins section."""
    from dsh_core.testing import pytest_plugin

    class Group:
        def __init__(self) -> None:
            self.names: list[str] = []

        def addoption(self, *names: str, **_: object) -> None:
            self.names.extend(names)

    group = Group()

    class Parser:
        def getgroup(self, *_: object) -> Group:
            return group

    pytest_plugin.pytest_addoption(Parser())  # type: ignore[arg-type]
    assert group.names
    missing = [name for name in group.names if f"`{name}" not in _section("plugins")]
    assert not missing, f"conformance kit options README.md never names: {missing}"


def test_where_things_live_names_files_and_functions_that_exist() -> None:
    """Every path in the "Where things live" table exists, and every ``Class.member`` it names is in that row's
    first file (files move; the table is the map readers use to find the code)."""
    root = README.parent
    problems = []
    for row in _section("architecture").splitlines()[4:]:
        tokens = re.findall(r"`([^`]+)`", row)
        paths = [t for t in tokens if re.fullmatch(r"[\w./]+(\.py|/)", t)]
        folders = [root, root / "dsh_core"]
        for path in paths:  # a bare file name is in a folder the row named before it
            found = next((folder / path for folder in folders if (folder / path).exists()), None)
            if found is None:
                problems.append(f"no such file: {path}")
            elif found.is_dir():
                folders.append(found)
        module_path = next((p for p in paths if p.endswith(".py")), None)
        for name in (t for t in tokens if re.fullmatch(r"[A-Z]\w*\.\w+", t)):
            assert module_path, row
            module = importlib.import_module(module_path.removesuffix(".py").replace("/", "."))
            owner, member = name.split(".")
            if not hasattr(getattr(module, owner, None), member):
                problems.append(f"{module_path} has no {name}")
    assert not problems, problems


def test_every_dsh_command_line_in_the_readme_parses() -> None:
    """Each ``dsh ...`` the README shows (console examples and inline code) names commands and options that exist:
    with ``--help`` appended, click parses it all and prints help instead of a usage error."""
    import shlex

    from click.testing import CliRunner

    from dsh_core.cli import main

    text = README.read_text(encoding="utf-8")
    lines = {
        line[2:].split("  #")[0].strip()
        for block in _code_blocks(text, "console")
        for line in block.splitlines()
        if line.startswith("$ dsh ")
    }
    lines |= set(re.findall(r"`(dsh [^`]*)`", text))
    assert len(lines) >= 10
    runner = CliRunner()
    failing = {}
    for line in sorted(lines):
        result = runner.invoke(main, [*shlex.split(line)[1:], "--help"])
        if result.exit_code != 0:
            failing[line] = result.output.strip().splitlines()[-1:]
    assert not failing, failing


def test_the_session_store_hookspec_tells_store_authors_of_create() -> None:
    """``open_store`` calls ``factory(home, create=False)`` for the read-only session commands; the
    hookspec, what a store author reads, still said only ``factory(home)`` (the README said more)."""
    from hookspecs import agents

    for text in (inspect.getdoc(agents.dsh_register_session_stores) or "", _section("hooks")):
        flat = " ".join(text.split())
        assert "factory(home, create=False)" in flat.replace("``", "`").replace("`", ""), text
        assert "**" in flat and "named" in flat, text  # **options alone is not asked


def test_the_conformance_kit_paragraph_gives_the_kits_own_limits_and_graces() -> None:
    """The Testing plugins paragraph promises how long the kit waits for a call: 60 s (``CALL_TIMEOUT_S``), 5 s more
    once aborted and again once cancelled (``STUCK_GRACE_S``), plus at most dsh's approval grace for a call in its ask
    (``APPROVAL_GRACE_S``); nothing tied those numbers to the constants."""
    from dsh_core.runtime import APPROVAL_GRACE_S
    from dsh_core.testing import checks

    text = " ".join(_section("plugins").split())
    assert (checks.CALL_TIMEOUT_S, checks.STUCK_GRACE_S, APPROVAL_GRACE_S) == (60, 5, 5)
    assert "checks make (default 60, `CALL_TIMEOUT_S`:" in text
    assert "aborted through its signal and cancelled if still running 5 s later" in text
    assert "given the runtime's approval grace on top (at most 5 s, `APPROVAL_GRACE_S`)" in text
    assert "is given 5 s more (plus the approval grace if in its ask)" in text
    assert checks.Target("p").abort_bound_s == 2 and "sets the `abort` check's bound (default 2)" in text
    assert "returns within the bound (default 2 s)" in text
