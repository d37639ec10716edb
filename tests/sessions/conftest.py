"""Agent tests never touch ~/.dsh."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _private_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSH_HOME", str(tmp_path / "dsh-home"))
    monkeypatch.delenv("DSH_TOOLS_MODE", raising=False)
    monkeypatch.delenv("DSH_BASE_URL", raising=False)
