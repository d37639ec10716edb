"""The benchmarks make their peers' venv themselves (bench/peers_env.py), offline here."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = ("--quiet", "--no-index")


def _peers_env() -> ModuleType:
    spec = importlib.util.spec_from_file_location("peers_env", ROOT / "bench" / "peers_env.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peers_env = _peers_env()


@pytest.fixture
def requirements(tmp_path: Path) -> Path:
    path = tmp_path / "requirements.txt"
    path.write_text("# nothing to install\n", encoding="utf-8")
    return path


def test_makes_a_venv_once_and_reuses_it(tmp_path: Path, requirements: Path) -> None:
    venv = tmp_path / "peers"
    python, note = peers_env.ensure_peers_python(venv, requirements, OFFLINE)
    assert python == venv / "bin" / "python", note
    assert "made" in note
    ran = subprocess.run(
        [str(python), "-c", "import sys; print(sys.prefix)"], check=True, capture_output=True, text=True
    )
    assert ran.stdout.strip() == str(venv)
    (venv / "left-by-the-first-fill").touch()
    again, note = peers_env.ensure_peers_python(venv, requirements, OFFLINE)
    assert again == python and "up to date" in note
    assert (venv / "left-by-the-first-fill").exists()  # reused, not remade


def test_changed_requirements_make_the_venv_again(tmp_path: Path, requirements: Path) -> None:
    venv = tmp_path / "peers"
    assert peers_env.ensure_peers_python(venv, requirements, OFFLINE)[0] is not None
    (venv / "left-by-the-first-fill").touch()
    requirements.write_text("# pins changed\n", encoding="utf-8")
    python, note = peers_env.ensure_peers_python(venv, requirements, OFFLINE)
    assert python is not None and "made" in note
    assert not (venv / "left-by-the-first-fill").exists()


def test_a_failed_install_is_a_note_and_is_tried_again(tmp_path: Path, requirements: Path) -> None:
    venv = tmp_path / "peers"
    requirements.write_text("dsh-no-such-package-anywhere==1.0\n", encoding="utf-8")
    python, note = peers_env.ensure_peers_python(venv, requirements, OFFLINE)
    assert python is None
    assert f"could not make the peers' venv {venv}" in note and "pip" in note
    assert "dsh-no-such-package-anywhere" in note  # pip's own words, which name the culprit
    assert not (venv / peers_env.STAMP).exists()
    requirements.write_text("# fixed\n", encoding="utf-8")
    python, note = peers_env.ensure_peers_python(venv, requirements, OFFLINE)
    assert python is not None, note


def test_never_removes_a_directory_it_did_not_make(tmp_path: Path, requirements: Path) -> None:
    venv = tmp_path / "someone-elses"
    venv.mkdir()
    (venv / "keep.txt").write_text("mine", encoding="utf-8")
    python, note = peers_env.ensure_peers_python(venv, requirements, OFFLINE)
    assert python is None
    assert f"{venv} exists and was not made by peers_env.py" in note
    assert (venv / "keep.txt").read_text(encoding="utf-8") == "mine"


def test_the_venv_path_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DSH_BENCH_VENV", str(tmp_path / "elsewhere"))
    assert peers_env.default_venv() == tmp_path / "elsewhere"
    monkeypatch.delenv("DSH_BENCH_VENV")
    assert peers_env.default_venv() == ROOT / ".bench-venv"


def test_the_pinned_file_pins_every_peer_exactly() -> None:
    lines = [
        line
        for line in peers_env.REQUIREMENTS.read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#")
    ]
    assert all("==" in line for line in lines), lines
    names = {line.split("==")[0].lower() for line in lines}
    assert {"smolagents", "pydantic-monty", "bpe-openai"} <= names
