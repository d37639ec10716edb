"""What importing dsh costs: the packages re-export lazily, and `dsh --help` loads none of the heavy machinery.

What a check imports is looked at in a fresh interpreter: in this one, the suite has imported everything.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import click
import pytest

ROOT = Path(__file__).resolve().parent.parent

#: What `dsh --help` and the package imports must not load: the event loop, validation, the model,
#: the HTTP client, the Code Mode runtime host and the harness boot.
HEAVY = ["asyncio", "jsonschema", "cattrs", "httpx", "dsh_core.coderuntime.host", "dsh_core.boot", "dsh_core.model"]

PACKAGES = ["dsh_core", "dsh_core.agent", "dsh_core.sessions"]


def fresh(script: str) -> Any:
    """Run ``script`` in a fresh interpreter and return the JSON document it prints last."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, check=False, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_importing_the_packages_loads_none_of_the_heavy_modules() -> None:
    loaded = fresh(f"""
        import json, sys
        import {", ".join(PACKAGES)}
        print(json.dumps([name for name in {HEAVY!r} if name in sys.modules]))
    """)
    assert loaded == []


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves_and_is_listed_by_dir(package: str) -> None:
    problems = fresh(f"""
        import importlib, json
        package = importlib.import_module({package!r})
        listed = dir(package)
        problems = [f"{{name}}: not in dir()" for name in package.__all__ if name not in listed]
        for name in package.__all__:
            try:
                getattr(package, name)
            except AttributeError as error:
                problems.append(f"{{name}}: {{error}}")
        namespace = {{}}
        exec("from {package} import *", namespace)
        problems += [f"{{name}}: missing after import *" for name in package.__all__ if name not in namespace]
        print(json.dumps(problems))
    """)
    assert problems == []


def type_checking_imports(package: str) -> dict[str, str]:
    """The names the package's ``if TYPE_CHECKING:`` block imports (what mypy sees), each with its module."""
    path = ROOT / Path(*package.split(".")) / "__init__.py"
    names: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom) and statement.module is not None
                names.update({alias.asname or alias.name: statement.module for alias in statement.names})
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_what_type_checkers_see_is_what_the_package_exports(package: str) -> None:
    module = importlib.import_module(package)
    seen = type_checking_imports(package)
    assert sorted(seen) == sorted(module.__all__)
    assert [
        name
        for name, source in seen.items()
        if getattr(module, name) is not getattr(importlib.import_module(source), name)
    ] == []


@pytest.mark.parametrize("package", PACKAGES)
def test_an_unknown_name_raises_the_usual_attribute_error(package: str) -> None:
    raised = fresh(f"""
        import importlib, json
        package = importlib.import_module({package!r})
        try:
            package.no_such_name
        except AttributeError as error:
            print(json.dumps([str(error), error.name, error.obj is package, hasattr(package, "no_such_name")]))
    """)
    assert raised == [f"module {package!r} has no attribute 'no_such_name'", "no_such_name", True, False]


def command_paths(group: click.Group, ctx: click.Context, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of every command and group under ``group`` (``dsh``'s own is ``()``)."""
    paths = [path]
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        if isinstance(command, click.Group):
            paths += command_paths(command, click.Context(command, parent=ctx, info_name=name), (*path, name))
        else:
            paths.append((*path, name))
    return paths


def all_helps() -> list[list[str]]:
    from dsh_core.cli import main

    paths = command_paths(main, click.Context(main, info_name="dsh"))
    return [[], *([*path, "--help"] for path in paths)]


def test_the_helps_cover_every_command_and_group() -> None:
    assert all_helps() == [
        [],
        ["--help"],
        ["config", "--help"],
        ["config", "dump", "--help"],
        ["demo", "--help"],
        ["run-code", "--help"],
        ["sdk", "--help"],
        ["sessions", "--help"],
        ["sessions", "list", "--help"],
        ["sessions", "release", "--help"],
        ["sessions", "show", "--help"],
        ["tools", "--help"],
        ["tools", "call", "--help"],
        ["tools", "list", "--help"],
    ]


@pytest.mark.parametrize("args", all_helps(), ids=lambda args: " ".join(["dsh", *args]))
def test_a_help_loads_none_of_the_heavy_modules(args: list[str]) -> None:
    shown = fresh(f"""
        import contextlib, io, json, sys
        from dsh_core.cli import main

        status = None
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                main({args!r}, prog_name="dsh")
            except SystemExit as exit:
                status = exit.code
        print(json.dumps([status, out.getvalue().partition("\\n")[0], [n for n in {HEAVY!r} if n in sys.modules]]))
    """)
    status, first_line, loaded = shown
    assert (status, loaded) == (0, [])
    assert first_line.startswith(f"Usage: {' '.join(['dsh', *args[:-1]])} [OPTIONS]")


def test_the_sdk_languages_of_the_cli_are_those_of_the_renderers() -> None:
    # Named in the CLI module so that `dsh sdk --help` does not import the renderers.
    from dsh_core.codemode.cli import SDK_LANGUAGES
    from dsh_core.codemode.sdk import SDK_RENDERERS

    assert list(SDK_LANGUAGES) == sorted(SDK_RENDERERS)
