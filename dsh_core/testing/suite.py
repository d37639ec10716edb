"""The suite ``pytest --dsh-conformance=NAME`` collects: the base class, fed by command-line options."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dsh_core.testing.conformance import ToolPluginConformance

__all__ = ["TestDshConformance"]


class TestDshConformance(ToolPluginConformance):
    """Runs every check on each ``--dsh-conformance`` name (parametrized by the pytest plugin)."""

    @pytest.fixture
    def plugin_config(self, request: pytest.FixtureRequest) -> dict[str, Any]:
        """``--dsh-conformance-config`` (a JSON object), default ``{}``."""
        raw = request.config.getoption("dsh_conformance_config") or "{}"
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as error:
            raise pytest.UsageError(f"--dsh-conformance-config is not valid JSON: {error}") from None
        if not isinstance(config, dict):
            raise pytest.UsageError("--dsh-conformance-config must be a JSON object")
        return config

    @pytest.fixture
    def dsh_abort_bound_s(self, request: pytest.FixtureRequest) -> float:
        """``--dsh-conformance-abort-bound`` seconds (default 2)."""
        return float(request.config.getoption("dsh_conformance_abort_bound"))
