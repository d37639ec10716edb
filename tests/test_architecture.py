"""The walls of DESIGN.md and the code-quality bars, checked by the suite itself."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STDLIB = sys.stdlib_module_names


def imports_of(path: Path) -> list[str]:
    """Top-level module names a file imports (absolute imports only)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def python_files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_dsh_core_never_imports_dsh_plugins() -> None:
    offenders = [
        str(p) for p in python_files("dsh_core") if any(name.split(".")[0] == "dsh_plugins" for name in imports_of(p))
    ]
    assert offenders == []


def test_worker_code_imports_the_standard_library_only() -> None:
    offenders = {
        str(p): name
        for p in python_files("dsh_core/coderuntime/worker")
        for name in imports_of(p)
        if name.split(".")[0] not in STDLIB
    }
    assert offenders == {}


def test_only_the_hooks_facade_touches_pluggy() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in python_files("dsh_core")
        if p.name != "hooks.py" and "pluggy" in {n.split(".")[0] for n in imports_of(p)} and "testing" not in p.parts
    ]
    assert offenders == []
    hook_calls = [
        str(p.relative_to(ROOT))
        for p in python_files("dsh_core")
        if p.name != "hooks.py" and ".hook.dsh_" in p.read_text()
    ]
    assert hook_calls == []


@pytest.mark.slow
def test_ruff_is_clean() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", str(ROOT)], check=False, capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_ruff_format_leaves_every_file_as_it_is() -> None:
    """One layout for the whole tree, so a diff shows behaviour, not someone's line breaks."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", str(ROOT)],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_strict_is_clean_on_dsh_core_and_the_bundled_plugins() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy"], check=False, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
