"""The suite ``pytest --dsh-conformance=NAME`` collects: the base class, fed by command-line options."""

from __future__ import annotations

from typing import Any

import pytest

from dsh_core.testing.conformance import ToolPluginConformance
from dsh_core.testing.pytest_plugin import config_for

__all__ = ["TestDshConformance"]


class TestDshConformance(ToolPluginConformance):
    """Runs every check on each ``--dsh-conformance`` name (parametrized by the pytest plugin)."""

    @pytest.fixture
    def plugin_config(self, request: pytest.FixtureRequest, dsh_plugin_name: str) -> dict[str, Any]:
        """``--dsh-conformance-config NAME=JSON`` for this name, else a bare ``--dsh-conformance-config JSON``,
        else ``{}`` (the values were vetted when pytest started)."""
        return config_for(request.config, dsh_plugin_name)

    @pytest.fixture
    def dsh_abort_bound_s(self, request: pytest.FixtureRequest) -> float:
        """``--dsh-conformance-abort-bound`` seconds (default 2)."""
        return float(request.config.getoption("dsh_conformance_abort_bound"))

    @pytest.fixture
    def dsh_call_timeout_s(self, request: pytest.FixtureRequest) -> float | None:
        """``--dsh-conformance-call-timeout`` seconds (default: the kit's ``CALL_TIMEOUT_S``)."""
        value = request.config.getoption("dsh_conformance_call_timeout")
        return None if value is None else float(value)
